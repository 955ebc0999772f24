//! Lowering: gathers (address pairs, lanes) for `kernel`, coalesced runs for `direct`.

use std::sync::Arc;

use super::*;
use crate::geometry::{DeviceGeometry, HostGeometry, Layout};

/// Lanes per item (log2) of a gather of `heads` chunks of `chunk` bytes: the adapter's policy for
/// the chunk's words (`caps.max_lanes`), raised where one invocation would run more loop
/// iterations than `caps.max_loop_trips` (per head, its words per lane plus one, counted in the
/// executor's smallest word, which it may fall back to); `None` when no lane count fits.
pub(super) fn gather_lanes(caps: &Capabilities, chunk: u64, heads: u64) -> Option<u32> {
    let words = chunk / if chunk.is_multiple_of(16) { 16 } else { caps.kernel_word.max(1) };
    let mut log2 = words.max(1).next_power_of_two().min(caps.max_lanes.max(1).next_power_of_two()).trailing_zeros();
    if caps.max_loop_trips == u64::MAX {
        return Some(log2);
    }
    let narrow = (chunk / caps.kernel_word.max(1)).max(1);
    let trips = |l: u32| heads.saturating_mul(narrow.div_ceil(1u64 << l).saturating_add(1));
    while trips(log2) > caps.max_loop_trips {
        if 1u64 << log2 >= narrow {
            return None;
        }
        log2 += 1;
    }
    Some(log2)
}

/// `kernel` steps: one per layer group, each split into pieces of at most
/// `caps.max_gather_items` index pairs (destinations are unique, so the split changes no byte).
/// `live`: the pairs with both indices non-negative (counted by the checks).
#[allow(clippy::too_many_arguments)]
pub(super) fn lower_gather(
    host: &HostGeometry,
    dev: &DeviceGeometry,
    caps: &Capabilities,
    direction: Direction,
    layer_groups: &[Vec<(u64, u32)>],
    hi: Arc<[i64]>,
    di: Arc<[i64]>,
    live: u64,
) -> (Vec<Step>, u64) {
    let heads = host.head_num();
    let comps = host.kind().components() as u8;
    let (src, dst) = match direction {
        Direction::HostToDevice => (hi, di),
        Direction::DeviceToHost => (di, hi),
    };
    // The gather's shape (checked by `check_indices`), and at most 2^31 invocations a step.
    let lanes_log2 = gather_lanes(caps, host.chunk_bytes(), heads).unwrap_or(0);
    let per = usize::try_from(caps.max_gather_items.min((1u64 << 31) >> lanes_log2).max(1)).unwrap_or(usize::MAX);
    let pieces: Vec<[Arc<[i64]>; 2]> = if src.len() <= per {
        vec![[src, dst]]
    } else {
        src.chunks(per).zip(dst.chunks(per)).map(|(s, d)| [Arc::from(s), Arc::from(d)]).collect()
    };
    let mut steps = Vec::with_capacity(layer_groups.len() * pieces.len());
    let mut layer_count = 0u64;
    for layers in layer_groups {
        let mut pairs = Vec::with_capacity(layers.len() * comps as usize);
        let mut items = Vec::with_capacity(layers.len() * comps as usize);
        for &(hl, ds) in layers {
            for c in 0..comps {
                items.push((hl, c));
                let (h, d) = (host.addr(c, hl), dev.addr(c, ds, heads));
                pairs.push(match direction {
                    Direction::HostToDevice => AddrPair { src: h, dst: d },
                    Direction::DeviceToHost => AddrPair { src: d, dst: h },
                });
            }
        }
        layer_count += layers.len() as u64;
        for [s, d] in &pieces {
            steps.push(Step {
                kind: StepKind::Gather(GatherStep {
                    src_indices: s.clone(),
                    dst_indices: d.clone(),
                    device_lists: None,
                    chunk_bytes: host.chunk_bytes(),
                    heads,
                    pairs: pairs.clone(),
                    items: items.clone(),
                    checksum: None,
                    lanes_log2,
                }),
                layers: layers.iter().map(|l| l.0).collect(),
                checksum: None,
                unsummed: None,
            });
        }
    }
    (steps, live * layer_count * comps as u64 * host.item_bytes())
}

