//! Page helpers of the host pool (sglang's `get_data_page`, `set_from_flat_data_page`,
//! `get_dummy_flat_data_page`, `get_page_buffer_meta`), used by L3 storage backends that move
//! whole pages.
//!
//! Support and byte order, per pool kind and layout (a flat page is K's part, then V's for MHA):
//!
//! | kind | layout | flat page | `get_page_buffer_meta` per page |
//! |---|---|---|---|
//! | MHA | layer_first | `[L][P][item]` | one span per layer and component: K₀, V₀, K₁, V₁, … (`P × item` each) |
//! | MHA | page_first | `[P][L][item]` | K, V (`L × P × item` each) |
//! | MHA | page_first_direct | `[L][P][item]` | K, V |
//! | MHA | page_head | `[H][P][L][D]` | K, V |
//! | MHA | page_first_direct_hg | `[HG][L][P][hg × D]` | K, V |
//! | MHA | page_unified | `[G][L][2][P][hg × D]` (K and V inside) | one span |
//! | MLA | layer_first | `[L][P][item]` | one span per layer |
//! | MLA | page_first, page_first_direct, page_unified | as MHA | one span |
//! | DSA | layer_first | `[L][item]` (one indexer page per layer) | `Unsupported layout: layer_first` |
//! | DSA | page_first, page_first_direct | `[L][item]` | one span |
//!
//! (page_head and page_first_direct_hg exist only for MHA: the other pools cannot be allocated with it.) `index` is a
//! token slot that starts a page (a multiple of `P`; sglang does not check, and for DSA rounds
//! down); an unaligned or out-of-range index is an error here.

use super::HostPool;
use crate::error::{Result, TransferError};
use crate::geometry::{Layout, PoolKind};

impl HostPool<'_> {
    /// The flat page starting at token `index`, as `(component, byte offset, bytes)` spans in
    /// flat order.
    pub(super) fn flat_page(&self, index: i64) -> Result<Vec<(usize, u64, u64)>> {
        let page = self.page_of(index)?;
        // Index-granular page: the DSA indexer's slots are pages already.
        let spans = self.pair.host().flat_page_spans(page);
        Ok((0..self.pair.host().buffers()).flat_map(|c| spans.iter().map(move |&(off, len)| (c, off, len))).collect())
    }

    /// The page that starts at host token `index` (an error unless one does).
    pub(super) fn page_of(&self, index: i64) -> Result<u64> {
        let g = self.pair.host();
        let p = g.page_size();
        let page_count = g.index_pages();
        let aligned = u64::try_from(index).ok().filter(|i| i % p == 0);
        let Some(first) = aligned else {
            return Err(TransferError::NotWholePage { side: "host", start: index, end: index, position: 0, page_size: p });
        };
        let page = first / p;
        if page >= page_count {
            return Err(TransferError::IndexOutOfRange {
                side: "host",
                index,
                position: 0,
                bound: page_count.saturating_mul(p),
                unit: "slots",
            });
        }
        Ok(page)
    }

    /// Bytes of one flat page (every component).
    pub fn flat_page_bytes(&self) -> u64 {
        let g = self.pair.host();
        g.index_page_size() * g.layout_dim() * g.kind().components() as u64
    }

    /// sglang `get_data_page(index, flat=True)`: the page's bytes (K then V).
    pub fn get_data_page(&self, index: i64) -> Result<Vec<u8>> {
        let spans = self.flat_page(index)?;
        let mut out = super::alloc_bytes("flat data page", self.flat_page_bytes())?;
        let mut at = 0;
        for (c, off, len) in spans {
            self.device.read(self.buffer(c)?, off, &mut out[at..at + len as usize])?;
            at += len as usize;
        }
        Ok(out)
    }

    /// sglang `get_dummy_flat_data_page()`: a zeroed page of the flat page's size.
    pub fn get_dummy_flat_data_page(&self) -> Result<Vec<u8>> {
        super::alloc_bytes("dummy flat data page", self.flat_page_bytes())
    }

    /// sglang `set_from_flat_data_page(index, data_page)`: the inverse of `get_data_page`. The
    /// page's item checksums (where the pool keeps them) are recomputed from the new bytes (see
    /// [`HostPool::set_from_flat_data_page_checked`] to verify them against the page's own).
    pub fn set_from_flat_data_page(&mut self, index: i64, data: &[u8]) -> Result<()> {
        self.set_page(index, data)
    }

    /// [`HostPool::set_from_flat_data_page`] for callers holding the page otherwise.
    pub(super) fn set_page(&self, index: i64, data: &[u8]) -> Result<()> {
        self.write_flat_page(index, data)?;
        self.record_page_checksums(&[index])
    }

    pub(super) fn write_flat_page(&self, index: i64, data: &[u8]) -> Result<()> {
        let spans = self.flat_page(index)?;
        let total = self.flat_page_bytes();
        if data.len() as u64 != total {
            return Err(TransferError::BufferSize { what: "flat data page".into(), expected: total, actual: data.len() as u64 });
        }
        let mut at = 0;
        for (c, off, len) in spans {
            self.device.write(self.buffer(c)?, off, &data[at..at + len as usize])?;
            at += len as usize;
        }
        Ok(())
    }

    /// sglang `get_page_buffer_meta(indices)`: `(component, byte offset, bytes)` of the pages
    /// whose first tokens are `indices[0], indices[P], …` (see the module table for the spans
    /// of each layout). `indices.len()` must be a multiple of `P`.
    pub fn get_page_buffer_meta(&self, indices: &[i64]) -> Result<Vec<(usize, u64, u64)>> {
        let g = self.pair.host();
        let p = g.page_size();
        if !(indices.len() as u64).is_multiple_of(p) {
            return Err(TransferError::DirectCountNotPageMultiple { len: indices.len(), page_size: p });
        }
        if g.kind() == PoolKind::DsaIndexer && g.layout() == Layout::LayerFirst {
            return Err(TransferError::UnsupportedLayout { layout: g.layout().name().into() });
        }
        let comps = g.buffers();
        // Every page's spans are page 0's, shifted (no allocation a page).
        let (template, shift) = g.flat_page_template();
        let mut out = Vec::with_capacity(indices.len() / p as usize * template.len() * comps);
        for &first in indices.iter().step_by(p as usize) {
            let at = self.page_of(first)? * shift;
            // sglang's meta interleaves K and V per span.
            for &(off, len) in &template {
                out.extend((0..comps).map(|c| (c, off + at, len)));
            }
        }
        Ok(out)
    }
}

