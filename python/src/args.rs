//! An op's index lists and layer arguments, placed for the executor that runs it.

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use hicache_io::kvcacheio::{self as kv, Memory, RawTensor};

use crate::*;

/// An index argument: host values, or an int64 CUDA array left where it is (the `kernel` ops
/// check such lists on the device, without waiting for the stream).
pub(crate) enum Idx {
    Host(Vec<i64>),
    Cuda(Held),
}

impl Idx {
    /// The list as the ops take it.
    pub(crate) fn indices(&self) -> kv::Indices<'_> {
        match self {
            Idx::Host(v) => kv::Indices::Host(v),
            // SAFETY: a live int64 CUDA array of that many entries (kept by the `Held`), used by
            // an op enqueued on the caller's stream, like every CUDA argument.
            Idx::Cuda(h) => kv::Indices::Cuda(unsafe { kv::CudaIndices::new(h.raw.addr(), (h.raw.len() / 8) as usize) }),
        }
    }
    /// Host values: a CUDA array is copied on the caller's stream, which this waits for.
    pub(crate) fn into_host(self, ctx: Ctx) -> PyResult<Vec<i64>> {
        match self {
            Idx::Host(v) => Ok(v),
            Idx::Cuda(h) => Ok(read_cuda(&h, ctx)?.chunks_exact(8).map(|c| i64::from_ne_bytes(c.try_into().expect("8 bytes"))).collect()),
        }
    }
}

