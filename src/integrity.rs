//! Checksums of KV bytes: a multilinear hash over 32-bit words, built so that lanes of a copy can
//! compute it in parallel and add their parts.
//!
//! `checksum(m) = Σ_i k_i · m_i  (mod 2^64)`, where `m_i` is the `i`-th little-endian 32-bit word
//! of the bytes (a tail shorter than a word is zero-padded), `k_i` the `i`-th key of a seeded key
//! stream ([`key`]: a 32-bit mix of the seed's base and `i`, which a shader computes in registers
//! instead of loading a table): odd, below `2^32`, so every product is an exact 32 × 32 → 64-bit multiply (one
//! instruction on every executor). The sum of [`range_sum`] over disjoint word ranges is the
//! checksum of the whole, whatever the split, so every executor and lane layout gives the same
//! bits.
//!
//! What it guarantees, for keys that do not depend on the data:
//! - **always detected**: any change confined to one 32-bit word (a single bit flip, any burst
//!   within a word): its term changes by `k_i · Δ` with `k_i` odd and `0 < |Δ| < 2^32`, so
//!   `0 < |k_i · Δ| < 2^64`, never `0 (mod 2^64)`;
//! - **otherwise** two different byte strings of one length have the same checksum with
//!   probability at most `2^-31` over random keys: pick a changed word `j`, `Δ_j = 2^t · u` with
//!   `u` odd and `t <= 31`; with the other keys fixed, a collision needs `k_j` to take one value
//!   modulo `2^(64 - t)`, `64 - t >= 33` bits, which at most one of the `2^31` odd keys below
//!   `2^32` has. With the fixed public seed of shared storage this is a bound for errors that do
//!   not depend on the keys (faults and bugs), not against an adversary.
//!
//! It is not a cryptographic MAC: the key stream is public (stores on several machines must agree
//! on it), so it catches corruption and misplaced pages, not forgery. Checks that must tell pages
//! apart also bind where a page belongs (the L3 store folds the object's key into its tag; a host
//! pool keeps one checksum per item in its own table).

/// The key stream's seed for pages in shared storage and for the items of host pools (every
/// process and machine must use the same one to verify what another wrote).
pub const STORAGE_SEED: u64 = 0x6869_6361_6368_6531; // "hicache1"

/// `splitmix64`: a fast, well-mixed 64-bit finaliser.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A 32-bit finaliser (xor-shifts and odd multiplies, each invertible: a bijection of `u32`),
/// cheap in a shader's 32-bit registers: two multiplies and three shifts.
#[inline(always)]
pub fn mix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// The 32-bit base of keys `hi · 2^32 ..` of the stream seeded by `seed`: executors compute an
/// item's keys from it and the word's position (items have fewer than `2^32` words there), so
/// checksums cost no key loads.
#[inline]
pub fn key_base(seed: u64, hi: u32) -> u32 {
    mix(seed ^ u64::from(hi).wrapping_mul(0x9e37_79b9_7f4a_7c15)) as u32
}

/// Key `i` of the stream seeded by `seed` (odd, below `2^32`):
/// `mix32(key_base(seed, i >> 32) ^ (i mod 2^32)) | 1`.
#[inline]
pub fn key(seed: u64, i: u64) -> u32 {
    mix32(key_base(seed, (i >> 32) as u32) ^ i as u32) | 1
}

/// Keys `0 .. words` of a stream, computed once for many checksums (each key is a few
/// multiplies; the checksum itself is one multiply-add per word).
#[derive(Debug, Clone)]
pub struct Keys {
    seed: u64,
    table: Vec<u32>,
}

impl Keys {
    /// Keys for words `0 .. words`.
    pub fn new(seed: u64, words: usize) -> crate::Result<Keys> {
        let mut table = Vec::new();
        table.try_reserve_exact(words).map_err(|_| crate::TransferError::OutOfMemory {
            what: "checksum key table".into(),
            requested: (words as u64).saturating_mul(4),
            limit: "allocation failed".into(),
        })?;
        table.extend((0..words as u64).map(|i| key(seed, i)));
        Ok(Keys { seed, table })
    }
    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }
    /// Words covered by the table.
    pub fn words(&self) -> usize {
        self.table.len()
    }
    /// The keys, as the device copies take them (little-endian `u32` per word).
    pub fn table(&self) -> &[u32] {
        &self.table
    }
}

