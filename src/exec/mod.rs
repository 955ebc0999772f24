//! Executors: each one only allocates, runs plans, synchronizes and reads/writes bytes.
//! Support decisions live in [`crate::plan`]; an executor states its limits as
//! [`Capabilities`](crate::plan::Capabilities) and the planner reads them.
//!
//! The shared core is thin: the `Executor` trait a backend implements (`executor.rs`), the
//! settlement of checksums its copies compute (`settle.rs`), and the machine facts every backend
//! reads (`host.rs`). The run-time choice is the [`Device`] enum (`device.rs`, candle-style): its
//! match arms forward to each backend; [`Completion`] wraps each backend's own ticket
//! (`completion.rs`); `run.rs` runs plans. Backends (`cpu/`, `wgpu/`, `cuda/`) import the core and
//! never the dispatcher.

mod calibrate;
pub mod caller;
mod completion;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
/// The cuda kernels' launch descriptors (also `exec::cuda::abi`): compiled without the cuda
/// feature too, for the host emulation of the kernels in the tests.
pub mod cuda_launch;
mod device;
mod executor;
mod fault;
mod host;
mod run;
mod settle;
#[cfg(feature = "wgpu")]
pub mod wgpu;

pub use completion::Completion;
pub(crate) use device::borrow_cpu_slice;
pub use device::{executor_from_env, probe_all, Buffer, Device};
pub use executor::ExecutorKind;
/// The former name of [`ExecutorKind`].
#[deprecated(note = "renamed ExecutorKind")]
pub type BackendKind = ExecutorKind;
pub(crate) use executor::{AutoSlot, Bindings, Executor, Stream, Ticket};
pub(crate) use settle::ChecksumBinding;
