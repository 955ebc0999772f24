//! Fault injection into a host pool (tests and `hicache-io fuzz`): bytes or recorded checksums
//! changed behind the pool's back, as a fault in host memory would, to prove loads catch it.

use super::HostPool;
use crate::error::Result;

impl HostPool<'_> {
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
