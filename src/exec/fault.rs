//! One-shot faults for testing recovery: an armed executor instance fails one of its next steps
//! with an executor error before it runs, or (wgpu) one of its next queued submissions after
//! the call that queued it has returned.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::error::{Result, TransferError};

/// Where an armed fault fires: a step, or a queued submission.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum At {
    Step,
    Submission,
}

/// Armed faults: (executor id, where, how many to let through first). Test support; the flag
/// keeps the cost at one atomic load per step when nothing is armed.
static FAULTS: Mutex<Vec<(u64, At, u64)>> = Mutex::new(Vec::new());
static FAULTS_ARMED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Set while the executor runs its own calibration plans.
    static UNFAULTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Arms a fault on executor `id`: the `after`-th step (or queued submission) from now on fails.
pub(crate) fn arm(id: u64, at: At, after: u64) {
    let mut faults = FAULTS.lock().unwrap_or_else(|e| e.into_inner());
    faults.retain(|(f, a, _)| (*f, *a) != (id, at));
    faults.push((id, at, after));
    FAULTS_ARMED.store(true, Ordering::Release);
}

/// Counts one step or submission of executor `id` against an armed fault; `true` when it fires.
pub(crate) fn fires(id: u64, at: At) -> bool {
    if !FAULTS_ARMED.load(Ordering::Acquire) || UNFAULTED.with(|u| u.get()) {
        return false;
    }
    let mut faults = FAULTS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(pos) = faults.iter().position(|(f, a, _)| (*f, *a) == (id, at)) else { return false };
    if faults[pos].2 > 0 {
        faults[pos].2 -= 1;
        return false;
    }
    faults.remove(pos);
    FAULTS_ARMED.store(!faults.is_empty(), Ordering::Release);
    true
}

/// Counts one step of executor `id` (named `name`) against an armed fault; `Err` when it fires.
pub(super) fn point(id: u64, name: &'static str) -> Result<()> {
    if fires(id, At::Step) {
        return Err(TransferError::Executor { backend: name, message: "injected fault".into() });
    }
    Ok(())
}

/// Runs `f` past any armed fault (the calibration's own runs must not use it up).
pub(super) fn unfaulted<R>(f: impl FnOnce() -> R) -> R {
    UNFAULTED.with(|u| u.set(true));
    let r = f();
    UNFAULTED.with(|u| u.set(false));
    r
}
