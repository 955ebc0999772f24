//! Every op of the catalogue (`hicache_io::kvcacheio::catalogue`) through one binding, and the
//! bespoke ones.

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use hicache_io::kvcacheio::{self as kv, Memory, RawTensor};

use crate::*;

use hicache_io::kvcacheio::catalogue::{self, ArgKind, Binding, CallOptions, OpSpec, Value};

/// Every op of the catalogue, as JSON (for the Python wrappers, their stubs and `torch.ops`):
/// each entry with its whole `docstring`.
#[pyfunction]
pub(crate) fn op_catalogue() -> PyResult<String> {
    let entries = catalogue::CATALOGUE
        .iter()
        .map(|spec| {
            let mut v = serde_json::to_value(spec)?;
            v["docstring"] = serde_json::Value::String(catalogue::docstring(spec));
            Ok(v)
        })
        .collect::<Result<Vec<_>, serde_json::Error>>()
        .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    serde_json::to_string(&entries).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// One argument as read from Python, before the executor is chosen.
pub(crate) enum Read {
    One(Held),
    Many(Vec<Held>),
    /// A table of layer addresses in CUDA memory the executor remembers (and the table).
    Table(kv::LayerTable, Held),
    Int(i64),
    Ints(Vec<i64>),
    /// An index list: placed later, with its partner.
    Index,
}

/// Runs generic op `name` of the catalogue with `args` (positional, in the catalogue's order):
/// each read by its kind, in sgl-kernel's order of checks (the layer count first, then the index
/// lists, then layer arguments, arrays and lists), on the executor of the arrays. The entry is
/// looked up once here and handed to the library with what was checked already.
#[pyfunction]
#[pyo3(signature = (name, args, *, stream = None, block_quota = None, num_warps_per_block = None))]
pub(crate) fn call_op(
    py: Python<'_>,
    name: &str,
    args: &Bound<'_, PyTuple>,
    stream: Option<u64>,
    block_quota: Option<i64>,
    num_warps_per_block: Option<i64>,
) -> PyResult<()> {
    let spec: &'static OpSpec = OpSpec::find(name)
        .filter(|s| s.binding == Binding::Generic)
        .ok_or_else(|| PyValueError::new_err(format!("{name}: not a generic op of the catalogue")))?;
    // The binding's own entry (the generated wrappers' signatures hold the same count); the
    // library's count check is for Rust callers, whose values it gets untyped.
    if args.len() != spec.args.len() {
        return Err(PyTypeError::new_err(format!("{name}() takes {} arguments, got {}", spec.args.len(), args.len())));
    }
    let ctx = Ctx { stream };
    let mut read = read_ints(spec, args)?;
    let ints = Ints { spec, read: &read };
    // sgl-kernel's first check of the all-layer ops: the source table's length.
    if let Some(mla) = spec.num_layers {
        let table = spec.args.iter().position(|(_, k)| *k == ArgKind::InLayers).expect("an all-layer op has source layers");
        kv::check_num_layers(mla, ints.get("num_layers"), args.get_item(table)?.len()?).py()?;
    }
    let lists = read_lists(spec, args, &ints, ctx)?;
    read_arrays(spec, args, &mut read, lists.remembered, lists.extents, ctx)?;
    same_dtype(spec, &read)?;
    let held: Vec<&Held> = read
        .iter()
        .flat_map(|r| match r {
            Read::One(h) | Read::Table(_, h) => std::slice::from_ref(h),
            Read::Many(v) => v.as_slice(),
            _ => &[],
        })
        .collect();
    let dev = executor_for(&held, ctx)?;
    let placed = match lists.kernel {
        Some((si, di)) => Lists::Kernel(place(si, di, &held, ctx)?),
        None => lists.host.map_or(Lists::None, Lists::Host),
    };
    let many: Vec<Vec<RawTensor>> = read.iter().map(|r| if let Read::Many(v) = r { raws(v) } else { Vec::new() }).collect();
    let values = values_of(spec, &read, &many, &placed)?;
    let options = CallOptions { tuning: launch_tuning(block_quota, num_warps_per_block), num_layers_checked: true };
    py.detach(|| catalogue::call_spec(spec, &dev, &values, options)).py()
}

/// The integer arguments read so far, by name (0 where absent).
struct Ints<'r> {
    spec: &'static OpSpec,
    read: &'r [Read],
}

impl Ints<'_> {
    fn get(&self, want: &str) -> i64 {
        self.spec
            .args
            .iter()
            .position(|(n, _)| *n == want)
            .and_then(|i| match &self.read[i] {
                Read::Int(v) => Some(*v),
                _ => None,
            })
            .unwrap_or(0)
    }
}

