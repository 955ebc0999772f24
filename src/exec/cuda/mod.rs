//! The NVIDIA executor: cudarc (driver API, loaded at run time), the copy kernels of
//! `kernels/transfer.cu` for io backend `kernel`, and DMA copies for `direct`.
//!
//! - Host pools are pinned, mapped host memory (`cuMemHostAlloc(PORTABLE | DEVICEMAP)`, not
//!   write-combined, so the CPU reads it at full speed); kernels address it through the device
//!   pointer the driver returns (UVA).
//! - Device pools: one `cuMemAlloc` per layer buffer.
//! - Kernels ship embedded: sm_90 and sm_80 cubins and compute_80 PTX (ISA 8.0, drivers ≥ 525),
//!   built by `scripts/build-kernels.py` and checked by the CI compile gate. No NVRTC needed.
//! - Ordering: everything this executor does to device memory — zeroing new buffers, pool
//!   writes and reads, gather tables, kernels and copies — is enqueued on the executor's one
//!   stream (its own non-blocking stream, or the caller's with [`CudaExecutor::from_stream`]), so
//!   stream order is program order. Transfers return once enqueued; pool reads and writes,
//!   [`CudaExecutor::synchronize`], dropping a buffer (owned or borrowed) and dropping the executor
//!   wait for the stream. [`CudaExecutor::record`] gives a completion handle.
//! - `kernel`: each gather step uploads its index lists and address-pair table once, through
//!   pinned staging slots (reused once their upload has left them, the ring grown when all are
//!   busy: issuing never waits for the device), into a device scratch area reused across steps
//!   and calls (the steps of a layer-sharded backup share their index lists and upload only
//!   their table).
//! - Item checksums (host pools that keep them): a checksumming gather step runs the summing
//!   kernel (`hicache_gather_sum_w*`: the same copy, each lane adding its words' checksum terms
//!   into the item's entry with a 64-bit atomic add), its sums copied into pinned memory after
//!   it; the host records or verifies them once the event after that copy has completed, at
//!   the next wait, poll, synchronize or issue (module `sums`). No host function sits in the
//!   streams and nothing on the issue path waits. A plain call returns once enqueued, so its
//!   mismatches are reported by the next [`CudaExecutor::synchronize`]
//!   ([`CudaExecutor::integrity_reports`]); an asynchronous one's by its completion. `direct`
//!   copies cannot sum: their items settle as unknown, in the same order.
//! - `direct` uses `cuMemcpyBatchAsync` (resolved by ABI version 12.8, in calls of at most 4096
//!   copies; not on the default streams, which it rejects), else one `cuMemcpyAsync` per run.
//!
//! Without libcuda, a driver or a device, [`CudaExecutor::new`] returns `Unavailable`; nothing
//! here panics for a missing CUDA.

//!
//! Rooms: `driver` (probing, errors, kernel images), `abi` (the kernels' launch descriptors),
//! `memory` (device and pinned or registered host memory), `queue` (engine and backup streams,
//! tickets), `staging` (tables uploaded without blocking), `gather` (the copy kernels), `checks`
//! (index lists checked on the device), `copy` (`direct`), `checksums` (settled in issue order),
//! `open` (construction), and here the executor itself.

mod checks;
mod checksums;
mod copy;
mod driver;
mod gather;
mod memory;
mod open;
mod plan_checks;
mod queue;
mod staging;
mod tables;

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::result;
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaStream, DriverError};

use super::host::{host_memory_bytes, next_executor_id};
use super::{AutoSlot, Bindings, Executor, ExecutorKind, Stream};
use crate::error::{Result, TransferError};
use crate::plan::{Capabilities, Plan, StepKind};

pub use driver::probe;
use driver::{batch_memcpy_fn, drv, drv_msg, is_default_stream, unavailable, BatchFn, CUBIN_80, CUBIN_90, PTX_80};
pub use memory::CudaBuffer;
pub use queue::CudaTicket;
use staging::Scratch;
/// The former name of [`CudaTicket`].
pub type Completion = CudaTicket;
use queue::{BackupStream, EngineStream};