impl HostPool<'_> {
    /// The [`crate::integrity`] checksum of each span [`HostPool::get_page_buffer_meta`] names for
    /// `indices` (same order: per page, K then V), keys seeded by `seed`. Waits for the pool's
    /// queued transfers, then reads it in place where it lives in this process's memory, through
    /// the executor otherwise. Memory written outside the pool's own calls (an L3 store into a
    /// registered pool, a raw-pointer op) must not be written to those pages meanwhile.
    pub(crate) fn object_checksums(&self, indices: &[i64], seed: u64) -> Result<Vec<u64>> {
        let meta = self.get_page_buffer_meta(indices)?;
        let widest = meta.iter().map(|m| m.2).max().unwrap_or(0);
        let keys = crate::integrity::shared_keys(seed, crate::integrity::words(widest as usize))?;
        let mut bytes = self.host_bytes()?;
        meta.iter().map(|&(c, off, len)| Ok(crate::integrity::checksum(bytes.get(c, off, len)?, &keys))).collect()
    }

    /// The [`crate::integrity`] checksum of each `shares` of each page whose first token is
    /// `indices[0], indices[P], …` (per page, the shares in order; a share's bytes in its own
    /// order, see [`crate::geometry::PageShare`]), keys seeded by `seed`: what an L3 store puts
    /// beside objects that hold a share of a page. Reads as [`HostPool::object_checksums`] does.
    pub(crate) fn share_checksums(&self, indices: &[i64], shares: &[crate::geometry::PageShare], seed: u64) -> Result<Vec<u64>> {
        let sums = self.share_summer(indices, shares, seed)?;
        let mut bytes = self.host_bytes()?;
        let mut out = Vec::with_capacity(sums.objects(indices));
        for k in 0..indices.len() / sums.page {
            sums.sum_page(&mut bytes, indices, k, &mut out)?;
        }
        Ok(out)
    }

    /// What summing `shares` of the pages starting at `indices[0], indices[P], …` takes, once the
    /// call is checked: every page starts a page of this pool, every share is a share of it.
    pub(super) fn share_summer(&self, indices: &[i64], shares: &[crate::geometry::PageShare], seed: u64) -> Result<ShareSummer> {
        if shares.is_empty() {
            // A page of no objects would read as landed whole and trusted.
            return Err(TransferError::InvalidConfig("no page shares: a page cut into shares needs at least one".into()));
        }
        let g = self.pair.host();
        let p = g.page_size();
        if !(indices.len() as u64).is_multiple_of(p) {
            return Err(TransferError::DirectCountNotPageMultiple { len: indices.len(), page_size: p });
        }
        for &first in indices.iter().step_by(p as usize) {
            self.page_of(first)?;
        }
        let spans = shares.iter().map(|&s| g.page_share_spans(s)).collect::<Result<Vec<_>>>()?;
        let widest = widest(&spans);
        let keys = crate::integrity::shared_keys(seed, crate::integrity::words(widest as usize))?;
        // Spans of whole words are summed where they lie (the checksum adds over word ranges);
        // others are gathered first (a partial word is padded only at the object's end).
        let in_place = spans.iter().all(|(v, _)| v.iter().all(|s| s.2.is_multiple_of(4)));
        let scratch = if in_place { Vec::new() } else { super::alloc_bytes("page share", widest)? };
        Ok(ShareSummer { page: p as usize, spans, keys, scratch: std::cell::RefCell::new(scratch), in_place, items: None })
    }

    /// [`HostPool::share_summer`] whose staging and landing passes also sum the pool's items
    /// (see [`super::share_items`]), where the pool keeps item checksums, is in this process's
    /// memory and the shares cover each item once in whole words.
    pub(super) fn share_summer_with_items(&self, indices: &[i64], shares: &[crate::geometry::PageShare], seed: u64) -> Result<ShareSummer> {
        let mut summer = self.share_summer(indices, shares, seed)?;
        let g = self.pair.host();
        let in_memory = (0..g.buffers()).all(|c| matches!(self.host_span(c), Ok(Some(_))));
        if let (Some(table), true, true) = (&self.checksums, summer.in_place, in_memory) {
            if let Some(runs) = super::share_items::ItemRuns::new(g, shares, &summer.spans) {
                let words = usize::try_from(g.item_bytes() / 4).map_err(|_| TransferError::InvalidConfig("item too large".into()))?;
                summer.items = Some((runs, crate::integrity::shared_keys(table.keys().seed(), words)?));
            }
        }
        Ok(summer)
    }
    /// The pool's host memory as it is now, after its queued transfers (see [`HostBytes`]).
    pub(super) fn host_bytes(&self) -> Result<HostBytes<'_>> {
        self.device.wait_idle()?;
        let spans = (0..self.pair.host().buffers()).map(|c| self.host_span(c)).collect::<Result<_>>()?;
        Ok(HostBytes { pool: self, spans, staged: Vec::new() })
    }
}

