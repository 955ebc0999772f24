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
//! - `direct` uses `cuMemcpyBatchAsync` (resolved by ABI version 12.8, in calls of at most 4096
//!   copies; not on the default streams, which it rejects), else one `cuMemcpyAsync` per run.
//!
//! Without libcuda, a driver or a device, [`CudaExecutor::new`] returns `Unavailable`; nothing
//! here panics for a missing CUDA.

use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex};

use cudarc::driver::result;
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaStream, DriverError};

use super::{Bindings, Executor, Stream};
use crate::error::{Result, TransferError};
use crate::plan::{Capabilities, GatherStep, Plan, StepKind};

const PTX_80: &str = include_str!("../../kernels/transfer.compute_80.ptx");
const CUBIN_80: &[u8] = include_bytes!("../../kernels/transfer.sm_80.cubin");
const CUBIN_90: &[u8] = include_bytes!("../../kernels/transfer.sm_90.cubin");

fn drv(what: &str, e: DriverError) -> TransferError {
    TransferError::Executor { backend: "cuda", message: format!("{what}: {e:?}") }
}

fn drv_msg(m: &str) -> TransferError {
    TransferError::Executor { backend: "cuda", message: m.into() }
}

fn unavailable(reason: impl Into<String>) -> TransferError {
    TransferError::Unavailable { backend: "cuda", reason: reason.into() }
}

/// Probes the driver without panicking: library → driver version → device count.
/// Returns the driver version (e.g. 12080) and the device count.
pub fn probe() -> Result<(i32, i32)> {
    // SAFETY: only dlopens the candidate library names.
    if !unsafe { sys::is_culib_present() } {
        return Err(unavailable("libcuda not found (no NVIDIA driver)"));
    }
    let mut version = 0;
    // SAFETY: plain out-parameter call; the library is present.
    let rc = unsafe { sys::cuDriverGetVersion(&mut version) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(unavailable(format!("cuDriverGetVersion: {rc:?}")));
    }
    result::init().map_err(|e| unavailable(format!("cuInit: {e:?} (driver {version})")))?;
    let count = CudaContext::device_count().map_err(|e| unavailable(format!("device count: {e:?}")))?;
    if count == 0 {
        return Err(unavailable(format!("driver {version} sees no device")));
    }
    Ok((version, count))
}

/// `cuMemcpyBatchAsync` with the CUDA 12.8 signature (with `failIdx`).
type BatchFn = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> sys::CUresult;

/// Resolves `cuMemcpyBatchAsync` *by ABI version* (12.8) through `cuGetProcAddress`, so a 13.x
/// driver's renamed `_v2` entry point (a different signature) can never be picked up by name.
/// `None` when the driver is older or does not provide it; nothing here panics for a missing
/// symbol (cudarc's loader would).
fn batch_memcpy_fn(driver_version: i32) -> Option<BatchFn> {
    type GetProcV2 = unsafe extern "C" fn(*const std::ffi::c_char, *mut *mut c_void, i32, u64, *mut i32) -> sys::CUresult;
    type GetProcV1 = unsafe extern "C" fn(*const std::ffi::c_char, *mut *mut c_void, i32, u64) -> sys::CUresult;
    if driver_version < 12080 {
        return None;
    }
    let name = c"cuMemcpyBatchAsync";
    let mut pfn: *mut c_void = std::ptr::null_mut();
    // SAFETY: culib() is only called after is_culib_present() succeeded in `probe`; the symbols'
    // signatures are the driver API's; flags 0 = CU_GET_PROC_ADDRESS_DEFAULT.
    let rc = unsafe {
        let lib = sys::culib();
        if let Ok(f) = lib.get::<GetProcV2>(b"cuGetProcAddress_v2\0") {
            let mut status = 0;
            f(name.as_ptr(), &mut pfn, 12080, 0, &mut status)
        } else if let Ok(f) = lib.get::<GetProcV1>(b"cuGetProcAddress\0") {
            f(name.as_ptr(), &mut pfn, 12080, 0)
        } else {
            return None;
        }
    };
    if rc != sys::CUresult::CUDA_SUCCESS || pfn.is_null() {
        return None;
    }
    // SAFETY: the driver returned the 12.8-ABI entry point for this name.
    Some(unsafe { std::mem::transmute::<*mut c_void, BatchFn>(pfn) })
}

