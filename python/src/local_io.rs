//! The local L3 store's byte path (`hicache_io.l3.local`): page objects between the caller's
//! registered memory and files, one system call per object each way where it can (`preadv` /
//! `pwritev`), with the GIL released and large objects spread over a few threads.
//!
//! File format (written, read and checked here only; the Python scrub calls [`local_intact`]): the object's bytes, its key,
//! then a 32-byte footer: `HIOLOC01`, the object's length (u64), the key's length (u32), the
//! CRC-32 (IEEE, as zlib's) of the object's bytes (u32), a flags byte, 7 zero bytes;
//! little-endian. Flags 0: the CRC is recorded. Flags 1 ([`NO_CRC`]): an object that ends in
//! hicache-io's trailer, whose checksum verifies it, records none (CRC 0), so its bytes are
//! hashed once, not twice; a build from before the flag reads such an object as damaged where
//! it checks the CRC (a miss, never data), and removes it. Flags or padding this build does not
//! know (a later format's) read as a miss, and the file is left.
//!
//! Every span is checked to lie inside a region the caller registered before any byte moves:
//! an address from Python reaches a system call only inside memory the caller vouched for. An
//! object with a span outside answers `INVALID_PARAMS`, as Mooncake answers a bad buffer.

use std::ffi::CString;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyList};
use sha2::{Digest, Sha256};

use crate::local_free::{hold_for_read, put_claimed, FreeFiles, RECYCLE_MIN};
use crate::local_read::{read_object, ReadHistory};
use crate::IntoPy;

/// Bytes of the footer (exported as `LOCAL_FOOTER_BYTES`: Python sizes files by it).
pub(crate) const FOOTER: usize = 32;
const FOOTER_MAGIC: &[u8; 8] = b"HIOLOC01";
/// The footer's flag (its byte 24): no CRC recorded, the object's trailer verifies it.
const NO_CRC: u8 = 1;
/// hicache-io's integrity trailer (the store verifies objects that end in one): its first word,
/// and its bytes (that word, then the object's checksum bound to its key). The one spelling of
/// the format: Python's `hicache_io.l3.trailer` takes both from here.
pub(crate) const TRAILER_MAGIC: u64 = u64::from_le_bytes(*b"HIOSUM03");
pub(crate) const TRAILER_BYTES: usize = 16;
/// Mooncake's codes, as the store reads them.
pub(crate) const OBJECT_NOT_FOUND: i64 = -704;
pub(crate) const INVALID_PARAMS: i64 = -600;
pub(crate) const BUFFER_MISMATCH: i64 = -800;
/// A file whose footer does not hold or whose bytes fail their CRC: the caller removes it.
pub(crate) const DAMAGED: i64 = -100_003;
/// Objects of at least this many bytes (on average) move on several threads.
const PARALLEL_BYTES: usize = 64 << 10;
/// Buffers one vectored call takes (Linux's `IOV_MAX`).
pub(crate) const IOV_MAX: usize = 1024;
/// How a put writes its files: `fsync` (each file flushed before it is published), `direct`
/// (objects of [`DIRECT_MIN`] and more whose first span starts on a page written with `O_DIRECT`,
/// so they bypass the page cache), `start_writeback` (buffered files' writeback started as each
/// is written, so that they stay cached without piling up dirty pages).
#[derive(Clone, Copy)]
struct WriteRule {
    fsync: bool,
    direct: bool,
    start_writeback: bool,
}

/// Objects at least this large whose first span starts on a page are written with `O_DIRECT`
/// where the put asks for it and the file system takes it: sustained buffered writes of new files
/// ran at a fifth to a tenth of the disk's speed on this project's CI machine kind.
pub(crate) const DIRECT_MIN: usize = 1 << 20;
/// `O_DIRECT`'s alignment of addresses, offsets and lengths (a page covers every block size).
pub(crate) const DIRECT_ALIGN: usize = 4096;
/// At most this many bytes of a direct put are written buffered after its pages (and of a
/// direct get read through its aligned bounce buffer).
pub(crate) const DIRECT_REST_MAX: usize = 256 << 10;

pub(crate) type Span = (usize, usize);

/// Per object, its spans `(address, bytes)`: `ptrs[j]` is an address and `sizes[j]` a size, or
/// both are lists of them.
fn spans_arg(ptrs: &Bound<'_, PyList>, sizes: &Bound<'_, PyList>) -> PyResult<Vec<Vec<Span>>> {
    if ptrs.len() != sizes.len() {
        return Err(PyValueError::new_err(format!("{} objects' addresses but {} sizes", ptrs.len(), sizes.len())));
    }
    let mut out = Vec::with_capacity(ptrs.len());
    for (p, s) in ptrs.iter().zip(sizes.iter()) {
        if let Ok(a) = p.extract::<usize>() {
            out.push(vec![(a, s.extract::<usize>()?)]);
            continue;
        }
        let (a, n): (Vec<usize>, Vec<usize>) = (p.extract()?, s.extract()?);
        if a.len() != n.len() {
            return Err(PyValueError::new_err(format!("an object of {} addresses but {} sizes", a.len(), n.len())));
        }
        out.push(a.into_iter().zip(n).collect());
    }
    Ok(out)
}

/// Where object `key` lives under folder `objects`: `<objects>/<h[..2]>/<h>`, `h` the SHA-256 of
/// the key in hex (256 folders of at most a few thousand files each at a laptop's capacity).
fn object_path(objects: &str, key: &[u8]) -> String {
    let h = key_hash(key);
    format!("{objects}/{}/{h}", &h[..2])
}

