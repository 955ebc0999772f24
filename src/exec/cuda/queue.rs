//! Streams besides the executor's own: the engine's (backups wait for it), the backup stream
//! (a pipeline's backups), and completions (events) the host or an engine's stream waits on.

use std::sync::{Arc, Mutex};

use cudarc::driver::result;
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaStream, DriverError};

use super::driver::{drv, drv_msg};
use super::staging::Scratch;
use crate::error::Result;

/// Work enqueued on `then` from now on starts after the work enqueued on `first` so far: an event
/// recorded on `first` and waited on by `then`, on the device (the host does not block).
///
/// # Safety
/// Both are live streams of the bound context.
pub(super) unsafe fn order_raw(first: sys::CUstream, then: sys::CUstream, what: &str) -> Result<()> {
    let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| drv("cuEventCreate", e))?;
    // SAFETY: the caller vouches for the streams; the event may be destroyed as soon as the wait
    // is enqueued (the wait keeps what it needs).
    let r = unsafe {
        result::event::record(event, first)
            .and_then(|_| result::stream::wait_event(then, event, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT))
    };
    // SAFETY: created above.
    let _ = unsafe { result::event::destroy(event) };
    r.map_err(|e| drv(what, e))
}

/// The stream an engine writes its KV on, raw, and the handle that keeps it alive (if any).
pub(super) struct EngineStream {
    pub(super) raw: sys::CUstream,
    pub(super) _keep: Option<Arc<CudaStream>>,
}

// SAFETY: a stream handle, used only with the executor's context bound.
unsafe impl Send for EngineStream {}

/// A second stream of the executor's context, for work that must not queue behind the main
/// stream's; gather steps on it upload through their own scratch.
pub(super) struct BackupStream {
    pub(super) stream: Arc<CudaStream>,
    pub(super) scratch: Mutex<Scratch>,
}

/// Completion of everything enqueued before [`super::CudaExecutor::record`] (an event on the
/// executor's stream).
pub struct CudaTicket {
    pub(super) event: sys::CUevent,
    pub(super) ctx: Arc<CudaContext>,
    /// The executor's checksums to settle once the recorded work is done.
    pub(super) sums: Arc<super::checksums::SumsQueue>,
}

unsafe impl Send for CudaTicket {}

impl CudaTicket {
    /// Blocks until the recorded work is done (and its checksums are settled).
    pub fn wait(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| drv("bind", e))?;
        // SAFETY: event created and recorded by us.
        let r = unsafe { result::event::synchronize(self.event) }.map_err(|e| drv("cuEventSynchronize", e));
        // The recorded work's sums arrived before the event completed.
        // SAFETY: the context is bound.
        unsafe { self.sums.settle(false) };
        r
    }
    /// Makes `stream` wait for the recorded work on the device, without blocking the host (what
    /// an engine's compute stream does before it reads a layer being loaded).
    pub fn wait_on_stream(&self, stream: &CudaStream) -> Result<()> {
        if **stream.context() != *self.ctx {
            return Err(drv_msg("the stream belongs to another CUDA context than the transfer"));
        }
        // SAFETY: a live stream of this (now bound) context.
        unsafe { self.wait_on_raw_stream(stream.cu_stream()) }
    }
    /// [`CudaTicket::wait_on_stream`] with a raw handle.
    ///
    /// # Safety
    /// `stream` must be a live stream of the transfer's context (or a default-stream handle).
    pub unsafe fn wait_on_raw_stream(&self, stream: sys::CUstream) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| drv("bind", e))?;
        // SAFETY: the caller vouches for the stream; the event is ours and recorded.
        unsafe { result::stream::wait_event(stream, self.event, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .map_err(|e| drv("cuStreamWaitEvent", e))
    }
    /// The recorded event (valid while the completion lives).
    pub fn event(&self) -> sys::CUevent {
        self.event
    }
    /// `Ok(true)` once done, `Ok(false)` while pending, `Err` when the stream failed (a poller
    /// must not spin on a dead context).
    pub fn is_done(&self) -> Result<bool> {
        self.ctx.bind_to_thread().map_err(|e| drv("bind", e))?;
        // SAFETY: as above.
        match unsafe { result::event::query(self.event) } {
            Ok(()) => {
                // SAFETY: the context is bound.
                unsafe { self.sums.settle(false) };
                Ok(true)
            }
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(drv("cuEventQuery", e)),
        }
    }
}

impl crate::exec::Ticket for CudaTicket {
    fn wait(&self) -> Result<()> {
        CudaTicket::wait(self)
    }
    fn is_done(&self) -> Result<bool> {
        CudaTicket::is_done(self)
    }
}

impl Drop for CudaTicket {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: created by us; destroying a pending event is allowed.
        let _ = unsafe { result::event::destroy(self.event) };
    }
}