/// A key table of at least `words` words for `seed`, shared by the process: building one costs a
/// few multiplies per word, far more than a checksum's multiply-add, so tables are kept (one per
/// seed, grown to the longest asked for: 4 bytes of key per 4-byte word).
pub fn shared_keys(seed: u64, words: usize) -> crate::Result<std::sync::Arc<Keys>> {
    use std::sync::{Arc, Mutex};
    static CACHE: Mutex<Vec<Arc<Keys>>> = Mutex::new(Vec::new());
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(k) = cache.iter().find(|k| k.seed == seed && k.words() >= words) {
        return Ok(k.clone());
    }
    let k = Arc::new(Keys::new(seed, words)?);
    cache.retain(|c| c.seed != seed);
    cache.push(k.clone());
    Ok(k)
}

/// Words in `len` bytes (a partial last word counts).
pub fn words(len: usize) -> usize {
    len.div_ceil(4)
}

/// The checksum of `bytes` (see the module docs), with keys from `keys` where it has them and
/// computed for words past its table.
pub fn checksum(bytes: &[u8], keys: &Keys) -> u64 {
    range_sum(bytes, 0, keys)
}

/// The checksum terms of `bytes` taken as words `first_word ..` of a longer string: the checksum
/// of a string is the sum of `partial` over any split of it into word-aligned pieces (every piece
/// but the last a whole number of words: a partial word is zero-padded).
#[inline]
pub fn range_sum(bytes: &[u8], first_word: usize, keys: &Keys) -> u64 {
    let table = keys.table.get(first_word..).unwrap_or(&[]);
    let covered = (bytes.len() / 4).min(table.len());
    let mut sum = tabled(&bytes[..covered * 4], &table[..covered]);
    let chunks = bytes[covered * 4..].chunks_exact(4);
    let mut i = covered;
    // Past the table (or a table that was not made long enough): keys computed in place.
    for w in chunks {
        let k = key(keys.seed, (first_word + i) as u64) as u64;
        sum = sum.wrapping_add(k * u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as u64);
        i += 1;
    }
    let rest = bytes.chunks_exact(4).remainder();
    debug_assert_eq!(i, bytes.len() / 4);
    if !rest.is_empty() {
        let mut w = [0u8; 4];
        w[..rest.len()].copy_from_slice(rest);
        let k = table.get(i).copied().unwrap_or_else(|| key(keys.seed, (first_word + i) as u64)) as u64;
        sum = sum.wrapping_add(k * u32::from_le_bytes(w) as u64);
    }
    sum
}

/// The former name of [`range_sum`].
#[deprecated(note = "renamed range_sum")]
pub fn partial(bytes: &[u8], first_word: usize, keys: &Keys) -> u64 {
    range_sum(bytes, first_word, keys)
}

/// `Σ keys[i] · word_i (mod 2^64)` over whole words, `words.len() == 4 · keys.len()`: AVX2 where
/// the processor has it (measured 3x the portable loop on 8448-byte items), else eight
/// independent sums of 32 × 32 → 64-bit products, which vectorize on any SIMD unit.
#[inline]
fn tabled(words: &[u8], keys: &[u32]) -> u64 {
    debug_assert_eq!(words.len(), 4 * keys.len());
    #[cfg(target_arch = "x86_64")]
    if words.len() >= 64 && has_avx2() {
        // SAFETY: AVX2 is present (checked); the slices are as long as the loop reads.
        return unsafe { tabled_avx2(words, keys) };
    }
    tabled_portable(words, keys)
}