/// Most copies one `cuMemcpyBatchAsync` call carries: drivers have crashed or hung near 52k
/// descriptors per call, and a 61-layer page_first_direct backup has hundreds of thousands.
const BATCH_MAX: usize = 4096;

/// The legacy NULL stream and the per-thread default stream, which `cuMemcpyBatchAsync` rejects.
fn is_default_stream(s: sys::CUstream) -> bool {
    // NULL, CU_STREAM_LEGACY (0x1), CU_STREAM_PER_THREAD (0x2).
    (s as usize) <= 2
}

pub use super::cuda_launch::LaunchTuning;
use super::cuda_launch::{gather_launch, GatherLaunch};

struct Inner {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    module: sys::CUmodule,
    f_w8: sys::CUfunction,
    f_w4: sys::CUfunction,
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
    /// Threads per block both kernel functions allow (their register use decides it).
    max_threads: u32,
    id: u64,
}

// SAFETY: CUDA handles are usable from any thread once the context is bound (we bind before
// every driver call).
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

/// The stream an engine writes its KV on, raw, and the handle that keeps it alive (if any).
struct EngineStream {
    raw: sys::CUstream,
    _keep: Option<Arc<CudaStream>>,
}

// SAFETY: a stream handle, used only with the executor's context bound.
unsafe impl Send for EngineStream {}

/// A second stream of the executor's context, for work that must not queue behind the main
/// stream's; gather steps on it upload through their own scratch.
struct SideStream {
    stream: Arc<CudaStream>,
    scratch: Mutex<Scratch>,
}

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
        // SAFETY: the module was loaded by us and no launch is pending.
        let _ = unsafe { result::module::unload(self.module) };
    }
}

/// The cuda executor: one context and one stream.
#[derive(Clone)]
pub struct CudaExecutor {
    inner: Arc<Inner>,
}

/// Device memory, or pinned mapped host memory with its device pointer.
pub struct CudaBuffer {
    dev_ptr: sys::CUdeviceptr,
    host_ptr: *mut u8,
    len: u64,
    owned: bool,
    /// Host memory we registered with `cuMemHostRegister` (unregistered on drop).
    registered: bool,
    /// Borrowed for one stream-ordered op (`kvcacheio`): the caller keeps the memory alive
    /// until the stream reaches it, as for any op on its stream, so dropping does not wait.
    stream_ordered: bool,
    exec: Arc<Inner>,
}

// SAFETY: raw device/host pointers; access is serialised by the pools' borrow rules and the
// executor's stream.
unsafe impl Send for CudaBuffer {}
unsafe impl Sync for CudaBuffer {}

impl CudaBuffer {
    /// Wraps an engine's device allocation (one layer buffer).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be device memory of `exec`'s context, valid for as long as the buffer
    /// (and any pool holding it) lives, and not written by others while a transfer runs.
    pub unsafe fn from_device_ptr(exec: &CudaExecutor, ptr: sys::CUdeviceptr, len: u64) -> CudaBuffer {
        CudaBuffer {
            dev_ptr: ptr,
            host_ptr: std::ptr::null_mut(),
            len,
            owned: false,
            registered: false,
            stream_ordered: false,
            exec: exec.inner.clone(),
        }
    }

    /// Wraps an engine's host region. With `register`, it is page-locked and mapped here
    /// (`cuMemHostRegister`, undone on drop); otherwise it must already be pinned or registered
    /// with device mapping.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid host memory for as long as the buffer lives, and not
    /// accessed by others while a transfer runs.
    pub unsafe fn from_host_ptr(exec: &CudaExecutor, ptr: *mut u8, len: u64, register: bool) -> Result<CudaBuffer> {
        exec.bind()?;
        unsafe {
            if register {
                let rc = sys::cuMemHostRegister_v2(
                    ptr as *mut c_void,
                    len as usize,
                    sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
                );
                if rc != sys::CUresult::CUDA_SUCCESS {
                    return Err(TransferError::Executor { backend: "cuda", message: format!("cuMemHostRegister({len} bytes): {rc:?}") });
                }
            }
            let mut dev_ptr = 0;
            let rc = sys::cuMemHostGetDevicePointer_v2(&mut dev_ptr, ptr as *mut c_void, 0);
            if rc != sys::CUresult::CUDA_SUCCESS {
                if register {
                    let _ = sys::cuMemHostUnregister(ptr as *mut c_void);
                }
                return Err(TransferError::Executor {
                    backend: "cuda",
                    message: format!("host region is not mapped for the device (register it): {rc:?}"),
                });
            }
            Ok(CudaBuffer {
                dev_ptr,
                host_ptr: ptr,
                len,
                owned: false,
                registered: register,
                stream_ordered: false,
                exec: exec.inner.clone(),
            })
        }
    }

