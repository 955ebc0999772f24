//! The pool classes: `Device`, `DevicePool`, `HostPool`.

use pyo3::prelude::*;

use hicache_io::geometry::{DeviceGeometry, PageShare, PoolPair, ShareSpans};
use hicache_io::{
    Device, DevicePool, DevicePoolConfig, HostPoolConfig, IoBackend, LayerMap, Profile, SharedDevicePool, SharedHostPool, TransferError,
};

use crate::*;

// ---- pools -------------------------------------------------------------------------------

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

/// A device pool (layer_first, one buffer per live layer and component), zero-initialised.
///
/// Shared by threads as sglang's cache controller shares it (see [`SharedDevicePool`]): every
/// call runs with the GIL released and waits only for calls in flight that touch the same
/// layers and pages, one of them writing.
#[pyclass(name = "DevicePool", module = "hicache_io", frozen)]
pub(crate) struct PyDevicePool {
    inner: SharedDevicePool,
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

/// A host pool in one of sglang's layouts, for a device pool.
///
/// Shared by threads like [`PyDevicePool`] (see [`SharedHostPool`]): a backup waits for a load
/// only where they touch the same layers and pages, page reads and writes for the calls on
/// their pages.
#[pyclass(name = "HostPool", module = "hicache_io", frozen)]
pub(crate) struct PyHostPool {
    inner: SharedHostPool,
    pair: PoolPair,
    device: Device,
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
    /// `(address, bytes)` of component `comp`'s buffer in this process, or `None` when the
    /// executor keeps host pools in its own buffers (wgpu). Valid while the pool lives; call
    /// `synchronize()` before touching it.
    pub(crate) fn host_span(&self, comp: usize) -> PyResult<Option<(u64, u64)>> {
        self.inner.host_span(comp).py()
    }
    /// Where a share of the page of token slots `0..P` lies: component `comp`, host layers
    /// `layers = (start, end)`, bytes `item_bytes = (start, end)` of each item, in the order
    /// (layer, token, byte). Returns `([(buffer, offset, bytes)], shift)`: spans, adjacent ones
    /// merged, and the byte shift from one page to the next.
    pub(crate) fn page_share_spans(&self, comp: u8, layers: (u64, u64), item_bytes: (u64, u64)) -> PyResult<ShareSpans> {
        self.pair.host().page_share_spans(PageShare { comp, layers, bytes: item_bytes }).py()
    }
    /// The integrity checksum of each share `(comp, layer start, layer end, byte start, byte
    /// end)` of each page starting at `indices[0], indices[P], …` (per page, the shares in
    /// order), as a `numpy.uint64` array; keys seeded by `seed` (the storage seed by default).
    #[pyo3(signature = (indices, shares, seed = hicache_io::integrity::STORAGE_SEED))]
    pub(crate) fn share_checksums<'py>(
        &self,
        py: Python<'py>,
        indices: &Bound<'_, PyAny>,
        shares: Vec<(u8, u64, u64, u64, u64)>,
        seed: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let idx = index_list(indices, "Host", Ctx { stream: None })?;
        let shares = page_shares(shares);
        let sums = py.detach(|| self.inner.share_checksums(&idx, &shares, seed)).py()?;
        u64_array(py, sums)
    }
    /// The integrity checksum of each span `get_page_buffer_meta(indices)` names (per page, K then
    /// V), as a `numpy.uint64` array; keys seeded by `seed` (the storage seed by default).
    #[pyo3(signature = (indices, seed = hicache_io::integrity::STORAGE_SEED))]
    pub(crate) fn object_checksums<'py>(&self, py: Python<'py>, indices: &Bound<'_, PyAny>, seed: u64) -> PyResult<Bound<'py, PyAny>> {
        let idx = index_list(indices, "Host", Ctx { stream: None })?;
        let sums = py.detach(|| self.inner.object_checksums(&idx, seed)).py()?;
        u64_array(py, sums)
    }
    /// `(share_checksums(indices, shares, seed), pages_intact(indices))` in one read of the pages'
    /// bytes.
    #[pyo3(signature = (indices, shares, seed = hicache_io::integrity::STORAGE_SEED))]
    pub(crate) fn put_share_checksums<'py>(
        &self,
        py: Python<'py>,
        indices: &Bound<'_, PyAny>,
        shares: Vec<(u8, u64, u64, u64, u64)>,
        seed: u64,
    ) -> PyResult<(Bound<'py, PyAny>, Vec<bool>)> {
        let idx = index_list(indices, "Host", Ctx { stream: None })?;
        let shares = page_shares(shares);
        let (sums, intact) = py.detach(|| self.inner.put_share_checksums(&idx, &shares, seed)).py()?;
        Ok((u64_array(py, sums)?, intact))
    }
    /// `landed_checksums` for objects that hold page shares: `expected` and `eligible` one per
    /// page and share.
    #[pyo3(signature = (indices, shares, expected, eligible, seed = hicache_io::integrity::STORAGE_SEED))]
    pub(crate) fn landed_share_checksums<'py>(
        &self,
        py: Python<'py>,
        indices: &Bound<'_, PyAny>,
        shares: Vec<(u8, u64, u64, u64, u64)>,
        expected: Vec<u64>,
        eligible: Vec<bool>,
        seed: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let idx = index_list(indices, "Host", Ctx { stream: None })?;
        let shares = page_shares(shares);
        let sums = py.detach(|| self.inner.landed_share_checksums(&idx, &shares, seed, &expected, &eligible)).py()?;
        u64_array(py, sums)
    }
    /// `(object_checksums(indices, seed), pages_intact(indices))` in one read of the pages' bytes:
    /// what an L3 store needs before it puts them.
    #[pyo3(signature = (indices, seed = hicache_io::integrity::STORAGE_SEED))]
    pub(crate) fn put_checksums<'py>(
        &self,
        py: Python<'py>,
        indices: &Bound<'_, PyAny>,
        seed: u64,
    ) -> PyResult<(Bound<'py, PyAny>, Vec<bool>)> {
        let idx = index_list(indices, "Host", Ctx { stream: None })?;
        let (sums, intact) = py.detach(|| self.inner.put_checksums(&idx, seed)).py()?;
        Ok((u64_array(py, sums)?, intact))
    }
    /// Private to the L3 store: `put_checksums(indices, seed)` with each object also copied into
    /// the store's staging buffer (`nbytes` bytes at address `addr`, a numpy array the store
    /// owns), object `j` at byte `j * stride`.
    #[pyo3(signature = (indices, addr, nbytes, stride, seed = hicache_io::integrity::STORAGE_SEED))]
    pub(crate) fn _stage_put<'py>(
        &self,
        py: Python<'py>,
        indices: &Bound<'_, PyAny>,
        addr: usize,
        nbytes: usize,
        stride: usize,
        seed: u64,
    ) -> PyResult<(Bound<'py, PyAny>, Vec<bool>)> {
        let idx = index_list(indices, "Host", Ctx { stream: None })?;
        let (sums, intact) = py
            .detach(|| {
                // SAFETY: the store passes its own live, writable numpy buffer of `nbytes` bytes,
                // which nothing else touches during the call (it holds its lock).
                let staging = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, nbytes) };
                self.inner.stage_put(&idx, seed, staging, stride)
            })
            .py()?;
        Ok((u64_array(py, sums)?, intact))
    }
    /// Private to the L3 store: `landed_checksums(indices, expected, eligible, seed)` for objects
    /// it read into its staging buffer (as `_stage_put`'s), the objects with `write[j]` copied
    /// into the pool in the pass that checksums them.
    #[pyo3(signature = (indices, addr, nbytes, stride, expected, eligible, write, seed = hicache_io::integrity::STORAGE_SEED))]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn _land_staged<'py>(
        &self,
        py: Python<'py>,
        indices: &Bound<'_, PyAny>,
        addr: usize,
        nbytes: usize,
        stride: usize,
        expected: Vec<u64>,
        eligible: Vec<bool>,
        write: Vec<bool>,
        seed: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let idx = index_list(indices, "Host", Ctx { stream: None })?;
        let sums = py
            .detach(|| {
                // SAFETY: as in `_stage_put` (read only here).
                let staging = unsafe { std::slice::from_raw_parts(addr as *const u8, nbytes) };
                self.inner.land_staged(&idx, seed, staging, stride, &expected, &eligible, &write)
            })
            .py()?;
        u64_array(py, sums)
    }
    /// After an L3 store wrote the pages of `indices` in place: `object_checksums(indices, seed)`
    /// from one read of the pages, which also records the item checksums of each page all of
    /// whose objects are `eligible` and match `expected` (one per object), and forgets every
    /// other page's.
    #[pyo3(signature = (indices, expected, eligible, seed = hicache_io::integrity::STORAGE_SEED))]
    pub(crate) fn landed_checksums<'py>(
        &self,
        py: Python<'py>,
        indices: &Bound<'_, PyAny>,
        expected: Vec<u64>,
        eligible: Vec<bool>,
        seed: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let idx = index_list(indices, "Host", Ctx { stream: None })?;
        let sums = py.detach(|| self.inner.landed_checksums(&idx, seed, &expected, &eligible)).py()?;
        u64_array(py, sums)
    }
    /// Per page of `indices` (first tokens at `indices[0], indices[P], …`): whether its bytes
    /// still match every item checksum the pool recorded for it (`True` where it has none).
    pub(crate) fn pages_intact(&self, py: Python<'_>, indices: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let idx = index_list(indices, "Host", Ctx { stream: None })?;
        py.detach(|| self.inner.pages_intact(&idx)).py()
    }
    /// Whether the pool keeps item checksums (recorded by backups, verified by loads).
    #[getter]
    pub(crate) fn integrity(&self, py: Python<'_>) -> bool {
        py.detach(|| self.inner.integrity_enabled())
    }
    /// `{"recorded", "verified", "unverified", "mismatched"}` item counts, `None` without
    /// checksums.
    pub(crate) fn integrity_stats(&self, py: Python<'_>) -> Option<std::collections::BTreeMap<&'static str, u64>> {
        py.detach(|| self.inner.integrity_stats()).map(|s| {
            [("recorded", s.recorded), ("verified", s.verified), ("unverified", s.unverified), ("mismatched", s.mismatched)].into()
        })
    }
    /// The recorded checksums of the page starting at token `index` (component, layer, slot;
    /// `None` where unknown); empty without checksums.
    pub(crate) fn page_checksums(&self, py: Python<'_>, index: i64) -> PyResult<Vec<Option<u64>>> {
        py.detach(|| self.inner.page_checksums(index)).py()
    }
    /// `set_from_flat_data_page` verified against the page's carried checksums.
    pub(crate) fn set_from_flat_data_page_checked(
        &self,
        py: Python<'_>,
        index: i64,
        data_page: &Bound<'_, PyAny>,
        checksums: Vec<Option<u64>>,
    ) -> PyResult<()> {
        let data_page = data_arg(data_page, "data_page")?;
        py.detach(|| self.inner.set_from_flat_data_page_checked(index, &data_page, &checksums)).py()
    }
    /// Records the checksums of the pages starting at `indices` (token slots) from their bytes in
    /// host memory (written in place by a store that verified them).
    pub(crate) fn recompute_page_checksums(&self, py: Python<'_>, indices: Vec<i64>) -> PyResult<()> {
        py.detach(|| self.inner.recompute_page_checksums(&indices)).py()
    }
    /// Forgets the checksums of the pages starting at `indices` (written in place, unverified).
    pub(crate) fn forget_page_checksums(&self, py: Python<'_>, indices: Vec<i64>) -> PyResult<()> {
        py.detach(|| self.inner.forget_page_checksums(&indices)).py()
    }
    /// Fault injection: writes `data` into component `comp` at byte `offset` without touching
    /// the checksums.
    pub(crate) fn inject_host_corruption(&self, py: Python<'_>, comp: usize, offset: u64, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let data = data_arg(data, "data")?;
        py.detach(|| self.inner.inject_host_corruption(comp, offset, &data)).py()
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

/// Page shares as Python passes them: `(comp, layer start, layer end, byte start, byte end)`.
fn page_shares(shares: Vec<(u8, u64, u64, u64, u64)>) -> Vec<PageShare> {
    shares.into_iter().map(|(comp, l0, l1, b0, b1)| PageShare { comp, layers: (l0, l1), bytes: (b0, b1) }).collect()
}
