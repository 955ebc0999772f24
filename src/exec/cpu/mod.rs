//! The reference executor: plain host memory, one `copy_nonoverlapping` per item chunk or run.
//! Large transfers are split over threads by items (destinations are unique, checked by the
//! planner, so the halves never touch the same bytes).
//!
//! Ordering works like a GPU stream: transfers run in submission order. A synchronous call on
//! an idle executor runs on the caller's thread; an asynchronous one (or any call while others
//! are queued) runs on the executor's worker thread, started on first use. A second queue with
//! its own worker (the backup stream) runs a pipeline's backups next to its loads. Everything that
//! touches pool memory from outside a transfer — reads, writes, dropping a buffer — first waits
//! for both queues, so a transfer never races with them, whatever happens to its handle.
//!
//! Rooms: `memory` (the buffers), `queue` (the two ordered queues and their tickets), `copy` (one
//! step over raw addresses, split across threads), `checksums` (copies that checksum in the same
//! pass), `raw` (what both share: the bindings' addresses, prefetching, the walk over spans).

mod checksums;
mod copy;
mod memory;
mod queue;
mod raw;

use std::sync::Arc;

use super::host::{host_memory_bytes, next_executor_id};
use super::{AutoSlot, Bindings, Executor, ExecutorKind, Stream};
use crate::error::Result;
use crate::plan::{Capabilities, Plan};

use copy::{run_step, split, PARALLEL_MIN_BYTES, STREAMING_MIN_BYTES};
pub use memory::CpuBuffer;
pub(crate) use queue::{CpuQueues, CpuTicket};
use raw::{RawBindings, SendPtr};

/// The cpu executor: plain host memory, `threads` threads per large transfer, two ordered
/// queues of transfers (main and backup stream).
#[derive(Clone)]
pub struct CpuExecutor {
    threads: usize,
    id: u64,
    queues: Arc<CpuQueues>,
    auto: AutoSlot,
}

impl Default for CpuExecutor {
    fn default() -> Self {
        CpuExecutor::new()
    }
}

impl CpuExecutor {
    /// Threads from `HICACHE_IO_CPU_THREADS`, else the machine's parallelism.
    pub fn new() -> CpuExecutor {
        let threads = std::env::var("HICACHE_IO_CPU_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
            .max(1);
        CpuExecutor::with_threads(threads)
    }
    /// An executor that uses at most `threads` threads per transfer.
    pub fn with_threads(threads: usize) -> CpuExecutor {
        CpuExecutor { threads: threads.max(1), id: next_executor_id(), queues: CpuQueues::new(), auto: AutoSlot::default() }
    }
}

impl Executor for CpuExecutor {
    type Buffer = CpuBuffer;
    type Ticket = CpuTicket;
    const KIND: ExecutorKind = ExecutorKind::Cpu;

