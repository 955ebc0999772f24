//! Checked allocation and sizes.

use crate::error::{Result, TransferError};
use crate::exec::{Buffer, Device};

/// A zeroed byte vector, or `OutOfMemory` (never an abort).
pub(super) fn alloc_bytes(what: &str, bytes: u64) -> Result<Vec<u8>> {
    let oom = || TransferError::OutOfMemory { what: what.into(), requested: bytes, limit: "the allocator refused it".into() };
    let n = usize::try_from(bytes).map_err(|_| oom())?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| oom())?;
    v.resize(n, 0);
    Ok(v)
}

pub(super) fn exact_size(what: &str, expected: u64, data: &[u8]) -> Result<()> {
    if data.len() as u64 != expected {
        return Err(TransferError::BufferSize { what: what.into(), expected, actual: data.len() as u64 });
    }
    Ok(())
}

/// Wrapped buffers: the right count, each at least `bytes` long, and of `device`'s executor
/// instance (also for the ops' sides over caller memory, `kvcacheio`).
pub(crate) fn check_wrapped(device: &Device, buffers: &[Vec<Buffer>], outer: usize, inner: usize, bytes: u64, what: &str) -> Result<()> {
    if buffers.len() != outer || buffers.iter().any(|c| c.len() != inner) {
        return Err(TransferError::InvalidConfig(format!(
            "{what}s: expected {outer} × {inner}, got {:?}",
            buffers.iter().map(|c| c.len()).collect::<Vec<_>>()
        )));
    }
    for (i, c) in buffers.iter().enumerate() {
        for (j, b) in c.iter().enumerate() {
            device.check_buffer(b)?;
            let len = device.buffer_len(b)?;
            if len < bytes {
                return Err(TransferError::BufferSize { what: format!("{what} [{i}][{j}]"), expected: bytes, actual: len });
            }
        }
    }
    Ok(())
}
