//! Executors: each one only allocates, runs plans, synchronizes and reads/writes bytes.
//! Support decisions live in [`crate::plan`]; an executor states its limits as
//! [`Capabilities`] and the planner reads them.
//!
//! The run-time choice is the [`Device`] enum (candle-style): its match arms forward to each
//! backend's implementation of the crate-internal `Executor` trait.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::error::{Result, TransferError};
use crate::geometry::BufRef;
use crate::plan::{Capabilities, Plan, Step};

/// Completion of transfers enqueued on one executor: wait for them, or poll. On cpu a ticket on
/// the executor's queue, on wgpu a queue submission, on cuda an event on the executor's stream.
pub struct Completion {
    kind: CompletionKind,
    /// Where a checksumming load's copies report mismatching items.
    integrity: Option<std::sync::Arc<crate::integrity::MismatchSink>>,
}

enum CompletionKind {
    Done,
    Cpu(cpu::CpuTicket),
    #[cfg(feature = "wgpu")]
    Wgpu(wgpu::WgpuExecutor, u64),
    #[cfg(feature = "cuda")]
    Cuda(cuda::Completion),
}

impl Completion {
    /// Nothing to wait for.
    pub fn done() -> Completion {
        Completion { kind: CompletionKind::Done, integrity: None }
    }
    pub(crate) fn cpu(t: cpu::CpuTicket) -> Completion {
        Completion { kind: CompletionKind::Cpu(t), integrity: None }
    }
    #[cfg(feature = "wgpu")]
    pub(crate) fn wgpu(e: wgpu::WgpuExecutor, ticket: u64) -> Completion {
        Completion { kind: CompletionKind::Wgpu(e, ticket), integrity: None }
    }
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda(c: cuda::Completion) -> Completion {
        Completion { kind: CompletionKind::Cuda(c), integrity: None }
    }
    /// Blocks until the transfers are done; their error, if one failed (an
    /// [`TransferError::Integrity`] when a load read items that do not match their checksums:
    /// the other items have landed).
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
        match &self.kind {
            CompletionKind::Done => Ok(()),
            CompletionKind::Cpu(t) => t.wait(),
            #[cfg(feature = "wgpu")]
            CompletionKind::Wgpu(e, ticket) => e.wait_for(*ticket),
            #[cfg(feature = "cuda")]
            CompletionKind::Cuda(c) => c.wait(),
        }
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
            CompletionKind::Cuda(c) => c.wait_on_stream(stream),
            _ => self.wait(),
        }
    }
    /// The CUDA completion underneath (its event), on the cuda executor.
    #[cfg(feature = "cuda")]
    pub fn as_cuda(&self) -> Option<&cuda::Completion> {
        match &self.kind {
            CompletionKind::Cuda(c) => Some(c),
            _ => None,
        }
    }
    /// `Ok(true)` once done, `Ok(false)` while pending, `Err` when the executor failed (or, once
    /// done, an item failed its checksum).
    pub fn is_done(&self) -> Result<bool> {
        let done = self.poll()?;
        if done {
            self.integrity_error()?;
        }
        Ok(done)
    }
    fn poll(&self) -> Result<bool> {
        match &self.kind {
            CompletionKind::Done => Ok(true),
            CompletionKind::Cpu(t) => Ok(t.is_done()),
            #[cfg(feature = "wgpu")]
            CompletionKind::Wgpu(e, ticket) => e.is_done(*ticket),
            #[cfg(feature = "cuda")]
            CompletionKind::Cuda(c) => c.is_done(),
        }
    }
}

mod calibrate;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod cuda_launch;
#[cfg(feature = "wgpu")]
pub mod wgpu;