/// Index list: an int64 array (sglang's type check and message), or a sequence of ints.
pub(crate) fn index_arg(obj: &Bound<'_, PyAny>, side: &str, ctx: Ctx) -> PyResult<Idx> {
    if obj.hasattr(intern!(obj.py(), "__dlpack__"))? || obj.hasattr(intern!(obj.py(), "__array_interface__"))? {
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
pub(crate) fn index_list(obj: &Bound<'_, PyAny>, side: &str, ctx: Ctx) -> PyResult<Vec<i64>> {
    index_arg(obj, side, ctx)?.into_host(ctx)
}

/// The index lists of a `kernel` op, placed for the executor of `args`: CUDA lists stay on the
/// device when both are CUDA arrays on the data's device (checked there); a CUDA list on another
/// device than the data is refused; otherwise the values come to the host.
pub(crate) fn place(si: Idx, di: Idx, args: &[&Held], ctx: Ctx) -> PyResult<(Idx, Idx)> {
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

/// A call's own launch tuning from sglang's per-call arguments, when given (the one not given
/// stays the executor's default); clamped as the kernels need.
pub(crate) fn launch_tuning(block_quota: Option<i64>, num_warps_per_block: Option<i64>) -> Option<hicache_io::plan::LaunchTuning> {
    use hicache_io::plan::LaunchTuning;
    if block_quota.is_none() && num_warps_per_block.is_none() {
        return None;
    }
    let base = LaunchTuning::default();
    Some(LaunchTuning::from_args(
        block_quota.unwrap_or(base.block_quota as i64),
        num_warps_per_block.unwrap_or(base.num_warps_per_block as i64),
    ))
}

/// Whether a layer argument is a list of arrays (not a table of addresses).
pub(crate) fn is_list(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>()
}

/// A layer argument: a list of arrays (every index bounds-checked), or sglang's table of layer
/// base addresses (a 1-D int64/uint64 array), trusted like sglang: each layer's extent is what
/// the largest index needs (`extent` bytes). A table on the GPU holds device addresses.
pub(crate) fn layers(obj: &Bound<'_, PyAny>, name: &str, writes: bool, extent: u64, ctx: Ctx) -> PyResult<Vec<Held>> {
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

/// The bytes of a bytes object or a host array, read in place: the object is kept alive with them.
pub(crate) struct HostBytes {
    _held: Option<Held>,
    _bytes: Option<Py<PyAny>>,
    addr: usize,
    len: usize,
}

impl HostBytes {
    pub(crate) fn slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `len` bytes of a live bytes object or host array (kept by `self`), only read.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

/// [`HostBytes`] of any bytes-like object or host array.
pub(crate) fn host_bytes(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<HostBytes> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        let bytes = b.as_bytes();
        return Ok(HostBytes { _held: None, _bytes: Some(obj.clone().unbind()), addr: bytes.as_ptr() as usize, len: bytes.len() });
    }
    let h = view(obj, name, Ctx { stream: None })?;
    if !h.on_host() {
        return Err(PyValueError::new_err(format!("{name}: pass host memory")));
    }
    let (addr, len) = (h.raw.addr() as usize, h.raw.len() as usize);
    Ok(HostBytes { _held: Some(h), _bytes: None, addr, len })
}

/// Bytes of any bytes-like object or host array, copied.
pub(crate) fn data_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u8>> {
    Ok(host_bytes(obj, name)?.slice().to_vec())
}

// ---- executors ---------------------------------------------------------------------------

// ---- kvcacheio ---------------------------------------------------------------------------

/// Source and destination index lists, read in sgl-kernel's order, as host values.
pub(crate) fn index_pair(src: &Bound<'_, PyAny>, dst: &Bound<'_, PyAny>, ctx: Ctx) -> PyResult<(Vec<i64>, Vec<i64>)> {
    Ok((index_list(src, "Source", ctx)?, index_list(dst, "Destination", ctx)?))
}

/// [`index_pair`] with CUDA arrays left on their device (see [`place`]).
pub(crate) fn index_args(src: &Bound<'_, PyAny>, dst: &Bound<'_, PyAny>, ctx: Ctx) -> PyResult<(Idx, Idx)> {
    Ok((index_arg(src, "Source", ctx)?, index_arg(dst, "Destination", ctx)?))
}

/// The lists of an all-layer op whose layer arguments may be tables of addresses: a table's
/// layers are as long as its side's largest index needs, so that side's values come to the host.
pub(crate) fn table_extents(
    spec: &hicache_io::kvcacheio::catalogue::OpSpec,
    si: Idx,
    di: Idx,
    src_table: bool,
    dst_table: bool,
    int: &dyn Fn(&str) -> i64,
    ctx: Ctx,
) -> PyResult<(Idx, Idx, u64, u64)> {
    let host = |i: Idx, table: bool, source: bool| -> PyResult<(Idx, u64)> {
        if !table {
            return Ok((i, 0));
        }
        let v = i.into_host(ctx)?;
        let e = spec.index_extent(source, &v, int);
        Ok((Idx::Host(v), e))
    };
    let (si, se) = host(si, src_table, true)?;
    let (di, de) = host(di, dst_table, false)?;
    Ok((si, di, se, de))
}

/// A table argument the executor remembers, and the array it came from, by argument.
pub(crate) type Remembered = Vec<Option<(kv::LayerTable, Held)>>;

/// The layer tables of a call when all of them are int64/uint64 tables in CUDA memory whose
/// layers' extents the executor can tell without index values: each read once by the executor
/// of its device (and checked on the device at every later call; see
/// `CudaExecutor::layer_table`). `None` otherwise: the caller reads the tables and the index
/// lists on the host.
pub(crate) fn remembered_tables(
    spec: &hicache_io::kvcacheio::catalogue::OpSpec,
    args: &Bound<'_, PyTuple>,
    int: &dyn Fn(&str) -> i64,
    ctx: Ctx,
) -> PyResult<Option<Remembered>> {
    use hicache_io::kvcacheio::catalogue::ArgKind;
    let mut out: Remembered = (0..spec.args.len()).map(|_| None).collect();
    for (i, (name, kind)) in spec.args.iter().enumerate() {
        if !matches!(kind, ArgKind::InLayers | ArgKind::OutLayers) {
            continue;
        }
        let obj = args.get_item(i)?;
        if is_list(&obj) {
            continue;
        }
        let table = view(&obj, name, ctx)?;
        if table.device_type != DL_CUDA || !(table.dtype == (DL_INT, 64) || table.dtype == (DL_UINT, 64)) || table.raw.dims().len() != 1 {
            return Ok(None);
        }
        let Some(t) = cuda_table(&table, &obj, ctx)? else { return Ok(None) };
        out[i] = Some((t, table));
    }
    let tables: Vec<(ArgKind, &kv::LayerTable)> =
        out.iter().enumerate().filter_map(|(i, o)| o.as_ref().map(|(t, _)| (spec.args[i].1, t))).collect();
    if spec.known_extents(&tables, int).iter().flatten().any(Option::is_none) {
        return Ok(None);
    }
    Ok(Some(out))
}

/// A table in CUDA memory as its device's executor remembers it (`None` without the cuda
/// executor). The executor remembers a table by address; the Python object that owns it is
/// remembered too (weakly), so that a table freed and replaced by another object at the same
/// address is read again rather than refused by the device check as rewritten.
fn cuda_table(table: &Held, owner: &Bound<'_, PyAny>, ctx: Ctx) -> PyResult<Option<kv::LayerTable>> {
    #[cfg(feature = "cuda")]
    if let hicache_io::Device::Cuda(e) = cuda(table.device_id, ctx.stream.unwrap_or(1))? {
        let n = table.raw.dims()[0] as usize;
        if !same_owner(table, owner, n) {
            e.forget_layer_table(table.raw.addr(), n);
        }
        // SAFETY: a live 1-D table of `n` 8-byte entries on that device (kept by `table`) holding
        // sglang's layer addresses, trusted as sglang trusts them.
        return unsafe { e.layer_table(table.raw.addr(), n) }.py().map(Some);
    }
    let _ = (table, owner, ctx);
    Ok(None)
}

/// Whether the object owning table `table` (`n` entries) is the one seen with that address
/// before (and remembers it for next time). Objects that cannot be weakly referenced count as
/// new each time.
#[cfg(feature = "cuda")]
fn same_owner(table: &Held, obj: &Bound<'_, PyAny>, n: usize) -> bool {
    use pyo3::types::PyWeakrefReference;
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    type Owners = Mutex<HashMap<(i32, u64, usize), Py<PyWeakrefReference>>>;
    static OWNERS: OnceLock<Owners> = OnceLock::new();
    let py = obj.py();
    {
        let key = (table.device_id, table.raw.addr(), n);
        let mut owners = OWNERS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        let same = owners.get(&key).and_then(|w| w.bind(py).upgrade()).is_some_and(|o| o.is(obj));
        if !same {
            owners.retain(|_, w| w.bind(py).upgrade().is_some());
            match PyWeakrefReference::new(obj) {
                Ok(w) => {
                    owners.insert(key, w.unbind());
                }
                Err(_) => {
                    owners.remove(&key);
                }
            }
        }
        same
    }
}

/// A direct op's list of arrays (sglang passes Python lists of tensors).
pub(crate) fn array_list(obj: &Bound<'_, PyAny>, name: &str, writes: bool, ctx: Ctx) -> PyResult<Vec<Held>> {
    if !(obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>()) {
        return Err(PyTypeError::new_err(format!("{name}: expected a list of arrays")));
    }
    layers(obj, name, writes, 0, ctx)
}
