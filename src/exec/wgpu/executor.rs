//! The [`Executor`] implementation.

use std::time::Duration;

use super::*;
use crate::error::{Result, TransferError};
use crate::exec::{Bindings, Executor};
use crate::plan::{Capabilities, Plan, StepKind};

impl Executor for WgpuExecutor {
    type Buffer = WgpuBuffer;
    type Ticket = WgpuTicket;
    const KIND: ExecutorKind = ExecutorKind::Wgpu;

    fn id(&self) -> u64 {
        self.inner.id
    }
    fn buffer_owner(&self, buf: &WgpuBuffer) -> u64 {
        buf.owner
    }
    fn describe(&self) -> String {
        let i = &self.inner.info;
        format!(
            "{} ({:?}, {:?}, driver {} {}; {}storage binding {} MiB, buffer {} MiB, {} storage buffers a stage, offset alignment {}; device pools {}, host pools {}{}{})",
            i.name,
            i.backend,
            i.device_type,
            i.driver,
            i.driver_info,
            self.inner.class.map_or(String::new(), |c| format!("planned as a {} adapter (HICACHE_WGPU_LIMITS): ", c.name())),
            self.inner.limits.max_storage_buffer_binding_size >> 20,
            self.inner.limits.max_buffer_size >> 20,
            self.inner.limits.max_storage_buffers_per_shader_stage,
            self.inner.limits.min_storage_buffer_offset_alignment,
            self.device_pool_memory().name(),
            self.host_pool_memory().name(),
            if self.inner.mapped_host { ", mapped" } else { " (no MAPPABLE_PRIMARY_BUFFERS: staged host reads and writes)" },
            if self.inner.int64 { "; checksums in 64-bit integers" } else { "; checksums in 16-bit halves" }
        )
    }
    fn auto_slot(&self) -> &AutoSlot {
        &self.inner.auto
    }
    fn capabilities(&self) -> Capabilities {
        // copy_buffer_to_buffer needs 4-byte offsets and sizes; the shader copies u32 words.
        Capabilities {
            name: "wgpu",
            kernel_word: 4,
            direct_align: wgpu::COPY_BUFFER_ALIGNMENT,
            max_binding: self.inner.max_window,
            binding_align: self.inner.limits.min_storage_buffer_offset_alignment as u64,
            max_gather_items: self.inner.max_gather_items,
            max_index: i32::MAX as u64,
            // Pools larger than one buffer are segmented, so the bound is the memory behind
            // them: system memory for host-visible and unified pools, and no more than that
            // for VRAM (wgpu does not report its size; an allocation it refuses is an
            // out-of-memory error from its error scope).
            max_pool_bytes: host_memory_bytes(),
            max_host_pool_bytes: host_memory_bytes(),
            max_segment: self.inner.max_segment,
            max_lanes: self.inner.max_lanes,
            // Every adapter: which drivers stop long loops is not something wgpu reports.
            max_loop_trips: GATHER_MAX_TRIPS,
            device_index_lists: false,
            // The WGSL gather sums as it copies; buffer-to-buffer copies cannot.
            checksums: true,
            direct_checksums: false,
            // The shader computes a word's key from its 32-bit position in the item.
            max_checksum_item_words: 1 << 32,
            auto: crate::plan::AutoTable::DEFAULT,
        }
    }
    fn alloc(&self, bytes: u64) -> Result<WgpuBuffer> {
        self.alloc_with(bytes, bytes, REQUIRED_USAGES)
    }
    fn alloc_host(&self, bytes: u64) -> Result<WgpuBuffer> {
        self.alloc_pool(bytes, bytes, true)
    }
    fn alloc_pool(&self, bytes: u64, segment: u64, host: bool) -> Result<WgpuBuffer> {
        let map = if host && self.inner.mapped_host {
            wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::MAP_WRITE
        } else {
            wgpu::BufferUsages::empty()
        };
        self.alloc_with(bytes, segment, REQUIRED_USAGES | map)
    }
    fn buffer_len(&self, buf: &WgpuBuffer) -> u64 {
        buf.len
    }
    fn check_buffer(&self, buf: &WgpuBuffer) -> Result<()> {
        let have = buf.usage();
        let missing = REQUIRED_USAGES - have;
        if !missing.is_empty() {
            return Err(TransferError::InvalidConfig(format!(
                "wgpu buffer lacks usage {missing:?} (has {have:?}; pools need STORAGE | COPY_SRC | COPY_DST)"
            )));
        }
        if let Some(big) = buf.segments.iter().find(|b| b.size() > self.inner.max_buffer) {
            return Err(TransferError::BufferSize {
                what: "wgpu buffer (u32 offsets)".into(),
                expected: self.inner.max_buffer,
                actual: big.size(),
            });
        }
        Ok(())
    }
    fn write(&self, buf: &WgpuBuffer, offset: u64, data: &[u8]) -> Result<()> {
        self.check_lost()?;
        for (k, within, n, at) in buf.pieces(offset, data.len() as u64) {
            self.write_segment(&buf.segments[k], within, &data[at as usize..(at + n) as usize]).map_err(|e| self.lost_or(e))?;
        }
        Ok(())
    }
    fn read(&self, buf: &WgpuBuffer, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check_lost()?;
        for (k, within, n, at) in buf.pieces(offset, out.len() as u64) {
            self.read_segment(&buf.segments[k], within, &mut out[at as usize..(at + n) as usize]).map_err(|e| self.lost_or(e))?;
        }
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        self.wait().map_err(|e| self.lost_or(e))
    }
    fn time_one_copy(&self, bytes: u64, budget: Duration) -> Result<f64> {
        let (a, b) = (self.alloc(bytes)?, self.alloc(bytes)?);
        let size = a.raw().size();
        crate::timing::time(budget, || {
            self.submit(|enc| {
                enc.copy_buffer_to_buffer(a.raw(), 0, b.raw(), 0, size);
                Ok(())
            })
        })
    }
    /// Both streams are the one queue: a pipeline's backups run in submission order with its
    /// loads (so no ordering between the streams is ever needed).
    fn execute_step(&self, plan: &Plan, k: usize, bufs: &Bindings<'_, WgpuBuffer>, enqueue: bool, _stream: Stream) -> Result<()> {
        if k == 0 && enqueue {
            super::submit::PLAN_TICKETS.set(Some(Vec::new()));
        }
        self.step(plan, k, bufs, enqueue).map_err(|e| self.lost_or(e))
    }
    fn finish(&self) -> Result<()> {
        self.wait().map_err(|e| self.lost_or(e))
    }
    fn completion(&self, _stream: Stream) -> Result<WgpuTicket> {
        // Called after an asynchronous plan, all of whose steps went to the submit thread (on
        // this thread): its last submission, or else the newest (possibly another thread's
        // later one: waiting for it waits no less).
        let own = super::submit::PLAN_TICKETS.take().unwrap_or_default();
        let ticket = own.last().copied().unwrap_or_else(|| self.inner.submitter.lock().queued);
        Ok(WgpuTicket { exec: self.clone(), ticket, own: own.into() })
    }
}

