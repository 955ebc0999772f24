//! One step of a plan over raw buffer addresses: gathers item by item and `direct` runs, split
//! across threads for large transfers, with non-temporal stores and prefetch where they pay.

use crate::exec::ChecksumBinding;
use crate::plan::{ChecksumMode, CopyStep, GatherStep, Step, StepKind};

use super::checksums::{copy_runs_checked, gather_checked};
use super::queue::ON_WORKER;
use super::raw::{each_span, prefetch_item, Pair, RawBindings, SendPtr, PREFETCH_AHEAD};
use crate::exec::settle::add_counts;

/// Below this many bytes a transfer stays on the calling thread (thread start-up costs more).
pub(super) const PARALLEL_MIN_BYTES: u64 = 1 << 20;
/// Runs one step over raw buffer addresses; `streaming`: with non-temporal stores (a transfer
/// larger than the caches, whose destination nobody reads soon).
pub(super) fn run_step(step: &Step, bufs: &RawBindings, threads: usize, streaming: bool) {
    match step.kind() {
        StepKind::Gather(g) => run_gather(g, bufs, threads, streaming),
        StepKind::Copy(c) if step.checksum().is_some() && bufs.integrity.is_some() => {
            let (Some(mode), Some(ib)) = (step.checksum(), &bufs.integrity) else { return };
            run_copy_checked(c, bufs, threads, streaming, mode, ib);
        }
        StepKind::Copy(c) => run_copy(c, bufs, threads, streaming),
    }
}

/// A gather step: its address pairs resolved to buffer addresses, then its items copied (and
/// checksummed where the step and the bindings keep checksums).
fn run_gather(g: &GatherStep, bufs: &RawBindings, threads: usize, streaming: bool) {
    let pairs: Vec<Pair> = g.pairs.iter().map(|l| (SendPtr(bufs.get(l.src.buf())), SendPtr(bufs.get(l.dst.buf())), l.src, l.dst)).collect();
    // Layer by layer (destinations are unique, so order only affects speed): each pass
    // stays within one layer's buffers, measured up to 4x faster than item by item for
    // random 128-byte items. Upcoming items are prefetched: random small items are
    // latency-bound otherwise.
    if let (Some(mode), Some(ib)) = (g.checksum, &bufs.integrity) {
        run_gather_checked(g, &pairs, threads, streaming, mode, ib);
        return;
    }
    run_gather_plain(g, &pairs, threads, streaming);
}

/// The items of a checksumming gather, split across threads, their checksums counted.
fn run_gather_checked(g: &GatherStep, pairs: &[Pair], threads: usize, streaming: bool, mode: ChecksumMode, ib: &ChecksumBinding) {
    let (chunk, heads) = (g.chunk_bytes as usize, g.heads);
    let (si, di) = (&g.src_indices[..], &g.dst_indices[..]);
    let work = |lo: usize, hi: usize| {
        let mut n = [0u64; 4];
        for (l, &item) in pairs.iter().zip(&g.items) {
            add_counts(
                &mut n,
                match streaming {
                    true => gather_checked::<true>(l, item, si, di, chunk, heads, lo, hi, mode, ib),
                    false => gather_checked::<false>(l, item, si, di, chunk, heads, lo, hi, mode, ib),
                },
            );
        }
        store_fence(streaming);
        ib.table.count(n);
    };
    split(g.src_indices.len(), threads, &work);
}

/// The items of a plain gather, split across threads.
fn run_gather_plain(g: &GatherStep, pairs: &[Pair], threads: usize, streaming: bool) {
    let (chunk, heads) = (g.chunk_bytes as usize, g.heads);
    let (si, di) = (&g.src_indices[..], &g.dst_indices[..]);
    // Prefetching the next items pays where they come from memory (a transfer larger
    // than the caches) or where an item is long enough to hide its cost; for small
    // cached items it measured 1.5x slower (128 B backups of 4 MiB).
    let prefetching = streaming || chunk >= PREFETCH_MIN_CHUNK;
    let work = |lo: usize, hi: usize| {
        for l in pairs {
            #[cfg(target_arch = "x86_64")]
            if crate::cpu_features::has_avx2() {
                // SAFETY: AVX2 is present (checked).
                unsafe { gather_items_avx2(l, si, di, chunk, heads, (lo, hi), (streaming, prefetching)) };
                continue;
            }
            gather_items_as(l, si, di, chunk, heads, (lo, hi), (streaming, prefetching));
        }
        store_fence(streaming);
    };
    split(g.src_indices.len(), threads, &work);
}