/// A fresh identity for an executor instance: pools, buffers and plans carry it, and objects of
/// two instances never meet in one call.
pub(crate) fn next_executor_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// One of an executor's two ordered queues of transfers. Plain calls and a [`crate::Pipeline`]'s
/// loads run on `Main`; a pipeline's backups on `Side`, so a backup need not wait for the loads
/// in flight. cpu: two worker threads; cuda: the executor's stream and a second stream of its
/// context; wgpu: one queue, so both name the same submission order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stream {
    /// Plain calls and pipeline loads.
    Main,
    /// Pipeline backups.
    Side,
}

/// Buffers a plan refers to: host component buffers `[comp]` and device buffers
/// `[comp][slot]`.
pub(crate) struct Bindings<'a, B> {
    pub(crate) host: Vec<&'a B>,
    pub(crate) device: Vec<Vec<&'a B>>,
    /// The host pool's checksum table and this transfer's mismatch report, for plans whose
    /// copies checksum.
    pub(crate) integrity: Option<IntegrityBinding>,
}

/// A host pool's checksum table bound to one transfer.
#[derive(Clone)]
pub(crate) struct IntegrityBinding {
    pub(crate) sidecar: std::sync::Arc<crate::integrity::Sidecar>,
    pub(crate) sink: std::sync::Arc<crate::integrity::MismatchSink>,
}

impl IntegrityBinding {
    /// Records (backup) or verifies (load) the checksum `sum` of item `(host index, device index,
    /// host layer, component)`, counting into `n` (recorded, verified, unverified, mismatched).
    #[inline(always)]
    pub(crate) fn settle(
        &self,
        mode: crate::plan::ChecksumMode,
        (host, device, layer, comp): (u64, u64, u64, u8),
        sum: u64,
        n: &mut [u64; 4],
    ) {
        let Some(slot) = self.sidecar.slot(host, layer, comp) else { return };
        match mode {
            crate::plan::ChecksumMode::Record => {
                self.sidecar.record(slot, sum);
                n[0] += 1;
            }
            crate::plan::ChecksumMode::Verify => match self.sidecar.expected(slot) {
                None => n[2] += 1,
                Some(e) if e == sum => n[1] += 1,
                Some(expected) => {
                    n[3] += 1;
                    self.sink.push(crate::integrity::ItemMismatch {
                        layer,
                        component: comp,
                        host_index: host,
                        device_index: device,
                        expected,
                        found: sum,
                    });
                }
            },
        }
    }
}

impl<'a, B> Bindings<'a, B> {
    /// The buffer `r` names.
    pub fn get(&self, r: BufRef) -> &'a B {
        match r {
            BufRef::Host { comp } => self.host[comp as usize],
            BufRef::Device { comp, slot } => self.device[comp as usize][slot as usize],
        }
    }
}

/// What a backend implements. Buffers are zero-initialised on allocation. Crate-internal: its
/// reads and writes go through shared buffer references, so only [`Device`] (which checks spans)
/// and the pools (which hold `&mut` on every destination) may call them.
pub(crate) trait Executor {
    /// The backend's buffer type.
    type Buffer;
    /// `cpu`, `wgpu` or `cuda`.
    fn name(&self) -> &'static str;
    /// This instance's identity (clones share it).
    fn id(&self) -> u64;
    /// The identity of the executor instance a buffer belongs to.
    fn buffer_owner(&self, buf: &Self::Buffer) -> u64;
    /// Adapter / device description for `hicache-io info` and check output.
    fn describe(&self) -> String;
    /// What the planner may ask of this executor.
    fn capabilities(&self) -> Capabilities;
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
    fn completion(&self, stream: Stream) -> Result<Completion>;
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
    /// Median seconds of one contiguous copy of `bytes` (the ceiling benchmarks compare with):
    /// memcpy on cpu, one buffer-to-buffer copy on wgpu, one host-to-device copy on cuda.
    fn time_one_copy(&self, bytes: u64, budget: std::time::Duration) -> Result<f64>;
}

