//! One-shot faults for testing recovery: an armed executor instance fails one of its next steps
//! with an executor error before it runs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::error::{Result, TransferError};

/// Armed faults: (executor id, steps to let through first). Test support; the flag keeps the
/// cost at one atomic load per step when nothing is armed.
static FAULTS: Mutex<Vec<(u64, u64)>> = Mutex::new(Vec::new());
static FAULTS_ARMED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Set while the executor runs its own calibration plans.
    static UNFAULTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Arms a fault on executor `id`: the `after_steps`-th step it executes from now on fails.
pub(super) fn arm(id: u64, after_steps: u64) {
    let mut faults = FAULTS.lock().unwrap_or_else(|e| e.into_inner());
    faults.retain(|(f, _)| *f != id);
    faults.push((id, after_steps));
    FAULTS_ARMED.store(true, Ordering::Release);
}

/// Counts one step of executor `id` (named `name`) against an armed fault; `Err` when it fires.
pub(super) fn point(id: u64, name: &'static str) -> Result<()> {
    if !FAULTS_ARMED.load(Ordering::Acquire) || UNFAULTED.with(|u| u.get()) {
        return Ok(());
    }
    let mut faults = FAULTS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(pos) = faults.iter().position(|(f, _)| *f == id) else { return Ok(()) };
    if faults[pos].1 > 0 {
        faults[pos].1 -= 1;
        return Ok(());
    }
    faults.remove(pos);
    FAULTS_ARMED.store(!faults.is_empty(), Ordering::Release);
    Err(TransferError::Executor { backend: name, message: "injected fault".into() })
}

/// Runs `f` past any armed fault (the calibration's own runs must not use it up).
pub(super) fn unfaulted<R>(f: impl FnOnce() -> R) -> R {
    UNFAULTED.with(|u| u.set(true));
    let r = f();
    UNFAULTED.with(|u| u.set(false));
    r
}