/// [`gather_items`] of the store kind and prefetch asked for, monomorphized (a branch per
/// chunk measured 30% slower for 128-byte items).
#[inline(always)]
fn gather_items_as(l: &Pair, si: &[i64], di: &[i64], chunk: usize, heads: u64, (lo, hi): (usize, usize), how: (bool, bool)) {
    match how {
        (true, true) => gather_items::<true, true>(l, si, di, chunk, heads, lo, hi),
        (true, false) => gather_items::<true, false>(l, si, di, chunk, heads, lo, hi),
        (false, true) => gather_items::<false, true>(l, si, di, chunk, heads, lo, hi),
        (false, false) => gather_items::<false, false>(l, si, di, chunk, heads, lo, hi),
    }
}

/// [`gather_items_as`] compiled with AVX2: the small items' constant-size copies become 32-byte
/// moves instead of 16-byte ones (measured 19 -> 33 GB/s on 128-byte loads that fit the caches).
///
/// # Safety
/// AVX2 available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn gather_items_avx2(l: &Pair, si: &[i64], di: &[i64], chunk: usize, heads: u64, range: (usize, usize), how: (bool, bool)) {
    gather_items_as(l, si, di, chunk, heads, range, how)
}

/// The runs of a checksumming `direct` step, split across threads, their checksums counted.
fn run_copy_checked(c: &CopyStep, bufs: &RawBindings, threads: usize, streaming: bool, mode: ChecksumMode, ib: &ChecksumBinding) {
    let work = |lo: usize, hi: usize| {
        let n = copy_runs_checked(c, bufs, (lo, hi), streaming, mode, ib);
        store_fence(streaming);
        ib.table.count(n);
    };
    split(c.len(), threads, &work);
}

/// The runs of a plain `direct` step, split across threads.
fn run_copy(c: &CopyStep, bufs: &RawBindings, threads: usize, streaming: bool) {
    let item = c.item_bytes() as usize;
    let work = |lo: usize, hi: usize| {
        for (p, spans) in c.pieces(lo, hi) {
            each_span(c, bufs, p, spans, |s, src, dst| {
                // SAFETY: the planner made the span from range-checked items of these
                // pools' geometry.
                unsafe { copy(streaming, src, dst, s.items as usize * item) };
            });
        }
        store_fence(streaming);
    };
    split(c.len(), threads, &work);
}

/// Items `lo..hi` of one address pair; `NT`: non-temporal stores; `PF`: prefetch ahead.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn gather_items<const NT: bool, const PF: bool>(
    (sp, dp, sa, da): &Pair,
    si: &[i64],
    di: &[i64],
    chunk: usize,
    heads: u64,
    lo: usize,
    hi: usize,
) {
    for i in lo..hi {
        let (s, d) = (si[i], di[i]);
        if s < 0 || d < 0 {
            continue;
        }
        if PF {
            prefetch_item(&(*sp, *dp, *sa, *da), si, di, i + PREFETCH_AHEAD);
        }
        for h in 0..heads {
            // SAFETY: plans are built only by the planner, for these pools: every index is
            // range-checked against the geometry the buffers were sized by.
            unsafe { copy(NT, sp.0.add(sa.offset(s as u64, h) as usize), dp.0.add(da.offset(d as u64, h) as usize), chunk) }
        }
    }
}

/// [`copy_streaming`] or [`copy_chunk`] (a constant `streaming` folds the branch away).
///
/// # Safety
/// As `copy_nonoverlapping(src, dst, len)`.
#[inline(always)]
pub(super) unsafe fn copy(streaming: bool, src: *const u8, dst: *mut u8, len: usize) {
    unsafe {
        if streaming {
            copy_streaming(src, dst, len)
        } else {
            copy_chunk(src, dst, len)
        }
    }
}