    /// [`CudaBuffer::from_device_ptr`] / [`CudaBuffer::from_host_ptr`] (never registering)
    /// for one stream-ordered `kvcacheio` op: dropping it does not wait for the stream.
    ///
    /// # Safety
    /// As for those, and the memory must stay valid until the executor's stream has run every
    /// copy enqueued on it meanwhile.
    pub(crate) unsafe fn stream_ordered(exec: &CudaExecutor, ptr: u64, len: u64, device_memory: bool) -> Result<CudaBuffer> {
        let mut b = if device_memory {
            unsafe { CudaBuffer::from_device_ptr(exec, ptr, len) }
        } else {
            unsafe { CudaBuffer::from_host_ptr(exec, ptr as *mut u8, len, false)? }
        };
        b.stream_ordered = true;
        Ok(b)
    }

    /// Device address a kernel or copy uses.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.dev_ptr
    }
    /// True for pinned host memory.
    pub fn is_host(&self) -> bool {
        !self.host_ptr.is_null()
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        if self.stream_ordered {
            return;
        }
        if !self.owned {
            // A queued copy may still use the engine's memory: the engine frees it once the
            // pool is dropped, so wait here first.
            let _ = self.exec.ctx.bind_to_thread();
            let _ = self.exec.sync_all();
            if self.registered {
                // SAFETY: registered by `from_host_ptr`.
                let _ = unsafe { sys::cuMemHostUnregister(self.host_ptr as *mut c_void) };
            }
            return;
        }
        let _ = self.exec.ctx.bind_to_thread();
        // Transfers in flight may still use this memory.
        let _ = self.exec.sync_all();
        // SAFETY: allocated by this executor with the matching call.
        unsafe {
            if self.host_ptr.is_null() {
                let _ = result::free_sync(self.dev_ptr);
            } else {
                let _ = result::free_host(self.host_ptr as *mut c_void);
            }
        }
    }
}

/// Completion of everything enqueued before [`CudaExecutor::record`].
pub struct Completion {
    event: sys::CUevent,
    ctx: Arc<CudaContext>,
}

unsafe impl Send for Completion {}

