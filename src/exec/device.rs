//! The run-time choice of executor: [`Device`] and [`Buffer`], whose variants are listed once, in
//! [`each_backend!`], and forwarded to each backend's [`Executor`] implementation
//! (candle-style: backends only execute, and never name these enums).

use std::ptr::NonNull;

use crate::error::{Result, TransferError};
use crate::exec::caller::{Memory, RawTensor};
use crate::plan::Capabilities;

#[cfg(feature = "cuda")]
use super::cuda;
#[cfg(feature = "wgpu")]
use super::wgpu;
use super::{cpu, fault, AutoSlot, Bindings, Executor, ExecutorKind};

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

/// The one list of executors: forwards `$body` to the executor of a [`Device`] (`$e`), wraps a
/// returned buffer in the same [`Buffer`] variant (`=> wrap`), or forwards to the executor and
/// its own buffer of a `(Device, Buffer)` pair, refusing a buffer of another kind.
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
    ($self:expr, $e:ident => wrap $body:expr) => {
        match $self {
            Device::Cpu($e) => $body.map(Buffer::Cpu),
            #[cfg(feature = "wgpu")]
            Device::Wgpu($e) => $body.map(Buffer::Wgpu),
            #[cfg(feature = "cuda")]
            Device::Cuda($e) => $body.map(Buffer::Cuda),
        }
    };
    ($self:expr, $buf:expr, $e:ident, $b:ident => $body:expr) => {
        match ($self, $buf) {
            (Device::Cpu($e), Buffer::Cpu($b)) => $body,
            #[cfg(feature = "wgpu")]
            (Device::Wgpu($e), Buffer::Wgpu($b)) => $body,
            #[cfg(feature = "cuda")]
            (Device::Cuda($e), Buffer::Cuda($b)) => $body,
            #[allow(unreachable_patterns)]
            _ => Err($self.mismatch()),
        }
    };
}
pub(super) use each_backend;

/// A backend's buffer type, picked out of a [`Buffer`] (`None` for another executor kind's).
pub(super) trait Pick: Sized {
    fn pick(b: &Buffer) -> Option<&Self>;
}

impl Pick for cpu::CpuBuffer {
    fn pick(b: &Buffer) -> Option<&Self> {
        #[allow(irrefutable_let_patterns)]
        if let Buffer::Cpu(x) = b {
            Some(x)
        } else {
            None
        }
    }
}

#[cfg(feature = "wgpu")]
impl Pick for wgpu::WgpuBuffer {
    fn pick(b: &Buffer) -> Option<&Self> {
        if let Buffer::Wgpu(x) = b {
            Some(x)
        } else {
            None
        }
    }
}

#[cfg(feature = "cuda")]
impl Pick for cuda::CudaBuffer {
    fn pick(b: &Buffer) -> Option<&Self> {
        if let Buffer::Cuda(x) = b {
            Some(x)
        } else {
            None
        }
    }
}

/// Narrows a binding of [`Buffer`]s to one backend's buffers; fails if one belongs to another
/// executor kind.
pub(super) fn typed<'a, T: Pick>(bufs: &Bindings<'a, Buffer>, name: &'static str) -> Result<Bindings<'a, T>> {
    let err = || TransferError::ExecutorMismatch { expected: format!("{name} buffers"), found: "a buffer of another executor kind".into() };
    let host = bufs.host.iter().map(|b| T::pick(b).ok_or_else(err)).collect::<Result<Vec<_>>>()?;
    let device =
        bufs.device.iter().map(|c| c.iter().map(|b| T::pick(b).ok_or_else(err)).collect::<Result<Vec<_>>>()).collect::<Result<Vec<_>>>()?;
    Ok(Bindings { host, device, integrity: bufs.integrity.clone() })
}