/// The kernels' launch descriptors (also compiled without the cuda feature, for the host
/// emulation of the kernels in the tests).
pub use super::cuda_launch as abi;
pub use abi::LaunchTuning;

struct Inner {
    /// The `auto` io backend's measured table.
    auto: AutoSlot,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    module: sys::CUmodule,
    /// `hicache_gather_w16`, `_w8`, `_w4`.
    f_gather: [sys::CUfunction; 3],
    /// `hicache_gather_sum_w16`, `_w8`, `_w4`: the same copies, checksumming each item.
    f_gather_sum: [sys::CUfunction; 3],
    f_check: sys::CUfunction,
    name: String,
    cc: (i32, i32),
    driver: i32,
    image: &'static str,
    batch: Option<BatchFn>,
    tuning: LaunchTuning,
    /// Index tables and address pairs of gather steps, uploaded once per step.
    scratch: Mutex<Scratch>,
    /// The backup stream (a pipeline's backups) and its own scratch, made on first use.
    backup: Mutex<Option<Arc<BackupStream>>>,
    /// The engine's stream (the forward pass writing KV): every backup waits for the work queued
    /// on it when the backup is issued.
    engine: Mutex<Option<EngineStream>>,
    /// Reports of device-checked calls not yet looked at.
    reports: Mutex<checks::Reports>,
    /// Layer tables read once and remembered.
    tables: Mutex<tables::Tables>,
    /// Checksums of summing gathers (and items of `direct` steps) not yet settled.
    sums: Arc<checksums::SumsQueue>,
    /// Threads per block every gather function allows (their register use decides it).
    max_threads: u32,
    /// The widest copy word used (`HICACHE_CUDA_MAX_WORD=8` or `4` caps it, to compare the
    /// kernels in benchmarks; the bytes moved are the same).
    max_word: u32,
    id: u64,
}

// SAFETY: CUDA handles are usable from any thread once the context is bound (we bind before
// every driver call).
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

impl Inner {
    fn backup(&self) -> Option<Arc<BackupStream>> {
        self.backup.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
    /// Waits for both streams and the engine stream, which may write the pools' memory too
    /// (the context is bound by the caller).
    fn sync_all(&self) -> std::result::Result<(), DriverError> {
        let side = self.backup().map_or(Ok(()), |s| s.stream.synchronize());
        let engine = self.engine.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|e| e.raw);
        // SAFETY: the engine stream is live while it is set (see `set_engine_stream_raw`).
        let engine = engine.filter(|e| *e != self.stream.cu_stream()).map_or(Ok(()), |e| unsafe { result::stream::synchronize(e) });
        self.stream.synchronize().and(side).and(engine)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = self.sync_all();
        if let Some(side) = self.backup.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            if let Ok(side) = Arc::try_unwrap(side) {
                side.scratch.into_inner().unwrap_or_else(|e| e.into_inner()).free();
                // SAFETY: made by `backup_stream`, synchronized above; nothing uses it any more.
                let _ = unsafe { result::stream::destroy(side.stream.cu_stream()) };
            }
        }
        self.scratch.get_mut().unwrap_or_else(|e| e.into_inner()).free();
        let reports = self.reports.get_mut().unwrap_or_else(|e| e.into_inner());
        // Failed checks nobody asked about are not dropped silently.
        // SAFETY: the context is bound and the streams drained.
        if let Err(e) = unsafe { reports.collect(true) } {
            log::error!("cuda: dropped with an unreported failed index check: {e}");
        }
        reports.free();
        self.tables.get_mut().unwrap_or_else(|e| e.into_inner()).free();
        self.sums.free();
        // SAFETY: the module was loaded by us and no launch is pending.
        let _ = unsafe { result::module::unload(self.module) };
    }
}

/// The cuda executor: one context and one stream.
#[derive(Clone)]
pub struct CudaExecutor {
    inner: Arc<Inner>,
}

impl CudaExecutor {
    /// Waits for everything enqueued on the executor's streams, then reports the first call
    /// whose CUDA index lists failed their device checks since the last report
    /// ([`TransferError::DeviceIndexCheck`]; nothing of that call was copied).
    pub fn synchronize(&self) -> Result<()> {
        Executor::synchronize(self)?;
        self.index_check_reports(true)?;
        self.integrity_reports()
    }

