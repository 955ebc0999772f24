//! Running a validated plan on a [`Device`]: the owner check, narrowing the bindings to the
//! backend's buffers, the steps in order on one of its streams, and the error of a plan that
//! failed part way.

use crate::error::{Result, TransferError};
use crate::plan::{Plan, Step};

use super::device::{each_backend, typed, Pick};
use super::{fault, Bindings, Buffer, Completion, Device, Executor, Stream};

impl Device {
    /// Runs a plan over pool buffers, step by step, and waits for it. A plan made for another
    /// executor instance is refused before anything runs. When a step fails, the steps before
    /// it have completed (the executor is drained first) and the error names them.
    pub(crate) fn execute(&self, plan: &Plan, bufs: &Bindings<'_, Buffer>) -> Result<()> {
        self.dispatch(plan, bufs, false, None).map(|_| ())
    }

    /// [`Device::execute`] past any armed fault (the calibration's own runs must not use it up).
    pub(crate) fn execute_unfaulted(&self, plan: &Plan, bufs: &Bindings<'_, Buffer>) -> Result<()> {
        fault::unfaulted(|| self.execute(plan, bufs))
    }

    /// Enqueues a plan and returns its completion without waiting.
    pub(crate) fn execute_async(&self, plan: &Plan, bufs: &Bindings<'_, Buffer>) -> Result<Completion> {
        self.dispatch(plan, bufs, true, None)
    }

    /// Enqueues a plan on `stream` for a [`crate::Pipeline`], which orders the two streams
    /// itself where their transfers touch the same slots.
    pub(crate) fn execute_on(&self, plan: &Plan, bufs: &Bindings<'_, Buffer>, stream: Stream) -> Result<Completion> {
        self.dispatch(plan, bufs, true, Some(stream))
    }

    /// Work enqueued on `then` from now on starts after everything enqueued on `first` so far.
    pub(crate) fn order_after(&self, first: Stream, then: Stream) -> Result<()> {
        each_backend!(self, e => Executor::order_after(e, first, then))
    }

    /// `stream: None` is a plain call: the main stream, after anything still running on the
    /// backup stream (a pipeline's backups; even a leaked pipeline's come before later calls).
    fn dispatch(&self, plan: &Plan, bufs: &Bindings<'_, Buffer>, enqueue: bool, stream: Option<Stream>) -> Result<Completion> {
        if plan.owner() != self.id() {
            return Err(TransferError::ExecutorMismatch {
                expected: self.label(),
                found: format!("a plan made for executor #{}", plan.owner()),
            });
        }
        if plan.is_empty() {
            return Ok(Completion::done());
        }
        let mut completion = each_backend!(self, e => self.run_typed(e, plan, bufs, enqueue, stream)).inspect_err(|e| {
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

    fn run_typed<E>(&self, e: &E, plan: &Plan, bufs: &Bindings<'_, Buffer>, enqueue: bool, stream: Option<Stream>) -> Result<Completion>
    where
        E: Executor,
        E::Buffer: Pick,
        E::Ticket: Into<Completion>,
    {
        let bufs = typed::<E::Buffer>(bufs, e.name())?;
        let stream = match stream {
            Some(s) => s,
            None => {
                if e.is_busy(Stream::Backup) {
                    e.order_after(Stream::Backup, Stream::Main)?;
                }
                Stream::Main
            }
        };
        self.run_steps(e, plan, &bufs, enqueue, stream)
    }

    fn run_steps<E>(&self, e: &E, plan: &Plan, bufs: &Bindings<'_, E::Buffer>, enqueue: bool, stream: Stream) -> Result<Completion>
    where
        E: Executor,
        E::Ticket: Into<Completion>,
    {
        let steps = plan.steps();
        for k in 0..steps.len() {
            if let Err(err) = fault::point(self.id(), self.name()).and_then(|_| e.execute_step(plan, k, bufs, enqueue, stream)) {
                // Drain what was enqueued before the failure (stream-ordered executors too), so
                // "completed" is true: a sticky device error fails the drain, and then nothing is
                // reported complete. Nor is anything when the steps' copies wait on a device
                // check of CUDA index lists: its verdict is the next synchronize's to report.
                let drained = e.finish().and_then(|_| e.synchronize()).is_ok() && plan.device_check().is_none();
                return Err(failed_at(steps, k, drained, err));
            }
        }
        if enqueue {
            // Without a handle nobody could wait for what was queued: drain it before failing.
            return e.completion(stream).map(Into::into).inspect_err(|_| {
                let _ = e.synchronize();
            });
        }
        e.finish().map_err(|err| failed_at(steps, steps.len().saturating_sub(1), false, err))?;
        Ok(Completion::done())
    }
}

/// The error of a plan that failed at step `failed`. A single-step plan returns the executor's
/// error as it is (nothing completed); otherwise it names the host layers whose every step
/// completed before the failure (`drained`: the executor confirmed the earlier steps).
fn failed_at(steps: &[Step], failed: usize, drained: bool, err: TransferError) -> TransferError {
    if steps.len() <= 1 {
        return err;
    }
    let completed_layers = if drained {
        let pending = crate::plan::layers_of(&steps[failed..]);
        crate::plan::layers_of(&steps[..failed]).into_iter().filter(|l| pending.binary_search(l).is_err()).collect()
    } else {
        Vec::new()
    };
    TransferError::partial(failed, steps.len(), completed_layers, err)
}
