//! `HostPool`: construction, transfers, page helpers, buffers and shape.

use pyo3::prelude::*;

use hicache_io::geometry::PoolPair;
use hicache_io::{Device, HostPoolConfig, IoBackend, Profile, SharedHostPool};

use crate::*;

/// A host pool in one of sglang's layouts, for a device pool.
///
/// Shared by threads like [`PyDevicePool`] (see [`SharedHostPool`]): a backup waits for a load
/// only where they touch the same layers and pages, page reads and writes for the calls on
/// their pages.
#[pyclass(name = "HostPool", module = "hicache_io", frozen)]
pub(crate) struct PyHostPool {
    pub(crate) inner: SharedHostPool,
    pub(crate) pair: PoolPair,
    pub(crate) device: Device,
}

pub(crate) fn io(name: &str) -> PyResult<IoBackend> {
    parse(name)
}

/// A pool call's index lists (host memory) and io backend.
pub(crate) fn pool_args(host: &Bound<'_, PyAny>, device: &Bound<'_, PyAny>, io_backend: &str) -> PyResult<(Vec<i64>, Vec<i64>, IoBackend)> {
    let ctx = Ctx { stream: None };
    Ok((index_list(host, "Host", ctx)?, index_list(device, "Device", ctx)?, io(io_backend)?))
}

