//! `hicache_io._native`: the Python bindings. Arrays arrive through DLPack (`__dlpack__`), or
//! numpy's `__array_interface__` for read-only sources; errors become the exception classes
//! sglang raises for the same condition, with its message text; transfers release the GIL.

#![allow(clippy::too_many_arguments)] // sglang's signatures

use std::ffi::c_void;
use std::sync::OnceLock;

use hicache_io::kvcacheio::{self as kv, Memory, RawTensor};
use hicache_io::{Device, DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, LayerMap, Profile, TransferError};
use pyo3::exceptions::{PyIndexError, PyMemoryError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

// ---- errors ------------------------------------------------------------------------------

pyo3::create_exception!(
    _native,
    IntegrityError,
    PyRuntimeError,
    "A load read host items whose bytes do not match the checksums their backups recorded; the \
     call's other items landed. `items`: `(layer, component, host_index, device_index, expected, \
     found)` per failed item."
);

/// sglang's pools raise `ValueError`; sgl-kernel's `TORCH_CHECK`s raise `RuntimeError`.
fn py_err(e: TransferError) -> PyErr {
    use TransferError as E;
    let msg = e.to_string();
    if let E::Integrity { items, .. } = &e {
        let items: Vec<(u64, u8, u64, u64, u64, u64)> =
            items.iter().map(|m| (m.layer, m.component, m.host_index, m.device_index, m.expected, m.found)).collect();
        let err = IntegrityError::new_err(msg);
        Python::attach(|py| {
            let _ = err.value(py).setattr("items", items);
        });
        return err;
    }
    match e {
        E::LengthMismatch { .. }
        | E::ItemNotWordAligned { .. }
        | E::PageSizeNotPositive
        | E::DirectCountNotPageMultiple { .. }
        | E::NumLayersMismatch { .. }
        | E::LayerListMismatch { .. }
        | E::Unavailable { .. }
        | E::Executor { .. }
        | E::Partial { .. }
        | E::BadArgument { .. } => PyRuntimeError::new_err(msg),
        E::IndexOutOfRange { .. } | E::LayerOutOfRange { .. } | E::LayerNotLoaded { .. } | E::NoSuchBuffer { .. } => {
            PyIndexError::new_err(msg)
        }
        E::DeviceIndexCheck { source, .. } if matches!(*source, E::IndexOutOfRange { .. }) => PyIndexError::new_err(msg),
        E::OutOfMemory { .. } => PyMemoryError::new_err(msg),
        _ => PyValueError::new_err(msg),
    }
}

trait IntoPy<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for hicache_io::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(py_err)
    }
}

// ---- DLPack ------------------------------------------------------------------------------

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// DLPack ≥ 1.0's `DLManagedTensorVersioned` (capsule `dltensor_versioned`), which can say
/// read-only.
#[repr(C)]
struct DlManagedTensorVersioned {
    version: [u32; 2],
    manager_ctx: *mut c_void,
    deleter: *mut c_void,
    flags: u64,
    dl_tensor: DlTensor,
}

const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
const DL_CUDA_HOST: i32 = 3;
const DL_INT: u8 = 0;
const DL_UINT: u8 = 1;
const DL_FLAG_READ_ONLY: u64 = 1;

/// An array argument, kept alive (its capsule or the array) while an op runs.
struct Held {
    raw: RawTensor,
    /// DLPack type code and bits per element.
    dtype: (u8, u8),
    device_type: i32,
    device_id: i32,
    writable: bool,
    _keep: Py<PyAny>,
}

impl Held {
    fn is_int64(&self) -> bool {
        self.dtype == (DL_INT, 64)
    }
    fn on_host(&self) -> bool {
        self.device_type == DL_CPU || self.device_type == DL_CUDA_HOST
    }
}

/// The stream a CUDA array is handed over on: the executor's (the caller's current stream).
#[derive(Clone, Copy)]
struct Ctx {
    stream: Option<u64>,
}

/// Reads an array through DLPack (versioned first, so read-only arrays say so), or numpy's
/// `__array_interface__` where DLPack is refused (e.g. non-native byte order).
fn view(obj: &Bound<'_, PyAny>, name: &str, ctx: Ctx) -> PyResult<Held> {
    let py = obj.py();
    if obj.hasattr("__dlpack__")? {
        let device: Option<(i32, i32)> = obj.call_method0("__dlpack_device__").ok().and_then(|d| d.extract().ok());
        let kw = pyo3::types::PyDict::new(py);
        kw.set_item("max_version", (1, 0))?;
        if matches!(device, Some((DL_CUDA, _))) {
            // DLPack: the consumer's stream; the producer orders its pending work before it.
            kw.set_item("stream", ctx.stream.unwrap_or(1))?;
        }
        let cap = match obj.call_method("__dlpack__", (), Some(&kw)) {
            Ok(c) => Ok(c),
            // Producers older than DLPack 1.0 take no max_version.
            Err(e) if e.is_instance_of::<PyTypeError>(py) => {
                kw.del_item("max_version")?;
                obj.call_method("__dlpack__", (), Some(&kw))
            }
            Err(e) => Err(e),
        };
        match cap {
            Ok(cap) => return from_capsule(&cap, name),
            Err(e) if !obj.hasattr("__array_interface__")? => {
                return Err(PyTypeError::new_err(format!("{name}: DLPack export failed ({e})")))
            }
            Err(_) => {}
        }
    }
    match obj.getattr("__array_interface__") {
        Ok(ai) => from_array_interface(obj, &ai, name),
        Err(_) => Err(PyTypeError::new_err(format!("{name}: expected an array that speaks DLPack"))),
    }
}

fn from_capsule(cap: &Bound<'_, PyAny>, name: &str) -> PyResult<Held> {
    // SAFETY: the capsule's name says which DLPack struct it holds; the capsule (kept in
    // `Held`) keeps it alive and frees it when collected, since it is never renamed `used_*`.
    let (t, flags) = unsafe {
        let cname = pyo3::ffi::PyCapsule_GetName(cap.as_ptr());
        if cname.is_null() {
            return Err(PyErr::take(cap.py()).unwrap_or_else(|| PyTypeError::new_err(format!("{name}: not a DLPack capsule"))));
        }
        let versioned = std::ffi::CStr::from_ptr(cname) == c"dltensor_versioned";
        let p = pyo3::ffi::PyCapsule_GetPointer(cap.as_ptr(), cname);
        if p.is_null() {
            return Err(PyErr::take(cap.py()).unwrap_or_else(|| PyTypeError::new_err(format!("{name}: empty DLPack capsule"))));
        }
        if versioned {
            let m = &*(p as *const DlManagedTensorVersioned);
            if m.version[0] != 1 {
                return Err(PyTypeError::new_err(format!("{name}: DLPack {}.{} is not supported", m.version[0], m.version[1])));
            }
            (&m.dl_tensor, m.flags)
        } else {
            // DLManagedTensor starts with its DLTensor.
            (&*(p as *const DlTensor), 0)
        }
    };
    let ndim = usize::try_from(t.ndim).map_err(|_| PyValueError::new_err(format!("{name}: negative ndim")))?;
    // SAFETY: DLPack gives `ndim` shape entries and, when non-null, `ndim` strides.
    let shape: Vec<i64> = if ndim == 0 { vec![] } else { unsafe { std::slice::from_raw_parts(t.shape, ndim) }.to_vec() };
    let strides: Option<Vec<i64>> =
        if t.strides.is_null() || ndim == 0 { None } else { Some(unsafe { std::slice::from_raw_parts(t.strides, ndim) }.to_vec()) };
    let bits = t.dtype.bits as u64 * t.dtype.lanes as u64;
    if bits == 0 || !bits.is_multiple_of(8) {
        return Err(PyValueError::new_err(format!("{name}: {bits}-bit elements are not whole bytes")));
    }
    let addr = (t.data as u64).checked_add(t.byte_offset).ok_or_else(|| PyValueError::new_err(format!("{name}: address overflows")))?;
    let memory = match t.device.device_type {
        DL_CPU | DL_CUDA_HOST => Memory::Host,
        DL_CUDA => Memory::CudaDevice,
        other => return Err(PyValueError::new_err(format!("{name}: DLPack device type {other} is not host or CUDA memory"))),
    };
    let raw = described(name, addr, &shape, strides.as_deref(), bits / 8, memory)?;
    Ok(Held {
        raw,
        dtype: (t.dtype.code, t.dtype.bits),
        device_type: t.device.device_type,
        device_id: t.device.device_id,
        writable: flags & DL_FLAG_READ_ONLY == 0,
        _keep: cap.clone().unbind(),
    })
}

