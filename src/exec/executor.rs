//! What a backend implements: the [`Executor`] trait, its [`Ticket`], the [`Stream`]s it
//! queues on and the [`Bindings`] a plan runs over. Backends import this file (and
//! [`super::settle`]) and nothing of the dispatcher.

use std::sync::{Arc, Mutex};

use crate::error::{Result, TransferError};
use crate::geometry::BufRef;
use crate::plan::{AutoTable, Capabilities, Plan};

use super::settle::ChecksumBinding;

/// Which executor, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecutorKind {
    /// Host memory (the reference).
    Cpu,
    /// WGSL compute shaders on Vulkan, Metal or DX12.
    Wgpu,
    /// NVIDIA GPUs.
    Cuda,
}

impl ExecutorKind {
    /// Every executor, in `auto` order reversed.
    pub const ALL: [ExecutorKind; 3] = [ExecutorKind::Cpu, ExecutorKind::Wgpu, ExecutorKind::Cuda];
    /// `cpu`, `wgpu` or `cuda`.
    pub fn name(self) -> &'static str {
        match self {
            ExecutorKind::Cpu => "cpu",
            ExecutorKind::Wgpu => "wgpu",
            ExecutorKind::Cuda => "cuda",
        }
    }
}

impl std::str::FromStr for ExecutorKind {
    type Err = TransferError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(ExecutorKind::Cpu),
            "wgpu" => Ok(ExecutorKind::Wgpu),
            "cuda" => Ok(ExecutorKind::Cuda),
            other => Err(TransferError::UnknownName { what: "executor", name: other.into(), expected: "cpu, wgpu, cuda, auto" }),
        }
    }
}

/// One of an executor's two ordered queues of transfers. Plain calls and a [`crate::Pipeline`]'s
/// loads run on `Main`; a pipeline's backups on `Backup`, so a backup need not wait for the loads
/// in flight. cpu: two worker threads; cuda: the executor's stream and a second stream of its
/// context; wgpu: one queue, so both name the same submission order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stream {
    /// Plain calls and pipeline loads.
    Main,
    /// Pipeline backups.
    Backup,
}

/// Buffers a plan refers to: host component buffers `[comp]` and device buffers
/// `[comp][slot]`.
pub(crate) struct Bindings<'a, B> {
    pub(crate) host: Vec<&'a B>,
    pub(crate) device: Vec<Vec<&'a B>>,
    /// The host pool's checksum table and this transfer's mismatch report, for plans whose
    /// copies checksum.
    pub(crate) integrity: Option<ChecksumBinding>,
}

impl<'a, B> Bindings<'a, B> {
    /// The buffer `r` names (the GPU executors' copies look buffers up this way).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    pub fn get(&self, r: BufRef) -> &'a B {
        match r {
            BufRef::Host { comp } => self.host[comp as usize],
            BufRef::Device { comp, slot } => self.device[comp as usize][slot as usize],
        }
    }
}

/// A backend's handle on transfers it has enqueued: wait for them, or poll.
pub(crate) trait Ticket {
    /// Blocks until the transfers are done; their error, if one failed.
    fn wait(&self) -> Result<()>;
    /// `Ok(true)` once done, `Ok(false)` while pending, `Err` when the executor failed.
    fn is_done(&self) -> Result<bool>;
}

/// The `auto` io backend's measured table of one executor instance (clones share it), kept on
/// the instance so that its capabilities need not look it up anywhere else.
#[derive(Clone, Default)]
pub(crate) struct AutoSlot(Arc<Mutex<Option<AutoTable>>>);

impl AutoSlot {
    /// The table measured so far, if any.
    pub(crate) fn get(&self) -> Option<AutoTable> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// Keeps `t` as this instance's table.
    pub(crate) fn set(&self, t: AutoTable) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(t);
    }
}

