//! Whole rows: embedding ranges, and rows moved inside the device pool.

use super::args::OpArgs;
use super::catalogue::spec::ArgKind;
use super::*;
use crate::exec::Device;
use crate::geometry::{IoBackend, PoolKind};
use crate::{Result, TransferError};

// ---- whole rows: embedding ranges ----------------------------------------------------------

/// [`Shape::EmbeddingRanges`](super::catalogue::Shape::EmbeddingRanges):
/// `transfer_embedding_ranges_direct`.
pub(super) fn embedding_ranges(device: &Device, a: &OpArgs<'_, '_>) -> Result<()> {
    let (src, dst) = (a.tensors(ArgKind::In), a.tensors(ArgKind::Out));
    let (src, dst) = match (src.first(), dst.first()) {
        (Some(s), Some(d)) => (s.t, d.t),
        _ => return Err(bad("src", "an array to read and one to write")),
    };
    ranges(device, src, dst, a.ints("src_starts")?, a.ints("dst_starts")?, a.ints("lengths")?)
}

/// For each range `k`, rows
/// `src[src_starts[k] .. src_starts[k] + lengths[k]]` → rows
/// `dst[dst_starts[k] .. dst_starts[k] + lengths[k]]` (rows along dimension 0, of equal bytes in
/// both tensors; any memory pair the executor moves). Copy engine only: one copy per range (or
/// per run of adjacent ranges). Beyond sglang: ranges must lie inside their tensors and
/// destination ranges must not overlap; nothing moves unless every range passes.
fn ranges(device: &Device, src: &RawTensor, dst: &RawTensor, src_starts: &[i64], dst_starts: &[i64], lengths: &[i64]) -> Result<()> {
    let argument = |arg: &'static str, value: i64, message: String| TransferError::BadArgument { arg, value, message };
    if src_starts.len() != lengths.len() || dst_starts.len() != lengths.len() {
        return Err(argument(
            "lengths",
            lengths.len() as i64,
            format!(
                "src_starts, dst_starts and lengths must have the same number of ranges, got {}, {} and {}",
                src_starts.len(),
                dst_starts.len(),
                lengths.len()
            ),
        ));
    }
    if lengths.iter().all(|&n| n == 0) && src_starts.iter().chain(dst_starts).all(|&v| v >= 0) {
        return Ok(());
    }
    let (s, d) = (arg("src", src), arg("dst", dst));
    if src.row_bytes() != dst.row_bytes() {
        return Err(bad("dst", format!("rows of {} bytes, src's are {}", dst.row_bytes(), src.row_bytes())));
    }
    let rows = |t: &RawTensor| t.dims().first().copied().unwrap_or(1);
    let mut total: u64 = 0;
    for (k, ((&ss, &ds), &n)) in src_starts.iter().zip(dst_starts).zip(lengths).enumerate() {
        for (name, v) in [("src_starts", ss), ("dst_starts", ds), ("lengths", n)] {
            if v < 0 {
                return Err(argument(name, v, format!("{name}[{k}] must not be negative, got {v}")));
            }
        }
        for (side, start, t) in [("source", ss, src), ("destination", ds, dst)] {
            let end = (start as u64).saturating_add(n as u64);
            if n > 0 && end > rows(t) {
                let bound = rows(t);
                let last = i64::try_from(end - 1).unwrap_or(i64::MAX);
                return Err(TransferError::IndexOutOfRange { side, index: last, position: k, bound, unit: "rows" });
            }
        }
        total = total.saturating_add(n as u64);
    }
    if total == 0 {
        return Ok(());
    }
    if total > MAX_ROWS {
        return Err(argument("lengths", total.min(i64::MAX as u64) as i64, format!("{total} rows in one call, at most {MAX_ROWS}")));
    }
    check_overlaps(std::slice::from_ref(&s), std::slice::from_ref(&d))?;
    // The ranges as row index pairs: the direct planner coalesces each range into one copy and
    // checks that no destination row is written twice.
    let (mut hi, mut di) = (Vec::new(), Vec::new());
    for v in [&mut hi, &mut di] {
        v.try_reserve_exact(total as usize).map_err(|_| TransferError::OutOfMemory {
            what: "embedding range row lists".into(),
            requested: total.saturating_mul(16),
            limit: "allocation failed".into(),
        })?;
    }
    for ((&ss, &ds), &n) in src_starts.iter().zip(dst_starts).zip(lengths) {
        hi.extend(ss..ss + n);
        di.extend(ds..ds + n);
    }
    let item = positive("src", src.row_bytes() as i64)?;
    let call = lf_pair(device, PoolKind::Mla, item, &[&s], &[&d], IoBackend::Direct, Indices::Host(&hi), Indices::Host(&di))?;
    run_all(vec![call])
}