/// Which executor, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// Host memory (the reference).
    Cpu,
    /// WGSL compute shaders on Vulkan, Metal or DX12.
    Wgpu,
    /// NVIDIA GPUs.
    Cuda,
}

impl BackendKind {
    /// Every executor, in `auto` order reversed.
    pub const ALL: [BackendKind; 3] = [BackendKind::Cpu, BackendKind::Wgpu, BackendKind::Cuda];
    /// `cpu`, `wgpu` or `cuda`.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Wgpu => "wgpu",
            BackendKind::Cuda => "cuda",
        }
    }
}

impl std::str::FromStr for BackendKind {
    type Err = TransferError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(BackendKind::Cpu),
            "wgpu" => Ok(BackendKind::Wgpu),
            "cuda" => Ok(BackendKind::Cuda),
            other => Err(TransferError::UnknownName { what: "executor", name: other.into(), expected: "cpu, wgpu, cuda, auto" }),
        }
    }
}

/// An executor chosen at run time. Clones share one executor instance (one identity).
#[derive(Clone)]
pub enum Device {
    /// Host memory.
    Cpu(cpu::CpuExecutor),
    /// WGSL compute shaders.
    #[cfg(feature = "wgpu")]
    Wgpu(wgpu::WgpuExecutor),
    /// NVIDIA GPUs through cudarc.
    #[cfg(feature = "cuda")]
    Cuda(cuda::CudaExecutor),
}

/// A buffer of some executor.
pub enum Buffer {
    /// Host memory.
    Cpu(cpu::CpuBuffer),
    /// A wgpu storage buffer.
    #[cfg(feature = "wgpu")]
    Wgpu(wgpu::WgpuBuffer),
    /// CUDA device memory or pinned mapped host memory.
    #[cfg(feature = "cuda")]
    Cuda(cuda::CudaBuffer),
}

macro_rules! each_backend {
    ($self:expr, $e:ident => $body:expr) => {
        match $self {
            Device::Cpu($e) => $body,
            #[cfg(feature = "wgpu")]
            Device::Wgpu($e) => $body,
            #[cfg(feature = "cuda")]
            Device::Cuda($e) => $body,
        }
    };
}

