//! [`Completion`]: the dispatcher's handle on transfers some executor enqueued. It wraps the
//! backend's own [`Ticket`], so no backend needs to name it.

use std::sync::Arc;

use crate::error::Result;
use crate::integrity::MismatchSink;

#[cfg(feature = "cuda")]
use super::cuda;
#[cfg(feature = "wgpu")]
use super::wgpu;
use super::{cpu, Ticket};

/// Completion of transfers enqueued on one executor: wait for them, or poll. On cpu a ticket on
/// the executor's queue, on wgpu a queue submission, on cuda an event on the executor's stream.
pub struct Completion {
    kind: Kind,
    /// Where a checksumming load's copies report mismatching items.
    pub(super) integrity: Option<Arc<MismatchSink>>,
}

enum Kind {
    Done,
    Cpu(cpu::CpuTicket),
    #[cfg(feature = "wgpu")]
    Wgpu(wgpu::WgpuTicket),
    #[cfg(feature = "cuda")]
    Cuda(cuda::CudaTicket),
}

impl From<cpu::CpuTicket> for Completion {
    fn from(t: cpu::CpuTicket) -> Completion {
        Completion { kind: Kind::Cpu(t), integrity: None }
    }
}

#[cfg(feature = "wgpu")]
impl From<wgpu::WgpuTicket> for Completion {
    fn from(t: wgpu::WgpuTicket) -> Completion {
        Completion { kind: Kind::Wgpu(t), integrity: None }
    }
}

#[cfg(feature = "cuda")]
impl From<cuda::CudaTicket> for Completion {
    fn from(t: cuda::CudaTicket) -> Completion {
        Completion { kind: Kind::Cuda(t), integrity: None }
    }
}

impl Completion {
    /// Nothing to wait for.
    pub fn done() -> Completion {
        Completion { kind: Kind::Done, integrity: None }
    }
    /// The backend's ticket, as a dyn [`Ticket`] (`None` for nothing to wait for).
    fn ticket(&self) -> Option<&dyn Ticket> {
        match &self.kind {
            Kind::Done => None,
            Kind::Cpu(t) => Some(t),
            #[cfg(feature = "wgpu")]
            Kind::Wgpu(t) => Some(t),
            #[cfg(feature = "cuda")]
            Kind::Cuda(t) => Some(t),
        }
    }
    /// Blocks until the transfers are done; their error, if one failed (an
    /// [`crate::TransferError::Integrity`] when a load read items that do not match their
    /// checksums: the other items have landed).
    pub fn wait(&self) -> Result<()> {
        self.wait_transfers()?;
        self.integrity_error()
    }
    /// The integrity error of a completed checksumming load (`Ok` otherwise); does not wait.
    pub(crate) fn integrity_error(&self) -> Result<()> {
        match self.integrity.as_ref().and_then(|s| s.error()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
    fn wait_transfers(&self) -> Result<()> {
        self.ticket().map_or(Ok(()), |t| t.wait())
    }
    /// Makes a CUDA stream (an engine's compute stream) wait for the transfers on the device,
    /// without blocking the host: what sglang's per-layer load events give the forward pass. On
    /// cuda the stream must belong to the executor's context; the transfers of other executors
    /// do not run on CUDA streams, so there this blocks until they are done (and reports their
    /// integrity error). On cuda a checksumming load's verdict is not known on the host yet:
    /// [`Completion::wait`] or [`Completion::is_done`] gives it once the transfers are done.
    #[cfg(feature = "cuda")]
    pub fn wait_on_stream(&self, stream: &cudarc::driver::CudaStream) -> Result<()> {
        match &self.kind {
            // No host wait: the checksums settle when the host next looks (wait, is_done).
            Kind::Cuda(c) => c.wait_on_stream(stream),
            _ => self.wait(),
        }
    }
    /// The CUDA completion underneath (its event), on the cuda executor.
    #[cfg(feature = "cuda")]
    pub fn as_cuda(&self) -> Option<&cuda::CudaTicket> {
        match &self.kind {
            Kind::Cuda(c) => Some(c),
            _ => None,
        }
    }
    /// `Ok(true)` once done, `Ok(false)` while pending, `Err` when the executor failed (or, once
    /// done, an item failed its checksum).
    pub fn is_done(&self) -> Result<bool> {
        let done = self.ticket().map_or(Ok(true), |t| t.is_done())?;
        if done {
            self.integrity_error()?;
        }
        Ok(done)
    }
}