/// The integer arguments, read first as a typed signature reads them; every other argument a
/// placeholder.
fn read_ints(spec: &'static OpSpec, args: &Bound<'_, PyTuple>) -> PyResult<Vec<Read>> {
    let name = spec.name;
    let mut read: Vec<Read> = Vec::with_capacity(spec.args.len());
    for (i, (n, kind)) in spec.args.iter().enumerate() {
        let arg = args.get_item(i)?;
        read.push(match kind {
            ArgKind::Int => Read::Int(arg.extract().map_err(|_| PyTypeError::new_err(format!("{name}(): {n} must be an int")))?),
            ArgKind::Ints => {
                Read::Ints(arg.extract().map_err(|_| PyTypeError::new_err(format!("{name}(): {n} must be a sequence of ints")))?)
            }
            _ => Read::Index,
        });
    }
    Ok(read)
}

/// An op's index lists as read: left in CUDA memory for `kernel` ops, values on the host for
/// `direct` ops; with the tables the executor remembers and the layers' extents where the
/// tables are read on the host.
struct ReadLists {
    kernel: Option<(Idx, Idx)>,
    host: Option<(Vec<i64>, Vec<i64>)>,
    remembered: Remembered,
    extents: (u64, u64),
}

/// The index lists, and what the layer arguments given as tables of addresses need of them: a
/// table's layers are as long as its side's largest index needs, so that side's values come to
/// the host, unless the executor can tell every layer's extent itself.
fn read_lists(spec: &'static OpSpec, args: &Bound<'_, PyTuple>, ints: &Ints<'_>, ctx: Ctx) -> PyResult<ReadLists> {
    let lists: Vec<usize> =
        spec.args.iter().enumerate().filter(|(_, (_, k))| matches!(k, ArgKind::Idx | ArgKind::HostIdx)).map(|(i, _)| i).collect();
    let kernel = spec.args.iter().any(|(_, k)| *k == ArgKind::Idx);
    let mut out = ReadLists { kernel: None, host: None, remembered: (0..spec.args.len()).map(|_| None).collect(), extents: (0, 0) };
    let [s, d] = lists[..] else { return Ok(out) };
    if !kernel {
        out.host = Some(index_pair(&args.get_item(s)?, &args.get_item(d)?, ctx)?);
        return Ok(out);
    }
    let (si, di) = index_args(&args.get_item(s)?, &args.get_item(d)?, ctx)?;
    let is_table = |k: ArgKind| -> PyResult<bool> {
        for (i, (_, kind)) in spec.args.iter().enumerate() {
            if *kind == k && !is_list(&args.get_item(i)?) {
                return Ok(true);
            }
        }
        Ok(false)
    };
    let (src_table, dst_table) = (is_table(ArgKind::InLayers)?, is_table(ArgKind::OutLayers)?);
    let int = |n: &str| ints.get(n);
    // sglang's path on CUDA: tables in GPU memory with CUDA index lists. The executor reads each
    // table once and checks it on the device at every call; the lists stay on the device when
    // every layer's extent is known without them.
    if (src_table || dst_table) && matches!((&si, &di), (Idx::Cuda(_), Idx::Cuda(_))) {
        if let Some(t) = remembered_tables(spec, args, &int, ctx)? {
            out.remembered = t;
        }
    }
    out.kernel = Some(if out.remembered.iter().all(Option::is_none) {
        let (si, di, se, de) = table_extents(spec, si, di, src_table, dst_table, &int, ctx)?;
        out.extents = (se, de);
        (si, di)
    } else {
        (si, di)
    });
    Ok(out)
}

