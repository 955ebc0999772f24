//! Copies that checksum every item in the same pass (each block of the source is loaded once,
//! stored and multiplied in), settling into the host pool's table as they go.

use crate::exec::settle::add_counts;
use crate::exec::ChecksumBinding;
use crate::integrity;
use crate::plan::{ChecksumMode, CopyStep};

use super::raw::{each_span, prefetch, prefetch_item, Pair, RawBindings, PREFETCH_AHEAD};

/// How a summing loop copies and checksums one chunk: the generic copy, or (the common small
/// items, one chunk each) keys held in registers ([`integrity::BlockKeys`]).
trait ChunkSum {
    /// Copies chunk `head` of an item from `src` to `dst`, returning its checksum terms.
    ///
    /// # Safety
    /// As `copy_nonoverlapping(src, dst, chunk)` for the chunk size the summer was made for; the
    /// AVX2 forms (`AnyChunk<true>`, `Blocks`) only where the processor has AVX2 (they are made
    /// only inside functions that run where it does).
    unsafe fn copy_sum(&self, src: *const u8, dst: *mut u8, head: u64) -> u64;
}

/// Any chunk: [`integrity::copy_and_sum`]; `AVX2`: the caller is compiled with AVX2 and probed
/// for it, so the vector loop inlines.
struct AnyChunk<'a, const AVX2: bool> {
    chunk: usize,
    keys: &'a integrity::Keys,
    stream: bool,
}

impl<const AVX2: bool> ChunkSum for AnyChunk<'_, AVX2> {
    #[inline(always)]
    unsafe fn copy_sum(&self, src: *const u8, dst: *mut u8, head: u64) -> u64 {
        let first_word = head as usize * integrity::words(self.chunk);
        #[cfg(target_arch = "x86_64")]
        if AVX2 {
            // SAFETY: as the caller vouches (memory; AVX2 where `AVX2`).
            return unsafe { integrity::copy_and_sum_avx2(src, dst, self.chunk, first_word, self.keys, self.stream) };
        }
        // SAFETY: as the caller vouches.
        unsafe { integrity::copy_and_sum(src, dst, self.chunk, first_word, self.keys, self.stream) }
    }
}

/// Items of `B` whole 32-byte blocks in one chunk, their keys in registers.
#[cfg(target_arch = "x86_64")]
struct Blocks<const B: usize> {
    keys: integrity::BlockKeys<B>,
    stream: bool,
}

#[cfg(target_arch = "x86_64")]
impl<const B: usize> ChunkSum for Blocks<B> {
    #[inline(always)]
    unsafe fn copy_sum(&self, src: *const u8, dst: *mut u8, _head: u64) -> u64 {
        // SAFETY: a `BlockKeys` exists only where AVX2 does; the caller vouches for the memory.
        unsafe { self.keys.copy_sum(src, dst, self.stream) }
    }
}

#[cfg(target_arch = "x86_64")]
impl<const B: usize> Blocks<B> {
    /// `None` where the key table is shorter than one item.
    ///
    /// # Safety
    /// AVX2 available.
    #[inline(always)]
    unsafe fn new(keys: &integrity::Keys, stream: bool) -> Option<Blocks<B>> {
        // SAFETY: as the caller vouches.
        Some(Blocks { keys: unsafe { integrity::BlockKeys::new(keys)? }, stream })
    }
}

/// Evaluates `$body` with `$sum` bound to the fastest [`ChunkSum`] for chunks of `$chunk` bytes
/// (keys in registers for one-chunk items, `$single`, of 64 to 512 bytes), returning from the
/// enclosing function (an AVX2 one, so that the register-keyed forms inline there).
#[cfg(target_arch = "x86_64")]
macro_rules! with_summer {
    ($keys:expr, $chunk:expr, $single:expr, $stream:expr, |$sum:ident| $body:expr) => {{
        let (keys, chunk, stream) = ($keys, $chunk, $stream);
        // `$blocks` 32-byte blocks an item: returns `$body` (keys too short: falls through).
        macro_rules! blocks {
            ($blocks:literal) => {
                // SAFETY: the enclosing function runs only where AVX2 is.
                if let Some($sum) = unsafe { Blocks::<$blocks>::new(keys, stream) }.as_ref() {
                    return $body;
                }
            };
        }
        match chunk {
            64 if $single => blocks!(2),
            128 if $single => blocks!(4),
            256 if $single => blocks!(8),
            512 if $single => blocks!(16),
            _ => {}
        }
        let $sum = &AnyChunk::<true> { chunk, keys, stream };
        $body
    }};
}

/// [`gather_items`] that checksums every item it copies, in the same pass (each block of the
/// source is loaded once, stored and multiplied in): recorded in the host pool's table for
/// backups, compared with it for loads. Returns the counts (recorded, verified, unverified,
/// mismatched).
#[allow(clippy::too_many_arguments)]
pub(super) fn gather_checked<const NT: bool>(
    pair: &Pair,
    item: (u64, u8),
    si: &[i64],
    di: &[i64],
    chunk: usize,
    heads: u64,
    lo: usize,
    hi: usize,
    mode: ChecksumMode,
    ib: &ChecksumBinding,
) -> [u64; 4] {
    #[cfg(target_arch = "x86_64")]
    if integrity::copy_and_sum_has_avx2() {
        // SAFETY: AVX2 is present (checked).
        return unsafe { gather_checked_avx2::<NT>(pair, item, si, di, chunk, heads, lo, hi, mode, ib) };
    }
    let sum = &AnyChunk::<false> { chunk, keys: ib.table.keys(), stream: NT };
    gather_checked_body(pair, item, si, di, heads, lo, hi, mode, ib, sum)
}

