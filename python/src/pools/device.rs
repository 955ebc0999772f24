//! `Device` and `DevicePool`.

use pyo3::prelude::*;

use hicache_io::geometry::DeviceGeometry;
use hicache_io::{Device, DevicePool, DevicePoolConfig, LayerMap, SharedDevicePool};

use crate::*;

/// An executor instance: `"cpu"`, `"wgpu"`, `"cuda"` or `"auto"`.
#[pyclass(name = "Device", module = "hicache_io")]
pub(crate) struct PyDevice {
    pub(crate) inner: Device,
}

#[pymethods]
impl PyDevice {
    #[new]
    #[pyo3(signature = (name = "auto"))]
    pub(crate) fn new(py: Python<'_>, name: &str) -> PyResult<Self> {
        let inner = py.detach(|| match name {
            "auto" => Ok(Device::auto()),
            other => other.parse().and_then(Device::open),
        });
        Ok(PyDevice { inner: inner.py()? })
    }
    /// `cpu`, `wgpu` or `cuda`.
    #[getter]
    pub(crate) fn name(&self) -> &'static str {
        self.inner.name()
    }
    /// Adapter / device description.
    pub(crate) fn describe(&self) -> String {
        self.inner.describe()
    }
    pub(crate) fn __repr__(&self) -> String {
        format!("Device({:?}: {})", self.inner.name(), self.inner.describe())
    }
    /// Test support: destroys a wgpu executor's device, as a driver reset or an unplugged GPU
    /// would lose it; every later call on it and its pools raises `DeviceLostError`.
    pub(crate) fn _lose(&self) -> PyResult<()> {
        match &self.inner {
            Device::Wgpu(w) => {
                w.device().destroy();
                Ok(())
            }
            _ => Err(pyo3::exceptions::PyValueError::new_err("only a wgpu device can be lost on purpose")),
        }
    }
}

/// A device pool (layer_first, one buffer per live layer and component), zero-initialised.
///
/// Shared by threads as sglang's cache controller shares it (see [`SharedDevicePool`]): every
/// call runs with the GIL released and waits only for calls in flight that touch the same
/// layers and pages, one of them writing.
#[pyclass(name = "DevicePool", module = "hicache_io", frozen)]
pub(crate) struct PyDevicePool {
    pub(crate) inner: SharedDevicePool,
    geometry: DeviceGeometry,
}

#[pymethods]
impl PyDevicePool {
    #[new]
    #[pyo3(signature = (device, kind, bytes_per_token, slots, page_size, layer_num, layer_shard = None, skipped = None, drafts = 0))]
    pub(crate) fn new(
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
        let pool = py.detach(|| DevicePool::new(&dev, &config)).py()?;
        Ok(PyDevicePool { geometry: pool.geometry().clone(), inner: SharedDevicePool::new(pool) })
    }
    /// Bytes per slot (the indexer page for the DSA indexer).
    #[getter]
    pub(crate) fn item_bytes(&self) -> u64 {
        self.geometry.item_bytes()
    }
    /// Slots per layer buffer.
    #[getter]
    pub(crate) fn slots(&self) -> u64 {
        self.geometry.slots()
    }
    /// Buffers per component (live target layers, then drafts).
    #[getter]
    pub(crate) fn buffer_count(&self) -> usize {
        self.geometry.buffer_count()
    }
    /// A copy of buffer `slot` of component `comp`, as a `numpy.uint8` array.
    pub(crate) fn read_buffer<'py>(&self, py: Python<'py>, comp: usize, slot: usize) -> PyResult<Bound<'py, PyAny>> {
        let v = py.detach(|| self.inner.read_buffer(comp, slot)).py()?;
        u8_array(py, &v)
    }
    /// Replaces buffer `slot` of component `comp` (exactly its size, any bytes-like object).
    pub(crate) fn write_buffer(&self, py: Python<'_>, comp: usize, slot: usize, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let data = data_arg(data, "data")?;
        py.detach(|| self.inner.write_buffer(comp, slot, &data)).py()
    }
}