fn tabled_portable(words: &[u8], keys: &[u32]) -> u64 {
    let mut acc = [0u64; 8];
    let mut wc = words.chunks_exact(32);
    let mut kc = keys.chunks_exact(8);
    for (w, k) in (&mut wc).zip(&mut kc) {
        for j in 0..8 {
            let x = u32::from_le_bytes([w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]]) as u64;
            acc[j] = acc[j].wrapping_add(k[j] as u64 * x);
        }
    }
    let mut sum = acc.iter().fold(0u64, |a, &b| a.wrapping_add(b));
    for (w, k) in wc.remainder().chunks_exact(4).zip(kc.remainder()) {
        sum = sum.wrapping_add(*k as u64 * u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as u64);
    }
    sum
}

#[cfg(target_arch = "x86_64")]
pub(crate) use crate::cpu_features::has_avx2;

mod copy;
pub(crate) use copy::{copy_and_sum, copy_and_sum_has_avx2, copy_sum_run};
#[cfg(target_arch = "x86_64")]
pub(crate) use copy::{copy_and_sum_avx2, BlockKeys};

/// [`tabled_portable`] with AVX2: per 32 bytes, one load of words and keys each, the even words'
/// products and (shifted down) the odd words', with no widening shuffle.
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn tabled_avx2(words: &[u8], keys: &[u32]) -> u64 {
    use std::arch::x86_64::*;
    let n = words.len() / 32;
    let (wp, kp) = (words.as_ptr(), keys.as_ptr() as *const u8);
    let (mut even, mut odd) = (_mm256_setzero_si256(), _mm256_setzero_si256());
    for i in 0..n {
        // SAFETY: `32 · i + 32 <= words.len() == 4 · keys.len()`.
        let (m, k) =
            unsafe { (_mm256_loadu_si256(wp.add(32 * i) as *const __m256i), _mm256_loadu_si256(kp.add(32 * i) as *const __m256i)) };
        even = _mm256_add_epi64(even, _mm256_mul_epu32(k, m));
        odd = _mm256_add_epi64(odd, _mm256_mul_epu32(_mm256_srli_epi64(k, 32), _mm256_srli_epi64(m, 32)));
    }
    let mut lanes = [0u64; 4];
    // SAFETY: a 32-byte store into a 32-byte array.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, _mm256_add_epi64(even, odd)) };
    let mut sum = lanes.iter().fold(0u64, |a, &b| a.wrapping_add(b));
    let done = n * 8;
    for (w, k) in words[done * 4..].chunks_exact(4).zip(&keys[done..]) {
        sum = sum.wrapping_add(*k as u64 * u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as u64);
    }
    sum
}

/// 64-bit FNV-1a of `bytes` (binds a checksum to a name, e.g. an object's key).
pub fn name_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

/// The checksum of one host item (what one index moves in one layer and component) as the copy
/// sees it: `heads` chunks of `chunk` bytes each (one unless the host layout splits heads), chunk
/// `h`'s words keyed from word `h · words(chunk)`. For chunks of whole words this is
/// [`checksum`] of the item's bytes on the device (where its chunks lie end to end); a chunk
/// with a partial last word is zero-padded on its own, so every executor gets the same bits (and
/// "a change within one word is always detected" holds per padded word of a chunk).
pub fn item_part(chunk: &[u8], head: u64, keys: &Keys) -> u64 {
    range_sum(chunk, (head as usize).saturating_mul(words(chunk.len())), keys)
}

/// [`item_part`] of each of `count` chunks of `chunk` bytes, chunk `h` at byte `h · stride` of
/// `region`, added: the checksum of one host item whose head chunks lie `stride` apart. `None`
/// where `region` is shorter than the last chunk's end. Chunks of whole 32-byte blocks whose keys
/// the table holds are summed by one vector loop over every chunk (per 256-byte chunk, the
/// generic [`range_sum`]'s entry and tail costs were more than its sum).
pub fn strided_item_sum(region: &[u8], stride: usize, count: usize, chunk: usize, keys: &Keys) -> Option<u64> {
    let end = count.checked_sub(1).map_or(Some(0), |last| last.checked_mul(stride)?.checked_add(chunk))?;
    if end > region.len() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    if chunk >= 32 && chunk.is_multiple_of(32) && count.checked_mul(chunk / 4).is_some_and(|w| w <= keys.table.len()) && has_avx2() {
        // SAFETY: AVX2 present (checked); every chunk lies inside `region` (checked above) and
        // the table holds `count · chunk / 4` keys (checked).
        return Some(unsafe { strided_avx2(region.as_ptr(), stride, count, chunk / 32, keys.table.as_ptr()) });
    }
    (0..count).try_fold(0u64, |sum, h| Some(sum.wrapping_add(item_part(region.get(h * stride..h * stride + chunk)?, h as u64, keys))))
}

