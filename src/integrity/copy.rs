//! Copies that checksum what they copy in the same pass: each 32-byte block of the source is
//! loaded once, stored, and multiplied into the sum (see the parent module for the checksum).

#[cfg(target_arch = "x86_64")]
use super::has_avx2;
use super::{range_sum, Keys};

/// Copies `len` bytes from `src` to `dst` and returns their checksum terms as words
/// `first_word ..` ([`range_sum`] of the source bytes), in one pass where the processor has AVX2:
/// each 32-byte block is loaded once, stored, and multiplied in from the same register.
/// `stream`: non-temporal stores where `dst` is 32-byte aligned (the caller fences them).
///
/// # Safety
/// As `copy_nonoverlapping(src, dst, len)`.
#[inline]
pub(crate) unsafe fn copy_and_sum(src: *const u8, dst: *mut u8, len: usize, first_word: usize, keys: &Keys, stream: bool) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 present (checked); the caller vouches for the memory.
        return unsafe { copy_and_sum_avx2(src, dst, len, first_word, keys, stream) };
    }
    let _ = stream;
    // SAFETY: as the caller vouches.
    unsafe { copy_and_sum_portable(src, dst, len, first_word, keys) }
}

/// [`copy_and_sum`] without vector instructions: the copy, then [`range_sum`].
///
/// # Safety
/// As `copy_nonoverlapping(src, dst, len)`.
#[inline]
unsafe fn copy_and_sum_portable(src: *const u8, dst: *mut u8, len: usize, first_word: usize, keys: &Keys) -> u64 {
    // SAFETY: as the caller vouches.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len);
        range_sum(std::slice::from_raw_parts(src, len), first_word, keys)
    }
}

/// Whether this processor can run [`copy_and_sum_avx2`] (probed once).
#[inline]
pub(crate) fn copy_and_sum_has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    return has_avx2();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// [`copy_and_sum`] for callers that probed AVX2 once ([`copy_and_sum_has_avx2`]) and are
/// compiled with it themselves, so that it inlines into their per-item loop (a call per 128-byte
/// item, and a `memcpy` call for its empty tail, cost more than the copy did).
///
/// # Safety
/// As `copy_nonoverlapping(src, dst, len)`; AVX2 available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) unsafe fn copy_and_sum_avx2(src: *const u8, dst: *mut u8, len: usize, first_word: usize, keys: &Keys, stream: bool) -> u64 {
    if len >= 64 && first_word.checked_add(len / 4).is_some_and(|end| end <= keys.table.len()) {
        // SAFETY: AVX2 present; the key table covers the blocks' words (checked); the caller
        // vouches for the memory.
        let (sum, done) = unsafe { copy_sum_avx2(src, dst, len, keys.table.as_ptr().add(first_word), stream) };
        if done == len {
            // The common item sizes are whole blocks: no tail copy and no tail sum.
            return sum;
        }
        // SAFETY: the tail of the same ranges.
        let tail = unsafe {
            std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done);
            std::slice::from_raw_parts(src.add(done), len - done)
        };
        return sum.wrapping_add(range_sum(tail, first_word + done / 4, keys));
    }
    // SAFETY: as the caller vouches.
    unsafe { copy_and_sum_portable(src, dst, len, first_word, keys) }
}

/// The 32-byte blocks of [`copy_and_sum`]: `(their checksum terms, bytes done)`.
///
/// # Safety
/// AVX2 available; `src`/`dst` valid for `len` bytes, not overlapping; `keys` valid for `len / 4`
/// words.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn copy_sum_avx2(src: *const u8, dst: *mut u8, len: usize, keys: *const u32, stream: bool) -> (u64, usize) {
    use std::arch::x86_64::*;
    let kp = keys as *const u8;
    // Two blocks per trip, each with its own accumulators (measured: one block per trip left
    // 10% of an 8448-byte backup on the table).
    let (mut e0, mut o0, mut e1, mut o1) = (_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256());
    let aligned = stream && (dst as usize).is_multiple_of(32);
    let mut at = 0;
    macro_rules! block {
        ($even:ident, $odd:ident, $off:expr) => {{
            // SAFETY: the block lies inside all three ranges (see the contract).
            unsafe {
                let m = _mm256_loadu_si256(src.add($off) as *const __m256i);
                store_block(dst.add($off), m, aligned);
                let k = _mm256_loadu_si256(kp.add($off) as *const __m256i);
                $even = _mm256_add_epi64($even, _mm256_mul_epu32(k, m));
                $odd = _mm256_add_epi64($odd, _mm256_mul_epu32(_mm256_srli_epi64(k, 32), _mm256_srli_epi64(m, 32)));
            }
        }};
    }
    while at + 64 <= len {
        block!(e0, o0, at);
        block!(e1, o1, at + 32);
        at += 64;
    }
    if at + 32 <= len {
        block!(e0, o0, at);
        at += 32;
    }
    (lanes_sum(_mm256_add_epi64(_mm256_add_epi64(e0, o0), _mm256_add_epi64(e1, o1))), at)
}

