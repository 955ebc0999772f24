//! Corruption injection: proof that item checksums catch what they claim to. Each trial backs a
//! random case of a backup cell up (profile `extended`, `kernel`, so every item is checksummed),
//! checks that loading everything back raises nothing, then injects one fault and loads again:
//! - **host bits**: a burst of 1 to 8 bytes flipped inside one host item;
//! - **table entry**: bits flipped in one item's recorded checksum;
//! - **swap**: two host items of one layer and component exchanged;
//! - **replay**: an item's older bytes written back over a newer backup;
//! - **storage page**: a page carried to another pool (`get_data_page` + `page_checksums` →
//!   `set_from_flat_data_page_checked`) with one bit flipped on the way.
//!
//! A fault is detected when the load (or the checked page write) names exactly the items it
//! damaged; a swap of identical bytes is provably harmless and must raise nothing. Any other
//! integrity error is a false alarm. Used by `hicache-io fuzz --inject` and its test.

use std::collections::BTreeSet;

use crate::error::{Result, TransferError};
use crate::exec::Device;
use crate::geometry::{DeviceGeometry, IoBackend, PoolKind, Profile};
use crate::plan::{Op, TableOp};
use crate::pool::{DevicePool, HostPool};
use crate::rng::Rng;
use crate::tools::check::{random_case, supported_cells, Case};

/// The kinds of fault, in report order.
pub const FAULTS: [&str; 5] = ["host bits", "table entry", "swap", "replay", "storage page"];

/// Counts of one injection run.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct InjectTally {
    /// Trials run.
    pub trials: u64,
    /// Faults injected, per kind of [`FAULTS`].
    pub injected: [u64; 5],
    /// Faults whose damaged items were all named, and nothing else.
    pub detected: u64,
    /// Faults that changed no byte (a swap of identical items): nothing may be raised.
    pub harmless: u64,
    /// Faults not (fully) detected: must be 0.
    pub missed: u64,
    /// Integrity errors where nothing was damaged, or naming undamaged items: must be 0.
    pub false_alarms: u64,
    /// Trials with nothing to damage (every index skipped, a no-op call).
    pub skipped: u64,
    /// `false` when the executor's copies keep no checksums (nothing was injected).
    pub verified: bool,
    /// The first failures, for the report.
    pub failures: Vec<String>,
}

impl InjectTally {
    /// Faults injected in all.
    pub fn total(&self) -> u64 {
        self.injected.iter().sum()
    }
    /// True when every fault was detected or harmless and nothing raised a false alarm.
    pub fn clean(&self) -> bool {
        self.missed == 0 && self.false_alarms == 0 && self.failures.is_empty()
    }
    fn fail(&mut self, what: String) {
        if self.failures.len() < 10 {
            self.failures.push(what);
        }
    }
}

/// One damaged item: `(host index, host layer, component)`.
type Item = (u64, u64, u8);

/// Runs trials on `device` until `injections` faults have been injected; `progress` after each.
pub fn inject_device(device: &Device, seed: u64, injections: u64, mut progress: impl FnMut(&InjectTally)) -> InjectTally {
    let mut t = InjectTally { verified: device.capabilities().checksums, ..Default::default() };
    if !t.verified {
        return t;
    }
    let mut rng = Rng::new(seed);
    let cells: Vec<_> = supported_cells(Profile::Extended)
        .into_iter()
        .filter(|c| matches!(c.op, TableOp::Backup | TableOp::ShardedBackup) && c.io == IoBackend::Kernel)
        .collect();
    // A trial that injects nothing (a case with nothing live) does not count; stop anyway if
    // the cases keep coming up empty.
    while t.total() < injections && t.trials < injections.saturating_mul(4) {
        let trial_seed = rng.next_u64();
        t.trials += 1;
        if let Err(e) = trial(device, &cells, trial_seed, &mut t) {
            t.fail(format!("seed {trial_seed}: {e}"));
        }
        progress(&t);
    }
    t
}