/// numpy's `__array_interface__` (strides in bytes; native byte order only).
fn from_array_interface(obj: &Bound<'_, PyAny>, ai: &Bound<'_, PyAny>, name: &str) -> PyResult<Held> {
    let (ptr, readonly): (u64, bool) = ai.get_item("data")?.extract()?;
    let shape: Vec<i64> = ai.get_item("shape")?.extract()?;
    let strides: Option<Vec<i64>> = ai.get_item("strides").ok().map(|s| s.extract()).transpose()?.flatten();
    let typestr: String = ai.get_item("typestr")?.extract()?;
    let order = typestr.chars().next().unwrap_or('?');
    let foreign = if cfg!(target_endian = "little") { '>' } else { '<' };
    let kind = typestr.chars().nth(1).unwrap_or('?');
    let size: u64 = typestr
        .get(2..)
        .and_then(|s| s.parse().ok())
        .filter(|&s| s > 0)
        .ok_or_else(|| PyTypeError::new_err(format!("{name}: dtype {typestr}")))?;
    if order == foreign && size > 1 {
        return Err(PyValueError::new_err(format!("{name}: byte order {typestr} is not this machine's")));
    }
    let strides = match strides {
        Some(st) => {
            if st.iter().any(|&b| b % size as i64 != 0) {
                return Err(PyValueError::new_err(format!("{name}: strides {st:?} are not whole elements")));
            }
            Some(st.iter().map(|&b| b / size as i64).collect::<Vec<_>>())
        }
        None => None,
    };
    let code = match kind {
        'i' => DL_INT,
        'u' => DL_UINT,
        'f' => 2,
        _ => 255,
    };
    let raw = described(name, ptr, &shape, strides.as_deref(), size, Memory::Host)?;
    Ok(Held {
        raw,
        dtype: (code, (size * 8).min(255) as u8),
        device_type: DL_CPU,
        device_id: 0,
        writable: !readonly,
        _keep: obj.clone().unbind(),
    })
}

/// A contiguous tensor's byte span (strides in elements; only C order, dimensions of extent 1
/// may have any stride).
fn described(name: &str, addr: u64, shape: &[i64], strides: Option<&[i64]>, elem: u64, memory: Memory) -> PyResult<RawTensor> {
    let dims: Vec<u64> = shape
        .iter()
        .map(|&d| u64::try_from(d))
        .collect::<Result<_, _>>()
        .map_err(|_| PyValueError::new_err(format!("{name}: negative extent")))?;
    let count =
        dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).ok_or_else(|| PyValueError::new_err(format!("{name}: size overflows")))?;
    // An empty array has no element to misplace (numpy exports its strides as 0).
    if let Some(strides) = strides.filter(|_| count > 0) {
        if strides.len() != shape.len() {
            return Err(PyValueError::new_err(format!("{name}: {} strides for {} dimensions", strides.len(), shape.len())));
        }
        let mut want = 1i64;
        for (i, &d) in shape.iter().enumerate().rev() {
            if d != 1 && strides[i] != want {
                return Err(PyValueError::new_err(format!(
                    "{name}: must be contiguous (C order), got strides {strides:?} for shape {shape:?}"
                )));
            }
            want = want.saturating_mul(d);
        }
    }
    let len = count.checked_mul(elem).ok_or_else(|| PyValueError::new_err(format!("{name}: size overflows")))?;
    // SAFETY: the span is the array's own memory, kept alive by `Held` for the op; the ops
    // refuse destinations that overlap another argument.
    Ok(unsafe { RawTensor::new(addr, len, dims, memory) })
}

/// A destination array: writable.
fn dst_view(obj: &Bound<'_, PyAny>, name: &str, ctx: Ctx) -> PyResult<Held> {
    let h = view(obj, name, ctx)?;
    if !h.writable {
        return Err(PyValueError::new_err(format!("{name}: destination array is read-only")));
    }
    Ok(h)
}

/// An index argument: host values, or an int64 CUDA array left where it is (the `kernel` ops
/// check such lists on the device, without waiting for the stream).
enum Idx {
    Host(Vec<i64>),
    Cuda(Held),
}

impl Idx {
    /// The list as the ops take it.
    fn indices(&self) -> kv::Indices<'_> {
        match self {
            Idx::Host(v) => kv::Indices::Host(v),
            // SAFETY: a live int64 CUDA array of that many entries (kept by the `Held`), used by
            // an op enqueued on the caller's stream, like every CUDA argument.
            Idx::Cuda(h) => kv::Indices::Cuda(unsafe { kv::CudaIndices::new(h.raw.addr(), (h.raw.len() / 8) as usize) }),
        }
    }
    /// Host values: a CUDA array is copied on the caller's stream, which this waits for.
    fn into_host(self, ctx: Ctx) -> PyResult<Vec<i64>> {
        match self {
            Idx::Host(v) => Ok(v),
            Idx::Cuda(h) => Ok(read_cuda(&h, ctx)?.chunks_exact(8).map(|c| i64::from_ne_bytes(c.try_into().expect("8 bytes"))).collect()),
        }
    }
}

/// Index list: an int64 array (sglang's type check and message), or a sequence of ints.
fn index_arg(obj: &Bound<'_, PyAny>, side: &str, ctx: Ctx) -> PyResult<Idx> {
    if obj.hasattr("__dlpack__")? || obj.hasattr("__array_interface__")? {
        let h = view(obj, &format!("{} indices", side.to_lowercase()), ctx)?;
        if !h.is_int64() {
            return Err(PyRuntimeError::new_err(format!("{side} indices must be of type long")));
        }
        if h.device_type == DL_CUDA {
            return Ok(Idx::Cuda(h));
        }
        let n = (h.raw.len() / 8) as usize;
        // SAFETY: `n` int64 values of a live host array (kept by `h`); read unaligned in case a
        // view starts off an 8-byte boundary.
        let p = h.raw.addr() as *const i64;
        return Ok(Idx::Host((0..n).map(|i| unsafe { p.add(i).read_unaligned() }).collect()));
    }
    obj.extract::<Vec<i64>>()
        .map(Idx::Host)
        .map_err(|_| PyTypeError::new_err(format!("{side} indices must be an int64 array or a sequence of ints")))
}

/// Host index values (a CUDA index array is copied on the executor's stream, which waits for
/// it: the `direct` ops and layer tables need the values on the host, as in sgl-kernel).
fn index_list(obj: &Bound<'_, PyAny>, side: &str, ctx: Ctx) -> PyResult<Vec<i64>> {
    index_arg(obj, side, ctx)?.into_host(ctx)
}

/// The index lists of a `kernel` op, placed for the executor of `args`: CUDA lists stay on the
/// device when both are CUDA arrays on the data's device (checked there); a CUDA list on another
/// device than the data is refused; otherwise the values come to the host.
fn place(si: Idx, di: Idx, args: &[&Held], ctx: Ctx) -> PyResult<(Idx, Idx)> {
    let gpu = args.iter().find(|h| h.device_type == DL_CUDA).map(|h| h.device_id);
    if let Some(g) = gpu {
        for (side, idx) in [("source", &si), ("destination", &di)] {
            if let Idx::Cuda(h) = idx {
                if h.device_id != g {
                    return Err(PyValueError::new_err(format!(
                        "{side} indices are on CUDA device {}, the data on device {g}",
                        h.device_id
                    )));
                }
            }
        }
        if matches!((&si, &di), (Idx::Cuda(_), Idx::Cuda(_))) {
            return Ok((si, di));
        }
    }
    Ok((Idx::Host(si.into_host(ctx)?), Idx::Host(di.into_host(ctx)?)))
}

