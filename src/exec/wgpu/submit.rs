//! The submit thread, and waiting for and polling what it submitted (checksums settled in
//! submission order).

use std::sync::{Arc, Mutex};

use super::*;
use crate::error::{Result, TransferError};
use crate::exec::fault;

/// The submit thread's state: tickets given and submitted, and their submission indices.
#[derive(Default)]
pub(super) struct Submitter {
    state: Mutex<SubmitState>,
    submitted_cv: std::sync::Condvar,
    pub(super) tx: Mutex<Option<std::sync::mpsc::Sender<Handed>>>,
}

/// Checksum readbacks in submission order, and how many were ever pushed and settled (entry
/// `k`, counting from 0, is settled once `settled > k`).
#[derive(Default)]
pub(super) struct PendingQueue {
    entries: std::collections::VecDeque<PendingSums>,
    pushed: u64,
    settled: u64,
    /// Submissions made so far, and (set by `on_submitted_work_done`) the newest one known
    /// complete: what `is_done` reads instead of a zero-timeout wait, which wgpu-core asserts
    /// on when another thread's poll retires the submission first.
    submissions: u64,
    completed: Arc<std::sync::atomic::AtomicU64>,
}

/// Out-of-memory and validation error scopes around one submission, popped once (the inner
/// one first; later pops give `None`).
pub(super) struct Scopes(Option<(wgpu::ErrorScopeGuard, wgpu::ErrorScopeGuard)>);

impl Scopes {
    fn push(device: &wgpu::Device) -> Scopes {
        let oom = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        Scopes(Some((device.push_error_scope(wgpu::ErrorFilter::Validation), oom)))
    }
    /// The first error either scope caught.
    fn pop(&mut self) -> Option<String> {
        let (val, oom) = self.0.take()?;
        let v = pollster::block_on(val.pop());
        let o = pollster::block_on(oom.pop());
        v.or(o).map(|e| e.to_string())
    }
}

/// A submission: wgpu's index, the checksum readbacks pushed up to it, and its number in
/// [`PendingQueue::submissions`].
#[derive(Clone)]
pub(super) struct Submitted {
    index: wgpu::SubmissionIndex,
    pushed: u64,
    seq: u64,
}

/// What the submit thread is given: a ticket, its command buffer and its checksum readbacks.
pub(super) type Handed = (u64, wgpu::CommandBuffer, Vec<PendingSums>);
#[derive(Default)]
pub(super) struct SubmitState {
    pub(super) queued: u64,
    submitted: u64,
    /// Recent tickets' submissions (see [`Submitted`]; pruned to the last 4096).
    indices: std::collections::BTreeMap<u64, Submitted>,
    /// Tickets whose submission failed, and why (pruned likewise).
    pub(super) failed: std::collections::BTreeMap<u64, String>,
}

thread_local! {
    /// The tickets of the asynchronous plan this thread is issuing (its steps and its
    /// completion run on one thread): its completion checks each for a failed submission.
    pub(super) static PLAN_TICKETS: std::cell::RefCell<Option<Vec<u64>>> = const { std::cell::RefCell::new(None) };
}