fn key_hash(key: &[u8]) -> String {
    Sha256::digest(key).iter().map(|b| format!("{b:02x}")).collect()
}

/// The files of objects `keys` under folder `objects` (see [`object_path`]).
#[pyfunction]
pub(crate) fn local_paths(objects: &str, keys: Vec<String>) -> Vec<String> {
    keys.iter().map(|k| object_path(objects, k.as_bytes())).collect()
}

/// Whether every span lies inside one registered region.
pub(crate) fn inside(regions: &[Span], spans: &[Span]) -> bool {
    spans.iter().all(|&(p, n)| {
        p.checked_add(n)
            .is_some_and(|end| regions.iter().any(|&(base, len)| base <= p && base.checked_add(len).is_some_and(|top| end <= top)))
    })
}

pub(crate) fn errno() -> i64 {
    -(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO) as i64)
}

pub(crate) fn cpath(p: &str) -> Option<CString> {
    CString::new(p).ok()
}

/// An open file descriptor, closed when dropped.
pub(crate) struct Fd(pub(crate) libc::c_int);

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: the descriptor is ours and open; closed once.
        unsafe { libc::close(self.0) };
    }
}

/// Reads (`write` false) or writes every byte of `iov` from file offset 0, at most `IOV_MAX`
/// buffers a call, until done or a read meets the end of the file; the bytes moved, or a code.
pub(crate) fn vectored(fd: &Fd, iov: Vec<libc::iovec>, write: bool) -> Result<usize, i64> {
    vectored_at(fd, iov, write, 0)
}

/// [`vectored`] from file offset `base`.
pub(crate) fn vectored_at(fd: &Fd, iov: Vec<libc::iovec>, write: bool, base: usize) -> Result<usize, i64> {
    match vectored_progress(fd, iov, write, base) {
        (_, Some(e)) => Err(e),
        (n, None) => Ok(n),
    }
}

/// [`vectored_at`], keeping what moved before an error: the bytes moved, and the error (a code)
/// that stopped it, if any.
pub(crate) fn vectored_progress(fd: &Fd, mut iov: Vec<libc::iovec>, write: bool, base: usize) -> (usize, Option<i64>) {
    let (mut offset, mut first) = (0usize, 0usize);
    while first < iov.len() {
        let end = (first + IOV_MAX).min(iov.len());
        let cnt = (end - first) as libc::c_int;
        // SAFETY: every iovec names a span checked to lie inside registered memory, or a buffer
        // of this function's caller; the count is within the vector.
        let n = unsafe {
            if write {
                libc::pwritev(fd.0, iov[first..].as_ptr(), cnt, (base + offset) as libc::off_t)
            } else {
                libc::preadv(fd.0, iov[first..].as_ptr(), cnt, (base + offset) as libc::off_t)
            }
        };
        if n < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return (offset, Some(errno()));
        }
        if n == 0 {
            break;
        }
        offset += n as usize;
        first += skip(&mut iov[first..], n as usize);
    }
    (offset, None)
}

/// Advances `iov` past `n` bytes: the buffers wholly covered (their count, returned) and the
/// start of the next one.
fn skip(iov: &mut [libc::iovec], mut n: usize) -> usize {
    let mut first = 0;
    while first < iov.len() && n >= iov[first].iov_len {
        n -= iov[first].iov_len;
        first += 1;
    }
    if n > 0 && first < iov.len() {
        // SAFETY: advancing within the same buffer (n < its length).
        iov[first].iov_base = unsafe { (iov[first].iov_base as *mut u8).add(n) } as *mut libc::c_void;
        iov[first].iov_len -= n;
    }
    first
}

pub(crate) fn iovecs(spans: &[Span]) -> Vec<libc::iovec> {
    spans.iter().map(|&(p, n)| libc::iovec { iov_base: p as *mut libc::c_void, iov_len: n }).collect()
}

/// The CRC-32 of the spans' bytes in order.
pub(crate) fn crc_of(spans: &[Span]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for &(p, n) in spans {
        // SAFETY: the span lies inside registered memory (checked by the caller of this module's
        // entry points); it is only read.
        h.update(unsafe { std::slice::from_raw_parts(p as *const u8, n) });
    }
    h.finalize()
}

/// The bytes of `spans` as slices, empty spans left out (no pointer is taken from them).
fn pieces(spans: &[Span]) -> Vec<&[u8]> {
    // SAFETY: each span lies inside registered memory (checked by the caller of this module's
    // entry points); only read, while the call that checked it runs.
    spans.iter().filter(|s| s.1 > 0).map(|&(p, n)| unsafe { std::slice::from_raw_parts(p as *const u8, n) }).collect()
}

/// The object's last [`TRAILER_BYTES`] bytes, wherever `pieces` split them (`None` for a
/// shorter object).
fn object_tail(pieces: &[&[u8]]) -> Option<[u8; TRAILER_BYTES]> {
    let mut tail = [0u8; TRAILER_BYTES];
    let mut need = TRAILER_BYTES;
    for piece in pieces.iter().rev() {
        let take = piece.len().min(need);
        tail[need - take..need].copy_from_slice(&piece[piece.len() - take..]);
        need -= take;
        if need == 0 {
            return Some(tail);
        }
    }
    None
}