/// What a backend implements. Buffers are zero-initialised on allocation. Crate-internal: its
/// reads and writes go through shared buffer references, so only [`super::Device`] (which checks
/// spans) and the pools (which hold `&mut` on every destination) may call them.
pub(crate) trait Executor {
    /// The backend's buffer type.
    type Buffer;
    /// The backend's handle on enqueued transfers.
    type Ticket: Ticket;
    /// Which executor this is.
    const KIND: ExecutorKind;
    /// `cpu`, `wgpu` or `cuda`.
    fn name(&self) -> &'static str {
        Self::KIND.name()
    }
    /// This instance's identity (clones share it).
    fn id(&self) -> u64;
    /// The identity of the executor instance a buffer belongs to.
    fn buffer_owner(&self, buf: &Self::Buffer) -> u64;
    /// Adapter / device description for `hicache-io info` and check output.
    fn describe(&self) -> String;
    /// What the planner may ask of this executor (its `auto` table is the default rule; the
    /// measured one lives in [`Executor::auto_slot`]).
    fn capabilities(&self) -> Capabilities;
    /// This instance's measured `auto` table.
    fn auto_slot(&self) -> &AutoSlot;
    /// Device-side memory (device pools).
    fn alloc(&self, bytes: u64) -> Result<Self::Buffer>;
    /// Host-side memory the executor can still address (host pools): pinned and mapped on
    /// cuda; the same as `alloc` where host and device memory are one kind.
    fn alloc_host(&self, bytes: u64) -> Result<Self::Buffer> {
        self.alloc(bytes)
    }
    /// A pool buffer of `bytes` in segments of `segment` bytes (the pool's choice from
    /// [`Capabilities::max_segment`]; executors without a segment limit never get one below
    /// `bytes`); host memory for host pools.
    fn alloc_pool(&self, bytes: u64, segment: u64, host: bool) -> Result<Self::Buffer> {
        let _ = segment;
        if host {
            self.alloc_host(bytes)
        } else {
            self.alloc(bytes)
        }
    }
    /// Bytes a buffer holds.
    fn buffer_len(&self, buf: &Self::Buffer) -> u64;
    /// Checks a borrowed buffer (usage flags, alignment) before a pool wraps it.
    fn check_buffer(&self, _buf: &Self::Buffer) -> Result<()> {
        Ok(())
    }
    /// Writes `data` at `offset` (span already checked).
    fn write(&self, buf: &Self::Buffer, offset: u64, data: &[u8]) -> Result<()>;
    /// Reads into `out` from `offset` (span already checked), after pending transfers.
    fn read(&self, buf: &Self::Buffer, offset: u64, out: &mut [u8]) -> Result<()>;
    /// Runs or enqueues step `k` of a validated plan (`enqueue`: the caller wants it queued
    /// even where it could run at once; cpu runs synchronous calls on an idle queue inline). Destination buffers are written
    /// through shared references: the pools hand out `&mut` access to the destination pool, so
    /// nothing else aliases it.
    fn execute_step(&self, plan: &Plan, k: usize, bufs: &Bindings<'_, Self::Buffer>, enqueue: bool, stream: Stream) -> Result<()>;
    /// A handle on everything enqueued on `stream` so far.
    fn completion(&self, stream: Stream) -> Result<Self::Ticket>;
    /// Work enqueued on `then` from now on starts only after everything enqueued on `first` so
    /// far (cuda: an event wait; cpu: a queued wait). Executors with one queue need nothing.
    fn order_after(&self, first: Stream, then: Stream) -> Result<()> {
        let _ = (first, then);
        Ok(())
    }
    /// Whether `stream` may still be running work (a cheap, conservative check).
    fn is_busy(&self, stream: Stream) -> bool {
        let _ = stream;
        false
    }
    /// After the last step of a plan: wait where the executor's contract is synchronous (wgpu),
    /// nothing where transfers are stream-ordered (cuda) or already done (cpu).
    fn finish(&self) -> Result<()> {
        Ok(())
    }
    /// Waits for every submitted transfer, on both streams.
    fn synchronize(&self) -> Result<()>;
    /// [`Executor::synchronize`], then what the executor kept for its caller: on cuda an earlier
    /// call's failed device index check, or else the mismatches of plain checksumming loads.
    fn synchronize_and_report(&self) -> Result<()> {
        self.synchronize()
    }
    /// The mismatches of plain (synchronous) checksumming loads not reported yet; does not
    /// wait. Only executors whose plain calls return before their checksums arrive have any.
    fn integrity_reports(&self) -> Result<()> {
        Ok(())
    }
    /// Waits until the item checksums of every transfer queued so far are settled (by default:
    /// until every queued transfer is done).
    fn settle_checksums(&self) -> Result<()> {
        self.synchronize()
    }
    /// The first earlier call whose device-resident index lists failed their checks (`wait`:
    /// waiting for every report); executors that check index lists on the host have none.
    fn index_check_reports(&self, wait: bool) -> Result<()> {
        let _ = wait;
        Ok(())
    }
    /// Runs `f`, whose calls all check their device-resident index lists with one shared check
    /// (all of them move, or none); executors without such lists just run it.
    fn with_shared_index_check<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        f()
    }
    /// Median seconds of one contiguous copy of `bytes` (the ceiling benchmarks compare with):
    /// memcpy on cpu, one buffer-to-buffer copy on wgpu, one host-to-device copy on cuda.
    fn time_one_copy(&self, bytes: u64, budget: std::time::Duration) -> Result<f64>;
}