/// Stores a 32-byte block at `dst`: non-temporal where `aligned` (the caller checked the
/// alignment and fences), plain otherwise.
///
/// # Safety
/// AVX2 available; `dst` valid for 32 bytes, 32-byte aligned where `aligned`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn store_block(dst: *mut u8, m: std::arch::x86_64::__m256i, aligned: bool) {
    use std::arch::x86_64::*;
    // SAFETY: as the caller vouches.
    unsafe {
        if aligned {
            _mm256_stream_si256(dst as *mut __m256i, m);
        } else {
            _mm256_storeu_si256(dst as *mut __m256i, m);
        }
    }
}

/// The sum of a vector's four 64-bit lanes, added in registers (a store and reload per item
/// showed in profiles).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn lanes_sum(v: std::arch::x86_64::__m256i) -> u64 {
    use std::arch::x86_64::*;
    let half = _mm_add_epi64(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    _mm_cvtsi128_si64(_mm_add_epi64(half, _mm_unpackhi_epi64(half, half))) as u64
}

/// The keys of items of `B` whole 32-byte blocks, loaded once by a loop that checksums many such
/// items (words `0 .. 8·B` of the stream; the odd words' keys already shifted down): per item no
/// table bounds and no block loop, and for `B <= 4` no key loads (the keys fit the 16 vector
/// registers; larger items reload them from the stack). Measured on 128-byte loads, where the
/// generic [`copy_and_sum_avx2`] spent a third of each item's time outside the copy.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct BlockKeys<const B: usize> {
    even: [std::arch::x86_64::__m256i; B],
    odd: [std::arch::x86_64::__m256i; B],
}

#[cfg(target_arch = "x86_64")]
impl<const B: usize> BlockKeys<B> {
    /// The keys of words `0 .. 8·B`; `None` where the table is shorter.
    ///
    /// # Safety
    /// AVX2 available.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(crate) unsafe fn new(keys: &Keys) -> Option<BlockKeys<B>> {
        use std::arch::x86_64::*;
        let table = keys.table.get(..8 * B)?;
        let mut even = [_mm256_setzero_si256(); B];
        let mut odd = [_mm256_setzero_si256(); B];
        for (b, k) in table.chunks_exact(8).enumerate() {
            // SAFETY: `k` is 8 words (32 bytes).
            let v = unsafe { _mm256_loadu_si256(k.as_ptr() as *const __m256i) };
            even[b] = v;
            odd[b] = _mm256_srli_epi64(v, 32);
        }
        Some(BlockKeys { even, odd })
    }

    /// Copies the `32·B` bytes at `src` to `dst` and returns their checksum (as
    /// [`copy_and_sum_avx2`] with `first_word` 0); `stream`: non-temporal stores where `dst` is
    /// 32-byte aligned (the caller fences them).
    ///
    /// # Safety
    /// AVX2 available; as `copy_nonoverlapping(src, dst, 32·B)`.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(crate) unsafe fn copy_sum(&self, src: *const u8, dst: *mut u8, stream: bool) -> u64 {
        use std::arch::x86_64::*;
        let aligned = stream && (dst as usize).is_multiple_of(32);
        let (mut e, mut o) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        for b in 0..B {
            // SAFETY: block `b` lies inside both ranges (see the contract).
            unsafe {
                let m = _mm256_loadu_si256(src.add(32 * b) as *const __m256i);
                store_block(dst.add(32 * b), m, aligned);
                e = _mm256_add_epi64(e, _mm256_mul_epu32(self.even[b], m));
                o = _mm256_add_epi64(o, _mm256_mul_epu32(self.odd[b], _mm256_srli_epi64(m, 32)));
            }
        }
        lanes_sum(_mm256_add_epi64(e, o))
    }
}