/// Whether an object (given in `pieces`) ends in hicache-io's integrity trailer.
fn ends_in_trailer(pieces: &[&[u8]]) -> bool {
    object_tail(pieces).is_some_and(|t| t[..8] == TRAILER_MAGIC.to_le_bytes())
}

/// Whether the object ends in hicache-io's integrity trailer (which the store verifies).
pub(crate) fn carries_trailer(spans: &[Span]) -> bool {
    ends_in_trailer(&pieces(spans))
}

fn footer(n: usize, key: &[u8], crc: Option<u32>) -> Vec<u8> {
    let mut f = Vec::with_capacity(key.len() + FOOTER);
    f.extend_from_slice(key);
    f.extend_from_slice(FOOTER_MAGIC);
    f.extend_from_slice(&(n as u64).to_le_bytes());
    f.extend_from_slice(&(key.len() as u32).to_le_bytes());
    f.extend_from_slice(&crc.unwrap_or(0).to_le_bytes());
    f.push(if crc.is_some() { 0 } else { NO_CRC });
    f.extend_from_slice(&[0u8; 7]);
    f
}

/// What a footer that names its object and key records.
#[derive(Clone, Copy)]
enum Recorded {
    /// The object's CRC.
    Crc(u32),
    /// No CRC: the object's trailer verifies it.
    NoCrc,
    /// Flags (or padding) this build does not know: a later format's, not this build's to read
    /// or to remove.
    Later,
}

/// What the footer `f` (the file's last [`FOOTER`] bytes) records, where it is this format's and
/// names an object of `n` bytes and a key of `klen` bytes; `None` where it does not hold.
fn footer_holds(f: &[u8], n: usize, klen: usize) -> Option<Recorded> {
    let f: &[u8; FOOTER] = f.try_into().ok()?;
    let (magic, rest) = f.split_first_chunk::<8>()?;
    let (len, rest) = rest.split_first_chunk::<8>()?;
    let (kl, rest) = rest.split_first_chunk::<4>()?;
    let (crc, rest) = rest.split_first_chunk::<4>()?;
    let (&flags, pad) = rest.split_first()?;
    let crc = u32::from_le_bytes(*crc);
    let recorded = match flags {
        _ if pad.iter().any(|&b| b != 0) => Recorded::Later,
        0 => Recorded::Crc(crc),
        NO_CRC if crc == 0 => Recorded::NoCrc,
        _ => Recorded::Later,
    };
    (magic == FOOTER_MAGIC && u64::from_le_bytes(*len) == n as u64 && u32::from_le_bytes(*kl) as usize == klen).then_some(recorded)
}

/// Whether an object read into `spans` (key `key`) holds what its footer records (`crc`): the
/// CRC, checked where nothing else verifies the object (it carries no trailer, or
/// `crc_trailered`: the caller does not check trailers); where none is recorded, a trailer,
/// whose checksum is checked here with `crc_trailered` (else the caller checks it). A code
/// where it cannot be told.
fn object_holds(spans: &[Span], key: &[u8], crc: Option<u32>, crc_trailered: bool) -> Result<bool, i64> {
    let trailered = carries_trailer(spans);
    Ok(match crc {
        Some(crc) => (trailered && !crc_trailered) || crc_of(spans) == crc,
        None => trailered && (!crc_trailered || spans_trailer_hold(spans, key)?),
    })
}

/// Whether the trailer that ends the object read into `spans` holds the checksum of the bytes
/// before it bound to `key` ([`pieces_trailer_hold`]); no trailer is no; `-ENOMEM` where the
/// checksum's key table cannot be made.
fn spans_trailer_hold(spans: &[Span], key: &[u8]) -> Result<bool, i64> {
    pieces_trailer_hold(&pieces(spans), key).map(|holds| holds == Some(true)).map_err(|_| -(libc::ENOMEM as i64))
}

/// Whether the trailer that ends an object given in `pieces` holds the checksum of the bytes
/// before it bound to `key` (summed piece by piece in place, wherever the pieces split it);
/// `None` where the object ends in no trailer.
fn pieces_trailer_hold(pieces: &[&[u8]], key: &[u8]) -> hicache_io::Result<Option<bool>> {
    use hicache_io::integrity as ig;
    let Some(tail) = object_tail(pieces).filter(|t| t[..8] == TRAILER_MAGIC.to_le_bytes()) else { return Ok(None) };
    let body = pieces.iter().map(|p| p.len()).sum::<usize>() - TRAILER_BYTES; // object_tail found them
    let keys = ig::shared_keys(ig::STORAGE_SEED, ig::words(body))?;
    let mut sum = PieceSum::default();
    let mut left = body;
    for piece in pieces {
        let take = piece.len().min(left);
        sum.add(&piece[..take], &keys);
        left -= take;
    }
    let mut want = [0u8; 8];
    want.copy_from_slice(&tail[8..]);
    Ok(Some(sum.finish(&keys) ^ ig::name_hash(key) == u64::from_le_bytes(want)))
}

/// hicache-io's integrity checksum of a string given in pieces of any lengths: whole words
/// summed in place, a word split between pieces put together first.
#[derive(Default)]
struct PieceSum {
    sum: u64,
    words: usize,
    carry: [u8; 4],
    held: usize,
}

