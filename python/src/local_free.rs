//! Recycled files of the local store (`hicache_io.l3.local`): where a put writes with `O_DIRECT`,
//! eviction keeps the files of the objects it evicts under `free/` (named `<size>-<unique>`), and
//! later puts of files of as many 4 KiB blocks write over them instead of creating files. On this
//! project's machines an `O_DIRECT` write over a file's existing blocks ran at 1.6–1.8× a write of
//! a new file: the file system allocates no blocks and converts no unwritten extents.
//!
//! Readers. A get may have opened an object's file just before eviction moved it. So a reader of
//! a file of [`RECYCLE_MIN`] bytes or more holds a shared `flock` on it while it reads, and once it
//! holds it checks that the object's path still names the file it opened (else: a miss). A put
//! claims a free file only under an exclusive lock taken without waiting (a file a reader holds
//! is skipped), held until the file is published as its new object. A reader thus reads an old
//! object whole, or misses; never a file half written over.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use pyo3::prelude::*;

use crate::local_io::{cpath, errno, on_disk, publish, write_direct, Fd, Span, OBJECT_NOT_FOUND};

/// Files of at least this many bytes may be recycled (and are read under a shared lock).
pub(crate) const RECYCLE_MIN: usize = 1 << 20;

/// The free files of a store's `free/` folder by the 4 KiB blocks they take, with their sizes,
/// listed once for a batch of puts. The folder is held open (never followed through a link), and
/// its files are opened and moved relative to it.
pub(crate) struct FreeFiles {
    dir: Fd,
    by_blocks: HashMap<usize, Vec<(usize, CString)>>,
}

/// 4 KiB blocks a file of `size` bytes takes: a put writes over a file of as many blocks.
fn blocks(size: usize) -> usize {
    size.div_ceil(4096)
}

/// Whether a free file named for `named` bytes may serve a put of a file of `size` bytes (one of
/// as many blocks is also required; see [`FreeFiles::claim`]).
fn claimable(named: usize, size: usize) -> bool {
    (RECYCLE_MIN..=size).contains(&named)
}

/// Whether open file `st` may be written over as a free file for a put of `size` bytes: a
/// regular file of this user's with one name (a link is never written through), of at least
/// [`RECYCLE_MIN`] bytes (smaller files are read without a lock), at most `size` and of as many
/// blocks, all of them allocated (a sparse file would grow the directory past its count).
fn writable_over(st: &libc::stat, size: usize) -> bool {
    let Ok(n) = usize::try_from(st.st_size) else { return false };
    st.st_mode & libc::S_IFMT == libc::S_IFREG
        && st.st_nlink == 1
        // SAFETY: geteuid has no preconditions.
        && st.st_uid == unsafe { libc::geteuid() }
        && (RECYCLE_MIN..=size).contains(&n)
        && blocks(n) == blocks(size)
        && u64::try_from(st.st_blocks).is_ok_and(|b| b.saturating_mul(512) >= blocks(n) as u64 * 4096)
}

