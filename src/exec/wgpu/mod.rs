//! The portable executor: wgpu on Vulkan, Metal or DX12 (lavapipe in CI).
//!
//! Memory model: every pool buffer, host pool included, is a wgpu storage buffer
//! (`STORAGE | COPY_SRC | COPY_DST`). The host pool is "host" in the sglang sense (its layout,
//! its role); the CPU reaches it through `queue.write_buffer` and a `MAP_READ` staging copy.
//! That works on every adapter; on integrated GPUs and lavapipe the buffer already lives in
//! system memory. Buffers are capped at `min(max_buffer_size, 4 GiB)` so byte offsets fit the
//! shader's u32 arithmetic; larger pools are rejected with a typed error at allocation.
//!
//! `kernel` = `shaders/gather.wgsl`, one dispatch per (layer, component) address pair and per
//! pair of binding windows: buffers larger than `max_storage_buffer_binding_size` are bound by
//! range, in windows of whole item chunks aligned to `min_storage_buffer_offset_alignment`.
//! The index table is one binding and one dispatch, so the planner splits calls with more
//! pairs than [`Capabilities::max_gather_items`](crate::plan::Capabilities::max_gather_items) into several steps.
//! `direct` = one `copy_buffer_to_buffer` per coalesced run.
//!
//! Item checksums: a checksumming `kernel` step runs the gather's checksum pipelines, which sum
//! each item as they copy it into a two-word entry per (index pair, address pair) of a buffer
//! the step's submission copies into a mappable one. Once that submission has completed (any
//! wait or poll that sees it), the entries are read and recorded into the host pool's table
//! (backups) or compared with it (loads), in submission order. `direct` copies
//! (`copy_buffer_to_buffer`) cannot sum: their items are settled as unknown in the same order (a
//! backup forgets their checksums, a load counts them unverified), without waiting.
//!
//! Each step is its own submission. A synchronous plan returns after the queue has finished all
//! of them. An asynchronous one is encoded on the caller's thread and submitted by the
//! executor's submit thread (started on first use): some drivers, lavapipe among them, run the
//! work inside `vkQueueSubmit`, and the caller's thread is meant to be free meanwhile. Every
//! synchronous operation (a plan, a read, a write) first waits until the submit thread has
//! submitted what it was given, so the queue keeps program order.
//!
//! Rooms: `options` (what the caller may choose), `open` (adapter, device and pipelines),
//! `memory` (segmented and mapped buffers), `submit` (the submit thread, waits and polls),
//! `gather` (the shader and its dispatches), `copy` (`direct` runs), `checksums` (the summing
//! gathers' buffers and their readback), `executor` (the `Executor` implementation).

mod checksums;
mod copy;
mod executor;
mod gather;
mod memory;
mod open;
mod options;
mod submit;
#[cfg(test)]
mod translation;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::{Result, TransferError};
use crate::exec::host::{host_memory_bytes, next_executor_id};
use crate::exec::{AutoSlot, ExecutorKind, Stream, Ticket};

use checksums::PendingSums;
use copy::{copy_run, DEFAULT_COPIES_PER_SUBMISSION, MANY_RUNS};
use gather::{bgl_entry, shader_source, GATHER_MAX_TRIPS};
pub use memory::{WgpuBuffer, REQUIRED_USAGES};
use options::{backends, int64_wanted};
pub use options::{AdapterClass, PoolMemory, WgpuOptions};
use submit::{PendingQueue, Submitter};

const SHADER: &str = include_str!("../../../shaders/gather.wgsl");
const WAIT: Duration = Duration::from_secs(120);

fn err(message: impl Into<String>) -> TransferError {
    TransferError::Executor { backend: "wgpu", message: message.into() }
}
struct Inner {
    /// The `auto` io backend's measured table.
    auto: AutoSlot,
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    limits: wgpu::Limits,
    /// The adapter class planned for (`HICACHE_WGPU_LIMITS`), if any.
    class: Option<AdapterClass>,
    layout: wgpu::BindGroupLayout,
    /// Pipelines for 4-byte (u32) and 16-byte (vec4<u32>) words.
    pipe4: wgpu::ComputePipeline,
    pipe16: wgpu::ComputePipeline,
    /// The checksumming ones (`sum_layout`: also the sums).
    sum_layout: wgpu::BindGroupLayout,
    sum4: wgpu::ComputePipeline,
    sum16: wgpu::ComputePipeline,
    /// Whether the checksumming gathers use 64-bit integers (else 16-bit halves).
    int64: bool,
    /// Checksum readbacks of submitted steps, in submission order (pushed under this lock
    /// together with the submission).
    /// (Shared with the submit thread, which must never hold the executor itself: its last
    /// reference would then drop the device there.)
    pending: Arc<Mutex<PendingQueue>>,
    max_window: u64,
    max_buffer: u64,
    /// Largest segment of a pool buffer (at most `max_buffer`).
    max_segment: u64,
    /// Invocations per item, at most: 64 on GPUs (coalesced words); 1 on CPU adapters such as
    /// lavapipe, where one SIMD lane per item measured about 2× faster (`HICACHE_WGPU_LANES`).
    max_lanes: u64,
    max_gather_items: u64,
    /// Most buffer copies in one submission ([`WgpuOptions::max_copies_per_submission`]).
    max_copies: usize,
    /// Host pools are allocated mappable (host-visible); their CPU reads and writes map them.
    mapped_host: bool,
    lost: Arc<Mutex<Option<String>>>,
    id: u64,
    submitter: Arc<Submitter>,
    /// Mapping a host pool excludes submissions (a buffer mapped for the CPU must not be used
    /// by a submitted command): submissions hold it shared, a mapping exclusively.
    map_lock: Arc<std::sync::RwLock<()>>,
    /// The submit thread, joined on drop so that it never outlives the device (it holds a queue
    /// handle; dropping the last one on another thread while the process exits can crash the
    /// driver).
    submit_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Closing the channel ends the thread once it has submitted what it holds.
        self.submitter.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = self.submit_thread.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// The wgpu executor (one device and queue).
#[derive(Clone)]
pub struct WgpuExecutor {
    inner: Arc<Inner>,
}
/// Transfers up to one ticket of a wgpu executor's submit thread.
pub(crate) struct WgpuTicket {
    exec: WgpuExecutor,
    /// The plan's last submission (or, for a plan with none of its own, the newest one when the
    /// ticket was made): waiting for it waits for the plan.
    ticket: u64,
    /// The plan's own submissions: any that failed fails the ticket, not only the last.
    own: Arc<[u64]>,
}

impl Ticket for WgpuTicket {
    fn wait(&self) -> Result<()> {
        self.exec.wait_for(self.ticket).and_then(|_| self.exec.inner.submitter.first_failure(&self.own)).map_err(|e| self.exec.lost_or(e))
    }
    fn is_done(&self) -> Result<bool> {
        let done = self.exec.is_done(self.ticket)?;
        if done {
            self.exec.inner.submitter.first_failure(&self.own)?;
        }
        Ok(done)
    }
}
