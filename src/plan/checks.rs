//! hicache-io's own index checks: ranges, whole pages, unique destinations.

use super::*;
use crate::error::{Result, TransferError};
use crate::geometry::{DeviceGeometry, HostGeometry, IoBackend, Layout, PoolKind};

/// hicache-io's own checks: ranges, whole pages, unique destinations, executor limits. Returns
/// the live pairs (both indices non-negative), which the uniqueness pass counts on the way.
pub(super) fn check_indices(
    host: &HostGeometry,
    dev: &DeviceGeometry,
    caps: &Capabilities,
    direction: Direction,
    io: IoBackend,
    hi: &[i64],
    di: &[i64],
) -> Result<u64> {
    let unit = if host.kind() == PoolKind::DsaIndexer { "pages" } else { "slots" };
    let (dst_side, dst_list, dst_bound, src_list, src_bound) = match direction {
        Direction::HostToDevice => ("device", di, dev.slots(), hi, host.slots()),
        Direction::DeviceToHost => ("host", hi, host.slots(), di, dev.slots()),
    };
    // A call that passes both checks passes them in one pass fewer; any other is checked again
    // in full, so that its error (and which comes first) is the same.
    let fast = distinct_in_range(src_list, src_bound, dst_list, dst_bound);
    let all_live = fast.is_some() || check_range("host", hi, host.slots(), unit)? & check_range("device", di, dev.slots(), unit)?;
    let group = host.index_page_size();
    if io == IoBackend::Direct && host.layout() == Layout::PageFirstDirect && group > 1 {
        check_whole_pages("host", hi, group)?;
        check_whole_pages("device", di, group)?;
    }
    let live = match fast {
        Some(live) => live,
        None => check_unique(dst_side, dst_list, hi, di, dst_bound, unit, all_live)?,
    };
    match io {
        IoBackend::Direct | IoBackend::Auto => {
            if !host.item_bytes().is_multiple_of(caps.direct_align) {
                return Err(TransferError::Misaligned {
                    what: format!("{} direct copy item bytes", caps.name),
                    value: host.item_bytes(),
                    required: caps.direct_align,
                });
            }
        }
        IoBackend::Kernel => {
            let granule = caps.window_granule(host.chunk_bytes());
            if granule > caps.max_binding {
                return Err(TransferError::WindowTooSmall {
                    executor: caps.name,
                    chunk_bytes: host.chunk_bytes(),
                    window: caps.max_binding,
                    required: granule,
                });
            }
            if gather_lanes(caps, host.chunk_bytes(), host.head_num()).is_none() {
                return Err(TransferError::ExecutorLimit {
                    executor: caps.name,
                    what: "head chunks per item (each costs an invocation two loop iterations at least)",
                    value: host.head_num(),
                    limit: caps.max_loop_trips / 2,
                });
            }
            // Indices a gather cannot address (a pool larger than the executor's index width).
            for (side, slots) in [("host", host.slots()), ("device", dev.slots())] {
                if slots - 1 > caps.max_index {
                    let list = if side == "host" { hi } else { di };
                    if let Some(position) = list.iter().position(|&x| x >= 0 && x as u64 > caps.max_index) {
                        return Err(TransferError::IndexOutOfRange {
                            side,
                            index: list[position],
                            position,
                            bound: caps.max_index + 1,
                            unit: "slots (executor index width)",
                        });
                    }
                }
            }
        }
    }
    Ok(live)
}

/// Token indices → page indices, one per group of `p`, from the group's first token like
/// sglang (`[:, 0] // P`; negative stays negative). Whether each group really is a whole page is
/// checked later, with hicache-io's own checks, so that sglang's errors come first.
pub(super) fn to_pages(tokens: &[i64], p: u64) -> Vec<i64> {
    tokens.chunks(p as usize).map(|g| g[0].div_euclid(p as i64)).collect()
}

