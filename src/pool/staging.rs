//! The passes an L3 store makes over its page objects in host memory (what `objects` answers
//! with): each page read once for its objects' checksums, with the pool's item checksums checked
//! (a put) or settled (a get's landing) in the same read, optionally through the store's staging
//! buffer (`stage_put`, `land_staged`). Kept apart from `checksums` (the item table itself).

use super::HostPool;
use crate::error::{Result, TransferError};
use crate::integrity;
use crate::PageObjects;

impl HostPool<'_> {
    /// [`HostPool::object_checksums`] and [`HostPool::pages_intact`] of the same pages in one
    /// read of their bytes: what an L3 store needs before it puts pages. An item that is exactly
    /// one object's bytes (a DSA indexer page of one layer; keys seeded by the storage seed) is
    /// summed once for both. Returns (per object, per page).
    pub(crate) fn put_checksums(&self, indices: &[i64], seed: u64) -> Result<(Vec<u64>, Vec<bool>)> {
        let (meta, keys, per) = self.object_spans(indices, seed)?;
        self.page_pass(indices, Reuse::Objects(&meta, seed), PageCheck::Intact, |bytes, k, out| {
            for &(c, off, len) in &meta[k * per..(k + 1) * per] {
                out.push(integrity::checksum(bytes.get(c, off, len)?, &keys));
            }
            Ok(())
        })
    }

    /// [`HostPool::put_object_sums`] with each object's bytes also copied into `staging`, object
    /// `j` (page by page, in the order of `objects`) at byte `j · stride`, in the same read: an L3
    /// store puts each object and the trailer it writes after it as one span. Refused before any
    /// byte moves when an object is longer than `stride` or `staging` is too short.
    pub fn stage_put(
        &self,
        indices: &[i64],
        objects: PageObjects<'_>,
        seed: u64,
        staging: &mut [u8],
        stride: usize,
    ) -> Result<(Vec<u64>, Vec<bool>)> {
        if let PageObjects::Shares(shares) = objects {
            let summer = self.share_summer_with_items(indices, shares, seed)?;
            check_staging(summer.objects(indices), summer.widest(), staging.len(), stride)?;
            // The page's item checks from the staging copy's own read, where it sums them.
            let items = std::cell::RefCell::new(Vec::new());
            return self.page_pass(indices, Reuse::Items(&items), PageCheck::Intact, |bytes, k, out| {
                summer.stage_page(bytes, indices, k, (&mut *staging, stride), out, &items)
            });
        }
        let (meta, keys, per) = self.object_spans(indices, seed)?;
        check_staging(meta.len(), longest(&meta), staging.len(), stride)?;
        self.page_pass(indices, Reuse::Objects(&meta, seed), PageCheck::Intact, |bytes, k, out| {
            for (i, &(c, off, len)) in meta[k * per..(k + 1) * per].iter().enumerate() {
                let from = bytes.get(c, off, len)?;
                let at = (k * per + i) * stride;
                let to = &mut staging[at..at + from.len()];
                // SAFETY: two slices of the same length in different allocations (the pool's
                // memory, the caller's staging buffer).
                out.push(unsafe { integrity::copy_and_sum(from.as_ptr(), to.as_mut_ptr(), to.len(), 0, &keys, false) });
            }
            Ok(())
        })
    }

    /// [`HostPool::landed_object_sums`] for objects an L3 store read into `staging` (object `j` at
    /// byte `j · stride`, as [`HostPool::stage_put`] lays them out): the objects with `write[j]`
    /// are copied into the pool in the pass that checksums them (their bytes are read once, from
    /// the staging buffer), then the pages are settled as there. Returns each object's checksum
    /// (0 for those not written).
    #[allow(clippy::too_many_arguments)]
    pub fn land_staged(
        &self,
        indices: &[i64],
        objects: PageObjects<'_>,
        seed: u64,
        staging: &[u8],
        stride: usize,
        expected: &[u64],
        eligible: &[bool],
        write: &[bool],
    ) -> Result<Vec<u64>> {
        if let PageObjects::Shares(shares) = objects {
            let summer = self.share_summer_with_items(indices, shares, seed)?;
            let n = summer.objects(indices);
            check_staging(n, summer.widest(), staging.len(), stride)?;
            let check = landed_writes(expected, eligible, write, n)?;
            // The items recorded from the landing copy's own sums, where it takes them.
            let items = std::cell::RefCell::new(Vec::new());
            let pass = |bytes: &mut super::pages::HostBytes<'_>, k, out: &mut Vec<u64>| {
                summer.land_page(bytes, indices, k, (staging, stride), write, out, &items)
            };
            return Ok(self.page_pass(indices, Reuse::Items(&items), check, pass)?.0);
        }
        let (meta, keys, per) = self.object_spans(indices, seed)?;
        check_staging(meta.len(), longest(&meta), staging.len(), stride)?;
        let check = landed_writes(expected, eligible, write, meta.len())?;
        let (sums, _) = self.page_pass(indices, Reuse::Objects(&meta, seed), check, |bytes, k, out| {
            for (i, &(c, off, len)) in meta[k * per..(k + 1) * per].iter().enumerate() {
                let j = k * per + i;
                if !write[j] {
                    out.push(0);
                    continue;
                }
                let from = &staging[j * stride..j * stride + len as usize];
                // Copied and checksummed in one pass over the staging bytes.
                // SAFETY: two slices of the same length in different allocations (the staging
                // buffer, the pool's memory).
                let sum = bytes.put_with(c, off, len, |to| unsafe {
                    integrity::copy_and_sum(from.as_ptr(), to.as_mut_ptr(), to.len(), 0, &keys, false)
                })?;
                out.push(sum);
            }
            Ok(())
        })?;
        Ok(sums)
    }

    /// [`HostPool::share_checksums`] and [`HostPool::pages_intact`] of the same pages in one read
    /// of their bytes. Returns (per page and share, per page).
    pub(crate) fn put_share_checksums(
        &self,
        indices: &[i64],
        shares: &[crate::geometry::PageShare],
        seed: u64,
    ) -> Result<(Vec<u64>, Vec<bool>)> {
        let sums = self.share_summer(indices, shares, seed)?;
        self.page_pass(indices, Reuse::Nothing, PageCheck::Intact, |bytes, k, out| sums.sum_page(bytes, indices, k, out))
    }

    /// After an L3 store wrote the pages starting at `indices[0], indices[P], …` in place: each
    /// object's checksum ([`HostPool::object_checksums`], keys seeded by `seed`) from one read of
    /// the pages, and in the same read the pool's item checksums settled: a page all of whose
    /// objects are `eligible` (read whole, with a trailer of this format) and match `expected` is
    /// trusted and its items' checksums are recorded; every other page's are forgotten (its loads
    /// read as unverified, never as corrupt). `expected` and `eligible`: one per object.
    pub(crate) fn landed_checksums(&self, indices: &[i64], seed: u64, expected: &[u64], eligible: &[bool]) -> Result<Vec<u64>> {
        let (meta, keys, per) = self.object_spans(indices, seed)?;
        let check = PageCheck::landed(expected, eligible, meta.len())?;
        let (sums, _) = self.page_pass(indices, Reuse::Objects(&meta, seed), check, |bytes, k, out| {
            for &(c, off, len) in &meta[k * per..(k + 1) * per] {
                out.push(integrity::checksum(bytes.get(c, off, len)?, &keys));
            }
            Ok(())
        })?;
        Ok(sums)
    }

    /// [`HostPool::landed_checksums`] for objects that hold page shares
    /// ([`HostPool::share_checksums`]): `expected` and `eligible` one per page and share.
    pub(crate) fn landed_share_checksums(
        &self,
        indices: &[i64],
        shares: &[crate::geometry::PageShare],
        seed: u64,
        expected: &[u64],
        eligible: &[bool],
    ) -> Result<Vec<u64>> {
        let sums = self.share_summer(indices, shares, seed)?;
        let check = PageCheck::landed(expected, eligible, sums.objects(indices))?;
        let (sums, _) = self.page_pass(indices, Reuse::Nothing, check, |bytes, k, out| sums.sum_page(bytes, indices, k, out))?;
        Ok(sums)
    }

    /// One read of each page starting at `indices[0], indices[P], …` (checked by the caller):
    /// `objects(bytes, page number, out)` appends the page's object checksums, then the page's
    /// items are checked against the recorded checksums (`Intact`: per page, whether they match)
    /// or settled (`Landed`: recorded for a page whose objects are eligible and match, forgotten
    /// for every other; per page, whether trusted), from bytes the objects' pass just read.
    /// `reuse`: what the objects' pass already knows of the items (see [`Reuse`]). Returns
    /// (object checksums, per page).
    pub(super) fn page_pass(
        &self,
        indices: &[i64],
        reuse: Reuse<'_>,
        check: PageCheck<'_>,
        mut objects: impl FnMut(&mut super::pages::HostBytes<'_>, usize, &mut Vec<u64>) -> Result<()>,
    ) -> Result<(Vec<u64>, Vec<bool>)> {
        let p = self.pair.host().page_size().max(1) as usize;
        let pages = indices.len() / p;
        let table = self.checksums.clone();
        if table.is_some() {
            // After the transfers queued so far (a backup recording these items).
            self.device.settle_checksums()?;
        }
        let g = self.pair.host();
        let mut bytes = self.host_bytes()?;
        let (mut sums, mut flags) = (Vec::new(), Vec::with_capacity(pages));
        for (k, page) in indices.chunks_exact(p).enumerate() {
            let first = sums.len();
            objects(&mut bytes, k, &mut sums)?;
            let Some(s) = &table else {
                flags.push(matches!(check, PageCheck::Intact));
                continue;
            };
            let trusted = match check {
                PageCheck::Intact => true,
                PageCheck::Landed { expected, eligible } => {
                    (first..sums.len()).all(|j| eligible.get(j) == Some(&true) && expected.get(j) == Some(&sums[j]))
                }
            };
            // The objects' spans, where an item that is exactly one object's bytes under the
            // same keys takes that object's sum; or the items' sums the objects' pass took.
            let objs = match reuse {
                Reuse::Objects(meta, seed) if g.head_num() == 1 && s.keys().seed() == seed => Some(&meta[first..sums.len()]),
                _ => None,
            };
            let known = match reuse {
                Reuse::Items(cell) => Some(cell.borrow()),
                _ => None,
            };
            let want = match check {
                PageCheck::Intact => PageItems::Check,
                PageCheck::Landed { .. } if trusted => PageItems::Record,
                PageCheck::Landed { .. } => PageItems::Forget,
            };
            let known = known.as_deref().map(Vec::as_slice).filter(|k| !k.is_empty());
            let (ok, items) = self.page_items_pass(s, &mut bytes, page[0], want, objs.map(|o| (o, &sums[first..])), known)?;
            if items > 0 {
                s.count([items, 0, 0, 0]);
            }
            flags.push(match check {
                PageCheck::Intact => ok,
                PageCheck::Landed { .. } => trusted,
            });
        }
        Ok((sums, flags))
    }

    /// The item checks of the page starting at token `first` ([`HostPool::page_pass`]): each item
    /// checked against its recorded checksum (those without one skipped), its checksum recorded,
    /// or forgotten. `objs`: the page's object spans and sums, where an item that is exactly one
    /// object's bytes takes that object's sum. Returns (every checked item matched, items
    /// recorded). The page's items in `items_of_page` order (component, layer, slot), each
    /// layer's entries and address found once (per item they cost as much as its sum did).
    /// `known`: each item's sum, in that order, where the objects' pass took them.
    fn page_items_pass(
        &self,
        s: &integrity::ChecksumTable,
        bytes: &mut super::pages::HostBytes<'_>,
        first: i64,
        want: PageItems,
        objs: Option<(ObjectSpans<'_>, &[u64])>,
        known: Option<&[u64]>,
    ) -> Result<(bool, u64)> {
        let g = self.pair.host();
        let (mut ok, mut items) = (true, 0u64);
        let units = self.units_of_page(first as u64);
        let chunk = g.chunk_bytes();
        for comp in 0..g.kind().components() as u8 {
            let buffer = g.buffer_of(comp) as usize;
            for layer in 0..g.layer_num() {
                let (entries, addr) = (s.layer_entries(layer, comp), g.addr(comp, layer));
                // Where this layer's items start in `known`.
                let layer_first = (comp as usize * g.layer_num() as usize + layer as usize) * (units.end - units.start) as usize;
                // Each item: skipped, or its sum taken (reused from an object that is exactly its
                // bytes, else by `$sum(offset)`) and checked or recorded.
                macro_rules! items {
                    ($sum:expr) => {
                        for (unit, at) in addr.offsets(units.clone()) {
                            let Some(e) = usize::try_from(unit).ok().and_then(|u| entries.get(u)) else {
                                // Outside the table: the error that names the item.
                                self.item_slot(s, unit, layer, comp)?;
                                continue;
                            };
                            let expected = match want {
                                PageItems::Check => match integrity::ChecksumTable::entry_expected(e) {
                                    Some(w) => Some(w),
                                    None => continue,
                                },
                                PageItems::Forget => {
                                    integrity::ChecksumTable::forget_entry(e);
                                    continue;
                                }
                                PageItems::Record => None,
                            };
                            let span = (buffer, at, chunk);
                            let taken = known.and_then(|k| k.get(layer_first + (unit - units.start) as usize)).copied();
                            let sum = match taken.or_else(|| objs.and_then(|(o, sums)| Some(sums[o.iter().position(|o| *o == span)?]))) {
                                Some(sum) => sum,
                                None => $sum(at)?,
                            };
                            match expected {
                                Some(w) => ok &= sum == w,
                                None => {
                                    integrity::ChecksumTable::record_entry(e, sum);
                                    items += 1;
                                }
                            }
                        }
                    };
                }
                // Where the pool's memory is at hand, the layer's items of this page are read as
                // one region, each summed by one loop over its head chunks: bounds and calls per
                // item cost as much as a 1 KiB item's sum.
                match self.layer_region(bytes, buffer, addr, units.clone())? {
                    Some(region) => items!(|at: u64| region.item_sum(at, s.keys())),
                    None => items!(|at: u64| self.item_sum_from(bytes, s.keys(), (buffer, addr), at)),
                }
            }
        }
        Ok((ok, items))
    }
}

/// The items of one layer and component of a page, in place: the bytes from `lo` on, each item's
/// `heads` chunks of `chunk` bytes `stride` apart.
struct LayerRegion<'b> {
    bytes: &'b [u8],
    lo: u64,
    chunk: usize,
    heads: usize,
    stride: usize,
}