/// Narrows a binding of [`Buffer`]s to one backend's buffers; fails if one belongs to another
/// executor.
fn typed<'a, T>(bufs: &Bindings<'a, Buffer>, pick: impl Fn(&'a Buffer) -> Option<&'a T>, name: &'static str) -> Result<Bindings<'a, T>> {
    let err = || TransferError::ExecutorMismatch { expected: format!("{name} buffers"), found: "a buffer of another executor kind".into() };
    let host = bufs.host.iter().map(|b| pick(b).ok_or_else(err)).collect::<Result<Vec<_>>>()?;
    let device =
        bufs.device.iter().map(|c| c.iter().map(|b| pick(b).ok_or_else(err)).collect::<Result<Vec<_>>>()).collect::<Result<Vec<_>>>()?;
    Ok(Bindings { host, device, integrity: bufs.integrity.clone() })
}

impl Device {
    /// A new cpu executor instance.
    pub fn cpu() -> Device {
        Device::Cpu(cpu::CpuExecutor::new())
    }

    /// Opens one executor; a missing driver or adapter is `Err(Unavailable)`, never a panic.
    pub fn open(kind: BackendKind) -> Result<Device> {
        match kind {
            BackendKind::Cpu => Ok(Device::cpu()),
            #[cfg(feature = "wgpu")]
            BackendKind::Wgpu => Ok(Device::Wgpu(wgpu::WgpuExecutor::new()?)),
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => Ok(Device::Cuda(cuda::CudaExecutor::new(0)?)),
            #[allow(unreachable_patterns)]
            other => Err(TransferError::Unavailable { backend: other.name(), reason: "not compiled in (cargo feature off)".into() }),
        }
    }

    /// `auto`: cuda, then wgpu, then cpu.
    pub fn auto() -> Device {
        for kind in [BackendKind::Cuda, BackendKind::Wgpu] {
            match Device::open(kind) {
                Ok(d) => return d,
                Err(e) => log::info!("auto: {e}"),
            }
        }
        Device::cpu()
    }

    /// From `HICACHE_IO_BACKEND=cpu|wgpu|cuda|auto` (unset or empty means auto); an unknown
    /// name is an error.
    pub fn from_env() -> Result<Device> {
        match std::env::var("HICACHE_IO_BACKEND").ok().as_deref() {
            None | Some("") | Some("auto") => Ok(Device::auto()),
            Some(name) => Device::open(name.parse()?),
        }
    }

    /// Which executor.
    pub fn kind(&self) -> BackendKind {
        match self {
            Device::Cpu(_) => BackendKind::Cpu,
            #[cfg(feature = "wgpu")]
            Device::Wgpu(_) => BackendKind::Wgpu,
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => BackendKind::Cuda,
        }
    }

    /// `cpu`, `wgpu` or `cuda`.
    pub fn name(&self) -> &'static str {
        each_backend!(self, e => e.name())
    }
    /// This executor instance's identity (clones share it).
    pub fn id(&self) -> u64 {
        each_backend!(self, e => e.id())
    }
    /// Name and identity, for messages: `wgpu #3`.
    pub fn label(&self) -> String {
        format!("{} #{}", self.name(), self.id())
    }
    /// Adapter or device description.
    pub fn describe(&self) -> String {
        each_backend!(self, e => e.describe())
    }
    /// What the planner may ask of this executor (the `auto` table as calibrated so far).
    pub fn capabilities(&self) -> Capabilities {
        let mut caps = each_backend!(self, e => e.capabilities());
        if let Some(t) = calibrate::cached(self.id()) {
            caps.auto = t;
        }
        caps
    }

    /// [`Device::capabilities`] with the `auto` table measured: on first use per executor
    /// instance (at most about a second, or read from the cache file of this adapter).
    pub fn calibrated_capabilities(&self) -> Capabilities {
        let mut caps = each_backend!(self, e => e.capabilities());
        caps.auto = calibrate::table(self, caps);
        caps
    }
    /// Waits for every submitted transfer (on cuda, then reports an earlier call's failed
    /// device index check, or else the mismatches of plain checksumming loads, as
    /// `CudaExecutor::synchronize` does).
    pub fn synchronize(&self) -> Result<()> {
        each_backend!(self, e => e.synchronize())
    }
    /// The items of plain (synchronous) checksumming loads that failed their checksums and have
    /// not been reported, as one [`TransferError::Integrity`]; does not wait. Only cuda has
    /// any: its plain calls return once enqueued, before their checksums arrive (other
    /// executors report them from the call). [`Device::synchronize`] reports them too.
    pub fn integrity_reports(&self) -> Result<()> {
        match self {
            #[cfg(feature = "cuda")]
            Device::Cuda(e) => e.integrity_reports(),
            _ => Ok(()),
        }
    }
    /// Waits until the item checksums of every transfer queued so far are settled (recorded,
    /// verified or forgotten in the host pools' tables): on cuda only for the steps that carry
    /// checksums (not for the engine's stream or other work), elsewhere for every queued transfer.
    pub(crate) fn settle_checksums(&self) -> Result<()> {
        match self {
            #[cfg(feature = "cuda")]
            Device::Cuda(e) => e.settle_checksums(),
            _ => self.wait_idle(),
        }
    }
    /// Waits for every submitted transfer and nothing more: a failed device index check of an
    /// earlier call stays pending for the code that issued it.
    pub fn wait_idle(&self) -> Result<()> {
        each_backend!(self, e => Executor::synchronize(e))
    }
    /// Median seconds of one contiguous copy of `bytes` (the benchmarks' ceiling).
    pub fn time_one_copy(&self, bytes: u64, budget: std::time::Duration) -> Result<f64> {
        each_backend!(self, e => e.time_one_copy(bytes, budget))
    }

    /// Device-side memory of `bytes` bytes, zeroed.
    pub fn alloc(&self, bytes: u64) -> Result<Buffer> {
        match self {
            Device::Cpu(e) => e.alloc(bytes).map(Buffer::Cpu),
            #[cfg(feature = "wgpu")]
            Device::Wgpu(e) => e.alloc(bytes).map(Buffer::Wgpu),
            #[cfg(feature = "cuda")]
            Device::Cuda(e) => e.alloc(bytes).map(Buffer::Cuda),
        }
    }

    /// A pool buffer whose copy chunks are `chunk_bytes` (at multiples of it), in the segments
    /// the executor's [`Capabilities::max_segment`] calls for, so that no chunk straddles two.
    pub(crate) fn alloc_pool(&self, bytes: u64, chunk_bytes: u64, host: bool) -> Result<Buffer> {
        let caps = self.capabilities();
        let segment = caps.segment_bytes(bytes, chunk_bytes).ok_or_else(|| TransferError::OutOfMemory {
            what: format!("one segment of a {bytes}-byte pool on {}", self.label()),
            requested: chunk_bytes,
            limit: format!("a segment holds at most {} bytes", caps.max_segment),
        })?;
        match self {
            Device::Cpu(e) => e.alloc_pool(bytes, segment, host).map(Buffer::Cpu),
            #[cfg(feature = "wgpu")]
            Device::Wgpu(e) => e.alloc_pool(bytes, segment, host).map(Buffer::Wgpu),
            #[cfg(feature = "cuda")]
            Device::Cuda(e) => e.alloc_pool(bytes, segment, host).map(Buffer::Cuda),
        }
    }

    /// Host-pool memory (pinned and mapped on cuda), zeroed.
    pub fn alloc_host(&self, bytes: u64) -> Result<Buffer> {
        match self {
            Device::Cpu(e) => e.alloc_host(bytes).map(Buffer::Cpu),
            #[cfg(feature = "wgpu")]
            Device::Wgpu(e) => e.alloc_host(bytes).map(Buffer::Wgpu),
            #[cfg(feature = "cuda")]
            Device::Cuda(e) => e.alloc_host(bytes).map(Buffer::Cuda),
        }
    }

    /// Bytes a buffer of this executor holds.
    pub fn buffer_len(&self, buf: &Buffer) -> Result<u64> {
        self.check_owner(buf)?;
        match (self, buf) {
            (Device::Cpu(e), Buffer::Cpu(b)) => Ok(e.buffer_len(b)),
            #[cfg(feature = "wgpu")]
            (Device::Wgpu(e), Buffer::Wgpu(b)) => Ok(e.buffer_len(b)),
            #[cfg(feature = "cuda")]
            (Device::Cuda(e), Buffer::Cuda(b)) => Ok(e.buffer_len(b)),
            #[allow(unreachable_patterns)]
            _ => Err(self.mismatch()),
        }
    }

    /// The buffer belongs to this executor instance (not only to an executor of this kind).
    fn check_owner(&self, buf: &Buffer) -> Result<()> {
        let owner = match (self, buf) {
            (Device::Cpu(e), Buffer::Cpu(b)) => e.buffer_owner(b),
            #[cfg(feature = "wgpu")]
            (Device::Wgpu(e), Buffer::Wgpu(b)) => e.buffer_owner(b),
            #[cfg(feature = "cuda")]
            (Device::Cuda(e), Buffer::Cuda(b)) => e.buffer_owner(b),
            #[allow(unreachable_patterns)]
            _ => return Err(self.mismatch()),
        };
        if owner != self.id() {
            return Err(TransferError::ExecutorMismatch { expected: self.label(), found: format!("a buffer of {} #{owner}", self.name()) });
        }
        Ok(())
    }

    /// Executor-specific checks of a borrowed buffer (ownership, usage flags, alignment).
    pub fn check_buffer(&self, buf: &Buffer) -> Result<()> {
        self.check_owner(buf)?;
        match (self, buf) {
            (Device::Cpu(e), Buffer::Cpu(b)) => e.check_buffer(b),
            #[cfg(feature = "wgpu")]
            (Device::Wgpu(e), Buffer::Wgpu(b)) => e.check_buffer(b),
            #[cfg(feature = "cuda")]
            (Device::Cuda(e), Buffer::Cuda(b)) => e.check_buffer(b),
            #[allow(unreachable_patterns)]
            _ => Err(self.mismatch()),
        }
    }

    /// Writes `data` at `offset` (checked against the buffer's size). Crate-internal: callers
    /// must hold the buffer exclusively (the pools' `write_buffer` takes `&mut self`).
    pub(crate) fn write(&self, buf: &Buffer, offset: u64, data: &[u8]) -> Result<()> {
        self.check_span(buf, offset, data.len() as u64)?;
        match (self, buf) {
            (Device::Cpu(e), Buffer::Cpu(b)) => e.write(b, offset, data),
            #[cfg(feature = "wgpu")]
            (Device::Wgpu(e), Buffer::Wgpu(b)) => e.write(b, offset, data),
            #[cfg(feature = "cuda")]
            (Device::Cuda(e), Buffer::Cuda(b)) => e.write(b, offset, data),
            #[allow(unreachable_patterns)]
            _ => Err(self.mismatch()),
        }
    }

    /// Reads `out.len()` bytes at `offset` (checked against the buffer's size). Crate-internal:
    /// no transfer may be writing the buffer meanwhile (the pools' borrows ensure it).
    pub(crate) fn read(&self, buf: &Buffer, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check_span(buf, offset, out.len() as u64)?;
        match (self, buf) {
            (Device::Cpu(e), Buffer::Cpu(b)) => e.read(b, offset, out),
            #[cfg(feature = "wgpu")]
            (Device::Wgpu(e), Buffer::Wgpu(b)) => e.read(b, offset, out),
            #[cfg(feature = "cuda")]
            (Device::Cuda(e), Buffer::Cuda(b)) => e.read(b, offset, out),
            #[allow(unreachable_patterns)]
            _ => Err(self.mismatch()),
        }
    }

    fn check_span(&self, buf: &Buffer, offset: u64, len: u64) -> Result<()> {
        let size = self.buffer_len(buf)?;
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(TransferError::BufferSize {
                what: format!("access at offset {offset} of {len} bytes"),
                expected: offset.saturating_add(len),
                actual: size,
            });
        }
        Ok(())
    }

    fn mismatch(&self) -> TransferError {
        TransferError::ExecutorMismatch { expected: self.label(), found: "a buffer of another executor kind".into() }
    }

    /// Arms a one-shot fault for testing recovery: the `after_steps`-th step executed from now
    /// on by this executor instance (0 = the next one) fails with an executor error before it
    /// runs. Steps before it complete normally.
    pub fn inject_fault(&self, after_steps: u64) {
        let mut faults = FAULTS.lock().unwrap_or_else(|e| e.into_inner());
        faults.retain(|(id, _)| *id != self.id());
        faults.push((self.id(), after_steps));
        FAULTS_ARMED.store(true, Ordering::Release);
    }

    /// Counts one step against an armed fault; `Err` when it fires.
    fn fault_point(&self) -> Result<()> {
        if !FAULTS_ARMED.load(Ordering::Acquire) || UNFAULTED.with(|u| u.get()) {
            return Ok(());
        }
        let mut faults = FAULTS.lock().unwrap_or_else(|e| e.into_inner());
        let id = self.id();
        let Some(pos) = faults.iter().position(|(f, _)| *f == id) else { return Ok(()) };
        if faults[pos].1 > 0 {
            faults[pos].1 -= 1;
            return Ok(());
        }
        faults.remove(pos);
        FAULTS_ARMED.store(!faults.is_empty(), Ordering::Release);
        Err(TransferError::Executor { backend: self.name(), message: "injected fault".into() })
    }

    /// Runs a plan over pool buffers, step by step, and waits for it. A plan made for another
    /// executor instance is refused before anything runs. When a step fails, the steps before
    /// it have completed (the executor is drained first) and the error names them.
    pub(crate) fn execute(&self, plan: &Plan, bufs: &Bindings<'_, Buffer>) -> Result<()> {
        self.dispatch(plan, bufs, false).map(|_| ())
    }

    /// [`Device::execute`] past any armed fault (the calibration's own runs must not use it up).
    pub(crate) fn execute_unfaulted(&self, plan: &Plan, bufs: &Bindings<'_, Buffer>) -> Result<()> {
        UNFAULTED.with(|u| u.set(true));
        let r = self.execute(plan, bufs);
        UNFAULTED.with(|u| u.set(false));
        r
    }

    /// Enqueues a plan and returns its completion without waiting.
    pub(crate) fn execute_async(&self, plan: &Plan, bufs: &Bindings<'_, Buffer>) -> Result<Completion> {
        self.dispatch(plan, bufs, true)
    }

    /// Enqueues a plan on `stream` for a [`crate::Pipeline`], which orders the two streams
    /// itself where their transfers touch the same slots.
    pub(crate) fn execute_on(&self, plan: &Plan, bufs: &Bindings<'_, Buffer>, stream: Stream) -> Result<Completion> {
        self.dispatch_on(plan, bufs, true, Some(stream))
    }

    /// Work enqueued on `then` from now on starts after everything enqueued on `first` so far.
    pub(crate) fn order_after(&self, first: Stream, then: Stream) -> Result<()> {
        each_backend!(self, e => e.order_after(first, then))
    }

    fn dispatch(&self, plan: &Plan, bufs: &Bindings<'_, Buffer>, enqueue: bool) -> Result<Completion> {
        self.dispatch_on(plan, bufs, enqueue, None)
    }

    /// `stream: None` is a plain call: the main stream, after anything still running on the
    /// side stream (a pipeline's backups; even a leaked pipeline's come before later calls).
    fn dispatch_on(&self, plan: &Plan, bufs: &Bindings<'_, Buffer>, enqueue: bool, stream: Option<Stream>) -> Result<Completion> {
        if plan.owner() != self.id() {
            return Err(TransferError::ExecutorMismatch {
                expected: self.label(),
                found: format!("a plan made for executor #{}", plan.owner()),
            });
        }
        if plan.is_empty() {
            return Ok(Completion::done());
        }
        macro_rules! typed_run {
            ($e:expr, $variant:ident, $name:literal) => {{
                #[allow(irrefutable_let_patterns)]
                let b = typed(bufs, |b| if let Buffer::$variant(x) = b { Some(x) } else { None }, $name)?;
                self.run_on($e, plan, &b, enqueue, stream)
            }};
        }
        let mut completion = match self {
            Device::Cpu(e) => typed_run!(e, Cpu, "cpu"),
            #[cfg(feature = "wgpu")]
            Device::Wgpu(e) => typed_run!(e, Wgpu, "wgpu"),
            #[cfg(feature = "cuda")]
            Device::Cuda(e) => typed_run!(e, Cuda, "cuda"),
        }
        .inspect_err(|e| {
            // An executor failure is the call's error; mismatches its completed steps found are
            // still worth a line.
            if let Some(Err(i)) = bufs.integrity.as_ref().map(|b| b.sink.error().map_or(Ok(()), Err)) {
                log::error!("{e}; before it: {i}");
            }
        })?;
        if let Some(b) = &bufs.integrity {
            completion.integrity = Some(b.sink.clone());
            if !enqueue {
                completion.integrity_error()?;
            }
        }
        Ok(completion)
    }

    fn run_on<E: Executor>(
        &self,
        e: &E,
        plan: &Plan,
        bufs: &Bindings<'_, E::Buffer>,
        enqueue: bool,
        stream: Option<Stream>,
    ) -> Result<Completion> {
        let stream = match stream {
            Some(s) => s,
            None => {
                if e.is_busy(Stream::Side) {
                    e.order_after(Stream::Side, Stream::Main)?;
                }
                Stream::Main
            }
        };
        self.run_steps(e, plan, bufs, enqueue, stream)
    }

    fn run_steps<E: Executor>(
        &self,
        e: &E,
        plan: &Plan,
        bufs: &Bindings<'_, E::Buffer>,
        enqueue: bool,
        stream: Stream,
    ) -> Result<Completion> {
        let steps = plan.steps();
        for k in 0..steps.len() {
            if let Err(err) = self.fault_point().and_then(|_| e.execute_step(plan, k, bufs, enqueue, stream)) {
                // Drain what was enqueued before the failure (stream-ordered executors too), so
                // "completed" is true: a sticky device error fails the drain, and then nothing is
                // reported complete.
                let drained = e.finish().and_then(|_| e.synchronize()).is_ok();
                return Err(partial(steps, k, drained, err));
            }
        }
        if enqueue {
            // Without a handle nobody could wait for what was queued: drain it before failing.
            return e.completion(stream).inspect_err(|_| {
                let _ = e.synchronize();
            });
        }
        e.finish().map_err(|err| partial(steps, steps.len().saturating_sub(1), false, err))?;
        Ok(Completion::done())
    }
}