impl PieceSum {
    fn add(&mut self, mut p: &[u8], keys: &hicache_io::integrity::Keys) {
        use hicache_io::integrity::range_sum;
        if self.held > 0 {
            let take = (4 - self.held).min(p.len());
            self.carry[self.held..self.held + take].copy_from_slice(&p[..take]);
            self.held += take;
            p = &p[take..];
            if self.held < 4 {
                return;
            }
            self.sum = self.sum.wrapping_add(range_sum(&self.carry, self.words, keys));
            self.words += 1;
            self.held = 0;
        }
        let whole = p.len() - p.len() % 4;
        self.sum = self.sum.wrapping_add(range_sum(&p[..whole], self.words, keys));
        self.words += whole / 4;
        self.held = p.len() - whole;
        self.carry[..self.held].copy_from_slice(&p[whole..]);
    }

    /// The checksum (a partial last word zero-padded).
    fn finish(self, keys: &hicache_io::integrity::Keys) -> u64 {
        self.sum.wrapping_add(hicache_io::integrity::range_sum(&self.carry[..self.held], self.words, keys))
    }
}

/// The bytes of `spans` together; `None` past `usize` (no buffer of the caller can be that large).
pub(crate) fn span_bytes(spans: &[Span]) -> Option<usize> {
    spans.iter().try_fold(0usize, |a, s| a.checked_add(s.1))
}

/// Reads object `key` from file `path` into `spans` (`exact`: their sizes add up to the
/// object's; else one span at least as large); the object's bytes, or a code.
fn get_one(
    path: &str,
    key: &[u8],
    spans: &[Span],
    exact: bool,
    crc_trailered: bool,
    touch_seconds: f64,
    history: Option<&ReadHistory>,
) -> i64 {
    let Some(c) = cpath(path) else { return INVALID_PARAMS };
    // SAFETY: a NUL-terminated path; the descriptor is closed by `Fd`.
    let raw = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if raw < 0 {
        let e = errno();
        return if e == -(libc::ENOENT as i64) { OBJECT_NOT_FOUND } else { e };
    }
    let fd = Fd(raw);
    // SAFETY: fstat fills the zeroed struct for an open descriptor.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd.0, &mut st) } != 0 {
        return errno();
    }
    if let Err(e) = hold_for_read(&fd, &c, &st) {
        return e; // being written over (a recycled file), or its object went meanwhile
    }
    let size = st.st_size.max(0) as usize;
    let Some(n) = size.checked_sub(key.len() + FOOTER) else { return OBJECT_NOT_FOUND };
    let Some(room) = span_bytes(spans) else { return INVALID_PARAMS };
    if exact && room != n {
        return BUFFER_MISMATCH;
    }
    if !exact && (spans.len() != 1 || room < n) {
        return INVALID_PARAMS;
    }
    let targets: Vec<Span> = if exact { spans.to_vec() } else { vec![(spans[0].0, n)] };
    let mut tail = vec![0u8; key.len() + FOOTER];
    let mut iov = iovecs(&targets);
    iov.push(libc::iovec { iov_base: tail.as_mut_ptr() as *mut libc::c_void, iov_len: tail.len() });
    match read_object(&fd, &st, &c, iov, size, history) {
        Ok(got) if got == size => {}
        Ok(_) => return OBJECT_NOT_FOUND, // truncated meanwhile
        Err(e) => return e,
    }
    let (k, f) = tail.split_at(key.len());
    let Some(recorded) = footer_holds(f, n, key.len()).filter(|_| k == key) else { return DAMAGED };
    let crc = match recorded {
        Recorded::Crc(c) => Some(c),
        Recorded::NoCrc => None,
        Recorded::Later => return OBJECT_NOT_FOUND, // a miss, left for the build that wrote it
    };
    match object_holds(&targets, key, crc, crc_trailered) {
        Ok(true) => {}
        Ok(false) => return DAMAGED,
        Err(e) => return e,
    }
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    if now - st.st_mtime as f64 > touch_seconds {
        // Last use, for the eviction order; another user's file keeps its order.
        // SAFETY: a null times pointer sets both times to now.
        unsafe { libc::futimens(fd.0, std::ptr::null()) };
    }
    n as i64
}

/// What a file of `nbytes` takes on disk: whole 4 KiB blocks.
pub(crate) fn on_disk(nbytes: usize) -> i64 {
    nbytes.div_ceil(4096).saturating_mul(4096) as i64
}