impl LayerRegion<'_> {
    /// The checksum of the item whose first chunk starts at byte `at` of the buffer.
    fn item_sum(&self, at: u64, keys: &integrity::Keys) -> Result<u64> {
        let from = at.checked_sub(self.lo).and_then(|rel| self.bytes.get(usize::try_from(rel).ok()?..));
        from.and_then(|from| integrity::strided_item_sum(from, self.stride, self.heads, self.chunk, keys)).ok_or_else(|| {
            TransferError::BufferSize {
                what: "page span".into(),
                expected: at.saturating_add(self.chunk as u64),
                actual: self.lo.saturating_add(self.bytes.len() as u64),
            }
        })
    }
}

impl HostPool<'_> {
    /// The items `units` of one layer and component at `addr` as one region of the pool's
    /// memory; `None` where it is not in this process or a size does not fit.
    fn layer_region<'b>(
        &self,
        bytes: &'b super::pages::HostBytes<'_>,
        buffer: usize,
        addr: crate::geometry::Addr,
        units: std::ops::Range<u64>,
    ) -> Result<Option<LayerRegion<'b>>> {
        let g = self.pair.host();
        let shape = (usize::try_from(g.chunk_bytes()), usize::try_from(g.head_num()), usize::try_from(addr.head_stride));
        let (Some((lo, len)), (Ok(chunk), Ok(heads), Ok(stride))) = (self.items_extent(addr, units), shape) else {
            return Ok(None);
        };
        Ok(bytes.in_place(buffer, lo, len)?.map(|bytes| LayerRegion { bytes, lo, chunk, heads, stride }))
    }

    /// `(first byte, bytes)` of the items `units` of one layer and component at `addr`: from the
    /// lowest item's first head chunk to the highest's last; `None` where there are none or a
    /// size overflows.
    fn items_extent(&self, addr: crate::geometry::Addr, units: std::ops::Range<u64>) -> Option<(u64, u64)> {
        let g = self.pair.host();
        let item = g.head_num().checked_sub(1)?.checked_mul(addr.head_stride)?.checked_add(g.chunk_bytes())?;
        let (lo, end) =
            addr.offsets(units).try_fold((u64::MAX, 0u64), |(lo, end), (_, at)| Some((lo.min(at), end.max(at.checked_add(item)?))))?;
        Some((lo, end.checked_sub(lo)?))
    }
}