/// Rows one embedding-range call may move (the row lists are made on the host).
pub const MAX_ROWS: u64 = 1 << 28;

// ---- rows inside the device pool: copy_all_layer_kv_cache ----------------------------------

/// sglang's `copy_all_layer_kv_cache_cpu`: in every buffer `b` (normally the 2·L K and V
/// layers), row `tgt_loc[i]` becomes what row `src_loc[i]` held before the call (rows of
/// `row_bytes[b]` bytes; the sources are all read before any target is written, so overlapping
/// and permuted moves behave as one simultaneous assignment). Host memory, on the calling
/// thread. Beyond sglang: every location must be a row inside its buffer (as large as the caller
/// describes it: sglang's address tables carry no sizes, so the Python binding sizes each buffer
/// by the largest location) and no target may appear twice; nothing moves unless all pass.
pub fn copy_all_layer_kv_cache(buffers: &[RawTensor], row_bytes: &[u64], tgt_loc: &[i64], src_loc: &[i64]) -> Result<()> {
    if buffers.len() != row_bytes.len() {
        return Err(TransferError::LayerListMismatch { src_len: buffers.len(), dst_len: row_bytes.len() });
    }
    if tgt_loc.len() != src_loc.len() {
        return Err(TransferError::LengthMismatch { src_len: src_loc.len(), dst_len: tgt_loc.len() });
    }
    for (b, (t, &row)) in buffers.iter().zip(row_bytes).enumerate() {
        let name = format!("data_ptrs[{b}]");
        if t.memory != Memory::Host {
            return Err(bad(&name, "must be host memory"));
        }
        if t.addr == 0 && t.len > 0 {
            return Err(bad(&name, "null data pointer"));
        }
        if t.addr.checked_add(t.len).is_none() {
            return Err(bad(&name, "address range wraps"));
        }
        if row == 0 {
            continue;
        }
        let rows = t.len / row;
        for (side, list) in [("source", src_loc), ("destination", tgt_loc)] {
            if let Some(position) = list.iter().position(|&x| x < 0 || x as u64 >= rows) {
                return Err(TransferError::IndexOutOfRange { side, index: list[position], position, bound: rows, unit: "rows" });
            }
        }
    }
    let mut seen = std::collections::HashMap::with_capacity(tgt_loc.len());
    for (i, &t) in tgt_loc.iter().enumerate() {
        if let Some(first) = seen.insert(t, i) {
            return Err(TransferError::DuplicateDestination { side: "destination", unit: "rows", index: t, first, second: i });
        }
    }
    let widest = row_bytes.iter().copied().max().unwrap_or(0);
    let stage_len = widest.checked_mul(src_loc.len() as u64).and_then(|n| usize::try_from(n).ok()).ok_or_else(|| {
        TransferError::OutOfMemory { what: "copy_all_layer_kv_cache staging".into(), requested: u64::MAX, limit: "size overflows".into() }
    })?;
    let mut stage: Vec<u8> = Vec::new();
    stage.try_reserve_exact(stage_len).map_err(|_| TransferError::OutOfMemory {
        what: "copy_all_layer_kv_cache staging".into(),
        requested: stage_len as u64,
        limit: "allocation failed".into(),
    })?;
    stage.resize(stage_len, 0);
    for (t, &row) in buffers.iter().zip(row_bytes) {
        let row = row as usize;
        if row == 0 || src_loc.is_empty() {
            continue;
        }
        let base = t.addr as *mut u8;
        // SAFETY: every location was checked to be a whole row inside `t`, whose span the
        // caller of `RawTensor::new` vouches for; `stage` is our own allocation.
        unsafe {
            for (i, &s) in src_loc.iter().enumerate() {
                std::ptr::copy_nonoverlapping(base.add(s as usize * row), stage.as_mut_ptr().add(i * row), row);
            }
            for (i, &d) in tgt_loc.iter().enumerate() {
                std::ptr::copy_nonoverlapping(stage.as_ptr().add(i * row), base.add(d as usize * row), row);
            }
        }
    }
    Ok(())
}