/// [`strided_item_sum`]'s vector loop: `count` chunks of `blocks` 32-byte blocks, chunk `h` at
/// `base + h · stride`, their words keyed in order from `keys` (chunk `h` from word
/// `h · 8 · blocks`: the item's chunks keyed as if they lay end to end).
///
/// # Safety
/// AVX2 available; each chunk readable; `keys` valid for `count · 8 · blocks` words.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn strided_avx2(base: *const u8, stride: usize, count: usize, blocks: usize, keys: *const u32) -> u64 {
    use std::arch::x86_64::*;
    let mut kp = keys as *const u8;
    let (mut e0, mut o0, mut e1, mut o1) = (_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256());
    macro_rules! block {
        ($even:ident, $odd:ident, $src:expr, $k:expr) => {{
            // SAFETY: the block lies inside chunk `h` and its keys (see the contract).
            unsafe {
                let m = _mm256_loadu_si256($src as *const __m256i);
                let k = _mm256_loadu_si256($k as *const __m256i);
                $even = _mm256_add_epi64($even, _mm256_mul_epu32(k, m));
                $odd = _mm256_add_epi64($odd, _mm256_mul_epu32(_mm256_srli_epi64(k, 32), _mm256_srli_epi64(m, 32)));
            }
        }};
    }
    for h in 0..count {
        // SAFETY: chunk `h` starts here (see the contract).
        let src = unsafe { base.add(h * stride) };
        let mut b = 0;
        while b + 2 <= blocks {
            // Blocks `b` and `b + 1` of the chunk and of its keys.
            block!(e0, o0, src.add(32 * b), kp.add(32 * b));
            block!(e1, o1, src.add(32 * b + 32), kp.add(32 * b + 32));
            b += 2;
        }
        if b < blocks {
            // The chunk's last block and its keys.
            block!(e0, o0, src.add(32 * b), kp.add(32 * b));
        }
        // SAFETY: the next chunk's keys follow (the contract covers `count` chunks' keys).
        kp = unsafe { kp.add(32 * blocks) };
    }
    copy::lanes_sum(_mm256_add_epi64(_mm256_add_epi64(e0, o0), _mm256_add_epi64(e1, o1)))
}

pub use crate::error::ItemMismatch;

/// What the host pool's checksum table knows: per item `(unit, layer, component)` one word,
/// `checksum + 1` (wrapping), with 0 meaning "no checksum known": one store per item, in one
/// cache line (an item whose checksum is `2^64 - 1` is stored as unknown, so it loads as
/// unverified: one item in 2^64, never a false alarm). Written by the copies of backups (each
/// item by one lane: the planner makes destinations unique), read by the copies of loads; a
/// transfer's completion orders both for the caller.
pub(crate) struct ChecksumTable {
    entries: Box<[std::sync::atomic::AtomicU64]>,
    units: u64,
    comps: u64,
    keys: std::sync::Arc<Keys>,
    counts: [std::sync::atomic::AtomicU64; 4],
}

/// Counters of a host pool's checksums since it was made (see [`crate::HostPool::integrity_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct IntegrityStats {
    /// Items whose checksum a backup (or a storage write) recorded.
    pub recorded: u64,
    /// Items a load verified against their recorded checksum.
    pub verified: u64,
    /// Items loaded without a recorded checksum (never backed up with checksums, or written
    /// by something that does not compute them).
    pub unverified: u64,
    /// Items whose bytes did not match.
    pub mismatched: u64,
}

