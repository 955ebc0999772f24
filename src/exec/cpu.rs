//! The reference executor: plain host memory, one `copy_nonoverlapping` per item chunk or run.
//! Large transfers are split over threads by items (destinations are unique, checked by the
//! planner, so the halves never touch the same bytes).
//!
//! Ordering works like a GPU stream: transfers run in submission order. A synchronous call on
//! an idle executor runs on the caller's thread; an asynchronous one (or any call while others
//! are queued) runs on the executor's worker thread, started on first use. A second queue with
//! its own worker (the side stream) runs a pipeline's backups next to its loads. Everything that
//! touches pool memory from outside a transfer — reads, writes, dropping a buffer — first waits
//! for both queues, so a transfer never races with them, whatever happens to its handle.

use std::alloc::Layout as AllocLayout;
use std::ptr::NonNull;
use std::sync::{mpsc, Arc, Condvar, Mutex};

use super::{Bindings, Executor, Stream};
use crate::error::{Result, TransferError};
use crate::geometry::{Addr, BufRef};
use crate::integrity;
use crate::plan::{Capabilities, ChecksumMode, Plan, Step, StepKind};

/// Below this many bytes a transfer stays on the calling thread (thread start-up costs more).
const PARALLEL_MIN_BYTES: u64 = 1 << 20;

/// Alignment of owned cpu buffers (a cache line).
const ALIGN: usize = 64;

/// Host memory, zeroed. Buffers of 2 MiB and more are mapped from the OS on Linux (zero pages
/// on first touch, so a large pool does not touch every page up front) and asked for
/// transparent huge pages: random items of a large pool then cost far fewer TLB misses.
pub struct CpuBuffer {
    ptr: NonNull<u8>,
    len: usize,
    /// How owned memory is freed on drop.
    memory: Memory,
    owner: u64,
    /// The owning executor's queues: dropping waits for queued transfers that may use the memory.
    queues: Arc<CpuQueues>,
}

// SAFETY: the buffer is plain memory; concurrent writes are ruled out by the pools' `&mut`
// access to destination pools and the planner's unique-destination check.
unsafe impl Send for CpuBuffer {}
unsafe impl Sync for CpuBuffer {}

/// Where a buffer's memory came from.
enum Memory {
    /// The caller's.
    Borrowed,
    /// `alloc_zeroed` with this layout.
    Heap(AllocLayout),
    /// An anonymous mapping of this many bytes.
    #[cfg(target_os = "linux")]
    Mapped(usize),
}

impl Drop for CpuBuffer {
    fn drop(&mut self) {
        self.queues.idle();
        match self.memory {
            Memory::Borrowed => {}
            // SAFETY: allocated by `alloc_zeroed` with this layout in `CpuExecutor::alloc`.
            Memory::Heap(layout) => unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) },
            // SAFETY: mapped by `map_huge` with this length; nothing uses it any more.
            #[cfg(target_os = "linux")]
            Memory::Mapped(len) => unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), len);
            },
        }
    }
}

/// Bytes from which owned buffers are mapped on huge pages (one huge page).
#[cfg(target_os = "linux")]
const HUGE_PAGE: usize = 2 << 20;

