//! `HostPool`: the page objects an L3 store moves and their sums, one API over both ways a page
//! is cut into objects: one per component (`shares=None`: the spans `get_page_buffer_meta`
//! names, per page K then V) or the given shares of it (`shares`: a list of `(comp, layer start,
//! layer end, byte start, byte end)`, the unified key scheme's objects). Each call reads the
//! pages once; sums come as `numpy.uint64` arrays, one per object (page by page), page verdicts
//! as lists of bools; keys seeded by `seed` (the storage seed by default).

use pyo3::prelude::*;

use hicache_io::geometry::{PageShare, ShareSpans};
use hicache_io::PageObjects;

use crate::*;

type Share = (u8, u64, u64, u64, u64);

/// Page shares as Python passes them: `(comp, layer start, layer end, byte start, byte end)`.
fn page_shares(shares: Option<Vec<Share>>) -> Option<Vec<PageShare>> {
    shares.map(|s| s.into_iter().map(|(comp, l0, l1, b0, b1)| PageShare { comp, layers: (l0, l1), bytes: (b0, b1) }).collect())
}

fn objects(shares: &Option<Vec<PageShare>>) -> PageObjects<'_> {
    match shares {
        Some(s) => PageObjects::Shares(s),
        None => PageObjects::Components,
    }
}

fn host_indices(indices: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    index_list(indices, "Host", Ctx { stream: None })
}

#[pymethods]
impl PyHostPool {
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
    /// Each object's integrity checksum, for the pages starting at `indices[0], indices[P], …`.
    #[pyo3(signature = (indices, shares = None, seed = hicache_io::integrity::STORAGE_SEED))]
    pub(crate) fn object_sums<'py>(
        &self,
        py: Python<'py>,
        indices: &Bound<'_, PyAny>,
        shares: Option<Vec<Share>>,
        seed: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (idx, shares) = (host_indices(indices)?, page_shares(shares));
        let sums = py.detach(|| self.inner.object_sums(&idx, objects(&shares), seed)).py()?;
        u64_array(py, sums)
    }
    /// `(object_sums(...), pages_intact(indices))` in one read of the pages: what an L3 store
    /// needs before it puts them.
    #[pyo3(signature = (indices, shares = None, seed = hicache_io::integrity::STORAGE_SEED))]
    pub(crate) fn put_object_sums<'py>(
        &self,
        py: Python<'py>,
        indices: &Bound<'_, PyAny>,
        shares: Option<Vec<Share>>,
        seed: u64,
    ) -> PyResult<(Bound<'py, PyAny>, Vec<bool>)> {
        let (idx, shares) = (host_indices(indices)?, page_shares(shares));
        let (sums, intact) = py.detach(|| self.inner.put_object_sums(&idx, objects(&shares), seed)).py()?;
        Ok((u64_array(py, sums)?, intact))
    }
    /// After an L3 store wrote the pages in place: `object_sums(...)` from one read of the pages,
    /// which also records the item checksums of each page all of whose objects are `eligible`
    /// and match `expected` (one each per object), and forgets every other page's.
    #[pyo3(signature = (indices, expected, eligible, shares = None, seed = hicache_io::integrity::STORAGE_SEED))]
    pub(crate) fn landed_object_sums<'py>(
        &self,
        py: Python<'py>,
        indices: &Bound<'_, PyAny>,
        expected: Vec<u64>,
        eligible: Vec<bool>,
        shares: Option<Vec<Share>>,
        seed: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (idx, shares) = (host_indices(indices)?, page_shares(shares));
        let sums = py.detach(|| self.inner.landed_object_sums(&idx, objects(&shares), seed, &expected, &eligible)).py()?;
        u64_array(py, sums)
    }
    /// Private to the L3 store: `put_object_sums(indices, shares, seed)` with each object also copied into
    /// the store's staging buffer (`nbytes` bytes at address `addr`, a numpy array the store
    /// owns), object `j` at byte `j * stride`.
    #[pyo3(signature = (indices, addr, nbytes, stride, shares = None, seed = hicache_io::integrity::STORAGE_SEED))]
    pub(crate) fn _stage_put<'py>(
        &self,
        py: Python<'py>,
        indices: &Bound<'_, PyAny>,
        addr: usize,
        nbytes: usize,
        stride: usize,
        shares: Option<Vec<Share>>,
        seed: u64,
    ) -> PyResult<(Bound<'py, PyAny>, Vec<bool>)> {
        let (idx, shares) = (host_indices(indices)?, page_shares(shares));
        let (sums, intact) = py
            .detach(|| {
                // SAFETY: the store passes its own live, writable numpy buffer of `nbytes` bytes,
                // which nothing else touches during the call (the store gives each of its buffers
                // to one batch at a time, and its calls hold its lock).
                let staging = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, nbytes) };
                self.inner.stage_put(&idx, objects(&shares), seed, staging, stride)
            })
            .py()?;
        Ok((u64_array(py, sums)?, intact))
    }
    /// Private to the L3 store: `landed_object_sums(indices, expected, eligible, shares, seed)` for objects
    /// it read into its staging buffer (as `_stage_put`'s), the objects with `write[j]` copied
    /// into the pool in the pass that checksums them.
    #[pyo3(signature = (indices, addr, nbytes, stride, expected, eligible, write, shares = None, seed = hicache_io::integrity::STORAGE_SEED))]
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
        shares: Option<Vec<Share>>,
        seed: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (idx, shares) = (host_indices(indices)?, page_shares(shares));
        let sums = py
            .detach(|| {
                // SAFETY: as in `_stage_put` (read only here).
                let staging = unsafe { std::slice::from_raw_parts(addr as *const u8, nbytes) };
                self.inner.land_staged(&idx, objects(&shares), seed, staging, stride, &expected, &eligible, &write)
            })
            .py()?;
        u64_array(py, sums)
    }
}