impl ChecksumTable {
    /// A table for `units × layers × comps` items of `heads` chunks of `chunk` bytes.
    pub(crate) fn new(units: u64, layers: u64, comps: u64, chunk: u64, heads: u64) -> crate::Result<ChecksumTable> {
        let n = units.checked_mul(layers).and_then(|x| x.checked_mul(comps));
        let oom = |requested: u64| crate::TransferError::OutOfMemory {
            what: "host pool checksum table".into(),
            requested,
            limit: "allocation failed".into(),
        };
        let n = n.and_then(|n| usize::try_from(n).ok()).ok_or_else(|| oom(u64::MAX))?;
        let entries = zeroed::<std::sync::atomic::AtomicU64>(n).ok_or_else(|| oom((n as u64).saturating_mul(8)))?;
        let item_words = usize::try_from(words(chunk as usize) as u64 * heads).map_err(|_| oom(u64::MAX))?;
        let keys = shared_keys(STORAGE_SEED, item_words)?;
        Ok(ChecksumTable { entries, units, comps, keys, counts: Default::default() })
    }
    /// The key stream items are checksummed with.
    pub(crate) fn keys(&self) -> &Keys {
        &self.keys
    }
    /// Slot of item `(unit, layer, comp)`; `None` outside the table.
    #[inline(always)]
    pub(crate) fn slot(&self, unit: u64, layer: u64, comp: u8) -> Option<usize> {
        if unit >= self.units || comp as u64 >= self.comps {
            return None;
        }
        let i = (layer.checked_mul(self.comps)? + comp as u64).checked_mul(self.units)?.checked_add(unit)?;
        (i < self.entries.len() as u64).then_some(i as usize)
    }
    /// The entries of `(layer, comp)`'s items, by unit (empty outside the table): a loop over
    /// one layer's items finds each entry with one bounds check.
    #[inline]
    pub(crate) fn layer_entries(&self, layer: u64, comp: u8) -> &[std::sync::atomic::AtomicU64] {
        let base = self.slot(0, layer, comp);
        base.and_then(|b| self.entries.get(b..b.checked_add(usize::try_from(self.units).ok()?)?)).unwrap_or(&[])
    }
    /// Records an item's checksum.
    #[inline(always)]
    pub(crate) fn record(&self, slot: usize, sum: u64) {
        if let Some(e) = self.entries.get(slot) {
            Self::record_entry(e, sum);
        }
    }
    /// The recorded checksum of an item, if one is known.
    #[inline(always)]
    pub(crate) fn expected(&self, slot: usize) -> Option<u64> {
        self.entries.get(slot).and_then(Self::entry_expected)
    }
    /// Records `sum` in an item's entry.
    #[inline(always)]
    pub(crate) fn record_entry(e: &std::sync::atomic::AtomicU64, sum: u64) {
        e.store(sum.wrapping_add(1), std::sync::atomic::Ordering::Relaxed);
    }
    /// Forgets the checksum an item's entry holds.
    #[inline(always)]
    pub(crate) fn forget_entry(e: &std::sync::atomic::AtomicU64) {
        e.store(0, std::sync::atomic::Ordering::Relaxed);
    }
    /// The checksum an item's entry holds, if one is known.
    #[inline(always)]
    pub(crate) fn entry_expected(e: &std::sync::atomic::AtomicU64) -> Option<u64> {
        let v = e.load(std::sync::atomic::Ordering::Relaxed);
        (v != 0).then(|| v.wrapping_sub(1))
    }
    /// Forgets an item's checksum (its bytes were written by something that did not compute one).
    pub(crate) fn forget(&self, slot: usize) {
        if let Some(e) = self.entries.get(slot) {
            e.store(0, std::sync::atomic::Ordering::Relaxed);
        }
    }
    /// Forgets every checksum.
    pub(crate) fn forget_all(&self) {
        for e in self.entries.iter() {
            e.store(0, std::sync::atomic::Ordering::Relaxed);
        }
    }
    /// Flips bits `xor` (nonzero) of a recorded checksum (fault injection: a corrupted table
    /// entry); a flip that would leave the entry reading "unknown" flips one bit more.
    pub(crate) fn corrupt(&self, slot: usize, xor: u64) -> bool {
        match self.entries.get(slot) {
            Some(e) if self.expected(slot).is_some() && xor != 0 => {
                let v = e.load(std::sync::atomic::Ordering::Relaxed);
                let x = if v ^ xor == 0 { xor ^ 1 } else { xor };
                e.store(v ^ x, std::sync::atomic::Ordering::Relaxed);
                true
            }
            _ => false,
        }
    }
    /// Adds to the counters: recorded, verified, unverified, mismatched.
    pub(crate) fn count(&self, n: [u64; 4]) {
        use std::sync::atomic::Ordering::Relaxed;
        for (c, n) in self.counts.iter().zip(n) {
            if n > 0 {
                c.fetch_add(n, Relaxed);
            }
        }
    }
    pub(crate) fn stats(&self) -> IntegrityStats {
        use std::sync::atomic::Ordering::Relaxed;
        IntegrityStats {
            recorded: self.counts[0].load(Relaxed),
            verified: self.counts[1].load(Relaxed),
            unverified: self.counts[2].load(Relaxed),
            mismatched: self.counts[3].load(Relaxed),
        }
    }
}

