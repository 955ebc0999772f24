//! Opening the cuda executor: on a device's primary context with a stream of its own, or on a
//! caller's stream (an engine's), with the kernels loaded and the limits read.

use std::ffi::CString;
use std::sync::{Arc, Mutex};

use cudarc::driver::result;
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaStream};

use super::*;

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
                return Err(super::driver::rc_err("cuMemcpyDtoHAsync", rc));
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
        let Kernels { image, module, f_gather, f_gather_sum, f_check, max_threads } = load_kernels(cc)?;
        // HICACHE_CUDA_BATCH=0 forces one cuMemcpyAsync per run (to compare in benchmarks).
        let batch = batch_memcpy_fn(driver).filter(|_| std::env::var("HICACHE_CUDA_BATCH").map_or(true, |v| v != "0"));
        log::info!("cuda: {name} sm_{}{}, driver {driver}, {image}, batched memcpy {}", cc.0, cc.1, batch.is_some());
        let id = next_executor_id();
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
                backup: Mutex::new(None),
                engine: Mutex::new(engine),
                reports: Mutex::new(checks::Reports::default()),
                tables: Mutex::new(tables::Tables::default()),
                sums: Arc::default(),
                max_threads,
                max_word: std::env::var("HICACHE_CUDA_MAX_WORD")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .filter(|w| [4, 8].contains(w))
                    .unwrap_or(16),
                id,
                auto: AutoSlot::default(),
            }),
        })
    }
}

/// The kernels of a device: their module and the image it was loaded from, the gather
/// functions (16-, 8- and 4-byte words, plain and summing), the index check, and the threads
/// per block every gather function allows.
struct Kernels {
    image: &'static str,
    module: sys::CUmodule,
    f_gather: [sys::CUfunction; 3],
    f_gather_sum: [sys::CUfunction; 3],
    f_check: sys::CUfunction,
    max_threads: u32,
}

/// Loads the kernels for compute capability `cc` (the context bound) and resolves their
/// functions and launch limits.
fn load_kernels(cc: (i32, i32)) -> Result<Kernels> {
    let (image, module) = load_module(cc)?;
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
    Ok(Kernels { image, module, f_gather, f_gather_sum, f_check, max_threads })
}

/// The kernels' module for compute capability `cc` (the context bound), with the name of the
/// image it was loaded from.
fn load_module(cc: (i32, i32)) -> Result<(&'static str, sys::CUmodule)> {
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
    Ok((image, module))
}