/// Writes object `key` from `spans` to temporary file `tmp` and publishes it at `path` by a
/// rename that replaces nothing (else a link; whole or not at all; an object published meanwhile
/// is kept: the caller checked that none existed before); the bytes it takes on disk (0 when
/// kept), or a code. (`O_TMPFILE` measured no faster here: the file system's metadata work is
/// the same.)
fn put_one(path: &str, tmp: &str, key: &[u8], spans: &[Span], rule: WriteRule, claimed: Option<(Fd, &FreeFiles)>) -> i64 {
    let fsync = rule.fsync;
    let (Some(final_c), Some(tmp_c)) = (cpath(path), cpath(tmp)) else { return INVALID_PARAMS };
    let Some(n) = span_bytes(spans) else { return INVALID_PARAMS };
    // An object that ends in a trailer is verified by it: its bytes are not hashed again.
    let foot = footer(n, key, (!carries_trailer(spans)).then(|| crc_of(spans)));
    let Some(total) = n.checked_add(foot.len()) else { return INVALID_PARAMS };
    if let Some((fd, free)) = claimed {
        return put_claimed(fd, &tmp_c, &final_c, spans, &foot, total, fsync, free);
    }
    let write = |fd: &Fd| -> Result<(), i64> {
        let mut iov = iovecs(spans);
        iov.push(libc::iovec { iov_base: foot.as_ptr() as *mut libc::c_void, iov_len: foot.len() });
        match vectored(fd, iov, true)? {
            // SAFETY: an open descriptor.
            w if w == total => {
                if fsync && unsafe { libc::fsync(fd.0) } != 0 {
                    Err(errno())
                } else {
                    if rule.start_writeback && !fsync {
                        start_writeback(fd);
                    }
                    Ok(())
                }
            }
            _ => Err(-(libc::EIO as i64)),
        }
    };
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC;
    let mut written = None;
    if writes_direct(rule, spans, total) {
        // SAFETY: a NUL-terminated path; the descriptor is closed by `Fd`.
        let raw = unsafe { libc::open(tmp_c.as_ptr(), flags | libc::O_DIRECT, 0o644) };
        let einval = -(libc::EINVAL as i64);
        written = if raw >= 0 { Some(write_direct(&Fd(raw), spans, &foot, total, fsync)) } else { Some(Err(errno())) };
        if written == Some(Err(einval)) {
            // The file system refuses O_DIRECT (tmpfs, some overlays), at the open or the first
            // write: written buffered below, from a file of its own.
            // SAFETY: a NUL-terminated path (a file this put created, if any).
            unsafe { libc::unlink(tmp_c.as_ptr()) };
            written = None;
        } else if written.as_ref().is_some_and(|w| w.is_err()) && raw < 0 {
            return written.and_then(|w| w.err()).unwrap_or(INVALID_PARAMS);
        }
    }
    let written = match written {
        Some(w) => w,
        None => {
            // SAFETY: a NUL-terminated path; the descriptor is closed by `Fd`.
            let raw = unsafe { libc::open(tmp_c.as_ptr(), flags, 0o644) };
            if raw < 0 {
                return errno();
            }
            write(&Fd(raw))
        }
    };
    match written {
        Ok(()) => publish(&tmp_c, &final_c, total, &unlink),
        Err(e) => {
            // SAFETY: a NUL-terminated path.
            unsafe { libc::unlink(tmp_c.as_ptr()) };
            e
        }
    }
}

/// Whether a put under `rule` writes an object of `total` bytes (file size) from `spans` with
/// `O_DIRECT`: where the object is mostly its first span's whole pages (the rest is written
/// buffered, which must stay small).
fn writes_direct(rule: WriteRule, spans: &[Span], total: usize) -> bool {
    rule.direct
        && total >= DIRECT_MIN
        && spans
            .first()
            .is_some_and(|&(p, n)| p.is_multiple_of(DIRECT_ALIGN) && n >= DIRECT_ALIGN && total - (n - n % DIRECT_ALIGN) <= DIRECT_REST_MAX)
}

/// Publishes the written temporary file `tmp` of `total` bytes as the object at `path`: one
/// rename that replaces nothing where the file system has it, else a link and an unlink. An
/// object already there stays (ours goes to `discard`). The bytes it takes on disk, `0` when
/// kept, or a code.
pub(crate) fn publish(tmp: &CString, path: &CString, total: usize, discard: &dyn Fn(&CString)) -> i64 {
    let published = |rc: libc::c_int| -> i64 {
        if rc == 0 {
            return on_disk(total);
        }
        match errno() {
            e if e == -(libc::EEXIST as i64) => 0, // another writer published it meanwhile: the first one stays
            e => e,
        }
    };
    // SAFETY: NUL-terminated paths.
    let rc = unsafe { libc::renameat2(libc::AT_FDCWD, tmp.as_ptr(), libc::AT_FDCWD, path.as_ptr(), libc::RENAME_NOREPLACE) };
    let refused = rc != 0 && matches!(errno(), e if e == -(libc::EINVAL as i64) || e == -(libc::ENOSYS as i64));
    if !refused {
        let out = published(rc);
        if rc != 0 {
            discard(tmp);
        }
        return out;
    }
    // SAFETY: NUL-terminated paths.
    let rc = unsafe { libc::link(tmp.as_ptr(), path.as_ptr()) };
    let out = published(rc);
    if rc == 0 {
        // SAFETY: a NUL-terminated path (now also the object's).
        unsafe { libc::unlink(tmp.as_ptr()) };
    } else {
        discard(tmp);
    }
    out
}

/// Removes temporary file `tmp`.
fn unlink(tmp: &CString) {
    // SAFETY: a NUL-terminated path.
    unsafe { libc::unlink(tmp.as_ptr()) };
}