impl Completion {
    /// Blocks until the recorded work is done.
    pub fn wait(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| drv("bind", e))?;
        // SAFETY: event created and recorded by us.
        unsafe { result::event::synchronize(self.event) }.map_err(|e| drv("cuEventSynchronize", e))
    }
    /// Makes `stream` wait for the recorded work on the device, without blocking the host (what
    /// an engine's compute stream does before it reads a layer being loaded).
    pub fn wait_on_stream(&self, stream: &CudaStream) -> Result<()> {
        if **stream.context() != *self.ctx {
            return Err(drv_msg("the stream belongs to another CUDA context than the transfer"));
        }
        // SAFETY: a live stream of this (now bound) context.
        unsafe { self.wait_on_raw_stream(stream.cu_stream()) }
    }
    /// [`Completion::wait_on_stream`] with a raw handle.
    ///
    /// # Safety
    /// `stream` must be a live stream of the transfer's context (or a default-stream handle).
    pub unsafe fn wait_on_raw_stream(&self, stream: sys::CUstream) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| drv("bind", e))?;
        // SAFETY: the caller vouches for the stream; the event is ours and recorded.
        unsafe { result::stream::wait_event(stream, self.event, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .map_err(|e| drv("cuStreamWaitEvent", e))
    }
    /// The recorded event (valid while the completion lives).
    pub fn event(&self) -> sys::CUevent {
        self.event
    }
    /// `Ok(true)` once done, `Ok(false)` while pending, `Err` when the stream failed (a poller
    /// must not spin on a dead context).
    pub fn is_done(&self) -> Result<bool> {
        self.ctx.bind_to_thread().map_err(|e| drv("bind", e))?;
        // SAFETY: as above.
        match unsafe { result::event::query(self.event) } {
            Ok(()) => Ok(true),
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(drv("cuEventQuery", e)),
        }
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: created by us; destroying a pending event is allowed.
        let _ = unsafe { result::event::destroy(self.event) };
    }
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
        self.synchronize()?;
        Ok(out)
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
        let (f_w8, f_w4) = (get("hicache_gather_w8")?, get("hicache_gather_w4")?);
        let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK;
        // SAFETY: both functions were just resolved from the loaded module.
        let max_threads = unsafe { [f_w8, f_w4].map(|f| result::function::get_function_attribute(f, attr)) };
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
                f_w8,
                f_w4,
                name,
                cc,
                driver,
                image,
                batch,
                tuning,
                scratch: Mutex::new(Scratch::default()),
                side: Mutex::new(None),
                engine: Mutex::new(engine),
                max_threads,
                id,
            }),
        })
    }

    /// Waits for everything enqueued on the executor's stream.
    pub fn synchronize(&self) -> Result<()> {
        Executor::synchronize(self)
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
        // SAFETY: live streams of the bound context; the event may be destroyed once the wait
        // is enqueued.
        unsafe {
            let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| drv("cuEventCreate", e))?;
            let r = result::event::record(event, engine)
                .and_then(|_| result::stream::wait_event(target, event, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT));
            let _ = result::event::destroy(event);
            r.map_err(|e| drv("ordering a backup after the engine stream", e))
        }
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
        Ok(Completion { event, ctx: self.inner.ctx.clone() })
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

    /// The raw stream of `stream` (the side stream made on first use).
    fn raw_stream(&self, stream: Stream) -> Result<sys::CUstream> {
        match stream {
            Stream::Main => Ok(self.cu_stream()),
            Stream::Side => Ok(self.side_stream()?.stream.cu_stream()),
        }
    }

    fn gather(&self, g: &GatherStep, bufs: &Bindings<'_, CudaBuffer>, on: Stream) -> Result<()> {
        let side = if on == Stream::Side { Some(self.side_stream()?) } else { None };
        let (stream, scratch) = match &side {
            Some(s) => (s.stream.cu_stream(), &s.scratch),
            None => (self.cu_stream(), &self.inner.scratch),
        };
        let launch = gather_launch(g, |b| bufs.get(b).dev_ptr, self.inner.tuning, self.inner.max_threads)?;
        let mut scratch = scratch.lock().unwrap_or_else(|e| e.into_inner());
        let args = scratch.upload(stream, g, &launch)?;
        let [table, src_idx, dst_idx] = args;
        let mut kernel_args = launch.args(table, src_idx, dst_idx);
        let mut params = kernel_args.params();
        let f = if launch.word == 8 { self.inner.f_w8 } else { self.inner.f_w4 };
        // SAFETY: the arguments match the kernel's signature; the tables live in the scratch
        // area, which later uploads overwrite only in stream order (after this kernel).
        unsafe { result::launch_kernel(f, (launch.blocks, 1, 1), (launch.threads_per_block, 1, 1), 0, stream, &mut params) }
            .map_err(|e| drv("cuLaunchKernel", e))
    }

    fn copies(&self, runs: &[crate::plan::Run], bufs: &Bindings<'_, CudaBuffer>, on: Stream) -> Result<()> {
        let stream = self.raw_stream(on)?;
        let mut dsts: Vec<sys::CUdeviceptr> = runs.iter().map(|r| bufs.get(r.dst).dev_ptr + r.dst_offset).collect();
        let mut srcs: Vec<sys::CUdeviceptr> = runs.iter().map(|r| bufs.get(r.src).dev_ptr + r.src_offset).collect();
        let mut sizes: Vec<usize> = runs.iter().map(|r| r.len as usize).collect();
        let mut done = 0;
        if let Some(batch) = self.inner.batch.filter(|_| runs.len() > 1 && !is_default_stream(stream)) {
            let src_host = runs.first().is_some_and(|r| bufs.get(r.src).is_host());
            let dst_host = runs.first().is_some_and(|r| bufs.get(r.dst).is_host());
            let loc = |host: bool| sys::CUmemLocation {
                type_: if host {
                    sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST
                } else {
                    sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE
                },
                id: if host { 0 } else { self.inner.ctx.ordinal() as i32 },
            };
            let mut attrs = sys::CUmemcpyAttributes {
                srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                srcLocHint: loc(src_host),
                dstLocHint: loc(dst_host),
                flags: 0,
            };
            while done < runs.len() {
                let n = (runs.len() - done).min(BATCH_MAX);
                let mut idx = [0usize];
                let mut fail = usize::MAX;
                // SAFETY: arrays of at least `done + n` entries, live for the call (the driver
                // copies the descriptors); addresses are inside pool allocations (validated plan).
                let rc = unsafe {
                    batch(
                        dsts[done..].as_mut_ptr(),
                        srcs[done..].as_mut_ptr(),
                        sizes[done..].as_mut_ptr(),
                        n,
                        &mut attrs,
                        idx.as_mut_ptr(),
                        1,
                        &mut fail,
                        stream,
                    )
                };
                match rc {
                    sys::CUresult::CUDA_SUCCESS => done += n,
                    // Not for this stream or these memory kinds: one copy per run instead.
                    sys::CUresult::CUDA_ERROR_NOT_SUPPORTED | sys::CUresult::CUDA_ERROR_INVALID_VALUE => {
                        log::debug!("cuMemcpyBatchAsync: {rc:?}; falling back to one copy per run");
                        break;
                    }
                    other => {
                        return Err(TransferError::Executor {
                            backend: "cuda",
                            message: format!("cuMemcpyBatchAsync failed at run {}: {other:?}", done + fail.min(n)),
                        })
                    }
                }
            }
        }
        for i in done..runs.len() {
            // SAFETY: as above; UVA pointers in either direction.
            let rc = unsafe { sys::cuMemcpyAsync(dsts[i], srcs[i], sizes[i], stream) };
            if rc != sys::CUresult::CUDA_SUCCESS {
                return Err(TransferError::Executor { backend: "cuda", message: format!("cuMemcpyAsync (run {i}): {rc:?}") });
            }
        }
        Ok(())
    }
}