/// `copy_nonoverlapping` with the common small sizes as constants (inlined moves instead of a
/// `memcpy` call per item).
///
/// # Safety
/// As `copy_nonoverlapping(src, dst, len)`.
#[inline(always)]
unsafe fn copy_chunk(src: *const u8, dst: *mut u8, len: usize) {
    unsafe {
        match len {
            64 => std::ptr::copy_nonoverlapping(src, dst, 64),
            128 => std::ptr::copy_nonoverlapping(src, dst, 128),
            256 => std::ptr::copy_nonoverlapping(src, dst, 256),
            _ => std::ptr::copy_nonoverlapping(src, dst, len),
        }
    }
}

/// Transfers of at least this many bytes write with non-temporal stores: they do not fit the
/// caches anyway, and plain stores first read every destination line (so a copy moves three
/// bytes per byte instead of two; glibc's large `memcpy`, the ceiling, streams too). Measured
/// on a 32 MiB-L3 machine: 8448 B items from about 0.75 to about 0.9 of that ceiling.
pub(super) const STREAMING_MIN_BYTES: u64 = 24 << 20;

/// `copy_nonoverlapping` with non-temporal stores for the 16-byte-aligned middle of the
/// destination; callers end with [`store_fence`] before anyone else may read it.
///
/// # Safety
/// As `copy_nonoverlapping(src, dst, len)`.
#[inline(always)]
unsafe fn copy_streaming(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    unsafe {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        if len < 64 {
            return copy_chunk(src, dst, len);
        }
        let head = dst.align_offset(16).min(len);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let (mut s, mut d, mut n) = (src.add(head), dst.add(head), len - head);
        while n >= 64 {
            // SSE2 is part of x86_64: no feature detection needed.
            let (a, b, c, e) = (
                _mm_loadu_si128(s as *const __m128i),
                _mm_loadu_si128(s.add(16) as *const __m128i),
                _mm_loadu_si128(s.add(32) as *const __m128i),
                _mm_loadu_si128(s.add(48) as *const __m128i),
            );
            _mm_stream_si128(d as *mut __m128i, a);
            _mm_stream_si128(d.add(16) as *mut __m128i, b);
            _mm_stream_si128(d.add(32) as *mut __m128i, c);
            _mm_stream_si128(d.add(48) as *mut __m128i, e);
            (s, d, n) = (s.add(64), d.add(64), n - 64);
        }
        while n >= 16 {
            _mm_stream_si128(d as *mut __m128i, _mm_loadu_si128(s as *const __m128i));
            (s, d, n) = (s.add(16), d.add(16), n - 16);
        }
        std::ptr::copy_nonoverlapping(s, d, n);
    }
    #[cfg(not(target_arch = "x86_64"))]
    unsafe {
        copy_chunk(src, dst, len)
    }
}

/// Orders this thread's non-temporal stores before what follows (the job's completion).
#[inline(always)]
fn store_fence(streaming: bool) {
    #[cfg(target_arch = "x86_64")]
    if streaming {
        // SAFETY: a fence; no memory operands.
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = streaming;
}

/// Chunks from which the gather prefetches even when the transfer fits the caches.
const PREFETCH_MIN_CHUNK: usize = 512;

/// Runs `work(lo, hi)` over `0..n` split into up to `threads` pieces on rayon's pool (its
/// threads stay alive between transfers: spawning per call cost ~10% of a 4 MiB load).
pub(super) fn split(n: usize, threads: usize, work: &(dyn Fn(usize, usize) + Sync)) {
    use rayon::prelude::*;
    let threads = threads.min(n).max(1);
    if threads == 1 {
        work(0, n);
        return;
    }
    let per = n.div_ceil(threads);
    // Queued transfers do not use rayon's shared pool: callers blocked on this queue from inside
    // rayon tasks could otherwise hold every pool thread while the job waits for one.
    if ON_WORKER.with(|w| w.get()) {
        std::thread::scope(|s| {
            for t in 1..threads {
                let (lo, hi) = (t * per, ((t + 1) * per).min(n));
                if lo < hi {
                    s.spawn(move || work(lo, hi));
                }
            }
            work(0, per.min(n));
        });
        return;
    }
    (0..threads).into_par_iter().for_each(|t| {
        let (lo, hi) = (t * per, ((t + 1) * per).min(n));
        if lo < hi {
            work(lo, hi);
        }
    });
}
