//! Arrays in: DLPack capsules (versioned first, so read-only arrays say so) or numpy's
//! `__array_interface__`.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;

use hicache_io::kvcacheio::{Memory, RawTensor};

use std::ffi::c_void;

// ---- DLPack ------------------------------------------------------------------------------

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct DlDevice {
    pub(crate) device_type: i32,
    pub(crate) device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct DlDataType {
    pub(crate) code: u8,
    pub(crate) bits: u8,
    pub(crate) lanes: u16,
}

#[repr(C)]
pub(crate) struct DlTensor {
    pub(crate) data: *mut c_void,
    pub(crate) device: DlDevice,
    pub(crate) ndim: i32,
    pub(crate) dtype: DlDataType,
    pub(crate) shape: *const i64,
    pub(crate) strides: *const i64,
    pub(crate) byte_offset: u64,
}

/// DLPack ≥ 1.0's `DLManagedTensorVersioned` (capsule `dltensor_versioned`), which can say
/// read-only.
#[repr(C)]
pub(crate) struct DlManagedTensorVersioned {
    pub(crate) version: [u32; 2],
    pub(crate) manager_ctx: *mut c_void,
    pub(crate) deleter: *mut c_void,
    pub(crate) flags: u64,
    pub(crate) dl_tensor: DlTensor,
}

pub(crate) const DL_CPU: i32 = 1;
pub(crate) const DL_CUDA: i32 = 2;
pub(crate) const DL_CUDA_HOST: i32 = 3;
pub(crate) const DL_INT: u8 = 0;
pub(crate) const DL_UINT: u8 = 1;
pub(crate) const DL_FLOAT: u8 = 2;
pub(crate) const DL_BFLOAT: u8 = 4;
pub(crate) const DL_FLAG_READ_ONLY: u64 = 1;

/// An array argument, kept alive (its capsule or the array) while an op runs.
pub(crate) struct Held {
    pub(crate) raw: RawTensor,
    /// DLPack type code and bits per element.
    pub(crate) dtype: (u8, u8),
    pub(crate) device_type: i32,
    pub(crate) device_id: i32,
    pub(crate) writable: bool,
    pub(crate) _keep: Py<PyAny>,
}

impl Held {
    pub(crate) fn is_int64(&self) -> bool {
        self.dtype == (DL_INT, 64)
    }
    pub(crate) fn on_host(&self) -> bool {
        self.device_type == DL_CPU || self.device_type == DL_CUDA_HOST
    }
}

/// The stream a CUDA array is handed over on: the executor's (the caller's current stream).
#[derive(Clone, Copy)]
pub(crate) struct Ctx {
    pub(crate) stream: Option<u64>,
}

/// Reads an array through DLPack (versioned first, so read-only arrays say so), or numpy's
/// `__array_interface__` where DLPack is refused (e.g. non-native byte order).
pub(crate) fn view(obj: &Bound<'_, PyAny>, name: &str, ctx: Ctx) -> PyResult<Held> {
    let h = exported(obj, name, ctx)?;
    inside_storage(obj, name, &h.raw)?;
    Ok(h)
}

/// `(rows, width in bytes, bytes from one row to the next)` of a 2-D array.
pub(crate) type RowShape = (u64, u64, u64);

/// A 2-D array of 1-byte elements whose rows may lie further apart than their width (a torch
/// tensor of strides `(S, 1)`, `S` > the width: vLLM's views of blocks packed with other views'),
/// as `(held, Some((rows, width, S)))`: the held span runs from the first row's start to the last
/// row's end, `(rows - 1) × S + width` bytes, exported as a 1-D view of those bytes (so as [`view`]
/// exports any tensor: the stream order of a CUDA tensor, its storage checked). Any other array
/// is [`view`]'s, with its rows (`S` = width) when it is 2-D, else `None`.
pub(crate) fn view_rows(obj: &Bound<'_, PyAny>, name: &str, ctx: Ctx) -> PyResult<(Held, Option<RowShape>)> {
    if let Some((rows, width, stride)) = strided_rows(obj)? {
        let span = (rows - 1)
            .checked_mul(stride)
            .and_then(|a| a.checked_add(width))
            .ok_or_else(|| PyValueError::new_err(format!("{name}: size overflows")))?;
        // The bytes from the first block's start to the last block's end, as one 1-D view.
        let flat = obj.call_method1(intern!(obj.py(), "as_strided"), ((span,), (1,)))?;
        return Ok((view(&flat, name, ctx)?, Some((rows, width, stride))));
    }
    let h = view(obj, name, ctx)?;
    let elem = u64::from(h.dtype.1 / 8);
    let shape = match h.raw.dims() {
        [r, w] => Some((*r, w.saturating_mul(elem), w.saturating_mul(elem))),
        _ => None,
    };
    Ok((h, shape))
}

/// `(rows, width, S)` of a torch tensor [`view_rows`] takes as strided rows; `None` for
/// anything else (left to [`view`], which refuses what is not contiguous).
fn strided_rows(obj: &Bound<'_, PyAny>) -> PyResult<Option<RowShape>> {
    if !obj.get_type().module()?.to_cow()?.starts_with("torch")
        || !obj.hasattr(intern!(obj.py(), "as_strided"))?
        || !obj.hasattr(intern!(obj.py(), "element_size"))?
    {
        return Ok(None);
    }
    let shape: Vec<i64> = obj.getattr(intern!(obj.py(), "shape"))?.extract()?;
    let strides: Vec<i64> = obj.call_method0(intern!(obj.py(), "stride"))?.extract()?;
    let (&[rows, width], &[s0, s1]) = (shape.as_slice(), strides.as_slice()) else { return Ok(None) };
    let elem: i64 = obj.call_method0(intern!(obj.py(), "element_size"))?.extract()?;
    if elem != 1 || rows < 2 || width < 1 || (s1 != 1 && width > 1) || s0 <= width {
        return Ok(None);
    }
    Ok(Some((rows as u64, width as u64, s0 as u64)))
}

/// Refuses an array whose bytes do not lie in the memory that owns them: a torch view of a
/// storage resized (or freed) since, a numpy view of an array resized with `refcheck=False`.
/// Their exports still name the old span, which may now belong to anything.
fn inside_storage(obj: &Bound<'_, PyAny>, name: &str, raw: &RawTensor) -> PyResult<()> {
    if raw.is_empty() {
        return Ok(());
    }
    let ty = obj.get_type();
    let module = ty.module()?;
    let module = module.to_cow()?;
    let owner: Option<(u64, u64)> = if module.starts_with("torch") && obj.hasattr(intern!(obj.py(), "untyped_storage"))? {
        let st = obj.call_method0(intern!(obj.py(), "untyped_storage"))?;
        Some((st.call_method0(intern!(st.py(), "data_ptr"))?.extract()?, st.call_method0(intern!(st.py(), "nbytes"))?.extract()?))
    } else if module == "numpy" {
        // The array at the root of the view chain owns the bytes, whole (it has no base); a
        // chain that ends in another kind of buffer is not checked.
        let mut root = obj.clone();
        let owned = loop {
            let base = root.getattr(intern!(root.py(), "base"))?;
            if base.is_none() {
                // Owning its data, the root spans exactly its nbytes from its address.
                break root.getattr(intern!(root.py(), "flags"))?.getattr(intern!(root.py(), "owndata"))?.is_truthy()?;
            }
            if base.get_type().module()?.to_cow()? != "numpy" || !base.hasattr(intern!(base.py(), "__array_interface__"))? {
                break false;
            }
            root = base;
        };
        if root.is(obj) || !owned {
            None
        } else {
            let ai = root.getattr(intern!(root.py(), "__array_interface__"))?;
            let (ptr, _ro): (u64, bool) = ai.get_item("data")?.extract()?;
            Some((ptr, root.getattr(intern!(root.py(), "nbytes"))?.extract()?))
        }
    } else {
        None
    };
    if let Some((lo, n)) = owner {
        let end = raw.addr().checked_add(raw.len());
        if raw.addr() < lo || end.is_none_or(|e| e > lo.saturating_add(n)) {
            return Err(PyValueError::new_err(format!(
                "{name}: its {} bytes at {:#x} lie outside the {n} bytes at {lo:#x} that own them (a view of storage resized or freed since)",
                raw.len(),
                raw.addr()
            )));
        }
    }
    Ok(())
}

/// DLPack's type code and bits of a torch dtype whose export needs nothing but its bytes
/// (`None`: another dtype, left to DLPack).
fn torch_dtype(dtype: &str) -> Option<(u8, u8)> {
    Some(match dtype {
        "torch.float16" => (DL_FLOAT, 16),
        "torch.float32" => (DL_FLOAT, 32),
        "torch.float64" => (DL_FLOAT, 64),
        "torch.bfloat16" => (DL_BFLOAT, 16),
        "torch.int8" => (DL_INT, 8),
        "torch.int16" => (DL_INT, 16),
        "torch.int32" => (DL_INT, 32),
        "torch.int64" => (DL_INT, 64),
        "torch.uint8" => (DL_UINT, 8),
        "torch.uint16" => (DL_UINT, 16),
        "torch.uint32" => (DL_UINT, 32),
        "torch.uint64" => (DL_UINT, 64),
        _ => return None,
    })
}

/// A torch tensor in host memory read from its own attributes, which costs a fraction of torch's
/// DLPack export (about 9 µs a tensor, most of an op's time on small calls). Only what that
/// export would give the same answer for: a strided CPU tensor of a plain dtype, without autograd
/// and without a lazy conjugate or negative bit; anything else (`None`) goes through DLPack,
/// which also raises the errors torch gives.
fn torch_host(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Option<Held>> {
    if !obj.get_type().module()?.to_cow()?.starts_with("torch") || !obj.hasattr(intern!(obj.py(), "is_cpu"))? {
        return Ok(None);
    }
    if !obj.getattr(intern!(obj.py(), "is_cpu"))?.is_truthy()?
        || obj.getattr(intern!(obj.py(), "requires_grad"))?.is_truthy()?
        || obj.getattr(intern!(obj.py(), "layout"))?.str()?.to_cow()? != "torch.strided"
        || obj.call_method0(intern!(obj.py(), "is_conj"))?.is_truthy()?
        || obj.call_method0(intern!(obj.py(), "is_neg"))?.is_truthy()?
    {
        return Ok(None);
    }
    let Some(dtype) = torch_dtype(&obj.getattr(intern!(obj.py(), "dtype"))?.str()?.to_cow()?) else { return Ok(None) };
    let addr: u64 = obj.call_method0(intern!(obj.py(), "data_ptr"))?.extract()?;
    let shape: Vec<i64> = obj.getattr(intern!(obj.py(), "shape"))?.extract()?;
    let strides: Vec<i64> = obj.call_method0(intern!(obj.py(), "stride"))?.extract()?;
    let raw = described(name, addr, &shape, Some(&strides), dtype.1 as u64 / 8, Memory::Host)?;
    Ok(Some(Held { raw, dtype, device_type: DL_CPU, device_id: 0, writable: true, _keep: obj.clone().unbind() }))
}

fn exported(obj: &Bound<'_, PyAny>, name: &str, ctx: Ctx) -> PyResult<Held> {
    let py = obj.py();
    if let Some(h) = torch_host(obj, name)? {
        return Ok(h);
    }
    if obj.hasattr(intern!(obj.py(), "__dlpack__"))? {
        let device: Option<(i32, i32)> = obj.call_method0(intern!(obj.py(), "__dlpack_device__")).ok().and_then(|d| d.extract().ok());
        let kw = pyo3::types::PyDict::new(py);
        kw.set_item(intern!(py, "max_version"), (1, 0))?;
        if matches!(device, Some((DL_CUDA, _))) {
            // DLPack: the consumer's stream; the producer orders its pending work before it.
            kw.set_item(intern!(py, "stream"), ctx.stream.unwrap_or(1))?;
        }
        let cap = match obj.call_method(intern!(obj.py(), "__dlpack__"), (), Some(&kw)) {
            Ok(c) => Ok(c),
            // Producers older than DLPack 1.0 take no max_version.
            Err(e) if e.is_instance_of::<PyTypeError>(py) => {
                kw.del_item(intern!(py, "max_version"))?;
                obj.call_method(intern!(obj.py(), "__dlpack__"), (), Some(&kw))
            }
            Err(e) => Err(e),
        };
        match cap {
            Ok(cap) => return from_capsule(&cap, name),
            Err(e) if !obj.hasattr(intern!(obj.py(), "__array_interface__"))? => {
                return Err(PyTypeError::new_err(format!("{name}: DLPack export failed ({e})")))
            }
            Err(_) => {}
        }
    }
    match obj.getattr(intern!(obj.py(), "__array_interface__")) {
        Ok(ai) => from_array_interface(obj, &ai, name),
        Err(_) => Err(PyTypeError::new_err(format!("{name}: expected an array that speaks DLPack"))),
    }
}

pub(crate) fn from_capsule(cap: &Bound<'_, PyAny>, name: &str) -> PyResult<Held> {
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
pub(crate) fn from_array_interface(obj: &Bound<'_, PyAny>, ai: &Bound<'_, PyAny>, name: &str) -> PyResult<Held> {
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
        'f' => DL_FLOAT,
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
pub(crate) fn described(name: &str, addr: u64, shape: &[i64], strides: Option<&[i64]>, elem: u64, memory: Memory) -> PyResult<RawTensor> {
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
pub(crate) fn dst_view(obj: &Bound<'_, PyAny>, name: &str, ctx: Ctx) -> PyResult<Held> {
    let h = view(obj, name, ctx)?;
    if !h.writable {
        return Err(PyValueError::new_err(format!("{name}: destination array is read-only")));
    }
    Ok(h)
}