impl Submitter {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, SubmitState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// Waits until every command buffer given so far has been submitted (not what others give
    /// meanwhile).
    pub(super) fn drain(&self) {
        let mut st = self.lock();
        let target = st.queued;
        while st.submitted < target {
            st = self.submitted_cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
    /// Waits until ticket `t` is submitted; its submission and the checksum readbacks pushed up
    /// to it (`Err` when it failed, `None` when it is too old to be remembered).
    fn index_of(&self, t: u64) -> Result<Option<Submitted>> {
        let mut st = self.lock();
        while st.submitted < t {
            st = self.submitted_cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        if let Some(e) = st.failed.get(&t) {
            return Err(err(format!("submitting a queued transfer: {e}")));
        }
        Ok(st.indices.get(&t).cloned())
    }
    /// The first of tickets `ts` whose submission failed, as an error (waits until each is
    /// submitted; tickets too old to be remembered pass).
    pub(super) fn first_failure(&self, ts: &[u64]) -> Result<()> {
        for &t in ts {
            self.index_of(t)?;
        }
        Ok(())
    }
    fn is_submitted(&self, t: u64) -> bool {
        self.lock().submitted >= t
    }
}
/// Submits `cb` and queues its checksum readbacks in submission order (the lock covers both):
/// mapped, or marked failed when `errors` (popping the submission's error scopes) reports one,
/// so that a submission that did not run never settles zeroed sums. Returns the submission and
/// the error.
pub(super) fn submit_with(
    queue: &wgpu::Queue,
    pending: &Mutex<PendingQueue>,
    cb: Option<wgpu::CommandBuffer>,
    sums: Vec<PendingSums>,
    errors: impl FnOnce() -> Option<String>,
) -> (Submitted, Option<String>) {
    let mut q = pending.lock().unwrap_or_else(|e| e.into_inner());
    let index = queue.submit(cb);
    q.submissions += 1;
    let (seq, completed) = (q.submissions, q.completed.clone());
    queue.on_submitted_work_done(move || {
        completed.fetch_max(seq, std::sync::atomic::Ordering::Release);
    });
    let error = errors();
    for s in sums {
        match error {
            Some(_) => s.failed.store(true, std::sync::atomic::Ordering::Release),
            None => s.map(),
        }
        q.entries.push_back(s);
        q.pushed += 1;
    }
    let pushed = q.pushed;
    (Submitted { index, pushed, seq }, error)
}

impl WgpuExecutor {
    /// [`TransferError::DeviceLost`] once the device is lost (the callback said so), for good.
    pub(super) fn check_lost(&self) -> Result<()> {
        match self.inner.lost.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            Some(cause) => Err(TransferError::DeviceLost { backend: "wgpu", cause }),
            None => Ok(()),
        }
    }

    /// `e`, or [`TransferError::DeviceLost`] when the device turns out to be lost: a failure
    /// after a loss (an invalid buffer, a failed map) is reported as the loss, once a poll has
    /// run the device-lost callback that wgpu may still hold.
    pub(super) fn lost_or(&self, e: TransferError) -> TransferError {
        if matches!(e, TransferError::DeviceLost { .. }) {
            return e;
        }
        let _ = self.inner.device.poll(wgpu::PollType::Poll);
        self.check_lost().err().unwrap_or(e)
    }

    /// Waits for everything submitted so far, checksums settled.
    pub(super) fn wait(&self) -> Result<()> {
        self.inner.submitter.drain();
        let pushed = self.inner.pending.lock().unwrap_or_else(|e| e.into_inner()).pushed;
        self.wait_index(None)?;
        self.settle_until(pushed)
    }

    /// Waits for submission `index` (all of them: `None`), then settles the checksums of what
    /// has completed.
    pub(super) fn wait_index(&self, index: Option<wgpu::SubmissionIndex>) -> Result<()> {
        let waited = self.inner.device.poll(wgpu::PollType::Wait { submission_index: index, timeout: Some(WAIT) });
        self.settle();
        // A wait that failed because the device was lost says so.
        self.check_lost()?;
        waited.map(|_| ()).map_err(|e| err(format!("waiting for the queue: {e}")))
    }

    /// Waits for the part of a step submitted last by this thread: its ticket on the submit
    /// thread (`later`), else everything submitted.
    pub(super) fn wait_previous_part(&self, later: bool) -> Result<()> {
        match PLAN_TICKETS.with_borrow(|p| p.as_ref().and_then(|v| v.last().copied())) {
            Some(t) if later => self.wait_for(t),
            _ => self.wait(),
        }
    }

    /// Waits for the transfers up to ticket `t` of the submit thread, checksums settled.
    pub(crate) fn wait_for(&self, t: u64) -> Result<()> {
        match self.inner.submitter.index_of(t)? {
            Some(s) => {
                self.wait_index(Some(s.index))?;
                self.settle_until(s.pushed)
            }
            None => self.wait(),
        }
    }

    /// Settles checksum readbacks until the first `pushed` are: their submissions have
    /// completed, but another thread's poll may have taken their mapping callbacks and not run
    /// them yet.
    fn settle_until(&self, pushed: u64) -> Result<()> {
        let start = std::time::Instant::now();
        loop {
            self.settle();
            if self.inner.pending.lock().unwrap_or_else(|e| e.into_inner()).settled >= pushed {
                return Ok(());
            }
            self.check_lost()?;
            if start.elapsed() > WAIT {
                return Err(err("waiting for checksum readbacks timed out"));
            }
            std::thread::yield_now();
            self.inner.device.poll(wgpu::PollType::Poll).map_err(|e| err(format!("polling the queue: {e}")))?;
        }
    }

    /// Whether the transfers up to ticket `t` have completed (polls without blocking).
    pub(crate) fn is_done(&self, t: u64) -> Result<bool> {
        self.check_lost()?;
        if !self.inner.submitter.is_submitted(t) {
            return Ok(false);
        }
        let status = self.inner.device.poll(wgpu::PollType::Poll).map_err(|e| err(format!("polling the queue: {e}")))?;
        let completed = self.inner.pending.lock().unwrap_or_else(|e| e.into_inner()).completed.clone();
        let (done, pushed) = match self.inner.submitter.index_of(t)? {
            // A poll that leaves the queue non-empty does not say which submissions are done;
            // the completion callbacks the poll ran do.
            Some(s) => (status.is_queue_empty() || completed.load(std::sync::atomic::Ordering::Acquire) >= s.seq, s.pushed),
            // Too old to be remembered: done once the queue is empty (and, below, every readback
            // pushed so far settled).
            None => (status.is_queue_empty(), self.inner.pending.lock().unwrap_or_else(|e| e.into_inner()).pushed),
        };
        if !done {
            return Ok(false);
        }
        // Done once its checksums are settled too (their callbacks may still be on their way).
        self.settle();
        Ok(self.inner.pending.lock().unwrap_or_else(|e| e.into_inner()).settled >= pushed)
    }

    /// Hands an encoded command buffer to the submit thread (started on first use).
    fn submit_later(&self, cb: wgpu::CommandBuffer, sums: Vec<PendingSums>) -> Result<u64> {
        let sub = &self.inner.submitter;
        let mut tx = sub.tx.lock().unwrap_or_else(|e| e.into_inner());
        if tx.is_none() {
            let (send, recv) = std::sync::mpsc::channel::<Handed>();
            let queue = self.inner.queue.clone();
            let pending = self.inner.pending.clone();
            let device = self.inner.device.clone();
            let map_lock = self.inner.map_lock.clone();
            let shared = Arc::downgrade(sub);
            let id = self.inner.id;
            let handle = std::thread::Builder::new()
                .name("hicache-io wgpu submit".into())
                .spawn(move || {
                    for (ticket, cb, sums) in recv {
                        // Error scopes are per thread: these catch what the submission of this
                        // command buffer reports (its readbacks are then marked failed), and its
                        // waiters get it as an error. A panic inside wgpu must not leave them
                        // hanging either.
                        let mut scopes = Scopes::push(&device);
                        let injected = fault::fires(id, fault::At::Submission);
                        let mut pop = || scopes.pop().or_else(|| injected.then(|| "injected submission fault".to_string()));
                        let index = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            let _no_mapping = map_lock.read().unwrap_or_else(|e| e.into_inner());
                            submit_with(&queue, &pending, (!injected).then_some(cb), sums, &mut pop)
                        }));
                        // A panic before the scope was popped: pop it now.
                        let late = pop();
                        let Some(s) = shared.upgrade() else { return };
                        let mut st = s.lock();
                        let (index, error) = match index {
                            Ok((submitted, error)) => (Ok(submitted), error.or(late)),
                            Err(e) => (Err(e), late),
                        };
                        match (index, error) {
                            (Ok(index), None) => {
                                st.indices.insert(ticket, index);
                            }
                            (Ok(_), Some(e)) => {
                                st.failed.insert(ticket, e.to_string());
                            }
                            (Err(_), _) => {
                                st.failed.insert(ticket, "the queue submission panicked".into());
                            }
                        }
                        while st.failed.len() > 4096 {
                            st.failed.pop_first();
                        }
                        while st.indices.len() > 4096 {
                            st.indices.pop_first();
                        }
                        st.submitted = ticket;
                        s.submitted_cv.notify_all();
                    }
                })
                .map_err(|e| err(format!("starting the submit thread: {e}")))?;
            *self.inner.submit_thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
            *tx = Some(send);
        }
        let ticket = {
            let mut st = sub.lock();
            st.queued += 1;
            st.queued
        };
        if tx.as_ref().map(|t| t.send((ticket, cb, sums)).is_err()).unwrap_or(true) {
            // The thread is gone: count the ticket as submitted-nothing so nobody waits forever.
            let mut st = sub.lock();
            st.submitted = st.submitted.max(ticket);
            sub.submitted_cv.notify_all();
            return Err(err("the submit thread is gone"));
        }
        Ok(ticket)
    }

    /// Submits `encoder` inside validation and out-of-memory scopes and waits.
    pub(super) fn submit(&self, build: impl FnOnce(&mut wgpu::CommandEncoder) -> Result<()>) -> Result<()> {
        self.encode_and_submit(false, |enc, _| build(enc))?;
        self.wait()
    }

    /// Submits `encoder` inside validation and out-of-memory scopes; with `later`, hands it to
    /// the submit thread instead (encoding errors are still caught here).
    /// `build` may add checksum readbacks, settled once the submission has completed.
    pub(super) fn encode_and_submit(
        &self,
        later: bool,
        build: impl FnOnce(&mut wgpu::CommandEncoder, &mut Vec<PendingSums>) -> Result<()>,
    ) -> Result<()> {
        self.check_lost()?;
        if !later {
            // Program order: what the submit thread holds goes first.
            self.inner.submitter.drain();
        }
        let dev = &self.inner.device;
        // Popped after the submission when there is one, so that its checksum readbacks are
        // marked failed before anyone can settle them.
        let mut scopes = Scopes::push(dev);
        let mut pop = || scopes.pop();
        let mut enc = dev.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("hicache-io") });
        let mut sums = Vec::new();
        let built = build(&mut enc, &mut sums);
        let mut handed = Ok(());
        let mut error = None;
        if built.is_ok() {
            let cb = enc.finish();
            if later {
                // The submit thread's own scope catches what its submission reports.
                handed = self.submit_later(cb, sums).map(|t| {
                    PLAN_TICKETS.with_borrow_mut(|p| {
                        if let Some(p) = p {
                            p.push(t)
                        }
                    })
                });
            } else {
                let _no_mapping = self.inner.map_lock.read().unwrap_or_else(|e| e.into_inner());
                error = submit_with(&self.inner.queue, &self.inner.pending, Some(cb), sums, &mut pop).1;
            }
        }
        let error = error.or_else(&mut pop);
        built?;
        handed?;
        if let Some(e) = error {
            return Err(err(e));
        }
        Ok(())
    }

    /// Records or verifies the checksums of every completed checksumming step, oldest first
    /// (mappings complete in submission order, so the settled ones are a prefix).
    pub(super) fn settle(&self) {
        let mut q = self.inner.pending.lock().unwrap_or_else(|e| e.into_inner());
        while q.entries.front().is_some_and(|p| p.is_ready()) {
            if let Some(p) = q.entries.pop_front() {
                p.settle();
                q.settled += 1;
            }
        }
    }
}