/// Runs `f` with sglang's per-call launch arguments, when given, on the cuda executor.
fn tuned<R>(block_quota: Option<i64>, num_warps_per_block: Option<i64>, f: impl FnOnce() -> R) -> R {
    #[cfg(feature = "cuda")]
    if block_quota.is_some() || num_warps_per_block.is_some() {
        use hicache_io::exec::cuda::{with_call_tuning, LaunchTuning};
        let base = LaunchTuning::default();
        let t = LaunchTuning::from_args(
            block_quota.unwrap_or(base.block_quota as i64),
            num_warps_per_block.unwrap_or(base.num_warps_per_block as i64),
        );
        return with_call_tuning(t, f);
    }
    let _ = (block_quota, num_warps_per_block);
    f()
}

/// Whether a layer argument is a list of arrays (not a table of addresses).
fn is_list(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>()
}

/// A layer argument: a list of arrays (every index bounds-checked), or sglang's table of layer
/// base addresses (a 1-D int64/uint64 array), trusted like sglang: each layer's extent is what
/// the largest index needs (`extent` bytes). A table on the GPU holds device addresses.
fn layers(obj: &Bound<'_, PyAny>, name: &str, writes: bool, extent: u64, ctx: Ctx) -> PyResult<Vec<Held>> {
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        return obj
            .try_iter()?
            .enumerate()
            .map(|(j, x)| {
                let n = format!("{name}[{j}]");
                if writes {
                    dst_view(&x?, &n, ctx)
                } else {
                    view(&x?, &n, ctx)
                }
            })
            .collect();
    }
    let table = view(obj, name, ctx)?;
    if !(table.dtype == (DL_INT, 64) || table.dtype == (DL_UINT, 64)) || table.raw.dims().len() != 1 {
        return Err(PyTypeError::new_err(format!("{name}: expected a list of arrays or a 1-D int64 or uint64 table of layer addresses")));
    }
    let entries: Vec<u64> = if table.device_type == DL_CUDA {
        read_cuda(&table, ctx)?.chunks_exact(8).map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes"))).collect()
    } else {
        let p = table.raw.addr() as *const u64;
        // SAFETY: entries of a live host table.
        (0..table.raw.dims()[0] as usize).map(|j| unsafe { p.add(j).read_unaligned() }).collect()
    };
    let (memory, device_type) = if table.device_type == DL_CUDA { (Memory::CudaDevice, DL_CUDA) } else { (Memory::Host, DL_CPU) };
    entries
        .into_iter()
        .map(|addr| {
            // SAFETY: sglang's contract for layer tables: the caller vouches for each layer.
            let raw = unsafe { RawTensor::new(addr, extent, vec![], memory) };
            Ok(Held { raw, dtype: (DL_UINT, 8), device_type, device_id: table.device_id, writable: true, _keep: obj.clone().unbind() })
        })
        .collect()
}

/// Bytes a pointer-table layer must hold for `idx` items of `item` bytes.
fn extent_for(idx: &[i64], item: i64) -> u64 {
    let top = idx.iter().copied().filter(|&i| i >= 0).max().map_or(1, |m| m as u64 + 1);
    top.saturating_mul(item.max(1) as u64)
}

/// Bytes of any bytes-like object or host array.
fn data_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u8>> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    let h = view(obj, name, Ctx { stream: None })?;
    if !h.on_host() {
        return Err(PyValueError::new_err(format!("{name}: pass host memory")));
    }
    if h.raw.is_empty() {
        return Ok(vec![]);
    }
    // SAFETY: a live host array of `len` bytes (kept by `h`).
    Ok(unsafe { std::slice::from_raw_parts(h.raw.addr() as *const u8, h.raw.len() as usize) }.to_vec())
}

// ---- executors ---------------------------------------------------------------------------

/// One cpu executor for the kvcacheio ops of this process.
fn cpu() -> &'static Device {
    static CPU: OnceLock<Device> = OnceLock::new();
    CPU.get_or_init(Device::cpu)
}

/// Cuda executors kept for reuse (each holds a context, scratch and pinned staging slots).
#[cfg(feature = "cuda")]
const CUDA_EXECUTORS: usize = 8;