/// `(buffer, offset, bytes)` of each object of a call's pages.
type ObjectSpans<'a> = &'a [(usize, u64, u64)];

/// The objects of a call's pages ([`HostPool::get_page_buffer_meta`]), the key stream of
/// `seed` covering the longest, and how many objects a page has.
type Objects = (Vec<(usize, u64, u64)>, std::sync::Arc<integrity::Keys>, usize);

impl HostPool<'_> {
    fn object_spans(&self, indices: &[i64], seed: u64) -> Result<Objects> {
        let meta = self.get_page_buffer_meta(indices)?;
        let keys = integrity::shared_keys(seed, integrity::words(longest(&meta) as usize))?;
        let per = meta.len() / (indices.len() / self.pair.host().page_size().max(1) as usize).max(1);
        Ok((meta, keys, per))
    }
}

/// The longest object's bytes.
fn longest(meta: ObjectSpans<'_>) -> u64 {
    meta.iter().map(|m| m.2).max().unwrap_or(0)
}

/// [`PageCheck::landed`] for a staged get whose `write` says, per object of `objects`, whether it
/// is copied into the pool.
fn landed_writes<'a>(expected: &'a [u64], eligible: &'a [bool], write: &[bool], objects: usize) -> Result<PageCheck<'a>> {
    if write.len() != objects {
        return Err(TransferError::BufferSize { what: "objects to write".into(), expected: objects as u64, actual: write.len() as u64 });
    }
    PageCheck::landed(expected, eligible, objects)
}