/// `direct` steps: runs of consecutive (host, device) pairs (`transfer_kv_direct`), or whole
/// pages for page_first_direct (only the first index of each page is read), one step per layer
/// group, layer by layer within it (each pass stays in one layer's buffers; destinations are
/// unique, so the order changes no byte). Every step shares one list of spans.
pub(super) fn lower_direct(
    host: &HostGeometry,
    dev: &DeviceGeometry,
    direction: Direction,
    layer_groups: &[Vec<(u64, u32)>],
    hi: &[i64],
    di: &[i64],
    live: u64,
) -> (Vec<Step>, u64) {
    let group = host.index_page_size();
    let comps = host.kind().components() as u8;
    let host_to_device = direction == Direction::HostToDevice;
    // Per layer group: its address pairs and their host items.
    type Pairs = (Vec<AddrPair>, Vec<(u64, u8)>);
    let groups: Vec<Pairs> = layer_groups
        .iter()
        .map(|layers| {
            let mut pairs = Vec::with_capacity(layers.len() * comps as usize);
            let mut items = Vec::with_capacity(layers.len() * comps as usize);
            for c in 0..comps {
                for &(hl, ds) in layers {
                    let (h, d) = (host.addr(c, hl), dev.addr(c, ds, 1));
                    pairs.push(if host_to_device { AddrPair { src: h, dst: d } } else { AddrPair { src: d, dst: h } });
                    items.push((hl, c));
                }
            }
            (pairs, items)
        })
        .collect();
    // Spans that continue each other in both buffers (page_first_direct pages that lie end to
    // end) become one copy. Whether they do depends on an address's strides, not on its base
    // (the layer), so the first pair decides for all when every pair has its strides.
    let shape = |a: &crate::geometry::Addr| (a.page, a.page_stride, a.row_stride, a.head_stride);
    let all = || groups.iter().flat_map(|g| &g.0);
    let first = all().next().copied();
    let merge_by = first.filter(|f| all().all(|p| shape(&p.src) == shape(&f.src) && shape(&p.dst) == shape(&f.dst)));
    let item_bytes = host.item_bytes();
    // One pass, appending each page or live pair to the last span where it continues it in
    // both units and bytes (units are range-checked, so the sums cannot overflow).
    let (spans, moved) = if host.layout() == Layout::PageFirstDirect && group > 1 {
        // One span per page group, from the group's first index (groups of one are pairs).
        let g = group as usize;
        let pages = hi.iter().step_by(g).zip(di.iter().step_by(g)).take(hi.len() / g);
        let live = pages.filter(|(h, d)| **h >= 0 && **d >= 0).map(|(h, d)| (*h as u64, *d as u64, group));
        build_spans(live, hi.len() / g, merge_by, item_bytes, host_to_device)
    } else if let Some(spans) = (live == hi.len() as u64).then(|| unit_spans(Merge::new(merge_by, item_bytes), hi, di)).flatten() {
        (spans, live)
    } else {
        let live = hi.iter().zip(di).filter(|(h, d)| **h >= 0 && **d >= 0).map(|(h, d)| (*h as u64, *d as u64, 1));
        build_spans(live, hi.len(), merge_by, item_bytes, host_to_device)
    };
    let moved = moved * item_bytes;
    let spans: Arc<Vec<Span>> = Arc::new(spans);
    let mut bytes = 0;
    let steps = layer_groups
        .iter()
        .zip(groups)
        .map(|(layers, (pairs, items))| {
            bytes += moved * pairs.len() as u64;
            Step {
                kind: StepKind::Copy(CopyStep { pairs, items, spans: spans.clone(), item_bytes, host_to_device }),
                layers: layers.iter().map(|l| l.0).collect(),
                checksum: None,
                unsummed: None,
            }
        })
        .collect();
    (steps, bytes)
}

/// The spans of an all-live list where every pair is a span of its own: no pair continues the
/// one before it in both units (scattered lists), or continuing ones never merge; `None`
/// otherwise. One pass with no run to carry: writes a span per pair and counts the pairs that
/// continue their predecessor (the run-carrying loop took twice as long a pair).
fn unit_spans(merge: Merge, hi: &[i64], di: &[i64]) -> Option<Vec<Span>> {
    let joins_at = |k: usize| hi[k] == hi[k - 1].wrapping_add(1) && di[k] == di[k - 1].wrapping_add(1);
    let count = match merge {
        Merge::Never => false,
        // Lists with runs mostly show one early: they go to the run-carrying pass at once.
        Merge::Always if (1..hi.len().min(di.len()).min(16)).any(joins_at) => return None,
        Merge::Always => true,
        Merge::Check(_) => return None,
    };
    // Units are non-negative: `i64::MIN + 1` continues none.
    let (mut ph, mut pd, mut joins) = (i64::MIN, i64::MIN, 0u64);
    let spans: Vec<Span> = hi
        .iter()
        .zip(di)
        .map(|(&h, &d)| {
            joins += (((h.wrapping_sub(ph) ^ 1) | (d.wrapping_sub(pd) ^ 1)) == 0) as u64;
            (ph, pd) = (h, d);
            Span { host_unit: h as u64, device_unit: d as u64, items: 1 }
        })
        .collect();
    (!count || joins == 0).then_some(spans)
}