    /// Waits for the streams, then reports a failed device index check of an earlier call (what
    /// pool reads and writes did before checksums): an earlier load's mismatch is left for
    /// [`CudaExecutor::synchronize`] and [`CudaExecutor::integrity_reports`].
    fn sync_checked(&self) -> Result<()> {
        Executor::synchronize(self)?;
        self.index_check_reports(true)
    }

    /// Waits for the queued steps that carry item checksums (their events only: not the engine's
    /// stream, not other work) and settles them.
    pub(crate) fn settle_checksums(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: the context is bound.
        unsafe { self.inner.sums.settle(true) };
        Ok(())
    }

    /// The items of plain (synchronous) checksumming loads whose bytes did not match their
    /// checksums, settled since the last report ([`TransferError::Integrity`]; the other items
    /// landed): those calls return once enqueued, before their checksums arrive. Does not wait;
    /// each mismatch is reported once. Asynchronous transfers report on their completion.
    pub fn integrity_reports(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: the context is bound.
        unsafe { self.inner.sums.settle(false) };
        self.inner.sums.take_unreported().map_or(Ok(()), Err)
    }

    /// The first call whose CUDA index lists failed their device checks, among the reports that
    /// have arrived (`wait`: all of them, waiting for the streams); each report is given once.
    pub fn index_check_reports(&self, wait: bool) -> Result<()> {
        self.bind()?;
        let mut reports = self.inner.reports.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the context is bound.
        unsafe { reports.collect(wait) }
    }

    /// The executor's stream (raw handle) for callers that order their own work after ours.
    pub fn cu_stream(&self) -> sys::CUstream {
        self.inner.stream.cu_stream()
    }

    /// An event recorded after everything enqueued so far: overlap a layer's load with compute
    /// and wait on it only when that layer is needed.
    pub fn record(&self) -> Result<CudaTicket> {
        self.record_on(Stream::Main)
    }

    /// The stream the engine's forward pass writes KV on. Every backup (device to host: all-layer,
    /// per-layer, layer-sharded, draft, kvcacheio), on whichever of the executor's streams it runs,
    /// first waits — on the device, without blocking the host — for the work queued on this
    /// stream when the backup is issued, so it copies the KV the forward pass finished writing.
    /// `None` turns that off. Executors made with [`CudaExecutor::from_stream`] or
    /// [`CudaExecutor::on_raw_stream`] start with their own stream as the engine stream.
    pub fn set_engine_stream(&self, stream: Option<Arc<CudaStream>>) -> Result<()> {
        if let Some(s) = &stream {
            if **s.context() != *self.inner.ctx {
                return Err(drv_msg("the engine stream belongs to another CUDA context than this executor's"));
            }
        }
        let engine = stream.map(|s| EngineStream { raw: s.cu_stream(), _keep: Some(s) });
        *self.inner.engine.lock().unwrap_or_else(|e| e.into_inner()) = engine;
        Ok(())
    }

    /// [`CudaExecutor::set_engine_stream`] with a raw handle (torch's current stream, say).
    ///
    /// # Safety
    /// `raw` must be a stream of this executor's context (or a default-stream handle) that
    /// outlives the executor or the next call of this function.
    pub unsafe fn set_engine_stream_raw(&self, raw: u64) {
        *self.inner.engine.lock().unwrap_or_else(|e| e.into_inner()) = Some(EngineStream { raw: raw as sys::CUstream, _keep: None });
    }