/// The cuda executor on (device, stream): the most recently used few are kept, the least
/// recently used one is released (after its streams drain) when another pair needs one, so a
/// process that cycles through streams does not keep an executor per stream forever.
#[cfg(feature = "cuda")]
fn cuda_device(device_id: i32, stream: u64) -> hicache_io::Result<Device> {
    use std::sync::Mutex;
    type Cache = Vec<((i32, u64), Device)>;
    static CUDA: OnceLock<Mutex<Cache>> = OnceLock::new();
    let mut cache = CUDA.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
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
fn cuda_device(_device_id: i32, _stream: u64) -> hicache_io::Result<Device> {
    Err(TransferError::Unavailable { backend: "cuda", reason: "this build has no cuda executor".into() })
}

fn cuda(device_id: i32, stream: u64) -> PyResult<Device> {
    cuda_device(device_id, stream).py()
}

/// The values of a 1-D array of 64-bit integers (a layer table or an index list), wherever it
/// lives: a CUDA array is copied on the caller's stream, which this waits for.
#[pyfunction]
#[pyo3(signature = (array, *, stream = None))]
fn host_words(array: &Bound<'_, PyAny>, stream: Option<u64>) -> PyResult<Vec<u64>> {
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
fn device_accessible_ptr(addr: u64, device_index: i32) -> PyResult<u64> {
    match cuda_device(device_index, 1) {
        Err(TransferError::Unavailable { .. }) => Ok(addr),
        Err(e) => Err(py_err(e)),
        #[cfg(feature = "cuda")]
        Ok(Device::Cuda(e)) => e.host_device_pointer(addr).py(),
        Ok(_) => Ok(addr),
    }
}

/// Device bytes of a CUDA index list or layer table, read on the caller's stream.
fn read_cuda(h: &Held, ctx: Ctx) -> PyResult<Vec<u8>> {
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
fn executor_for(args: &[&Held], ctx: Ctx) -> PyResult<Device> {
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

fn raws(hs: &[Held]) -> Vec<RawTensor> {
    hs.iter().map(|h| h.raw.clone()).collect()
}

// ---- kvcacheio ---------------------------------------------------------------------------

/// Source and destination index lists, read in sgl-kernel's order, as host values.
fn index_pair(src: &Bound<'_, PyAny>, dst: &Bound<'_, PyAny>, ctx: Ctx) -> PyResult<(Vec<i64>, Vec<i64>)> {
    Ok((index_list(src, "Source", ctx)?, index_list(dst, "Destination", ctx)?))
}

/// [`index_pair`] with CUDA arrays left on their device (see [`place`]).
fn index_args(src: &Bound<'_, PyAny>, dst: &Bound<'_, PyAny>, ctx: Ctx) -> PyResult<(Idx, Idx)> {
    Ok((index_arg(src, "Source", ctx)?, index_arg(dst, "Destination", ctx)?))
}

/// An op over K and V arrays (`src_k, dst_k, src_v, dst_v`), the index lists and integers.
macro_rules! kv_pair_op {
    ($name:ident($($int:ident),+)) => {
        #[pyfunction]
        #[pyo3(signature = (src_k, dst_k, src_v, dst_v, src_indices, dst_indices, $($int),+, *, stream = None, block_quota = None, num_warps_per_block = None))]
        fn $name(
            py: Python<'_>,
            src_k: &Bound<'_, PyAny>,
            dst_k: &Bound<'_, PyAny>,
            src_v: &Bound<'_, PyAny>,
            dst_v: &Bound<'_, PyAny>,
            src_indices: &Bound<'_, PyAny>,
            dst_indices: &Bound<'_, PyAny>,
            $($int: i64,)+
            stream: Option<u64>,
            block_quota: Option<i64>,
            num_warps_per_block: Option<i64>,
        ) -> PyResult<()> {
            let ctx = Ctx { stream };
            let (si, di) = index_args(src_indices, dst_indices, ctx)?;
            let (sk, dk) = (view(src_k, "src_k", ctx)?, dst_view(dst_k, "dst_k", ctx)?);
            let (sv, dv) = (view(src_v, "src_v", ctx)?, dst_view(dst_v, "dst_v", ctx)?);
            let dev = executor_for(&[&sk, &dk, &sv, &dv], ctx)?;
            let (si, di) = place(si, di, &[&sk, &dk, &sv, &dv], ctx)?;
            let (si, di) = (si.indices(), di.indices());
            py.detach(|| tuned(block_quota, num_warps_per_block, || kv::$name(&dev, &sk.raw, &dk.raw, &sv.raw, &dv.raw, si, di, $($int),+))).py()
        }
    };
}

/// An op over one source and one destination array (MLA, the DSA indexer).
macro_rules! kv_one_op {
    ($name:ident($($int:ident),+)) => {
        #[pyfunction]
        #[pyo3(signature = (src, dst, src_indices, dst_indices, $($int),+, *, stream = None, block_quota = None, num_warps_per_block = None))]
        fn $name(
            py: Python<'_>,
            src: &Bound<'_, PyAny>,
            dst: &Bound<'_, PyAny>,
            src_indices: &Bound<'_, PyAny>,
            dst_indices: &Bound<'_, PyAny>,
            $($int: i64,)+
            stream: Option<u64>,
            block_quota: Option<i64>,
            num_warps_per_block: Option<i64>,
        ) -> PyResult<()> {
            let ctx = Ctx { stream };
            let (si, di) = index_args(src_indices, dst_indices, ctx)?;
            let (s, d) = (view(src, "src", ctx)?, dst_view(dst, "dst", ctx)?);
            let dev = executor_for(&[&s, &d], ctx)?;
            let (si, di) = place(si, di, &[&s, &d], ctx)?;
            let (si, di) = (si.indices(), di.indices());
            py.detach(|| tuned(block_quota, num_warps_per_block, || kv::$name(&dev, &s.raw, &d.raw, si, di, $($int),+))).py()
        }
    };
}

/// A direct op over two lists of arrays (sglang's `Tensor[]` arguments).
macro_rules! kv_list_op {
    ($name:ident($src:ident, $dst:ident; $($int:ident),+)) => {
        #[pyfunction]
        #[pyo3(signature = ($src, $dst, src_indices, dst_indices, $($int),+, *, stream = None))]
        fn $name(
            py: Python<'_>,
            $src: &Bound<'_, PyAny>,
            $dst: &Bound<'_, PyAny>,
            src_indices: &Bound<'_, PyAny>,
            dst_indices: &Bound<'_, PyAny>,
            $($int: i64,)+
            stream: Option<u64>,
        ) -> PyResult<()> {
            let ctx = Ctx { stream };
            let (si, di) = index_pair(src_indices, dst_indices, ctx)?;
            let (s, d) = (array_list($src, stringify!($src), false, ctx)?, array_list($dst, stringify!($dst), true, ctx)?);
            let dev = executor_for(&s.iter().chain(&d).collect::<Vec<_>>(), ctx)?;
            let (s, d) = (raws(&s), raws(&d));
            py.detach(|| kv::$name(&dev, &s, &d, &si, &di, $($int),+)).py()
        }
    };
}

/// An all-layer backup of K and V layer lists into two host buffers (`item_size`,
/// `dst_layout_dim`, `num_layers`, then the layout's own integers).
macro_rules! kv_backup_op {
    ($name:ident($($extra:ident),*)) => {
        #[pyfunction]
        #[pyo3(signature = (src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size, dst_layout_dim, num_layers, $($extra,)* *, stream = None, block_quota = None, num_warps_per_block = None))]
        fn $name(
            py: Python<'_>,
            src_k_layers: &Bound<'_, PyAny>,
            dst_k: &Bound<'_, PyAny>,
            src_v_layers: &Bound<'_, PyAny>,
            dst_v: &Bound<'_, PyAny>,
            src_indices: &Bound<'_, PyAny>,
            dst_indices: &Bound<'_, PyAny>,
            item_size: i64,
            dst_layout_dim: i64,
            num_layers: i64,
            $($extra: i64,)*
            stream: Option<u64>,
            block_quota: Option<i64>,
            num_warps_per_block: Option<i64>,
        ) -> PyResult<()> {
            let ctx = Ctx { stream };
            // sgl-kernel checks the layer count before anything else.
            kv::check_num_layers(false, num_layers, src_k_layers.len()?).py()?;
            let (si, di) = index_args(src_indices, dst_indices, ctx)?;
            let src_table = !is_list(src_k_layers) || !is_list(src_v_layers);
            let (si, di, se, _) = table_extents(si, di, src_table, false, item_size, ctx)?;
            let (sk, sv) = (layers(src_k_layers, "src_k_layers", false, se, ctx)?, layers(src_v_layers, "src_v_layers", false, se, ctx)?);
            let (dk, dv) = (dst_view(dst_k, "dst_k", ctx)?, dst_view(dst_v, "dst_v", ctx)?);
            let args: Vec<&Held> = sk.iter().chain(&sv).chain([&dk, &dv]).collect();
            let dev = executor_for(&args, ctx)?;
            let (si, di) = place(si, di, &args, ctx)?;
            let (si, di) = (si.indices(), di.indices());
            let (sk, sv) = (raws(&sk), raws(&sv));
            py.detach(|| tuned(block_quota, num_warps_per_block, || kv::$name(&dev, &sk, &dk.raw, &sv, &dv.raw, si, di, item_size, dst_layout_dim, num_layers $(, $extra)*))).py()
        }
    };
}

kv_backup_op!(transfer_kv_all_layer_lf_pf());
kv_backup_op!(transfer_kv_all_layer_lf_ph(page_size, head_num));
kv_backup_op!(transfer_kv_all_layer_lf_pfdhg(page_size, head_num));

kv_pair_op!(transfer_kv_per_layer(item_size));
kv_pair_op!(transfer_kv_per_layer_pf_lf(layer_id, item_size, src_layout_dim));
kv_pair_op!(transfer_kv_per_layer_ph_lf(layer_id, item_size, src_layout_dim, page_size, head_num));
kv_pair_op!(transfer_kv_per_layer_pfdhg_lf(layer_id, item_size, src_layout_dim, page_size, head_num));
kv_pair_op!(transfer_kv_per_layer_lf_pf(layer_id, item_size, dst_layout_dim));
kv_one_op!(transfer_kv_per_layer_mla(item_size));
kv_one_op!(transfer_kv_per_layer_mla_pf_lf(layer_id, item_size, src_layout_dim));
kv_one_op!(transfer_kv_per_layer_mla_lf_pf(layer_id, item_size, dst_layout_dim));
kv_list_op!(transfer_kv_direct(src_layers, dst_layers; page_size));
kv_list_op!(transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs; layer_id, page_size));
kv_list_op!(transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs; page_size));
kv_list_op!(transfer_kv_per_layer_direct_lf_pf(src_ptrs, dst_ptrs; layer_id, page_size));

/// The lists of an all-layer op whose layer arguments may be tables of addresses: a table's
/// layers are as long as its side's largest index needs, so that side's values come to the host.
fn table_extents(si: Idx, di: Idx, src_table: bool, dst_table: bool, item_size: i64, ctx: Ctx) -> PyResult<(Idx, Idx, u64, u64)> {
    let host = |i: Idx, table: bool| -> PyResult<(Idx, u64)> {
        if !table {
            return Ok((i, 0));
        }
        let v = i.into_host(ctx)?;
        let e = extent_for(&v, item_size);
        Ok((Idx::Host(v), e))
    };
    let (si, se) = host(si, src_table)?;
    let (di, de) = host(di, dst_table)?;
    Ok((si, di, se, de))
}

#[pyfunction]
#[pyo3(signature = (src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices, dst_indices, item_size, num_layers, *, stream = None, block_quota = None, num_warps_per_block = None))]
fn transfer_kv_all_layer(
    py: Python<'_>,
    src_k_layers: &Bound<'_, PyAny>,
    dst_k_layers: &Bound<'_, PyAny>,
    src_v_layers: &Bound<'_, PyAny>,
    dst_v_layers: &Bound<'_, PyAny>,
    src_indices: &Bound<'_, PyAny>,
    dst_indices: &Bound<'_, PyAny>,
    item_size: i64,
    num_layers: i64,
    stream: Option<u64>,
    block_quota: Option<i64>,
    num_warps_per_block: Option<i64>,
) -> PyResult<()> {
    let ctx = Ctx { stream };
    // sgl-kernel checks the layer count before anything else.
    kv::check_num_layers(false, num_layers, src_k_layers.len()?).py()?;
    let (si, di) = index_args(src_indices, dst_indices, ctx)?;
    let (src_table, dst_table) = (!is_list(src_k_layers) || !is_list(src_v_layers), !is_list(dst_k_layers) || !is_list(dst_v_layers));
    let (si, di, se, de) = table_extents(si, di, src_table, dst_table, item_size, ctx)?;
    let sk = layers(src_k_layers, "src_k_layers", false, se, ctx)?;
    let dk = layers(dst_k_layers, "dst_k_layers", true, de, ctx)?;
    let sv = layers(src_v_layers, "src_v_layers", false, se, ctx)?;
    let dv = layers(dst_v_layers, "dst_v_layers", true, de, ctx)?;
    let args: Vec<&Held> = sk.iter().chain(&dk).chain(&sv).chain(&dv).collect();
    let dev = executor_for(&args, ctx)?;
    let (si, di) = place(si, di, &args, ctx)?;
    let (si, di) = (si.indices(), di.indices());
    let (sk, dk, sv, dv) = (raws(&sk), raws(&dk), raws(&sv), raws(&dv));
    py.detach(|| {
        tuned(block_quota, num_warps_per_block, || kv::transfer_kv_all_layer(&dev, &sk, &dk, &sv, &dv, si, di, item_size, num_layers))
    })
    .py()
}

#[pyfunction]
#[pyo3(signature = (src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers, *, stream = None, block_quota = None, num_warps_per_block = None))]
fn transfer_kv_all_layer_mla(
    py: Python<'_>,
    src_layers: &Bound<'_, PyAny>,
    dst_layers: &Bound<'_, PyAny>,
    src_indices: &Bound<'_, PyAny>,
    dst_indices: &Bound<'_, PyAny>,
    item_size: i64,
    num_layers: i64,
    stream: Option<u64>,
    block_quota: Option<i64>,
    num_warps_per_block: Option<i64>,
) -> PyResult<()> {
    let ctx = Ctx { stream };
    // sgl-kernel checks the layer count before anything else.
    kv::check_num_layers(true, num_layers, src_layers.len()?).py()?;
    let (si, di) = index_args(src_indices, dst_indices, ctx)?;
    let (si, di, se, de) = table_extents(si, di, !is_list(src_layers), !is_list(dst_layers), item_size, ctx)?;
    let s = layers(src_layers, "src_layers", false, se, ctx)?;
    let d = layers(dst_layers, "dst_layers", true, de, ctx)?;
    let args: Vec<&Held> = s.iter().chain(&d).collect();
    let dev = executor_for(&args, ctx)?;
    let (si, di) = place(si, di, &args, ctx)?;
    let (si, di) = (si.indices(), di.indices());
    let (s, d) = (raws(&s), raws(&d));
    py.detach(|| tuned(block_quota, num_warps_per_block, || kv::transfer_kv_all_layer_mla(&dev, &s, &d, si, di, item_size, num_layers)))
        .py()
}

#[pyfunction]
#[pyo3(signature = (src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers, *, stream = None, block_quota = None, num_warps_per_block = None))]
fn transfer_kv_all_layer_mla_lf_pf(
    py: Python<'_>,
    src_layers: &Bound<'_, PyAny>,
    dst: &Bound<'_, PyAny>,
    src_indices: &Bound<'_, PyAny>,
    dst_indices: &Bound<'_, PyAny>,
    item_size: i64,
    dst_layout_dim: i64,
    num_layers: i64,
    stream: Option<u64>,
    block_quota: Option<i64>,
    num_warps_per_block: Option<i64>,
) -> PyResult<()> {
    let ctx = Ctx { stream };
    // sgl-kernel checks the layer count before anything else.
    kv::check_num_layers(true, num_layers, src_layers.len()?).py()?;
    let (si, di) = index_args(src_indices, dst_indices, ctx)?;
    let (si, di, se, _) = table_extents(si, di, !is_list(src_layers), false, item_size, ctx)?;
    let s = layers(src_layers, "src_layers", false, se, ctx)?;
    let d = dst_view(dst, "dst", ctx)?;
    let args: Vec<&Held> = s.iter().chain([&d]).collect();
    let dev = executor_for(&args, ctx)?;
    let (si, di) = place(si, di, &args, ctx)?;
    let (si, di) = (si.indices(), di.indices());
    let s = raws(&s);
    py.detach(|| {
        tuned(block_quota, num_warps_per_block, || {
            kv::transfer_kv_all_layer_mla_lf_pf(&dev, &s, &d.raw, si, di, item_size, dst_layout_dim, num_layers)
        })
    })
    .py()
}

/// Whole rows between two arrays (host or CUDA, any pair the executor moves), one copy per range.
#[pyfunction]
#[pyo3(signature = (src, dst, src_starts, dst_starts, lengths, *, stream = None))]
fn transfer_embedding_ranges_direct(
    py: Python<'_>,
    src: &Bound<'_, PyAny>,
    dst: &Bound<'_, PyAny>,
    src_starts: Vec<i64>,
    dst_starts: Vec<i64>,
    lengths: Vec<i64>,
    stream: Option<u64>,
) -> PyResult<()> {
    let ctx = Ctx { stream };
    let (s, d) = (view(src, "src", ctx)?, dst_view(dst, "dst", ctx)?);
    if s.dtype != d.dtype {
        return Err(PyRuntimeError::new_err("src and dst must have the same dtype"));
    }
    let dev = executor_for(&[&s, &d], ctx)?;
    py.detach(|| kv::transfer_embedding_ranges_direct(&dev, &s.raw, &d.raw, &src_starts, &dst_starts, &lengths)).py()
}

/// sglang's `copy_all_layer_kv_cache_cpu`: `data_ptrs` (uint64 host addresses of the buffers,
/// trusted as sglang trusts them: each holds the rows the largest location needs), `strides`
/// (int64 bytes per row), `tgt_loc` / `src_loc` (int32 or int64 rows). The type and shape checks
/// with sglang's messages are made by the Python wrapper; here the values.
#[pyfunction]
fn copy_all_layer_kv_cache_cpu(
    py: Python<'_>,
    data_ptrs: &Bound<'_, PyAny>,
    strides: &Bound<'_, PyAny>,
    tgt_loc: &Bound<'_, PyAny>,
    src_loc: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let ctx = Ctx { stream: None };
    let host_values = |obj: &Bound<'_, PyAny>, name: &str| -> PyResult<Vec<i64>> {
        let h = view(obj, name, ctx)?;
        if !h.on_host() {
            return Err(PyRuntimeError::new_err(format!("{name} must be a CPU tensor")));
        }
        let n = h.raw.dims().iter().product::<u64>() as usize;
        let p = h.raw.addr() as *const u8;
        // SAFETY: `n` elements of a live host array (kept by `h`), read unaligned.
        let read = |i: usize| unsafe {
            match h.dtype.1 {
                32 => (p as *const i32).add(i).read_unaligned() as i64,
                _ => (p as *const i64).add(i).read_unaligned(),
            }
        };
        match h.dtype {
            (DL_INT | DL_UINT, 64) | (DL_INT, 32) => Ok((0..n).map(read).collect()),
            _ => Err(PyRuntimeError::new_err(format!("\"copy_all_layer_kv_cache_cpu\" not implemented for {name}'s dtype"))),
        }
    };
    let ptrs = host_values(data_ptrs, "data_ptrs")?;
    let row_bytes = host_values(strides, "strides")?;
    if ptrs.len() != row_bytes.len() {
        return Err(PyRuntimeError::new_err(format!("CHECK_EQ(strides.numel(), num_bufs) failed. {} vs {}", row_bytes.len(), ptrs.len())));
    }
    let (tgt, src) = (host_values(tgt_loc, "tgt_loc")?, host_values(src_loc, "src_loc")?);
    let top = tgt.iter().chain(&src).copied().max().unwrap_or(-1);
    let rows = u64::try_from(top.saturating_add(1)).unwrap_or(0);
    let mut buffers = Vec::with_capacity(ptrs.len());
    let mut rb = Vec::with_capacity(ptrs.len());
    for (b, (&addr, &row)) in ptrs.iter().zip(&row_bytes).enumerate() {
        let row = u64::try_from(row).map_err(|_| PyValueError::new_err(format!("strides[{b}] must not be negative, got {row}")))?;
        let extent = rows.checked_mul(row).ok_or_else(|| PyValueError::new_err(format!("strides[{b}]: buffer extent overflows")))?;
        // SAFETY: sglang's contract for these address tables: the caller vouches that buffer `b`
        // holds every row the locations address.
        buffers.push(unsafe { RawTensor::new(addr as u64, extent, vec![rows, row], Memory::Host) });
        rb.push(row);
    }
    py.detach(|| kv::copy_all_layer_kv_cache(&buffers, &rb, &tgt, &src)).py()
}

/// The integrity checksum of a host array's bytes (or any bytes-like object): the multilinear
/// hash every hicache-io checksum uses, keys seeded by `seed`.
#[pyfunction]
#[pyo3(signature = (data, seed = hicache_io::integrity::STORAGE_SEED))]
fn checksum(py: Python<'_>, data: &Bound<'_, PyAny>, seed: u64) -> PyResult<u64> {
    let bytes = data_arg(data, "data")?;
    py.detach(|| {
        let keys = hicache_io::integrity::shared_keys(seed, hicache_io::integrity::words(bytes.len()))?;
        Ok(hicache_io::integrity::checksum(&bytes, &keys))
    })
    .py()
}

/// 64-bit tags of names (FNV-1a of their UTF-8 bytes), as a `numpy.uint64` array: what the L3
/// store folds into an object's checksum to bind it to its key.
#[pyfunction]
fn name_tags<'py>(py: Python<'py>, names: Vec<String>) -> PyResult<Bound<'py, PyAny>> {
    u64_array(py, names.iter().map(|n| hicache_io::integrity::name_hash(n.as_bytes())))
}