/// Reads of a host pool's memory outside transfers: in place where the pool lives in this
/// process's memory ([`HostPool::host_span`]), through the executor otherwise. Memory written
/// outside the pool's own calls (an L3 store into a registered pool, a raw-pointer op) must not be
/// written meanwhile.
pub(super) struct HostBytes<'a> {
    pool: &'a HostPool<'a>,
    spans: Vec<Option<(u64, u64)>>,
    staged: Vec<u8>,
}

impl HostBytes<'_> {
    /// `len` bytes of component `comp` at byte `off`.
    pub(super) fn get(&mut self, comp: usize, off: u64, len: u64) -> Result<&[u8]> {
        if !matches!(self.spans.get(comp), Some(Some(_))) {
            self.staged.resize(len as usize, 0);
            self.pool.device.read(self.pool.buffer(comp)?, off, &mut self.staged)?;
            return Ok(&self.staged);
        }
        Ok(self.in_place(comp, off, len)?.unwrap_or_default())
    }

    /// `len` bytes of component `comp` at byte `off` where the pool's memory is in this process
    /// (`None` where it is read through the executor: [`HostBytes::get`] stages it), borrowed for
    /// reading only: nothing writes the pool through these bytes while the slice lives.
    pub(super) fn in_place(&self, comp: usize, off: u64, len: u64) -> Result<Option<&[u8]>> {
        let Some(&Some((base, size))) = self.spans.get(comp) else {
            return Ok(None);
        };
        if off.checked_add(len).is_none_or(|end| end > size) {
            return Err(TransferError::BufferSize { what: "page span".into(), expected: off.saturating_add(len), actual: size });
        }
        // SAFETY: `off..off + len` lies inside component `comp`'s buffer (checked above), which
        // lives as long as the pool; the executor's queue was drained and the pool is borrowed
        // (or, shared, the pages read are claimed), so no transfer of the pool writes it; the
        // slice borrows `self`, so `put_with` cannot write the pool meanwhile, and other
        // writers of its memory are bound by the contract above.
        Ok(Some(unsafe { std::slice::from_raw_parts((base + off) as *const u8, len as usize) }))
    }

    /// `fill(span)` on the `len` bytes of component `comp` at byte `off`, in place (pools in this
    /// process's memory only: an L3 store's staging path, which the zero-copy layouts are).
    pub(super) fn put_with<R>(&mut self, comp: usize, off: u64, len: u64, fill: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        let Some(&Some((base, size))) = self.spans.get(comp) else {
            return Err(TransferError::InvalidConfig(format!("component {comp} of this host pool is not in this process's memory")));
        };
        if off.checked_add(len).is_none_or(|end| end > size) {
            return Err(TransferError::BufferSize { what: "page span".into(), expected: off.saturating_add(len), actual: size });
        }
        // SAFETY: inside component `comp`'s buffer (checked above), which lives as long as the
        // pool; no transfer of the pool runs (the queue was drained, the pages are the caller's),
        // and nothing else in this process holds a reference into it meanwhile.
        Ok(fill(unsafe { std::slice::from_raw_parts_mut((base + off) as *mut u8, len as usize) }))
    }
}