/// One trial: a random backup, checked clean, then one fault of a random kind, scored by what
/// loading everything back names.
fn trial(device: &Device, cells: &[crate::plan::Cell], seed: u64, t: &mut InjectTally) -> Result<()> {
    let mut rng = Rng::new(seed);
    let mut case = random_case(rng.pick(cells), Profile::Extended, &mut rng);
    case.host.integrity = Some(true);
    let mut dev = DevicePool::new(device, &case.device)?;
    let mut host = HostPool::new(&dev, &case.host)?;
    let g = dev.geometry().clone();
    fill_device(&mut dev, &mut rng)?;
    let (hi, di) = (&case.host_indices, &case.device_indices);
    backup(&mut host, &dev, &case)?;
    // The live (host, device) units and the host layers the backup wrote.
    let units = live_units(&g, hi, di);
    let host_layers = backed_up_layers(&host, &units);
    if units.is_empty() || host_layers.is_empty() {
        t.skipped += 1;
        return Ok(());
    }
    // Nothing damaged yet: loading every layer back raises nothing.
    let found = load_all(&host, &mut dev, hi, di)?;
    if !found.is_empty() {
        t.false_alarms += 1;
        t.fail(format!("seed {seed}: {} items reported before any fault", found.len()));
    }
    let comps = g.kind().components() as u8;
    let (u, d) = units[rng.below(units.len() as u64) as usize];
    let layer = host_layers[rng.below(host_layers.len() as u64) as usize];
    let comp = rng.below(comps as u64) as u8;
    let target = (u, layer, comp);
    let mut kind = rng.below(FAULTS.len() as u64) as usize;
    if kind == 2 && units.len() < 2 {
        kind = 0;
    }
    let expected = match kind {
        0 => flip_host_bits(&mut host, target, &mut rng)?,
        1 => corrupt_table_entry(&mut host, target, &mut rng, seed, t)?,
        2 => swap_items(&mut host, &units, target, &mut rng)?,
        3 => replay(&mut host, &mut dev, &case, target, d, &mut rng)?,
        _ => {
            t.injected[4] += 1;
            return storage_page(&host, &case, u, &mut rng, seed, t);
        }
    };
    t.injected[kind] += 1;
    let found = load_all(&host, &mut dev, hi, di)?;
    score(t, seed, kind, target, &expected, &found);
    Ok(())
}

/// Fills every device buffer with random bytes.
fn fill_device(dev: &mut DevicePool<'static>, rng: &mut Rng) -> Result<()> {
    let g = dev.geometry().clone();
    for c in 0..g.kind().components() {
        for s in 0..g.buffer_count() {
            let mut b = vec![0u8; g.layer_bytes() as usize];
            rng.fill(&mut b);
            dev.write_buffer(c, s, &b)?;
        }
    }
    Ok(())
}

/// Runs the case's backup (per layer for a layer backup, else of every layer) with `kernel`.
fn backup(host: &mut HostPool<'static>, dev: &DevicePool<'static>, case: &Case) -> Result<()> {
    let (hi, di) = (&case.host_indices, &case.device_indices);
    match case.op {
        Op::BackupLayer { layer_id, is_draft } => host.backup_from_device_per_layer(dev, hi, di, layer_id, is_draft, IoBackend::Kernel),
        _ => host.backup_from_device_all_layer(dev, hi, di, IoBackend::Kernel),
    }
}

/// The live `(host, device)` units of the index lists: pages for the DSA indexer (by their
/// first entry), else tokens; entries with a negative side are skipped.
fn live_units(g: &DeviceGeometry, hi: &[i64], di: &[i64]) -> Vec<(u64, u64)> {
    let p = g.page_size();
    let dsa = g.kind() == PoolKind::DsaIndexer;
    if dsa {
        hi.chunks(p as usize)
            .zip(di.chunks(p as usize))
            .filter(|(h, d)| h[0] >= 0 && d[0] >= 0)
            .map(|(h, d)| (h[0] as u64 / p, d[0] as u64 / p))
            .collect()
    } else {
        hi.iter().zip(di).filter(|(h, d)| **h >= 0 && **d >= 0).map(|(&h, &d)| (h as u64, d as u64)).collect()
    }
}

/// The host layers the backup wrote: those where the first live unit's item has a checksum.
fn backed_up_layers(host: &HostPool<'static>, units: &[(u64, u64)]) -> Vec<u64> {
    (0..host.geometry().layer_num())
        .filter(|&l| host.item_checksum(units.first().map_or(0, |u| u.0), l, 0).ok().flatten().is_some())
        .collect()
}

/// The bytes of one host item, head by head.
fn read_item(host: &HostPool<'static>, (u, l, c): Item) -> Result<Vec<u8>> {
    let hg = host.geometry();
    let (chunk, heads) = (hg.chunk_bytes(), hg.head_num());
    let buf = host.read_buffer(hg.buffer_of(c) as usize)?;
    let a = hg.addr(c, l);
    Ok((0..heads).flat_map(|h| buf[a.offset(u, h) as usize..][..chunk as usize].to_vec()).collect())
}