/// Waits for the caller's stream on CUDA device `device_id` (and the executor's other streams),
/// then raises the first op since the last report whose CUDA index lists failed their device
/// checks (nothing of that op was copied).
#[pyfunction]
#[pyo3(signature = (device_id = 0, *, stream = None))]
fn synchronize(py: Python<'_>, device_id: i32, stream: Option<u64>) -> PyResult<()> {
    let dev = cuda(device_id, stream.unwrap_or(1))?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(e) = &dev {
        return py.detach(|| e.synchronize()).py();
    }
    let _ = (py, dev);
    Ok(())
}

/// A direct op's list of arrays (sglang passes Python lists of tensors).
fn array_list(obj: &Bound<'_, PyAny>, name: &str, writes: bool, ctx: Ctx) -> PyResult<Vec<Held>> {
    if !(obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>()) {
        return Err(PyTypeError::new_err(format!("{name}: expected a list of arrays")));
    }
    layers(obj, name, writes, 0, ctx)
}

// ---- pools -------------------------------------------------------------------------------

/// An executor instance: `"cpu"`, `"wgpu"`, `"cuda"` or `"auto"`.
#[pyclass(name = "Device", module = "hicache_io")]
struct PyDevice {
    inner: Device,
}

#[pymethods]
impl PyDevice {
    #[new]
    #[pyo3(signature = (name = "auto"))]
    fn new(py: Python<'_>, name: &str) -> PyResult<Self> {
        let inner = py.detach(|| match name {
            "auto" => Ok(Device::auto()),
            other => other.parse().and_then(Device::open),
        });
        Ok(PyDevice { inner: inner.py()? })
    }
    /// `cpu`, `wgpu` or `cuda`.
    #[getter]
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    /// Adapter / device description.
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn __repr__(&self) -> String {
        format!("Device({:?}: {})", self.inner.name(), self.inner.describe())
    }
}