/// Walks one share of page `page`: `piece(span, at)` on each of its spans (`span`: buffer,
/// offset and bytes of this page's; `at`: where it starts in the object), adding what each
/// returns. Returns (that sum, the object's bytes).
fn walk(
    page: u64,
    (template, shift): &crate::geometry::ShareSpans,
    mut piece: impl FnMut((usize, u64, u64), usize) -> Result<u64>,
) -> Result<(u64, usize)> {
    let (mut at, mut sum) = (0usize, 0u64);
    for &(buffer, off, len) in template {
        sum = sum.wrapping_add(piece((buffer, off + page * shift, len), at)?);
        at += len as usize;
    }
    Ok((sum, at))
}

/// The runs of span `i` (a share's runs are in its spans' order).
fn of_span(runs: &[super::share_items::Run], i: usize) -> &[super::share_items::Run] {
    &runs[runs.partition_point(|r| r.span < i)..runs.partition_point(|r| r.span <= i)]
}

/// `sums` made `n` zeros (fallibly: it holds a page's items).
fn fresh(sums: &mut Vec<u64>, n: usize) -> Result<()> {
    sums.clear();
    sums.try_reserve(n).map_err(|_| TransferError::OutOfMemory {
        what: "page item sums".into(),
        requested: (n as u64).saturating_mul(8),
        limit: "allocation failed".into(),
    })?;
    sums.resize(n, 0);
    Ok(())
}

/// A run of item pieces that does not fit its span, object or keys: the runs are built from the
/// same geometry as the spans, so this is a defect, reported instead of a wrong checksum.
fn broken_run() -> TransferError {
    TransferError::InvalidConfig("page share: a run of item pieces outside its span or keys".into())
}

/// The bytes of the longest of these shares.
fn widest(spans: &[crate::geometry::ShareSpans]) -> u64 {
    spans.iter().map(|(v, _)| v.iter().map(|s| s.2).sum::<u64>()).max().unwrap_or(0)
}

/// The checksums of page shares, page by page ([`HostPool::share_summer`]).
pub(super) struct ShareSummer {
    page: usize,
    spans: Vec<crate::geometry::ShareSpans>,
    keys: std::sync::Arc<crate::integrity::Keys>,
    scratch: std::cell::RefCell<Vec<u8>>,
    in_place: bool,
    /// The shares' runs of item pieces and the items' keys, where the staging passes sum the
    /// items too ([`HostPool::share_summer_with_items`]).
    items: Option<(super::share_items::ItemRuns, std::sync::Arc<crate::integrity::Keys>)>,
}

