//! The local store's reads of large objects: where the page cache does not hold one, read past
//! it with `O_DIRECT` (the disk's speed) the first time, through it the next (objects read again
//! stay cached).

use std::ffi::CString;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use pyo3::prelude::*;

use crate::local_io::{errno, vectored, Fd, DIRECT_ALIGN, DIRECT_MIN, DIRECT_REST_MAX};

/// Reads a file's `size` bytes into `iov` (the object's spans, then its key and footer) from
/// `fd` (whose `fstat` is `st`; opened at `path`). With a `history` (`reads="auto"`), an object of
/// [`DIRECT_MIN`] and more that the page cache does not hold whole, and that this history has not
/// seen read so, comes from the disk with `O_DIRECT` where the first span allows it (cold buffered
/// reads ran at half the disk's speed on this project's CI machine kind) and is remembered; read
/// again while the cache still does not hold it, it goes through the page cache, which then keeps
/// it for the reads after. The rest is read buffered. The bytes read.
pub(crate) fn read_object(
    fd: &Fd,
    st: &libc::stat,
    path: &CString,
    iov: Vec<libc::iovec>,
    size: usize,
    history: Option<&ReadHistory>,
) -> Result<usize, i64> {
    if let Some(history) = history.filter(|_| size >= DIRECT_MIN) {
        if let Some(plan) = DirectRead::of(&iov, size) {
            if !cached(fd, size) && history.first_read(path) {
                if let Some(got) = plan.read(path, st, &iov) {
                    return Ok(got);
                }
            }
        }
    }
    vectored(fd, iov, false)
}

/// Slots of a [`ReadHistory`]: 512 KiB a client, the last reads of about this many objects.
const HISTORY_SLOTS: usize = 1 << 16;

/// The large objects a client read past the page cache (`O_DIRECT`): a table of hashes of their
/// paths, one slot per hash value modulo its size, so an object is forgotten when another takes
/// its slot (a forgotten object is read past the cache once more). Lock-free: a process forked
/// while another thread reads inherits a consistent table, and no reader waits on another.
#[pyclass(module = "hicache_io._native", frozen)]
pub(crate) struct ReadHistory {
    slots: Box<[AtomicU64]>,
}

#[pymethods]
impl ReadHistory {
    #[new]
    fn new() -> Self {
        ReadHistory { slots: (0..HISTORY_SLOTS).map(|_| AtomicU64::new(0)).collect() }
    }
}

impl ReadHistory {
    /// Whether `path` was not seen before (its read goes past the cache); records it either way.
    fn first_read(&self, path: &CString) -> bool {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        path.as_bytes().hash(&mut h);
        let h = h.finish();
        // Slot from the whole hash; the value kept has its low bit set (0 marks an empty slot).
        self.slots[(h as usize) % self.slots.len()].swap(h | 1, Ordering::Relaxed) != h | 1
    }
}

/// The machine's page size (`mincore` answers a byte per page).
fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    // SAFETY: sysconf has no preconditions.
    *PAGE.get_or_init(|| usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok().filter(|&p| p > 0).unwrap_or(4096))
}

/// `cachestat(2)` (Linux 6.5; the number the generic syscall table gives it, x86-64's and
/// arm64's; where it means something else the call fails and `mincore` answers).
const SYS_CACHESTAT: libc::c_long = 451;
/// Set once the kernel does not have `cachestat` (`ENOSYS`): `mincore` from then on.
static NO_CACHESTAT: AtomicBool = AtomicBool::new(false);

#[repr(C)]
struct CachestatRange {
    off: u64,
    len: u64,
}

#[repr(C)]
#[derive(Default)]
struct Cachestat {
    nr_cache: u64,
    nr_dirty: u64,
    nr_writeback: u64,
    nr_evicted: u64,
    nr_recently_evicted: u64,
}

/// Whether the page cache holds every page of `fd`'s first `size` bytes: `cachestat` where the
/// kernel answers it, else `mincore` over a mapping never touched, which reads nothing (but
/// costs a mapping and its `munmap` a get: 1 MiB warm gets ran at two thirds of their speed with
/// it). `cachestat` is refused (`EPERM`) for a file the process could not write (another user's
/// object in a shared directory) and by some seccomp filters: that file alone is asked with
/// `mincore` (which, for a file the process may not write, answers since Linux 5.2 only for
/// pages this process mapped: such a file reads as uncached, and its first read goes past the
/// cache). A question neither can answer is a yes, so the read stays buffered. A read that
/// asks the cache itself (`RWF_NOWAIT`) starts readahead when it misses, and the disk would be
/// read twice.
fn cached(fd: &Fd, size: usize) -> bool {
    if !NO_CACHESTAT.load(Ordering::Relaxed) {
        let range = CachestatRange { off: 0, len: size as u64 };
        let mut stat = Cachestat::default();
        // SAFETY: cachestat reads `range` and fills `stat`, both live for the call; flags 0.
        let rc = unsafe { libc::syscall(SYS_CACHESTAT, fd.0, &range as *const CachestatRange, &mut stat as *mut Cachestat, 0) };
        if rc == 0 {
            return stat.nr_cache >= size.div_ceil(page_size()) as u64;
        }
        if errno() == -(libc::ENOSYS as i64) {
            NO_CACHESTAT.store(true, Ordering::Relaxed);
        }
    }
    mapped_cached(fd, size)
}