/// Each group of `p` must be a whole page (`k·p, k·p + 1, …, k·p + p − 1`) or all negative
/// (skipped). sglang reads only the first entry of each group and assumes the rest; every entry
/// is checked here, so that no accepted call means something other than its index list says.
/// `p` is at most 2^32 (checked by the geometry).
pub(super) fn check_whole_pages(side: &'static str, idx: &[i64], p: u64) -> Result<()> {
    let pu = p as usize;
    let pi = p as i64;
    for (g, chunk) in idx.chunks_exact(pu).enumerate() {
        let first = chunk[0];
        let ok = if first < 0 {
            chunk.iter().all(|&x| x < 0)
        } else {
            // Branch-free over the page (it vectorizes): every entry minus its position is `first`.
            first % pi == 0
                && first.checked_add(pi - 1).is_some()
                && chunk.iter().zip(0..pi).fold(0i64, |acc, (&x, k)| acc | (x.wrapping_sub(k) ^ first)) == 0
        };
        if !ok {
            return Err(TransferError::NotWholePage { side, start: first, end: chunk[pu - 1], position: g * pu, page_size: p });
        }
    }
    Ok(())
}

/// Whether every entry of `idx` is negative (a skipped pair) or below `b` (non-negative): one
/// pass of 64-bit subtract, or and and, which SSE2 has, so it vectorizes everywhere (a compare
/// per entry stays scalar without SSE4.2). `x − b` and `x` both have the sign bit set unless
/// `x ≥ b ≥ 0` (`x − b` cannot overflow for `x ≥ 0`), so the sign bit of the and of
/// `(x − b) | x` over the list is clear exactly when some entry is out.
#[inline(always)]
fn in_range_term(b: i64, x: i64) -> i64 {
    x.wrapping_sub(b) | x
}

/// Sign bits: of the and of the range terms (clear when an entry is out), of the or of the
/// entries (set when one is negative). Twice the entries a step with AVX2 where the processor has
/// it (the fold is a third of a 4096-pair plan with SSE2).
fn range_fold(idx: &[i64], b: i64) -> (i64, i64) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu_features::has_avx2() {
        // SAFETY: AVX2 is available.
        return unsafe { range_fold_avx2(idx, b) };
    }
    range_fold_portable(idx, b)
}

#[inline(always)]
fn range_fold_portable(idx: &[i64], b: i64) -> (i64, i64) {
    idx.iter().fold((-1i64, 0i64), |(acc, neg), &x| (acc & in_range_term(b, x), neg | x))
}

/// [`range_fold_portable`] compiled for AVX2.
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn range_fold_avx2(idx: &[i64], b: i64) -> (i64, i64) {
    range_fold_portable(idx, b)
}

/// Returns whether no entry is negative (no pair is skipped), found in the same pass.
pub(super) fn check_range(side: &'static str, idx: &[i64], bound: u64, unit: &'static str) -> Result<bool> {
    // Negative entries are skipped pairs; a non-negative one below 2^63 is out when it reaches
    // `bound`, and none can when `bound` exceeds every i64.
    let (b, unbounded) = match i64::try_from(bound) {
        Ok(b) => (b, false),
        Err(_) => (i64::MAX, true),
    };
    // Sign bits: of the and of the range terms (clear when one is out), of the or of the entries
    // (set when one is negative).
    let (inside, any) = range_fold(idx, b);
    if inside < 0 || unbounded {
        return Ok(any >= 0);
    }
    let out = |x: i64| x >= b;
    match idx.iter().position(|&x| out(x)) {
        Some(position) => Err(TransferError::IndexOutOfRange { side, index: idx[position], position, bound, unit }),
        None => Ok(any >= 0),
    }
}