impl ShareSummer {
    /// Checksums a call's pages hold: pages × shares.
    pub(super) fn objects(&self, indices: &[i64]) -> usize {
        indices.len() / self.page * self.spans.len()
    }
    /// Appends the checksum of each share of page `k` (starting at `indices[k · P]`) to `out`.
    pub(super) fn sum_page(&self, bytes: &mut HostBytes<'_>, indices: &[i64], k: usize, out: &mut Vec<u64>) -> Result<()> {
        let page = indices[k * self.page] as u64 / self.page as u64;
        let mut scratch = self.scratch.borrow_mut();
        for share in &self.spans {
            let walked = walk(page, share, |(buffer, off, len), at| {
                let from = bytes.get(buffer, off, len)?;
                if self.in_place {
                    return Ok(crate::integrity::range_sum(from, at / 4, &self.keys));
                }
                scratch[at..at + len as usize].copy_from_slice(from);
                Ok(0)
            })?;
            out.push(self.finish(walked, &scratch));
        }
        Ok(())
    }
    /// The longest share's bytes.
    pub(super) fn widest(&self) -> u64 {
        widest(&self.spans)
    }
    /// [`ShareSummer::sum_page`] with each share of page `k` also gathered into `staging`, object
    /// `j` of the call at byte `j · stride`, in the same read. The caller checked that the call's
    /// objects fit: `objects(indices) · stride <= staging.len()`, `widest() <= stride`.
    /// Where the summer sums items ([`HostPool::share_summer_with_items`]), `items` is left
    /// holding the checksum of each item of the page (in the table's order), else empty.
    pub(super) fn stage_page(
        &self,
        bytes: &mut HostBytes<'_>,
        indices: &[i64],
        k: usize,
        (staging, stride): (&mut [u8], usize),
        out: &mut Vec<u64>,
        items: &std::cell::RefCell<Vec<u64>>,
    ) -> Result<()> {
        let page = indices[k * self.page] as u64 / self.page as u64;
        if let Some((runs, item_keys)) = &self.items {
            let mut sums = items.borrow_mut();
            fresh(&mut sums, runs.items)?;
            for (s, share) in self.spans.iter().enumerate() {
                let base = (k * self.spans.len() + s) * stride;
                let object = &mut staging[base..base + stride];
                let mut sum = 0u64;
                for (i, &(buffer, off, len)) in share.0.iter().enumerate() {
                    let from = bytes.get(buffer, off + page * share.1, len)?;
                    for run in of_span(&runs.runs[s], i) {
                        let n = run.chunk * run.count;
                        let (x, r) = (run.obj_word * 4, run.rel);
                        let (Some(f), Some(t)) = (from.get(r..r + n), object.get_mut(x..x + n)) else { return Err(broken_run()) };
                        sum = sum.wrapping_add(self.run_sums(f, t, run, item_keys, &mut sums)?);
                    }
                }
                out.push(sum);
            }
            return Ok(());
        }
        items.borrow_mut().clear();
        for (s, share) in self.spans.iter().enumerate() {
            let base = (k * self.spans.len() + s) * stride;
            let object = &mut staging[base..base + stride];
            let walked = walk(page, share, |(buffer, off, len), at| {
                let from = bytes.get(buffer, off, len)?;
                let to = &mut object[at..at + from.len()];
                if self.in_place {
                    // SAFETY: two slices of the same length in different allocations (the pool's
                    // memory, the caller's staging buffer).
                    return Ok(unsafe {
                        crate::integrity::copy_and_sum(from.as_ptr(), to.as_mut_ptr(), to.len(), at / 4, &self.keys, false)
                    });
                }
                to.copy_from_slice(from);
                Ok(0)
            })?;
            out.push(self.finish(walked, object));
        }
        Ok(())
    }
    /// The reverse of [`ShareSummer::stage_page`] after a get into `staging`: each share of page
    /// `k` with `write[j]` scattered into the pool and summed in the same pass over the staged
    /// bytes (0 for the others). Checked as there, and `write` has an entry per object.
    /// Where the summer sums items, `items` is left holding each item's checksum as landed (in
    /// the table's order) when every share of the page was written, else empty.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn land_page(
        &self,
        bytes: &mut HostBytes<'_>,
        indices: &[i64],
        k: usize,
        (staging, stride): (&[u8], usize),
        write: &[bool],
        out: &mut Vec<u64>,
        items: &std::cell::RefCell<Vec<u64>>,
    ) -> Result<()> {
        let page = indices[k * self.page] as u64 / self.page as u64;
        let n = self.spans.len();
        if let (Some((runs, item_keys)), true) = (&self.items, write.get(k * n..(k + 1) * n).is_some_and(|w| w.iter().all(|&w| w))) {
            let mut sums = items.borrow_mut();
            fresh(&mut sums, runs.items)?;
            for (s, share) in self.spans.iter().enumerate() {
                let j = k * n + s;
                let object = &staging[j * stride..(j + 1) * stride];
                let mut sum = 0u64;
                for (i, &(buffer, off, len)) in share.0.iter().enumerate() {
                    sum = sum.wrapping_add(bytes.put_with(buffer, off + page * share.1, len, |to| {
                        let mut part = 0u64;
                        for run in of_span(&runs.runs[s], i) {
                            let m = run.chunk * run.count;
                            let (x, r) = (run.obj_word * 4, run.rel);
                            let (Some(f), Some(t)) = (object.get(x..x + m), to.get_mut(r..r + m)) else { return Err(broken_run()) };
                            part = part.wrapping_add(self.run_sums(f, t, run, item_keys, &mut sums)?);
                        }
                        Ok(part)
                    })??);
                }
                out.push(sum);
            }
            return Ok(());
        }
        items.borrow_mut().clear();
        for (s, share) in self.spans.iter().enumerate() {
            let j = k * self.spans.len() + s;
            if !write[j] {
                out.push(0);
                continue;
            }
            let object = &staging[j * stride..(j + 1) * stride];
            let walked = walk(page, share, |(buffer, off, len), at| {
                let from = &object[at..at + len as usize];
                bytes.put_with(buffer, off, len, |to| {
                    if self.in_place {
                        // SAFETY: two slices of the same length in different allocations (the
                        // staging buffer, the pool's memory).
                        return unsafe {
                            crate::integrity::copy_and_sum(from.as_ptr(), to.as_mut_ptr(), to.len(), at / 4, &self.keys, false)
                        };
                    }
                    to.copy_from_slice(from);
                    0
                })
            })?;
            out.push(self.finish(walked, object));
        }
        Ok(())
    }
    /// One run copied from `from` to `to` ([`crate::integrity::copy_sum_run`]): its object
    /// terms, each piece's item terms added to its item of `items`.
    fn run_sums(
        &self,
        from: &[u8],
        to: &mut [u8],
        run: &super::share_items::Run,
        item_keys: &crate::integrity::Keys,
        items: &mut [u64],
    ) -> Result<u64> {
        let mut parts = [0u64; 64];
        let mut total = 0u64;
        // At most 64 pieces a kernel call (a run may hold many more: its sums go to its items).
        for first in (0..run.count).step_by(parts.len()) {
            let count = (run.count - first).min(parts.len());
            let (a, b) = (first * run.chunk, (first + count) * run.chunk);
            let (Some(obj), Some(item)) = (self.keys.table().get(run.obj_word + a / 4..), item_keys.table().get(run.item_word..)) else {
                return Err(broken_run());
            };
            let pieces = &mut parts[..count];
            pieces.fill(0);
            let sum = crate::integrity::copy_sum_run(&from[a..b], &mut to[a..b], run.chunk, obj, item, pieces).ok_or_else(broken_run)?;
            total = total.wrapping_add(sum);
            for (c, part) in pieces.iter().enumerate() {
                let at = (first + c).checked_mul(run.step).and_then(|d| d.checked_add(run.item));
                let slot = at.and_then(|at| items.get_mut(at)).ok_or_else(broken_run)?;
                *slot = slot.wrapping_add(*part);
            }
        }
        Ok(total)
    }
    /// A share's checksum from [`walk`]'s `(sum, bytes)`: the spans' sums where they were summed
    /// where they lie (`in_place`), else the checksum of the object as gathered into `object`.
    fn finish(&self, (sum, len): (u64, usize), object: &[u8]) -> u64 {
        if self.in_place {
            sum
        } else {
            crate::integrity::checksum(&object[..len], &self.keys)
        }
    }
}