impl FreeFiles {
    /// One listing of folder `dir` (none where it is missing, unreadable or a link); only names
    /// of the form `<size>-<anything>` count.
    pub(crate) fn list(dir: &str) -> Option<FreeFiles> {
        let c = cpath(dir)?;
        // SAFETY: a NUL-terminated path; the descriptor is closed by `Fd`.
        let raw = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
        if raw < 0 {
            return None;
        }
        let dir_fd = Fd(raw);
        let mut by_blocks: HashMap<usize, Vec<(usize, CString)>> = HashMap::new();
        // Listed by its path; the names are opened and moved relative to the folder held open,
        // so a listing of another folder put in its place names nothing there.
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if let (Some(size), Some(c)) = (name.split_once('-').and_then(|(s, _)| s.parse::<usize>().ok()), cpath(name)) {
                by_blocks.entry(blocks(size)).or_default().push((size, c));
            }
        }
        Some(FreeFiles { dir: dir_fd, by_blocks })
    }

    /// Claims a free file for a put of a file of `size` bytes ([`writable_over`]: the put writes
    /// all of it, and past its end within its last block), moved to the put's temporary name
    /// `tmp`, open for writing with `O_DIRECT`, marked used now (a temporary file is old only when
    /// its writer stalled) and locked (exclusive) until the descriptor is closed. `None` when there
    /// is none it can claim (none of that size, all held by readers or claimed by other puts, a
    /// file system that refuses `O_DIRECT` or `flock`).
    pub(crate) fn claim(&mut self, size: usize, tmp: &CString) -> Option<Fd> {
        let candidates = self.by_blocks.get_mut(&blocks(size))?;
        while let Some(at) = candidates.iter().rposition(|&(s, _)| claimable(s, size)) {
            let (_, name) = candidates.swap_remove(at);
            let flags = libc::O_WRONLY | libc::O_DIRECT | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;
            // SAFETY: an open folder and a NUL-terminated name; the descriptor is closed by `Fd`.
            let raw = unsafe { libc::openat(self.dir.0, name.as_ptr(), flags) };
            if raw < 0 {
                continue; // claimed meanwhile, or refused
            }
            let fd = Fd(raw);
            // SAFETY: fstat fills the zeroed struct for an open descriptor.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            if unsafe { libc::fstat(fd.0, &mut st) } != 0 || !writable_over(&st, size) {
                continue; // not a free file to write over: left where it is
            }
            // SAFETY: an open descriptor. A reader that opened it before it was evicted holds it.
            if unsafe { libc::flock(fd.0, libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                continue;
            }
            // SAFETY: an open descriptor; a null times pointer sets both times to now. A regular
            // file's writes ignore O_NONBLOCK (there only so that a FIFO never blocked the open);
            // it is cleared all the same.
            unsafe {
                libc::futimens(fd.0, std::ptr::null());
                libc::fcntl(fd.0, libc::F_SETFL, libc::fcntl(fd.0, libc::F_GETFL) & !libc::O_NONBLOCK);
            }
            // SAFETY: an open folder, NUL-terminated names. The rename is the claim: of two puts,
            // one moves it; the file moved must be the one locked (a name may have been reused).
            if unsafe { libc::renameat(self.dir.0, name.as_ptr(), libc::AT_FDCWD, tmp.as_ptr()) } != 0 {
                continue;
            }
            let mut moved: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: lstat fills the zeroed struct for a NUL-terminated path.
            if unsafe { libc::lstat(tmp.as_ptr(), &mut moved) } != 0 || (moved.st_dev, moved.st_ino) != (st.st_dev, st.st_ino) {
                give_back(&self.dir, tmp);
                continue;
            }
            return Some(fd);
        }
        None
    }

    /// Free files of this listing not yet claimed that a put of a file of `size` bytes could
    /// claim (some may have been claimed by other puts since it was listed).
    pub(crate) fn left(&self, size: usize) -> usize {
        self.by_blocks.get(&blocks(size)).map_or(0, |c| c.iter().filter(|&&(s, _)| claimable(s, size)).count())
    }

    /// Returns claimed file `tmp`, which its put did not publish, to the free files.
    pub(crate) fn give_back(&self, tmp: &CString) {
        give_back(&self.dir, tmp);
    }
}

/// Returns claimed file `tmp` to the free files (folder `dir`) under a name no other file has
/// (the directory's usage counter still counts it); removes it where that fails.
fn give_back(dir: &Fd, tmp: &CString) {
    // SAFETY: lstat fills the zeroed struct for a NUL-terminated path.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    let size = if unsafe { libc::lstat(tmp.as_ptr(), &mut st) } == 0 { st.st_size.max(0) } else { 0 };
    let name = tmp.to_bytes().rsplit(|&b| b == b'/').next().map(String::from_utf8_lossy).unwrap_or_default();
    let back = cpath(&format!("{size}-{}-{name}", st.st_ino));
    let Some(back) = back else {
        // SAFETY: a NUL-terminated path.
        unsafe { libc::unlink(tmp.as_ptr()) };
        return;
    };
    // SAFETY: an open folder, NUL-terminated names.
    if unsafe { libc::renameat2(libc::AT_FDCWD, tmp.as_ptr(), dir.0, back.as_ptr(), libc::RENAME_NOREPLACE) } == 0 {
        return;
    }
    if matches!(errno(), e if e == -(libc::EINVAL as i64) || e == -(libc::ENOSYS as i64)) {
        // A file system without the no-replace rename: a link, which replaces nothing either.
        // SAFETY: as above.
        unsafe { libc::linkat(libc::AT_FDCWD, tmp.as_ptr(), dir.0, back.as_ptr(), 0) };
    }
    // SAFETY: a NUL-terminated path (its file kept under `back` where the link was made).
    unsafe { libc::unlink(tmp.as_ptr()) };
}

