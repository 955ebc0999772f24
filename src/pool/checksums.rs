//! The host pool's item checksums from outside a transfer: what storage code and tests need to
//! read, recompute or forget. Transfers themselves record and verify them inside their copies
//! (see [`crate::integrity`]); an L3 store's passes over its page objects are in `staging`, fault
//! injection in `faults`.

use super::staging::PageCheck;
use super::HostPool;
use crate::error::{Result, TransferError};
use crate::integrity::{self, IntegrityStats};

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

    pub(super) fn item_slot(&self, s: &integrity::ChecksumTable, host_index: u64, layer: u64, comp: u8) -> Result<usize> {
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
    pub(super) fn units_of_page(&self, index: u64) -> std::ops::Range<u64> {
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
        let addr = g.addr(comp, layer);
        self.item_sum_from(bytes, keys, (g.buffer_of(comp) as usize, addr), addr.offset(unit, 0))
    }

    /// [`HostPool::item_sum`] of the item of the layer and component whose buffer and addresses
    /// are given, its first head chunk at byte `first` of the buffer (`addr.offset(unit, 0)`).
    #[inline]
    pub(super) fn item_sum_from(
        &self,
        bytes: &mut super::pages::HostBytes<'_>,
        keys: &integrity::Keys,
        (buffer, addr): (usize, crate::geometry::Addr),
        first: u64,
    ) -> Result<u64> {
        let (chunk, heads) = (self.pair.host().chunk_bytes(), self.pair.host().head_num());
        (0..heads).try_fold(0u64, |sum, h| {
            Ok(sum.wrapping_add(integrity::item_part(bytes.get(buffer, first + h * addr.head_stride, chunk)?, h, keys)))
        })
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
        Ok(self.page_pass(indices, super::staging::Reuse::Nothing, PageCheck::Intact, |_, _, _| Ok(()))?.1)
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
}