/// Overwrites one host item with `bytes` (as [`read_item`] returns them), leaving its checksum.
fn write_item(host: &mut HostPool<'static>, (u, l, c): Item, bytes: &[u8]) -> Result<()> {
    let hg = host.geometry().clone();
    let chunk = hg.chunk_bytes();
    let a = hg.addr(c, l);
    for h in 0..hg.head_num() {
        host.inject_host_corruption(hg.buffer_of(c) as usize, a.offset(u, h), &bytes[(h * chunk) as usize..][..chunk as usize])?;
    }
    Ok(())
}

/// Host bits: flips a burst of 1 to 8 bytes inside one head of the item; the item is damaged.
fn flip_host_bits(host: &mut HostPool<'static>, (u, layer, comp): Item, rng: &mut Rng) -> Result<BTreeSet<Item>> {
    let hg = host.geometry().clone();
    let (chunk, heads) = (hg.chunk_bytes(), hg.head_num());
    let (h, at) = (rng.below(heads), rng.below(chunk));
    let len = 1 + rng.below(8.min(chunk - at));
    let mut mask = vec![0u8; len as usize];
    rng.fill(&mut mask);
    mask[0] |= 1 << rng.below(8);
    let off = hg.addr(comp, layer).offset(u, h) + at;
    let mut now = vec![0u8; len as usize];
    let buffer = hg.buffer_of(comp) as usize;
    now.copy_from_slice(&host.read_buffer(buffer)?[off as usize..][..len as usize]);
    let bad: Vec<u8> = now.iter().zip(&mask).map(|(a, m)| a ^ m).collect();
    host.inject_host_corruption(buffer, off, &bad)?;
    Ok(BTreeSet::from([(u, layer, comp)]))
}

/// Table entry: flips bits of the item's recorded checksum (a failure if it has none).
fn corrupt_table_entry(
    host: &mut HostPool<'static>,
    (u, layer, comp): Item,
    rng: &mut Rng,
    seed: u64,
    t: &mut InjectTally,
) -> Result<BTreeSet<Item>> {
    let xor = rng.next_u64() | 1 << rng.below(64);
    if !host.inject_checksum_corruption(u, layer, comp, xor)? {
        t.fail(format!("seed {seed}: item {u} of layer {layer} has no checksum after its backup"));
    }
    Ok(BTreeSet::from([(u, layer, comp)]))
}

/// Swap: exchanges the item with that of another live unit (same layer and component); both
/// are damaged unless their bytes were equal.
fn swap_items(host: &mut HostPool<'static>, units: &[(u64, u64)], (u, layer, comp): Item, rng: &mut Rng) -> Result<BTreeSet<Item>> {
    let v = loop {
        let v = units[rng.below(units.len() as u64) as usize].0;
        if v != u {
            break v;
        }
    };
    let (a, b) = (read_item(host, (u, layer, comp))?, read_item(host, (v, layer, comp))?);
    write_item(host, (u, layer, comp), &b)?;
    write_item(host, (v, layer, comp), &a)?;
    if a == b {
        Ok(BTreeSet::new())
    } else {
        Ok(BTreeSet::from([(u, layer, comp), (v, layer, comp)]))
    }
}

/// Replay: the item's device source (unit `d`) changes and is backed up again, then the item's
/// older host bytes are written back over the newer backup; the item is damaged.
fn replay(
    host: &mut HostPool<'static>,
    dev: &mut DevicePool<'static>,
    case: &Case,
    (u, layer, comp): Item,
    d: u64,
    rng: &mut Rng,
) -> Result<BTreeSet<Item>> {
    let g = dev.geometry().clone();
    let old = read_item(host, (u, layer, comp))?;
    // The device item changes (one byte), is backed up again; then the older bytes return.
    let slot = layer as usize;
    let mut buf = dev.read_buffer(comp as usize, slot)?;
    let at = d * g.item_bytes() + rng.below(g.item_bytes());
    buf[at as usize] ^= 1 << rng.below(8);
    dev.write_buffer(comp as usize, slot, &buf)?;
    backup(host, dev, case)?;
    write_item(host, (u, layer, comp), &old)?;
    Ok(BTreeSet::from([(u, layer, comp)]))
}

/// Scores one injected fault: the items the load `found` against those `expected` damaged
/// (none: a harmless swap, where anything found is a false alarm).
fn score(t: &mut InjectTally, seed: u64, kind: usize, (u, layer, comp): Item, expected: &BTreeSet<Item>, found: &BTreeSet<Item>) {
    if expected.is_empty() {
        t.harmless += 1;
        if !found.is_empty() {
            t.false_alarms += 1;
            t.fail(format!("seed {seed}: a swap of identical items reported {} items", found.len()));
        }
    } else if found == expected {
        t.detected += 1;
    } else if expected.is_subset(found) {
        t.detected += 1;
        t.false_alarms += 1;
        t.fail(format!("seed {seed}: {} damaged, also named {:?}", FAULTS[kind], found.difference(expected).collect::<Vec<_>>()));
    } else {
        t.missed += 1;
        t.fail(format!("seed {seed}: {} of item {u} layer {layer} comp {comp} missed (named {found:?})", FAULTS[kind]));
    }
}

