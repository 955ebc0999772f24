//! The pool classes: `Device`, `DevicePool`, `HostPool`.
//!
//! Rooms: `device` (`Device`, `DevicePool`), `host` (`HostPool`: construction, transfers, pages,
//! buffers), `objects` (`HostPool`: the page objects an L3 store moves and their sums),
//! `integrity` (`HostPool`: item checksums, fault injection). `HostPool`'s methods are spread
//! over its rooms (pyo3's `multiple-pymethods`).

mod device;
mod host;
mod integrity;
mod objects;

use pyo3::prelude::*;

use hicache_io::TransferError;

pub(crate) use device::*;
pub(crate) use host::*;

use crate::*;

/// Bytes out as a writable 1-D numpy array of `dtype` (over a `bytearray`: one copy in all).
pub(crate) fn numpy_array<'py>(py: Python<'py>, bytes: &[u8], dtype: &str) -> PyResult<Bound<'py, PyAny>> {
    let kw = pyo3::types::PyDict::new(py);
    kw.set_item("dtype", dtype)?;
    py.import("numpy")?.call_method("frombuffer", (pyo3::types::PyByteArray::new(py, bytes),), Some(&kw))
}

/// Bytes out as a writable 1-D `numpy.uint8` array.
pub(crate) fn u8_array<'py>(py: Python<'py>, bytes: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    numpy_array(py, bytes, "uint8")
}

/// Values out as a writable 1-D little-endian `numpy.uint64` array.
pub(crate) fn u64_array<'py>(py: Python<'py>, values: impl IntoIterator<Item = u64>) -> PyResult<Bound<'py, PyAny>> {
    let bytes: Vec<u8> = values.into_iter().flat_map(u64::to_le_bytes).collect();
    numpy_array(py, &bytes, "<u8")
}

pub(crate) fn parse<T: std::str::FromStr<Err = TransferError>>(s: &str) -> PyResult<T> {
    s.parse().py()
}