/// Starts `fd`'s writeback now, without waiting for it: its pages stay in the page cache (a get
/// reads them from memory) while dirty pages stay few. Advice only: a failure changes nothing the
/// caller sees.
pub(crate) fn start_writeback(fd: &Fd) {
    // SAFETY: an open descriptor.
    unsafe { libc::sync_file_range(fd.0, 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
}

/// Writes an object to `fd` (opened with `O_DIRECT`): the page-aligned head of the first span
/// straight from the caller's memory, then, `O_DIRECT` turned off, the rest (its tail, the other
/// spans, the key and footer) buffered: the file is its exact size with no padding to cut (a
/// truncation, a metadata change, cost a tenth of a 2 MiB object's put here).
pub(crate) fn write_direct(fd: &Fd, spans: &[Span], foot: &[u8], total: usize, fsync: bool) -> Result<(), i64> {
    let (p0, n0) = spans[0];
    let head = n0 - n0 % DIRECT_ALIGN;
    let mut done = 0usize;
    while done < head {
        // SAFETY: `head` bytes of the first span (inside registered memory, page-aligned, checked
        // by the caller) from file offset `done`, which stays page-aligned (whole pages written).
        let n = unsafe { libc::pwrite(fd.0, (p0 + done) as *const libc::c_void, head - done, done as libc::off_t) };
        if n < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(errno());
        }
        if n == 0 || !(n as usize).is_multiple_of(DIRECT_ALIGN) {
            return Err(-(libc::EIO as i64));
        }
        done += n as usize;
    }
    // SAFETY: an open descriptor; its status flags read, then set without O_DIRECT.
    let flags = unsafe { libc::fcntl(fd.0, libc::F_GETFL) };
    if flags < 0 || unsafe { libc::fcntl(fd.0, libc::F_SETFL, flags & !libc::O_DIRECT) } != 0 {
        return Err(errno());
    }
    let mut rest = vec![libc::iovec { iov_base: (p0 + head) as *mut libc::c_void, iov_len: n0 - head }];
    rest.extend(spans[1..].iter().map(|&(p, n)| libc::iovec { iov_base: p as *mut libc::c_void, iov_len: n }));
    rest.push(libc::iovec { iov_base: foot.as_ptr() as *mut libc::c_void, iov_len: foot.len() });
    // The spans' bytes after the head (registered memory) and the footer, after the head.
    if vectored_at(fd, rest, true, head)? != total - head {
        return Err(-(libc::EIO as i64));
    }
    // SAFETY: an open descriptor.
    if fsync && unsafe { libc::fsync(fd.0) } != 0 {
        return Err(errno());
    }
    Ok(())
}

/// `f(j)` for every object, on up to `threads` threads where the objects are large.
fn run_all(count: usize, bytes: usize, threads: usize, f: impl Fn(usize) -> i64 + Sync) -> Vec<i64> {
    if count <= 2 || threads <= 1 || bytes < PARALLEL_BYTES.saturating_mul(count) {
        return (0..count).map(f).collect();
    }
    let out: Vec<AtomicI64> = (0..count).map(|_| AtomicI64::new(0)).collect();
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads.min(count) {
            s.spawn(|| loop {
                let j = next.fetch_add(1, Ordering::Relaxed);
                if j >= count {
                    break;
                }
                out[j].store(f(j), Ordering::Relaxed);
            });
        }
    });
    out.into_iter().map(AtomicI64::into_inner).collect()
}

/// The spans of a batch of `count` objects ([`spans_arg`]), unchecked.
pub(crate) fn span_lists(ptrs: &Bound<'_, PyList>, sizes: &Bound<'_, PyList>, count: usize) -> PyResult<Vec<Vec<Span>>> {
    let spans = spans_arg(ptrs, sizes)?;
    if spans.len() != count {
        return Err(PyValueError::new_err(format!("{count} objects but {} span lists", spans.len())));
    }
    Ok(spans)
}

/// Checked spans of a batch: per object its spans, `None` for an object outside registered memory.
pub(crate) fn checked(
    regions: &[Span],
    ptrs: &Bound<'_, PyList>,
    sizes: &Bound<'_, PyList>,
    count: usize,
) -> PyResult<Vec<Option<Vec<Span>>>> {
    let spans = span_lists(ptrs, sizes, count)?;
    Ok(spans.into_iter().map(|s| inside(regions, &s).then_some(s)).collect())
}

/// Reads objects `keys[j]` from their files under folder `objects` into their spans (`ptrs[j]`, `sizes[j]`: an
/// address and a size, or lists of them), each inside one of `regions` (`(address, bytes)`).
/// `exact`: the spans add up to the object's size (else `-800`); else one span at least as large
/// (else `-600`). Per object: its bytes, `-704` (missing, or truncated meanwhile), `-600` (a span
/// outside `regions`), [`DAMAGED`], or `-errno`. Objects that carry hicache-io's trailer skip the
/// CRC unless `crc_trailered`; a file last used more than `touch_seconds` ago is marked used.
/// `history` (`reads="auto"`; none: every read buffered): large objects the page cache does not
/// hold are read with `O_DIRECT` the first time it sees them read (see [`read_object`]).
#[pyfunction]
#[pyo3(signature = (regions, objects, keys, ptrs, sizes, exact, crc_trailered, touch_seconds, threads, history=None))]
pub(crate) fn local_get(
    py: Python<'_>,
    regions: Vec<Span>,
    objects: &str,
    keys: Vec<String>,
    ptrs: &Bound<'_, PyList>,
    sizes: &Bound<'_, PyList>,
    exact: bool,
    crc_trailered: bool,
    touch_seconds: f64,
    threads: usize,
    history: Option<Py<ReadHistory>>,
) -> PyResult<Vec<i64>> {
    let spans = checked(&regions, ptrs, sizes, keys.len())?;
    let bytes = spans.iter().flatten().flatten().map(|s| s.1).sum();
    let history = history.as_ref().map(|h| h.get());
    Ok(py.detach(|| {
        run_all(keys.len(), bytes, threads, |j| match &spans[j] {
            Some(s) => {
                get_one(&object_path(objects, keys[j].as_bytes()), keys[j].as_bytes(), s, exact, crc_trailered, touch_seconds, history)
            }
            None => INVALID_PARAMS,
        })
    }))
}