/// [`gather_checked`] compiled with AVX2, so that each item's copy and sum inline into the loop.
///
/// # Safety
/// AVX2 available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn gather_checked_avx2<const NT: bool>(
    pair: &Pair,
    item: (u64, u8),
    si: &[i64],
    di: &[i64],
    chunk: usize,
    heads: u64,
    lo: usize,
    hi: usize,
    mode: ChecksumMode,
    ib: &ChecksumBinding,
) -> [u64; 4] {
    with_summer!(ib.table.keys(), chunk, heads == 1, NT, |sum| gather_checked_body(pair, item, si, di, heads, lo, hi, mode, ib, sum))
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn gather_checked_body<S: ChunkSum>(
    (sp, dp, sa, da): &Pair,
    (layer, comp): (u64, u8),
    si: &[i64],
    di: &[i64],
    heads: u64,
    lo: usize,
    hi: usize,
    mode: ChecksumMode,
    ib: &ChecksumBinding,
    summer: &S,
) -> [u64; 4] {
    let mut settle = ib.layer(mode, layer, comp);
    for i in lo..hi {
        let (s, d) = (si[i], di[i]);
        if s < 0 || d < 0 {
            continue;
        }
        prefetch_item(&(*sp, *dp, *sa, *da), si, di, i + PREFETCH_AHEAD);
        // And that item's checksum entry: the table is indexed by random host units, and its
        // load missed the cache on every item (a tenth of a 128-byte load's time).
        if let (Some(&s2), Some(&d2)) = (si.get(i + PREFETCH_AHEAD), di.get(i + PREFETCH_AHEAD)) {
            let unit = if mode == ChecksumMode::Record { d2 } else { s2 };
            if unit >= 0 {
                prefetch(settle.entry_addr(unit as u64));
            }
        }
        let mut sum = 0u64;
        for h in 0..heads {
            // SAFETY: as in `gather_items`; the source chunk is only read (the planner refuses
            // calls whose destinations overlap a source).
            unsafe {
                let (src, dst) = (sp.0.add(sa.offset(s as u64, h) as usize), dp.0.add(da.offset(d as u64, h) as usize));
                sum = sum.wrapping_add(summer.copy_sum(src, dst, h));
            }
        }
        let (host, device) = match mode {
            ChecksumMode::Record => (d as u64, s as u64),
            ChecksumMode::Verify => (s as u64, d as u64),
        };
        settle.item(host, device, sum);
    }
    settle.n
}

/// `direct` runs `lo..hi`, item by item, each copied and checksummed in one pass (a run's items
/// are consecutive and whole: `len / items` bytes each). Counts as [`gather_checked`].
pub(super) fn copy_runs_checked(
    c: &CopyStep,
    bufs: &RawBindings,
    (lo, hi): (usize, usize),
    stream: bool,
    mode: ChecksumMode,
    ib: &ChecksumBinding,
) -> [u64; 4] {
    #[cfg(target_arch = "x86_64")]
    if integrity::copy_and_sum_has_avx2() {
        // SAFETY: AVX2 is present (checked).
        return unsafe { copy_runs_checked_avx2(c, bufs, (lo, hi), stream, mode, ib) };
    }
    let sum = &AnyChunk::<false> { chunk: c.item_bytes() as usize, keys: ib.table.keys(), stream };
    copy_runs_checked_body(c, bufs, (lo, hi), mode, ib, sum)
}

/// [`copy_runs_checked`] compiled with AVX2 (the copy and sum inline into the loop).
///
/// # Safety
/// AVX2 available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_runs_checked_avx2(
    c: &CopyStep,
    bufs: &RawBindings,
    range: (usize, usize),
    stream: bool,
    mode: ChecksumMode,
    ib: &ChecksumBinding,
) -> [u64; 4] {
    with_summer!(ib.table.keys(), c.item_bytes() as usize, true, stream, |sum| copy_runs_checked_body(c, bufs, range, mode, ib, sum))
}

#[inline(always)]
fn copy_runs_checked_body<S: ChunkSum>(
    c: &CopyStep,
    bufs: &RawBindings,
    (lo, hi): (usize, usize),
    mode: ChecksumMode,
    ib: &ChecksumBinding,
    summer: &S,
) -> [u64; 4] {
    let mut n = [0u64; 4];
    let item = c.item_bytes() as usize;
    for (p, spans) in c.pieces(lo, hi) {
        let (layer, comp) = c.item(p);
        let mut settle = ib.layer(mode, layer, comp);
        each_span(c, bufs, p, spans, |s, src, dst| {
            for j in 0..s.items {
                let off = j as usize * item;
                // Within a long run too, the items ahead.
                if j + (PREFETCH_AHEAD as u64) < s.items {
                    let ahead = off + PREFETCH_AHEAD * item;
                    prefetch(src.wrapping_add(ahead));
                    prefetch(dst.wrapping_add(ahead));
                }
                // SAFETY: the planner made the span from range-checked items of these pools'
                // geometry; item `j` lies inside it.
                let sum = unsafe { summer.copy_sum(src.add(off), dst.add(off), 0) };
                settle.item(s.host_unit + j, s.device_unit + j, sum);
            }
        });
        add_counts(&mut n, settle.n);
    }
    n
}