    fn id(&self) -> u64 {
        self.id
    }
    fn buffer_owner(&self, buf: &CpuBuffer) -> u64 {
        buf.owner
    }
    fn describe(&self) -> String {
        format!("host memory, {} thread(s)", self.threads)
    }
    fn auto_slot(&self) -> &AutoSlot {
        &self.auto
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: "cpu",
            max_pool_bytes: host_memory_bytes(),
            max_host_pool_bytes: host_memory_bytes(),
            checksums: true,
            direct_checksums: true,
            ..Capabilities::UNLIMITED
        }
    }
    fn alloc(&self, bytes: u64) -> Result<CpuBuffer> {
        CpuBuffer::alloc(bytes, self.id, self.queues.clone())
    }
    fn buffer_len(&self, buf: &CpuBuffer) -> u64 {
        buf.len as u64
    }
    fn write(&self, buf: &CpuBuffer, offset: u64, data: &[u8]) -> Result<()> {
        self.queues.idle();
        // SAFETY: span checked by `Device::write`; `&mut` pool access rules out aliasing; no
        // queued transfer runs any more.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf.as_ptr().add(offset as usize), data.len()) };
        Ok(())
    }
    fn read(&self, buf: &CpuBuffer, offset: u64, out: &mut [u8]) -> Result<()> {
        self.queues.idle();
        // SAFETY: span checked by `Device::read`; no queued transfer runs any more.
        unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr().add(offset as usize), out.as_mut_ptr(), out.len()) };
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        let side = self.queues.backup.wait(self.queues.backup.last_ticket());
        self.queues.main.wait(self.queues.main.last_ticket()).and(side)
    }
    fn finish(&self) -> Result<()> {
        self.synchronize()
    }
    fn completion(&self, stream: Stream) -> Result<CpuTicket> {
        let queue = self.queues.get(stream);
        Ok(CpuTicket { queue: queue.clone(), ticket: queue.last_ticket() })
    }
    fn order_after(&self, first: Stream, then: Stream) -> Result<()> {
        let first = self.queues.get(first).clone();
        if first.is_idle() {
            return Ok(());
        }
        let ticket = first.last_ticket();
        // A job that waits: the tickets it waits for were queued before it, so two streams
        // waiting on each other always wait for older work and never for each other.
        // A failure on `first` fails this job too, so waiters on `then` hear of it.
        self.queues.get(then).enqueue(Box::new(move || {
            if let Err(e) = first.wait(ticket) {
                panic!("{e}");
            }
        }))?;
        Ok(())
    }
    fn is_busy(&self, stream: Stream) -> bool {
        !self.queues.get(stream).is_idle()
    }
    /// One contiguous copy of the same bytes with the threads a transfer of that size uses
    /// (so the ratio compares like with like).
    fn time_one_copy(&self, bytes: u64, budget: std::time::Duration) -> Result<f64> {
        let src = vec![1u8; bytes as usize];
        let mut dst = vec![2u8; bytes as usize];
        let threads = if bytes >= PARALLEL_MIN_BYTES { self.threads } else { 1 };
        let per = (bytes as usize).div_ceil(threads.max(1)).max(1);
        crate::timing::time(budget, || {
            let (s, d) = (SendPtr(src.as_ptr() as *mut u8), SendPtr(dst.as_mut_ptr()));
            let n = src.len();
            split(threads, threads, &|lo, hi| {
                for t in lo..hi {
                    let (a, b) = ((t * per).min(n), ((t + 1) * per).min(n));
                    // SAFETY: disjoint ranges of two live vectors of `n` bytes.
                    unsafe { std::ptr::copy_nonoverlapping(s.get().add(a), d.get().add(a), b - a) };
                }
            });
            std::hint::black_box(&mut dst);
            Ok(())
        })
    }

    fn execute_step(&self, plan: &Plan, k: usize, bufs: &Bindings<'_, CpuBuffer>, enqueue: bool, stream: Stream) -> Result<()> {
        let threads = if plan.bytes() >= PARALLEL_MIN_BYTES { self.threads } else { 1 };
        let streaming = plan.bytes() >= STREAMING_MIN_BYTES;
        let raw = RawBindings {
            host: bufs.host.iter().map(|b| SendPtr(b.as_ptr())).collect(),
            device: bufs.device.iter().map(|c| c.iter().map(|b| SendPtr(b.as_ptr())).collect()).collect(),
            integrity: bufs.integrity.clone(),
        };
        let queue = self.queues.get(stream);
        if !enqueue && queue.is_idle() {
            run_step(&plan.steps()[k], &raw, threads, streaming);
            return Ok(());
        }
        // On the worker, after everything queued before it, with one thread fewer: the caller's
        // thread is free to compute meanwhile (that is why it queued). The buffers outlive the
        // job: every way to free or touch them waits for the queue first.
        let threads = threads.min(self.threads.saturating_sub(1)).max(1);
        let steps = plan.shared_steps();
        queue.enqueue(Box::new(move || run_step(&steps[k], &raw, threads, streaming)))?;
        Ok(())
    }
}