/// Writes objects `keys[j]` from their spans (as [`local_get`]'s) to temporary files `tmps[j]`
/// and publishes each at its file under folder `objects` by a link. Each object's existence is
/// checked once, here; then `reserve(need, again)` is called, with the GIL, before any byte is
/// written: `need` is what the new objects' files take on disk (the directory's capacity is
/// counted first). `reserve` answers false to refuse (nothing is written: `None`), or, where
/// `again`, `None`: free files appeared, claim them and ask once more; an exception it raises
/// propagates. Else `(need, per object: the bytes its file takes on disk (written),
/// `0` (it existed, or a racing writer published it first: kept; or written over a free file),
/// `-600` (a span outside `regions`) or `-errno`)`: the caller uncounts what `need` holds beyond
/// what was written. With `free` (the store's folder of recycled files), objects written with
/// `O_DIRECT` first claim a free file of as many blocks, whose bytes are on disk already: they
/// are not in `need`. The tuple's third item: where the put claimed free files, the fewest its
/// listing had left for any of the file sizes it claimed, and that size (the caller makes more
/// ahead of need); else `(-1, 0)`.
/// What [`local_put`] answers: `(need, per object: written or a code, (free files left, their size))`.
type PutAnswer = (u64, Vec<i64>, (i64, usize));

#[pyfunction]
#[pyo3(signature = (regions, objects, tmps, keys, ptrs, sizes, fsync, threads, reserve, direct=true, start_writeback=false, free=None))]
pub(crate) fn local_put(
    py: Python<'_>,
    regions: Vec<Span>,
    objects: &str,
    tmps: Vec<String>,
    keys: Vec<String>,
    ptrs: &Bound<'_, PyList>,
    sizes: &Bound<'_, PyList>,
    fsync: bool,
    threads: usize,
    reserve: &Bound<'_, PyAny>,
    direct: bool,
    start_writeback: bool,
    free: Option<String>,
) -> PyResult<Option<PutAnswer>> {
    let rule = WriteRule { fsync, direct, start_writeback };
    if tmps.len() != keys.len() {
        return Err(PyValueError::new_err(format!("{} temporary names for {} keys", tmps.len(), keys.len())));
    }
    // Every object's bytes count, its spans checked or not (those outside fail below and are
    // uncounted by the caller with the rest): the reservation is what the sizes say.
    let all = span_lists(ptrs, sizes, keys.len())?;
    let spans: Vec<Option<Vec<Span>>> = all.iter().map(|s| inside(&regions, s).then(|| s.clone())).collect();
    let paths: Vec<String> = keys.iter().map(|k| object_path(objects, k.as_bytes())).collect();
    let files: Vec<Option<usize>> = all
        .iter()
        .zip(&keys)
        .map(|(s, k)| span_bytes(s).and_then(|n| n.checked_add(FOOTER)).and_then(|n| n.checked_add(k.len())))
        .collect();
    let exists: Vec<bool> = py.detach(|| paths.iter().map(|p| cpath(p).is_some_and(|c| file_exists(&c))).collect());
    let claimed: Vec<std::sync::Mutex<Option<Fd>>> = (0..keys.len()).map(|_| std::sync::Mutex::new(None)).collect();
    let mut listed = None;
    let mut need = 0;
    for again in [true, false] {
        let before = listed.take();
        (listed, need) = py.detach(|| {
            // A listing that fails now keeps the one the files claimed so far came from.
            let mut listed = free.as_deref().and_then(FreeFiles::list).or(before);
            claims(listed.as_mut(), rule, &tmps, &files, &spans, &exists, &claimed);
            // Saturating: a sum past u64 exceeds any capacity, so the reservation refuses it.
            let need = (0..keys.len())
                .filter(|&j| !exists[j] && claimed[j].lock().is_ok_and(|c| c.is_none()))
                .fold(0u64, |acc, j| acc.saturating_add(files[j].map_or(u64::MAX, |f| on_disk(f) as u64)));
            (listed, need)
        });
        let answer = match reserve.call1((need, again)) {
            Ok(a) => a,
            Err(e) => {
                give_back_all(listed.as_ref(), &claimed, &tmps);
                return Err(e);
            }
        };
        if again && answer.is_none() {
            continue; // free files appeared meanwhile (another put's eviction): claim them first
        }
        if answer.is_truthy()? {
            break;
        }
        give_back_all(listed.as_ref(), &claimed, &tmps); // nothing is written
        return Ok(None);
    }
    let free = listed;
    let left = free.as_ref().map_or((-1, 0), |listing| free_left(listing, &files, &claimed));
    let bytes = spans.iter().flatten().flatten().fold(0usize, |a, s| a.saturating_add(s.1));
    let written = py.detach(|| {
        run_all(keys.len(), bytes, threads, |j| {
            let mine = claimed[j].lock().ok().and_then(|mut c| c.take()).zip(free.as_ref());
            match &spans[j] {
                None => INVALID_PARAMS,
                // Kept, unless it went meanwhile (the reservation's eviction, another process):
                // then written, its bytes counted by the caller's correction. (Only new objects
                // claim free files.)
                Some(_) if exists[j] && cpath(&paths[j]).is_some_and(|c| file_exists(&c)) => 0,
                Some(s) => put_one(&paths[j], &tmps[j], keys[j].as_bytes(), s, rule, mine),
            }
        })
    });
    Ok(Some((need, written, left)))
}