/// [`cached`] by `mincore` over a mapping never touched.
fn mapped_cached(fd: &Fd, size: usize) -> bool {
    // SAFETY: a read-only shared mapping of an open file, unmapped below; never dereferenced.
    let map = unsafe { libc::mmap(std::ptr::null_mut(), size, libc::PROT_READ, libc::MAP_SHARED, fd.0, 0) };
    if map == libc::MAP_FAILED {
        return true;
    }
    let mut pages = vec![0u8; size.div_ceil(page_size())];
    // SAFETY: `pages` holds a byte per page of the `size`-byte mapping.
    let known = unsafe { libc::mincore(map, size, pages.as_mut_ptr()) } == 0;
    // SAFETY: the mapping made above.
    unsafe { libc::munmap(map, size) };
    !known || pages.iter().all(|p| p & 1 == 1)
}

/// A read of `size` bytes with `O_DIRECT` into buffers whose first one starts on a page: its
/// `head` whole pages straight from the disk, the `rest` (its tail, the other buffers: at most
/// [`DIRECT_REST_MAX`] bytes) through one aligned buffer.
struct DirectRead {
    p0: usize,
    n0: usize,
    head: usize,
    rest: usize,
}

impl DirectRead {
    fn of(iov: &[libc::iovec], size: usize) -> Option<DirectRead> {
        let (p0, n0) = (iov.first()?.iov_base as usize, iov.first()?.iov_len);
        let head = n0 - n0 % DIRECT_ALIGN;
        let rest = size.checked_sub(head)?;
        (p0.is_multiple_of(DIRECT_ALIGN) && head > 0 && rest <= DIRECT_REST_MAX).then_some(DirectRead { p0, n0, head, rest })
    }

    /// Reads file `path` (the file `st` describes: another one, linked there meanwhile, is left
    /// alone) into `iov`; the bytes read (fewer where the file ends early), or `None` where this
    /// cannot read it (a file system or memory that refuses `O_DIRECT`, any error): the caller
    /// reads it buffered.
    fn read(&self, path: &CString, st: &libc::stat, iov: &[libc::iovec]) -> Option<usize> {
        let DirectRead { p0, n0, head, rest } = *self;
        // SAFETY: a NUL-terminated path; the descriptor is closed by `Fd`.
        let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_DIRECT | libc::O_CLOEXEC) };
        if raw < 0 {
            return None;
        }
        let fd = Fd(raw);
        // SAFETY: fstat fills the zeroed struct for an open descriptor.
        let mut same: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.0, &mut same) } != 0 || (same.st_dev, same.st_ino) != (st.st_dev, st.st_ino) {
            return None;
        }
        let padded = rest.div_ceil(DIRECT_ALIGN).max(1) * DIRECT_ALIGN;
        let layout = std::alloc::Layout::from_size_align(padded, DIRECT_ALIGN).ok()?;
        // SAFETY: a non-zero size; freed below.
        let buf = unsafe { std::alloc::alloc(layout) };
        if buf.is_null() {
            return None;
        }
        // One read of both: the head's whole pages into the first buffer (registered memory,
        // page-aligned), the rest into the aligned buffer: one request of the disk, not two.
        let both = [
            libc::iovec { iov_base: p0 as *mut libc::c_void, iov_len: head },
            libc::iovec { iov_base: buf as *mut libc::c_void, iov_len: padded },
        ];
        let n = loop {
            // SAFETY: two page-aligned buffers of whole pages: `head` bytes of the first, `padded`
            // of the aligned one, read from offset 0.
            let n = unsafe { libc::preadv(fd.0, both.as_ptr(), 2, 0) };
            if n < 0 && errno() == -(libc::EINTR as i64) {
                continue;
            }
            break n;
        };
        let got = match usize::try_from(n) {
            Ok(n) if n >= head => Some((n - head).min(rest)),
            // The file ends inside the head (the caller sees a short read), or a read cut short
            // on a page boundary: the caller reads the object again, buffered.
            Ok(n) if n == 0 || !n.is_multiple_of(DIRECT_ALIGN) => {
                // SAFETY: allocated above with this layout.
                unsafe { std::alloc::dealloc(buf, layout) };
                return Some(n);
            }
            _ => None,
        };
        if let Some(got) = got {
            // The bytes after the first buffer's whole pages, in order: its tail, then the others.
            let mut at = 0usize;
            let pieces =
                std::iter::once(((p0 + head) as *mut u8, n0 - head)).chain(iov[1..].iter().map(|v| (v.iov_base as *mut u8, v.iov_len)));
            for (p, n) in pieces {
                let take = n.min(got - at);
                // SAFETY: `at + take <= got <= padded`; the target is a buffer of `iov` (registered
                // memory or the caller's tail), `take` bytes of it.
                unsafe { std::ptr::copy_nonoverlapping(buf.add(at), p, take) };
                at += take;
            }
        }
        // SAFETY: allocated above with this layout.
        unsafe { std::alloc::dealloc(buf, layout) };
        got.map(|g| head + g)
    }
}