/// A zeroed anonymous mapping of at least `len` bytes aligned to a huge page, with
/// `MADV_HUGEPAGE` (a hint: without transparent huge pages it is plain memory). `None` when
/// the OS refuses the mapping. Returns the address and the mapped length.
#[cfg(target_os = "linux")]
fn map_huge(len: usize) -> Option<(NonNull<u8>, usize)> {
    let mapped = len.checked_next_multiple_of(HUGE_PAGE)?;
    let total = mapped.checked_add(HUGE_PAGE)?;
    // SAFETY: a fresh private anonymous mapping; the unaligned head and tail are unmapped
    // again, so exactly `start..start + mapped` stays mapped and owned by the buffer.
    unsafe {
        let p = libc::mmap(std::ptr::null_mut(), total, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
        if p == libc::MAP_FAILED {
            return None;
        }
        let base = p as usize;
        let start = base.next_multiple_of(HUGE_PAGE);
        if start > base {
            libc::munmap(p, start - base);
        }
        let tail = base + total - (start + mapped);
        if tail > 0 {
            libc::munmap((start + mapped) as *mut libc::c_void, tail);
        }
        libc::madvise(start as *mut libc::c_void, mapped, libc::MADV_HUGEPAGE);
        Some((NonNull::new(start as *mut u8)?, mapped))
    }
}

impl CpuBuffer {
    /// Wraps caller memory for executor `owner`.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes for as long as the buffer (and any
    /// pool holding it) lives, and must not be accessed by anything else during a transfer.
    pub(crate) unsafe fn from_raw(ptr: NonNull<u8>, len: usize, exec: &CpuExecutor) -> CpuBuffer {
        CpuBuffer { ptr, len, memory: Memory::Borrowed, owner: exec.id, queues: exec.queues.clone() }
    }

    /// Start of the memory.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True for a 0-byte buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The cpu executor: plain host memory, `threads` threads per large transfer, two ordered
/// queues of transfers (main and side stream).
#[derive(Clone)]
pub struct CpuExecutor {
    threads: usize,
    id: u64,
    queues: Arc<CpuQueues>,
}

/// The main and the side stream.
pub(crate) struct CpuQueues {
    main: Arc<CpuQueue>,
    side: Arc<CpuQueue>,
}

impl CpuQueues {
    fn new() -> Arc<CpuQueues> {
        Arc::new(CpuQueues { main: CpuQueue::new("hicache-io cpu"), side: CpuQueue::new("hicache-io cpu side") })
    }
    fn get(&self, stream: Stream) -> &Arc<CpuQueue> {
        match stream {
            Stream::Main => &self.main,
            Stream::Side => &self.side,
        }
    }
    /// Waits until everything queued so far on both streams has run.
    fn idle(&self) {
        self.side.idle();
        self.main.idle();
    }
}

type Job = Box<dyn FnOnce() + Send>;

thread_local! {
    /// True on an executor's worker thread.
    static ON_WORKER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Transfers in submission order on one worker thread; tickets count them.
pub(crate) struct CpuQueue {
    name: &'static str,
    state: Mutex<QueueState>,
    done: Condvar,
    /// Started on the first queued job.
    worker: Mutex<Option<mpsc::Sender<Job>>>,
}

#[derive(Default)]
struct QueueState {
    submitted: u64,
    completed: u64,
    /// The first job that failed (a panic in a copy: a bug) and its ticket.
    failed: Option<(u64, String)>,
}

impl CpuQueue {
    fn new(name: &'static str) -> Arc<CpuQueue> {
        Arc::new(CpuQueue { name, state: Mutex::new(QueueState::default()), done: Condvar::new(), worker: Mutex::new(None) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn is_idle(&self) -> bool {
        let st = self.lock();
        st.completed == st.submitted
    }

    /// Queues `job`; returns its ticket.
    fn enqueue(self: &Arc<Self>, job: Job) -> Result<u64> {
        let mut worker = self.worker.lock().unwrap_or_else(|e| e.into_inner());
        if worker.is_none() {
            let (tx, rx) = mpsc::channel::<Job>();
            let queue = Arc::downgrade(self);
            std::thread::Builder::new()
                .name(self.name.into())
                .spawn(move || {
                    ON_WORKER.with(|w| w.set(true));
                    for job in rx {
                        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                        let Some(q) = queue.upgrade() else { return };
                        let mut st = q.lock();
                        st.completed += 1;
                        if let Err(p) = outcome {
                            let msg = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
                            let ticket = st.completed;
                            st.failed.get_or_insert((ticket, msg.unwrap_or_default()));
                        }
                        q.done.notify_all();
                    }
                })
                .map_err(|e| TransferError::Executor { backend: "cpu", message: format!("starting the worker thread: {e}") })?;
            *worker = Some(tx);
        }
        let ticket = {
            let mut st = self.lock();
            st.submitted += 1;
            st.submitted
        };
        let sent = worker.as_ref().map(|tx| tx.send(job).is_ok()).unwrap_or(false);
        if !sent {
            let mut st = self.lock();
            st.completed += 1;
            st.failed.get_or_insert((ticket, "the worker thread is gone".into()));
            self.done.notify_all();
        }
        Ok(ticket)
    }

    /// Waits until the job with `ticket` (and every job before it) has run.
    pub(crate) fn wait(&self, ticket: u64) -> Result<()> {
        let mut st = self.lock();
        while st.completed < ticket {
            st = self.done.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        match &st.failed {
            Some((t, msg)) if *t <= ticket => {
                Err(TransferError::Executor { backend: "cpu", message: format!("a queued transfer panicked: {msg}") })
            }
            _ => Ok(()),
        }
    }

    /// Waits until everything queued so far has run (not what others queue meanwhile).
    pub(crate) fn idle(&self) {
        let mut st = self.lock();
        let target = st.submitted;
        while st.completed < target {
            st = self.done.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The ticket of the last queued job.
    pub(crate) fn last_ticket(&self) -> u64 {
        self.lock().submitted
    }
}

impl Drop for CpuQueue {
    fn drop(&mut self) {
        // Closing the channel ends the worker.
        self.worker.get_mut().unwrap_or_else(|e| e.into_inner()).take();
    }
}

/// A ticket on a cpu executor's queue (the cpu form of a completion handle).
#[derive(Clone)]
pub(crate) struct CpuTicket {
    pub(crate) queue: Arc<CpuQueue>,
    pub(crate) ticket: u64,
}

impl CpuTicket {
    pub(crate) fn wait(&self) -> Result<()> {
        self.queue.wait(self.ticket)
    }
    pub(crate) fn is_done(&self) -> bool {
        self.queue.lock().completed >= self.ticket
    }
}

impl Default for CpuExecutor {
    fn default() -> Self {
        CpuExecutor::new()
    }
}

impl CpuExecutor {
    /// Threads from `HICACHE_IO_CPU_THREADS`, else the machine's parallelism.
    pub fn new() -> CpuExecutor {
        let threads = std::env::var("HICACHE_IO_CPU_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
            .max(1);
        CpuExecutor::with_threads(threads)
    }
    /// An executor that uses at most `threads` threads per transfer.
    pub fn with_threads(threads: usize) -> CpuExecutor {
        CpuExecutor { threads: threads.max(1), id: super::next_executor_id(), queues: CpuQueues::new() }
    }
}

/// Physical memory plus swap, from `/proc/meminfo` (no bound where it cannot be read): a pool
/// larger than this can never be backed, so it is refused before anything is allocated.
pub(crate) fn host_memory_bytes() -> u64 {
    static MEM: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *MEM.get_or_init(|| {
        let Ok(text) = std::fs::read_to_string("/proc/meminfo") else { return isize::MAX as u64 };
        let field = |name: &str| -> Option<u64> {
            let line = text.lines().find(|l| l.starts_with(name))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kib| kib.saturating_mul(1024))
        };
        match (field("MemTotal:"), field("SwapTotal:")) {
            (Some(m), s) => m.saturating_add(s.unwrap_or(0)),
            _ => isize::MAX as u64,
        }
    })
}

#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The address (a method, so closures capture the whole `Send` wrapper).
    fn get(self) -> *mut u8 {
        self.0
    }
}

impl Executor for CpuExecutor {
    type Buffer = CpuBuffer;

    fn name(&self) -> &'static str {
        "cpu"
    }
    fn id(&self) -> u64 {
        self.id
    }
    fn buffer_owner(&self, buf: &CpuBuffer) -> u64 {
        buf.owner
    }
    fn describe(&self) -> String {
        format!("host memory, {} thread(s)", self.threads)
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: "cpu",
            max_pool_bytes: host_memory_bytes(),
            max_host_pool_bytes: host_memory_bytes(),
            checksums: true,
            direct_checksums: true,
            ..Capabilities::UNLIMITED
        }
    }
    fn alloc(&self, bytes: u64) -> Result<CpuBuffer> {
        let oom = |limit: String| TransferError::OutOfMemory { what: "cpu buffer".into(), requested: bytes, limit };
        let len = usize::try_from(bytes).map_err(|_| oom("exceeds the address space".into()))?;
        #[cfg(target_os = "linux")]
        if len >= HUGE_PAGE {
            let (ptr, mapped) = map_huge(len).ok_or_else(|| oom("mmap refused it".into()))?;
            return Ok(CpuBuffer { ptr, len, memory: Memory::Mapped(mapped), owner: self.id, queues: self.queues.clone() });
        }
        let layout = AllocLayout::from_size_align(len.max(1), ALIGN).map_err(|_| oom("exceeds the address space".into()))?;
        // SAFETY: the layout has a non-zero size. A null return is a refused allocation, reported
        // as an error rather than aborting the process.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| oom("the allocator refused it".into()))?;
        Ok(CpuBuffer { ptr, len, memory: Memory::Heap(layout), owner: self.id, queues: self.queues.clone() })
    }
    fn buffer_len(&self, buf: &CpuBuffer) -> u64 {
        buf.len as u64
    }
    fn write(&self, buf: &CpuBuffer, offset: u64, data: &[u8]) -> Result<()> {
        self.queues.idle();
        // SAFETY: span checked by `Device::write`; `&mut` pool access rules out aliasing; no
        // queued transfer runs any more.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf.as_ptr().add(offset as usize), data.len()) };
        Ok(())
    }
    fn read(&self, buf: &CpuBuffer, offset: u64, out: &mut [u8]) -> Result<()> {
        self.queues.idle();
        // SAFETY: span checked by `Device::read`; no queued transfer runs any more.
        unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr().add(offset as usize), out.as_mut_ptr(), out.len()) };
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        let side = self.queues.side.wait(self.queues.side.last_ticket());
        self.queues.main.wait(self.queues.main.last_ticket()).and(side)
    }
    fn finish(&self) -> Result<()> {
        self.synchronize()
    }
    fn completion(&self, stream: Stream) -> Result<super::Completion> {
        let queue = self.queues.get(stream);
        Ok(super::Completion::cpu(CpuTicket { queue: queue.clone(), ticket: queue.last_ticket() }))
    }
    fn order_after(&self, first: Stream, then: Stream) -> Result<()> {
        let first = self.queues.get(first).clone();
        if first.is_idle() {
            return Ok(());
        }
        let ticket = first.last_ticket();
        // A job that waits: the tickets it waits for were queued before it, so two streams
        // waiting on each other always wait for older work and never for each other.
        // A failure on `first` fails this job too, so waiters on `then` hear of it.
        self.queues.get(then).enqueue(Box::new(move || {
            if let Err(e) = first.wait(ticket) {
                panic!("{e}");
            }
        }))?;
        Ok(())
    }
    fn is_busy(&self, stream: Stream) -> bool {
        !self.queues.get(stream).is_idle()
    }
    /// One contiguous copy of the same bytes with the threads a transfer of that size uses
    /// (so the ratio compares like with like).
    fn time_one_copy(&self, bytes: u64, budget: std::time::Duration) -> Result<f64> {
        let src = vec![1u8; bytes as usize];
        let mut dst = vec![2u8; bytes as usize];
        let threads = if bytes >= PARALLEL_MIN_BYTES { self.threads } else { 1 };
        let per = (bytes as usize).div_ceil(threads.max(1)).max(1);
        crate::timing::time(budget, || {
            let (s, d) = (SendPtr(src.as_ptr() as *mut u8), SendPtr(dst.as_mut_ptr()));
            let n = src.len();
            split(threads, threads, &|lo, hi| {
                for t in lo..hi {
                    let (a, b) = ((t * per).min(n), ((t + 1) * per).min(n));
                    // SAFETY: disjoint ranges of two live vectors of `n` bytes.
                    unsafe { std::ptr::copy_nonoverlapping(s.get().add(a), d.get().add(a), b - a) };
                }
            });
            std::hint::black_box(&mut dst);
            Ok(())
        })
    }

    fn execute_step(&self, plan: &Plan, k: usize, bufs: &Bindings<'_, CpuBuffer>, enqueue: bool, stream: Stream) -> Result<()> {
        let threads = if plan.bytes() >= PARALLEL_MIN_BYTES { self.threads } else { 1 };
        let streaming = plan.bytes() >= STREAMING_MIN_BYTES;
        let raw = RawBindings {
            host: bufs.host.iter().map(|b| SendPtr(b.as_ptr())).collect(),
            device: bufs.device.iter().map(|c| c.iter().map(|b| SendPtr(b.as_ptr())).collect()).collect(),
            integrity: bufs.integrity.clone(),
        };
        let queue = self.queues.get(stream);
        if !enqueue && queue.is_idle() {
            run_step(&plan.steps()[k], &raw, threads, streaming);
            return Ok(());
        }
        // On the worker, after everything queued before it, with one thread fewer: the caller's
        // thread is free to compute meanwhile (that is why it queued). The buffers outlive the
        // job: every way to free or touch them waits for the queue first.
        let threads = threads.min(self.threads.saturating_sub(1)).max(1);
        let steps = plan.shared_steps();
        queue.enqueue(Box::new(move || run_step(&steps[k], &raw, threads, streaming)))?;
        Ok(())
    }
}

/// Buffer addresses of a plan's bindings, `[comp]` and `[comp][slot]`.
struct RawBindings {
    host: Vec<SendPtr>,
    device: Vec<Vec<SendPtr>>,
    integrity: Option<super::IntegrityBinding>,
}

impl RawBindings {
    fn get(&self, r: BufRef) -> *mut u8 {
        match r {
            BufRef::Host { comp } => self.host[comp as usize].0,
            BufRef::Device { comp, slot } => self.device[comp as usize][slot as usize].0,
        }
    }
}

/// Runs one step over raw buffer addresses; `streaming`: with non-temporal stores (a transfer
/// larger than the caches, whose destination nobody reads soon).
fn run_step(step: &Step, bufs: &RawBindings, threads: usize, streaming: bool) {
    match step.kind() {
        StepKind::Gather(g) => {
            let pairs: Vec<(SendPtr, SendPtr, Addr, Addr)> =
                g.pairs.iter().map(|l| (SendPtr(bufs.get(l.src.buf())), SendPtr(bufs.get(l.dst.buf())), l.src, l.dst)).collect();
            let (chunk, heads) = (g.chunk_bytes as usize, g.heads);
            // Layer by layer (destinations are unique, so order only affects speed): each pass
            // stays within one layer's buffers, measured up to 4x faster than item by item for
            // random 128-byte items. Upcoming items are prefetched: random small items are
            // latency-bound otherwise.
            let (si, di) = (&g.src_indices[..], &g.dst_indices[..]);
            // Prefetching the next items pays where they come from memory (a transfer larger
            // than the caches) or where an item is long enough to hide its cost; for small
            // cached items it measured 1.5x slower (128 B backups of 4 MiB).
            let prefetching = streaming || chunk >= PREFETCH_MIN_CHUNK;
            if let (Some(mode), Some(ib)) = (g.checksum, &bufs.integrity) {
                let work = |lo: usize, hi: usize| {
                    let mut n = [0u64; 4];
                    for (l, &item) in pairs.iter().zip(&g.items) {
                        n = add4(
                            n,
                            match streaming {
                                true => gather_checked::<true>(l, item, si, di, chunk, heads, lo, hi, mode, ib),
                                false => gather_checked::<false>(l, item, si, di, chunk, heads, lo, hi, mode, ib),
                            },
                        );
                    }
                    store_fence(streaming);
                    ib.sidecar.count(n);
                };
                split(g.src_indices.len(), threads, &work);
                return;
            }
            let work = |lo: usize, hi: usize| {
                for l in &pairs {
                    // Monomorphized per store kind and prefetch: a branch per chunk measured
                    // 30% slower for 128-byte items.
                    match (streaming, prefetching) {
                        (true, true) => gather_items::<true, true>(l, si, di, chunk, heads, lo, hi),
                        (true, false) => gather_items::<true, false>(l, si, di, chunk, heads, lo, hi),
                        (false, true) => gather_items::<false, true>(l, si, di, chunk, heads, lo, hi),
                        (false, false) => gather_items::<false, false>(l, si, di, chunk, heads, lo, hi),
                    }
                }
                store_fence(streaming);
            };
            split(g.src_indices.len(), threads, &work);
        }
        StepKind::Copy(runs) if step.checksum().is_some() && bufs.integrity.is_some() => {
            let (Some(mode), Some(ib)) = (step.checksum(), &bufs.integrity) else { return };
            let ptrs: Vec<(SendPtr, SendPtr)> = runs.iter().map(|r| (SendPtr(bufs.get(r.src)), SendPtr(bufs.get(r.dst)))).collect();
            let work = |lo: usize, hi: usize| {
                let mut n = [0u64; 4];
                for k in lo..hi {
                    // Runs of one item each (random pages) are latency-bound: prefetch ahead.
                    if let (Some(r), Some((s, d))) = (runs.get(k + PREFETCH_AHEAD), ptrs.get(k + PREFETCH_AHEAD)) {
                        prefetch(s.0.wrapping_add(r.src_offset as usize));
                        prefetch(d.0.wrapping_add(r.dst_offset as usize));
                    }
                    n = add4(n, copy_run_checked(&runs[k], ptrs[k], streaming, mode, ib));
                }
                store_fence(streaming);
                ib.sidecar.count(n);
            };
            split(runs.len(), threads, &work);
        }
        StepKind::Copy(runs) => {
            let runs: Vec<(SendPtr, SendPtr, usize, usize, usize)> = runs
                .iter()
                .map(|r| (SendPtr(bufs.get(r.src)), SendPtr(bufs.get(r.dst)), r.src_offset as usize, r.dst_offset as usize, r.len as usize))
                .collect();
            let work = |lo: usize, hi: usize| {
                for k in lo..hi {
                    if let Some((sp, dp, so, dof, _)) = runs.get(k + PREFETCH_AHEAD) {
                        prefetch(sp.0.wrapping_add(*so));
                        prefetch(dp.0.wrapping_add(*dof));
                    }
                    let (sp, dp, so, dof, len) = &runs[k];
                    // SAFETY: as above.
                    unsafe { copy(streaming, sp.0.add(*so), dp.0.add(*dof), *len) };
                }
                store_fence(streaming);
            };
            split(runs.len(), threads, &work);
        }
    }
}

/// Items `lo..hi` of one address pair; `NT`: non-temporal stores; `PF`: prefetch ahead.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn gather_items<const NT: bool, const PF: bool>(
    (sp, dp, sa, da): &(SendPtr, SendPtr, Addr, Addr),
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

/// Prefetches both sides of index pair `j` of a gather (nothing past the lists or for a skipped
/// pair).
#[inline(always)]
fn prefetch_item((sp, dp, sa, da): &(SendPtr, SendPtr, Addr, Addr), si: &[i64], di: &[i64], j: usize) {
    if let (Some(&s), Some(&d)) = (si.get(j), di.get(j)) {
        if s >= 0 && d >= 0 {
            prefetch(sp.0.wrapping_add(sa.offset(s as u64, 0) as usize));
            prefetch(dp.0.wrapping_add(da.offset(d as u64, 0) as usize));
        }
    }
}

fn add4(a: [u64; 4], b: [u64; 4]) -> [u64; 4] {
    [a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3]]
}

/// [`gather_items`] that checksums every item it copies, in the same pass (each block of the
/// source is loaded once, stored and multiplied in): recorded in the host pool's table for
/// backups, compared with it for loads. Returns the counts (recorded, verified, unverified,
/// mismatched).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn gather_checked<const NT: bool>(
    (sp, dp, sa, da): &(SendPtr, SendPtr, Addr, Addr),
    (layer, comp): (u64, u8),
    si: &[i64],
    di: &[i64],
    chunk: usize,
    heads: u64,
    lo: usize,
    hi: usize,
    mode: ChecksumMode,
    ib: &super::IntegrityBinding,
) -> [u64; 4] {
    let keys = ib.sidecar.keys();
    let chunk_words = integrity::words(chunk);
    let mut n = [0u64; 4];
    for i in lo..hi {
        let (s, d) = (si[i], di[i]);
        if s < 0 || d < 0 {
            continue;
        }
        prefetch_item(&(*sp, *dp, *sa, *da), si, di, i + PREFETCH_AHEAD);
        let mut sum = 0u64;
        for h in 0..heads {
            // SAFETY: as in `gather_items`; the source chunk is only read (the planner refuses
            // calls whose destinations overlap a source).
            unsafe {
                let (src, dst) = (sp.0.add(sa.offset(s as u64, h) as usize), dp.0.add(da.offset(d as u64, h) as usize));
                sum = sum.wrapping_add(integrity::copy_and_sum(src, dst, chunk, h as usize * chunk_words, keys, NT));
            }
        }
        let (host, device) = match mode {
            ChecksumMode::Record => (d as u64, s as u64),
            ChecksumMode::Verify => (s as u64, d as u64),
        };
        ib.settle(mode, (host, device, layer, comp), sum, &mut n);
    }
    n
}

/// One `direct` run, item by item, each copied and checksummed in one pass (the run's items are
/// consecutive and whole: `len / items` bytes each). Counts as [`gather_checked`].
fn copy_run_checked(
    r: &crate::plan::Run,
    (sp, dp): (SendPtr, SendPtr),
    stream: bool,
    mode: ChecksumMode,
    ib: &super::IntegrityBinding,
) -> [u64; 4] {
    let keys = ib.sidecar.keys();
    let mut n = [0u64; 4];
    let item = (r.len / r.items.max(1)) as usize;
    for k in 0..r.items {
        let at = k as usize * item;
        if k + (PREFETCH_AHEAD as u64) < r.items {
            let ahead = at + PREFETCH_AHEAD * item;
            prefetch(sp.0.wrapping_add(r.src_offset as usize + ahead));
            prefetch(dp.0.wrapping_add(r.dst_offset as usize + ahead));
        }
        // SAFETY: the planner made the run from range-checked items of these pools' geometry;
        // item `k` lies inside it.
        let sum = unsafe {
            let (s, d) = (sp.0.add(r.src_offset as usize + at), dp.0.add(r.dst_offset as usize + at));
            integrity::copy_and_sum(s, d, item, 0, keys, stream)
        };
        ib.settle(mode, (r.host_unit + k, r.device_unit + k, r.host_layer, r.comp), sum, &mut n);
    }
    n
}

/// [`copy_streaming`] or [`copy_chunk`] (a constant `streaming` folds the branch away).
///
/// # Safety
/// As `copy_nonoverlapping(src, dst, len)`.
#[inline(always)]
unsafe fn copy(streaming: bool, src: *const u8, dst: *mut u8, len: usize) {
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
const STREAMING_MIN_BYTES: u64 = 24 << 20;

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

/// How many items ahead the gather loop prefetches.
const PREFETCH_AHEAD: usize = 8;

#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch is a hint; it never faults, even on an invalid address.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T0)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Runs `work(lo, hi)` over `0..n` split into up to `threads` pieces on rayon's pool (its
/// threads stay alive between transfers: spawning per call cost ~10% of a 4 MiB load).
fn split(n: usize, threads: usize, work: &(dyn Fn(usize, usize) + Sync)) {
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
