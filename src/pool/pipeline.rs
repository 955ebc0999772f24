//! Loads and backups in flight together, as sglang's cache controller runs them: loads on one
//! stream, backups on another, each waited on only where the forward pass needs it.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{layer_load_plans, DevicePool, HostPool};
use crate::error::{Result, TransferError};
use crate::exec::{Completion, Stream};
use crate::geometry::IoBackend;
use crate::plan::{Direction, Footprint, Op, Plan, Request};

/// Loads and backups between one host pool and one device pool, issued without waiting and in
/// flight together: loads run on the executor's main stream, backups on its backup stream, so a
/// backup does not queue behind the loads issued before it (cpu: a second worker thread; cuda:
/// a second stream of the context; wgpu has one queue, so there they run in issue order).
///
/// Where a transfer touches what one in flight on the other stream touches — a common layer
/// and a common host or device page — it is ordered after that stream's work so far, so the
/// bytes are those of running every call in issue order. Transfers on one stream are always
/// in issue order.
///
/// The pipeline holds both pools exclusively until it is finished or dropped (dropping waits
/// for everything issued), so safe code cannot read a pool mid-transfer:
///
/// ```compile_fail
/// # use hicache_io::*;
/// # fn f(host: &mut HostPool<'static>, dev: &mut DevicePool<'static>) -> Result<()> {
/// let mut p = host.pipeline(dev)?;
/// let t = p.load(&[0], &[1], 0, IoBackend::Kernel)?;
/// let bytes = dev.read_buffer(0, 0)?; // refused: the pipeline still holds the device pool
/// p.wait(t)
/// # }
/// ```
///
/// A pipeline keeps one entry per issued transfer until it ends: make one per batch. Its
/// backups are ordered after the main stream's work when it opens and after its own loads they
/// meet; on cuda, each backup also waits (on the device) for the work queued on the engine
/// stream when it is issued ([`crate::exec::cuda::CudaExecutor::set_engine_stream`]), so it
/// copies the KV the forward pass finished writing.
#[must_use = "dropping a pipeline waits for everything it issued"]
pub struct Pipeline<'a> {
    host: &'a HostPool<'static>,
    pub(super) device: &'a DevicePool<'static>,
    id: u64,
    issued: Vec<Issued>,
    /// Per stream (main, side): transfers of the other stream issued before this index are
    /// already ordered before this stream's later work.
    ordered: [usize; 2],
    _pools: PhantomData<&'a mut ()>,
}

struct Issued {
    stream: Stream,
    completion: Completion,
    footprint: Footprint,
}

/// One transfer issued on a [`Pipeline`]; wait for it with [`Pipeline::wait`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    pipeline: u64,
    index: usize,
}

fn slot(stream: Stream) -> usize {
    match stream {
        Stream::Main => 0,
        Stream::Backup => 1,
    }
}

impl HostPool<'static> {
    /// A pipeline over this host pool and `device_pool` (see [`Pipeline`]). Both pools must
    /// own their memory, so nothing in flight can outlive what it writes.
    pub fn pipeline<'a>(&'a mut self, device_pool: &'a mut DevicePool<'static>) -> Result<Pipeline<'a>> {
        self.check_pair(device_pool)?;
        // Backups start after what the main stream holds now (earlier plain calls), and
        // loads after what the backup stream holds (a leaked pipeline's backups).
        self.device().order_after(Stream::Main, Stream::Backup)?;
        self.device().order_after(Stream::Backup, Stream::Main)?;
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Ok(Pipeline {
            host: self,
            device: device_pool,
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            issued: Vec::new(),
            ordered: [0, 0],
            _pools: PhantomData,
        })
    }
}