#[pymethods]
impl PyHostPool {
    #[new]
    #[pyo3(signature = (device_pool, layout, size, head_num = 1, profile = "extended", integrity = None))]
    pub(crate) fn new(
        py: Python<'_>,
        device_pool: &PyDevicePool,
        layout: &str,
        size: u64,
        head_num: u64,
        profile: &str,
        integrity: Option<bool>,
    ) -> PyResult<Self> {
        let config = HostPoolConfig { layout: parse(layout)?, size, head_num, profile: parse::<Profile>(profile)?, integrity };
        let pool = py.detach(|| SharedHostPool::new(&device_pool.inner, &config)).py()?;
        Ok(PyHostPool { pair: pool.pair().clone(), device: pool.device().clone(), inner: pool })
    }
    #[pyo3(signature = (device_pool, host_indices, device_indices, layer_id, io_backend = "kernel"))]
    pub(crate) fn load_to_device_per_layer(
        &self,
        py: Python<'_>,
        device_pool: &PyDevicePool,
        host_indices: &Bound<'_, PyAny>,
        device_indices: &Bound<'_, PyAny>,
        layer_id: usize,
        io_backend: &str,
    ) -> PyResult<()> {
        let (hi, di, io) = pool_args(host_indices, device_indices, io_backend)?;
        py.detach(|| self.inner.load_to_device_per_layer(&device_pool.inner, &hi, &di, layer_id, io)).py()
    }
    #[pyo3(signature = (device_pool, host_indices, device_indices, layer_id, io_backend = "kernel"))]
    pub(crate) fn load_draft_to_device(
        &self,
        py: Python<'_>,
        device_pool: &PyDevicePool,
        host_indices: &Bound<'_, PyAny>,
        device_indices: &Bound<'_, PyAny>,
        layer_id: usize,
        io_backend: &str,
    ) -> PyResult<()> {
        let (hi, di, io) = pool_args(host_indices, device_indices, io_backend)?;
        py.detach(|| self.inner.load_draft_to_device(&device_pool.inner, &hi, &di, layer_id, io)).py()
    }
    #[pyo3(signature = (device_pool, host_indices, device_indices, io_backend = "kernel"))]
    pub(crate) fn backup_from_device_all_layer(
        &self,
        py: Python<'_>,
        device_pool: &PyDevicePool,
        host_indices: &Bound<'_, PyAny>,
        device_indices: &Bound<'_, PyAny>,
        io_backend: &str,
    ) -> PyResult<()> {
        let (hi, di, io) = pool_args(host_indices, device_indices, io_backend)?;
        py.detach(|| self.inner.backup_from_device_all_layer(&device_pool.inner, &hi, &di, io)).py()
    }
    #[pyo3(signature = (device_pool, host_indices, device_indices, layer_id, io_backend = "kernel", is_draft = false))]
    pub(crate) fn backup_from_device_per_layer(
        &self,
        py: Python<'_>,
        device_pool: &PyDevicePool,
        host_indices: &Bound<'_, PyAny>,
        device_indices: &Bound<'_, PyAny>,
        layer_id: usize,
        io_backend: &str,
        is_draft: bool,
    ) -> PyResult<()> {
        let (hi, di, io) = pool_args(host_indices, device_indices, io_backend)?;
        py.detach(|| self.inner.backup_from_device_per_layer(&device_pool.inner, &hi, &di, layer_id, is_draft, io)).py()
    }
    /// sglang `get_data_page(index, flat=True)`: the flat page, a `numpy.uint8` array.
    pub(crate) fn get_data_page<'py>(&self, py: Python<'py>, index: i64) -> PyResult<Bound<'py, PyAny>> {
        let v = py.detach(|| self.inner.get_data_page(index)).py()?;
        u8_array(py, &v)
    }
    /// sglang `get_dummy_flat_data_page()`: zeros of one flat page.
    pub(crate) fn get_dummy_flat_data_page<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let v = py.detach(|| self.inner.get_dummy_flat_data_page()).py()?;
        u8_array(py, &v)
    }
    /// sglang `set_from_flat_data_page(index, data_page)`.
    pub(crate) fn set_from_flat_data_page(&self, py: Python<'_>, index: i64, data_page: &Bound<'_, PyAny>) -> PyResult<()> {
        let data_page = data_arg(data_page, "data_page")?;
        py.detach(|| self.inner.set_from_flat_data_page(index, &data_page)).py()
    }
    /// sglang `get_page_buffer_meta(indices)`: `(component, byte offset, bytes)` per span.
    pub(crate) fn get_page_buffer_meta(&self, py: Python<'_>, indices: &Bound<'_, PyAny>) -> PyResult<Vec<(usize, u64, u64)>> {
        let idx = index_list(indices, "Host", Ctx { stream: None })?;
        py.detach(|| self.inner.get_page_buffer_meta(&idx)).py()
    }
    /// Private to the L3 store: raises as `get_page_buffer_meta(indices)` would, and returns
    /// nothing (a batch's check without a tuple per span).
    pub(crate) fn _check_pages(&self, py: Python<'_>, indices: &Bound<'_, PyAny>) -> PyResult<()> {
        let idx = index_list(indices, "Host", Ctx { stream: None })?;
        py.detach(|| self.inner.get_page_buffer_meta(&idx).map(drop)).py()
    }
    /// Private to the L3 store: the address of each span `get_page_buffer_meta(indices)` names
    /// (the pages' objects, page by page), for a pool in this process's memory; raises as that
    /// call would, or when a component is not in this process's memory (wgpu).
    pub(crate) fn _object_addrs(&self, py: Python<'_>, indices: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let idx = index_list(indices, "Host", Ctx { stream: None })?;
        py.detach(|| {
            let meta = self.inner.get_page_buffer_meta(&idx)?;
            let mut bases = Vec::new();
            meta.iter()
                .map(|&(c, off, _)| {
                    while bases.len() <= c {
                        bases.push(self.inner.host_span(bases.len())?);
                    }
                    // The span lies inside its buffer (get_page_buffer_meta checked it).
                    bases[c].map(|(base, _)| base + off).ok_or_else(|| {
                        hicache_io::TransferError::InvalidConfig(format!("component {c} of this host pool is not in this process's memory"))
                    })
                })
                .collect::<hicache_io::Result<Vec<u64>>>()
        })
        .py()
    }
    /// Test support: holds the pages starting at host tokens `indices` (every layer; `write`: as
    /// a backup would) while `callback()` runs, so a test can show which calls wait for them.
    /// The callback must make no call on these pools on its own thread.
    pub(crate) fn _while_held<'py>(
        &self,
        py: Python<'py>,
        indices: &Bound<'_, PyAny>,
        write: bool,
        callback: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let idx = index_list(indices, "Host", Ctx { stream: None })?;
        let _hold = py.detach(|| self.inner.hold_pages(&idx, write));
        callback.call0()
    }
    /// A copy of component `comp`'s buffer, as a `numpy.uint8` array.
    pub(crate) fn read_buffer<'py>(&self, py: Python<'py>, comp: usize) -> PyResult<Bound<'py, PyAny>> {
        let v = py.detach(|| self.inner.read_buffer(comp)).py()?;
        u8_array(py, &v)
    }
    /// Replaces component `comp`'s buffer (exactly its size).
    pub(crate) fn write_buffer(&self, py: Python<'_>, comp: usize, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let data = data_arg(data, "data")?;
        py.detach(|| self.inner.write_buffer(comp, &data)).py()
    }
    /// Bytes of one component buffer.
    #[getter]
    pub(crate) fn buffer_bytes(&self) -> u64 {
        self.pair.host().buffer_bytes()
    }
    /// Token slots after sglang's rounding.
    #[getter]
    pub(crate) fn size(&self) -> u64 {
        self.pair.host().size()
    }
    /// Host layers `L`.
    #[getter]
    pub(crate) fn layer_num(&self) -> u64 {
        self.pair.host().layer_num()
    }
    /// `mha`, `mla` or `dsa`.
    #[getter]
    pub(crate) fn kind(&self) -> &'static str {
        self.pair.host().kind().name()
    }
    /// The host layout, sglang's name.
    #[getter]
    pub(crate) fn layout(&self) -> &'static str {
        self.pair.host().layout().name()
    }
    /// Tokens per page `P`.
    #[getter]
    pub(crate) fn page_size(&self) -> u64 {
        self.pair.host().page_size()
    }
    /// Heads (page_head) or head groups (page_first_direct_hg, MHA page_unified); 1 otherwise.
    #[getter]
    pub(crate) fn head_num(&self) -> u64 {
        self.pair.host().head_num()
    }
    /// Bytes per (slot, layer) of the host pool.
    #[getter]
    pub(crate) fn item_bytes(&self) -> u64 {
        self.pair.host().item_bytes()
    }
    /// Host buffers: 2 (K, V) for MHA, 1 otherwise and for page_unified (K and V in one).
    #[getter]
    pub(crate) fn components(&self) -> usize {
        self.pair.host().buffers()
    }
    /// The executor's name (`cpu`, `wgpu`, `cuda`).
    #[getter]
    pub(crate) fn executor(&self) -> &'static str {
        self.device.name()
    }
    /// The device pool's layers as this host pool holds them: `(layer_num, owned start, owned
    /// end, drafts, skipped)`.
    #[getter]
    pub(crate) fn layer_map(&self) -> (usize, usize, usize, usize, Vec<bool>) {
        let m = self.pair.device().layers();
        let (start, end) = m.owned();
        (m.layer_num, start, end, m.drafts, m.skipped.clone())
    }
    /// Waits for every transfer queued on the pool's executor, then raises `IntegrityError` for
    /// the items of plain loads that failed their checksums since the last report (cuda: its
    /// plain calls return once enqueued, before their checksums arrive; other executors raise
    /// from the call). Another call's failed CUDA index check stays pending for that call's own
    /// report.
    pub(crate) fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let dev = self.device.clone();
        py.detach(|| dev.wait_idle().and_then(|_| dev.integrity_reports())).py()
    }
}