/// `Some(live pairs)` when every entry of both lists is in range and none is negative, and the
/// destinations are distinct; `None` for any other call, and where the pool is too large for a
/// byte map or a bitmap (the full checks then run). The destination list's range check is made
/// in the map's own pass, which saves a pass over it.
pub(super) fn distinct_in_range(src: &[i64], src_bound: u64, dst: &[i64], dst_bound: u64) -> Option<u64> {
    let b = i64::try_from(src_bound).ok()?;
    let (inside, any) = range_fold(src, b);
    if inside >= 0 || any < 0 {
        return None;
    }
    let n = dst.len() as u64;
    if byte_mapped(dst_bound, dst.len()) {
        let mut seen = byte_map(usize::try_from(dst_bound).ok()?)?;
        for &d in dst {
            // An entry out of range (or negative: out as a `usize`) sets no byte, and a repeat
            // sets none anew: the list passes when as many bytes are set as it has entries.
            if let Some(s) = seen.get_mut(d as usize) {
                *s = 1;
            }
        }
        return (count_set(&seen) == n).then_some(n);
    }
    let mut seen = bitmap(dst_bound, dst.len())?;
    let mut again = 0u64;
    for &d in dst {
        // Negative entries are out as a `u64`; so are those past the bound in its last word.
        if (d as u64) >= dst_bound {
            return None;
        }
        let (w, bit) = ((d as u64 >> 6) as usize, 1u64 << (d as u64 & 63));
        let old = seen[w];
        again |= old & bit;
        seen[w] = old | bit;
    }
    (again == 0).then_some(n)
}

/// A zeroed bit a slot for `list` entries, reserved fallibly; `None` where the pool is so much
/// larger than the list that sorting the list costs less (a pool of 2^40 slots would need
/// 128 GiB of bitmap), or the memory is short.
fn bitmap(bound: u64, list: usize) -> Option<Vec<u64>> {
    let words = usize::try_from(bound.div_ceil(64)).ok()?;
    if words / 8 > list + 1024 {
        return None;
    }
    let mut seen: Vec<u64> = Vec::new();
    seen.try_reserve_exact(words).ok()?;
    seen.resize(words, 0);
    Some(seen)
}

/// A zeroed byte a slot, reserved fallibly (`vec![0; n]` aborts when memory is short).
fn byte_map(slots: usize) -> Option<Vec<u8>> {
    #[allow(clippy::slow_vector_initialization)]
    let mut seen: Vec<u8> = Vec::new();
    seen.try_reserve_exact(slots).ok()?;
    seen.resize(slots, 0);
    Some(seen)
}

/// Rejects a destination written twice by live pairs (an executor-dependent result otherwise);
/// returns the live pairs. Indices are already range-checked against `bound`; `all_live` says no
/// entry of `hi` or `di` is negative (then only `dst` is read).
pub(super) fn check_unique(
    side: &'static str,
    dst: &[i64],
    hi: &[i64],
    di: &[i64],
    bound: u64,
    unit: &'static str,
    all_live: bool,
) -> Result<u64> {
    // A byte a slot where the pool is small next to the list (clearing it costs less than the
    // pass): a plain load and store per pair, where the bitmap's shift and mask cost a fifth
    // more (4096 random pairs of 5124 slots: 2.8 against 3.9 µs).
    if let (true, Ok(slots)) = (byte_mapped(bound, dst.len()), usize::try_from(bound)) {
        if let Some(mut seen) = byte_map(slots) {
            // Stores only (a load of the byte before each store made the pass twice as long):
            // the destinations are distinct when as many bytes are set as pairs are live, which
            // one vectorized pass over the map counts.
            let mut live = 0u64;
            if all_live {
                for &d in dst {
                    seen[d as usize] = 1;
                }
                live = dst.len() as u64;
            } else {
                for ((&d, &h), &x) in dst.iter().zip(hi).zip(di) {
                    // Both non-negative (then so is `d`, one of them).
                    if (h | x) >= 0 {
                        seen[d as usize] = 1;
                        live += 1;
                    }
                }
            }
            if count_set(&seen) == live {
                return Ok(live);
            }
            return check_unique_sorted(side, dst, hi, di, unit);
        }
    }
    let Some(mut seen) = bitmap(bound, dst.len()) else {
        return check_unique_sorted(side, dst, hi, di, unit);
    };
    // One pass, one branch a pair: which entry repeats is looked for only when one does.
    let (mut again, mut live) = (0u64, 0u64);
    for ((&d, &h), &x) in dst.iter().zip(hi).zip(di) {
        let (w, bit) = ((d as u64 >> 6) as usize, 1u64 << (d as u64 & 63));
        // Both non-negative.
        if all_live || (h | x) >= 0 {
            let old = seen[w];
            again |= old & bit;
            seen[w] = old | bit;
            live += 1;
        }
    }
    if again == 0 {
        return Ok(live);
    }
    // Rare: the sort names the same first repeat a scan in order would.
    check_unique_sorted(side, dst, hi, di, unit)
}