impl Device {
    /// Wraps caller memory `t` (argument `name`, for errors) as a buffer of this executor,
    /// without owning it: refused where the executor cannot move that memory.
    pub(crate) fn wrap_raw(&self, t: &RawTensor, name: &str) -> Result<Buffer> {
        let bad = |reason: &str| TransferError::BadTensor { arg: name.into(), reason: reason.into() };
        let Some(ptr) = NonNull::new(t.addr as *mut u8) else { return Err(bad("null data pointer")) };
        let len = usize::try_from(t.len).map_err(|_| bad("larger than the address space"))?;
        if t.addr.checked_add(t.len).is_none() {
            return Err(bad("address range wraps"));
        }
        match self {
            Device::Cpu(e) => {
                if t.memory != Memory::Host {
                    return Err(bad("the cpu executor moves host memory only"));
                }
                // SAFETY: the caller of `RawTensor::new` vouches for the span; the buffer is dropped
                // before the op returns.
                Ok(Buffer::Cpu(unsafe { cpu::CpuBuffer::from_raw(ptr, len, e) }))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(e) => {
                // SAFETY: as above, and the op's copies are ordered on the executor's stream (the
                // caller's, for an executor made with `CudaExecutor::from_stream`); host memory must
                // be pinned or registered (refused otherwise).
                let b = unsafe { cuda::CudaBuffer::stream_ordered(e, t.addr, t.len, t.memory == Memory::CudaDevice)? };
                Ok(Buffer::Cuda(b))
            }
            #[cfg(feature = "wgpu")]
            Device::Wgpu(_) => Err(bad("the wgpu executor moves between its own pools only (use DevicePool / HostPool)")),
        }
    }

    /// A new cpu executor instance.
    pub fn cpu() -> Device {
        Device::Cpu(cpu::CpuExecutor::new())
    }

    /// A new cpu executor instance that copies on at most `threads` threads (at least one).
    pub fn cpu_with_threads(threads: usize) -> Device {
        Device::Cpu(cpu::CpuExecutor::with_threads(threads))
    }

    /// Opens one executor; a missing driver or adapter is `Err(Unavailable)`, never a panic.
    pub fn open(kind: ExecutorKind) -> Result<Device> {
        match kind {
            ExecutorKind::Cpu => Ok(Device::cpu()),
            #[cfg(feature = "wgpu")]
            ExecutorKind::Wgpu => Ok(Device::Wgpu(wgpu::WgpuExecutor::new()?)),
            #[cfg(feature = "cuda")]
            ExecutorKind::Cuda => Ok(Device::Cuda(cuda::CudaExecutor::new(0)?)),
            #[allow(unreachable_patterns)]
            other => Err(TransferError::Unavailable { backend: other.name(), reason: "not compiled in (cargo feature off)".into() }),
        }
    }

    /// `auto`: cuda, then wgpu, then cpu.
    pub fn auto() -> Device {
        for kind in [ExecutorKind::Cuda, ExecutorKind::Wgpu] {
            match Device::open(kind) {
                Ok(d) => return d,
                Err(e) => log::info!("auto: {e}"),
            }
        }
        Device::cpu()
    }

    /// From `HICACHE_IO_EXECUTOR=cpu|wgpu|cuda|auto` (or its older name `HICACHE_IO_BACKEND`;
    /// unset or empty means auto); an unknown name is an error.
    pub fn from_env() -> Result<Device> {
        match executor_from_env()? {
            None => Ok(Device::auto()),
            Some(kind) => Device::open(kind),
        }
    }

    /// Which executor.
    pub fn kind(&self) -> ExecutorKind {
        each_backend!(self, e => kind_of(e))
    }

    /// `cpu`, `wgpu` or `cuda`.
    pub fn name(&self) -> &'static str {
        each_backend!(self, e => Executor::name(e))
    }
    /// This executor instance's identity (clones share it).
    pub fn id(&self) -> u64 {
        each_backend!(self, e => Executor::id(e))
    }
    /// Name and identity, for messages: `wgpu #3`.
    pub fn label(&self) -> String {
        format!("{} #{}", self.name(), self.id())
    }
    /// Adapter or device description.
    pub fn describe(&self) -> String {
        each_backend!(self, e => Executor::describe(e))
    }
    /// What the planner may ask of this executor (the `auto` table as calibrated so far).
    pub fn capabilities(&self) -> Capabilities {
        let mut caps = each_backend!(self, e => Executor::capabilities(e));
        if let Some(t) = self.auto_slot().get() {
            caps.auto = t;
        }
        caps
    }
    /// Where this instance keeps its measured `auto` table.
    pub(super) fn auto_slot(&self) -> &AutoSlot {
        each_backend!(self, e => Executor::auto_slot(e))
    }
    /// The capabilities without a measured `auto` table (what calibration starts from).
    pub(super) fn base_capabilities(&self) -> Capabilities {
        each_backend!(self, e => Executor::capabilities(e))
    }
    /// Waits for every submitted transfer (on cuda, then reports an earlier call's failed
    /// device index check, or else the mismatches of plain checksumming loads, as
    /// `CudaExecutor::synchronize` does).
    pub fn synchronize(&self) -> Result<()> {
        each_backend!(self, e => Executor::synchronize_and_report(e))
    }
    /// The items of plain (synchronous) checksumming loads that failed their checksums and have
    /// not been reported, as one [`TransferError::Integrity`]; does not wait. Only cuda has
    /// any: its plain calls return once enqueued, before their checksums arrive (other
    /// executors report them from the call). [`Device::synchronize`] reports them too.
    pub fn integrity_reports(&self) -> Result<()> {
        each_backend!(self, e => Executor::integrity_reports(e))
    }
    /// Waits until the item checksums of every transfer queued so far are settled (recorded,
    /// verified or forgotten in the host pools' tables): on cuda only for the steps that carry
    /// checksums (not for the engine's stream or other work), elsewhere for every queued transfer.
    pub(crate) fn settle_checksums(&self) -> Result<()> {
        each_backend!(self, e => Executor::settle_checksums(e))
    }
    /// The first earlier call whose CUDA index lists failed their device checks (`wait`: all
    /// reports, waiting for the streams); executors that check index lists on the host have none.
    pub(crate) fn index_check_reports(&self, wait: bool) -> Result<()> {
        each_backend!(self, e => Executor::index_check_reports(e, wait))
    }
    /// Runs `f`, whose calls check their CUDA index lists with one shared device check.
    pub(crate) fn with_shared_index_check<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        each_backend!(self, e => Executor::with_shared_index_check(e, f))
    }
    /// Waits for every submitted transfer and nothing more: a failed device index check of an
    /// earlier call stays pending for the code that issued it.
    pub fn wait_idle(&self) -> Result<()> {
        each_backend!(self, e => Executor::synchronize(e))
    }
    /// Median seconds of one contiguous copy of `bytes` (the benchmarks' ceiling).
    pub fn time_one_copy(&self, bytes: u64, budget: std::time::Duration) -> Result<f64> {
        each_backend!(self, e => Executor::time_one_copy(e, bytes, budget))
    }

    /// Device-side memory of `bytes` bytes, zeroed.
    pub fn alloc(&self, bytes: u64) -> Result<Buffer> {
        each_backend!(self, e => wrap Executor::alloc(e, bytes))
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
        each_backend!(self, e => wrap Executor::alloc_pool(e, bytes, segment, host))
    }

    /// Host-pool memory (pinned and mapped on cuda), zeroed.
    pub fn alloc_host(&self, bytes: u64) -> Result<Buffer> {
        each_backend!(self, e => wrap Executor::alloc_host(e, bytes))
    }

    /// Bytes a buffer of this executor holds.
    pub fn buffer_len(&self, buf: &Buffer) -> Result<u64> {
        self.check_owner(buf)?;
        each_backend!(self, buf, e, b => Ok(Executor::buffer_len(e, b)))
    }

    /// The buffer belongs to this executor instance (not only to an executor of this kind).
    fn check_owner(&self, buf: &Buffer) -> Result<()> {
        let owner = each_backend!(self, buf, e, b => Ok(Executor::buffer_owner(e, b)))?;
        if owner != self.id() {
            return Err(TransferError::ExecutorMismatch { expected: self.label(), found: format!("a buffer of {} #{owner}", self.name()) });
        }
        Ok(())
    }

    /// Executor-specific checks of a borrowed buffer (ownership, usage flags, alignment).
    pub fn check_buffer(&self, buf: &Buffer) -> Result<()> {
        self.check_owner(buf)?;
        each_backend!(self, buf, e, b => Executor::check_buffer(e, b))
    }

    /// Writes `data` at `offset` (checked against the buffer's size). Crate-internal: callers
    /// must hold the buffer exclusively (the pools' `write_buffer` takes `&mut self`).
    pub(crate) fn write(&self, buf: &Buffer, offset: u64, data: &[u8]) -> Result<()> {
        self.check_span(buf, offset, data.len() as u64)?;
        each_backend!(self, buf, e, b => Executor::write(e, b, offset, data))
    }

    /// Reads `out.len()` bytes at `offset` (checked against the buffer's size). Crate-internal:
    /// no transfer may be writing the buffer meanwhile (the pools' borrows ensure it).
    pub(crate) fn read(&self, buf: &Buffer, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check_span(buf, offset, out.len() as u64)?;
        each_backend!(self, buf, e, b => Executor::read(e, b, offset, out))
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

    pub(super) fn mismatch(&self) -> TransferError {
        TransferError::ExecutorMismatch { expected: self.label(), found: "a buffer of another executor kind".into() }
    }

    /// Arms a one-shot fault for testing recovery: the `after_steps`-th step executed from now
    /// on by this executor instance (0 = the next one) fails with an executor error before it
    /// runs. Steps before it complete normally.
    pub fn inject_fault(&self, after_steps: u64) {
        fault::arm(self.id(), fault::At::Step, after_steps);
    }
    /// Arms a one-shot fault of a queued submission, for testing how asynchronous calls report
    /// one: on wgpu the `after_submissions`-th command buffer handed to the submit thread from
    /// now on is dropped unrun and its ticket marked failed, as a submission the driver refused
    /// would be; the call that queued it has already returned. Other executors have no queued
    /// submissions and never fire it.
    pub fn inject_submission_fault(&self, after_submissions: u64) {
        fault::arm(self.id(), fault::At::Submission, after_submissions);
    }
}