/// A staging buffer of `staging` bytes holds `objects` objects of at most `longest` bytes at
/// `j · stride`.
fn check_staging(objects: usize, longest: u64, staging: usize, stride: usize) -> Result<()> {
    if longest > stride as u64 {
        return Err(TransferError::BufferSize {
            what: "staging stride (an object's bytes)".into(),
            expected: longest,
            actual: stride as u64,
        });
    }
    let need = (objects as u64).saturating_mul(stride as u64);
    if need > staging as u64 {
        return Err(TransferError::BufferSize { what: "staging buffer".into(), expected: need, actual: staging as u64 });
    }
    Ok(())
}

/// What a page pass's objects pass knows of the page's items ([`HostPool::page_pass`]).
#[derive(Clone, Copy)]
pub(super) enum Reuse<'a> {
    /// Nothing: the items are read.
    Nothing,
    /// The objects' spans and seed: an item that is exactly one object's bytes under the same
    /// keys takes that object's sum.
    Objects(ObjectSpans<'a>, u64),
    /// After each page, the sums of its items (in the table's order) where the pass took them
    /// (empty where it did not).
    Items(&'a std::cell::RefCell<Vec<u64>>),
}

/// What [`HostPool::page_items_pass`] does with a page's items.
#[derive(Clone, Copy)]
enum PageItems {
    /// Compare each with its recorded checksum (a put's check).
    Check,
    /// Record each one's checksum (a landing that was trusted).
    Record,
    /// Forget each one's checksum (a landing that was not).
    Forget,
}

/// What [`HostPool::page_pass`] does with a page's items.
#[derive(Clone, Copy)]
pub(super) enum PageCheck<'a> {
    /// Compare them with their recorded checksums.
    Intact,
    /// Record them where the page's objects are all eligible and match `expected`, else forget
    /// them (one entry per object).
    Landed { expected: &'a [u64], eligible: &'a [bool] },
}

impl<'a> PageCheck<'a> {
    /// `Landed`, once `expected` and `eligible` have one entry per object.
    fn landed(expected: &'a [u64], eligible: &'a [bool], objects: usize) -> Result<PageCheck<'a>> {
        for (what, len) in [("expected object checksums", expected.len()), ("eligible objects", eligible.len())] {
            if len != objects {
                return Err(TransferError::BufferSize { what: what.into(), expected: objects as u64, actual: len as u64 });
            }
        }
        Ok(PageCheck::Landed { expected, eligible })
    }
}