/// How many bytes of a byte map are set (each is 0 or 1), in blocks a vector adds without
/// overflowing its byte lanes.
fn count_set(map: &[u8]) -> u64 {
    map.chunks(255).map(|c| c.iter().fold(0u8, |a, &b| a.wrapping_add(b)) as u64).sum()
}

/// Pools of at most this many slots (or eight per pair) check uniqueness with a byte map.
const BYTE_MAP_SLOTS: u64 = 1 << 16;

/// Whether a pool of `bound` slots checks a list of `list` destinations with a byte map.
fn byte_mapped(bound: u64, list: usize) -> bool {
    bound <= BYTE_MAP_SLOTS.max((list as u64).saturating_mul(8))
}

pub(super) fn check_unique_sorted(side: &'static str, dst: &[i64], hi: &[i64], di: &[i64], unit: &'static str) -> Result<u64> {
    let mut live: Vec<(i64, usize)> = (0..dst.len()).filter(|&i| hi[i] >= 0 && di[i] >= 0).map(|i| (dst[i], i)).collect();
    live.sort_unstable();
    match live.windows(2).filter(|w| w[0].0 == w[1].0).map(|w| w[1].1).min() {
        Some(i) => Err(duplicate(side, dst, hi, di, i, unit)),
        None => Ok(live.len() as u64),
    }
}

/// The error for a destination written again at position `second` (rare path: finds where it
/// was first written, for the message).
pub(super) fn duplicate(side: &'static str, dst: &[i64], hi: &[i64], di: &[i64], second: usize, unit: &'static str) -> TransferError {
    let d = dst[second];
    let first = dst[..second].iter().enumerate().position(|(j, &x)| x == d && hi[j] >= 0 && di[j] >= 0).unwrap_or(0);
    TransferError::DuplicateDestination { side, unit, index: d, first, second }
}

/// Padded pages whose page bytes or offset are not whole chunks put chunks at any byte. That is
/// exact inside one binding window and one segment, but an executor that splits larger buffers
/// (wgpu) cuts them only at whole chunks, so such a buffer must fit one window and one segment.
pub(super) fn check_padded_windows(host: &HostGeometry, dev: &DeviceGeometry, caps: &Capabilities) -> Result<()> {
    let sides = [(host.padding(), host.chunk_bytes(), host.buffer_bytes()), (dev.padding(), dev.item_bytes(), dev.layer_bytes())];
    for (padding, chunk, bytes) in sides {
        let Some(pad) = padding else { continue };
        if pad.page_bytes.is_multiple_of(chunk) && pad.offset.is_multiple_of(chunk) {
            continue;
        }
        // The smallest window either of the gather's words gets, against the buffer rounded up
        // to 16 bytes (allocations round to 4: this errs on the side of refusing).
        let granule = lcm(caps.window_granule(chunk), 16);
        let limit = (caps.max_binding / granule * granule).min(caps.max_segment);
        if bytes.next_multiple_of(16) > limit {
            return Err(TransferError::ExecutorLimit {
                executor: caps.name,
                what: "bytes of a buffer of padded pages that are not whole items (one binding window and segment at most)",
                value: bytes,
                limit,
            });
        }
    }
    Ok(())
}
