//! Small objects of the local L3 store, packed into append-only files (`hicache_io.l3.local`):
//! a put of a batch is one vectored write at the end of its writer's pack, a get of objects
//! written together one vectored read. A file per object costs its creation (about 0.3 ms on
//! this project's machines, whatever its size): for pages of a few KiB, most of a put.
//!
//! Folder `packs/` of the store's directory holds the packs, each written by one writer (one
//! process's [`LocalPacks`]) and never changed but at its end. A record is a 32-byte header, the
//! key, then the object's bytes; little-endian:
//!
//! | bytes | what |
//! |---|---|
//! | 0..8 | `HIOPAK01` |
//! | 8..16 | the record's sequence number (the directory's counter, below) |
//! | 16..20 | the object's length |
//! | 20..22 | the key's length |
//! | 22..24 | flags: 1 a removal (no object bytes), 2 the pack's last record (sealed) |
//! | 24..28 | CRC-32 of the object's bytes |
//! | 28..32 | CRC-32 of bytes 0..28 and the key |
//!
//! Every process keeps its own index of the packs (key → record), built from the records'
//! headers and followed through a counter every process shares (`packs.counter`, mapped
//! memory): a writer takes its records' sequence numbers from it before writing and adds one
//! after (published), and a reader reads the packs' new records whenever the counter moved.
//! Of two records of a key the later number wins (a removal hides an earlier put).
//!
//! Crash safety: a record is indexed only once its header holds (its CRC) and the file holds
//! all its bytes; a writer killed part way leaves a torn last record, which every reader stops
//! before (and retries, as it would a record still being written). A get checks each record it
//! reads again (header, key, number, and the object's CRC): a damaged one is a miss, and
//! removed.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyList};

use crate::local_io::{
    carries_trailer, checked, cpath, crc_of, errno, inside, iovecs, span_bytes, span_lists, start_writeback, trailer_holds, vectored_at,
    vectored_progress, Fd, Span, BUFFER_MISMATCH, DAMAGED, INVALID_PARAMS, IOV_MAX, OBJECT_NOT_FOUND,
};

const MAGIC: &[u8; 8] = b"HIOPAK01";
const HEADER: usize = 32;
const REMOVAL: u16 = 1;
const SEAL: u16 = 2;
/// Objects of up to this many bytes go to packs (larger ones to files of their own).
pub(crate) const PACK_OBJECT_MAX: usize = 64 << 10;
/// Bytes a pack scan reads at once.
const CHUNK: usize = 1 << 20;
/// At most this many bytes in one vectored read of a get.
const RUN_MAX: usize = 8 << 20;

/// A record's header, as read.
#[derive(Clone, Copy)]
struct Header {
    seq: u64,
    obj_len: usize,
    key_len: usize,
    flags: u16,
    crc: u32,
}

impl Header {
    /// The header's bytes and the key (the record's bytes before the object's).
    fn encode(&self, key: &[u8]) -> Vec<u8> {
        let mut h = Vec::with_capacity(HEADER + key.len());
        h.extend_from_slice(MAGIC);
        h.extend_from_slice(&self.seq.to_le_bytes());
        h.extend_from_slice(&(self.obj_len as u32).to_le_bytes());
        h.extend_from_slice(&(self.key_len as u16).to_le_bytes());
        h.extend_from_slice(&self.flags.to_le_bytes());
        h.extend_from_slice(&self.crc.to_le_bytes());
        let hcrc = header_crc(&h, key);
        h.extend_from_slice(&hcrc.to_le_bytes());
        h.extend_from_slice(key);
        h
    }

    /// The header at the start of `b`, where its magic holds; its own CRC is checked by
    /// [`Header::holds`] once the key is there too.
    fn parse(b: &[u8]) -> Option<Header> {
        let b: &[u8; HEADER] = b.get(..HEADER)?.try_into().ok()?;
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        (&b[..8] == MAGIC).then(|| Header {
            seq: u64::from_le_bytes(b[8..16].try_into().unwrap_or_default()),
            obj_len: u32_at(16) as usize,
            key_len: u16_at(20) as usize,
            flags: u16_at(22),
            crc: u32_at(24),
        })
    }

    /// Whether record bytes `b` (header then key) hold this header's CRC.
    fn holds(b: &[u8], key_len: usize) -> bool {
        let Some(key) = b.get(HEADER..HEADER + key_len) else { return false };
        let stored = u32::from_le_bytes([b[28], b[29], b[30], b[31]]);
        header_crc(&b[..28], key) == stored
    }

    fn record_len(&self) -> usize {
        HEADER + self.key_len + self.obj_len
    }
}

/// Bytes on disk (whole 4 KiB blocks) a record of `len` bytes at offset `at` adds to its pack:
/// at most `len` rounded up to blocks, which the reservation counts.
fn growth(at: u64, len: u64) -> u64 {
    let blocks = |x: u64| x.div_ceil(BLOCK) * BLOCK;
    blocks(at + len) - blocks(at)
}

/// What the directory's capacity counts a record of `len` bytes as before it is written.
fn reserved(len: u64) -> u64 {
    len.div_ceil(BLOCK).saturating_mul(BLOCK)
}

const BLOCK: u64 = 4096;

/// A record's share of its pack's seal (its line in the list), counted with the record.
fn listed(key_len: usize) -> u64 {
    24 + key_len as u64
}

/// The end of a sealed pack: its seal record's offset, then this.
const SEAL_END: &[u8; 8] = b"HIOPKEND";
/// A seal of more bytes than this is not read whole (the pack is read record by record).
const SEAL_MAX: u64 = 64 << 20;

/// One record in a seal's list: offset (u64), number (u64), object length (u32), flags (u16),
/// key length (u16), key.
fn index_item(items: &mut Vec<u8>, at: u64, h: &Header, key: &[u8]) {
    items.extend_from_slice(&at.to_le_bytes());
    items.extend_from_slice(&h.seq.to_le_bytes());
    items.extend_from_slice(&(h.obj_len as u32).to_le_bytes());
    items.extend_from_slice(&h.flags.to_le_bytes());
    items.extend_from_slice(&(key.len() as u16).to_le_bytes());
    items.extend_from_slice(key);
}

