//! The host pool's item checksums from outside a transfer: what storage code and tests need to
//! read, recompute, forget or (for fault injection) corrupt them. Transfers themselves record
//! and verify them inside their copies (see [`crate::integrity`]).

use super::HostPool;
use crate::error::{Result, TransferError};
use crate::integrity::{self, IntegrityStats};
use crate::PageObjects;

impl HostPool<'_> {
    /// Whether this pool keeps item checksums: its config (or the profile's default) asked for
    /// them and its executor's copies compute them.
    pub fn integrity_enabled(&self) -> bool {
        self.checksums.is_some()
    }

    /// Counters of the pool's checksums since it was made, once the queued transfers' checksums
    /// have settled; `None` without checksums.
    pub fn integrity_stats(&self) -> Option<IntegrityStats> {
        let s = self.checksums.as_ref()?;
        // As of every queued transfer (executors that settle checksums when transfers complete).
        if let Err(e) = self.device.settle_checksums() {
            log::error!("integrity_stats: waiting for queued transfers: {e}");
        }
        Some(s.stats())
    }

    /// The recorded checksum of host item `(host_index, layer, comp)` (`host_index` in slots; in
    /// indexer pages for the DSA indexer) once the queued transfers are done; `None` when the
    /// pool has none for it.
    pub fn item_checksum(&self, host_index: u64, layer: u64, comp: u8) -> Result<Option<u64>> {
        let Some(s) = &self.checksums else { return Ok(None) };
        let slot = self.item_slot(s, host_index, layer, comp)?;
        // As of every queued transfer (their checksums are settled when they complete).
        self.device.settle_checksums()?;
        Ok(s.expected(slot))
    }

    fn item_slot(&self, s: &integrity::ChecksumTable, host_index: u64, layer: u64, comp: u8) -> Result<usize> {
        let g = self.pair.host();
        s.slot(host_index, layer, comp).ok_or_else(|| {
            TransferError::InvalidConfig(format!(
                "no host item ({host_index}, layer {layer}, component {comp}): the pool has {} slots, {} layers, {} components",
                g.slots(),
                g.layer_num(),
                g.kind().components()
            ))
        })
    }

    /// The host items of the page starting at token `index`, as `(host index, layer, comp)` in
    /// the order of [`HostPool::page_checksums`]: component, then layer, then slot.
    fn page_items(&self, index: i64) -> Result<Vec<(u64, u64, u8)>> {
        self.flat_page(index)?;
        Ok(self.items_of_page(index as u64).collect())
    }

    /// [`HostPool::page_items`] of a page already checked to start at token `index`.
    fn items_of_page(&self, index: u64) -> impl Iterator<Item = (u64, u64, u8)> + '_ {
        let g = self.pair.host();
        let std::ops::Range { start: first, end } = self.units_of_page(index);
        (0..g.kind().components() as u8).flat_map(move |c| (0..g.layer_num()).flat_map(move |l| (first..end).map(move |u| (u, l, c))))
    }

    /// The host units (slots; indexer pages for the DSA indexer) of the page starting at token
    /// `index`.
    fn units_of_page(&self, index: u64) -> std::ops::Range<u64> {
        let g = self.pair.host();
        let per = g.index_page_size();
        let first = (index / g.page_size()) * per;
        first..first + per
    }

    /// The recorded checksums of the items of the page starting at token `index` once the
    /// queued transfers are done (component, then layer, then slot; `None` where unknown): what a page carries to storage beside
    /// [`HostPool::get_data_page`]'s bytes, for [`HostPool::set_from_flat_data_page_checked`].
    /// Empty when the pool keeps no checksums.
    pub fn page_checksums(&self, index: i64) -> Result<Vec<Option<u64>>> {
        let items = self.page_items(index)?;
        let Some(s) = &self.checksums else { return Ok(Vec::new()) };
        self.device.settle_checksums()?;
        items.into_iter().map(|(u, l, c)| Ok(s.expected(self.item_slot(s, u, l, c)?))).collect()
    }

    /// The checksums of items' bytes as they are in host memory now (after the pool's queued
    /// transfers).
    fn item_sums(&self, keys: &integrity::Keys, items: &[(u64, u64, u8)]) -> Result<Vec<u64>> {
        let mut bytes = self.host_bytes()?;
        items.iter().map(|&item| self.item_sum(&mut bytes, keys, item)).collect()
    }

    /// The checksum of one host item's bytes, read through `bytes`.
    fn item_sum(
        &self,
        bytes: &mut super::pages::HostBytes<'_>,
        keys: &integrity::Keys,
        (unit, layer, comp): (u64, u64, u8),
    ) -> Result<u64> {
        let g = self.pair.host();
        self.item_sum_at(bytes, keys, (g.buffer_of(comp) as usize, g.addr(comp, layer)), unit)
    }

    /// [`HostPool::item_sum`] of slot `unit` of the layer and component whose buffer and
    /// addresses are given.
    #[inline]
    fn item_sum_at(
        &self,
        bytes: &mut super::pages::HostBytes<'_>,
        keys: &integrity::Keys,
        (buffer, addr): (usize, crate::geometry::Addr),
        unit: u64,
    ) -> Result<u64> {
        let (chunk, heads) = (self.pair.host().chunk_bytes(), self.pair.host().head_num());
        (0..heads)
            .try_fold(0u64, |sum, h| Ok(sum.wrapping_add(integrity::item_part(bytes.get(buffer, addr.offset(unit, h), chunk)?, h, keys))))
    }

    /// [`HostPool::object_checksums`] and [`HostPool::pages_intact`] of the same pages in one
    /// read of their bytes: what an L3 store needs before it puts pages. An item that is exactly
    /// one object's bytes (a DSA indexer page of one layer; keys seeded by the storage seed) is
    /// summed once for both. Returns (per object, per page).
    pub(crate) fn put_checksums(&self, indices: &[i64], seed: u64) -> Result<(Vec<u64>, Vec<bool>)> {
        let (meta, keys, per) = self.object_spans(indices, seed)?;
        self.page_pass(indices, Some((&meta, seed)), PageCheck::Intact, |bytes, k, out| {
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
            let summer = self.share_summer(indices, shares, seed)?;
            check_staging(summer.objects(indices), summer.widest(), staging.len(), stride)?;
            return self.page_pass(indices, None, PageCheck::Intact, |bytes, k, out| {
                summer.stage_page(bytes, indices, k, (&mut *staging, stride), out)
            });
        }
        let (meta, keys, per) = self.object_spans(indices, seed)?;
        check_staging(meta.len(), longest(&meta), staging.len(), stride)?;
        self.page_pass(indices, Some((&meta, seed)), PageCheck::Intact, |bytes, k, out| {
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
            let summer = self.share_summer(indices, shares, seed)?;
            let n = summer.objects(indices);
            check_staging(n, summer.widest(), staging.len(), stride)?;
            let check = landed_writes(expected, eligible, write, n)?;
            let pass = |bytes: &mut super::pages::HostBytes<'_>, k, out: &mut Vec<u64>| {
                summer.land_page(bytes, indices, k, (staging, stride), write, out)
            };
            return Ok(self.page_pass(indices, None, check, pass)?.0);
        }
        let (meta, keys, per) = self.object_spans(indices, seed)?;
        check_staging(meta.len(), longest(&meta), staging.len(), stride)?;
        let check = landed_writes(expected, eligible, write, meta.len())?;
        let (sums, _) = self.page_pass(indices, Some((&meta, seed)), check, |bytes, k, out| {
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
        self.page_pass(indices, None, PageCheck::Intact, |bytes, k, out| sums.sum_page(bytes, indices, k, out))
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
        let (sums, _) = self.page_pass(indices, Some((&meta, seed)), check, |bytes, k, out| {
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
        let (sums, _) = self.page_pass(indices, None, check, |bytes, k, out| sums.sum_page(bytes, indices, k, out))?;
        Ok(sums)
    }

    /// One read of each page starting at `indices[0], indices[P], …` (checked by the caller):
    /// `objects(bytes, page number, out)` appends the page's object checksums, then the page's
    /// items are checked against the recorded checksums (`Intact`: per page, whether they match)
    /// or settled (`Landed`: recorded for a page whose objects are eligible and match, forgotten
    /// for every other; per page, whether trusted), from bytes the objects' pass just read.
    /// `reuse`: the objects' spans and seed, where an item that is exactly one object takes its
    /// sum. Returns (object checksums, per page).
    fn page_pass(
        &self,
        indices: &[i64],
        reuse: Option<(ObjectSpans<'_>, u64)>,
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
            // same keys takes that object's sum.
            let objs = reuse.filter(|(_, seed)| g.head_num() == 1 && s.keys().seed() == *seed).map(|(meta, _)| &meta[first..sums.len()]);
            let want = match check {
                PageCheck::Intact => PageItems::Check,
                PageCheck::Landed { .. } if trusted => PageItems::Record,
                PageCheck::Landed { .. } => PageItems::Forget,
            };
            let (ok, items) = self.page_items_pass(s, &mut bytes, page[0], want, objs.map(|o| (o, &sums[first..])))?;
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
    fn page_items_pass(
        &self,
        s: &integrity::ChecksumTable,
        bytes: &mut super::pages::HostBytes<'_>,
        first: i64,
        want: PageItems,
        objs: Option<(ObjectSpans<'_>, &[u64])>,
    ) -> Result<(bool, u64)> {
        let g = self.pair.host();
        let (mut ok, mut items) = (true, 0u64);
        let units = self.units_of_page(first as u64);
        for comp in 0..g.kind().components() as u8 {
            let buffer = g.buffer_of(comp) as usize;
            for layer in 0..g.layer_num() {
                let (entries, addr) = (s.layer_entries(layer, comp), g.addr(comp, layer));
                for unit in units.clone() {
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
                    let span = (buffer, addr.offset(unit, 0), g.chunk_bytes());
                    let sum = match objs.and_then(|(o, sums)| Some(sums[o.iter().position(|o| *o == span)?])) {
                        Some(sum) => sum,
                        None => self.item_sum_at(bytes, s.keys(), (buffer, addr), unit)?,
                    };
                    match expected {
                        Some(w) => ok &= sum == w,
                        None => {
                            integrity::ChecksumTable::record_entry(e, sum);
                            items += 1;
                        }
                    }
                }
            }
        }
        Ok((ok, items))
    }

    /// For each page whose first token is `indices[0], indices[P], …` (as
    /// [`HostPool::get_page_buffer_meta`] takes them): whether its bytes in host memory still match
    /// every item checksum the pool recorded for it, once the queued transfers are done (`true`
    /// for items it has none for, and for every page of a pool without checksums). What an L3
    /// store asks before it puts pages: bytes damaged in host memory after their backup must not
    /// reach storage under a checksum of their own. Only items with a recorded checksum are read.
    pub fn pages_intact(&self, indices: &[i64]) -> Result<Vec<bool>> {
        self.get_page_buffer_meta(indices)?;
        if self.checksums.is_none() {
            return Ok(vec![true; indices.len() / self.pair.host().page_size().max(1) as usize]);
        }
        Ok(self.page_pass(indices, None, PageCheck::Intact, |_, _, _| Ok(()))?.1)
    }

    /// Records (or, for `None`, forgets) the checksums of host items `(host_index, 0, 0)`, after
    /// the queued transfers (their checksums settle first): for items whose bytes and checksums
    /// someone else wrote, verified by the next load inside its copy. Every item is checked
    /// before one is recorded. A no-op without checksums.
    pub(crate) fn set_item_checksums(&self, items: impl Iterator<Item = (u64, Option<u64>)> + Clone) -> Result<()> {
        let Some(s) = &self.checksums else { return Ok(()) };
        let slots = items.clone().map(|(u, _)| self.item_slot(s, u, 0, 0)).collect::<Result<Vec<_>>>()?;
        self.device.settle_checksums()?;
        for (slot, (_, sum)) in slots.into_iter().zip(items) {
            match sum {
                Some(sum) => s.record(slot, sum),
                None => s.forget(slot),
            }
        }
        Ok(())
    }

    /// Recomputes and records the checksums of the page starting at token `index` from its bytes
    /// in host memory: for pages written by something that does not record them (an L3 store
    /// writing the pool's memory in place) once their bytes are known good (the store verified
    /// them). A no-op without checksums.
    pub fn recompute_page_checksums(&mut self, index: i64) -> Result<()> {
        self.record_page_checksums(&[index])
    }

    /// [`HostPool::recompute_page_checksums`] for the pages starting at each of `indices`, for
    /// callers holding them otherwise (one wait for the pool's transfers, not one a page).
    pub(super) fn record_page_checksums(&self, indices: &[i64]) -> Result<()> {
        let items = indices.iter().map(|&i| self.page_items(i)).collect::<Result<Vec<_>>>()?;
        let Some(s) = self.checksums.clone() else { return Ok(()) };
        let mut bytes = self.host_bytes()?;
        for items in items {
            for &item in &items {
                let sum = self.item_sum(&mut bytes, s.keys(), item)?;
                s.record(self.item_slot(&s, item.0, item.1, item.2)?, sum);
            }
            s.count([items.len() as u64, 0, 0, 0]);
        }
        Ok(())
    }

    /// Forgets the checksums of the page starting at token `index` (its bytes were written by
    /// something unverified): loads read it as unverified, never as corrupt.
    pub fn forget_page_checksums(&mut self, index: i64) -> Result<()> {
        self.forget_checksums_of_page(index)
    }
    /// [`HostPool::forget_page_checksums`] for callers holding the page otherwise.
    pub(super) fn forget_checksums_of_page(&self, index: i64) -> Result<()> {
        let items = self.page_items(index)?;
        if let Some(s) = &self.checksums {
            // After the transfers queued so far (a backup recording these items).
            self.device.settle_checksums()?;
            for (u, l, c) in items {
                s.forget(self.item_slot(s, u, l, c)?);
            }
        }
        Ok(())
    }

    /// [`HostPool::set_from_flat_data_page`] with the checksums the page carries (from
    /// [`HostPool::page_checksums`] of the pool that wrote it; `None` entries are unverified):
    /// writes the page, then checks every item against them. A mismatch is an
    /// [`TransferError::Integrity`] naming the items (`device_index` is the page's first slot),
    /// whose checksums are then forgotten; the matching items are recorded. Without checksums
    /// in this pool it is `set_from_flat_data_page`; an empty `checksums` (what a pool without
    /// checksums carries) is every item unverified.
    pub fn set_from_flat_data_page_checked(&mut self, index: i64, data: &[u8], checksums: &[Option<u64>]) -> Result<()> {
        self.set_page_checked(index, data, checksums)
    }
    /// [`HostPool::set_from_flat_data_page_checked`] for callers holding the page otherwise.
    pub(super) fn set_page_checked(&self, index: i64, data: &[u8], checksums: &[Option<u64>]) -> Result<()> {
        let items = self.page_items(index)?;
        let unverified = vec![None; if checksums.is_empty() { items.len() } else { 0 }];
        let checksums = if checksums.is_empty() { &unverified[..] } else { checksums };
        if self.checksums.is_some() && checksums.len() != items.len() {
            return Err(TransferError::BufferSize {
                what: "page item checksums".into(),
                expected: items.len() as u64,
                actual: checksums.len() as u64,
            });
        }
        self.write_flat_page(index, data)?;
        let Some(s) = self.checksums.clone() else { return Ok(()) };
        let sink = integrity::MismatchSink::default();
        let sums = self.item_sums(s.keys(), &items)?;
        let mut n = [0u64; 4];
        for ((item, want), sum) in items.into_iter().zip(checksums).zip(sums) {
            let slot = self.item_slot(&s, item.0, item.1, item.2)?;
            match want {
                Some(w) if *w != sum => {
                    s.forget(slot);
                    n[3] += 1;
                    let (layer, component, host_index) = (item.1, item.2, item.0);
                    sink.push(integrity::ItemMismatch {
                        layer,
                        component,
                        host_index,
                        device_index: index as u64,
                        expected: *w,
                        found: sum,
                    });
                }
                Some(_) => {
                    s.record(slot, sum);
                    n[0] += 1;
                }
                None => s.forget(slot),
            }
        }
        s.count(n);
        sink.error().map_or(Ok(()), Err)
    }

    /// Fault injection: writes `bytes` into component `comp` at byte `offset` **without**
    /// touching the checksums, as a fault in host memory would (tests and `hicache-io fuzz`
    /// use it to prove loads catch it).
    pub fn inject_host_corruption(&mut self, comp: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        self.corrupt_host(comp, offset, bytes)
    }
    /// [`HostPool::inject_host_corruption`] for callers holding the pool otherwise.
    pub(super) fn corrupt_host(&self, comp: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        let buf = self.buffer(comp)?;
        self.device.write(buf, offset, bytes)
    }

    /// Fault injection: flips the bits `xor` of the recorded checksum of host item
    /// `(host_index, layer, comp)`. `Ok(false)` when it has none (nothing to corrupt).
    pub fn inject_checksum_corruption(&mut self, host_index: u64, layer: u64, comp: u8, xor: u64) -> Result<bool> {
        let Some(s) = &self.checksums else { return Ok(false) };
        let slot = self.item_slot(s, host_index, layer, comp)?;
        // The checksum as the queued transfers leave it.
        self.device.settle_checksums()?;
        Ok(s.corrupt(slot, xor))
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
enum PageCheck<'a> {
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