/// Armed faults: (executor id, steps to let through first). Test support; the flag keeps the
/// cost at one atomic load per step when nothing is armed.
static FAULTS: Mutex<Vec<(u64, u64)>> = Mutex::new(Vec::new());
static FAULTS_ARMED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Set while the executor runs its own calibration plans.
    static UNFAULTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The error of a plan that failed at step `failed`. A single-step plan returns the executor's
/// error as it is (nothing completed); otherwise it names the host layers whose every step
/// completed before the failure (`drained`: the executor confirmed the earlier steps).
fn partial(steps: &[Step], failed: usize, drained: bool, err: TransferError) -> TransferError {
    if steps.len() <= 1 {
        return err;
    }
    let mut completed_layers: Vec<u64> = Vec::new();
    if drained {
        let pending: std::collections::BTreeSet<u64> = steps[failed..].iter().flat_map(|s| s.layers().iter().copied()).collect();
        completed_layers = steps[..failed].iter().flat_map(|s| s.layers().iter().copied()).filter(|l| !pending.contains(l)).collect();
        completed_layers.sort_unstable();
        completed_layers.dedup();
    }
    TransferError::Partial { failed_step: failed, total_steps: steps.len(), completed_layers, source: Box::new(err) }
}

/// Wraps borrowed host memory as a buffer of cpu executor `exec`. Crate-internal: the pool that
/// receives it carries the borrow's lifetime (`DevicePool<'m>`, `HostPool<'m>`), so the buffer
/// never outlives the slice, and the `&mut` borrow rules out other access meanwhile.
pub(crate) fn borrow_cpu_slice(exec: &cpu::CpuExecutor, s: &mut [u8]) -> Buffer {
    // SAFETY: see above; the slice is valid for reads and writes for the pool's lifetime.
    Buffer::Cpu(unsafe { cpu::CpuBuffer::from_raw(std::ptr::NonNull::from(&mut *s).cast(), s.len(), exec) })
}

/// One line per executor: what is present here and why not.
pub fn probe_all() -> Vec<(BackendKind, Result<Device>)> {
    BackendKind::ALL.into_iter().map(|k| (k, Device::open(k))).collect()
}
