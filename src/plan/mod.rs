//! The one validation table and the lowering of accepted requests into plans.
//!
//! [`decide`] is the table: for a profile and a [`Cell`] (pool kind, operation, layout, io
//! backend) it returns the path sglang would run (named after its op) or the error sglang
//! raises, verbatim. [`HostPool::plan`](crate::HostPool::plan) checks one call in sglang's order
//! (in the order listed under "Order of checks" below) and lowers it into a [`Plan`]: plain data that every executor runs the same
//! way. Executors never decide support; their limits reach this module as [`Capabilities`].
//!
//! # Order of checks
//! sglang's pool code checks a call in this order, and so does the planner, so that the same
//! call fails with the same message:
//! 1. layers: a load of a layer this rank does not own, or of a DSA skip-topk layer, is a no-op
//!    before anything else is looked at; a layer id the model does not have, or a draft id past
//!    the drafts, is an error;
//! 2. DSA indexer: token indices become pages (`Index buffer transfer expects page-aligned
//!    indices for DSA.` when a list is not a whole number of pages), before the table;
//! 3. the table ([`decide`]): layout and io backend;
//! 4. the launcher checks: equal lengths, the `kernel` word (item, then per-head chunk), the
//!    `direct` page multiple;
//! 5. an empty call is a no-op;
//! 6. hicache-io's own checks: index ranges, whole pages, unique destinations, executor
//!    capabilities.
//!
//! Plans are unforgeable: only this module builds them, their fields are private, and a plan
//! runs only on the executor instance and pools it was made for.
//!
//! Rooms: `capabilities` (what an executor can address, the `auto` table), `table` ([`decide`]:
//! one screen of rules), `types` (plans, steps, runs, requests), `planner` (the entry: checks in
//! sglang's order, then lowering), `device_lists` (index lists checked on the device),
//! `footprint` (what a call touches, for a pipeline's ordering), `checks` (index checks),
//! `lower` (gathers and coalesced runs), `int` (integer helpers).

mod capabilities;
mod checks;
mod device_lists;
mod footprint;
mod int;
mod lower;
mod planner;
mod table;
mod tuning;
mod types;

pub use capabilities::*;
pub use device_lists::*;
pub use int::*;
pub use lower::coalesce;
pub use table::*;
pub use tuning::{LaunchTuning, MAX_BLOCK_QUOTA};
pub use types::*;

pub(crate) use footprint::{Claim, Footprint};
pub(crate) use planner::plan;
pub(crate) use types::layers_of;