/// Atomics whose all-zero bytes are a valid value (zero, `false`).
trait ZeroIsValid {}
impl ZeroIsValid for std::sync::atomic::AtomicU64 {}

/// `n` zeroed values from the allocator's zeroed memory: for a table the size of a large host
/// pool, the OS hands out zero pages on first touch instead of every entry being written up
/// front. `None` when the allocation is refused.
fn zeroed<T: ZeroIsValid>(n: usize) -> Option<Box<[T]>> {
    if n == 0 || std::mem::size_of::<T>() == 0 {
        return Some(Box::new([]));
    }
    let layout = std::alloc::Layout::array::<T>(n).ok()?;
    // SAFETY: a non-zero size; null is a refused allocation. All-zero bytes are a valid `T`
    // (`AtomicU64` has the in-memory representation of `u64`), and
    // the box frees the memory with the same layout (`Box<[T]>` of `n` elements).
    unsafe {
        let p = std::alloc::alloc_zeroed(layout) as *mut T;
        if p.is_null() {
            return None;
        }
        Some(Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, n)))
    }
}

/// Mismatches found by one transfer's copies (rare: a lock is cheap enough).
#[derive(Default)]
pub(crate) struct MismatchSink {
    found: std::sync::Mutex<Vec<ItemMismatch>>,
}