impl WgpuExecutor {
    /// Step `k` of `plan`: a gather in one submission, `direct` runs in bounded ones.
    fn step(&self, plan: &Plan, k: usize, bufs: &Bindings<'_, WgpuBuffer>, enqueue: bool) -> Result<()> {
        let step = &plan.steps()[k];
        let runs = match step.kind() {
            StepKind::Gather(g) => return self.encode_and_submit(enqueue, |enc, sums| self.gather(g, bufs, enc, sums)),
            StepKind::Copy(c) => c,
        };
        if runs.len() > MANY_RUNS {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                log::warn!(
                    "wgpu: a direct step of {} runs issues one buffer copy per run; the kernel io backend is much faster for scattered items",
                    runs.len()
                )
            });
        }
        // Bounded submissions: a part of the runs each, the next encoded once the one before
        // has run, so that the queue never holds more than one part's commands.
        let per = self.inner.max_copies.max(1);
        for (part, lo) in (0..runs.len()).step_by(per).enumerate() {
            let chunk = lo..(lo + per).min(runs.len());
            if part > 0 {
                self.wait_previous_part(enqueue)?;
            }
            self.encode_and_submit(enqueue, |enc, sums| {
                for r in runs.runs_in(chunk.start, chunk.end) {
                    copy_run(enc, bufs.get(r.src), r.src_offset, bufs.get(r.dst), r.dst_offset, r.len);
                }
                // Buffer-to-buffer copies cannot sum: their items settle as unknown, in order.
                if let (Some(mode), Some(b)) = (step.unsummed(), &bufs.integrity) {
                    sums.push(PendingSums::unknown(mode, b.clone(), runs, chunk));
                }
                Ok(())
            })?;
        }
        Ok(())
    }
}
