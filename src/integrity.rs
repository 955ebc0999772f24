//! Checksums of KV bytes: a multilinear hash over 32-bit words, built so that lanes of a copy can
//! compute it in parallel and add their parts.
//!
//! `checksum(m) = Σ_i k_i · m_i  (mod 2^64)`, where `m_i` is the `i`-th little-endian 32-bit word
//! of the bytes (a tail shorter than a word is zero-padded) and `k_i` is the `i`-th key of a
//! seeded key stream, always odd. The sum of [`partial`] over disjoint word ranges is the
//! checksum of the whole, whatever the split, so every executor and lane layout gives the same
//! bits.
//!
//! What it guarantees, for keys that do not depend on the data:
//! - **always detected**: any change confined to one 32-bit word (a single bit flip, any burst
//!   within a word): its term changes by `k_i · Δ` with `k_i` odd and `0 < |Δ| < 2^32`, which is
//!   never `0 (mod 2^64)`;
//! - **otherwise** two different byte strings of one length have the same checksum with
//!   probability at most `2^-32` over random odd keys: take the changed word whose change has the
//!   fewest trailing zero bits `t <= 31`; a collision fixes its key modulo `2^(64 - t)`, and an odd
//!   key has 63 random bits, so the chance is `2^-(63 - t) <= 2^-32`. With the fixed public seed
//!   of shared storage this is a bound for errors that do not depend on the keys (faults and
//!   bugs), not against an adversary.
//!
//! It is not a cryptographic MAC: the key stream is public (stores on several machines must agree
//! on it), so it catches corruption and misplaced pages, not forgery. Checks that must tell pages
//! apart also bind where a page belongs (the L3 store folds the object's key into its tag).

/// The key stream's seed for pages in shared storage (every process and machine must use the
/// same one to verify what another wrote).
pub const STORAGE_SEED: u64 = 0x6869_6361_6368_6531; // "hicache1"

/// `splitmix64`: a fast, well-mixed 64-bit finaliser.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Key `i` of the stream seeded by `seed` (odd).
#[inline]
pub fn key(seed: u64, i: u64) -> u64 {
    mix(seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1
}

/// Keys `0 .. words` of a stream, computed once for many checksums (each key is a few
/// multiplies; the checksum itself is one multiply-add per word).
#[derive(Debug, Clone)]
pub struct Keys {
    seed: u64,
    table: Vec<u64>,
}

impl Keys {
    /// Keys for words `0 .. words`.
    pub fn new(seed: u64, words: usize) -> crate::Result<Keys> {
        let mut table = Vec::new();
        table.try_reserve_exact(words).map_err(|_| crate::TransferError::OutOfMemory {
            what: "checksum key table".into(),
            requested: (words as u64).saturating_mul(8),
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
}

/// A key table of at least `words` words for `seed`, shared by the process: building one costs a
/// few multiplies per word, far more than a checksum's multiply-add, so tables are kept (one per
/// seed, grown to the longest asked for: 8 bytes of key per 4-byte word, twice the page).
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
    partial(bytes, 0, keys)
}

/// The checksum terms of `bytes` taken as words `first_word ..` of a longer string: the checksum
/// of a string is the sum of `partial` over any split of it into word-aligned pieces (every piece
/// but the last a whole number of words: a partial word is zero-padded).
pub fn partial(bytes: &[u8], first_word: usize, keys: &Keys) -> u64 {
    let table = keys.table.get(first_word..).unwrap_or(&[]);
    let covered = (bytes.len() / 4).min(table.len());
    let mut sum = tabled(&bytes[..covered * 4], &table[..covered]);
    let chunks = bytes[covered * 4..].chunks_exact(4);
    let mut i = covered;
    // Past the table (or a table that was not made long enough): keys computed in place.
    for w in chunks {
        let k = key(keys.seed, (first_word + i) as u64);
        sum = sum.wrapping_add(k.wrapping_mul(u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as u64));
        i += 1;
    }
    let rest = bytes.chunks_exact(4).remainder();
    debug_assert_eq!(i, bytes.len() / 4);
    if !rest.is_empty() {
        let mut w = [0u8; 4];
        w[..rest.len()].copy_from_slice(rest);
        let k = table.get(i).copied().unwrap_or_else(|| key(keys.seed, (first_word + i) as u64));
        sum = sum.wrapping_add(k.wrapping_mul(u32::from_le_bytes(w) as u64));
    }
    sum
}

/// `Σ keys[i] · word_i (mod 2^64)` over whole words, `words.len() == 4 · keys.len()`. Eight
/// independent sums, each product as two 32 × 32 → 64-bit multiplies (`k · w = k_lo · w +
/// (k_hi · w) << 32` mod 2^64), so the loop vectorizes (measured 3x faster than one
/// accumulator of 64 × 64-bit multiplies).
fn tabled(words: &[u8], keys: &[u64]) -> u64 {
    debug_assert_eq!(words.len(), 4 * keys.len());
    let mut acc = [0u64; 8];
    let mut wc = words.chunks_exact(32);
    let mut kc = keys.chunks_exact(8);
    for (w, k) in (&mut wc).zip(&mut kc) {
        for j in 0..8 {
            let x = u32::from_le_bytes([w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]]) as u64;
            let (lo, hi) = (k[j] & 0xffff_ffff, k[j] >> 32);
            acc[j] = acc[j].wrapping_add((lo * x).wrapping_add((hi * x) << 32));
        }
    }
    let mut sum = acc.iter().fold(0u64, |a, &b| a.wrapping_add(b));
    for (w, k) in wc.remainder().chunks_exact(4).zip(kc.remainder()) {
        sum = sum.wrapping_add(k.wrapping_mul(u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as u64));
    }
    sum
}

/// 64-bit FNV-1a of `bytes` (binds a checksum to a name, e.g. an object's key).
pub fn name_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

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
            assert_eq!(partial(a, 0, &keys).wrapping_add(partial(b, split / 4, &keys)), whole, "split at {split}");
        }
        // Keys past the table are the stream's own, also for a piece that starts past it.
        let short = Keys::new(STORAGE_SEED, 10).unwrap();
        assert_eq!(checksum(&m, &short), whole);
        let (a, b) = m.split_at(600);
        assert_eq!(partial(a, 0, &short).wrapping_add(partial(b, 150, &short)), whole);
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