    /// Orders work enqueued on `stream` from now on after the engine stream's work so far (an
    /// event recorded there, waited on here; nothing blocks the host).
    fn order_after_engine(&self, stream: Stream) -> Result<()> {
        let engine = match self.inner.engine.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            Some(e) => e.raw,
            None => return Ok(()),
        };
        let target = self.raw_stream(stream)?;
        if engine == target {
            return Ok(());
        }
        // SAFETY: live streams of the bound context (the engine's vouched for when it was set).
        unsafe { queue::order_raw(engine, target, "ordering a backup after the engine stream") }
    }

    fn record_on(&self, stream: Stream) -> Result<CudaTicket> {
        self.bind()?;
        let raw = self.raw_stream(stream)?;
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| drv("cuEventCreate", e))?;
        // SAFETY: event and stream are live.
        if let Err(e) = unsafe { result::event::record(event, raw) } {
            // SAFETY: created above, never recorded.
            let _ = unsafe { result::event::destroy(event) };
            return Err(drv("cuEventRecord", e));
        }
        Ok(CudaTicket { event, ctx: self.inner.ctx.clone(), sums: self.inner.sums.clone() })
    }

    /// Whether `direct` uses `cuMemcpyBatchAsync` (not on the default streams, which it rejects).
    pub fn batched_memcpy(&self) -> bool {
        self.inner.batch.is_some() && !is_default_stream(self.cu_stream())
    }

    fn bind(&self) -> Result<()> {
        self.inner.ctx.bind_to_thread().map_err(|e| drv("bind", e))
    }

    /// The backup stream, made on first use (a non-blocking stream of the executor's context).
    fn backup_stream(&self) -> Result<Arc<BackupStream>> {
        let mut side = self.inner.backup.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = side.as_ref() {
            return Ok(s.clone());
        }
        // cuStreamCreate directly: cudarc's new_stream synchronizes the whole context when it
        // makes a context's first stream (an engine's work included).
        // The context is bound by the caller; the stream is destroyed in `Inner::drop`.
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking).map_err(|e| drv("cuStreamCreate (backup stream)", e))?;
        // SAFETY: a live stream of this context, destroyed only after the executor is done with it.
        let stream = unsafe { self.inner.ctx.wrap_borrowed_stream(raw) };
        let s = Arc::new(BackupStream { stream, scratch: Mutex::new(Scratch::default()) });
        *side = Some(s.clone());
        Ok(s)
    }

    /// The raw stream of `on` and the scratch whose lock orders its gathers (and their
    /// checksum entries); for the backup stream (made on first use) `side` keeps it alive.
    fn stream_scratch<'a>(&'a self, on: Stream, side: &'a mut Option<Arc<BackupStream>>) -> Result<(sys::CUstream, &'a Mutex<Scratch>)> {
        if on == Stream::Backup {
            *side = Some(self.backup_stream()?);
        }
        Ok(match side {
            Some(s) => (s.stream.cu_stream(), &s.scratch),
            None => (self.cu_stream(), &self.inner.scratch),
        })
    }

    /// The raw stream of `stream` (the backup stream made on first use).
    fn raw_stream(&self, stream: Stream) -> Result<sys::CUstream> {
        match stream {
            Stream::Main => Ok(self.cu_stream()),
            Stream::Backup => Ok(self.backup_stream()?.stream.cu_stream()),
        }
    }
}

impl Executor for CudaExecutor {
    type Buffer = CudaBuffer;
    type Ticket = CudaTicket;
    const KIND: ExecutorKind = ExecutorKind::Cuda;