/// Staging slots the ring may grow to before an upload waits for the oldest one: enough for the
/// per-layer steps of the largest models in flight at once (61 layers, K and V, drafts) without a
/// host wait; past that, memory stays bounded.
const MAX_STAGING_SLOTS: usize = 512;

/// One pinned staging buffer and the event recorded after the copy out of it.
struct Slot {
    host: *mut u8,
    cap: usize,
    event: sys::CUevent,
    /// A copy out of `host` was enqueued and may not have run yet.
    pending: bool,
}

/// Device scratch for gather steps (index lists and the address-pair table) and the pinned
/// staging slots they are uploaded through. Reused across steps and calls. Nothing here blocks
/// the host on the issue path: a staging slot is reused only once its upload has left it (asked
/// with `cuEventQuery`), and when every slot is busy the ring grows; a device area that is
/// outgrown is kept, not freed (`cuMemFree` would stall every stream), until the executor is
/// dropped. A step whose index lists are the ones already on the device (the steps of a
/// layer-sharded backup share them) uploads only its table. Later uploads overwrite the device
/// area only in stream order, after the kernels that read it.
#[derive(Default)]
struct Scratch {
    dev: sys::CUdeviceptr,
    dev_cap: usize,
    /// Outgrown device areas, still possibly read by queued kernels: freed by `free`.
    retired: Vec<sys::CUdeviceptr>,
    slots: Vec<Slot>,
    next: usize,
    /// The index lists now in `dev`. Holding them keeps their allocations alive, so an equal
    /// pointer always means the same contents. `None` whenever an upload did not complete.
    indices: Option<[Arc<[i64]>; 2]>,
}

// SAFETY: raw driver handles, used only under the executor's mutex with the context bound.
unsafe impl Send for Scratch {}

