//! Executors: each one only allocates, runs plans, synchronizes and reads/writes bytes.
//! Support decisions live in [`crate::plan`]; an executor states its limits as
//! [`Capabilities`] and the planner reads them.
//!
//! The run-time choice is the [`Device`] enum (candle-style): its match arms forward to each
//! backend's [`Executor`] implementation.

use crate::error::{Result, TransferError};
use crate::plan::{BufRef, Capabilities, Plan};

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "wgpu")]
pub mod wgpu;

/// Buffers a plan refers to: host component buffers `[comp]` and device buffers
/// `[comp][slot]`.
pub struct Bindings<'a, B> {
    pub host: Vec<&'a B>,
    pub device: Vec<Vec<&'a B>>,
}

impl<'a, B> Bindings<'a, B> {
    pub fn get(&self, r: BufRef) -> &'a B {
        match r {
            BufRef::Host { comp } => self.host[comp as usize],
            BufRef::Device { comp, slot } => self.device[comp as usize][slot as usize],
        }
    }
}

/// What a backend implements. Buffers are zero-initialised on allocation.
pub trait Executor {
    type Buffer;
    fn name(&self) -> &'static str;
    /// Adapter / device description for `hicache-io info` and check output.
    fn describe(&self) -> String;
    fn capabilities(&self) -> Capabilities;
    /// Device-side memory (device pools).
    fn alloc(&self, bytes: u64) -> Result<Self::Buffer>;
    /// Host-side memory the executor can still address (host pools): pinned and mapped on
    /// cuda; the same as `alloc` where host and device memory are one kind.
    fn alloc_host(&self, bytes: u64) -> Result<Self::Buffer> {
        self.alloc(bytes)
    }
    fn buffer_len(&self, buf: &Self::Buffer) -> u64;
    /// Checks a borrowed buffer (usage flags, alignment) before a pool wraps it.
    fn check_buffer(&self, _buf: &Self::Buffer) -> Result<()> {
        Ok(())
    }
    fn write(&self, buf: &Self::Buffer, offset: u64, data: &[u8]) -> Result<()>;
    fn read(&self, buf: &Self::Buffer, offset: u64, out: &mut [u8]) -> Result<()>;
    /// Runs a validated plan. Destination buffers are written through shared references: the
    /// pools hand out `&mut` access to the destination pool, so nothing else aliases it.
    fn execute(&self, plan: &Plan, bufs: &Bindings<'_, Self::Buffer>) -> Result<()>;
    /// Waits for every submitted transfer.
    fn synchronize(&self) -> Result<()>;
    /// Median seconds of one contiguous copy of `bytes` (the ceiling benchmarks compare with):
    /// memcpy on cpu, one buffer-to-buffer copy on wgpu, one host-to-device copy on cuda.
    fn time_one_copy(&self, bytes: u64, budget: std::time::Duration) -> Result<f64>;
}

/// Which executor, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    Cpu,
    Wgpu,
    Cuda,
}

impl BackendKind {
    pub const ALL: [BackendKind; 3] = [BackendKind::Cpu, BackendKind::Wgpu, BackendKind::Cuda];
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
            other => Err(TransferError::Geometry(format!("unknown executor {other:?} (cpu, wgpu, cuda, auto)"))),
        }
    }
}

/// An executor chosen at run time.
#[derive(Clone)]
pub enum Device {
    Cpu(cpu::CpuExecutor),
    #[cfg(feature = "wgpu")]
    Wgpu(wgpu::WgpuExecutor),
    #[cfg(feature = "cuda")]
    Cuda(cuda::CudaExecutor),
}

/// A buffer of some executor.
pub enum Buffer {
    Cpu(cpu::CpuBuffer),
    #[cfg(feature = "wgpu")]
    Wgpu(wgpu::WgpuBuffer),
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
    let err = || TransferError::ExecutorMismatch { host: name.into(), device: "another executor".into() };
    let host = bufs.host.iter().map(|b| pick(b).ok_or_else(err)).collect::<Result<Vec<_>>>()?;
    let device =
        bufs.device.iter().map(|c| c.iter().map(|b| pick(b).ok_or_else(err)).collect::<Result<Vec<_>>>()).collect::<Result<Vec<_>>>()?;
    Ok(Bindings { host, device })
}

