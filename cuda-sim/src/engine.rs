//! The simulator's state: memory behind fake device addresses, streams run by worker threads,
//! events, and the stream-ordering race checker.
//!
//! Ordering model. Every stream keeps a vector clock (one entry per stream). Enqueueing an op
//! bumps the stream's own entry and merges what the op is ordered after: the host's clock
//! (everything the host has observed by a synchronizing call happens before what it enqueues
//! next), the legacy default stream's rules, and the events `cuStreamWaitEvent` names. An op
//! `A` happens before `B` iff `B.clock[A.stream] >= A.seq`. When an op executes, each byte range
//! it reads or writes is compared with the recorded accesses of ops that already ran: two
//! accesses of one range, one a write, neither ordered before the other, are a race, whatever
//! bytes the schedule happened to produce.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::ffi::c_void;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use crate::codes::*;

/// Device allocations live at addresses no host pointer can have: above the 47-bit user address
/// space (non-canonical on x86-64), so a device pointer dereferenced by host code faults at once.
pub const DEV_BASE: u64 = 0x0000_dd00_0000_0000;
pub const DEV_END: u64 = 0x0000_ef00_0000_0000;
/// Device allocations are 2 MiB aligned with a 2 MiB gap between them: an access past the end of
/// one never lands in the next.
const DEV_GRAIN: u64 = 2 << 20;
/// Fresh device and pinned memory is filled with this (uninitialized, as on a GPU)...
pub const UNINIT: u8 = 0xCD;
/// ...and freed memory with this before it is released.
pub const POISON: u8 = 0xDB;

/// Settings from the environment, read once.
pub struct Config {
    pub devices: usize,
    pub max_delay_us: u64,
    pub seed: u64,
    pub mem_bytes: u64,
    pub driver_version: i32,
    pub verbose: bool,
    pub strict: bool,
}