/// Bytes out as a writable 1-D numpy array of `dtype` (over a `bytearray`: one copy in all).
fn numpy_array<'py>(py: Python<'py>, bytes: &[u8], dtype: &str) -> PyResult<Bound<'py, PyAny>> {
    let kw = pyo3::types::PyDict::new(py);
    kw.set_item("dtype", dtype)?;
    py.import("numpy")?.call_method("frombuffer", (pyo3::types::PyByteArray::new(py, bytes),), Some(&kw))
}

/// Bytes out as a writable 1-D `numpy.uint8` array.
fn u8_array<'py>(py: Python<'py>, bytes: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    numpy_array(py, bytes, "uint8")
}

/// Values out as a writable 1-D little-endian `numpy.uint64` array.
fn u64_array<'py>(py: Python<'py>, values: impl IntoIterator<Item = u64>) -> PyResult<Bound<'py, PyAny>> {
    let bytes: Vec<u8> = values.into_iter().flat_map(u64::to_le_bytes).collect();
    numpy_array(py, &bytes, "<u8")
}

fn parse<T: std::str::FromStr<Err = TransferError>>(s: &str) -> PyResult<T> {
    s.parse().py()
}

/// A device pool (layer_first, one buffer per live layer and component), zero-initialised.
#[pyclass(name = "DevicePool", module = "hicache_io")]
struct PyDevicePool {
    inner: DevicePool<'static>,
}

#[pymethods]
impl PyDevicePool {
    #[new]
    #[pyo3(signature = (device, kind, bytes_per_token, slots, page_size, layer_num, layer_shard = None, skipped = None, drafts = 0))]
    fn new(
        py: Python<'_>,
        device: &PyDevice,
        kind: &str,
        bytes_per_token: u64,
        slots: u64,
        page_size: u64,
        layer_num: usize,
        layer_shard: Option<(usize, usize)>,
        skipped: Option<Vec<bool>>,
        drafts: usize,
    ) -> PyResult<Self> {
        let layers = LayerMap { layer_num, layer_shard, skipped: skipped.unwrap_or_else(|| vec![false; layer_num]), drafts };
        let config = DevicePoolConfig { kind: parse(kind)?, bytes_per_token, slots, page_size, layers };
        let dev = device.inner.clone();
        Ok(PyDevicePool { inner: py.detach(|| DevicePool::new(&dev, &config)).py()? })
    }
    /// Bytes per slot (the indexer page for the DSA indexer).
    #[getter]
    fn item_bytes(&self) -> u64 {
        self.inner.geometry().item_bytes()
    }
    /// Slots per layer buffer.
    #[getter]
    fn slots(&self) -> u64 {
        self.inner.geometry().slots()
    }
    /// Buffers per component (live target layers, then drafts).
    #[getter]
    fn buffer_count(&self) -> usize {
        self.inner.geometry().buffer_count()
    }
    /// A copy of buffer `slot` of component `comp`, as a `numpy.uint8` array.
    fn read_buffer<'py>(&self, py: Python<'py>, comp: usize, slot: usize) -> PyResult<Bound<'py, PyAny>> {
        let v = py.detach(|| self.inner.read_buffer(comp, slot)).py()?;
        u8_array(py, &v)
    }
    /// Replaces buffer `slot` of component `comp` (exactly its size, any bytes-like object).
    fn write_buffer(&mut self, py: Python<'_>, comp: usize, slot: usize, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let data = data_arg(data, "data")?;
        py.detach(|| self.inner.write_buffer(comp, slot, &data)).py()
    }
}

