//! Copies that checksum every item in the same pass (each block of the source is loaded once,
//! stored and multiplied in), settling into the host pool's table as they go.

use crate::exec::ChecksumBinding;
use crate::geometry::Addr;
use crate::integrity;
use crate::plan::ChecksumMode;

use super::copy::{prefetch, prefetch_item, SendPtr, PREFETCH_AHEAD};

/// [`gather_items`] that checksums every item it copies, in the same pass (each block of the
/// source is loaded once, stored and multiplied in): recorded in the host pool's table for
/// backups, compared with it for loads. Returns the counts (recorded, verified, unverified,
/// mismatched).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn gather_checked<const NT: bool>(
    (sp, dp, sa, da): &(SendPtr, SendPtr, Addr, Addr),
    (layer, comp): (u64, u8),
    si: &[i64],
    di: &[i64],
    chunk: usize,
    heads: u64,
    lo: usize,
    hi: usize,
    mode: ChecksumMode,
    ib: &ChecksumBinding,
) -> [u64; 4] {
    let keys = ib.table.keys();
    let chunk_words = integrity::words(chunk);
    let mut n = [0u64; 4];
    for i in lo..hi {
        let (s, d) = (si[i], di[i]);
        if s < 0 || d < 0 {
            continue;
        }
        prefetch_item(&(*sp, *dp, *sa, *da), si, di, i + PREFETCH_AHEAD);
        let mut sum = 0u64;
        for h in 0..heads {
            // SAFETY: as in `gather_items`; the source chunk is only read (the planner refuses
            // calls whose destinations overlap a source).
            unsafe {
                let (src, dst) = (sp.0.add(sa.offset(s as u64, h) as usize), dp.0.add(da.offset(d as u64, h) as usize));
                sum = sum.wrapping_add(integrity::copy_and_sum(src, dst, chunk, h as usize * chunk_words, keys, NT));
            }
        }
        let (host, device) = match mode {
            ChecksumMode::Record => (d as u64, s as u64),
            ChecksumMode::Verify => (s as u64, d as u64),
        };
        ib.settle(mode, (host, device, layer, comp), sum, &mut n);
    }
    n
}

/// One `direct` run, item by item, each copied and checksummed in one pass (the run's items are
/// consecutive and whole: `len / items` bytes each). Counts as [`gather_checked`].
pub(super) fn copy_run_checked(
    r: &crate::plan::Run,
    (sp, dp): (SendPtr, SendPtr),
    stream: bool,
    mode: ChecksumMode,
    ib: &ChecksumBinding,
) -> [u64; 4] {
    let keys = ib.table.keys();
    let mut n = [0u64; 4];
    let item = (r.len / r.items.max(1)) as usize;
    for k in 0..r.items {
        let at = k as usize * item;
        if k + (PREFETCH_AHEAD as u64) < r.items {
            let ahead = at + PREFETCH_AHEAD * item;
            prefetch(sp.0.wrapping_add(r.src_offset as usize + ahead));
            prefetch(dp.0.wrapping_add(r.dst_offset as usize + ahead));
        }
        // SAFETY: the planner made the run from range-checked items of these pools' geometry;
        // item `k` lies inside it.
        let sum = unsafe {
            let (s, d) = (sp.0.add(r.src_offset as usize + at), dp.0.add(r.dst_offset as usize + at));
            integrity::copy_and_sum(s, d, item, 0, keys, stream)
        };
        ib.settle(mode, (r.host_unit + k, r.device_unit + k, r.host_layer, r.comp), sum, &mut n);
    }
    n
}