use checks::*;
use lower::*;
use planner::*;

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::error::TransferError;
    use crate::geometry::{IoBackend, LayerMap, Layout, PoolKind, PoolPair, Profile};

    #[test]
    fn a_repeated_destination_is_named_at_its_first_repeat() {
        // Skipped pairs (-1) never count; the error names the earliest entry that repeats one
        // before it, whichever value repeats first.
        let hi = [0, 1, 2, 3, 4, -1, 6];
        let di = [5, 7, 8, 7, 5, 8, 7];
        match checks::check_unique("device", &di, &hi, &di, 16, "slots", false) {
            Err(TransferError::DuplicateDestination { index: 7, first: 1, second: 3, .. }) => {}
            other => panic!("{other:?}"),
        }
        assert!(checks::check_unique("device", &[5, 7, 8], &[0, 1, -1], &[5, 7, 8], 16, "slots", false).is_ok());
    }

    #[test]
    fn auto_default_rule_and_nearest_cells() {
        let t = AutoTable::DEFAULT;
        assert_eq!(t.choose(1, 128.0 as u64, 1.0), IoBackend::Kernel);
        assert_eq!(t.choose(1, 8448, 1.0), IoBackend::Direct);
        assert_eq!(t.choose(8, 1152, 64.0), IoBackend::Direct);
        assert_eq!(t.choose(8, 1152, 2.0), IoBackend::Kernel);
        assert!((mean_run(&[0, 1, 2, 9], &[5, 6, 7, 1]) - 2.0).abs() < 1e-9);
        assert!((mean_run(&[0, -1, 2], &[0, 1, 2]) - 1.0).abs() < 1e-9);
    }

    /// `auto` answers a wrong call with the same error whichever path the calibration prefers.
    #[test]
    fn auto_answers_a_wrong_call_alike_whatever_the_calibration() {
        let dc =
            crate::pool::DevicePoolConfig { kind: PoolKind::Mla, bytes_per_token: 64, slots: 64, page_size: 4, layers: LayerMap::new(2) };
        let pair = Arc::new(PoolPair::new(dc.geometry().unwrap(), Layout::LayerFirst, 64, 1).unwrap());
        let op = Op::Load { layer_id: 0, is_draft: false };
        let calls: [(Vec<i64>, Vec<i64>); 2] = [(vec![0, 1], vec![2, 64]), ((0..8).collect(), vec![8, 9, 10, 11, 12, 13, 14, 8])];
        let answers = |direct: bool| -> Vec<String> {
            let caps = Capabilities { auto: AutoTable { direct: [[[direct; 4]; 6]; 2], calibrated: true }, ..Capabilities::UNLIMITED };
            assert_eq!(caps.auto.choose(1, 64, 8.0), if direct { IoBackend::Direct } else { IoBackend::Kernel });
            calls
                .iter()
                .map(|(hi, di)| {
                    let req = Request { op, io_backend: IoBackend::Auto, host_indices: hi, device_indices: di };
                    plan(Profile::Extended, &caps, 1, &pair, &req).unwrap_err().to_string()
                })
                .collect()
        };
        let (k, d) = (answers(false), answers(true));
        assert_eq!(k, d);
        assert!(k[0].contains("64") && k[0].contains("device"), "{}", k[0]);
        assert!(k[1].contains("written twice") || k[1].to_lowercase().contains("duplicate"), "{}", k[1]);
    }

    /// An item wider than the executor's summing copies can sum is refused by the planner, on a
    /// pool with checksums, before any step is issued (cuda once found it at launch, after the
    /// steps before had been enqueued); without checksums it moves.
    #[test]
    fn checksummed_items_wider_than_the_summing_copies_are_refused_when_planned() {
        let caps = Capabilities { checksums: true, max_checksum_item_words: 1 << 20, ..Capabilities::UNLIMITED };
        let plan_of = |item: u64| {
            let dc = crate::pool::DevicePoolConfig {
                kind: PoolKind::Mla,
                bytes_per_token: item,
                slots: 4,
                page_size: 1,
                layers: LayerMap::new(3),
            };
            let pair = Arc::new(PoolPair::new(dc.geometry().unwrap(), Layout::LayerFirst, 4, 1).unwrap());
            let req = Request { op: Op::Backup, io_backend: IoBackend::Kernel, host_indices: &[0, 1], device_indices: &[2, 3] };
            plan(Profile::Extended, &caps, 1, &pair, &req).unwrap()
        };
        assert!(plan_of(4 << 20).with_checksums(true, &caps).unwrap().is_checksummed());
        match plan_of((4 << 20) + 4).with_checksums(true, &caps) {
            Err(TransferError::ExecutorLimit { value, limit: 1048576, .. }) => assert_eq!(value, (1 << 20) + 1),
            other => panic!("{other:?}"),
        }
        assert!(!plan_of((4 << 20) + 4).with_checksums(false, &caps).unwrap().is_checksummed());
    }

    #[test]
    fn coalescing_like_transfer_kv_direct() {
        assert_eq!(coalesce(&[0, 1, 2, 7, 8], &[10, 11, 5, 6, 7]), vec![(0, 10, 2), (2, 5, 1), (7, 6, 2)]);
        assert_eq!(coalesce(&[0, -1, 2, 3], &[0, 1, 2, 3]), vec![(0, 0, 1), (2, 2, 2)]);
    }

    /// A `direct` step keeps one list of spans for every layer: its runs, expanded to items,
    /// are the naive per-(component, layer, index pair) copies (merging pages that lie end to
    /// end changes no byte), and `run`, `runs_in` and `pieces` agree on every range.
    #[test]
    fn direct_steps_are_the_per_item_copies_of_every_layer() {
        for (layout, page, host_slots) in [(Layout::LayerFirst, 1u64, 48u64), (Layout::PageFirstDirect, 4, 48)] {
            let dc = crate::pool::DevicePoolConfig {
                kind: PoolKind::Mha,
                bytes_per_token: 16,
                slots: 32,
                page_size: page,
                layers: LayerMap::new(3),
            };
            let pair = Arc::new(PoolPair::new(dc.geometry().unwrap(), layout, host_slots, 1).unwrap());
            // Pages 1, 2 (adjacent on both sides), 7 and a skipped one; tokens within them.
            let pages: [(i64, i64); 4] = [(1, 3), (2, 4), (7, 0), (-1, 5)];
            let expand = |p: i64| -> Vec<i64> { (0..page as i64).map(|t| if p < 0 { -1 } else { p * page as i64 + t }).collect() };
            let hi: Vec<i64> = pages.iter().flat_map(|&(h, _)| expand(h)).collect();
            let di: Vec<i64> = pages.iter().flat_map(|&(_, d)| expand(d)).collect();
            for op in [Op::Backup, Op::Load { layer_id: 1, is_draft: false }] {
                let req = Request { op, io_backend: IoBackend::Direct, host_indices: &hi, device_indices: &di };
                let plan = plan(Profile::Extended, &Capabilities::UNLIMITED, 1, &pair, &req).unwrap();
                let (host, dev) = (pair.host(), pair.device());
                let layers: Vec<u64> = if matches!(op, Op::Backup) { vec![0, 1, 2] } else { vec![1] };
                let mut want = Vec::new();
                for c in 0..2u8 {
                    for &l in &layers {
                        for (&h, &d) in hi.iter().zip(&di).filter(|(h, d)| **h >= 0 && **d >= 0) {
                            let (ha, da) = (host.addr(c, l), dev.addr(c, l as u32, 1));
                            let (hs, ds) = ((ha.buf(), ha.offset(h as u64, 0)), (da.buf(), da.offset(d as u64, 0)));
                            want.push(if matches!(op, Op::Backup) { (ds, hs) } else { (hs, ds) });
                        }
                    }
                }
                let mut got = Vec::new();
                for step in plan.steps() {
                    let StepKind::Copy(c) = step.kind() else { panic!("a direct plan has copy steps") };
                    let runs: Vec<Run> = c.runs().collect();
                    assert_eq!(runs.len(), c.len());
                    for lo in 0..=c.len() {
                        for hi in lo..=c.len() + 1 {
                            assert_eq!(c.runs_in(lo, hi).collect::<Vec<_>>(), runs[lo..hi.min(c.len())].to_vec());
                            let pieces: Vec<Run> = c
                                .pieces(lo, hi)
                                .flat_map(|(p, spans)| spans.iter().map(move |s| (p, *s)))
                                .map(|(p, s)| {
                                    let k = p * c.spans().len() + c.spans().iter().position(|x| *x == s).unwrap();
                                    c.run(k).unwrap()
                                })
                                .collect();
                            assert_eq!(pieces, runs[lo..hi.min(c.len())].to_vec());
                        }
                    }
                    assert!(c.run(c.len()).is_none());
                    for r in runs {
                        let item = r.len / r.items;
                        got.extend((0..r.items).map(|k| ((r.src, r.src_offset + k * item), (r.dst, r.dst_offset + k * item))));
                    }
                }
                let key = |x: &((crate::geometry::BufRef, u64), (crate::geometry::BufRef, u64))| format!("{x:?}");
                want.sort_by_key(key);
                got.sort_by_key(key);
                assert_eq!(got, want, "{layout:?} {op:?}");
            }
        }
    }

    #[test]
    fn whole_pages_near_the_integer_limit() {
        assert!(check_whole_pages("host", &[i64::MAX - 3, i64::MAX - 2, i64::MAX - 1, i64::MAX], 4).is_ok());
        // (2^63 - 2) is a multiple of 3 whose page would end past i64::MAX.
        assert!(check_whole_pages("host", &[i64::MAX - 1, 0, 0], 3).is_err());
        // Interior entries count, not only the first and last.
        assert!(check_whole_pages("host", &[4, 6, 5, 7], 4).is_err());
        assert!(check_whole_pages("host", &[-1, 2, -1, -1], 4).is_err());
        assert!(check_whole_pages("host", &[4, 5, 6, 7, -1, -1, -1, -1], 4).is_ok());
    }

    #[test]
    fn ranges_at_the_integer_limits() {
        use checks::check_range;
        let out = |idx: &[i64], bound: u64| match check_range("host", idx, bound, "slots") {
            Ok(_) => None,
            Err(TransferError::IndexOutOfRange { position, .. }) => Some(position),
            Err(e) => panic!("{e:?}"),
        };
        // Negative entries (skipped pairs) are never out, however negative.
        assert_eq!(out(&[i64::MIN, -1, 0, 9], 10), None);
        assert_eq!(out(&[i64::MIN, -1, 10, 9], 10), Some(2));
        assert_eq!(out(&[0], 0), Some(0));
        assert_eq!(out(&[-1, i64::MIN], 0), None);
        assert_eq!(out(&[3, i64::MAX, i64::MAX - 1], i64::MAX as u64), Some(1));
        assert_eq!(out(&[3, i64::MAX - 1], i64::MAX as u64), None);
        // No i64 reaches a bound past i64::MAX.
        assert_eq!(out(&[i64::MAX, 0, i64::MIN], 1 << 63), None);
        assert_eq!(out(&[i64::MAX, 0, i64::MIN], u64::MAX), None);
        // The first out entry is named, past a vector's width.
        let mut v: Vec<i64> = (0..37).collect();
        v[21] = 40;
        v[30] = 50;
        assert_eq!(out(&v, 40), Some(21));
        assert_eq!(out(&v, 41), Some(30));
        assert_eq!(out(&v, 51), None);
        // In range, it says whether no pair is skipped (the uniqueness pass then reads one list).
        for bound in [51, 1 << 63, u64::MAX] {
            assert!(check_range("host", &v, bound, "slots").unwrap(), "{bound}");
            v[33] = -1;
            assert!(!check_range("host", &v, bound, "slots").unwrap(), "{bound}");
            v[33] = 33;
        }
    }

    #[test]
    fn the_one_pass_check_accepts_exactly_the_calls_the_full_checks_accept() {
        // The oracle: both lists in range and non-negative, destinations distinct.
        let full = |src: &[i64], sb: u64, dst: &[i64], db: u64| {
            let inside = |l: &[i64], b: u64| l.iter().all(|&x| x >= 0 && (x as u64) < b);
            let distinct = dst.iter().collect::<std::collections::HashSet<_>>().len() == dst.len();
            (inside(src, sb) && inside(dst, db) && distinct).then_some(dst.len() as u64)
        };
        let mut rng = crate::rng::Rng::new(11);
        for case in 0..6000 {
            // Pools of about 40 slots take a byte map; of about 2^18, a bitmap.
            let big = case % 2 == 1;
            let scale = if big { 1 << 18 } else { 40 };
            let n = 1 + rng.below(70) as usize;
            let (sb, db) = (scale + rng.below(3), scale + rng.below(3));
            // Past the bound, also inside the bitmap's last word.
            let bad = [-1, i64::MIN, i64::MAX, db as i64, db as i64 + 1, (db | 63) as i64, 1 << 32];
            let mut src: Vec<i64> = (0..n).map(|_| rng.below(sb) as i64).collect();
            let mut dst: Vec<i64> = (0..n as i64).map(|i| (i * 7 + case) % db as i64).collect();
            dst.truncate(db as usize);
            src.truncate(dst.len());
            // Up to two faults anywhere (past a vector's width too): a bad entry or a repeat.
            for _ in 0..rng.below(3) {
                let (list, at) = (rng.below(3), rng.below(dst.len() as u64) as usize);
                match list {
                    0 => src[at] = bad[rng.below(bad.len() as u64) as usize],
                    1 => dst[at] = bad[rng.below(bad.len() as u64) as usize],
                    _ => dst[at] = dst[rng.below(dst.len() as u64) as usize],
                }
            }
            assert_eq!(distinct_in_range(&src, sb, &dst, db), full(&src, sb, &dst, db), "{src:?} < {sb}, {dst:?} < {db}");
        }
        // Pools too large for a bitmap go the full way.
        assert_eq!(distinct_in_range(&[0, 1], 4, &[0, 1], 1 << 40), None);
    }

    #[test]
    fn duplicates_are_found_with_a_byte_map_a_bitmap_and_a_sort() {
        let (hi, di) = ([0i64, 1, 2, 3], [5i64, 9, 5, 7]);
        // 10 slots: a byte map; 2^18: a bitmap; 2^50: a sort.
        for bound in [10, 1 << 18, 1 << 50] {
            for all_live in [false, true] {
                let e = check_unique("device", &di, &hi, &di, bound, "slots", all_live).unwrap_err();
                assert!(matches!(e, TransferError::DuplicateDestination { first: 0, second: 2, .. }), "{bound}: {e:?}");
            }
            assert_eq!(check_unique("device", &[5, 9, 7, 0], &hi, &[5, 9, 7, 0], bound, "slots", true).unwrap(), 4, "{bound}");
            // Live pairs are counted on the way; a skipped pair frees its destination.
            let hi2 = [0i64, 1, -1, 3];
            assert_eq!(check_unique("device", &di, &hi2, &di, bound, "slots", false).unwrap(), 3, "{bound}");
        }
    }

    #[test]
    fn direct_spans_are_the_coalesced_runs_with_or_without_a_run_to_carry() {
        // layer_first pages lie end to end (runs merge): scattered all-live lists take the pass
        // that writes a span a pair; a join early or late, or a skipped pair, take the
        // run-carrying pass. Every one must give transfer_kv_direct's coalesced runs.
        let dc =
            crate::pool::DevicePoolConfig { kind: PoolKind::Mha, bytes_per_token: 16, slots: 4096, page_size: 1, layers: LayerMap::new(2) };
        let pair = Arc::new(PoolPair::new(dc.geometry().unwrap(), Layout::LayerFirst, 4096, 1).unwrap());
        let n = 200i64;
        let scattered =
            || -> (Vec<i64>, Vec<i64>) { ((0..n).map(|i| (i * 37 + 11) % 4096).collect(), (0..n).map(|i| (i * 53 + 7) % 4096).collect()) };
        let mut cases = vec![scattered()];
        for at in [3usize, 100, 199] {
            let (mut hi, mut di) = scattered();
            (hi[at], di[at]) = (hi[at - 1] + 1, di[at - 1] + 1);
            cases.push((hi, di));
        }
        let (mut hi, di) = scattered();
        hi[50] = -1;
        cases.push((hi, di));
        for (k, (hi, di)) in cases.iter().enumerate() {
            let req = Request {
                op: Op::Load { layer_id: 1, is_draft: false },
                io_backend: IoBackend::Direct,
                host_indices: hi,
                device_indices: di,
            };
            let plan = plan(Profile::Extended, &Capabilities::UNLIMITED, 1, &pair, &req).unwrap();
            let want: Vec<(u64, u64, u64)> = lower::coalesce(hi, di);
            assert_eq!(want.len(), if k == 0 || k == 4 { hi.iter().filter(|&&h| h >= 0).count() } else { n as usize - 1 }, "case {k}");
            for step in plan.steps() {
                let StepKind::Copy(c) = step.kind() else { panic!("a direct plan has copy steps") };
                let got: Vec<(u64, u64, u64)> = c.spans().iter().map(|s| (s.host_unit, s.device_unit, s.items)).collect();
                assert_eq!(got, want, "case {k}");
            }
        }
    }
}