impl Config {
    fn from_env() -> Config {
        let num = |k: &str, d: u64| std::env::var(k).ok().and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(d);
        Config {
            devices: num("HICACHE_CUDA_SIM_DEVICES", 1).clamp(0, 2) as usize,
            max_delay_us: num("HICACHE_CUDA_SIM_DELAY_US", 0).min(1_000_000),
            seed: num("HICACHE_CUDA_SIM_SEED", 1),
            mem_bytes: num("HICACHE_CUDA_SIM_MEM_MB", 8192).saturating_mul(1 << 20),
            driver_version: num("HICACHE_CUDA_SIM_DRIVER_VERSION", 12080) as i32,
            verbose: std::env::var("HICACHE_CUDA_SIM_LOG").is_ok_and(|v| !v.is_empty() && v != "0"),
            strict: std::env::var("HICACHE_CUDA_SIM_STRICT").map_or(true, |v| v != "0"),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Mem {
    /// `cuMemAlloc` on this device.
    Device(usize),
    /// `cuMemHostAlloc` / `cuMemAllocHost`: page-locked, mapped; the device pointer is the host
    /// pointer (unified addressing).
    Pinned,
    /// `cuMemHostRegister`ed caller memory.
    Registered { read_only: bool },
}

pub struct Alloc {
    pub len: u64,
    /// Where the bytes are for the host.
    pub host: *mut u8,
    pub mem: Mem,
    /// Backing memory we allocated (device and pinned), released on free.
    pub owned: bool,
    pub what: String,
    /// How device memory came to be: `cuMemAlloc`, a stream-ordered pool, or a mapping of the
    /// virtual-memory API (whose pointer attributes the driver answers differently).
    pub origin: Origin,
}

/// Where a device allocation comes from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Origin {
    /// `cuMemAlloc`, `cuMemHostAlloc`, `cuMemHostRegister`.
    Plain,
    /// `cuMemAllocAsync` / `cuMemAllocFromPoolAsync` from `pool`: no context of its own.
    Pool { pool: u64 },
    /// `cuMemMap` of physical allocation `handle` into a reservation: no context of its own, and
    /// unreachable until `cuMemSetAccess` grants `access`.
    Mapped { handle: u64, access: bool },
}

/// A physical allocation of the virtual-memory API (`cuMemCreate`).
pub struct Physical {
    pub host: *mut u8,
    pub len: u64,
    pub dev: usize,
    /// Live mappings of it.
    pub maps: u32,
    /// `cuMemRelease` was called: freed with its last mapping.
    pub released: bool,
}

// SAFETY: owned backing memory, touched only under the state lock.
unsafe impl Send for Physical {}

// SAFETY: `host` is owned backing memory (or the caller's registered memory), touched only under
// the state lock.
unsafe impl Send for Alloc {}

pub struct Freed {
    pub len: u64,
    pub what: String,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum StreamKind {
    /// The legacy NULL stream: waits for every blocking stream of its device, and they for it.
    Legacy,
    /// A stream created without `CU_STREAM_NON_BLOCKING`, or the per-thread default stream.
    Blocking,
    NonBlocking,
}

pub type HostFn = unsafe extern "C" fn(*mut c_void);

pub enum OpKind {
    /// Event records and stream waits: ordering only.
    Nop,
    Record {
        event: u64,
        generation: u64,
    },
    Copy {
        dst: u64,
        src: u64,
        len: u64,
        staged: Option<Vec<u8>>,
    },
    Batch(Vec<(u64, u64, u64)>),
    Memset {
        dst: u64,
        len: u64,
        value: u32,
        width: u8,
    },
    /// `cuMemFreeAsync`: the allocation goes when the stream gets here.
    Free {
        addr: u64,
    },
    Kernel {
        kernel: crate::emu::Kernel,
        grid: u32,
        block: u32,
        args: [u64; crate::emu::MAX_ARGS],
    },
    HostFn {
        f: HostFn,
        data: usize,
    },
}

pub struct Op {
    pub seq: u64,
    pub clock: Vec<u64>,
    pub deps: Vec<(usize, u64)>,
    pub kind: OpKind,
    pub desc: Arc<str>,
    pub delay: Duration,
}

pub struct StreamSt {
    pub dev: usize,
    pub kind: StreamKind,
    pub flags: u32,
    pub handle: u64,
    pub vc: Vec<u64>,
    /// Ops enqueued / completed (sequence numbers start at 1).
    pub enq: u64,
    pub done: u64,
    pub queue: VecDeque<Op>,
    pub running: Option<Vec<u64>>,
    pub destroyed: bool,
}

pub struct EventSt {
    pub dev: usize,
    pub flags: u32,
    /// The recorded op: stream, sequence number, clock.
    pub rec: Option<(usize, u64, Vec<u64>)>,
    pub generation: u64,
    pub when: Option<Instant>,
}

struct Access {
    lo: u64,
    hi: u64,
    write: bool,
    sid: usize,
    seq: u64,
    desc: Arc<str>,
}

/// The recorded accesses of one allocation, indexed by 64 KiB grain so that a check looks only
/// at records near the range it checks.
#[derive(Default)]
struct History {
    recs: Vec<Access>,
    grains: HashMap<u64, Vec<u32>>,
}

const GRAIN_SHIFT: u32 = 16;

impl History {
    fn push(&mut self, a: Access) {
        let i = self.recs.len() as u32;
        for g in (a.lo >> GRAIN_SHIFT)..=((a.hi - 1) >> GRAIN_SHIFT) {
            self.grains.entry(g).or_default().push(i);
        }
        self.recs.push(a);
    }
    /// The first record overlapping `[lo, hi)` that `keep` accepts.
    fn find(&self, lo: u64, hi: u64, keep: impl Fn(&Access) -> bool) -> Option<&Access> {
        for g in (lo >> GRAIN_SHIFT)..=((hi - 1) >> GRAIN_SHIFT) {
            for &i in self.grains.get(&g).map_or(&[][..], |v| v.as_slice()) {
                let r = &self.recs[i as usize];
                if r.lo < hi && lo < r.hi && keep(r) {
                    return Some(r);
                }
            }
        }
        None
    }
    fn retain(&mut self, keep: impl Fn(&Access) -> bool) {
        let recs = std::mem::take(&mut self.recs);
        self.grains.clear();
        for r in recs.into_iter().filter(|r| keep(r)) {
            self.push(r);
        }
    }
}

pub struct State {
    pub cfg: Config,
    pub inited: bool,
    pub allocs: BTreeMap<u64, Alloc>,
    pub freed: BTreeMap<u64, Freed>,
    /// Address ranges reserved with `cuMemAddressReserve`: (bytes, device).
    pub reserved: BTreeMap<u64, (u64, usize)>,
    /// Physical allocations of `cuMemCreate`, by handle.
    pub physical: HashMap<u64, Physical>,
    next_dev: u64,
    pub dev_used: Vec<u64>,
    pub streams: Vec<StreamSt>,
    pub stream_ids: HashMap<u64, usize>,
    legacy: Vec<Option<usize>>,
    per_thread: HashMap<(usize, ThreadId), usize>,
    pub events: HashMap<u64, EventSt>,
    pub host_vc: Vec<u64>,
    history: BTreeMap<u64, History>,
    hist_len: usize,
    prune_at: usize,
    /// Races found since the last synchronizing call of each device.
    pub unreported: Vec<Vec<String>>,
    /// A fault makes the context unusable, as on a GPU.
    pub sticky: Vec<u32>,
    pub races: u64,
    pub faults: u64,
    pub next_handle: u64,
    pub alloc_count: u64,
    seen: HashSet<String>,
    pub modules: HashSet<u64>,
    pub primary_refs: Vec<u32>,
    pub started: Instant,
}

pub struct Engine {
    pub st: Mutex<State>,
    pub cv: Condvar,
}

pub fn engine() -> &'static Engine {
    static E: OnceLock<Engine> = OnceLock::new();
    E.get_or_init(|| {
        let cfg = Config::from_env();
        let n = cfg.devices;
        Engine {
            st: Mutex::new(State {
                cfg,
                inited: false,
                allocs: BTreeMap::new(),
                freed: BTreeMap::new(),
                reserved: BTreeMap::new(),
                physical: HashMap::new(),
                next_dev: DEV_BASE,
                dev_used: vec![0; n],
                streams: Vec::new(),
                stream_ids: HashMap::new(),
                legacy: vec![None; n],
                per_thread: HashMap::new(),
                events: HashMap::new(),
                host_vc: Vec::new(),
                history: BTreeMap::new(),
                hist_len: 0,
                prune_at: 4096,
                unreported: vec![Vec::new(); n],
                sticky: vec![0; n],
                races: 0,
                faults: 0,
                next_handle: 0x5157_0000,
                alloc_count: 0,
                seen: HashSet::new(),
                modules: HashSet::new(),
                primary_refs: vec![0; n],
                started: Instant::now(),
            }),
            cv: Condvar::new(),
        }
    })
}

pub fn lock() -> MutexGuard<'static, State> {
    engine().st.lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    /// Set when the current driver call waited for device work (the trace's `blocked=1`).
    pub static BLOCKED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn merge(into: &mut Vec<u64>, from: &[u64]) {
    if into.len() < from.len() {
        into.resize(from.len(), 0);
    }
    for (a, b) in into.iter_mut().zip(from) {
        *a = (*a).max(*b);
    }
}

fn ordered_before(sid: usize, seq: u64, clock: &[u64]) -> bool {
    clock.get(sid).is_some_and(|c| *c >= seq)
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Where an address span is.
/// A piece of a span inside one allocation: (its key, address, bytes, host view, origin).
pub type Piece = (u64, u64, u64, *mut u8, Origin);

pub enum Loc {
    /// Inside a live allocation (key = its start address).
    Tracked {
        key: u64,
        host: *mut u8,
        mem: Mem,
    },
    /// Host memory the driver does not know (pageable).
    Pageable,
    Bad(String),
}

impl State {
    pub fn new_handle(&mut self) -> u64 {
        self.next_handle += 0x10;
        self.next_handle
    }

    pub fn stream_name(&self, sid: usize) -> String {
        let s = &self.streams[sid];
        match s.kind {
            StreamKind::Legacy => format!("legacy NULL stream (device {})", s.dev),
            StreamKind::Blocking => format!("stream {:#x} (blocking)", s.handle),
            StreamKind::NonBlocking => format!("stream {:#x}", s.handle),
        }
    }

    /// Describes an address no live allocation holds.
    pub fn describe_bad(&self, addr: u64) -> String {
        if let Some((start, f)) = self.freed.range(..=addr).next_back() {
            if addr - start < f.len.max(1) {
                return format!("{addr:#x} is inside {} at {start:#x}, already freed (use after free)", f.what);
            }
        }
        if let Some((start, a)) = self.allocs.range(..=addr).next_back() {
            if addr - start < a.len.saturating_add(DEV_GRAIN) {
                return format!("{addr:#x} is past the end of {} at {start:#x} ({} bytes)", a.what, a.len);
            }
        }
        if let Some((start, (len, _))) = self.reserved.range(..=addr).next_back() {
            if addr - start < *len {
                return format!(
                    "{addr:#x} is inside the address range reserved at {start:#x} ({len} bytes) where nothing is mapped (cuMemMap)"
                );
            }
        }
        if (DEV_BASE..DEV_END).contains(&addr) {
            format!("{addr:#x} is not device memory of any allocation")
        } else {
            format!("{addr:#x} is host memory the driver does not know (not pinned or registered)")
        }
    }

    /// `len` bytes at `addr` as pieces of allocations `(key, addr, len, host view, origin)`: one
    /// piece, or several across mappings of the virtual-memory API that lie side by side (a
    /// reservation mapped chunk by chunk is one span to the GPU, not to our host views).
    pub fn span(&self, addr: u64, len: u64) -> Result<Option<Vec<Piece>>, String> {
        let mut out = Vec::new();
        let (mut at, mut left) = (addr, len);
        loop {
            match self.locate(at, 1) {
                Loc::Tracked { key, host, .. } => {
                    let a = &self.allocs[&key];
                    let n = left.min(a.len - (at - key));
                    out.push((key, at, n, host, a.origin));
                    left -= n;
                    at += n;
                    if left == 0 {
                        return Ok(Some(out));
                    }
                    let next_mapped = matches!(self.allocs.get(&at), Some(b) if matches!(b.origin, Origin::Mapped { .. }));
                    if !matches!(a.origin, Origin::Mapped { .. }) || !next_mapped {
                        return Err(format!("{len} bytes at {addr:#x} run past the end of {} at {key:#x} ({} bytes)", a.what, a.len));
                    }
                }
                Loc::Pageable if out.is_empty() => return Ok(None),
                Loc::Pageable => return Err(format!("{len} bytes at {addr:#x} run past mapped memory into {at:#x}")),
                Loc::Bad(why) => return Err(why),
            }
        }
    }

    pub fn locate(&self, addr: u64, len: u64) -> Loc {
        if let Some((&start, a)) = self.allocs.range(..=addr).next_back() {
            let off = addr - start;
            if off < a.len.max(1) {
                if len > a.len - off {
                    return Loc::Bad(format!("{len} bytes at {addr:#x} run past the end of {} at {start:#x} ({} bytes)", a.what, a.len));
                }
                // SAFETY: `off < a.len`: inside the backing allocation.
                return Loc::Tracked { key: start, host: unsafe { a.host.add(off as usize) }, mem: a.mem };
            }
        }
        if (DEV_BASE..DEV_END).contains(&addr) || addr == 0 {
            return Loc::Bad(self.describe_bad(addr));
        }
        Loc::Pageable
    }

    /// Allocates device memory (`cuMemAlloc`) or pinned host memory.
    pub fn alloc(&mut self, len: u64, mem: Mem) -> Result<u64, u32> {
        if len == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if let Mem::Device(d) = mem {
            if self.dev_used[d].saturating_add(len) > self.cfg.mem_bytes {
                return Err(CUDA_ERROR_OUT_OF_MEMORY);
            }
        }
        let size = usize::try_from(len).map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        let layout = std::alloc::Layout::from_size_align(size, 4096).map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        // SAFETY: non-zero size; checked for null below.
        let host = unsafe { std::alloc::alloc(layout) };
        if host.is_null() {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        // SAFETY: fresh allocation of `size` bytes.
        unsafe { std::ptr::write_bytes(host, UNINIT, size) };
        self.alloc_count += 1;
        let (addr, what) = match mem {
            Mem::Device(d) => {
                let addr = self.next_dev;
                let span = len.div_ceil(DEV_GRAIN).saturating_add(1).saturating_mul(DEV_GRAIN);
                self.next_dev = self.next_dev.saturating_add(span);
                if self.next_dev >= DEV_END {
                    // SAFETY: allocated above with this layout.
                    unsafe { std::alloc::dealloc(host, layout) };
                    return Err(CUDA_ERROR_OUT_OF_MEMORY);
                }
                self.dev_used[d] += len;
                (addr, format!("cuMemAlloc #{} ({len} bytes, device {d})", self.alloc_count))
            }
            _ => (host as u64, format!("cuMemHostAlloc #{} ({len} bytes)", self.alloc_count)),
        };
        self.freed.remove(&addr);
        self.allocs.insert(addr, Alloc { len, host, mem, owned: true, what, origin: Origin::Plain });
        Ok(addr)
    }

    /// Frees an allocation: a host-side write of all of it, checked against the ops that used it.
    pub fn free(&mut self, addr: u64, call: &str) -> Result<(), u32> {
        let Some(a) = self.allocs.get(&addr) else {
            return Err(CUDA_ERROR_INVALID_VALUE);
        };
        let mem = a.mem;
        let host_vc = self.host_vc.clone();
        let dev = match mem {
            Mem::Device(d) => d,
            _ => 0,
        };
        if let Some(h) = self.history.get(&addr) {
            let mut msgs = Vec::new();
            for r in &h.recs {
                if !ordered_before(r.sid, r.seq, &host_vc) {
                    msgs.push(format!(
                        "{call} of {} at {addr:#x} while {} on {} may still {} it (no synchronization between them)",
                        a.what,
                        r.desc,
                        self.stream_name(r.sid),
                        if r.write { "write" } else { "read" }
                    ));
                }
            }
            for m in msgs {
                self.race(dev, m);
            }
        }
        if let Some(h) = self.history.remove(&addr) {
            self.hist_len -= h.recs.len();
        }
        let a = self.allocs.remove(&addr).expect("present");
        if a.owned {
            // SAFETY: allocated in `alloc` with this size and alignment; nothing else holds it
            // (workers touch memory only under the state lock, which we hold).
            unsafe {
                std::ptr::write_bytes(a.host, POISON, a.len as usize);
                std::alloc::dealloc(a.host, std::alloc::Layout::from_size_align_unchecked(a.len as usize, 4096));
            }
        }
        if let (Mem::Device(d), false) = (a.mem, matches!(a.origin, Origin::Mapped { .. })) {
            self.dev_used[d] -= a.len;
        }
        if let Origin::Mapped { handle, .. } = a.origin {
            self.unmapped(handle);
        }
        self.freed.insert(addr, Freed { len: a.len, what: a.what });
        Ok(())
    }

    // ---- the virtual-memory API and stream-ordered pools --------------------------------

    /// `cuMemAddressReserve`: `len` bytes of device addresses, nothing behind them yet.
    pub fn reserve(&mut self, len: u64, dev: usize) -> Result<u64, u32> {
        if len == 0 || !len.is_multiple_of(DEV_GRAIN) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let addr = self.next_dev;
        self.next_dev = self.next_dev.saturating_add(len.saturating_add(DEV_GRAIN));
        if self.next_dev >= DEV_END {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        self.reserved.insert(addr, (len, dev));
        Ok(addr)
    }

    /// `cuMemAddressFree`: the whole reservation, with nothing mapped in it.
    pub fn address_free(&mut self, addr: u64, len: u64) -> Result<(), u32> {
        match self.reserved.get(&addr) {
            Some(&(l, _)) if l == len => {}
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        if self.allocs.range(addr..addr + len).next().is_some() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        self.reserved.remove(&addr);
        Ok(())
    }

    /// `cuMemCreate`: physical memory on `dev`, reachable only once mapped.
    pub fn create(&mut self, len: u64, dev: usize) -> Result<u64, u32> {
        if len == 0 || !len.is_multiple_of(DEV_GRAIN) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if self.dev_used[dev].saturating_add(len) > self.cfg.mem_bytes {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let size = usize::try_from(len).map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        let layout = std::alloc::Layout::from_size_align(size, 4096).map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        // SAFETY: non-zero size; checked for null below.
        let host = unsafe { std::alloc::alloc(layout) };
        if host.is_null() {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        // SAFETY: fresh allocation of `size` bytes.
        unsafe { std::ptr::write_bytes(host, UNINIT, size) };
        self.dev_used[dev] += len;
        let handle = self.new_handle();
        self.physical.insert(handle, Physical { host, len, dev, maps: 0, released: false });
        Ok(handle)
    }

    /// `cuMemMap`: `len` bytes of physical `handle` from `offset`, at `addr` inside a
    /// reservation, not yet accessible.
    pub fn map(&mut self, addr: u64, len: u64, offset: u64, handle: u64) -> Result<(), u32> {
        let inside = self.reserved.range(..=addr).next_back().is_some_and(|(s, (l, _))| addr.saturating_add(len) <= s + l);
        let p = self.physical.get(&handle).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if !inside || len == 0 || offset.checked_add(len).is_none_or(|e| e > p.len) || self.allocs.range(addr..addr + len).next().is_some()
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if self.allocs.range(..addr).next_back().is_some_and(|(s, a)| s + a.len > addr) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (host, dev) = (p.host, p.dev);
        self.physical.get_mut(&handle).expect("present").maps += 1;
        self.alloc_count += 1;
        let what = format!("cuMemMap #{} ({len} bytes of handle {handle:#x} at offset {offset}, device {dev})", self.alloc_count);
        self.freed.remove(&addr);
        // SAFETY: `offset + len` is inside the physical allocation.
        let host = unsafe { host.add(offset as usize) };
        self.allocs
            .insert(addr, Alloc { len, host, mem: Mem::Device(dev), owned: false, what, origin: Origin::Mapped { handle, access: false } });
        Ok(())
    }

    /// `cuMemSetAccess`: every mapping inside the span becomes reachable from the device.
    pub fn set_access(&mut self, addr: u64, len: u64) -> Result<(), u32> {
        let keys: Vec<u64> = self.allocs.range(addr..addr.saturating_add(len)).map(|(k, _)| *k).collect();
        let mut any = false;
        for k in keys {
            let a = self.allocs.get_mut(&k).expect("present");
            if let Origin::Mapped { handle, .. } = a.origin {
                a.origin = Origin::Mapped { handle, access: true };
                any = true;
            }
        }
        if any {
            Ok(())
        } else {
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    }

    /// `cuMemUnmap`: every mapping inside the span goes (its physical memory keeps its bytes);
    /// queued work still using it is a race, later work a fault.
    pub fn unmap(&mut self, addr: u64, len: u64) -> Result<(), u32> {
        let keys: Vec<u64> = self
            .allocs
            .range(addr..addr.saturating_add(len))
            .filter(|(_, a)| matches!(a.origin, Origin::Mapped { .. }))
            .map(|(k, _)| *k)
            .collect();
        if keys.is_empty() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for k in keys {
            self.free(k, "cuMemUnmap")?;
            if let Some(f) = self.freed.get_mut(&k) {
                f.what.push_str(", unmapped");
            }
        }
        Ok(())
    }

    /// One mapping of `handle` went.
    fn unmapped(&mut self, handle: u64) {
        if let Some(p) = self.physical.get_mut(&handle) {
            p.maps = p.maps.saturating_sub(1);
            if p.released && p.maps == 0 {
                self.drop_physical(handle);
            }
        }
    }

    /// `cuMemRelease`: the physical memory goes with its last mapping.
    pub fn release(&mut self, handle: u64) -> Result<(), u32> {
        let p = self.physical.get_mut(&handle).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        p.released = true;
        if p.maps == 0 {
            self.drop_physical(handle);
        }
        Ok(())
    }

    fn drop_physical(&mut self, handle: u64) {
        if let Some(p) = self.physical.remove(&handle) {
            // SAFETY: allocated in `create` with this layout; no mapping refers to it any more.
            unsafe {
                std::ptr::write_bytes(p.host, POISON, p.len as usize);
                std::alloc::dealloc(p.host, std::alloc::Layout::from_size_align_unchecked(p.len as usize, 4096));
            }
            self.dev_used[p.dev] -= p.len;
        }
    }

    /// `cuMemAllocAsync` / `cuMemAllocFromPoolAsync`: device memory from `pool`, usable in the
    /// order of stream `sid` (an op on it writes the fresh bytes: other streams not ordered after
    /// it race with it).
    pub fn alloc_async(&mut self, len: u64, dev: usize, pool: u64, sid: usize) -> Result<u64, u32> {
        let addr = self.alloc(len, Mem::Device(dev))?;
        let a = self.allocs.get_mut(&addr).expect("present");
        a.origin = Origin::Pool { pool };
        a.what = a.what.replacen("cuMemAlloc", "cuMemAllocAsync", 1);
        self.enqueue(
            sid,
            OpKind::Memset { dst: addr, len, value: UNINIT as u32, width: 1 },
            format!("cuMemAllocAsync({len} bytes)"),
            vec![],
            None,
        );
        Ok(addr)
    }

    pub fn register_host(&mut self, ptr: u64, len: u64, read_only: bool) -> Result<(), u32> {
        if ptr == 0 || len == 0 || (DEV_BASE..DEV_END).contains(&ptr) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let end = ptr.checked_add(len).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if let Some((s, a)) = self.allocs.range(..end).next_back() {
            if s + a.len > ptr {
                return Err(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
            }
        }
        self.alloc_count += 1;
        let what = format!("cuMemHostRegister #{} ({len} bytes{})", self.alloc_count, if read_only { ", read-only" } else { "" });
        self.allocs.insert(
            ptr,
            Alloc { len, host: ptr as *mut u8, mem: Mem::Registered { read_only }, owned: false, what, origin: Origin::Plain },
        );
        Ok(())
    }

    pub fn race(&mut self, dev: usize, msg: String) {
        self.races += 1;
        // Counted and reported every time; logged once per distinct text (loops repeat them).
        if self.seen.insert(msg.clone()) {
            eprintln!("cuda-sim: RACE: {msg}");
        }
        if let Some(u) = self.unreported.get_mut(dev) {
            u.push(msg);
        }
    }

    pub fn fault(&mut self, dev: usize, code: u32, msg: String) {
        self.faults += 1;
        eprintln!("cuda-sim: FAULT ({}): {msg}", crate::codes::name(code));
        crate::set_last_message(code, &msg);
        if self.sticky[dev] == 0 {
            self.sticky[dev] = code;
        }
    }

    /// The error a synchronizing call of device `dev` returns: a sticky fault, else the races
    /// found since the last such call (reported once).
    pub fn sync_error(&mut self, dev: usize) -> u32 {
        if self.sticky[dev] != 0 {
            return self.sticky[dev];
        }
        let found = std::mem::take(&mut self.unreported[dev]);
        if found.is_empty() {
            return CUDA_SUCCESS;
        }
        let msg = format!("stream-ordering race: {}", found.join("; "));
        crate::set_last_message(CUDA_ERROR_ILLEGAL_STATE, &msg);
        CUDA_ERROR_ILLEGAL_STATE
    }

    pub fn legacy(&mut self, dev: usize) -> usize {
        if let Some(s) = self.legacy[dev] {
            return s;
        }
        let sid = self.spawn_stream(dev, StreamKind::Legacy, 0, 0);
        self.legacy[dev] = Some(sid);
        sid
    }

    /// Resolves a stream handle of device `dev` (the current context's).
    pub fn resolve(&mut self, handle: u64, dev: usize) -> Result<usize, u32> {
        match handle {
            0 | 1 => Ok(self.legacy(dev)),
            2 => {
                let key = (dev, std::thread::current().id());
                if let Some(s) = self.per_thread.get(&key) {
                    return Ok(*s);
                }
                let sid = self.spawn_stream(dev, StreamKind::Blocking, 0, 2);
                self.per_thread.insert(key, sid);
                Ok(sid)
            }
            h => self.stream_ids.get(&h).copied().ok_or(CUDA_ERROR_INVALID_HANDLE),
        }
    }

    pub fn spawn_stream(&mut self, dev: usize, kind: StreamKind, flags: u32, handle: u64) -> usize {
        let sid = self.streams.len();
        let handle = if handle == 0 && kind != StreamKind::Legacy { self.new_handle() } else { handle };
        self.streams.push(StreamSt {
            dev,
            kind,
            flags,
            handle,
            vc: self.host_vc.clone(),
            enq: 0,
            done: 0,
            queue: VecDeque::new(),
            running: None,
            destroyed: false,
        });
        if kind != StreamKind::Legacy && handle > 2 {
            self.stream_ids.insert(handle, sid);
        }
        std::thread::Builder::new().name(format!("cuda-sim-stream-{sid}")).spawn(move || worker(sid)).expect("spawning a stream worker");
        sid
    }

    /// Enqueues `kind` on stream `sid`, ordered after `deps` and `clock` (an event's) as well as
    /// stream order, the host's observations and the legacy stream's rules.
    pub fn enqueue(&mut self, sid: usize, kind: OpKind, desc: String, mut deps: Vec<(usize, u64)>, clock: Option<&[u64]>) -> u64 {
        let mut vc = std::mem::take(&mut self.streams[sid].vc);
        merge(&mut vc, &self.host_vc.clone());
        if let Some(c) = clock {
            merge(&mut vc, c);
        }
        let (dev, skind) = (self.streams[sid].dev, self.streams[sid].kind);
        match skind {
            StreamKind::Legacy => {
                for (b, s) in self.streams.iter().enumerate() {
                    if b != sid && s.dev == dev && s.kind == StreamKind::Blocking && s.enq > 0 {
                        deps.push((b, s.enq));
                        merge(&mut vc, &s.vc);
                    }
                }
            }
            StreamKind::Blocking => {
                if let Some(l) = self.legacy[dev] {
                    let s = &self.streams[l];
                    if s.enq > 0 {
                        deps.push((l, s.enq));
                        merge(&mut vc, &s.vc.clone());
                    }
                }
            }
            StreamKind::NonBlocking => {}
        }
        let s = &mut self.streams[sid];
        s.enq += 1;
        let seq = s.enq;
        if vc.len() <= sid {
            vc.resize(sid + 1, 0);
        }
        vc[sid] = seq;
        let max = self.cfg.max_delay_us;
        let delay = if max == 0 {
            Duration::ZERO
        } else {
            Duration::from_micros(splitmix(self.cfg.seed ^ splitmix(((sid as u64) << 40) ^ seq)) % (max + 1))
        };
        s.queue.push_back(Op { seq, clock: vc.clone(), deps, kind, desc: desc.into(), delay });
        s.vc = vc;
        engine().cv.notify_all();
        seq
    }

    /// The host has observed the work behind `clock` (a synchronization or a successful query).
    pub fn observe(&mut self, clock: &[u64]) {
        merge(&mut self.host_vc, clock);
    }

    /// Checks `accesses` (address, length, write) of an op against the ops that ran before it,
    /// then records them. Returns a fault message for an access outside live memory.
    fn check_and_record(&mut self, sid: usize, op: &Op, accesses: &[(u64, u64, bool)]) -> Result<(), String> {
        let dev = self.streams[sid].dev;
        // Coalesce per allocation and kind.
        let mut spans: Vec<(u64, u64, u64, bool)> = Vec::with_capacity(accesses.len());
        for &(addr, len, write) in accesses {
            if len == 0 {
                continue;
            }
            match self.span(addr, len) {
                Ok(Some(pieces)) => {
                    for (key, at, n, _, origin) in pieces {
                        if write && self.allocs[&key].mem == (Mem::Registered { read_only: true }) {
                            return Err(format!("{} writes read-only registered memory at {addr:#x}", op.desc));
                        }
                        if matches!(origin, Origin::Mapped { access: false, .. }) {
                            return Err(format!(
                                "{} on {}: {at:#x} is mapped but not accessible (no cuMemSetAccess for this device)",
                                op.desc,
                                self.stream_name(sid)
                            ));
                        }
                        spans.push((key, at, at + n, write));
                    }
                }
                Ok(None) => {}
                Err(why) => return Err(format!("{} on {}: {why}", op.desc, self.stream_name(sid))),
            }
        }
        spans.sort_unstable_by_key(|s| (s.0, s.3, s.1));
        let mut merged: Vec<(u64, u64, u64, bool)> = Vec::with_capacity(spans.len());
        for s in spans {
            match merged.last_mut() {
                Some(m) if m.0 == s.0 && m.3 == s.3 && s.1 <= m.2 => m.2 = m.2.max(s.2),
                _ => merged.push(s),
            }
        }
        let mut found = Vec::new();
        for &(key, lo, hi, write) in &merged {
            // A few per op say enough (a kernel racing another races on every item).
            if found.len() == 3 {
                break;
            }
            if let Some(h) = self.history.get(&key) {
                if let Some(r) = h.find(lo, hi, |r| (r.write || write) && r.sid != sid && !ordered_before(r.sid, r.seq, &op.clock)) {
                    let what = self.allocs.get(&key).map_or(String::new(), |a| a.what.clone());
                    found.push(format!(
                        "{} on {} {} [{:#x}, {:#x}) of {what}, which {} on {} {} [{:#x}, {:#x}) with no event or synchronization ordering them",
                        op.desc,
                        self.stream_name(sid),
                        if write { "writes" } else { "reads" },
                        lo.max(r.lo),
                        hi.min(r.hi),
                        r.desc,
                        self.stream_name(r.sid),
                        if r.write { "wrote" } else { "read" },
                        lo.max(r.lo),
                        hi.min(r.hi),
                    ));
                }
            }
        }
        for m in found {
            self.race(dev, m);
        }
        for (key, lo, hi, write) in merged {
            self.history.entry(key).or_default().push(Access { lo, hi, write, sid, seq: op.seq, desc: op.desc.clone() });
            self.hist_len += 1;
        }
        Ok(())
    }

    /// Drops recorded accesses that every op still to run (and the host) is ordered after.
    fn prune(&mut self) {
        if self.hist_len < self.prune_at {
            return;
        }
        let mut frontier: Vec<Vec<u64>> = vec![self.host_vc.clone()];
        for s in &self.streams {
            if let Some(front) = s.running.as_ref().or(s.queue.front().map(|o| &o.clock)) {
                frontier.push(front.clone());
            } else if !s.destroyed {
                frontier.push(s.vc.clone());
            }
        }
        let mut kept = 0;
        for h in self.history.values_mut() {
            h.retain(|r| !frontier.iter().all(|c| ordered_before(r.sid, r.seq, c)));
            kept += h.recs.len();
        }
        self.history.retain(|_, h| !h.recs.is_empty());
        self.hist_len = kept;
        self.prune_at = (kept * 2).max(4096);
    }

    /// Runs one op's memory work (the state lock is held: ops are atomic with respect to each
    /// other and to frees).
    fn execute(&mut self, sid: usize, op: &Op) {
        let dev = self.streams[sid].dev;
        if self.sticky[dev] != 0 {
            return;
        }
        let result = match &op.kind {
            OpKind::Nop | OpKind::HostFn { .. } => Ok(()),
            OpKind::Record { event, generation } => {
                if let Some(e) = self.events.get_mut(event) {
                    if e.generation == *generation {
                        e.when = Some(Instant::now());
                    }
                }
                Ok(())
            }
            OpKind::Copy { dst, src, len, staged } => {
                let src_access = if staged.is_some() { vec![] } else { vec![(*src, *len, false)] };
                let mut acc = src_access;
                acc.push((*dst, *len, true));
                self.check_and_record(sid, op, &acc).and_then(|_| self.copy(*dst, *src, *len, staged.as_deref()))
            }
            OpKind::Batch(list) => {
                let acc: Vec<_> = list.iter().flat_map(|&(d, s, n)| [(s, n, false), (d, n, true)]).collect();
                self.check_and_record(sid, op, &acc).and_then(|_| list.iter().try_for_each(|&(d, s, n)| self.copy(d, s, n, None)))
            }
            OpKind::Memset { dst, len, value, width } => {
                let bytes = len * *width as u64;
                self.check_and_record(sid, op, &[(*dst, bytes, true)]).and_then(|_| {
                    // The pattern's bytes, written piece by piece (pieces of mappings are whole
                    // granules, so a pattern element never straddles two).
                    let pattern = value.to_ne_bytes();
                    let w = *width as u64;
                    let mut at = 0u64;
                    for (host, n) in self.views(*dst, bytes)? {
                        if w == 1 {
                            // SAFETY: as below.
                            unsafe { std::ptr::write_bytes(host, pattern[0], n as usize) };
                            continue;
                        }
                        for i in 0..n {
                            // SAFETY: inside a live piece (or the caller's pageable memory, as
                            // the real driver would touch it).
                            unsafe { *host.add(i as usize) = pattern[((at + i) % w) as usize] };
                        }
                        at += n;
                    }
                    Ok(())
                })
            }
            OpKind::Kernel { kernel, grid, block, args } => return self.kernel(sid, op, *kernel, *grid, *block, args),
            OpKind::Free { addr } => {
                let len = self.allocs.get(addr).map_or(0, |a| a.len);
                if len == 0 {
                    Err(format!("{}: {addr:#x} is no live stream-ordered allocation ({})", op.desc, self.describe_bad(*addr)))
                } else {
                    // As a host free, but ordered by the stream: work not ordered before this
                    // op races with it.
                    let host_vc = std::mem::replace(&mut self.host_vc, op.clock.clone());
                    let r = self.free(*addr, "cuMemFreeAsync").map_err(|rc| format!("{}: {}", op.desc, crate::codes::name(rc)));
                    self.host_vc = host_vc;
                    r
                }
            }
        };
        if let Err(msg) = result {
            self.fault(dev, CUDA_ERROR_ILLEGAL_ADDRESS, msg);
        }
    }

    /// The host views of a span, piece by piece (`(host pointer, bytes)`).
    fn views(&self, addr: u64, len: u64) -> Result<Vec<(*mut u8, u64)>, String> {
        Ok(match self.span(addr, len)? {
            Some(pieces) => pieces.into_iter().map(|(_, _, n, host, _)| (host, n)).collect(),
            None => vec![(addr as *mut u8, len)],
        })
    }

    fn copy(&self, dst: u64, src: u64, len: u64, staged: Option<&[u8]>) -> Result<(), String> {
        let d = self.views(dst, len)?;
        let s = match staged {
            Some(bytes) => vec![(bytes.as_ptr() as *mut u8, len)],
            None => self.views(src, len)?,
        };
        // Walk both piece lists together.
        let (mut di, mut si, mut doff, mut soff) = (0usize, 0usize, 0u64, 0u64);
        while di < d.len() && si < s.len() {
            let n = (d[di].1 - doff).min(s[si].1 - soff);
            // SAFETY: both pieces are inside live allocations or caller memory; `copy` allows
            // overlap, as the driver's copies do.
            unsafe { std::ptr::copy(s[si].0.add(soff as usize), d[di].0.add(doff as usize), n as usize) };
            doff += n;
            soff += n;
            if doff == d[di].1 {
                di += 1;
                doff = 0;
            }
            if soff == s[si].1 {
                si += 1;
                soff = 0;
            }
        }
        Ok(())
    }

    /// Host view of a span a kernel reads directly (its tables and index lists).
    fn kernel_input(&self, addr: u64, len: u64, what: &str) -> Result<*const u8, String> {
        if len == 0 {
            return Ok(std::ptr::NonNull::<u64>::dangling().as_ptr() as *const u8);
        }
        match self.locate(addr, len) {
            Loc::Tracked { host, .. } => Ok(host),
            Loc::Pageable => Err(format!("the kernel's {what} at {addr:#x} is pageable host memory, which a GPU cannot read")),
            Loc::Bad(why) => Err(format!("the kernel's {what}: {why}")),
        }
    }

    fn kernel(&mut self, sid: usize, op: &Op, kernel: crate::emu::Kernel, grid: u32, block: u32, args: &[u64; crate::emu::MAX_ARGS]) {
        let dev = self.streams[sid].dev;
        if kernel == crate::emu::Kernel::CheckIndices {
            return self.check_kernel(sid, op, grid, block, args);
        }
        let n_launches = args[1] as i32 as i64;
        let n_items = args[4] as i64;
        let (heads, chunk, status) = (args[5], args[6], args[8]);
        type Inputs = (Vec<u64>, Vec<i64>, Vec<i64>, [*const u8; 3], bool);
        let prepared = (|| -> Result<Inputs, String> {
            // A failed device check (status not all ones): the kernel returns before reading
            // anything else.
            if status != 0 {
                let p = self.kernel_input(status, 8, "status word")?;
                // SAFETY: located inside a live allocation of at least 8 bytes.
                if unsafe { (p as *const u64).read_unaligned() } != u64::MAX {
                    return Ok((vec![], vec![], vec![], [std::ptr::null(); 3], false));
                }
            }
            let nl = n_launches.max(0) as u64;
            let ni = n_items.max(0) as u64;
            let t = self.kernel_input(args[0], nl * 96, "address-pair table")?;
            let s = self.kernel_input(args[2], ni * 8, "source indices")?;
            let d = self.kernel_input(args[3], ni * 8, "destination indices")?;
            // SAFETY: each span was just located inside a live allocation of that many bytes.
            let (table, src, dst) = unsafe {
                (
                    (0..nl as usize * 12).map(|i| (t as *const u64).add(i).read_unaligned()).collect::<Vec<u64>>(),
                    (0..ni as usize).map(|i| (s as *const i64).add(i).read_unaligned()).collect::<Vec<i64>>(),
                    (0..ni as usize).map(|i| (d as *const i64).add(i).read_unaligned()).collect::<Vec<i64>>(),
                )
            };
            Ok((table, src, dst, [t, s, d], true))
        })();
        let (table, src, dst, ptrs, copies) = match prepared {
            Ok(p) => p,
            Err(why) => {
                let msg = format!("{} on {}: {why}", op.desc, self.stream_name(sid));
                return self.fault(dev, CUDA_ERROR_ILLEGAL_ADDRESS, msg);
            }
        };
        // What the launch description says the kernel touches: the status word, its inputs, then
        // every item's chunk per (layer, component) and head.
        let addr = |side: &[u64], idx: u64, h: u64| -> u64 {
            let (ptr, base, page, ps, rs, hs) = (side[0], side[1], side[2], side[3], side[4], side[5]);
            let paged = match (idx.checked_div(page), idx.checked_rem(page)) {
                _ if page == 1 => idx.wrapping_mul(ps),
                (Some(q), Some(r)) => q.wrapping_mul(ps).wrapping_add(r.wrapping_mul(rs)),
                // A zero page divides by zero on the GPU: the emulator faults on it.
                _ => u64::MAX / 2,
            };
            ptr.wrapping_add(base).wrapping_add(paged).wrapping_add(h.wrapping_mul(hs))
        };
        let mut acc = vec![];
        if status != 0 {
            acc.push((status, 8, false));
        }
        if copies {
            acc.push((args[0], n_launches.max(0) as u64 * 96, false));
            acc.push((args[2], n_items.max(0) as u64 * 8, false));
            acc.push((args[3], n_items.max(0) as u64 * 8, false));
            if kernel.sums() {
                // The sums it adds into (keys are computed from word positions: no table).
                acc.push((args[10], (n_items.max(0) as u64).saturating_mul(n_launches.max(0) as u64).saturating_mul(8), true));
            }
            for (s, d) in src.iter().zip(&dst) {
                if *s < 0 || *d < 0 {
                    continue;
                }
                for l in table.chunks_exact(12) {
                    for h in 0..heads.min(1 << 20) {
                        acc.push((addr(&l[0..6], *s as u64, h), chunk, false));
                        acc.push((addr(&l[6..12], *d as u64, h), chunk, true));
                    }
                }
            }
        }
        // A GPU cannot reach pageable host memory (only pinned or registered memory is mapped
        // for it): a kernel that touches any is an illegal address, as on the device. DMA copies
        // (`copy`) may read and write pageable memory; kernels may not.
        if let Some(&(a, n, _)) = acc.iter().find(|&&(a, n, _)| n > 0 && matches!(self.locate(a, n), Loc::Pageable)) {
            let msg = format!(
                "{} on {}: the kernel touches {n} bytes at {a:#x}, pageable host memory the GPU cannot reach",
                op.desc,
                self.stream_name(sid)
            );
            return self.fault(dev, CUDA_ERROR_ILLEGAL_ADDRESS, msg);
        }
        if let Err(why) = self.check_and_record(sid, op, &acc) {
            return self.fault(dev, CUDA_ERROR_ILLEGAL_ADDRESS, why);
        }
        let mut translated = *args;
        if copies {
            translated[0] = ptrs[0] as u64;
            translated[2] = ptrs[1] as u64;
            translated[3] = ptrs[2] as u64;
        }
        self.emulate(sid, op, kernel, grid, block, &translated);
    }

    /// `hicache_check_indices`: reads both index lists, and writes the claim words of the
    /// destination side's bound and the status words.
    fn check_kernel(&mut self, sid: usize, op: &Op, grid: u32, block: u32, args: &[u64; crate::emu::MAX_ARGS]) {
        let dev = self.streams[sid].dev;
        let n = (args[2] as i64).max(0) as u64;
        let bound = if args[5] as i32 != 0 { args[3] } else { args[4] };
        let acc = vec![
            (args[0], n.saturating_mul(8), false),
            (args[1], n.saturating_mul(8), false),
            (args[6], bound.saturating_mul(4), true),
            (args[7], 32, true),
        ];
        if let Err(why) = self.check_and_record(sid, op, &acc) {
            return self.fault(dev, CUDA_ERROR_ILLEGAL_ADDRESS, why);
        }
        self.emulate(sid, op, crate::emu::Kernel::CheckIndices, grid, block, args);
    }

    /// Runs a kernel in the host emulation over every allocation; a bad access is the GPU's
    /// sticky error.
    fn emulate(&mut self, sid: usize, op: &Op, kernel: crate::emu::Kernel, grid: u32, block: u32, args: &[u64; crate::emu::MAX_ARGS]) {
        let dev = self.streams[sid].dev;
        let ranges: Vec<crate::emu::Range> = self
            .allocs
            .iter()
            .map(|(start, a)| crate::emu::Range {
                start: *start,
                len: a.len,
                flags: match (a.mem, a.origin) {
                    (_, Origin::Mapped { access: false, .. }) => 0,
                    (Mem::Registered { read_only: true }, _) => crate::emu::READ,
                    _ => crate::emu::READ | crate::emu::WRITE,
                },
                host: a.host as u64,
            })
            .collect();
        let report = crate::emu::launch(kernel, grid, block, args, &ranges);
        match report {
            Err(()) => self.fault(dev, CUDA_ERROR_INVALID_VALUE, format!("{}: the launch was refused by the kernel's bounds", op.desc)),
            Ok(r) if r.faults > 0 => {
                let code = if r.first_fault_addr % r.first_fault_size.max(1) != 0 {
                    CUDA_ERROR_MISALIGNED_ADDRESS
                } else {
                    CUDA_ERROR_ILLEGAL_ADDRESS
                };
                let msg = format!(
                    "{} on {}: {} bad accesses; the first, a {}-byte {} at {:#x}: {}",
                    op.desc,
                    self.stream_name(sid),
                    r.faults,
                    r.first_fault_size,
                    if r.first_fault_flags == crate::emu::WRITE { "store" } else { "load" },
                    r.first_fault_addr,
                    self.describe_bad(r.first_fault_addr)
                );
                self.fault(dev, code, msg)
            }
            Ok(_) => {}
        }
    }

    /// Waits (the lock released meanwhile) until stream `sid` has completed `seq`, then records
    /// that the host has observed the work behind `clock` (that op's clock or later).
    pub fn wait(mut g: MutexGuard<'static, State>, sid: usize, seq: u64, clock: &[u64]) -> MutexGuard<'static, State> {
        BLOCKED.with(|b| b.set(true));
        while g.streams[sid].done < seq {
            g = engine().cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        g.observe(clock);
        g
    }
}

/// A stream's worker: runs its ops in order, each once the ops it is ordered after are done.
fn worker(sid: usize) {
    let eng = engine();
    let mut g = lock();
    loop {
        loop {
            let s = &g.streams[sid];
            match s.queue.front() {
                Some(op) if op.deps.iter().all(|(d, q)| g.streams[*d].done >= *q) => break,
                None if s.destroyed => return,
                _ => g = eng.cv.wait(g).unwrap_or_else(|e| e.into_inner()),
            }
        }
        let op = g.streams[sid].queue.pop_front().expect("front");
        g.streams[sid].running = Some(op.clock.clone());
        let dev = g.streams[sid].dev;
        drop(g);
        if !op.delay.is_zero() {
            std::thread::sleep(op.delay);
        }
        if let OpKind::HostFn { f, data } = op.kind {
            let sticky = lock().sticky[dev] != 0;
            if !sticky {
                // SAFETY: the caller's host function and its argument, as cuLaunchHostFunc got them.
                unsafe { f(data as *mut c_void) };
            }
            g = lock();
        } else {
            g = lock();
            g.execute(sid, &op);
        }
        let s = &mut g.streams[sid];
        s.done = op.seq;
        s.running = None;
        g.prune();
        eng.cv.notify_all();
    }
}