impl Pipeline<'_> {
    /// `load_to_device_per_layer` on the main stream.
    pub fn load(&mut self, host_indices: &[i64], device_indices: &[i64], layer_id: usize, io_backend: IoBackend) -> Result<Ticket> {
        self.issue(Op::Load { layer_id, is_draft: false }, io_backend, host_indices, device_indices)
    }

    /// `load_to_device_per_layer(..., is_draft=True)` (draft pool `layer_id - layer_num`) on
    /// the main stream.
    pub fn load_draft(&mut self, host_indices: &[i64], device_indices: &[i64], layer_id: usize, io_backend: IoBackend) -> Result<Ticket> {
        self.issue(Op::Load { layer_id, is_draft: true }, io_backend, host_indices, device_indices)
    }

    /// Every owned live layer, then every draft pool, loaded in order on the main stream, one
    /// ticket per layer: `(layer id, ticket)`, draft `k` as `layer_num + k`. Every layer is
    /// validated before the first one moves; if issuing fails after the first, the error is
    /// `Partial` and names the host layers that landed.
    pub fn load_layers(&mut self, host_indices: &[i64], device_indices: &[i64], io_backend: IoBackend) -> Result<Vec<(usize, Ticket)>> {
        let plans = layer_load_plans(self.host, self.device, host_indices, device_indices, io_backend)?;
        let mut tickets = Vec::with_capacity(plans.len());
        for (i, (layer, op, plan)) in plans.iter().enumerate() {
            let req = Request { op: *op, io_backend, host_indices, device_indices };
            match self.run(plan, Footprint::of(plan, &req), Stream::Main) {
                Ok(t) => tickets.push((*layer, t)),
                Err(e) if i == 0 => return Err(e),
                Err(e) => {
                    let landed = matches!(self.wait(tickets[i - 1].1), Ok(()) | Err(crate::TransferError::Integrity { .. }));
                    return Err(super::partial_layers(&plans[..i], landed, e, plans.len()));
                }
            }
        }
        Ok(tickets)
    }

    /// `backup_from_device_all_layer` on the backup stream.
    pub fn backup(&mut self, host_indices: &[i64], device_indices: &[i64], io_backend: IoBackend) -> Result<Ticket> {
        self.issue(Op::Backup, io_backend, host_indices, device_indices)
    }

    /// [`HostPool::backup_from_device_per_layer`] on the backup stream.
    pub fn backup_layer(
        &mut self,
        host_indices: &[i64],
        device_indices: &[i64],
        layer_id: usize,
        is_draft: bool,
        io_backend: IoBackend,
    ) -> Result<Ticket> {
        self.issue(Op::BackupLayer { layer_id, is_draft }, io_backend, host_indices, device_indices)
    }

    /// Blocks until the transfer has landed (and everything issued before it on its stream).
    pub fn wait(&self, ticket: Ticket) -> Result<()> {
        self.get(ticket)?.completion.wait()
    }

    /// Makes `stream` (an engine's compute stream) wait for the transfer on the device, without
    /// blocking the host (see [`crate::exec::Completion::wait_on_stream`]).
    #[cfg(feature = "cuda")]
    pub fn wait_on_stream(&self, ticket: Ticket, stream: &cudarc::driver::CudaStream) -> Result<()> {
        self.get(ticket)?.completion.wait_on_stream(stream)
    }

    /// `Ok(true)` once the transfer has landed, `Ok(false)` while in flight.
    pub fn is_done(&self, ticket: Ticket) -> Result<bool> {
        self.get(ticket)?.completion.is_done()
    }

    /// Waits for everything issued and gives the pools back; the first error, if a transfer
    /// failed.
    pub fn finish(mut self) -> Result<()> {
        self.wait_all()
    }

    fn wait_all(&mut self) -> Result<()> {
        let mut first = Ok(());
        for issued in self.issued.drain(..).rev() {
            if let Err(e) = issued.completion.wait() {
                first = Err(e);
            }
        }
        first
    }

    fn get(&self, ticket: Ticket) -> Result<&Issued> {
        if ticket.pipeline != self.id {
            return Err(TransferError::InvalidConfig(format!("a ticket of pipeline #{} used on pipeline #{}", ticket.pipeline, self.id)));
        }
        self.issued.get(ticket.index).ok_or_else(|| TransferError::InvalidConfig(format!("no transfer #{} on this pipeline", ticket.index)))
    }

    /// Plans (nothing moves unless accepted), then runs on the op's stream.
    fn issue(&mut self, op: Op, io_backend: IoBackend, host_indices: &[i64], device_indices: &[i64]) -> Result<Ticket> {
        let req = Request { op, io_backend, host_indices, device_indices };
        let plan = self.host.plan(self.device, &req)?;
        let stream = match op.direction() {
            Direction::HostToDevice => Stream::Main,
            Direction::DeviceToHost => Stream::Backup,
        };
        self.run(&plan, Footprint::of(&plan, &req), stream)
    }

    /// Orders `stream` after the other one where `footprint` meets a transfer still in flight
    /// there, then enqueues.
    fn run(&mut self, plan: &Plan, footprint: Footprint, stream: Stream) -> Result<Ticket> {
        let other = if stream == Stream::Main { Stream::Backup } else { Stream::Main };
        let start = self.ordered[slot(stream)];
        let hazard = self.issued[start..]
            .iter()
            .any(|t| t.stream == other && t.footprint.conflicts(&footprint) && !t.completion.is_done().unwrap_or(false));
        let device = self.host.device();
        if hazard {
            log::debug!("pipeline: a {:?} transfer waits for the {other:?} stream (same layer and page)", plan.direction());
            device.order_after(other, stream)?;
            self.ordered[slot(stream)] = self.issued.len();
        }
        let completion = device.execute_on(plan, &self.host.bindings(self.device, plan), stream)?;
        self.issued.push(Issued { stream, completion, footprint });
        Ok(Ticket { pipeline: self.id, index: self.issued.len() - 1 })
    }
}

impl Drop for Pipeline<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.wait_all() {
            log::error!("a pipeline dropped without finishing had a failed transfer: {e}");
        }
    }
}