    fn id(&self) -> u64 {
        self.inner.id
    }
    fn buffer_owner(&self, buf: &CudaBuffer) -> u64 {
        buf.exec.id
    }
    fn describe(&self) -> String {
        let i = &self.inner;
        format!(
            "{} (sm_{}{}, driver {}.{}, kernels: {}, batched memcpy: {}, grid {}×{} warps, words up to {} B)",
            i.name,
            i.cc.0,
            i.cc.1,
            i.driver / 1000,
            (i.driver % 1000) / 10,
            i.image,
            if self.batched_memcpy() { "yes" } else { "no" },
            i.tuning.block_quota,
            i.tuning.num_warps_per_block,
            i.max_word
        )
    }
    fn auto_slot(&self) -> &AutoSlot {
        &self.inner.auto
    }
    fn capabilities(&self) -> Capabilities {
        let host = host_memory_bytes();
        Capabilities {
            name: "cuda",
            max_host_pool_bytes: host,
            device_index_lists: true,
            // The summing gathers; DMA copies cannot sum (their items settle as unknown).
            checksums: true,
            direct_checksums: false,
            max_checksum_item_words: abi::MAX_SUM_ITEM_WORDS,
            ..Capabilities::UNLIMITED
        }
    }
    fn alloc(&self, bytes: u64) -> Result<CudaBuffer> {
        self.bind()?;
        let n = bytes.max(1) as usize;
        // SAFETY: fresh allocation, zeroed on the executor's stream (the legacy NULL stream would
        // not order against our non-blocking stream).
        let dev_ptr = unsafe {
            let p = result::malloc_sync(n).map_err(|e| TransferError::OutOfMemory {
                what: "cuda device buffer".into(),
                requested: bytes,
                limit: format!("cuMemAlloc: {e:?}"),
            })?;
            if let Err(e) = result::memset_d8_async(p, 0, n, self.cu_stream()) {
                let _ = result::free_sync(p);
                return Err(drv("cuMemsetD8Async", e));
            }
            p
        };
        // Wait for the zeroing: the engine may write the new pool's memory on its own stream
        // (its KV), which nothing would order after ours. Pools are made once, off the hot path.
        if let Err(e) = self.inner.stream.synchronize() {
            // SAFETY: allocated above; the failed stream no longer runs the memset.
            let _ = unsafe { result::free_sync(dev_ptr) };
            return Err(drv("cuStreamSynchronize (zeroing a new buffer)", e));
        }
        Ok(CudaBuffer {
            dev_ptr,
            host_ptr: std::ptr::null_mut(),
            len: bytes,
            owned: true,
            registered: false,
            stream_ordered: false,
            exec: self.inner.clone(),
        })
    }
    fn alloc_host(&self, bytes: u64) -> Result<CudaBuffer> {
        self.bind()?;
        let n = bytes.max(1) as usize;
        // SAFETY: fresh pinned allocation; PORTABLE|DEVICEMAP (not write-combined).
        unsafe {
            let host = result::malloc_host(n, sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP).map_err(|e| {
                TransferError::OutOfMemory {
                    what: "cuda pinned host buffer".into(),
                    requested: bytes,
                    limit: format!("cuMemHostAlloc: {e:?}"),
                }
            })?;
            std::ptr::write_bytes(host as *mut u8, 0, n);
            let mut dev_ptr = 0;
            let rc = sys::cuMemHostGetDevicePointer_v2(&mut dev_ptr, host, 0);
            if rc != sys::CUresult::CUDA_SUCCESS {
                let _ = result::free_host(host);
                return Err(driver::rc_err("cuMemHostGetDevicePointer", rc));
            }
            Ok(CudaBuffer {
                dev_ptr,
                host_ptr: host as *mut u8,
                len: bytes,
                owned: true,
                registered: false,
                stream_ordered: false,
                exec: self.inner.clone(),
            })
        }
    }
    fn buffer_len(&self, buf: &CudaBuffer) -> u64 {
        buf.len
    }
    fn check_buffer(&self, buf: &CudaBuffer) -> Result<()> {
        // The copy kernel moves at least 4-byte words.
        if !buf.dev_ptr.is_multiple_of(4) {
            return Err(TransferError::Misaligned { what: "cuda buffer address".into(), value: buf.dev_ptr, required: 4 });
        }
        Ok(())
    }
    fn write(&self, buf: &CudaBuffer, offset: u64, data: &[u8]) -> Result<()> {
        self.sync_checked()?;
        if buf.is_host() {
            // SAFETY: span checked by `Device::write`; no transfer in flight after the sync.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf.host_ptr.add(offset as usize), data.len()) };
            Ok(())
        } else {
            // On the executor's stream, then waited: a pageable copy on the legacy stream may
            // return before its DMA lands and is not ordered against our stream.
            // SAFETY: span checked; `data` outlives the synchronize below.
            unsafe { result::memcpy_htod_async(buf.dev_ptr + offset, data, self.cu_stream()) }.map_err(|e| drv("cuMemcpyHtoDAsync", e))?;
            self.sync_checked()
        }
    }
    fn read(&self, buf: &CudaBuffer, offset: u64, out: &mut [u8]) -> Result<()> {
        self.sync_checked()?;
        if buf.is_host() {
            // SAFETY: span checked; transfers finished.
            unsafe { std::ptr::copy_nonoverlapping(buf.host_ptr.add(offset as usize), out.as_mut_ptr(), out.len()) };
            Ok(())
        } else {
            // SAFETY: span checked; `out` outlives the synchronize below.
            unsafe { result::memcpy_dtoh_async(out, buf.dev_ptr + offset, self.cu_stream()) }.map_err(|e| drv("cuMemcpyDtoHAsync", e))?;
            self.sync_checked()
        }
    }
    fn time_one_copy(&self, bytes: u64, budget: std::time::Duration) -> Result<f64> {
        let (h, d) = (self.alloc_host(bytes)?, self.alloc(bytes)?);
        let stream = self.cu_stream();
        crate::timing::time(budget, || {
            self.bind()?;
            // SAFETY: both allocations hold `bytes` bytes.
            let rc = unsafe { sys::cuMemcpyAsync(d.dev_ptr, h.dev_ptr, bytes as usize, stream) };
            if rc != sys::CUresult::CUDA_SUCCESS {
                return Err(driver::rc_err("cuMemcpyAsync", rc));
            }
            self.sync_checked()
        })
    }
    fn synchronize(&self) -> Result<()> {
        self.bind()?;
        let synced = self.inner.sync_all().map_err(|e| drv("cuStreamSynchronize", e));
        // Every queued checksum has arrived (or its stream failed: settled as unknown).
        // SAFETY: the context is bound.
        unsafe { self.inner.sums.settle(true) };
        synced
    }
    fn completion(&self, stream: Stream) -> Result<CudaTicket> {
        self.record_on(stream)
    }
    fn synchronize_and_report(&self) -> Result<()> {
        CudaExecutor::synchronize(self)
    }
    fn integrity_reports(&self) -> Result<()> {
        CudaExecutor::integrity_reports(self)
    }
    fn settle_checksums(&self) -> Result<()> {
        CudaExecutor::settle_checksums(self)
    }
    fn index_check_reports(&self, wait: bool) -> Result<()> {
        CudaExecutor::index_check_reports(self, wait)
    }
    fn with_shared_index_check<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        CudaExecutor::with_shared_index_check(self, f)
    }
    fn order_after(&self, first: Stream, then: Stream) -> Result<()> {
        self.bind()?;
        if first == then {
            return Ok(());
        }
        let (first, then) = (self.raw_stream(first)?, self.raw_stream(then)?);
        // SAFETY: both streams are live streams of the bound context.
        unsafe { queue::order_raw(first, then, "cuStreamWaitEvent") }
    }
    fn is_busy(&self, stream: Stream) -> bool {
        let raw = match stream {
            Stream::Main => self.cu_stream(),
            Stream::Backup => match self.inner.backup() {
                Some(s) => s.stream.cu_stream(),
                None => return false,
            },
        };
        if self.bind().is_err() {
            return true;
        }
        // SAFETY: a live stream of the bound context. Anything but "done" counts as busy.
        unsafe { sys::cuStreamQuery(raw) != sys::CUresult::CUDA_SUCCESS }
    }
    fn execute_step(&self, plan: &Plan, k: usize, bufs: &Bindings<'_, CudaBuffer>, enqueue: bool, stream: Stream) -> Result<()> {
        self.bind()?;
        // Sums that have arrived free their buffers (a look at each event, no wait).
        // SAFETY: the context is bound.
        unsafe { self.inner.sums.settle(false) };
        if k == 0 && plan.direction() == crate::plan::Direction::DeviceToHost {
            self.order_after_engine(stream)?;
        }
        let step = &plan.steps()[k];
        // A plain call returns once enqueued: its mismatches go to the next synchronize.
        let orphan = !enqueue;
        match (step.kind(), step.unsummed(), &bufs.integrity) {
            (StepKind::Gather(g), _, _) => self.gather(plan, k, g, bufs, stream, orphan),
            (StepKind::Copy(c), Some(mode), Some(b)) => self.copies_unsummed(c, bufs, stream, mode, b, orphan),
            (StepKind::Copy(c), _, _) => self.copies(c, bufs, stream),
        }
    }
}
