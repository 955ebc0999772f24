//! Launching a gather step: its launch description, its tables uploaded, the kernel enqueued;
//! and the device checks of a plan whose index lists are in CUDA memory.

use std::cell::{Cell, RefCell};

use cudarc::driver::{result, sys};

use super::checks::Slot;
use super::driver::{drv, drv_msg};
use super::{call_tuning, CudaBuffer, CudaExecutor};
use crate::error::Result;
use crate::exec::cuda_launch::gather_launch;
use crate::exec::{Bindings, Stream};
use crate::plan::{DeviceIndexCheck, GatherStep, Plan};

/// A device check enqueued on this thread whose report is not queued yet: the plan's later
/// steps (and, inside [`CudaExecutor::with_shared_index_check`], the later calls with the same
/// check) test its status. Thread-local because a plan's steps are issued by one thread, one
/// after the other; another thread's calls have their own.
struct Active {
    exec: u64,
    check: DeviceIndexCheck,
    stream: sys::CUstream,
    slot: Slot,
}

thread_local! {
    static ACTIVE: RefCell<Vec<Active>> = const { RefCell::new(Vec::new()) };
    static SHARED: Cell<u32> = const { Cell::new(0) };
}

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
        let tuning = call_tuning().unwrap_or(self.inner.tuning);
        let launch = gather_launch(g, |b| bufs.get(b).dev_ptr, tuning, self.inner.max_threads)?;
        let mut scratch = scratch.lock().unwrap_or_else(|e| e.into_inner());
        let status = match (plan.device_check(), g.device_lists()) {
            (Some(c), Some(_)) => {
                let id = self.inner.id;
                let active =
                    ACTIVE.with_borrow(|a| a.iter().find(|a| a.exec == id && a.check == *c && a.stream == stream).map(|a| a.slot.status));
                match active {
                    Some(status) if k > 0 || SHARED.get() > 0 => status,
                    _ if k > 0 => return Err(drv_msg("a later step of a device-checked plan found no checks enqueued")),
                    _ => {
                        // An earlier check left unreported (its plan failed midway) is reported
                        // first: its slot then comes back once the report is read.
                        self.report_active()?;
                        let slot = {
                            let mut reports = self.inner.reports.lock().unwrap_or_else(|e| e.into_inner());
                            // SAFETY: the context is bound (execute_step).
                            unsafe { reports.slot()? }
                        };
                        // SAFETY: the context is bound; the slot is this call's; the lists are
                        // the caller's device memory, vouched for where they were described. On
                        // failure the slot is not reused (queued work may use it).
                        unsafe { scratch.check.enqueue(stream, self.inner.f_check, c, slot.status)? };
                        ACTIVE.with_borrow_mut(|a| a.push(Active { exec: id, check: *c, stream, slot }));
                        slot.status
                    }
                }
            }
            // Unchecked device lists never reach a kernel.
            (None, Some(_)) => return Err(drv_msg("a gather with CUDA index lists but no device check")),
            (_, None) => 0,
        };
        let summing = match (g.checksum(), &bufs.integrity) {
            (Some(mode), Some(b)) => Some((mode, b, launch.sum_entries()? as usize)),
            _ => None,
        };
        let args = scratch.upload(stream, g, &launch)?;
        let [table, src_idx, dst_idx] = args;
        // A word aligned for 16 bytes is aligned for 8 and 4: a cap only narrows it.
        let word = launch.word.min(self.inner.max_word);
        let grid = ((launch.blocks, 1, 1), (launch.threads_per_block, 1, 1));
        match summing {
            None => {
                let mut kernel_args = launch.args(table, src_idx, dst_idx, status);
                let mut params = kernel_args.params();
                let f = self.inner.f_gather[word_index(word)];
                // SAFETY: the arguments match the kernel's signature; the tables live in the
                // scratch area, which later uploads overwrite only in stream order (after this
                // kernel).
                unsafe { result::launch_kernel(f, grid.0, grid.1, 0, stream, &mut params) }.map_err(|e| drv("cuLaunchKernel", e))?;
            }
            Some((mode, binding, entries)) => {
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
                let f = self.inner.f_gather_sum[word_index(word)];
                // SAFETY: as above; the sums hold `entries` words.
                if let Err(e) = unsafe { result::launch_kernel(f, grid.0, grid.1, 0, stream, &mut params) } {
                    sums.retire(buf);
                    return Err(drv("cuLaunchKernel (summing gather)", e));
                }
                // Queued under the scratch lock: this stream's entries stay in device order.
                // SAFETY: the kernel was enqueued on `stream` just above.
                unsafe { sums.push_sums(stream, buf, entries, g, mode, binding, orphan)? };
            }
        }
        drop(scratch);
        if plan.device_check().is_some() && k + 1 == plan.steps().len() && SHARED.get() == 0 {
            self.report_active()?;
        }
        Ok(())
    }

    /// Queues the report of this executor's device check left active on this thread, if any,
    /// behind the gathers that test it.
    fn report_active(&self) -> Result<()> {
        let id = self.inner.id;
        let Some(a) = ACTIVE.with_borrow_mut(|v| v.iter().position(|a| a.exec == id).map(|i| v.swap_remove(i))) else {
            return Ok(());
        };
        let mut reports = self.inner.reports.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the context is bound (the callers bind it); the stream is this executor's and
        // live; the slot's checks were enqueued on it.
        unsafe { reports.enqueue(a.stream, a.slot, a.check) }
    }

    /// Runs `f` (calls issued by this thread on this executor, one after the other) with one
    /// device check shared by the calls whose CUDA index lists and bounds are the same (the
    /// layers of one all-layer op): checked once, so all of them move or none does, and
    /// reported once, after the last.
    pub(crate) fn with_shared_index_check<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        struct Scope;
        impl Drop for Scope {
            fn drop(&mut self) {
                SHARED.set(SHARED.get() - 1);
            }
        }
        let r = {
            SHARED.set(SHARED.get() + 1);
            let _scope = Scope;
            f()
        };
        if SHARED.get() > 0 {
            return r;
        }
        let reported = self.bind().and_then(|_| self.report_active());
        // The calls' own error first.
        r.and_then(|v| reported.map(|_| v))
    }
}