impl MismatchSink {
    pub(crate) fn push(&self, m: ItemMismatch) {
        self.found.lock().unwrap_or_else(|e| e.into_inner()).push(m);
    }
    /// The transfer's error, if any item mismatched.
    pub(crate) fn error(&self) -> Option<crate::TransferError> {
        mismatch_error(self.found.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }
}

/// The [`crate::TransferError::Integrity`] of `items` (sorted by layer, component and host
/// index; the first one's fields on the error), `None` when there are none.
pub(crate) fn mismatch_error(mut items: Vec<ItemMismatch>) -> Option<crate::TransferError> {
    items.sort_by_key(|m| (m.layer, m.component, m.host_index));
    let first = *items.first()?;
    Some(crate::TransferError::Integrity {
        layer: first.layer,
        host_index: first.host_index,
        device_index: first.device_index,
        expected: first.expected,
        found: first.found,
        items,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// `checksum(b"hicache-io integrity")` with the storage seed (stored objects' format: trailer `HIOSUM03`).
    const KNOWN: u64 = 16_945_557_311_944_231_580;

    fn data(len: usize, seed: u64) -> Vec<u8> {
        let mut v = vec![0u8; len];
        Rng::new(seed).fill(&mut v);
        v
    }

    #[test]
    fn parts_add_up_to_the_whole() {
        let keys = Keys::new(STORAGE_SEED, 300).unwrap();
        let m = data(1001, 1);
        let whole = checksum(&m, &keys);
        for split in [0usize, 4, 8, 400, 996, 1000] {
            let (a, b) = m.split_at(split);
            assert_eq!(range_sum(a, 0, &keys).wrapping_add(range_sum(b, split / 4, &keys)), whole, "split at {split}");
        }
        // Keys past the table are the stream's own, also for a piece that starts past it.
        let short = Keys::new(STORAGE_SEED, 10).unwrap();
        assert_eq!(checksum(&m, &short), whole);
        let (a, b) = m.split_at(600);
        assert_eq!(range_sum(a, 0, &short).wrapping_add(range_sum(b, 150, &short)), whole);
    }

    #[test]
    fn the_vector_loop_and_the_portable_loop_agree() {
        let keys = Keys::new(STORAGE_SEED, 3000).unwrap();
        for len in [0usize, 4, 60, 64, 68, 1152, 8448, 12000] {
            let m = data(len, len as u64);
            let k = &keys.table()[..len / 4];
            assert_eq!(tabled(&m, k), tabled_portable(&m, k), "{len} bytes");
        }
        // Known value (the format of stored checksums): changing it breaks stores.
        assert_eq!(checksum(b"hicache-io integrity", &Keys::new(STORAGE_SEED, 8).unwrap()), KNOWN);
    }

    #[test]
    fn copying_and_summing_in_one_pass_is_the_copy_and_the_checksum() {
        let keys = Keys::new(STORAGE_SEED, 4000).unwrap();
        for (len, first, stream) in
            [(8448usize, 0usize, true), (1152, 10, false), (100, 3, true), (3, 0, false), (12000, 0, true), (640, 3800, false)]
        {
            let m = data(len, 9);
            let mut out = vec![0u8; len + 32];
            let at = out.as_mut_ptr().align_offset(32);
            // SAFETY: `len` bytes of each, disjoint.
            let sum = unsafe { copy_and_sum(m.as_ptr(), out.as_mut_ptr().add(at), len, first, &keys, stream) };
            assert_eq!(&out[at..at + len], &m[..], "{len}");
            assert_eq!(sum, range_sum(&m, first, &keys), "{len} at word {first}");
        }
    }

    #[test]
    fn a_strided_item_sum_is_the_sum_of_its_chunks_parts() {
        let keys = Keys::new(STORAGE_SEED, 4096).unwrap();
        // (chunk, count, stride): vector chunks (odd and even block counts), a chunk past the
        // table, partial words, contiguous chunks, one chunk, none.
        for (chunk, count, stride) in
            [(256usize, 4usize, 1024usize), (96, 3, 100), (32, 8, 32), (4096, 8, 4096), (100, 4, 128), (6, 5, 7), (256, 1, 0), (256, 0, 0)]
        {
            let region = data(count.saturating_sub(1) * stride + chunk, chunk as u64);
            let want = (0..count).fold(0u64, |s, h| s.wrapping_add(item_part(&region[h * stride..h * stride + chunk], h as u64, &keys)));
            assert_eq!(strided_item_sum(&region, stride, count, chunk, &keys), Some(want), "{chunk} x {count} at {stride}");
            if count > 0 {
                assert_eq!(strided_item_sum(&region[..region.len() - 1], stride, count, chunk, &keys), None, "short region");
            }
        }
        // Contiguous chunks of whole words are the checksum of the item's bytes.
        let m = data(1024, 5);
        assert_eq!(strided_item_sum(&m, 256, 4, 256, &keys), Some(checksum(&m, &keys)));
        // Sizes that overflow are refused, not wrapped.
        assert_eq!(strided_item_sum(&m, usize::MAX, 3, 256, &keys), None);
    }

    #[test]
    fn a_run_copied_with_two_key_streams_is_the_copy_its_checksum_and_its_chunks_parts() {
        let obj = Keys::new(STORAGE_SEED, 4096).unwrap();
        let item = Keys::new(STORAGE_SEED ^ 1, 4096).unwrap();
        // (chunk, chunks, first object word, first item word): the vector loop, the portable one.
        for (chunk, n, ow, iw) in [(256usize, 16usize, 0usize, 64usize), (32, 3, 8, 0), (96, 5, 100, 24), (12, 7, 3, 1)] {
            let from = data(chunk * n, chunk as u64);
            let mut to = vec![0u8; from.len()];
            let mut sums = vec![5u64; n];
            let got = copy_sum_run(&from, &mut to, chunk, &obj.table()[ow..], &item.table()[iw..], &mut sums);
            assert_eq!(to, from, "{chunk} x {n}");
            assert_eq!(got, Some(range_sum(&from, ow, &obj)), "{chunk} x {n}");
            for (c, s) in sums.iter().enumerate() {
                assert_eq!(*s, 5u64.wrapping_add(range_sum(&from[c * chunk..(c + 1) * chunk], iw, &item)), "{chunk} x {n}: chunk {c}");
            }
        }
        // Refused, nothing copied: a partial word, a chunk that does not divide the run, short keys or sums.
        let from = data(256, 1);
        let mut to = vec![0u8; 256];
        for (chunk, o, i, n) in
            [(6usize, 4096usize, 4096usize, 1usize), (96, 4096, 4096, 2), (256, 63, 4096, 1), (256, 4096, 63, 1), (128, 4096, 4096, 1)]
        {
            let mut sums = vec![0u64; n];
            assert_eq!(copy_sum_run(&from, &mut to, chunk, &obj.table()[..o], &item.table()[..i], &mut sums), None, "{chunk}");
            assert!(to.iter().all(|&b| b == 0));
        }
    }

    /// The table is the stream the shaders compute: `mix32(key_base(seed, 0) ^ i) | 1` below
    /// 2^32 words, another base per 2^32 words above; keys odd, and seeds give other streams.
    #[test]
    fn the_key_table_is_the_computed_stream() {
        let k = Keys::new(STORAGE_SEED, 4096).unwrap();
        let base = key_base(STORAGE_SEED, 0);
        for (i, &t) in k.table().iter().enumerate() {
            assert_eq!(t, key(STORAGE_SEED, i as u64));
            assert_eq!(t, mix32(base ^ i as u32) | 1);
            assert_eq!(t & 1, 1);
        }
        assert_ne!(key(STORAGE_SEED, 1 << 32), key(STORAGE_SEED, 0));
        assert_ne!(k.table()[..64], Keys::new(STORAGE_SEED ^ 1, 64).unwrap().table()[..]);
        // mix32 is a bijection: distinct positions, distinct values before the low bit is set.
        let mut seen: Vec<u32> = (0..1u32 << 16).map(|i| mix32(base ^ i)).collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 1 << 16);
    }

    #[test]
    fn every_change_within_one_word_is_detected() {
        let keys = Keys::new(7, 64).unwrap();
        let m = data(256, 2);
        let h = checksum(&m, &keys);
        for word in 0..64 {
            // Every single bit, and bursts within the word.
            for pattern in (0..32).map(|b| 1u32 << b).chain([0xffff_ffff, 0x8000_0001, 0x00ff_ff00]) {
                let mut c = m.clone();
                let w = u32::from_le_bytes(c[word * 4..word * 4 + 4].try_into().unwrap()) ^ pattern;
                c[word * 4..word * 4 + 4].copy_from_slice(&w.to_le_bytes());
                assert_ne!(checksum(&c, &keys), h, "word {word} pattern {pattern:#x}");
            }
        }
    }

    #[test]
    fn swapped_words_and_random_changes_are_detected() {
        let keys = Keys::new(9, 64).unwrap();
        let m = data(256, 3);
        let h = checksum(&m, &keys);
        let mut r = Rng::new(4);
        for _ in 0..2000 {
            let mut c = m.clone();
            let (a, b) = (r.below(64) as usize, r.below(64) as usize);
            if c[a * 4..a * 4 + 4] == c[b * 4..b * 4 + 4] {
                continue;
            }
            for k in 0..4 {
                c.swap(a * 4 + k, b * 4 + k);
            }
            assert_ne!(checksum(&c, &keys), h);
        }
        // The top bit of two words at once: the weakest change for sums mod 2^32, caught here.
        let mut c = m.clone();
        c[3] ^= 0x80;
        c[7] ^= 0x80;
        assert_ne!(checksum(&c, &keys), h);
    }
}
