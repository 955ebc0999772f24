//! `HostPool`: the item checksums its backups record and its loads verify, and fault injection.

use pyo3::prelude::*;

use crate::*;

#[pymethods]
impl PyHostPool {
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
}