/// Copies a run of chunks of `chunk` bytes (`from` and `to`: the run, `from.len() / chunk`
/// chunks end to end) and returns its checksum terms under `obj` (word `i` of the run under
/// `obj[i]`), adding each chunk's terms under `item` (word `i` of every chunk under `item[i]`)
/// to `chunk_sums[c]`, in one pass: each block is loaded once and multiplied under both keys.
/// What an L3 store's staging pass needs where an object's bytes are pieces of the pool's items:
/// the object's checksum and its items' parts from one read. `None`, with nothing copied, where
/// `chunk` is not a whole number of words or does not divide the run, the slices differ in
/// length, a key table is short, or `chunk_sums` has not one entry a chunk.
pub(crate) fn copy_sum_run(from: &[u8], to: &mut [u8], chunk: usize, obj: &[u32], item: &[u32], chunk_sums: &mut [u64]) -> Option<u64> {
    let len = from.len();
    if chunk == 0 || !chunk.is_multiple_of(4) || !len.is_multiple_of(chunk) || to.len() != len {
        return None;
    }
    let (words, chunk_words) = (len / 4, chunk / 4);
    if obj.len() < words || item.len() < chunk_words || chunk_sums.len() != len / chunk {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    if chunk.is_multiple_of(32) && has_avx2() {
        // SAFETY: AVX2 present (checked); `from` and `to` are `len` bytes each (checked), two
        // slices so not overlapping; the tables hold the run's and a chunk's words (checked).
        return Some(unsafe { copy_sum_run_avx2(from.as_ptr(), to.as_mut_ptr(), chunk / 32, chunk_sums, obj.as_ptr(), item.as_ptr()) });
    }
    to.copy_from_slice(from);
    for (c, sum) in chunk_sums.iter_mut().enumerate() {
        *sum = sum.wrapping_add(super::tabled_portable(&from[c * chunk..(c + 1) * chunk], &item[..chunk_words]));
    }
    Some(super::tabled_portable(from, &obj[..words]))
}

/// [`copy_sum_run`]'s vector loop: `chunk_sums.len()` chunks of `blocks` 32-byte blocks.
///
/// # Safety
/// AVX2 available; `src` and `dst` valid for and not overlapping in `32 · blocks ·
/// chunk_sums.len()` bytes; `obj` valid for as many bytes, `item` for `32 · blocks`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_sum_run_avx2(src: *const u8, dst: *mut u8, blocks: usize, chunk_sums: &mut [u64], obj: *const u32, item: *const u32) -> u64 {
    use std::arch::x86_64::*;
    let (op, ip) = (obj as *const u8, item as *const u8);
    let (mut oe, mut oo) = (_mm256_setzero_si256(), _mm256_setzero_si256());
    let mut at = 0;
    for sum in chunk_sums.iter_mut() {
        let (mut ie, mut io) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        for b in 0..blocks {
            // SAFETY: block `b` of this chunk lies inside both ranges and the object's keys, its
            // item keys inside the chunk's (see the contract).
            unsafe {
                let m = _mm256_loadu_si256(src.add(at) as *const __m256i);
                _mm256_storeu_si256(dst.add(at) as *mut __m256i, m);
                let mh = _mm256_srli_epi64(m, 32);
                let ko = _mm256_loadu_si256(op.add(at) as *const __m256i);
                let ki = _mm256_loadu_si256(ip.add(32 * b) as *const __m256i);
                oe = _mm256_add_epi64(oe, _mm256_mul_epu32(ko, m));
                oo = _mm256_add_epi64(oo, _mm256_mul_epu32(_mm256_srli_epi64(ko, 32), mh));
                ie = _mm256_add_epi64(ie, _mm256_mul_epu32(ki, m));
                io = _mm256_add_epi64(io, _mm256_mul_epu32(_mm256_srli_epi64(ki, 32), mh));
            }
            at += 32;
        }
        *sum = sum.wrapping_add(lanes_sum(_mm256_add_epi64(ie, io)));
    }
    lanes_sum(_mm256_add_epi64(oe, oo))
}
