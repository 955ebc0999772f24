//! The integrity trailers of sealed objects in an L3 store's staging buffer (object `j` at byte
//! `j · stride`, its 16-byte trailer `at` bytes into that slot), sealed and checked in the same
//! native call as the staging pass: per object its key's tag, the trailer's two words, and on a
//! get the verdict, with no per-object Python. Bounds are checked before anything is written.

use crate::local_io::{TRAILER_BYTES, TRAILER_MAGIC};

/// Trailers of earlier key streams (`HIOSUM01`, `HIOSUM02`): their objects read as unverified
/// (exported as `OLD_TRAILER_MAGICS`: Python's trailer module takes them from here).
pub(crate) const OLD_TRAILER_MAGICS: [u64; 2] = [u64::from_le_bytes(*b"HIOSUM01"), u64::from_le_bytes(*b"HIOSUM02")];

/// A get's verdict on one object (what `hicache_io.l3.trailer.verify` decides, one code each;
/// exported as `SEALED_VERDICTS` in this order).
pub(crate) const NOT_READ: u8 = 0;
pub(crate) const VERIFIED: u8 = 1;
pub(crate) const UNVERIFIED: u8 = 2;
pub(crate) const CORRUPT: u8 = 3;

/// Where the trailers of `n` objects lie in a staging buffer of `len` bytes: refused (naming the
/// numbers) where a trailer would pass its slot or the last slot the buffer.
pub(crate) fn check(n: usize, len: usize, stride: usize, at: usize) -> Result<(), String> {
    let fits = at.checked_add(TRAILER_BYTES).is_some_and(|end| end <= stride);
    let room = n.checked_mul(stride).is_some_and(|need| need <= len);
    if !fits || !room {
        return Err(format!("{n} sealed objects of stride {stride} with trailers at byte {at} do not fit a staging buffer of {len} bytes"));
    }
    Ok(())
}

fn slot(staging: &[u8], j: usize, stride: usize, at: usize) -> [u64; 2] {
    let t = &staging[j * stride + at..j * stride + at + TRAILER_BYTES];
    [u64::from_le_bytes(t[..8].try_into().unwrap_or_default()), u64::from_le_bytes(t[8..].try_into().unwrap_or_default())]
}

/// The key tag of each name (FNV-1a of its UTF-8 bytes).
pub(crate) fn tags(keys: &[String]) -> Vec<u64> {
    keys.iter().map(|k| hicache_io::integrity::name_hash(k.as_bytes())).collect()
}

/// Writes object `j`'s trailer (the magic, `sums[j] ^ tags[j]`) into its slot, for every `j`.
/// The caller checked the slots ([`check`] for `sums.len()` objects) and `tags.len() == sums.len()`.
pub(crate) fn seal(staging: &mut [u8], stride: usize, at: usize, sums: &[u64], tags: &[u64]) {
    for (j, (sum, tag)) in sums.iter().zip(tags).enumerate() {
        let t = &mut staging[j * stride + at..j * stride + at + TRAILER_BYTES];
        t[..8].copy_from_slice(&TRAILER_MAGIC.to_le_bytes());
        t[8..].copy_from_slice(&(sum ^ tag).to_le_bytes());
    }
}

/// Before a landing: per object, whether its trailer may vouch for it (read whole with a trailer
/// of this format) and the checksum that trailer expects.
pub(crate) fn expected(
    staging: &[u8],
    stride: usize,
    at: usize,
    tags: &[u64],
    whole: &[bool],
    with_trailer: &[bool],
) -> (Vec<u64>, Vec<bool>) {
    tags.iter()
        .enumerate()
        .map(|(j, tag)| {
            let [magic, word] = slot(staging, j, stride, at);
            (word ^ tag, whole[j] && with_trailer[j] && magic == TRAILER_MAGIC)
        })
        .unzip()
}

/// After a landing: each object's verdict from its trailer and the checksum of what landed
/// (`sums`): not read whole; unverified (read without a trailer, or with one of an earlier
/// format); verified; or corrupt (any other trailer, or another checksum).
pub(crate) fn verdicts(
    staging: &[u8],
    stride: usize,
    at: usize,
    tags: &[u64],
    sums: &[u64],
    whole: &[bool],
    with_trailer: &[bool],
) -> Vec<u8> {
    (0..tags.len())
        .map(|j| {
            let [magic, word] = slot(staging, j, stride, at);
            if !whole[j] {
                NOT_READ
            } else if !with_trailer[j] || OLD_TRAILER_MAGICS.contains(&magic) {
                UNVERIFIED
            } else if magic == TRAILER_MAGIC && word == sums[j] ^ tags[j] {
                VERIFIED
            } else {
                CORRUPT
            }
        })
        .collect()
}