/// Writes object (`spans`, then `foot`: its key and footer; `total` bytes, at least the claimed
/// file's size, as many blocks) over claimed file `fd` at `tmp` and publishes it at `path`. Every
/// byte of the file is written, so nothing of its old object stays. `0` when published (its bytes
/// were on disk already), or a code; a file not published goes back to the free files.
pub(crate) fn put_claimed(
    fd: Fd,
    tmp: &CString,
    path: &CString,
    spans: &[Span],
    foot: &[u8],
    total: usize,
    fsync: bool,
    free: &FreeFiles,
) -> i64 {
    let back = |t: &CString| free.give_back(t);
    let out = match write_direct(&fd, spans, foot, total, fsync) {
        Ok(()) => publish(tmp, path, total, &back).min(0),
        Err(e) => {
            back(tmp);
            e
        }
    };
    drop(fd); // the lock goes with it, once the file is published
    out
}

/// Holds file `fd` (opened at `path`, whose `fstat` is `st`) for a read where it may have been
/// recycled: a shared lock, then the path checked to name it still, at the size `st` read. `Err(OBJECT_NOT_FOUND)` (a
/// miss) where a put is writing over it or its object is gone; files smaller than
/// [`RECYCLE_MIN`], and file systems without `flock` (where no file is recycled), are read as
/// they are.
pub(crate) fn hold_for_read(fd: &Fd, path: &CString, st: &libc::stat) -> Result<(), i64> {
    if st.st_size < 0 || (st.st_size as usize) < RECYCLE_MIN {
        return Ok(());
    }
    // SAFETY: an open descriptor; released when it is closed.
    if unsafe { libc::flock(fd.0, libc::LOCK_SH | libc::LOCK_NB) } != 0 {
        return if errno() == -(libc::EWOULDBLOCK as i64) { Err(OBJECT_NOT_FOUND) } else { Ok(()) };
    }
    // SAFETY: stat fills the zeroed struct for a NUL-terminated path.
    let mut now: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::stat(path.as_ptr(), &mut now) } != 0 || (now.st_dev, now.st_ino, now.st_size) != (st.st_dev, st.st_ino, st.st_size) {
        return Err(OBJECT_NOT_FOUND);
    }
    Ok(())
}

/// Free files in folder `free` that a put of a file of `size` bytes could claim by their names
/// ([`FreeFiles::left`] of one listing; 0 where it cannot be listed).
#[pyfunction]
pub(crate) fn local_free_left(py: Python<'_>, free: &str, size: usize) -> usize {
    py.detach(|| FreeFiles::list(free).map_or(0, |listing| listing.left(size)))
}

/// Every file under `directory` (not following links) as `(path, last modification, bytes on
/// disk)` (bytes on disk: its blocks, or its length in whole 4 KiB blocks where it has none
/// counted yet), and what the folders themselves take on disk: the eviction's count of a store,
/// in native code (a walk in Python took about 7 ms for 600 files, under the lock every put of the
/// directory waits on). Files and folders removed meanwhile are left out.
#[pyfunction]
pub(crate) fn local_walk(py: Python<'_>, directory: PathBuf) -> (u64, Vec<(std::ffi::OsString, f64, u64)>) {
    py.detach(|| {
        let (mut folders, mut files) = (0u64, Vec::new());
        let mut todo = vec![directory];
        while let Some(dir) = todo.pop() {
            let Ok(meta) = std::fs::symlink_metadata(&dir) else { continue };
            folders = folders.saturating_add(meta.blocks().saturating_mul(512));
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let Ok(meta) = entry.metadata() else { continue };
                if meta.is_dir() {
                    todo.push(entry.path());
                    continue;
                }
                let size = match meta.blocks().saturating_mul(512) {
                    0 => usize::try_from(meta.len()).map_or(u64::MAX, |n| on_disk(n) as u64),
                    b => b,
                };
                let mtime = meta.mtime() as f64 + meta.mtime_nsec() as f64 * 1e-9;
                files.push((entry.path().into_os_string(), mtime, size));
            }
        }
        (folders, files)
    })
}