/// A seal record's object: the list of the pack's records, then the seal's own offset `at` and
/// [`SEAL_END`], which end the file.
fn seal_bytes(items: &[u8], at: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(items.len() + 16);
    b.extend_from_slice(items);
    b.extend_from_slice(&at.to_le_bytes());
    b.extend_from_slice(SEAL_END);
    b
}

/// The records a seal lists (its object's bytes `body`, the list then 16 bytes), each checked to
/// lie before the seal at `at`; `None` where the list does not parse.
fn seal_items(body: &[u8], at: u64) -> Option<Vec<(Vec<u8>, Header, u64)>> {
    let list = body.get(..body.len().checked_sub(16)?)?;
    let (mut out, mut p) = (Vec::new(), 0usize);
    while p < list.len() {
        let f = list.get(p..p + 24)?;
        let u = |r: std::ops::Range<usize>| f[r].iter().rev().fold(0u64, |a, &b| (a << 8) | b as u64);
        let (rec_at, seq, obj_len, flags, key_len) = (u(0..8), u(8..16), u(16..20) as usize, u(20..22) as u16, u(22..24) as usize);
        let key = list.get(p + 24..p + 24 + key_len)?.to_vec();
        let h = Header { seq, obj_len, key_len, flags, crc: 0 };
        if rec_at.checked_add(h.record_len() as u64)? > at || obj_len > PACK_OBJECT_MAX || flags & !REMOVAL != 0 {
            return None;
        }
        out.push((key, h, rec_at));
        p += 24 + key_len;
    }
    Some(out)
}

fn header_crc(head28: &[u8], key: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&head28[..28]);
    h.update(key);
    h.finalize()
}

/// The directory's shared counter: a `u64` in a mapped file every process maps.
struct Counter(std::ptr::NonNull<AtomicU64>);

// SAFETY: the mapping is shared memory used only through atomics; it lives until `Drop`.
unsafe impl Send for Counter {}
unsafe impl Sync for Counter {}

impl Counter {
    fn open(path: &str) -> std::io::Result<Counter> {
        use std::os::unix::io::AsRawFd;
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path)?;
        // Its block allocated, not a hole a store to the mapping would have to allocate (a full
        // disk would then kill the process with SIGBUS); never zeroed, so a racing maker's
        // counter stays. A file system without fallocate gets the hole.
        // SAFETY: an open descriptor.
        if unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, 4096) } != 0 && f.metadata()?.len() < 4096 {
            f.set_len(4096)?;
        }
        // SAFETY: a shared read-write mapping of 4096 bytes of an open file (the mapping outlives
        // the descriptor); unmapped in `Drop`.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, f.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        std::ptr::NonNull::new(p as *mut AtomicU64).map(Counter).ok_or_else(|| std::io::Error::other("mmap"))
    }

    fn get(&self) -> &AtomicU64 {
        // SAFETY: page-aligned, mapped for this value's life.
        unsafe { self.0.as_ref() }
    }
}

impl Drop for Counter {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `open`.
        unsafe { libc::munmap(self.0.as_ptr() as *mut libc::c_void, 4096) };
    }
}

/// Descriptors a process's packs hold open at most (beyond its own pack's): the least recently
/// used are closed past it, and opened again when read.
pub(crate) const OPEN_MAX: usize = 16;

/// The packs' open descriptors, and a clock of their use.
#[derive(Default)]
struct Budget {
    opened: AtomicUsize,
    tick: AtomicU64,
}

/// A pack this process knows: its descriptor opened when read, closed when the budget is spent.
struct Pack {
    path: String,
    fd: Mutex<Option<Arc<Fd>>>,
    /// The writer's own pack: its read-write descriptor stays (and is not counted).
    pinned: AtomicBool,
    budget: Arc<Budget>,
    used: AtomicU64,
    /// Seconds (since the epoch) of its last mark of use (its modification time).
    touched: AtomicI64,
}

impl Pack {
    fn new(path: String, fd: Option<Fd>, budget: Arc<Budget>) -> Pack {
        let pinned = AtomicBool::new(fd.is_some());
        Pack { path, fd: Mutex::new(fd.map(Arc::new)), pinned, budget, used: AtomicU64::new(0), touched: AtomicI64::new(0) }
    }

    /// Its descriptor, opened (read-only) if closed; a reader's copy stays usable however the
    /// pack's is closed meanwhile.
    fn fd(&self) -> Result<Arc<Fd>, i64> {
        self.used.store(self.budget.tick.fetch_add(1, Ordering::Relaxed), Ordering::Relaxed);
        let mut g = lock(&self.fd);
        if let Some(f) = g.as_ref() {
            return Ok(f.clone());
        }
        let f = Arc::new(open_fd(&self.path, libc::O_RDONLY)?);
        self.budget.opened.fetch_add(1, Ordering::Relaxed);
        *g = Some(f.clone());
        Ok(f)
    }

