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
//! The code: `driver` (probing, errors, kernel images), `buffer` (memory), `streams` (engine and
//! side streams, completions), `staging` (tables uploaded without blocking), `launch` (gather
//! kernels), `copies` (`direct`), `sums` (checksums settled in issue order), and here the
//! executor itself.

mod buffer;
mod checks;
mod copies;
mod driver;
mod launch;
mod staging;
mod streams;
mod sums;

use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex};

use cudarc::driver::result;
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaStream, DriverError};

use super::{Bindings, Executor, Stream};
use crate::error::{Result, TransferError};
use crate::plan::{Capabilities, Plan, StepKind};

pub use buffer::CudaBuffer;
pub use driver::probe;
use driver::{batch_memcpy_fn, drv, drv_msg, is_default_stream, unavailable, BatchFn, CUBIN_80, CUBIN_90, PTX_80};
use staging::Scratch;
pub use streams::Completion;
use streams::{EngineStream, SideStream};

pub use super::cuda_launch::LaunchTuning;

thread_local! {
    /// The grid of the calls made on this thread inside [`with_call_tuning`].
    static CALL_TUNING: std::cell::Cell<Option<LaunchTuning>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with the gathers it issues on this thread launched with `tuning` (clamped; sglang's
/// per-call `block_quota` and `num_warps_per_block`) instead of the executor's own.
pub fn with_call_tuning<R>(tuning: LaunchTuning, f: impl FnOnce() -> R) -> R {
    // Restored on unwinding too (a panic caught by a binding must not leave it set).
    struct Restore(Option<LaunchTuning>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CALL_TUNING.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CALL_TUNING.with(|c| c.replace(Some(tuning.clamped()))));
    f()
}

fn call_tuning() -> Option<LaunchTuning> {
    CALL_TUNING.with(|c| c.get())
}

struct Inner {
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
    /// The side stream (a pipeline's backups) and its own scratch, made on first use.
    side: Mutex<Option<Arc<SideStream>>>,
    /// The engine's stream (the forward pass writing KV): every backup waits for the work queued
    /// on it when the backup is issued.
    engine: Mutex<Option<EngineStream>>,
    /// Reports of device-checked calls not yet looked at.
    reports: Mutex<checks::Reports>,
    /// Checksums of summing gathers (and items of `direct` steps) not yet settled.
    sums: Arc<sums::SumsQueue>,
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
    fn side(&self) -> Option<Arc<SideStream>> {
        self.side.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
    /// Waits for both streams and the engine stream, which may write the pools' memory too
    /// (the context is bound by the caller).
    fn sync_all(&self) -> std::result::Result<(), DriverError> {
        let side = self.side().map_or(Ok(()), |s| s.stream.synchronize());
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
        if let Some(side) = self.side.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            if let Ok(side) = Arc::try_unwrap(side) {
                side.scratch.into_inner().unwrap_or_else(|e| e.into_inner()).free();
                // SAFETY: made by `side_stream`, synchronized above; nothing uses it any more.
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
    /// Opens device `ordinal`; `Err(Unavailable)` without a driver or device.
    pub fn new(ordinal: usize) -> Result<CudaExecutor> {
        CudaExecutor::with_tuning(ordinal, LaunchTuning::default())
    }

    /// Opens device `ordinal` with a grid tuning.
    pub fn with_tuning(ordinal: usize, tuning: LaunchTuning) -> Result<CudaExecutor> {
        let (driver, count) = probe()?;
        if ordinal >= count as usize {
            return Err(unavailable(format!("device {ordinal} requested, {count} present")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| unavailable(format!("context on device {ordinal}: {e:?}")))?;
        let stream = ctx.new_stream().map_err(|e| drv("cuStreamCreate", e))?;
        CudaExecutor::from_parts(ctx, stream, driver, tuning, false)
    }

    /// Runs on the caller's stream (an engine's own; not the legacy NULL stream if `direct`
    /// should batch), which is also the engine stream (see [`CudaExecutor::set_engine_stream`]).
    /// Transfers are enqueued on it and nothing here synchronizes it, except
    /// pool reads/writes, [`CudaExecutor::synchronize`] and dropping a buffer this executor
    /// allocated or registered (its memory may still be in use by a queued copy).
    pub fn from_stream(stream: Arc<CudaStream>, tuning: LaunchTuning) -> Result<CudaExecutor> {
        let (driver, _) = probe()?;
        let ctx = stream.context().clone();
        CudaExecutor::from_parts(ctx, stream, driver, tuning, true)
    }

    /// Runs on a stream another library owns (torch's current stream, say), given as its raw
    /// handle, on device `ordinal`'s primary context (the one the CUDA runtime uses).
    ///
    /// # Safety
    /// `raw_stream` must be a valid stream of that context (or a default-stream handle) for as
    /// long as the executor lives.
    pub unsafe fn on_raw_stream(ordinal: usize, raw_stream: u64, tuning: LaunchTuning) -> Result<CudaExecutor> {
        let (_, count) = probe()?;
        if ordinal >= count as usize {
            return Err(unavailable(format!("device {ordinal} requested, {count} present")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| unavailable(format!("context on device {ordinal}: {e:?}")))?;
        // A stream of another device's (or another context's) is refused, not trusted: work on it
        // would address this context's memory.
        if raw_stream > 2 {
            let mut of: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: plain query of a handle the caller vouches for.
            let rc = unsafe { sys::cuStreamGetCtx(raw_stream as sys::CUstream, &mut of) };
            if rc != sys::CUresult::CUDA_SUCCESS {
                return Err(drv_msg(&format!("stream {raw_stream:#x}: cuStreamGetCtx: {rc:?}")));
            }
            if of != ctx.cu_ctx() {
                return Err(drv_msg(&format!(
                    "stream {raw_stream:#x} belongs to another CUDA context than device {ordinal}'s primary context"
                )));
            }
        }
        // SAFETY: the caller vouches for the handle.
        let stream = unsafe { ctx.wrap_borrowed_stream(raw_stream as sys::CUstream) };
        CudaExecutor::from_stream(stream, tuning)
    }

    /// Copies `len` bytes of device memory at `ptr` to the host, ordered after the work on the
    /// executor's stream, and waits for that stream (index lists the planner must read).
    ///
    /// # Safety
    /// `ptr..ptr + len` must be device memory of this executor's context.
    pub unsafe fn read_device(&self, ptr: u64, len: u64) -> Result<Vec<u8>> {
        self.bind()?;
        let n = usize::try_from(len).map_err(|_| drv_msg("read_device: length exceeds the address space"))?;
        let mut out = vec![0u8; n];
        if n > 0 {
            // SAFETY: `out` holds `n` bytes; the caller vouches for the device span.
            let rc = unsafe { sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr() as *mut c_void, ptr, n, self.cu_stream()) };
            if rc != sys::CUresult::CUDA_SUCCESS {
                return Err(TransferError::Executor { backend: "cuda", message: format!("cuMemcpyDtoHAsync: {rc:?}") });
            }
        }
        self.sync_checked()?;
        Ok(out)
    }

    /// The address kernels of this executor's device read host memory at `addr` through: the
    /// device alias the driver maps pinned or registered host memory at (interior addresses
    /// keep their offset). Host memory that is neither is refused with the driver's answer.
    pub fn host_device_pointer(&self, addr: u64) -> Result<u64> {
        self.bind()?;
        let mut dev_ptr = 0;
        // SAFETY: a plain query; the driver answers for any address.
        let rc = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev_ptr, addr as *mut c_void, 0) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            return Err(TransferError::Executor {
                backend: "cuda",
                message: format!(
                    "host memory at {addr:#x} is not pinned or registered for this device (cuMemHostGetDevicePointer: {rc:?})"
                ),
            });
        }
        Ok(dev_ptr)
    }

    fn from_parts(ctx: Arc<CudaContext>, stream: Arc<CudaStream>, driver: i32, tuning: LaunchTuning, engine: bool) -> Result<CudaExecutor> {
        let engine = engine.then(|| EngineStream { raw: stream.cu_stream(), _keep: Some(stream.clone()) });
        let name = ctx.name().unwrap_or_else(|_| "?".into());
        let cc = ctx.compute_capability().map_err(|e| drv("compute capability", e))?;
        if cc.0 < 8 {
            return Err(unavailable(format!("{name} is sm_{}{}; the kernels need sm_80 or newer", cc.0, cc.1)));
        }
        ctx.bind_to_thread().map_err(|e| drv("bind", e))?;
        // sm_90 cubin on Hopper, sm_80 cubin on Ampere/Ada (binary compatible within major 8),
        // PTX JIT elsewhere, and the PTX too when a cubin does not load.
        let ptx = CString::new(PTX_80).map_err(|_| unavailable("embedded PTX has a NUL byte"))?;
        let cubin: Option<(&'static str, &[u8])> = match cc {
            (9, 0) => Some(("sm_90 cubin", CUBIN_90)),
            (8, _) => Some(("sm_80 cubin", CUBIN_80)),
            _ => None,
        };
        let mut loaded = None;
        if let Some((image, bytes)) = cubin {
            // An include_bytes! array is byte-aligned; ELF images are loaded from 8-byte-aligned
            // memory (a copy in u64 words).
            let mut words = vec![0u64; bytes.len().div_ceil(8)];
            bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
            // SAFETY: a complete cubin image that outlives the call.
            match unsafe { result::module::load_data(words.as_ptr() as *const c_void) } {
                Ok(m) => loaded = Some((image, m)),
                Err(e) => log::warn!("cuda: loading the {image} failed ({e:?}); falling back to the PTX"),
            }
        }
        let (image, module) = match loaded {
            Some(l) => l,
            None => {
                let image = "compute_80 PTX (JIT)";
                // SAFETY: NUL-terminated PTX that outlives the call.
                let m = unsafe { result::module::load_data(ptx.as_ptr() as *const c_void) }
                    .map_err(|e| unavailable(format!("loading {image}: {e:?} (the PTX needs a driver of version 525 or newer)")))?;
                (image, m)
            }
        };
        let get = |n: &str| {
            let c = CString::new(n).expect("name");
            // SAFETY: module loaded above.
            unsafe { result::module::get_function(module, c) }.map_err(|e| drv(&format!("function {n}"), e))
        };
        let f_gather = [get("hicache_gather_w16")?, get("hicache_gather_w8")?, get("hicache_gather_w4")?];
        let f_gather_sum = [get("hicache_gather_sum_w16")?, get("hicache_gather_sum_w8")?, get("hicache_gather_sum_w4")?];
        let f_check = get("hicache_check_indices")?;
        let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK;
        // SAFETY: the functions were just resolved from the loaded module.
        let max_threads: Vec<_> =
            [f_gather, f_gather_sum].concat().into_iter().map(|f| unsafe { result::function::get_function_attribute(f, attr) }).collect();
        let max_threads = max_threads
            .iter()
            .map(|r| r.map(|v| v.max(32) as u32))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| drv("cuFuncGetAttribute", e))?;
        let max_threads = max_threads.into_iter().min().unwrap_or(32);
        // HICACHE_CUDA_BATCH=0 forces one cuMemcpyAsync per run (to compare in benchmarks).
        let batch = batch_memcpy_fn(driver).filter(|_| std::env::var("HICACHE_CUDA_BATCH").map_or(true, |v| v != "0"));
        log::info!("cuda: {name} sm_{}{}, driver {driver}, {image}, batched memcpy {}", cc.0, cc.1, batch.is_some());
        let id = super::next_executor_id();
        Ok(CudaExecutor {
            inner: Arc::new(Inner {
                ctx,
                stream,
                module,
                f_gather,
                f_gather_sum,
                f_check,
                name,
                cc,
                driver,
                image,
                batch,
                tuning,
                scratch: Mutex::new(Scratch::default()),
                side: Mutex::new(None),
                engine: Mutex::new(engine),
                reports: Mutex::new(checks::Reports::default()),
                sums: Arc::default(),
                max_threads,
                max_word: std::env::var("HICACHE_CUDA_MAX_WORD")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .filter(|w| [4, 8].contains(w))
                    .unwrap_or(16),
                id,
            }),
        })
    }

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
    pub fn record(&self) -> Result<Completion> {
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
        unsafe { streams::order_raw(engine, target, "ordering a backup after the engine stream") }
    }

    fn record_on(&self, stream: Stream) -> Result<Completion> {
        self.bind()?;
        let raw = self.raw_stream(stream)?;
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| drv("cuEventCreate", e))?;
        // SAFETY: event and stream are live.
        if let Err(e) = unsafe { result::event::record(event, raw) } {
            // SAFETY: created above, never recorded.
            let _ = unsafe { result::event::destroy(event) };
            return Err(drv("cuEventRecord", e));
        }
        Ok(Completion { event, ctx: self.inner.ctx.clone(), sums: self.inner.sums.clone() })
    }

    /// Whether `direct` uses `cuMemcpyBatchAsync` (not on the default streams, which it rejects).
    pub fn batched_memcpy(&self) -> bool {
        self.inner.batch.is_some() && !is_default_stream(self.cu_stream())
    }

    fn bind(&self) -> Result<()> {
        self.inner.ctx.bind_to_thread().map_err(|e| drv("bind", e))
    }

    /// The side stream, made on first use (a non-blocking stream of the executor's context).
    fn side_stream(&self) -> Result<Arc<SideStream>> {
        let mut side = self.inner.side.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = side.as_ref() {
            return Ok(s.clone());
        }
        // cuStreamCreate directly: cudarc's new_stream synchronizes the whole context when it
        // makes a context's first stream (an engine's work included).
        // The context is bound by the caller; the stream is destroyed in `Inner::drop`.
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking).map_err(|e| drv("cuStreamCreate (side stream)", e))?;
        // SAFETY: a live stream of this context, destroyed only after the executor is done with it.
        let stream = unsafe { self.inner.ctx.wrap_borrowed_stream(raw) };
        let s = Arc::new(SideStream { stream, scratch: Mutex::new(Scratch::default()) });
        *side = Some(s.clone());
        Ok(s)
    }

    /// The raw stream of `on` and the scratch whose lock orders its gathers (and their
    /// checksum entries); for the side stream (made on first use) `side` keeps it alive.
    fn stream_scratch<'a>(&'a self, on: Stream, side: &'a mut Option<Arc<SideStream>>) -> Result<(sys::CUstream, &'a Mutex<Scratch>)> {
        if on == Stream::Side {
            *side = Some(self.side_stream()?);
        }
        Ok(match side {
            Some(s) => (s.stream.cu_stream(), &s.scratch),
            None => (self.cu_stream(), &self.inner.scratch),
        })
    }

    /// The raw stream of `stream` (the side stream made on first use).
    fn raw_stream(&self, stream: Stream) -> Result<sys::CUstream> {
        match stream {
            Stream::Main => Ok(self.cu_stream()),
            Stream::Side => Ok(self.side_stream()?.stream.cu_stream()),
        }
    }
}

impl Executor for CudaExecutor {
    type Buffer = CudaBuffer;

    fn name(&self) -> &'static str {
        "cuda"
    }
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
    fn capabilities(&self) -> Capabilities {
        let host = super::cpu::host_memory_bytes();
        Capabilities {
            name: "cuda",
            max_host_pool_bytes: host,
            device_index_lists: true,
            // The summing gathers; DMA copies cannot sum (their items settle as unknown).
            checksums: true,
            direct_checksums: false,
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
                return Err(TransferError::Executor { backend: "cuda", message: format!("cuMemHostGetDevicePointer: {rc:?}") });
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
                return Err(TransferError::Executor { backend: "cuda", message: format!("cuMemcpyAsync: {rc:?}") });
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
    fn completion(&self, stream: Stream) -> Result<super::Completion> {
        self.record_on(stream).map(super::Completion::cuda)
    }
    fn order_after(&self, first: Stream, then: Stream) -> Result<()> {
        self.bind()?;
        if first == then {
            return Ok(());
        }
        let (first, then) = (self.raw_stream(first)?, self.raw_stream(then)?);
        // SAFETY: both streams are live streams of the bound context.
        unsafe { streams::order_raw(first, then, "cuStreamWaitEvent") }
    }
    fn is_busy(&self, stream: Stream) -> bool {
        let raw = match stream {
            Stream::Main => self.cu_stream(),
            Stream::Side => match self.inner.side() {
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
            (StepKind::Copy(runs), Some(mode), Some(b)) => self.copies_unsummed(runs, bufs, stream, mode, b, orphan),
            (StepKind::Copy(runs), _, _) => self.copies(runs, bufs, stream),
        }
    }
}
