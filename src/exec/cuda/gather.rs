//! Launching a gather step: its launch description, its tables uploaded, the kernel enqueued
//! (the plain copy, or the summing one with its sums queued for settling). The device checks it
//! tests are in `plan_checks`.

use cudarc::driver::{result, sys};

use super::driver::drv;
use super::{CudaBuffer, CudaExecutor};
use crate::error::Result;
use crate::exec::cuda_launch::{gather_launch, GatherLaunch};
use crate::exec::{Bindings, ChecksumBinding, Stream};
use crate::plan::{ChecksumMode, GatherStep, Plan};

/// A launch's grid and block dimensions.
type Grid = ((u32, u32, u32), (u32, u32, u32));

/// Index of a copy word's kernel in the executor's function tables: 16, 8, 4 bytes.
fn word_index(word: u32) -> usize {
    match word {
        16 => 0,
        8 => 1,
        _ => 2,
    }
}

impl CudaExecutor {
    /// `direct` runs of a checksummed pool's step whose copies cannot sum: copied, then their
    /// items queued to settle as unknown in stream order (under the stream's scratch lock, as
    /// the summing gathers' entries).
    pub(super) fn copies_unsummed(
        &self,
        runs: &crate::plan::CopyStep,
        bufs: &Bindings<'_, CudaBuffer>,
        on: Stream,
        mode: crate::plan::ChecksumMode,
        binding: &crate::exec::ChecksumBinding,
        orphan: bool,
    ) -> Result<()> {
        let mut side = None;
        let (stream, scratch) = self.stream_scratch(on, &mut side)?;
        let _order = scratch.lock().unwrap_or_else(|e| e.into_inner());
        let copied = self.copies(runs, bufs, on);
        // Even after a failed copy: some runs may have been enqueued, and their items must not
        // keep checksums of other bytes.
        // SAFETY: the context is bound (execute_step); the runs were enqueued on `stream`.
        let queued = unsafe { self.inner.sums.push_unknown(stream, runs, mode, binding, orphan) };
        copied.and(queued)
    }

    /// Step `k` of `plan`, a gather. A plan with CUDA index lists runs its checks before its
    /// first step and queues their report after its last; its gathers test the checks' status.
    /// A checksumming step launches the summing kernel and queues its sums for settling
    /// (`orphan`: a plain call's, whose mismatches the next `synchronize` reports).
    pub(super) fn gather(
        &self,
        plan: &Plan,
        k: usize,
        g: &GatherStep,
        bufs: &Bindings<'_, CudaBuffer>,
        on: Stream,
        orphan: bool,
    ) -> Result<()> {
        let mut side = None;
        let (stream, scratch) = self.stream_scratch(on, &mut side)?;
        // The call's own grid (sglang's `block_quota`, `num_warps_per_block`), else the executor's.
        let tuning = plan.tuning().unwrap_or(self.inner.tuning);
        let launch = gather_launch(g, |b| bufs.get(b).dev_ptr, tuning, self.inner.max_threads)?;
        let mut scratch = scratch.lock().unwrap_or_else(|e| e.into_inner());
        let status = self.check_status(plan, k, g, stream, &mut scratch)?;
        let summing = match (g.checksum(), &bufs.integrity) {
            (Some(mode), Some(b)) => Some((mode, b, launch.sum_entries()? as usize)),
            _ => None,
        };
        let args = scratch.upload(stream, g, &launch)?;
        // Launched under the scratch lock, as the tables were uploaded (released after).
        match summing {
            None => self.launch_plain(stream, &launch, args, status)?,
            Some(summing) => self.launch_summing(stream, &launch, args, status, g, summing, orphan)?,
        }
        drop(scratch);
        self.report_after_last(plan, k)
    }

    /// The function among `fs` (16-, 8- and 4-byte words) for `launch`'s copy word, and the
    /// launch's grid.
    fn kernel(&self, fs: &[sys::CUfunction; 3], launch: &GatherLaunch) -> (sys::CUfunction, Grid) {
        // A word aligned for 16 bytes is aligned for 8 and 4: a cap only narrows it.
        let word = launch.word.min(self.inner.max_word);
        (fs[word_index(word)], ((launch.blocks, 1, 1), (launch.threads_per_block, 1, 1)))
    }

    /// Enqueues the plain gather kernel on `stream` over the tables `args` uploaded for it,
    /// testing the checks' `status`. The caller holds `stream`'s scratch lock.
    fn launch_plain(
        &self,
        stream: sys::CUstream,
        launch: &GatherLaunch,
        args: [sys::CUdeviceptr; 3],
        status: sys::CUdeviceptr,
    ) -> Result<()> {
        let [table, src_idx, dst_idx] = args;
        let mut kernel_args = launch.args(table, src_idx, dst_idx, status);
        let mut params = kernel_args.params();
        let (f, grid) = self.kernel(&self.inner.f_gather, launch);
        // SAFETY: the arguments match the kernel's signature; the tables live in the
        // scratch area, which later uploads overwrite only in stream order (after this
        // kernel).
        unsafe { result::launch_kernel(f, grid.0, grid.1, 0, stream, &mut params) }.map_err(|e| drv("cuLaunchKernel", e))?;
        Ok(())
    }

    /// Enqueues the summing gather kernel on `stream` (as `launch_plain`) into a zeroed sums
    /// buffer of `entries` words, then queues the sums for settling. The caller holds
    /// `stream`'s scratch lock.
    #[allow(clippy::too_many_arguments)]
    fn launch_summing(
        &self,
        stream: sys::CUstream,
        launch: &GatherLaunch,
        args: [sys::CUdeviceptr; 3],
        status: sys::CUdeviceptr,
        g: &GatherStep,
        (mode, binding, entries): (ChecksumMode, &ChecksumBinding, usize),
        orphan: bool,
    ) -> Result<()> {
        let [table, src_idx, dst_idx] = args;
        let sums = &self.inner.sums;
        // Items have fewer than 2^32 words (`sum_entries`): one base covers their keys.
        let key_base = crate::integrity::key_base(binding.table.keys().seed(), 0);
        // SAFETY: the context is bound.
        let buf = unsafe { sums.buffer(entries * 8)? };
        // SAFETY: the buffer's device half holds at least `entries · 8` bytes.
        if let Err(e) = unsafe { result::memset_d8_async(buf.dev, 0, entries * 8, stream) } {
            sums.unused(buf);
            return Err(drv("cuMemsetD8Async (checksums)", e));
        }
        let mut kernel_args = launch.sum_args(table, src_idx, dst_idx, status, key_base, buf.dev);
        let mut params = kernel_args.params();
        let (f, grid) = self.kernel(&self.inner.f_gather_sum, launch);
        // SAFETY: as in `launch_plain`; the sums hold `entries` words.
        if let Err(e) = unsafe { result::launch_kernel(f, grid.0, grid.1, 0, stream, &mut params) } {
            sums.retire(buf);
            return Err(drv("cuLaunchKernel (summing gather)", e));
        }
        // Queued under the scratch lock: this stream's entries stay in device order.
        // SAFETY: the kernel was enqueued on `stream` just above.
        unsafe { sums.push_sums(stream, buf, entries, g, mode, binding, orphan)? };
        Ok(())
    }
}