    /// Closes its descriptor (not the writer's own).
    fn close(&self) {
        if !self.pinned.load(Ordering::Relaxed) && lock(&self.fd).take().is_some() {
            self.budget.opened.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// The writer is done with it: its descriptor counts (and closes) as any.
    fn unpin(&self) {
        if self.pinned.swap(false, Ordering::Relaxed) && lock(&self.fd).is_some() {
            self.budget.opened.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Pack {
    fn drop(&mut self) {
        if !*self.pinned.get_mut() && self.fd.get_mut().map(|f| f.is_some()).unwrap_or(false) {
            self.budget.opened.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Where an object's record lies.
#[derive(Clone, Copy)]
struct Entry {
    pack: u32,
    at: u64,
    obj_len: u32,
    seq: u64,
    live: bool,
}

struct Known {
    name: String,
    pack: Arc<Pack>,
    scanned: u64,
    sealed: bool,
}

/// This process's index of the packs.
#[derive(Default)]
struct Index {
    packs: HashMap<u32, Known>,
    by_name: HashMap<String, u32>,
    next_id: u32,
    map: HashMap<Vec<u8>, Entry>,
    last_seen: Option<u64>,
    /// The highest number of a record applied.
    top: u64,
}

/// The pack this process appends to.
#[derive(Default)]
struct Writer {
    pack: Option<(u32, Arc<Pack>, u64)>,
    made: u64,
    /// The process that made the pack (a child of `fork()` makes its own).
    pid: u32,
    /// Bytes on disk seals added that no put has reported yet.
    sealed: u64,
    /// The index of the pack's records so far, as its seal holds it ([`seal_bytes`]).
    items: Vec<u8>,
}

/// Small objects of a local store's directory in packs (see the module docs).
#[pyclass(module = "hicache_io._native")]
pub(crate) struct LocalPacks {
    folder: String,
    budget: Arc<Budget>,
    tag: String,
    pack_bytes: u64,
    counter: Counter,
    index: Mutex<Index>,
    writer: Mutex<Writer>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn fstat(fd: &Fd) -> Result<libc::stat, i64> {
    // SAFETY: fstat fills the zeroed struct for an open descriptor.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd.0, &mut st) } != 0 {
        return Err(errno());
    }
    Ok(st)
}

fn open_fd(path: &str, flags: libc::c_int) -> Result<Fd, i64> {
    let c = cpath(path).ok_or(INVALID_PARAMS)?;
    // SAFETY: a NUL-terminated path; the descriptor is closed by `Fd`.
    let raw = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC, 0o644) };
    if raw < 0 {
        return Err(errno());
    }
    Ok(Fd(raw))
}

fn now_secs() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

/// Reads up to `n` bytes at `at`; fewer at the end of the file.
fn pread_some(fd: &Fd, n: usize, at: u64) -> Result<Vec<u8>, i64> {
    let mut buf = vec![0u8; n];
    let iov = vec![libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: n }];
    let got = vectored_at(fd, iov, false, at as usize)?;
    buf.truncate(got);
    Ok(buf)
}

impl Index {
    /// The live record of `key`, in a pack this index knows.
    fn live(&self, key: &[u8]) -> Option<&Entry> {
        self.map.get(key).filter(|e| e.live && self.packs.contains_key(&e.pack))
    }

    /// Applies a record: the later number of a key wins.
    fn apply(&mut self, key: &[u8], e: Entry) {
        self.top = self.top.max(e.seq);
        match self.map.get_mut(key) {
            Some(old) if old.seq >= e.seq => {}
            Some(old) => *old = e,
            None => {
                self.map.insert(key.to_vec(), e);
            }
        }
    }

    fn add_pack(&mut self, name: String, pack: Arc<Pack>, scanned: u64) -> u32 {
        let id = self.next_id;
        self.next_id += 1;
        self.by_name.insert(name.clone(), id);
        self.packs.insert(id, Known { name, pack, scanned, sealed: false });
        id
    }

    /// Reads a sealed pack met for the first time from its seal alone (the list of its records);
    /// false where it is not sealed or its seal does not hold (then it is read record by record).
    fn scan_sealed(&mut self, id: u32, pack: &Pack, size: u64) -> bool {
        let Ok(fd) = pack.fd() else { return false };
        let Some(tail) = size.checked_sub(16).and_then(|t| pread_some(&fd, 16, t).ok()) else { return false };
        if tail.len() != 16 || &tail[8..] != SEAL_END {
            return false;
        }
        let at = u64::from_le_bytes(tail[..8].try_into().unwrap_or_default());
        if at.checked_add((HEADER + 16) as u64).is_none_or(|e| e > size) || size - at > SEAL_MAX {
            return false;
        }
        let Ok(rec) = pread_some(&fd, (size - at) as usize, at) else { return false };
        let Some(h) = Header::parse(&rec) else { return false };
        let whole = h.flags == SEAL && h.key_len == 0 && HEADER + h.obj_len == rec.len() && Header::holds(&rec, 0);
        let Some(items) = whole.then(|| &rec[HEADER..]).filter(|b| crc32fast::hash(b) == h.crc).and_then(|b| seal_items(b, at)) else {
            return false;
        };
        for (key, h, rec_at) in items {
            let e = Entry { pack: id, at: rec_at, obj_len: h.obj_len as u32, seq: h.seq, live: h.flags & REMOVAL == 0 };
            self.apply(&key, e);
        }
        if let Some(k) = self.packs.get_mut(&id) {
            (k.scanned, k.sealed) = (size, true);
        }
        true
    }

    /// Reads pack `id`'s records past what was read of it; stops before a record not whole yet
    /// (or torn, or damaged in its header).
    fn scan(&mut self, id: u32) -> Result<(), i64> {
        let Some(k) = self.packs.get(&id) else { return Ok(()) };
        let (pack, mut scanned) = (k.pack.clone(), k.scanned);
        let fd = pack.fd()?;
        let size = fstat(&fd)?.st_size.max(0) as u64;
        if scanned == 0 && self.scan_sealed(id, &pack, size) {
            return Ok(());
        }
        let mut sealed = false;
        'chunks: while scanned + HEADER as u64 <= size && !sealed {
            let buf = pread_some(&fd, CHUNK.min((size - scanned) as usize), scanned)?;
            let mut pos = 0usize;
            while let Some(h) = Header::parse(&buf[pos.min(buf.len())..]) {
                let Some(rec) = buf.get(pos..pos + HEADER + h.key_len) else { break };
                let end = scanned + (pos + h.record_len()) as u64;
                let sane = h.flags & SEAL != 0 || h.obj_len <= PACK_OBJECT_MAX;
                if !sane || !Header::holds(rec, h.key_len) || end > size {
                    break 'chunks; // torn, damaged, or not whole yet: retried at the next scan
                }
                if h.flags & SEAL != 0 {
                    sealed = true;
                } else {
                    let e =
                        Entry { pack: id, at: scanned + pos as u64, obj_len: h.obj_len as u32, seq: h.seq, live: h.flags & REMOVAL == 0 };
                    self.apply(&rec[HEADER..], e);
                }
                pos += h.record_len();
                if sealed || pos + HEADER > buf.len() {
                    break;
                }
            }
            if pos == 0 {
                break; // no whole header in reach
            }
            scanned += pos as u64;
        }
        if let Some(k) = self.packs.get_mut(&id) {
            k.scanned = scanned;
            k.sealed = sealed;
        }
        Ok(())
    }
}

impl LocalPacks {
    /// Follows the packs (new packs, new records, packs gone) where the counter moved since the
    /// last look (or always, `force`).
    fn refresh(&self, force: bool) -> Result<MutexGuard<'_, Index>, i64> {
        let mut idx = lock(&self.index);
        self.trim(&idx);
        let now = self.counter.get().load(Ordering::Acquire);
        if !force && idx.last_seen == Some(now) {
            return Ok(idx);
        }
        let mut names = HashSet::new();
        let rd = std::fs::read_dir(&self.folder).map_err(|e| -(e.raw_os_error().unwrap_or(libc::EIO) as i64))?;
        for ent in rd.flatten() {
            if let Some(n) = ent.file_name().to_str().filter(|n| n.ends_with(".pack")) {
                names.insert(n.to_string());
            }
        }
        let gone: HashSet<u32> = idx.packs.iter().filter(|(_, k)| !names.contains(&k.name)).map(|(&id, _)| id).collect();
        if !gone.is_empty() {
            for id in &gone {
                if let Some(k) = idx.packs.remove(id) {
                    idx.by_name.remove(&k.name);
                }
            }
            idx.map.retain(|_, e| !gone.contains(&e.pack));
        }
        for n in names {
            if idx.by_name.contains_key(&n) {
                continue;
            }
            // Opened when read: one gone meanwhile, or not openable (a permission), reads as misses.
            let pack = Pack::new(format!("{}/{n}", self.folder), None, self.budget.clone());
            idx.add_pack(n, Arc::new(pack), 0);
        }
        let open: Vec<u32> = idx.packs.iter().filter(|(_, k)| !k.sealed).map(|(&id, _)| id).collect();
        for id in open {
            let _ = idx.scan(id); // a read error leaves the rest of that pack for the next look
        }
        // Numbers stay ahead of every record seen (a counter file made anew after a crash).
        if self.counter.get().load(Ordering::Acquire) <= idx.top {
            self.counter.get().fetch_max(idx.top + 1, Ordering::AcqRel);
        }
        idx.last_seen = Some(now);
        Ok(idx)
    }

    /// Past the budget of open descriptors, closes the least recently used down to half of it.
    fn trim(&self, idx: &Index) {
        let open = self.budget.opened.load(Ordering::Relaxed);
        if open <= OPEN_MAX {
            return;
        }
        let mut by_use: Vec<(u64, &Arc<Pack>)> = idx.packs.values().map(|k| (k.pack.used.load(Ordering::Relaxed), &k.pack)).collect();
        by_use.sort_by_key(|u| u.0);
        for (_, p) in by_use {
            if self.budget.opened.load(Ordering::Relaxed) <= OPEN_MAX / 2 {
                break;
            }
            p.close();
        }
    }

    /// The pack to append `need` more bytes to: the current one, unless it is full (then sealed)
    /// or gone (evicted); else a new one, known to the index.
    fn writer_pack(&self, w: &mut Writer, need: u64) -> Result<(u32, Arc<Pack>, u64), i64> {
        if w.pid != std::process::id() {
            // A child of fork(): its parent's pack is the parent's to append to.
            (w.pack, w.made) = (None, 0);
            w.items.clear();
        }
        if let Some((id, pack, end)) = w.pack.clone() {
            let fd = pack.fd();
            let gone = fd.as_ref().map_or(true, |f| fstat(f).map_or(true, |s| s.st_nlink == 0));
            if !gone && (end == 0 || end + need <= self.pack_bytes) {
                return Ok((id, pack, end));
            }
            if let (false, Ok(fd)) = (gone, fd) {
                w.sealed += Self::seal_pack(&fd, end, &w.items);
            }
            pack.unpin();
            w.pack = None;
        }
        w.items.clear();
        w.made += 1;
        w.pid = std::process::id();
        let nonce = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let name = format!("{}-{}-{}-{nonce:09}.pack", self.tag, w.pid, w.made);
        let path = format!("{}/{name}", self.folder);
        let fd = open_fd(&path, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL)?;
        let pack = Arc::new(Pack::new(path, Some(fd), self.budget.clone()));
        pack.touched.store(now_secs(), Ordering::Relaxed);
        let id = lock(&self.index).add_pack(name, pack.clone(), 0);
        w.pack = Some((id, pack.clone(), 0));
        Ok((id, pack, 0))
    }

    /// Closes a pack whose records end at `end`: its last record lists them all ([`seal_bytes`]),
    /// so that a process that meets the pack later reads that record alone. Best effort: a pack
    /// left unsealed is read record by record.
    fn seal_pack(fd: &Fd, end: u64, items: &[u8]) -> u64 {
        let body = seal_bytes(items, end);
        let head = Header { seq: 0, obj_len: body.len(), key_len: 0, flags: SEAL, crc: crc32fast::hash(&body) }.encode(b"");
        let iov = vec![
            libc::iovec { iov_base: head.as_ptr() as *mut libc::c_void, iov_len: head.len() },
            libc::iovec { iov_base: body.as_ptr() as *mut libc::c_void, iov_len: body.len() },
        ];
        let len = (head.len() + body.len()) as u64;
        // The bytes on disk it added (for the capacity's count), none where it failed.
        vectored_at(fd, iov, true, end as usize).map_or(0, |_| growth(end, len))
    }

    /// The answers of records `heads` (of `lens` bytes) written from `start` of pack `id`, whose
    /// bytes up to `done` are on disk: `(id, offset)` for each whole one (listed for the seal),
    /// `failed` for the rest. The end of the last whole one.
    fn written(
        w: &mut Writer,
        (id, start, done): (u32, u64, u64),
        heads: &[Vec<u8>],
        lens: &[u64],
        failed: i64,
        out: &mut Vec<Result<(u32, u64), i64>>,
    ) -> u64 {
        let (mut at, mut whole) = (start, start);
        for (head, len) in heads.iter().zip(lens) {
            let end = at + len;
            if end <= done {
                out.push(Ok((id, at)));
                if let Some(h) = Header::parse(head) {
                    index_item(&mut w.items, at, &h, &head[HEADER..]);
                }
                whole = end;
            } else {
                out.push(Err(failed));
            }
            at = end;
        }
        whole
    }

    /// Appends records (`heads[j]`: header and key; `bodies[j]`: the object's spans) at the end
    /// of this process's pack; per record, its `(pack, offset)` or a code. A write cut short
    /// keeps the records written whole and cuts the rest away.
    fn append(&self, heads: &[Vec<u8>], bodies: &[&[Span]], rule: (bool, bool)) -> Vec<Result<(u32, u64), i64>> {
        let (fsync, writeback) = rule;
        let mut out: Vec<Result<(u32, u64), i64>> = Vec::with_capacity(heads.len());
        let lens: Vec<u64> = heads.iter().zip(bodies).map(|(h, b)| (h.len() + b.iter().map(|s| s.1).sum::<usize>()) as u64).collect();
        let len = |j: usize| lens[j];
        let mut w = lock(&self.writer);
        let mut j = 0;
        while j < heads.len() {
            let (id, fd, start) = match self.writer_pack(&mut w, len(j)).and_then(|(id, p, start)| Ok((id, p.fd()?, start))) {
                Ok(p) => p,
                Err(e) => {
                    out.push(Err(e));
                    j += 1;
                    continue;
                }
            };
            // As many records as fit the pack and one vectored call.
            let (mut k, mut bytes, mut n_iov) = (j, 0u64, 0usize);
            // The first always (a record of more spans than one call takes moves in several).
            while k < heads.len() && (k == j || (start + bytes + len(k) <= self.pack_bytes && n_iov + 1 + bodies[k].len() <= IOV_MAX)) {
                bytes += len(k);
                n_iov += 1 + bodies[k].len();
                k += 1;
            }
            let mut iov = Vec::with_capacity(n_iov);
            for (head, body) in heads[j..k].iter().zip(&bodies[j..k]) {
                iov.push(libc::iovec { iov_base: head.as_ptr() as *mut libc::c_void, iov_len: head.len() });
                iov.extend(iovecs(body));
            }
            let (wrote, err) = match vectored_progress(&fd, iov, true, start as usize) {
                (n, Some(e)) => (n as u64, e),
                (n, None) => (n as u64, if (n as u64) < bytes { -(libc::ENOSPC as i64) } else { 0 }),
            };
            let failed = if err != 0 { err } else { -(libc::EIO as i64) };
            let mark = out.len();
            let whole = Self::written(&mut w, (id, start, start + wrote), &heads[j..k], &lens[j..k], failed, &mut out);
            if whole < start + bytes {
                // SAFETY: an open descriptor; the torn records go (the pack is abandoned if not).
                if unsafe { libc::ftruncate(fd.0, whole as libc::off_t) } != 0 {
                    w.pack = None;
                }
            } else if writeback && !fsync {
                start_writeback(&fd);
            }
            // SAFETY: an open descriptor.
            if fsync && whole > start && unsafe { libc::fdatasync(fd.0) } != 0 {
                // The records stay (whole, and perhaps indexed by others already) but are not
                // reported stored: their flush failed.
                let e = errno();
                out[mark..].iter_mut().filter(|o| o.is_ok()).for_each(|o| *o = Err(e));
            }
            if let Some(p) = w.pack.as_mut().filter(|p| p.0 == id) {
                p.2 = whole;
            }
            j = k;
        }
        out
    }

    /// Publishes records numbered `base + 1 ..= base + n` (written): the counter moves, and
    /// this process skips its next look where nobody else wrote meanwhile.
    fn publish(&self, idx: &mut Index, base: u64, n: u64) {
        let p = self.counter.get().fetch_add(1, Ordering::AcqRel);
        if idx.last_seen == Some(base) && p == base + n {
            idx.last_seen = Some(p + 1);
        }
    }

    /// Removal records for `keys`: those the index holds live (and, with `expected`, whose live
    /// record is still the one numbered `expected[j]`: a damaged record's removal never removes
    /// a newer put). Per key whether its removal was written, and the bytes on disk they added.
    fn remove_keys(&self, keys: &[Vec<u8>], expected: Option<&[u64]>) -> Result<(Vec<bool>, u64), i64> {
        let todo: Vec<usize> = {
            let idx = self.refresh(false)?;
            (0..keys.len()).filter(|&j| idx.live(&keys[j]).is_some_and(|e| expected.is_none_or(|s| s.get(j) == Some(&e.seq)))).collect()
        };
        let mut removed = vec![false; keys.len()];
        if todo.is_empty() {
            return Ok((removed, 0));
        }
        let base = self.counter.get().fetch_add(todo.len() as u64, Ordering::AcqRel);
        let heads: Vec<Vec<u8>> = todo
            .iter()
            .enumerate()
            .map(|(i, &j)| Header { seq: base + 1 + i as u64, obj_len: 0, key_len: keys[j].len(), flags: REMOVAL, crc: 0 }.encode(&keys[j]))
            .collect();
        let none: Vec<&[Span]> = vec![&[]; heads.len()];
        let wrote = self.append(&heads, &none, (false, false));
        let mut sealed = std::mem::take(&mut lock(&self.writer).sealed); // before the index: the writer's lock comes first
        let mut idx = lock(&self.index);
        let mut bytes = 0;
        for (i, &j) in todo.iter().enumerate() {
            if let Ok((pack, at)) = wrote[i] {
                if idx.packs.contains_key(&pack) {
                    idx.apply(&keys[j], Entry { pack, at, obj_len: 0, seq: base + 1 + i as u64, live: false });
                }
                bytes += growth(at, heads[i].len() as u64) + std::mem::take(&mut sealed);
                removed[j] = true;
            }
        }
        self.publish(&mut idx, base, todo.len() as u64);
        Ok((removed, bytes))
    }
}

/// An object a get reads from a pack: its record and the caller's spans it lands in.
struct Want {
    j: usize,
    pid: u32,
    pack: Arc<Pack>,
    at: u64,
    key_len: usize,
    obj_len: usize,
    seq: u64,
    targets: Vec<Span>,
}

impl Want {
    fn end(&self) -> u64 {
        self.at + (HEADER + self.key_len + self.obj_len) as u64
    }
}

/// The spans a get lands object `n` bytes long in (`exact`: the spans add up to it; else one span
/// at least as large), or a code.
fn targets(spans: &[Span], n: usize, exact: bool) -> Result<Vec<Span>, i64> {
    let room = span_bytes(spans).ok_or(INVALID_PARAMS)?;
    if exact {
        return if room == n { Ok(spans.to_vec()) } else { Err(BUFFER_MISMATCH) };
    }
    if spans.len() != 1 || room < n {
        return Err(INVALID_PARAMS);
    }
    Ok(vec![(spans[0].0, n)])
}

/// Whether the record read for `w` (its header and key in `head`, its object in its targets)
/// is the one the index names, whole: header, key, number, length, and the object's CRC
/// (unless it carries hicache-io's trailer, which the store checks, and `crc_trailered` is off).
fn record_holds(w: &Want, head: &[u8], key: &[u8], crc_trailered: bool) -> bool {
    let Some(h) = named_record(head, key, w.seq, w.obj_len) else { return false };
    (!crc_trailered && carries_trailer(&w.targets)) || crc_of(&w.targets) == h.crc
}

/// The header at the start of `rec` (its header then key, at least), where it is the record an
/// index names: this key's, numbered `seq`, of an object of `obj_len` bytes, its own CRC held.
fn named_record(rec: &[u8], key: &[u8], seq: u64, obj_len: usize) -> Option<Header> {
    let h = Header::parse(rec)?;
    let same = h.seq == seq && h.key_len == key.len() && h.obj_len == obj_len && h.flags == 0;
    (same && Header::holds(rec, h.key_len) && rec.get(HEADER..HEADER + key.len()) == Some(key)).then_some(h)
}

/// Runs of records adjacent in one pack (one vectored read each), within the call's limits.
fn runs(mut wants: Vec<Want>) -> Vec<Vec<Want>> {
    wants.sort_by_key(|w| (w.pid, w.at));
    let mut out: Vec<Vec<Want>> = Vec::new();
    let (mut bytes, mut n_iov) = (0u64, 0usize);
    for w in wants {
        let joins = out.last().and_then(|r| r.last()).is_some_and(|p| p.pid == w.pid && p.end() == w.at);
        let len = w.end() - w.at;
        if joins && bytes + len <= RUN_MAX as u64 && n_iov + 1 + w.targets.len() <= IOV_MAX {
            bytes += len;
            n_iov += 1 + w.targets.len();
            if let Some(r) = out.last_mut() {
                r.push(w);
            }
        } else {
            (bytes, n_iov) = (len, 1 + w.targets.len());
            out.push(vec![w]);
        }
    }
    out
}

impl LocalPacks {
    /// Reads one run of adjacent records; per record, its object's bytes or a code (`DAMAGED`
    /// where it does not hold).
    fn read_run(run: &[Want], keys: &[Vec<u8>], crc_trailered: bool, out: &mut [i64]) {
        let heads: Vec<usize> = run.iter().map(|w| HEADER + w.key_len).collect();
        let mut scratch = vec![0u8; heads.iter().sum()];
        let mut iov = Vec::new();
        let mut off = 0;
        for (w, &h) in run.iter().zip(&heads) {
            // SAFETY: `off + h <= scratch.len()`; the pointer stays inside the vector.
            iov.push(libc::iovec { iov_base: unsafe { scratch.as_mut_ptr().add(off) } as *mut libc::c_void, iov_len: h });
            iov.extend(iovecs(&w.targets));
            off += h;
        }
        let start = run[0].at;
        // Records read whole before an error still count; a pack shorter than its records was
        // cut meanwhile: the rest are misses (so is a pack that cannot be opened: gone).
        let (got, err) = match run[0].pack.fd().map(|fd| vectored_progress(&fd, iov, false, start as usize)) {
            Ok((n, Some(e))) => (n as u64, e),
            Ok((n, None)) => (n as u64, OBJECT_NOT_FOUND),
            Err(_) => (0, OBJECT_NOT_FOUND),
        };
        let mut off = 0;
        for (w, &h) in run.iter().zip(&heads) {
            out[w.j] = if w.end() > start + got {
                err
            } else if record_holds(w, &scratch[off..off + h], &keys[w.j], crc_trailered) {
                w.obj_len as i64
            } else {
                DAMAGED
            };
            off += h;
        }
    }

    /// The records of `keys` the index holds live, with their targets (`out` gets a code for
    /// the others: `OBJECT_NOT_FOUND` where packs do not hold it).
    fn plan_get(&self, keys: &[Vec<u8>], spans: &[Option<Vec<Span>>], exact: bool, out: &mut [i64]) -> Result<Vec<Want>, i64> {
        let idx = self.refresh(false)?;
        let mut wants = Vec::new();
        for (j, key) in keys.iter().enumerate() {
            let Some(e) = idx.live(key) else {
                out[j] = OBJECT_NOT_FOUND;
                continue;
            };
            let (Some(s), Some(k)) = (&spans[j], idx.packs.get(&e.pack)) else {
                out[j] = if spans[j].is_none() { INVALID_PARAMS } else { OBJECT_NOT_FOUND };
                continue;
            };
            match targets(s, e.obj_len as usize, exact) {
                Ok(targets) => wants.push(Want {
                    j,
                    pid: e.pack,
                    pack: k.pack.clone(),
                    at: e.at,
                    key_len: key.len(),
                    obj_len: e.obj_len as usize,
                    seq: e.seq,
                    targets,
                }),
                Err(c) => out[j] = c,
            }
        }
        Ok(wants)
    }

    fn get_all(&self, keys: &[Vec<u8>], spans: &[Option<Vec<Span>>], exact: bool, crc_trailered: bool, touch_seconds: f64) -> Vec<i64> {
        let mut out = vec![0i64; keys.len()];
        let wants = match self.plan_get(keys, spans, exact, &mut out) {
            Ok(w) => w,
            Err(_) => return vec![OBJECT_NOT_FOUND; keys.len()], // packs unreadable now: the caller tries files
        };
        let seqs: Vec<(usize, u64)> = wants.iter().map(|w| (w.j, w.seq)).collect();
        let now = now_secs();
        for run in runs(wants) {
            Self::read_run(&run, keys, crc_trailered, &mut out);
            let p = &run[0].pack;
            if (now - p.touched.load(Ordering::Relaxed)) as f64 > touch_seconds {
                p.touched.store(now, Ordering::Relaxed);
                if let Ok(fd) = p.fd() {
                    // SAFETY: a null times pointer sets both times to now (the eviction order).
                    unsafe { libc::futimens(fd.0, std::ptr::null()) };
                }
            }
        }
        if self.budget.opened.load(Ordering::Relaxed) > OPEN_MAX {
            self.trim(&lock(&self.index));
        }
        let (damaged, seqs): (Vec<Vec<u8>>, Vec<u64>) =
            seqs.into_iter().filter(|&(j, _)| out[j] == DAMAGED).map(|(j, s)| (keys[j].clone(), s)).unzip();
        if !damaged.is_empty() {
            let _ = self.remove_keys(&damaged, Some(&seqs)); // a miss either way; removed where it can be
        }
        out
    }

    /// Which of `keys` to write: not held live, and each key's first occurrence in the batch.
    fn fresh(&self, keys: &[Vec<u8>]) -> Result<Vec<bool>, i64> {
        let idx = self.refresh(false)?;
        let mut seen = HashSet::new();
        Ok(keys.iter().map(|k| idx.live(k).is_none() && seen.insert(k.as_slice())).collect())
    }

    /// Writes the objects `fresh` marks (their spans checked: `None` outside registered memory);
    /// per object the bytes it added to the pack, `0` (kept), or a code.
    fn put_all(&self, keys: &[Vec<u8>], spans: &[Option<Vec<Span>>], fresh: &[bool], rule: (bool, bool)) -> Vec<i64> {
        let mut out = vec![0i64; keys.len()];
        let mut todo = Vec::new();
        for j in (0..keys.len()).filter(|&j| fresh[j]) {
            match &spans[j] {
                Some(s) if keys[j].len() <= u16::MAX as usize && span_bytes(s).is_some_and(|n| n <= PACK_OBJECT_MAX) => todo.push(j),
                _ => out[j] = INVALID_PARAMS,
            }
        }
        if todo.is_empty() {
            return out;
        }
        let base = self.counter.get().fetch_add(todo.len() as u64, Ordering::AcqRel);
        let bodies: Vec<&[Span]> = todo.iter().map(|&j| spans[j].as_deref().unwrap_or(&[])).collect();
        let heads: Vec<Vec<u8>> = todo
            .iter()
            .zip(&bodies)
            .enumerate()
            .map(|(i, (&j, b))| {
                let n = b.iter().map(|s| s.1).sum();
                Header { seq: base + 1 + i as u64, obj_len: n, key_len: keys[j].len(), flags: 0, crc: crc_of(b) }.encode(&keys[j])
            })
            .collect();
        let wrote = self.append(&heads, &bodies, rule);
        // The pack's seal written on the way is reported with the first record written.
        let mut sealed = std::mem::take(&mut lock(&self.writer).sealed);
        let mut idx = lock(&self.index);
        for (i, &j) in todo.iter().enumerate() {
            let n = bodies[i].iter().map(|s| s.1).sum::<usize>();
            out[j] = match wrote[i] {
                Ok((pack, at)) => {
                    // A pack evicted meanwhile (and dropped by a look of another thread) is not
                    // indexed again: its record is gone with it.
                    if idx.packs.contains_key(&pack) {
                        idx.apply(&keys[j], Entry { pack, at, obj_len: n as u32, seq: base + 1 + i as u64, live: true });
                    }
                    let len = (heads[i].len() + n) as u64;
                    if let Some(k) = idx.packs.get_mut(&pack).filter(|k| k.scanned == at) {
                        k.scanned = at + len;
                    }
                    (growth(at, len) + std::mem::take(&mut sealed)) as i64
                }
                Err(e) => e,
            };
        }
        self.publish(&mut idx, base, todo.len() as u64);
        out
    }

    /// Checks every live record whole (as a get would, the trailer included); removes the
    /// damaged. `(checked, damaged)`.
    fn scrub_all(&self) -> Result<(usize, usize), i64> {
        let live: Vec<(Vec<u8>, Arc<Pack>, Entry)> = {
            let idx = self.refresh(true)?;
            idx.map
                .iter()
                .filter(|(_, e)| e.live)
                .filter_map(|(k, e)| idx.packs.get(&e.pack).map(|p| (k.clone(), p.pack.clone(), *e)))
                .collect()
        };
        let (mut damaged, mut seqs) = (Vec::new(), Vec::new());
        for (key, pack, e) in &live {
            let len = HEADER + key.len() + e.obj_len as usize;
            let rec = pread_some(&*pack.fd()?, len, e.at)?;
            let h = named_record(&rec, key, e.seq, e.obj_len as usize).filter(|_| rec.len() == len);
            let intact = h.is_some_and(|h| {
                let obj = &rec[HEADER + key.len()..];
                crc32fast::hash(obj) == h.crc && trailer_holds(obj, key).unwrap_or(false)
            });
            if !intact {
                damaged.push(key.clone());
                seqs.push(e.seq);
            }
        }
        if !damaged.is_empty() {
            self.remove_keys(&damaged, Some(&seqs))?;
        }
        Ok((live.len(), damaged.len()))
    }
}

fn os_err(code: i64) -> PyErr {
    PyOSError::new_err((-code as i32, std::io::Error::from_raw_os_error(-code as i32).to_string()))
}

fn key_bytes(keys: Vec<String>) -> Vec<Vec<u8>> {
    keys.into_iter().map(String::into_bytes).collect()
}

#[pymethods]
impl LocalPacks {
    /// The packs of store directory `directory` (folder `packs/`, counter `packs.counter`);
    /// this process's packs are named `<tag>-<n>.pack` and closed at `pack_bytes`.
    #[new]
    fn new(directory: &str, tag: &str, pack_bytes: u64) -> PyResult<Self> {
        if tag.contains('/') || tag.is_empty() {
            return Err(pyo3::exceptions::PyValueError::new_err(format!("a pack tag names a file: {tag:?}")));
        }
        let folder = format!("{directory}/packs");
        std::fs::create_dir_all(&folder)?;
        let counter = Counter::open(&format!("{directory}/packs.counter"))?;
        let pack_bytes = pack_bytes.max((HEADER + u16::MAX as usize + PACK_OBJECT_MAX) as u64);
        Ok(LocalPacks {
            folder,
            budget: Arc::default(),
            tag: tag.to_string(),
            pack_bytes,
            counter,
            index: Mutex::default(),
            writer: Mutex::default(),
        })
    }

    /// Reads objects `keys[j]` into their spans (as `local_get`'s, each inside one of
    /// `regions`); per object its bytes, `-704` (not in a pack: the caller looks for its file),
    /// `-600`, `-800`, `DAMAGED` (removed) or `-errno`.
    #[pyo3(signature = (regions, keys, ptrs, sizes, exact, crc_trailered, touch_seconds))]
    fn get(
        &self,
        py: Python<'_>,
        regions: Vec<Span>,
        keys: Vec<String>,
        ptrs: &Bound<'_, PyList>,
        sizes: &Bound<'_, PyList>,
        exact: bool,
        crc_trailered: bool,
        touch_seconds: f64,
    ) -> PyResult<Vec<i64>> {
        let spans = checked(&regions, ptrs, sizes, keys.len())?;
        let keys = key_bytes(keys);
        Ok(py.detach(|| self.get_all(&keys, &spans, exact, crc_trailered, touch_seconds)))
    }

    /// Writes objects `keys[j]` (each of at most `PACK_OBJECT_MAX` bytes) from their spans, those
    /// the packs do not hold yet; `reserve(need)` is called first with at least the bytes on disk
    /// they add (as `local_put`'s). `None` where it refuses; else `(need, per object: bytes on disk added, 0 (kept),
    /// -600 (a span outside `regions`, or too large) or -errno)`.
    #[pyo3(signature = (regions, keys, ptrs, sizes, reserve, fsync=false, start_writeback=true))]
    fn put(
        &self,
        py: Python<'_>,
        regions: Vec<Span>,
        keys: Vec<String>,
        ptrs: &Bound<'_, PyList>,
        sizes: &Bound<'_, PyList>,
        reserve: &Bound<'_, PyAny>,
        fsync: bool,
        start_writeback: bool,
    ) -> PyResult<Option<(u64, Vec<i64>)>> {
        let all = span_lists(ptrs, sizes, keys.len())?;
        let keys = key_bytes(keys);
        let fresh = match py.detach(|| self.fresh(&keys)) {
            Ok(f) => f,
            Err(e) => return Ok(Some((0, vec![e; keys.len()]))),
        };
        let need = (0..keys.len()).filter(|&j| fresh[j]).fold(0u64, |acc, j| {
            let rec = span_bytes(&all[j]).and_then(|n| n.checked_add(HEADER + keys[j].len()));
            acc.saturating_add(rec.map_or(u64::MAX, |r| reserved(r as u64) + listed(keys[j].len())))
        });
        if !reserve.call1((need,))?.is_truthy()? {
            return Ok(None);
        }
        let spans: Vec<Option<Vec<Span>>> = all.into_iter().map(|s| inside(&regions, &s).then_some(s)).collect();
        Ok(Some((need, py.detach(|| self.put_all(&keys, &spans, &fresh, (fsync, start_writeback))))))
    }

    /// Per key, whether a pack holds it.
    fn exists(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<Vec<bool>> {
        let keys = key_bytes(keys);
        py.detach(|| self.refresh(false).map(|idx| keys.iter().map(|k| idx.live(k).is_some()).collect())).map_err(os_err)
    }

    /// The object's length, where a pack holds it.
    fn size(&self, py: Python<'_>, key: String) -> PyResult<Option<usize>> {
        py.detach(|| self.refresh(false).map(|idx| idx.live(key.as_bytes()).map(|e| e.obj_len as usize))).map_err(os_err)
    }

    /// Removes `keys` (a removal record each); per key whether a pack held it, and the bytes
    /// the removal records added.
    fn remove(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<(Vec<bool>, u64)> {
        let keys = key_bytes(keys);
        py.detach(|| self.remove_keys(&keys, None)).map_err(os_err)
    }

    /// Seals this process's pack (its writer is done: a process that meets it later reads its
    /// list of records alone); the next put starts a new one. The bytes on disk seals added since
    /// the last put reported them (for the capacity's count).
    fn seal(&self, py: Python<'_>) -> u64 {
        py.detach(|| {
            let mut w = lock(&self.writer);
            let ours = w.pid == std::process::id(); // a fork()ed child's inherited pack is its parent's
            if let Some((_, pack, end)) = w.pack.take() {
                let fd = pack.fd();
                if let (true, Ok(fd)) = (ours, fd) {
                    if fstat(&fd).is_ok_and(|s| s.st_nlink > 0) {
                        w.sealed += Self::seal_pack(&fd, end, &w.items);
                    }
                }
                pack.unpin();
            }
            w.items.clear();
            std::mem::take(&mut w.sealed)
        })
    }

    /// Tells every process that packs went (removed by the capacity's eviction).
    fn changed(&self) {
        self.counter.get().fetch_add(1, Ordering::AcqRel);
    }

    /// Objects the packs hold live.
    fn count(&self, py: Python<'_>) -> PyResult<usize> {
        py.detach(|| self.refresh(true).map(|idx| idx.map.values().filter(|e| e.live).count())).map_err(os_err)
    }

    /// Checks every object the packs hold; removes the damaged. `(checked, damaged)`.
    fn scrub(&self, py: Python<'_>) -> PyResult<(usize, usize)> {
        py.detach(|| self.scrub_all()).map_err(os_err)
    }

    /// Removes every pack (of every writer); the objects they held live.
    fn clear(&self, py: Python<'_>) -> PyResult<usize> {
        py.detach(|| {
            let n = self.refresh(true).map(|idx| idx.map.values().filter(|e| e.live).count())?;
            lock(&self.writer).pack = None;
            for ent in std::fs::read_dir(&self.folder).map_err(|e| -(e.raw_os_error().unwrap_or(libc::EIO) as i64))?.flatten() {
                if ent.file_name().to_str().is_some_and(|n| n.ends_with(".pack")) {
                    let _ = std::fs::remove_file(ent.path());
                }
            }
            self.changed();
            Ok(n)
        })
        .map_err(os_err)
    }
}
