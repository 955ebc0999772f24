//! Settling item checksums that an executor's copies computed: a host pool's checksum table
//! bound to one transfer records them (backups) or verifies them (loads).

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::integrity::{ChecksumTable, ItemMismatch, MismatchSink};
use crate::plan::{ChecksumMode, CopyStep};

/// A host pool's checksum table bound to one transfer.
#[derive(Clone)]
pub(crate) struct ChecksumBinding {
    pub(crate) table: Arc<ChecksumTable>,
    pub(crate) sink: Arc<MismatchSink>,
}

impl ChecksumBinding {
    /// Settles the items of one host layer and component, for a loop over many of them: each
    /// checksum recorded (backup) or verified (load).
    #[inline(always)]
    pub(crate) fn layer(&self, mode: ChecksumMode, layer: u64, comp: u8) -> LayerSettle<'_> {
        LayerSettle { binding: self, entries: self.table.layer_entries(layer, comp), mode, layer, comp, n: [0; 4] }
    }
}

/// `n += m`, counts (recorded, verified, unverified, mismatched) of settled items.
#[inline(always)]
pub(crate) fn add_counts(n: &mut [u64; 4], m: [u64; 4]) {
    for (a, b) in n.iter_mut().zip(m) {
        *a += b;
    }
}

/// The settling of one host layer and component's item checksums ([`ChecksumBinding::layer`]):
/// their table entries found once, so that each item costs one bounds check and one load or store
/// (the slot's arithmetic per item measured 20% of a checksummed 128-byte load).
pub(crate) struct LayerSettle<'a> {
    binding: &'a ChecksumBinding,
    entries: &'a [AtomicU64],
    mode: ChecksumMode,
    layer: u64,
    comp: u8,
    /// Counts so far: (recorded, verified, unverified, mismatched).
    pub(crate) n: [u64; 4],
}

impl LayerSettle<'_> {
    /// Records or verifies the checksum `sum` of host item `host` (moved to or from device index
    /// `device`); nothing for an index outside the table.
    #[inline(always)]
    pub(crate) fn item(&mut self, host: u64, device: u64, sum: u64) {
        let Some(e) = usize::try_from(host).ok().and_then(|h| self.entries.get(h)) else { return };
        match self.mode {
            ChecksumMode::Record => {
                ChecksumTable::record_entry(e, sum);
                self.n[0] += 1;
            }
            ChecksumMode::Verify => match ChecksumTable::entry_expected(e) {
                None => self.n[2] += 1,
                Some(expected) if expected == sum => self.n[1] += 1,
                Some(expected) => self.mismatch(host, device, expected, sum),
            },
        }
    }

    #[cold]
    fn mismatch(&mut self, host: u64, device: u64, expected: u64, found: u64) {
        self.n[3] += 1;
        let (layer, component) = (self.layer, self.comp);
        self.binding.sink.push(ItemMismatch { layer, component, host_index: host, device_index: device, expected, found });
    }

    /// Where host item `host`'s entry lives (a prefetch hint; null outside the table).
    #[inline(always)]
    pub(crate) fn entry_addr(&self, host: u64) -> *const u8 {
        let e = usize::try_from(host).ok().and_then(|h| self.entries.get(h));
        e.map_or(std::ptr::null(), |e| e as *const AtomicU64 as *const u8)
    }
}

/// What one step's item checksums settle, on the executors whose copies compute them on the
/// device and read them back (wgpu, cuda; cpu settles inside its copies).
#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
pub(crate) enum Settle {
    /// A summing gather: the sum of index pair `i`'s item of address pair `l` belongs to host
    /// item `items[l]` (layer, component) at index pair `(src[i], dst[i])` (negative: skipped).
    Sums { src: Arc<[i64]>, dst: Arc<[i64]>, items: Vec<(u64, u8)> },
    /// Runs `range` of a `direct` step, copied without a checksum.
    Unknown(CopyStep, std::ops::Range<usize>),
}

#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
impl ChecksumBinding {
    /// Settles a step's items in the host pool's table: with `sum(i, l)` (the sum of index pair
    /// `i`'s item of address pair `l`) each is recorded (backup) or verified (load); without
    /// (the sums never arrived, or the copies could not sum) each is unknown: a backup forgets
    /// its checksum, a load counts it unverified. Updates the table's counters.
    pub(crate) fn settle_step(&self, mode: ChecksumMode, what: &Settle, sum: Option<&dyn Fn(usize, usize) -> u64>) {
        let mut n = [0u64; 4];
        match what {
            Settle::Sums { src, dst, items } => {
                let mut layers: Vec<LayerSettle<'_>> = items.iter().map(|&(layer, comp)| self.layer(mode, layer, comp)).collect();
                for (i, (&s, &d)) in src.iter().zip(dst.iter()).enumerate() {
                    if s < 0 || d < 0 {
                        continue;
                    }
                    let (host, device) = match mode {
                        ChecksumMode::Record => (d as u64, s as u64),
                        ChecksumMode::Verify => (s as u64, d as u64),
                    };
                    for (l, (settle, &(layer, comp))) in layers.iter_mut().zip(items.iter()).enumerate() {
                        match sum {
                            Some(sum) => settle.item(host, device, sum(i, l)),
                            None => self.unknown(mode, (host, layer, comp), &mut n),
                        }
                    }
                }
                for settle in &layers {
                    add_counts(&mut n, settle.n);
                }
            }
            Settle::Unknown(step, range) => {
                for r in step.runs_in(range.start, range.end) {
                    for k in 0..r.items {
                        self.unknown(mode, (r.host_unit + k, r.host_layer, r.comp), &mut n);
                    }
                }
            }
        }
        self.table.count(n);
    }

    /// An item moved without a checksum: a backup forgets its recorded one, a load counts it
    /// unverified.
    fn unknown(&self, mode: ChecksumMode, (host, layer, comp): (u64, u64, u8), n: &mut [u64; 4]) {
        let Some(slot) = self.table.slot(host, layer, comp) else { return };
        match mode {
            ChecksumMode::Record => self.table.forget(slot),
            ChecksumMode::Verify => n[2] += 1,
        }
    }
}