/// The fewest free files `listing` has left for any file size of the objects that claimed one,
/// and that size; `(-1, 0)` where none claimed any.
fn free_left(listing: &FreeFiles, files: &[Option<usize>], claimed: &[std::sync::Mutex<Option<Fd>>]) -> (i64, usize) {
    (0..files.len())
        .filter(|&j| claimed[j].lock().is_ok_and(|c| c.is_some()))
        .filter_map(|j| files[j].map(|f| (i64::try_from(listing.left(f)).unwrap_or(i64::MAX), f)))
        .min()
        .unwrap_or((-1, 0))
}

/// Claims free files (see [`local_put`]) for the objects that hold none in `claimed` yet: new
/// objects (`!exists`) of [`RECYCLE_MIN`] bytes or more (`files`: their file sizes) written with
/// `O_DIRECT`, whose spans lie in registered memory.
fn claims(
    mut free: Option<&mut FreeFiles>,
    rule: WriteRule,
    tmps: &[String],
    files: &[Option<usize>],
    spans: &[Option<Vec<Span>>],
    exists: &[bool],
    claimed: &[std::sync::Mutex<Option<Fd>>],
) {
    for j in 0..tmps.len() {
        let Ok(mut slot) = claimed[j].lock() else { continue };
        if let (None, Some(free), Some(f), Some(s)) = (slot.as_ref(), free.as_deref_mut(), files[j], &spans[j]) {
            if !exists[j] && f >= RECYCLE_MIN && writes_direct(rule, s, f) {
                *slot = cpath(&tmps[j]).and_then(|t| free.claim(f, &t));
            }
        }
    }
}

/// Returns the files `claimed` (at their temporary names `tmps`) to the free files.
fn give_back_all(free: Option<&FreeFiles>, claimed: &[std::sync::Mutex<Option<Fd>>], tmps: &[String]) {
    for (c, t) in claimed.iter().zip(tmps) {
        if let (Some(free), Ok(Some(_)), Some(t)) = (free, c.lock().map(|mut c| c.take()), cpath(t)) {
            free.give_back(&t);
        }
    }
}

/// Whether file `c` exists (as `os.path.exists`: any failure to find it is no).
fn file_exists(c: &CString) -> bool {
    // SAFETY: a NUL-terminated path.
    unsafe { libc::access(c.as_ptr(), libc::F_OK) == 0 }
}

/// Whether object file `path` holds what its footer says: its key (valid UTF-8, whose file
/// under folder `objects` is `path`), the object's length and CRC-32 (where the footer records
/// one; where it records none, the object must end in hicache-io's trailer), and, where the
/// object ends in a trailer, that trailer's checksum of the body bound to the key. The scrub's
/// check (`hicache_io.l3.local.scrub`); a file that cannot be read is not intact, one whose
/// footer is a later format's is (not this build's to judge).
#[pyfunction]
pub(crate) fn local_intact(py: Python<'_>, objects: PathBuf, path: PathBuf) -> PyResult<bool> {
    py.detach(|| {
        let Some(c) = path.to_str().and_then(cpath) else { return Ok(false) };
        // SAFETY: a NUL-terminated path; the descriptor is closed by `Fd`.
        let raw = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        if raw < 0 {
            return Ok(false);
        }
        let fd = Fd(raw);
        // SAFETY: fstat fills the zeroed struct for an open descriptor.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.0, &mut st) } != 0 {
            return Ok(false);
        }
        if hold_for_read(&fd, &c, &st).is_err() {
            return Ok(true); // evicted or written over meanwhile: no longer this path's to judge
        }
        let mut data = Vec::new();
        if data.try_reserve_exact(st.st_size.max(0) as usize).is_err() {
            return Ok(false);
        }
        data.resize(st.st_size.max(0) as usize, 0u8);
        let iov = vec![libc::iovec { iov_base: data.as_mut_ptr() as *mut libc::c_void, iov_len: data.len() }];
        if vectored(&fd, iov, false) != Ok(data.len()) {
            return Ok(false);
        }
        let Some(foot_at) = data.len().checked_sub(FOOTER) else { return Ok(false) };
        let (head, foot) = data.split_at(foot_at);
        // The key's length as the footer says, then the object before it.
        let klen = foot.get(16..20).and_then(|b| b.try_into().ok()).map_or(0, u32::from_le_bytes) as usize;
        let Some(n) = foot_at.checked_sub(klen) else { return Ok(false) };
        let (obj, key) = head.split_at(n);
        let crc = match footer_holds(foot, n, key.len()) {
            None => return Ok(false),
            Some(Recorded::Later) => return Ok(true), // not this build's to judge
            Some(Recorded::Crc(c)) => Some(c),
            Some(Recorded::NoCrc) => None,
        };
        if std::str::from_utf8(key).is_err() {
            return Ok(false);
        }
        let h = key_hash(key);
        let mut named = objects.into_os_string().into_vec();
        named.extend_from_slice(format!("/{}/{h}", &h[..2]).as_bytes());
        if named != path.as_os_str().as_bytes()
            || crc.is_some_and(|c| crc32fast::hash(obj) != c)
            || (crc.is_none() && !ends_in_trailer(&[obj]))
        {
            return Ok(false);
        }
        trailer_holds(obj, key)
    })
    .py()
}

/// Whether object `obj` of key `key`, where it ends in hicache-io's trailer, holds it (the
/// checksum of the body bound to the key); an object without one holds.
pub(crate) fn trailer_holds(obj: &[u8], key: &[u8]) -> hicache_io::Result<bool> {
    Ok(pieces_trailer_hold(&[obj], key)? != Some(false))
}
