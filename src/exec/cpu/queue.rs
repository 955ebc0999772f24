//! The cpu executor's two ordered queues of transfers (main and backup stream), one worker
//! thread each, and the tickets that wait on them.

use std::sync::{mpsc, Arc, Condvar, Mutex};

use crate::error::{Result, TransferError};
use crate::exec::{Stream, Ticket};

/// The main and the backup stream.
pub(crate) struct CpuQueues {
    pub(super) main: Arc<CpuQueue>,
    pub(super) backup: Arc<CpuQueue>,
}

impl CpuQueues {
    pub(super) fn new() -> Arc<CpuQueues> {
        Arc::new(CpuQueues { main: CpuQueue::new("hicache-io cpu"), backup: CpuQueue::new("hicache-io cpu backup") })
    }
    pub(super) fn get(&self, stream: Stream) -> &Arc<CpuQueue> {
        match stream {
            Stream::Main => &self.main,
            Stream::Backup => &self.backup,
        }
    }
    /// Waits until everything queued so far on both streams has run.
    pub(super) fn idle(&self) {
        self.backup.idle();
        self.main.idle();
    }
}

type Job = Box<dyn FnOnce() + Send>;

thread_local! {
    /// True on an executor's worker thread.
    pub(super) static ON_WORKER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Transfers in submission order on one worker thread; tickets count them.
pub(crate) struct CpuQueue {
    name: &'static str,
    state: Mutex<QueueState>,
    done: Condvar,
    /// Started on the first queued job.
    worker: Mutex<Option<mpsc::Sender<Job>>>,
}

#[derive(Default)]
struct QueueState {
    submitted: u64,
    completed: u64,
    /// The first job that failed (a panic in a copy: a bug) and its ticket.
    failed: Option<(u64, String)>,
}

impl CpuQueue {
    pub(super) fn new(name: &'static str) -> Arc<CpuQueue> {
        Arc::new(CpuQueue { name, state: Mutex::new(QueueState::default()), done: Condvar::new(), worker: Mutex::new(None) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn is_idle(&self) -> bool {
        let st = self.lock();
        st.completed == st.submitted
    }

    /// Queues `job`; returns its ticket.
    pub(super) fn enqueue(self: &Arc<Self>, job: Job) -> Result<u64> {
        let mut worker = self.worker.lock().unwrap_or_else(|e| e.into_inner());
        if worker.is_none() {
            let (tx, rx) = mpsc::channel::<Job>();
            let queue = Arc::downgrade(self);
            std::thread::Builder::new()
                .name(self.name.into())
                .spawn(move || {
                    ON_WORKER.with(|w| w.set(true));
                    for job in rx {
                        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                        let Some(q) = queue.upgrade() else { return };
                        let mut st = q.lock();
                        st.completed += 1;
                        if let Err(p) = outcome {
                            let msg = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
                            let ticket = st.completed;
                            st.failed.get_or_insert((ticket, msg.unwrap_or_default()));
                        }
                        q.done.notify_all();
                    }
                })
                .map_err(|e| TransferError::Executor { backend: "cpu", message: format!("starting the worker thread: {e}") })?;
            *worker = Some(tx);
        }
        let ticket = {
            let mut st = self.lock();
            st.submitted += 1;
            st.submitted
        };
        let sent = worker.as_ref().map(|tx| tx.send(job).is_ok()).unwrap_or(false);
        if !sent {
            let mut st = self.lock();
            st.completed += 1;
            st.failed.get_or_insert((ticket, "the worker thread is gone".into()));
            self.done.notify_all();
        }
        Ok(ticket)
    }

    /// Waits until the job with `ticket` (and every job before it) has run.
    pub(crate) fn wait(&self, ticket: u64) -> Result<()> {
        let mut st = self.lock();
        while st.completed < ticket {
            st = self.done.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        match &st.failed {
            Some((t, msg)) if *t <= ticket => {
                Err(TransferError::Executor { backend: "cpu", message: format!("a queued transfer panicked: {msg}") })
            }
            _ => Ok(()),
        }
    }

    /// Waits until everything queued so far has run (not what others queue meanwhile).
    pub(crate) fn idle(&self) {
        let mut st = self.lock();
        let target = st.submitted;
        while st.completed < target {
            st = self.done.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The ticket of the last queued job.
    pub(crate) fn last_ticket(&self) -> u64 {
        self.lock().submitted
    }
}

impl Drop for CpuQueue {
    fn drop(&mut self) {
        // Closing the channel ends the worker.
        self.worker.get_mut().unwrap_or_else(|e| e.into_inner()).take();
    }
}

/// A ticket on a cpu executor's queue (the cpu form of a completion handle).
#[derive(Clone)]
pub(crate) struct CpuTicket {
    pub(crate) queue: Arc<CpuQueue>,
    pub(crate) ticket: u64,
}

impl Ticket for CpuTicket {
    fn wait(&self) -> Result<()> {
        self.queue.wait(self.ticket)
    }
    fn is_done(&self) -> Result<bool> {
        Ok(self.queue.lock().completed >= self.ticket)
    }
}