impl Device {
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

    /// From `HICACHE_IO_BACKEND=cpu|wgpu|cuda|auto` (unset means auto).
    pub fn from_env() -> Result<Device> {
        match std::env::var("HICACHE_IO_BACKEND").ok().as_deref() {
            None | Some("") | Some("auto") => Ok(Device::auto()),
            Some(name) => Device::open(name.parse()?),
        }
    }

    pub fn kind(&self) -> BackendKind {
        match self {
            Device::Cpu(_) => BackendKind::Cpu,
            #[cfg(feature = "wgpu")]
            Device::Wgpu(_) => BackendKind::Wgpu,
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => BackendKind::Cuda,
        }
    }

    pub fn name(&self) -> &'static str {
        each_backend!(self, e => e.name())
    }
    pub fn describe(&self) -> String {
        each_backend!(self, e => e.describe())
    }
    pub fn capabilities(&self) -> Capabilities {
        each_backend!(self, e => e.capabilities())
    }
    pub fn synchronize(&self) -> Result<()> {
        each_backend!(self, e => e.synchronize())
    }
    pub fn time_one_copy(&self, bytes: u64, budget: std::time::Duration) -> Result<f64> {
        each_backend!(self, e => e.time_one_copy(bytes, budget))
    }

    pub fn alloc(&self, bytes: u64) -> Result<Buffer> {
        match self {
            Device::Cpu(e) => e.alloc(bytes).map(Buffer::Cpu),
            #[cfg(feature = "wgpu")]
            Device::Wgpu(e) => e.alloc(bytes).map(Buffer::Wgpu),
            #[cfg(feature = "cuda")]
            Device::Cuda(e) => e.alloc(bytes).map(Buffer::Cuda),
        }
    }

    /// Host-pool memory (pinned and mapped on cuda).
    pub fn alloc_host(&self, bytes: u64) -> Result<Buffer> {
        match self {
            Device::Cpu(e) => e.alloc_host(bytes).map(Buffer::Cpu),
            #[cfg(feature = "wgpu")]
            Device::Wgpu(e) => e.alloc_host(bytes).map(Buffer::Wgpu),
            #[cfg(feature = "cuda")]
            Device::Cuda(e) => e.alloc_host(bytes).map(Buffer::Cuda),
        }
    }

    pub fn buffer_len(&self, buf: &Buffer) -> Result<u64> {
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

    /// Executor-specific checks of a borrowed buffer.
    pub fn check_buffer(&self, buf: &Buffer) -> Result<()> {
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

    pub fn write(&self, buf: &Buffer, offset: u64, data: &[u8]) -> Result<()> {
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

    pub fn read(&self, buf: &Buffer, offset: u64, out: &mut [u8]) -> Result<()> {
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
        TransferError::ExecutorMismatch { host: self.name().into(), device: "a buffer of another executor".into() }
    }

    /// Runs a plan over pool buffers.
    pub fn execute(&self, plan: &Plan, bufs: &Bindings<'_, Buffer>) -> Result<()> {
        if plan.is_empty() {
            return Ok(());
        }
        match self {
            Device::Cpu(e) => {
                #[allow(irrefutable_let_patterns)]
                let b = typed(bufs, |b| if let Buffer::Cpu(x) = b { Some(x) } else { None }, "cpu")?;
                e.execute(plan, &b)
            }
            #[cfg(feature = "wgpu")]
            Device::Wgpu(e) => {
                #[allow(irrefutable_let_patterns)]
                let b = typed(bufs, |b| if let Buffer::Wgpu(x) = b { Some(x) } else { None }, "wgpu")?;
                e.execute(plan, &b)
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(e) => {
                #[allow(irrefutable_let_patterns)]
                let b = typed(bufs, |b| if let Buffer::Cuda(x) = b { Some(x) } else { None }, "cuda")?;
                e.execute(plan, &b)
            }
        }
    }
}

/// One line per executor: what is present here and why not.
pub fn probe_all() -> Vec<(BackendKind, Result<Device>)> {
    BackendKind::ALL.into_iter().map(|k| (k, Device::open(k))).collect()
}
