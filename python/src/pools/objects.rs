//! `HostPool`: the page objects an L3 store moves and their sums, one API over both ways a page
//! is cut into objects: one per component (`shares=None`: the spans `get_page_buffer_meta`
//! names, per page K then V) or the given shares of it (`shares`: a list of `(comp, layer start,
//! layer end, byte start, byte end)`, the unified key scheme's objects). Each call reads the
//! pages once; sums come as `numpy.uint64` arrays, one per object (page by page), page verdicts
//! as lists of bools; keys seeded by `seed` (the storage seed by default). For the store's sealed
//! objects (each with its trailer in a slot of its staging buffer) the staging call also writes
//! the trailers and the landing call checks them, one verdict an object (`numpy.uint8`).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use hicache_io::geometry::{HostGeometry, PageShare, ShareSpans};
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

/// Sealed objects' trailers for `keys` (one an object of the pages at `idx`) fit `nbytes` bytes of
/// slots of `stride` bytes, each `at` bytes in: checked before a pass writes anything.
fn check_sealed(
    host: &HostGeometry,
    idx: &[i64],
    shares: &Option<Vec<PageShare>>,
    keys: usize,
    (nbytes, stride, at): (usize, usize, usize),
) -> PyResult<()> {
    // As `get_page_buffer_meta` cuts a page: its template's spans, one per buffer each.
    let per = shares.as_ref().map_or_else(|| host.flat_page_template().0.len() * host.buffers(), Vec::len);
    let pages = idx.len() / host.page_size().max(1) as usize;
    if pages.checked_mul(per) != Some(keys) {
        return Err(PyValueError::new_err(format!("{keys} keys for {pages} pages of {per} objects")));
    }
    trailers::check(keys, nbytes, stride, at).map_err(PyValueError::new_err)
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
    /// owns), object `j` at byte `j * stride`. `seal = (at, keys)`: each object's trailer (the
    /// magic, its checksum bound to `keys[j]`) also written `at` bytes into its slot, in the same
    /// call (one key an object; refused before anything is written where the slots do not fit).
    #[pyo3(signature = (indices, addr, nbytes, stride, shares = None, seed = hicache_io::integrity::STORAGE_SEED, seal = None))]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn _stage_put<'py>(
        &self,
        py: Python<'py>,
        indices: &Bound<'_, PyAny>,
        addr: usize,
        nbytes: usize,
        stride: usize,
        shares: Option<Vec<Share>>,
        seed: u64,
        seal: Option<(usize, Vec<String>)>,
    ) -> PyResult<(Bound<'py, PyAny>, Vec<bool>)> {
        let (idx, shares) = (host_indices(indices)?, page_shares(shares));
        if let Some((at, keys)) = &seal {
            check_sealed(self.pair.host(), &idx, &shares, keys.len(), (nbytes, stride, *at))?;
        }
        let (sums, intact) = py.detach(|| -> PyResult<_> {
            // SAFETY: the store passes its own live, writable numpy buffer of `nbytes` bytes,
            // which nothing else touches during the call (the store gives each of its buffers
            // to one batch at a time, and its calls hold its lock).
            let staging = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, nbytes) };
            let (sums, intact) = self.inner.stage_put(&idx, objects(&shares), seed, staging, stride).py()?;
            if let Some((at, keys)) = &seal {
                // One key an object was checked above from the pool's objects a page; were the
                // pass to answer another count, no trailer is written (`zip` would stop short).
                if keys.len() != sums.len() {
                    return Err(PyValueError::new_err(format!("{} keys for {} sealed objects", keys.len(), sums.len())));
                }
                trailers::seal(staging, stride, *at, &sums, &trailers::tags(keys));
            }
            Ok((sums, intact))
        })?;
        Ok((u64_array(py, sums)?, intact))
    }
    /// Private to the L3 store: after a get of sealed objects into its staging buffer (as
    /// `_stage_put` lays them out, trailers `at` bytes into each slot), the objects' trailers read
    /// and bound to `keys`, the objects with `write[j]` landed (as `_land_staged`, each trusted
    /// where its trailer vouches for what landed), and each object's verdict: 0 not read whole
    /// (`whole[j]` false), 1 verified, 2 unverified (read without a trailer, `with_trailer[j]`
    /// false, or with one of an earlier format), 3 corrupt. Returns (checksums, verdicts as
    /// bytes), one of each an object; refused before any byte moves where the lists are not one
    /// an object or the slots do not fit.
    #[pyo3(signature = (indices, addr, nbytes, stride, at, keys, whole, with_trailer, write, shares = None, seed = hicache_io::integrity::STORAGE_SEED))]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn _land_sealed<'py>(
        &self,
        py: Python<'py>,
        indices: &Bound<'_, PyAny>,
        addr: usize,
        nbytes: usize,
        stride: usize,
        at: usize,
        keys: Vec<String>,
        whole: Vec<bool>,
        with_trailer: Vec<bool>,
        write: Vec<bool>,
        shares: Option<Vec<Share>>,
        seed: u64,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let (idx, shares) = (host_indices(indices)?, page_shares(shares));
        let n = keys.len();
        if whole.len() != n || with_trailer.len() != n {
            return Err(PyValueError::new_err(format!("{n} keys, {} read-whole flags, {} trailer flags", whole.len(), with_trailer.len())));
        }
        check_sealed(self.pair.host(), &idx, &shares, n, (nbytes, stride, at))?;
        let (sums, verdicts) = py.detach(|| -> PyResult<_> {
            // SAFETY: as in `_stage_put` (read only here).
            let staging = unsafe { std::slice::from_raw_parts(addr as *const u8, nbytes) };
            let tags = trailers::tags(&keys);
            let (expected, eligible) = trailers::expected(staging, stride, at, &tags, &whole, &with_trailer);
            let sums = self.inner.land_staged(&idx, objects(&shares), seed, staging, stride, &expected, &eligible, &write).py()?;
            let verdicts = trailers::verdicts(staging, stride, at, &tags, &sums, &whole, &with_trailer);
            Ok((sums, verdicts))
        })?;
        Ok((u64_array(py, sums)?, numpy_array(py, &verdicts, "u1")?))
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