/// A host pool in one of sglang's layouts, for a device pool.
#[pyclass(name = "HostPool", module = "hicache_io")]
struct PyHostPool {
    inner: HostPool<'static>,
}

fn io(name: &str) -> PyResult<IoBackend> {
    parse(name)
}

/// A pool call's index lists (host memory) and io backend.
fn pool_args(host: &Bound<'_, PyAny>, device: &Bound<'_, PyAny>, io_backend: &str) -> PyResult<(Vec<i64>, Vec<i64>, IoBackend)> {
    let ctx = Ctx { stream: None };
    Ok((index_list(host, "Host", ctx)?, index_list(device, "Device", ctx)?, io(io_backend)?))
}

#[pymethods]
impl PyHostPool {
    #[new]
    #[pyo3(signature = (device_pool, layout, size, head_num = 1, profile = "extended", integrity = None))]
    fn new(
        py: Python<'_>,
        device_pool: &PyDevicePool,
        layout: &str,
        size: u64,
        head_num: u64,
        profile: &str,
        integrity: Option<bool>,
    ) -> PyResult<Self> {
        let config = HostPoolConfig { layout: parse(layout)?, size, head_num, profile: parse::<Profile>(profile)?, integrity };
        Ok(PyHostPool { inner: py.detach(|| HostPool::new(&device_pool.inner, &config)).py()? })
    }
    #[pyo3(signature = (device_pool, host_indices, device_indices, layer_id, io_backend = "kernel"))]
    fn load_to_device_per_layer(
        &self,
        py: Python<'_>,
        device_pool: &mut PyDevicePool,
        host_indices: &Bound<'_, PyAny>,
        device_indices: &Bound<'_, PyAny>,
        layer_id: usize,
        io_backend: &str,
    ) -> PyResult<()> {
        let (hi, di, io) = pool_args(host_indices, device_indices, io_backend)?;
        let dev = &mut device_pool.inner;
        py.detach(|| self.inner.load_to_device_per_layer(dev, &hi, &di, layer_id, io)).py()
    }
    #[pyo3(signature = (device_pool, host_indices, device_indices, layer_id, io_backend = "kernel"))]
    fn load_draft_to_device(
        &self,
        py: Python<'_>,
        device_pool: &mut PyDevicePool,
        host_indices: &Bound<'_, PyAny>,
        device_indices: &Bound<'_, PyAny>,
        layer_id: usize,
        io_backend: &str,
    ) -> PyResult<()> {
        let (hi, di, io) = pool_args(host_indices, device_indices, io_backend)?;
        let dev = &mut device_pool.inner;
        py.detach(|| self.inner.load_draft_to_device(dev, &hi, &di, layer_id, io)).py()
    }
    #[pyo3(signature = (device_pool, host_indices, device_indices, io_backend = "kernel"))]
    fn backup_from_device_all_layer(
        &mut self,
        py: Python<'_>,
        device_pool: &PyDevicePool,
        host_indices: &Bound<'_, PyAny>,
        device_indices: &Bound<'_, PyAny>,
        io_backend: &str,
    ) -> PyResult<()> {
        let (hi, di, io) = pool_args(host_indices, device_indices, io_backend)?;
        let host = &mut self.inner;
        py.detach(|| host.backup_from_device_all_layer(&device_pool.inner, &hi, &di, io)).py()
    }
    #[pyo3(signature = (device_pool, host_indices, device_indices, layer_id, io_backend = "kernel", is_draft = false))]
    fn backup_from_device_per_layer(
        &mut self,
        py: Python<'_>,
        device_pool: &PyDevicePool,
        host_indices: &Bound<'_, PyAny>,
        device_indices: &Bound<'_, PyAny>,
        layer_id: usize,
        io_backend: &str,
        is_draft: bool,
    ) -> PyResult<()> {
        let (hi, di, io) = pool_args(host_indices, device_indices, io_backend)?;
        let host = &mut self.inner;
        py.detach(|| host.backup_from_device_per_layer(&device_pool.inner, &hi, &di, layer_id, is_draft, io)).py()
    }
    /// sglang `get_data_page(index, flat=True)`: the flat page, a `numpy.uint8` array.
    fn get_data_page<'py>(&self, py: Python<'py>, index: i64) -> PyResult<Bound<'py, PyAny>> {
        let v = py.detach(|| self.inner.get_data_page(index)).py()?;
        u8_array(py, &v)
    }
    /// sglang `get_dummy_flat_data_page()`: zeros of one flat page.
    fn get_dummy_flat_data_page<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let v = self.inner.get_dummy_flat_data_page().py()?;
        u8_array(py, &v)
    }
    /// sglang `set_from_flat_data_page(index, data_page)`.
    fn set_from_flat_data_page(&mut self, py: Python<'_>, index: i64, data_page: &Bound<'_, PyAny>) -> PyResult<()> {
        let data_page = data_arg(data_page, "data_page")?;
        let host = &mut self.inner;
        py.detach(|| host.set_from_flat_data_page(index, &data_page)).py()
    }
    /// sglang `get_page_buffer_meta(indices)`: `(component, byte offset, bytes)` per span.
    fn get_page_buffer_meta(&self, indices: &Bound<'_, PyAny>) -> PyResult<Vec<(usize, u64, u64)>> {
        let idx = index_list(indices, "Host", Ctx { stream: None })?;
        self.inner.get_page_buffer_meta(&idx).py()
    }
    /// A copy of component `comp`'s buffer, as a `numpy.uint8` array.
    fn read_buffer<'py>(&self, py: Python<'py>, comp: usize) -> PyResult<Bound<'py, PyAny>> {
        let v = py.detach(|| self.inner.read_buffer(comp)).py()?;
        u8_array(py, &v)
    }
    /// Replaces component `comp`'s buffer (exactly its size).
    fn write_buffer(&mut self, py: Python<'_>, comp: usize, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let data = data_arg(data, "data")?;
        let host = &mut self.inner;
        py.detach(|| host.write_buffer(comp, &data)).py()
    }
    /// Bytes of one component buffer.
    #[getter]
    fn buffer_bytes(&self) -> u64 {
        self.inner.geometry().buffer_bytes()
    }
    /// Token slots after sglang's rounding.
    #[getter]
    fn size(&self) -> u64 {
        self.inner.geometry().size()
    }
    /// Host layers `L`.
    #[getter]
    fn layer_num(&self) -> u64 {
        self.inner.geometry().layer_num()
    }
    /// `mha`, `mla` or `dsa`.
    #[getter]
    fn kind(&self) -> &'static str {
        self.inner.geometry().kind().name()
    }
    /// The host layout, sglang's name.
    #[getter]
    fn layout(&self) -> &'static str {
        self.inner.geometry().layout().name()
    }
    /// Tokens per page `P`.
    #[getter]
    fn page_size(&self) -> u64 {
        self.inner.geometry().page_size()
    }
    /// Heads (page_head) or head groups (page_first_direct_hg); 1 otherwise.
    #[getter]
    fn head_num(&self) -> u64 {
        self.inner.geometry().head_num()
    }
    /// Bytes per (slot, layer) of the host pool.
    #[getter]
    fn item_bytes(&self) -> u64 {
        self.inner.geometry().item_bytes()
    }
    /// Component buffers: 2 (K, V) for MHA, 1 otherwise.
    #[getter]
    fn components(&self) -> usize {
        self.inner.geometry().kind().components()
    }
    /// The executor's name (`cpu`, `wgpu`, `cuda`).
    #[getter]
    fn executor(&self) -> &'static str {
        self.inner.device().name()
    }
    /// The device pool's layers as this host pool holds them: `(layer_num, owned start, owned
    /// end, drafts, skipped)`.
    #[getter]
    fn layer_map(&self) -> (usize, usize, usize, usize, Vec<bool>) {
        let m = self.inner.pair().device().layers();
        let (start, end) = m.owned();
        (m.layer_num, start, end, m.drafts, m.skipped.clone())
    }
    /// `(address, bytes)` of component `comp`'s buffer in this process, or `None` when the
    /// executor keeps host pools in its own buffers (wgpu). Valid while the pool lives; call
    /// `synchronize()` before touching it.
    fn host_span(&self, comp: usize) -> PyResult<Option<(u64, u64)>> {
        self.inner.host_span(comp).py()
    }
    /// The integrity checksum of each span `get_page_buffer_meta(indices)` names (per page, K then
    /// V), as a `numpy.uint64` array; keys seeded by `seed` (the storage seed by default).
    #[pyo3(signature = (indices, seed = hicache_io::integrity::STORAGE_SEED))]
    fn object_checksums<'py>(&self, py: Python<'py>, indices: &Bound<'_, PyAny>, seed: u64) -> PyResult<Bound<'py, PyAny>> {
        let idx = index_list(indices, "Host", Ctx { stream: None })?;
        let sums = py.detach(|| self.inner.object_checksums(&idx, seed)).py()?;
        u64_array(py, sums)
    }
    /// Per page of `indices` (first tokens at `indices[0], indices[P], …`): whether its bytes
    /// still match every item checksum the pool recorded for it (`True` where it has none).
    fn pages_intact(&self, py: Python<'_>, indices: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let idx = index_list(indices, "Host", Ctx { stream: None })?;
        py.detach(|| self.inner.pages_intact(&idx)).py()
    }
    /// Whether the pool keeps item checksums (recorded by backups, verified by loads).
    #[getter]
    fn integrity(&self) -> bool {
        self.inner.integrity_enabled()
    }
    /// `{"recorded", "verified", "unverified", "mismatched"}` item counts, `None` without
    /// checksums.
    fn integrity_stats(&self) -> Option<std::collections::BTreeMap<&'static str, u64>> {
        self.inner.integrity_stats().map(|s| {
            [("recorded", s.recorded), ("verified", s.verified), ("unverified", s.unverified), ("mismatched", s.mismatched)].into()
        })
    }
    /// The recorded checksums of the page starting at token `index` (component, layer, slot;
    /// `None` where unknown); empty without checksums.
    fn page_checksums(&self, index: i64) -> PyResult<Vec<Option<u64>>> {
        self.inner.page_checksums(index).py()
    }
    /// `set_from_flat_data_page` verified against the page's carried checksums.
    fn set_from_flat_data_page_checked(
        &mut self,
        py: Python<'_>,
        index: i64,
        data_page: &Bound<'_, PyAny>,
        checksums: Vec<Option<u64>>,
    ) -> PyResult<()> {
        let data_page = data_arg(data_page, "data_page")?;
        let host = &mut self.inner;
        py.detach(|| host.set_from_flat_data_page_checked(index, &data_page, &checksums)).py()
    }
    /// Records the checksums of the pages starting at `indices` (token slots) from their bytes in
    /// host memory (written in place by a store that verified them).
    fn recompute_page_checksums(&mut self, py: Python<'_>, indices: Vec<i64>) -> PyResult<()> {
        let host = &mut self.inner;
        py.detach(|| indices.iter().try_for_each(|&i| host.recompute_page_checksums(i))).py()
    }
    /// Forgets the checksums of the pages starting at `indices` (written in place, unverified).
    fn forget_page_checksums(&mut self, indices: Vec<i64>) -> PyResult<()> {
        indices.iter().try_for_each(|&i| self.inner.forget_page_checksums(i)).py()
    }
    /// Fault injection: writes `data` into component `comp` at byte `offset` without touching
    /// the checksums.
    fn inject_host_corruption(&mut self, comp: usize, offset: u64, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let data = data_arg(data, "data")?;
        self.inner.inject_host_corruption(comp, offset, &data).py()
    }
    /// Waits for every transfer queued on the pool's executor, then raises `IntegrityError` for
    /// the items of plain loads that failed their checksums since the last report (cuda: its
    /// plain calls return once enqueued, before their checksums arrive; other executors raise
    /// from the call). Another call's failed CUDA index check stays pending for that call's own
    /// report.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let dev = self.inner.device().clone();
        py.detach(|| dev.wait_idle().and_then(|_| dev.integrity_reports())).py()
    }
}