/// Loads every layer back into the case's device slots; the items any layer's load named.
fn load_all(host: &HostPool<'static>, dev: &mut DevicePool<'static>, hi: &[i64], di: &[i64]) -> Result<BTreeSet<Item>> {
    let loads = host.load_layers(dev, hi, di, IoBackend::Kernel)?;
    let mut found = BTreeSet::new();
    for l in loads.layer_ids() {
        match loads.wait_layer(l) {
            Ok(()) => {}
            Err(TransferError::Integrity { items, .. }) => found.extend(items.iter().map(|m| (m.host_index, m.layer, m.component))),
            Err(e) => return Err(e),
        }
    }
    match loads.wait() {
        // The last layer's mismatches, collected above.
        Ok(()) | Err(TransferError::Integrity { .. }) => Ok(found),
        Err(e) => Err(e),
    }
}

/// A page of the pool carried to a fresh pool of the same shape, once intact (accepted) and once
/// with one bit flipped (refused, naming one item).
fn storage_page(host: &HostPool<'static>, case: &Case, unit: u64, rng: &mut Rng, seed: u64, t: &mut InjectTally) -> Result<()> {
    let g = host.geometry();
    let index = match g.kind() {
        PoolKind::DsaIndexer => unit * g.page_size(),
        _ => unit / g.page_size() * g.page_size(),
    } as i64;
    let (page, sums) = (host.get_data_page(index)?, host.page_checksums(index)?);
    let dev = DevicePool::new(host.device(), &case.device)?;
    let mut other = HostPool::new(&dev, &case.host)?;
    if let Err(e) = other.set_from_flat_data_page_checked(index, &page, &sums) {
        t.false_alarms += 1;
        t.fail(format!("seed {seed}: an intact page was refused: {e}"));
    }
    // Flip a bit of an item that carries a checksum (a page may hold items never backed up).
    let known: Vec<usize> = sums.iter().enumerate().filter(|(_, s)| s.is_some()).map(|(i, _)| i).collect();
    if known.is_empty() {
        t.harmless += 1;
        return Ok(());
    }
    let item = known[rng.below(known.len() as u64) as usize];
    let at = flat_offset(host, index, item, rng.below(g.item_bytes()))?;
    let mut bad = page;
    bad[at] ^= 1 << rng.below(8);
    match other.set_from_flat_data_page_checked(index, &bad, &sums) {
        Err(TransferError::Integrity { items, .. }) if items.len() == 1 => t.detected += 1,
        Err(TransferError::Integrity { items, .. }) => {
            t.detected += 1;
            t.false_alarms += 1;
            t.fail(format!("seed {seed}: one flipped bit named {} items", items.len()));
        }
        other => {
            t.missed += 1;
            t.fail(format!("seed {seed}: a damaged page was taken: {other:?}"));
        }
    }
    Ok(())
}

/// The offset in the flat page at `index` of byte `byte` of item number `item` of
/// [`HostPool::page_checksums`]'s order (component, layer, slot): found by writing a marker page
/// into a scratch pool, so the flat order of every layout comes from the pool itself.
fn flat_offset(host: &HostPool<'static>, index: i64, item: usize, byte: u64) -> Result<usize> {
    let g = host.geometry();
    let per = g.index_page_size() as usize;
    let layers = g.layer_num() as usize;
    let (c, rest) = (item / (layers * per), item % (layers * per));
    let (l, s) = (rest / per, rest % per);
    let unit = (index as u64 / g.page_size()) * g.index_page_size() + s as u64;
    let (h, within) = (byte / g.chunk_bytes(), byte % g.chunk_bytes());
    let target = g.addr(c as u8, l as u64).offset(unit, h) + within;
    // The flat page is buffer-major, each buffer the page's spans in order.
    let mut at = 0usize;
    let page_spans = g.flat_page_spans(index as u64 / g.page_size());
    let spans = (0..g.buffers()).flat_map(|cc| page_spans.iter().map(move |&(off, len)| (cc, off, len)));
    let buffer = g.buffer_of(c as u8) as usize;
    for (cc, off, len) in spans {
        if cc == buffer && (off..off + len).contains(&target) {
            return Ok(at + (target - off) as usize);
        }
        at += len as usize;
    }
    Err(TransferError::InvalidConfig(format!("item {item} byte {byte} is not in the flat page at {index}")))
}
