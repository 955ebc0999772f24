//! What every executor reads of the host machine and of the process: the memory that could
//! ever back a pool, and fresh executor identities.

use std::sync::atomic::{AtomicU64, Ordering};

/// A fresh identity for an executor instance: pools, buffers and plans carry it, and objects of
/// two instances never meet in one call.
pub(crate) fn next_executor_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Physical memory plus swap, from `/proc/meminfo` (no bound where it cannot be read): a pool
/// larger than this can never be backed, so it is refused before anything is allocated.
pub(crate) fn host_memory_bytes() -> u64 {
    static MEM: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *MEM.get_or_init(|| {
        let Ok(text) = std::fs::read_to_string("/proc/meminfo") else { return isize::MAX as u64 };
        let field = |name: &str| -> Option<u64> {
            let line = text.lines().find(|l| l.starts_with(name))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kib| kib.saturating_mul(1024))
        };
        match (field("MemTotal:"), field("SwapTotal:")) {
            (Some(m), s) => m.saturating_add(s.unwrap_or(0)),
            _ => isize::MAX as u64,
        }
    })
}