/// The spans of a `direct` step, built in one pass: each page or live pair `(host unit, device
/// unit, items)` extends the current span where it continues it in both units and bytes, else
/// starts the next. The current span lives in locals (kept in an `Option` or in the vector's
/// last element it cost a store and reload per pair). Returns the spans and the items they hold.
/// Units are range-checked, so the sums cannot overflow.
fn build_spans(
    pairs: impl Iterator<Item = (u64, u64, u64)>,
    capacity: usize,
    merge_by: Option<AddrPair>,
    item_bytes: u64,
    host_to_device: bool,
) -> (Vec<Span>, u64) {
    let mut spans: Vec<Span> = Vec::with_capacity(capacity);
    let out = spans.spare_capacity_mut();
    // One loop per merge rule, so the common ones carry no per-run offset code (it cost the
    // loop its registers: spills on every pair).
    let (at, moved) = match Merge::new(merge_by, item_bytes) {
        Merge::Never => fill_spans(pairs, out, |_| false),
        Merge::Always => fill_spans(pairs, out, |_| true),
        Merge::Check(p) => fill_spans(pairs, out, |[ch, cd, cn, h, d]| {
            let len = cn * item_bytes;
            let ((s0, t0), (s1, t1)) = if host_to_device { ((ch, cd), (h, d)) } else { ((cd, ch), (d, h)) };
            p.src.offset(s0, 0) + len == p.src.offset(s1, 0) && p.dst.offset(t0, 0) + len == p.dst.offset(t1, 0)
        }),
    };
    // SAFETY: `fill_spans` wrote the first `at` elements of the spare capacity.
    unsafe { spans.set_len(at) };
    (spans, moved)
}

/// [`build_spans`]' pass: writes the spans into `out` by position (`push` re-checked the
/// capacity and kept the length in memory, a store and reload per pair) and returns how many,
/// and the items they hold. `joins([ch, cd, cn, h, d])`: whether pair `(h, d)`, which continues
/// span `(ch, cd, cn)` in units, continues it in bytes. Not inlined: inside `lower_direct` the
/// loop lost its registers to the caller's locals (spills on every pair).
#[inline(never)]
fn fill_spans(
    pairs: impl Iterator<Item = (u64, u64, u64)>,
    out: &mut [std::mem::MaybeUninit<Span>],
    joins: impl Fn([u64; 5]) -> bool,
) -> (usize, u64) {
    let mut at = 0usize;
    let (mut ch, mut cd, mut cn, mut moved) = (0u64, 0u64, 0u64, 0u64);
    for (h, d, n) in pairs {
        moved += n;
        if cn > 0 && ch + cn == h && cd + cn == d && joins([ch, cd, cn, h, d]) {
            cn += n;
            continue;
        }
        if cn > 0 {
            // At most one span per pair: the capacity covers every pair.
            out[at].write(Span { host_unit: ch, device_unit: cd, items: cn });
            at += 1;
        }
        (ch, cd, cn) = (h, d, n);
    }
    if cn > 0 {
        out[at].write(Span { host_unit: ch, device_unit: cd, items: cn });
        at += 1;
    }
    (at, moved)
}

/// Whether runs that continue a span in units continue it in bytes: decided once from the
/// strides where they say it for every position (`Always`, `Never`), else per run (`Check`:
/// paged addresses whose pages are not end to end).
enum Merge {
    Never,
    Always,
    Check(AddrPair),
}

impl Merge {
    fn new(merge_by: Option<AddrPair>, item_bytes: u64) -> Merge {
        let Some(p) = merge_by else { return Merge::Never };
        // An address is `base + unit · item_bytes` at every unit: one page or rows and pages
        // end to end.
        let linear = |a: &crate::geometry::Addr| {
            (a.page == 1 && a.page_stride == item_bytes)
                || (a.page > 1 && a.row_stride == item_bytes && a.page.checked_mul(item_bytes) == Some(a.page_stride))
        };
        // Unpaged with another stride: units never continue in bytes.
        let never = |a: &crate::geometry::Addr| a.page == 1 && a.page_stride != item_bytes;
        if linear(&p.src) && linear(&p.dst) {
            Merge::Always
        } else if never(&p.src) || never(&p.dst) {
            Merge::Never
        } else {
            Merge::Check(p)
        }
    }
}

/// `transfer_kv_direct` coalescing: maximal runs where both indices step by one; negative
/// entries break runs and are skipped. Returns (host start, device start, length).
pub fn coalesce(hi: &[i64], di: &[i64]) -> Vec<(u64, u64, u64)> {
    let mut out = Vec::new();
    let mut i = 0;
    let n = hi.len();
    while i < n {
        if hi[i] < 0 || di[i] < 0 {
            i += 1;
            continue;
        }
        let start = i;
        while i + 1 < n && hi[i + 1] >= 0 && di[i + 1] >= 0 && hi[i + 1] - hi[i] == 1 && di[i + 1] - di[i] == 1 {
            i += 1;
        }
        out.push((hi[start] as u64, di[start] as u64, (i + 1 - start) as u64));
        i += 1;
    }
    out
}