fn kind_of<E: Executor>(_: &E) -> ExecutorKind {
    E::KIND
}

/// Wraps borrowed host memory as a buffer of cpu executor `exec`. Crate-internal: the pool that
/// receives it carries the borrow's lifetime (`DevicePool<'m>`, `HostPool<'m>`), so the buffer
/// never outlives the slice, and the `&mut` borrow rules out other access meanwhile.
pub(crate) fn borrow_cpu_slice(exec: &cpu::CpuExecutor, s: &mut [u8]) -> Buffer {
    // SAFETY: see above; the slice is valid for reads and writes for the pool's lifetime.
    Buffer::Cpu(unsafe { cpu::CpuBuffer::from_raw(std::ptr::NonNull::from(&mut *s).cast(), s.len(), exec) })
}

/// The executor the environment names: `HICACHE_IO_EXECUTOR`, else its older name
/// `HICACHE_IO_BACKEND`; `None` when unset, empty or `auto`, an error (naming the variable) for
/// an unknown name.
pub fn executor_from_env() -> Result<Option<ExecutorKind>> {
    for var in ["HICACHE_IO_EXECUTOR", "HICACHE_IO_BACKEND"] {
        match std::env::var(var).ok().as_deref() {
            None | Some("") => continue,
            Some("auto") => return Ok(None),
            Some(name) => {
                return name.parse().map(Some).map_err(|e: TransferError| TransferError::BadArgument {
                    arg: var,
                    value: 0,
                    message: format!("{var}: {e}"),
                })
            }
        }
    }
    Ok(None)
}

/// One line per executor: what is present here and why not.
pub fn probe_all() -> Vec<(ExecutorKind, Result<Device>)> {
    ExecutorKind::ALL.into_iter().map(|k| (k, Device::open(k))).collect()
}