// ---- tools -------------------------------------------------------------------------------

/// `hicache-io matrix --json`, as a JSON string.
#[pyfunction]
#[pyo3(signature = (profile = "extended", pools = None, dsa_page_size = 64))]
fn matrix_json(profile: &str, pools: Option<Vec<String>>, dsa_page_size: u64) -> PyResult<String> {
    hicache_io::matrix::check_dsa_page_size(dsa_page_size).py()?;
    let pools = match pools {
        Some(p) => p.iter().map(|s| parse(s)).collect::<PyResult<Vec<_>>>()?,
        None => hicache_io::PoolKind::ALL.to_vec(),
    };
    let m = hicache_io::matrix::matrix(parse(profile)?, &pools, dsa_page_size);
    serde_json::to_string(&m).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// `hicache-io check --json` for one executor, as a JSON string.
#[pyfunction]
#[pyo3(signature = (device, profile = "extended", rounds = 4, seed = 1, io_backend = None))]
fn check_json(py: Python<'_>, device: &PyDevice, profile: &str, rounds: u64, seed: u64, io_backend: Option<&str>) -> PyResult<String> {
    let (profile, io) = (parse::<Profile>(profile)?, io_backend.map(io).transpose()?);
    let dev = device.inner.clone();
    let rows = py.detach(|| hicache_io::check::check_device_io(&dev, profile, seed, rounds, io, |_, _| {})).py()?;
    let v: Vec<_> = rows.iter().map(|(c, t)| serde_json::json!({"cell": c, "tally": t})).collect();
    serde_json::to_string(&v).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDevice>()?;
    m.add_class::<PyDevicePool>()?;
    m.add_class::<PyHostPool>()?;
    m.add_function(wrap_pyfunction!(matrix_json, m)?)?;
    m.add_function(wrap_pyfunction!(check_json, m)?)?;
    m.add_function(wrap_pyfunction!(synchronize, m)?)?;
    m.add_function(wrap_pyfunction!(device_accessible_ptr, m)?)?;
    m.add_function(wrap_pyfunction!(host_words, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_kv_per_layer, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_kv_per_layer_pf_lf, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_kv_per_layer_ph_lf, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_kv_all_layer, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_kv_all_layer_lf_pf, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_kv_all_layer_lf_ph, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_kv_per_layer_mla, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_kv_per_layer_mla_pf_lf, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_kv_all_layer_mla, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_kv_all_layer_mla_lf_pf, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_kv_direct, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_kv_per_layer_direct_pf_lf, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_kv_all_layer_direct_lf_pf, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_kv_per_layer_lf_pf, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_kv_per_layer_mla_lf_pf, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_kv_per_layer_direct_lf_pf, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_kv_per_layer_pfdhg_lf, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_kv_all_layer_lf_pfdhg, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_embedding_ranges_direct, m)?)?;
    m.add_function(wrap_pyfunction!(copy_all_layer_kv_cache_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(checksum, m)?)?;
    m.add_function(wrap_pyfunction!(name_tags, m)?)?;
    m.add("STORAGE_SEED", hicache_io::integrity::STORAGE_SEED)?;
    m.add("IntegrityError", m.py().get_type::<IntegrityError>())?;
    Ok(())
}
