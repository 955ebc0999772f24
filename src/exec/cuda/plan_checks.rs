//! The device checks of a plan whose index lists are in CUDA memory, across its steps: enqueued
//! before its first gather, their status tested by its gathers, their report queued after its
//! last (or after the last of the calls that share one check).

use std::cell::{Cell, RefCell};

use cudarc::driver::sys;

use super::checks::Slot;
use super::driver::drv_msg;
use super::staging::Scratch;
use super::CudaExecutor;
use crate::error::Result;
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

impl CudaExecutor {
    /// The device address of the status word step `k` of `plan`, gather `g`, tests (0 for
    /// host index lists): the first step enqueues the plan's checks on `stream` (into
    /// `scratch`'s check area, under the stream's scratch lock the caller holds), the later
    /// ones (and the later calls sharing the check) find them active.
    pub(super) fn check_status(
        &self,
        plan: &Plan,
        k: usize,
        g: &GatherStep,
        stream: sys::CUstream,
        scratch: &mut Scratch,
    ) -> Result<sys::CUdeviceptr> {
        Ok(match (plan.device_check(), g.device_lists()) {
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
        })
    }

    /// After step `k` of `plan`: the last step of a device-checked plan queues its checks'
    /// report (unless the check is shared, see [`CudaExecutor::with_shared_index_check`]).
    pub(super) fn report_after_last(&self, plan: &Plan, k: usize) -> Result<()> {
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
