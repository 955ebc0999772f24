//! Which executor runs a call: host arrays on the cpu executor, CUDA arrays on the cuda
//! executor of their device, on the caller's stream.

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use hicache_io::kvcacheio::RawTensor;
use hicache_io::{Device, TransferError};

use std::sync::OnceLock;

use crate::*;

// ---- executors ---------------------------------------------------------------------------

/// One cpu executor for the kvcacheio ops of this process.
pub(crate) fn cpu() -> &'static Device {
    static CPU: OnceLock<Device> = OnceLock::new();
    CPU.get_or_init(Device::cpu)
}

/// Cuda executors kept for reuse (each holds a context, scratch and pinned staging slots).
#[cfg(feature = "cuda")]
pub(crate) const CUDA_EXECUTORS: usize = 8;

/// The cuda executor on (device, stream): the most recently used few are kept, the least
/// recently used one is released (after its streams drain) when another pair needs one, so a
/// process that cycles through streams does not keep an executor per stream forever.
#[cfg(feature = "cuda")]
type CudaCache = std::sync::Mutex<Vec<((i32, u64), Device)>>;

#[cfg(feature = "cuda")]
fn cuda_cache() -> &'static CudaCache {
    static CUDA: OnceLock<CudaCache> = OnceLock::new();
    CUDA.get_or_init(Default::default)
}

/// Forgets the layer tables every cuda executor of this process remembers (the next use of a
/// table reads it again): after rewriting a table in place, or freeing one and making another at
/// the same address.
#[pyfunction]
pub(crate) fn forget_layer_tables() -> PyResult<()> {
    #[cfg(feature = "cuda")]
    for (_, d) in cuda_cache().lock().unwrap_or_else(|e| e.into_inner()).iter() {
        if let Device::Cuda(e) = d {
            e.forget_layer_tables().py()?;
        }
    }
    Ok(())
}

#[cfg(feature = "cuda")]
pub(crate) fn cuda_device(device_id: i32, stream: u64) -> hicache_io::Result<Device> {
    let mut cache = cuda_cache().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = cache.iter().position(|(k, _)| *k == (device_id, stream)) {
        let entry = cache.remove(i);
        let d = entry.1.clone();
        cache.push(entry);
        return Ok(d);
    }
    let ordinal = usize::try_from(device_id).map_err(|_| TransferError::BadArgument {
        arg: "device_index",
        value: device_id as i64,
        message: "a CUDA device ordinal is not negative".into(),
    })?;
    // SAFETY: the stream is the caller's current stream on that device (see kvcacheio.py).
    let exec = unsafe { hicache_io::exec::cuda::CudaExecutor::on_raw_stream(ordinal, stream, Default::default()) }?;
    let d = Device::Cuda(exec);
    if cache.len() == CUDA_EXECUTORS {
        cache.remove(0);
    }
    cache.push(((device_id, stream), d.clone()));
    Ok(d)
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn cuda_device(_device_id: i32, _stream: u64) -> hicache_io::Result<Device> {
    Err(TransferError::Unavailable { backend: "cuda", reason: "this build has no cuda executor".into() })
}

pub(crate) fn cuda(device_id: i32, stream: u64) -> PyResult<Device> {
    cuda_device(device_id, stream).py()
}

/// The values of a 1-D array of 64-bit integers (a layer table or an index list), wherever it
/// lives: a CUDA array is copied on the caller's stream, which this waits for.
#[pyfunction]
#[pyo3(signature = (array, *, stream = None))]
pub(crate) fn host_words(array: &Bound<'_, PyAny>, stream: Option<u64>) -> PyResult<Vec<u64>> {
    let ctx = Ctx { stream };
    let h = view(array, "table", ctx)?;
    if !(h.dtype == (DL_INT, 64) || h.dtype == (DL_UINT, 64)) || h.raw.dims().len() != 1 {
        return Err(PyTypeError::new_err("expected a 1-D int64 or uint64 array"));
    }
    if h.device_type == DL_CUDA {
        return Ok(read_cuda(&h, ctx)?.chunks_exact(8).map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes"))).collect());
    }
    let p = h.raw.addr() as *const u64;
    // SAFETY: `dims[0]` 8-byte values of a live host array (kept by `h`).
    Ok((0..h.raw.dims()[0] as usize).map(|j| unsafe { p.add(j).read_unaligned() }).collect())
}

/// sglang's `get_device_accessible_ptr`: the address kernels on CUDA device `device_index` read
/// host memory at `addr` through (the driver's alias of pinned or registered memory; refused
/// for other host memory). Without a CUDA device (none in this build or on this machine) the
/// host address itself, which is where the cpu executor reads it.
#[pyfunction]
pub(crate) fn device_accessible_ptr(addr: u64, device_index: i32) -> PyResult<u64> {
    match cuda_device(device_index, 1) {
        Err(TransferError::Unavailable { .. }) => Ok(addr),
        Err(e) => Err(py_err(e)),
        #[cfg(feature = "cuda")]
        Ok(Device::Cuda(e)) => e.host_device_pointer(addr).py(),
        Ok(_) => Ok(addr),
    }
}

/// Device bytes of a CUDA index list or layer table, read on the caller's stream.
pub(crate) fn read_cuda(h: &Held, ctx: Ctx) -> PyResult<Vec<u8>> {
    let dev = cuda(h.device_id, ctx.stream.unwrap_or(1))?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(e) = &dev {
        // SAFETY: a live device array of `len` bytes (kept by `h`) on that device.
        return unsafe { e.read_device(h.raw.addr(), h.raw.len()) }.py();
    }
    let _ = dev;
    Err(PyRuntimeError::new_err("cuda: unavailable"))
}

/// The executor for an op's arrays: host arrays run on the cpu executor; CUDA arrays on the
/// cuda executor of their device, on the caller's stream, with any host arrays pinned
/// (checked by the driver when they are wrapped).
pub(crate) fn executor_for(args: &[&Held], ctx: Ctx) -> PyResult<Device> {
    let Some(gpu) = args.iter().find(|h| h.device_type == DL_CUDA) else {
        return Ok(cpu().clone());
    };
    for h in args {
        // Host arrays (DLPack says kDLCPU even for torch's pinned tensors) must be pinned or
        // registered: the cuda executor asks the driver for their device address before anything
        // moves and refuses them otherwise.
        if h.device_type == DL_CUDA && h.device_id != gpu.device_id {
            return Err(PyValueError::new_err(format!("CUDA arrays on devices {} and {}", gpu.device_id, h.device_id)));
        }
    }
    cuda(gpu.device_id, ctx.stream.unwrap_or(1))
}

pub(crate) fn raws(hs: &[Held]) -> Vec<RawTensor> {
    hs.iter().map(|h| h.raw.clone()).collect()
}
/// Waits for the caller's stream on CUDA device `device_id` (and the executor's other streams),
/// then raises the first op since the last report whose CUDA index lists failed their device
/// checks (nothing of that op was copied).
#[pyfunction]
#[pyo3(signature = (device_id = 0, *, stream = None))]
pub(crate) fn synchronize(py: Python<'_>, device_id: i32, stream: Option<u64>) -> PyResult<()> {
    let dev = cuda(device_id, stream.unwrap_or(1))?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(e) = &dev {
        return py.detach(|| e.synchronize()).py();
    }
    let _ = (py, dev);
    Ok(())
}