/// Layer arguments, then arrays, then lists of arrays, each in the catalogue's order.
fn read_arrays(
    spec: &'static OpSpec,
    args: &Bound<'_, PyTuple>,
    read: &mut [Read],
    mut remembered: Remembered,
    (src_extent, dst_extent): (u64, u64),
    ctx: Ctx,
) -> PyResult<()> {
    // Which layer arguments the op writes (page rows: whichever side `load` says).
    let (writes_in, writes_out) = {
        let ints = Ints { spec, read };
        let int = |n: &str| ints.get(n);
        (spec.writes(ArgKind::InLayers, &int), spec.writes(ArgKind::OutLayers, &int))
    };
    for pass in 0..3 {
        for (i, (n, kind)) in spec.args.iter().enumerate() {
            let obj = args.get_item(i)?;
            match (pass, kind) {
                (0, ArgKind::InLayers | ArgKind::OutLayers) if remembered[i].is_some() => {
                    let (t, h) = remembered[i].take().expect("checked");
                    read[i] = Read::Table(t, h);
                }
                (0, ArgKind::InLayers) => read[i] = Read::Many(layers(&obj, n, writes_in, src_extent, ctx)?),
                (0, ArgKind::OutLayers) => read[i] = Read::Many(layers(&obj, n, writes_out, dst_extent, ctx)?),
                (1, ArgKind::In) => read[i] = Read::One(view(&obj, n, ctx)?),
                (1, ArgKind::Out) => read[i] = Read::One(dst_view(&obj, n, ctx)?),
                (2, ArgKind::InList) => read[i] = Read::Many(array_list(&obj, n, false, ctx)?),
                (2, ArgKind::OutList) => read[i] = Read::Many(array_list(&obj, n, true, ctx)?),
                _ => {}
            }
        }
    }
    Ok(())
}

/// sglang's check that the source and destination arrays are of one dtype, where the op makes it.
fn same_dtype(spec: &'static OpSpec, read: &[Read]) -> PyResult<()> {
    if !spec.same_dtype {
        return Ok(());
    }
    let one = |k: ArgKind| {
        spec.args.iter().position(|(_, x)| *x == k).and_then(|i| match &read[i] {
            Read::One(h) => Some(h.dtype),
            _ => None,
        })
    };
    if one(ArgKind::In) != one(ArgKind::Out) {
        return Err(PyRuntimeError::new_err("src and dst must have the same dtype"));
    }
    Ok(())
}

/// The index lists, placed for the executor.
enum Lists {
    Kernel((Idx, Idx)),
    Host((Vec<i64>, Vec<i64>)),
    None,
}

/// Every argument as the library takes it, borrowing what was read.
fn values_of<'a>(spec: &'static OpSpec, read: &'a [Read], many: &'a [Vec<RawTensor>], lists: &'a Lists) -> PyResult<Vec<Value<'a>>> {
    let first_list = spec.args.iter().position(|(_, k)| matches!(k, ArgKind::Idx | ArgKind::HostIdx));
    let mut values: Vec<Value<'_>> = Vec::with_capacity(spec.args.len());
    for (i, r) in read.iter().enumerate() {
        values.push(match r {
            Read::One(h) => Value::Tensor(&h.raw),
            Read::Many(_) => Value::Tensors(&many[i]),
            Read::Table(t, _) => Value::Table(t),
            Read::Int(v) => Value::Int(*v),
            Read::Ints(v) => Value::Ints(v),
            Read::Index => {
                let first = first_list == Some(i);
                match lists {
                    Lists::Kernel((si, di)) => Value::Indices(if first { si.indices() } else { di.indices() }),
                    Lists::Host((si, di)) => Value::Ints(if first { si } else { di }),
                    Lists::None => return Err(PyRuntimeError::new_err(format!("{}: index lists missing", spec.name))),
                }
            }
        });
    }
    Ok(values)
}

/// sglang's `copy_all_layer_kv_cache_cpu`: `data_ptrs` (uint64 host addresses of the buffers,
/// trusted as sglang trusts them: each holds the rows the largest location needs), `strides`
/// (int64 bytes per row), `tgt_loc` / `src_loc` (int32 or int64 rows). The type and shape checks
/// with sglang's messages are made by the Python wrapper; here the values.
#[pyfunction]
pub(crate) fn copy_all_layer_kv_cache_cpu(
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
pub(crate) fn checksum(py: Python<'_>, data: &Bound<'_, PyAny>, seed: u64) -> PyResult<u64> {
    let sum = |bytes: &[u8]| -> hicache_io::Result<u64> {
        let keys = hicache_io::integrity::shared_keys(seed, hicache_io::integrity::words(bytes.len()))?;
        Ok(hicache_io::integrity::checksum(bytes, &keys))
    };
    // Read in place, not copied first: a copy of a chunk of megabytes took as long as its sum.
    let bytes = host_bytes(data, "data")?;
    py.detach(|| sum(bytes.slice())).py()
}

/// 64-bit tags of names (FNV-1a of their UTF-8 bytes), as a `numpy.uint64` array: what the L3
/// store folds into an object's checksum to bind it to its key.
#[pyfunction]
pub(crate) fn name_tags<'py>(py: Python<'py>, names: Vec<String>) -> PyResult<Bound<'py, PyAny>> {
    u64_array(py, crate::trailers::tags(&names))
}