impl Scratch {
    /// A staging slot whose previous upload has left it: the next free one round-robin, a new one
    /// when all are busy, and (only past `MAX_STAGING_SLOTS`) the oldest once its upload is done.
    ///
    /// # Safety
    /// The context is bound.
    unsafe fn free_slot(&mut self) -> Result<usize> {
        let n = self.slots.len();
        for k in 0..n {
            let i = (self.next + k) % n;
            let slot = &mut self.slots[i];
            if slot.pending {
                // SAFETY: our event.
                match unsafe { result::event::query(slot.event) } {
                    Ok(()) => slot.pending = false,
                    Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => continue,
                    Err(e) => return Err(drv("cuEventQuery (staging slot)", e)),
                }
            }
            self.next = (i + 1) % n;
            return Ok(i);
        }
        if n < MAX_STAGING_SLOTS {
            let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| drv("cuEventCreate", e))?;
            self.slots.push(Slot { host: std::ptr::null_mut(), cap: 0, event, pending: false });
            self.next = 0;
            return Ok(n);
        }
        let i = self.next;
        log::debug!("cuda: all {n} staging slots busy; waiting for the oldest");
        // SAFETY: our event.
        unsafe { result::event::synchronize(self.slots[i].event) }.map_err(|e| drv("cuEventSynchronize", e))?;
        self.slots[i].pending = false;
        self.next = (i + 1) % n;
        Ok(i)
    }

    /// Uploads what gather step `g` needs; returns the device addresses of the address-pair
    /// table, the source indices and the destination indices.
    fn upload(&mut self, stream: sys::CUstream, g: &GatherStep, launch: &GatherLaunch) -> Result<[sys::CUdeviceptr; 3]> {
        let n = g.src_indices().len();
        let index_bytes = n * 8;
        let table_bytes = std::mem::size_of_val(launch.table.as_slice());
        // Device layout: [src indices][dst indices][table], each 256-byte aligned.
        let align = |x: usize| x.next_multiple_of(256);
        let (si_off, di_off, t_off) = (0, align(index_bytes), 2 * align(index_bytes));
        let dev_need = t_off + align(table_bytes);
        let reuse = self.dev_cap >= dev_need
            && self.indices.as_ref().is_some_and(|[s, d]| Arc::ptr_eq(s, &g.src_indices) && Arc::ptr_eq(d, &g.dst_indices));
        // Until this upload is enqueued and recorded, the device area holds nothing reusable.
        self.indices = None;
        let stage_bytes = if reuse { table_bytes } else { t_off + table_bytes };
        // SAFETY: all driver calls on live handles with the context bound by the caller.
        unsafe {
            if self.dev_cap < dev_need {
                // Queued kernels may still read the old area: keep it until `free`.
                let cap = dev_need.next_power_of_two().max(64 << 10);
                let dev = result::malloc_sync(cap).map_err(|e| TransferError::OutOfMemory {
                    what: "cuda gather scratch".into(),
                    requested: cap as u64,
                    limit: format!("cuMemAlloc: {e:?}"),
                })?;
                if self.dev != 0 {
                    self.retired.push(self.dev);
                }
                self.dev = dev;
                self.dev_cap = cap;
            }
            let i = self.free_slot()?;
            let slot = &mut self.slots[i];
            if slot.cap < stage_bytes {
                if !slot.host.is_null() {
                    // Idle (its upload has left it): freeing pinned memory waits for nothing.
                    let _ = result::free_host(slot.host as *mut c_void);
                    slot.host = std::ptr::null_mut();
                    slot.cap = 0;
                }
                let cap = stage_bytes.next_power_of_two().max(4096);
                slot.host = result::malloc_host(cap, 0).map_err(|e| TransferError::OutOfMemory {
                    what: "cuda pinned staging".into(),
                    requested: cap as u64,
                    limit: format!("cuMemHostAlloc: {e:?}"),
                })? as *mut u8;
                slot.cap = cap;
            }
            let table_src = launch.table.as_ptr() as *const u8;
            let dst = if reuse {
                std::ptr::copy_nonoverlapping(table_src, slot.host, table_bytes);
                self.dev + t_off as u64
            } else {
                std::ptr::copy_nonoverlapping(g.src_indices().as_ptr() as *const u8, slot.host.add(si_off), index_bytes);
                std::ptr::copy_nonoverlapping(g.dst_indices().as_ptr() as *const u8, slot.host.add(di_off), index_bytes);
                std::ptr::copy_nonoverlapping(table_src, slot.host.add(t_off), table_bytes);
                self.dev
            };
            let rc = sys::cuMemcpyHtoDAsync_v2(dst, slot.host as *const c_void, stage_bytes, stream);
            if rc != sys::CUresult::CUDA_SUCCESS {
                return Err(TransferError::Executor { backend: "cuda", message: format!("cuMemcpyHtoDAsync (gather tables): {rc:?}") });
            }
            slot.pending = true;
            if let Err(e) = result::event::record(slot.event, stream) {
                // Without the event the slot's reuse cannot be ordered: drain the stream.
                let _ = result::stream::synchronize(stream);
                slot.pending = false;
                return Err(drv("cuEventRecord", e));
            }
        }
        self.indices = Some([g.src_indices.clone(), g.dst_indices.clone()]);
        Ok([self.dev + t_off as u64, self.dev + si_off as u64, self.dev + di_off as u64])
    }

    /// Frees everything (the stream has been synchronized).
    fn free(&mut self) {
        // SAFETY: handles allocated by `upload`; nothing queued uses them any more.
        unsafe {
            for dev in self.retired.drain(..).chain((self.dev != 0).then_some(self.dev)) {
                let _ = result::free_sync(dev);
            }
            for slot in &mut self.slots {
                if !slot.host.is_null() {
                    let _ = result::free_host(slot.host as *mut c_void);
                }
                let _ = result::event::destroy(slot.event);
            }
        }
        *self = Scratch::default();
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
            "{} (sm_{}{}, driver {}.{}, kernels: {}, batched memcpy: {}, grid {}×{} warps)",
            i.name,
            i.cc.0,
            i.cc.1,
            i.driver / 1000,
            (i.driver % 1000) / 10,
            i.image,
            if self.batched_memcpy() { "yes" } else { "no" },
            i.tuning.block_quota,
            i.tuning.num_warps_per_block
        )
    }
    fn capabilities(&self) -> Capabilities {
        let host = super::cpu::host_memory_bytes();
        Capabilities { name: "cuda", max_host_pool_bytes: host, ..Capabilities::UNLIMITED }
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
        self.synchronize()?;
        if buf.is_host() {
            // SAFETY: span checked by `Device::write`; no transfer in flight after the sync.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf.host_ptr.add(offset as usize), data.len()) };
            Ok(())
        } else {
            // On the executor's stream, then waited: a pageable copy on the legacy stream may
            // return before its DMA lands and is not ordered against our stream.
            // SAFETY: span checked; `data` outlives the synchronize below.
            unsafe { result::memcpy_htod_async(buf.dev_ptr + offset, data, self.cu_stream()) }.map_err(|e| drv("cuMemcpyHtoDAsync", e))?;
            self.synchronize()
        }
    }
    fn read(&self, buf: &CudaBuffer, offset: u64, out: &mut [u8]) -> Result<()> {
        self.synchronize()?;
        if buf.is_host() {
            // SAFETY: span checked; transfers finished.
            unsafe { std::ptr::copy_nonoverlapping(buf.host_ptr.add(offset as usize), out.as_mut_ptr(), out.len()) };
            Ok(())
        } else {
            // SAFETY: span checked; `out` outlives the synchronize below.
            unsafe { result::memcpy_dtoh_async(out, buf.dev_ptr + offset, self.cu_stream()) }.map_err(|e| drv("cuMemcpyDtoHAsync", e))?;
            self.synchronize()
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
            self.synchronize()
        })
    }
    fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.inner.sync_all().map_err(|e| drv("cuStreamSynchronize", e))
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
        // SAFETY: both streams are live streams of the bound context; the event may be destroyed
        // right after the wait is enqueued (the wait keeps what it needs).
        unsafe {
            let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| drv("cuEventCreate", e))?;
            let r = result::event::record(event, first)
                .and_then(|_| result::stream::wait_event(then, event, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT));
            let _ = result::event::destroy(event);
            r.map_err(|e| drv("cuStreamWaitEvent", e))
        }
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
    fn execute_step(&self, plan: &Plan, k: usize, bufs: &Bindings<'_, CudaBuffer>, _enqueue: bool, stream: Stream) -> Result<()> {
        self.bind()?;
        if k == 0 && plan.direction() == crate::plan::Direction::DeviceToHost {
            self.order_after_engine(stream)?;
        }
        match plan.steps()[k].kind() {
            StepKind::Gather(g) => self.gather(g, bufs, stream),
            StepKind::Copy(runs) => self.copies(runs, bufs, stream),
        }
    }
}
