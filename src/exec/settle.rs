//! Settling item checksums that an executor's copies computed: a host pool's checksum table
//! bound to one transfer records them (backups) or verifies them (loads).

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
    /// Records (backup) or verifies (load) the checksum `sum` of item `(host index, device index,
    /// host layer, component)`, counting into `n` (recorded, verified, unverified, mismatched).
    #[inline(always)]
    pub(crate) fn settle(&self, mode: ChecksumMode, (host, device, layer, comp): (u64, u64, u64, u8), sum: u64, n: &mut [u64; 4]) {
        let Some(slot) = self.table.slot(host, layer, comp) else { return };
        match mode {
            ChecksumMode::Record => {
                self.table.record(slot, sum);
                n[0] += 1;
            }
            ChecksumMode::Verify => match self.table.expected(slot) {
                None => n[2] += 1,
                Some(e) if e == sum => n[1] += 1,
                Some(expected) => {
                    n[3] += 1;
                    self.sink.push(ItemMismatch { layer, component: comp, host_index: host, device_index: device, expected, found: sum });
                }
            },
        }
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
                for (i, (&s, &d)) in src.iter().zip(dst.iter()).enumerate() {
                    if s < 0 || d < 0 {
                        continue;
                    }
                    let (host, device) = match mode {
                        ChecksumMode::Record => (d as u64, s as u64),
                        ChecksumMode::Verify => (s as u64, d as u64),
                    };
                    for (l, &(layer, comp)) in items.iter().enumerate() {
                        match sum {
                            Some(sum) => self.settle(mode, (host, device, layer, comp), sum(i, l), &mut n),
                            None => self.unknown(mode, (host, layer, comp), &mut n),
                        }
                    }
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
