//! sglang's tables of layer addresses in device memory (`make_kernel_ptr_table`), read once.
//!
//! An engine builds these tables when it makes its pools and passes the same tables to every
//! all-layer copy. Reading one on the host waits for the stream, so each table is read at its
//! first use only, and remembered by (address, length) with a device copy of its entries: every
//! later call's device checks compare the caller's table with that copy before the copies run
//! (check 3 of `hicache_check_indices`), so a table rewritten in place moves nothing and is
//! reported like a failed index check. [`CudaExecutor::forget_layer_tables`] drops what was
//! remembered (after rewriting a table on purpose).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result, sys};

use super::CudaExecutor;
use crate::error::{Result, TransferError};
use crate::exec::caller::{LayerTable, Memory};
use crate::plan::TableGuard;

/// Tables an executor remembers: at most this many (an engine has a handful per pool).
const MAX_TABLES: usize = 4096;

struct Remembered {
    entries: Vec<u64>,
    ranges: Vec<Option<(u64, u64)>>,
    /// Device copy of `entries`.
    expected: sys::CUdeviceptr,
}

/// The tables one executor remembers.
#[derive(Default)]
pub(super) struct Tables {
    map: HashMap<(u64, usize), Arc<Remembered>>,
    /// Copies of forgotten tables, freed once the streams are drained.
    retired: Vec<sys::CUdeviceptr>,
}

// SAFETY: device pointers, used only under the executor's mutex with the context bound.
unsafe impl Send for Tables {}

impl Tables {
    /// Frees every copy (the streams have been synchronized).
    pub(super) fn free(&mut self) {
        for p in self.retired.drain(..).chain(self.map.drain().map(|(_, r)| r.expected)) {
            // SAFETY: our allocations; nothing queued reads them any more.
            let _ = unsafe { result::free_sync(p) };
        }
    }
}

/// The range (start, end) the driver says `addr` lies in, where it says one.
fn range_of(addr: u64) -> Option<(u64, u64)> {
    let (mut start, mut size): (u64, usize) = (0, 0);
    // SAFETY: plain queries; the outputs are large enough for the attributes asked.
    let rc = unsafe {
        [
            sys::cuPointerGetAttribute(
                &mut start as *mut u64 as *mut c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                addr,
            ),
            sys::cuPointerGetAttribute(
                &mut size as *mut usize as *mut c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                addr,
            ),
        ]
    };
    let end = start.checked_add(size as u64)?;
    (rc.iter().all(|rc| *rc == sys::CUresult::CUDA_SUCCESS) && start <= addr && addr < end).then_some((start, end))
}

/// Whether the driver names a context for `addr` (cuMemAlloc memory does; memory of the
/// virtual-memory API and of stream-ordered pools does not).
fn has_context(addr: u64) -> bool {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: a plain query into a pointer-sized output.
    let rc = unsafe {
        sys::cuPointerGetAttribute(&mut ctx as *mut _ as *mut c_void, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_CONTEXT, addr)
    };
    rc == sys::CUresult::CUDA_SUCCESS && !ctx.is_null()
}

/// The allocation (start, bytes) `addr` lies in, where the driver says one. Mappings of the
/// virtual-memory API that follow each other (an expandable segment's chunks) count as one, so
/// a layer that straddles two chunks keeps its extent; `cuMemAlloc` allocations never merge.
fn allocation_of(addr: u64) -> Option<(u64, u64)> {
    let (start, mut end) = range_of(addr)?;
    if !has_context(addr) {
        // At most 4096 chunks (8 GiB of 2 MiB mappings) per walk.
        for _ in 0..4096 {
            match range_of(end) {
                Some((s, e)) if s == end && !has_context(end) => end = e,
                _ => break,
            }
        }
    }
    Some((start, end - start))
}

impl CudaExecutor {
    /// sglang's table of `len` layer addresses at device address `table` (u64 entries), as the
    /// all-layer ops take it: read on the executor's stream at its first use (which waits for
    /// the stream, once per table) and remembered, with the allocation the driver says each
    /// entry lies in (the layers' extents) and a device copy of the entries that every later
    /// call's device checks compare with the caller's table.
    ///
    /// # Safety
    /// `table..table + 8 * len` is device memory of this executor's context holding the
    /// addresses of the caller's layers, which stay valid while calls use them.
    pub unsafe fn layer_table(&self, table: u64, len: usize) -> Result<LayerTable> {
        let key = (table, len);
        let known = self.inner.tables.lock().unwrap_or_else(|e| e.into_inner()).map.get(&key).cloned();
        let r = match known {
            Some(r) => r,
            None => {
                let bytes = len.checked_mul(8).ok_or_else(|| TransferError::BadArgument {
                    arg: "table",
                    value: len as i64,
                    message: "table length overflows".into(),
                })?;
                // SAFETY: the caller's contract.
                let raw = unsafe { self.read_device(table, bytes as u64)? };
                let entries: Vec<u64> = raw.chunks_exact(8).map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes"))).collect();
                let ranges = entries.iter().map(|&e| allocation_of(e)).collect();
                let expected = if bytes == 0 {
                    0
                } else {
                    // SAFETY: a plain allocation and a copy from our own host vector on the
                    // executor's stream, waited for before the vector can go (a copy from pageable
                    // memory may still be in flight when the call returns); the context is bound
                    // (read_device bound it).
                    unsafe {
                        let p = result::malloc_sync(bytes).map_err(|e| TransferError::OutOfMemory {
                            what: "cuda layer-table copy".into(),
                            requested: bytes as u64,
                            limit: format!("cuMemAlloc: {e:?}"),
                        })?;
                        let rc = sys::cuMemcpyHtoDAsync_v2(p, entries.as_ptr() as *const c_void, bytes, self.cu_stream());
                        let done = if rc == sys::CUresult::CUDA_SUCCESS {
                            self.inner.stream.synchronize().map_err(|e| format!("{e:?}"))
                        } else {
                            Err(format!("{rc:?}"))
                        };
                        if let Err(e) = done {
                            let _ = self.inner.stream.synchronize();
                            let _ = result::free_sync(p);
                            return Err(TransferError::Executor {
                                backend: "cuda",
                                message: format!("cuMemcpyHtoDAsync (layer-table copy): {e}"),
                            });
                        }
                        p
                    }
                };
                let r = Arc::new(Remembered { entries, ranges, expected });
                let mut t = self.inner.tables.lock().unwrap_or_else(|e| e.into_inner());
                if t.map.len() >= MAX_TABLES {
                    t.retired.push(r.expected);
                    return Err(TransferError::BadArgument {
                        arg: "table",
                        value: t.map.len() as i64,
                        message: format!("this executor remembers {MAX_TABLES} layer tables already; call forget_layer_tables()"),
                    });
                }
                match t.map.get(&key).cloned() {
                    // Another thread read it meanwhile: keep theirs.
                    Some(theirs) => {
                        t.retired.push(r.expected);
                        theirs
                    }
                    None => {
                        t.map.insert(key, r.clone());
                        r
                    }
                }
            }
        };
        let guard = TableGuard { table, expected: r.expected, len: len as u64 };
        // SAFETY: the caller's contract.
        Ok(unsafe { LayerTable::new(r.entries.clone(), r.ranges.clone(), Some(guard), Memory::CudaDevice) })
    }

    /// Forgets the remembered table of `len` entries at `table`, if any (its next use reads it
    /// again): for a caller that knows the table at that address is another one now.
    pub fn forget_layer_table(&self, table: u64, len: usize) {
        let mut t = self.inner.tables.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = t.map.remove(&(table, len)) {
            t.retired.push(r.expected);
        }
    }

    /// Forgets every remembered layer table: the next use of each reads it again. For a caller
    /// that rewrote a table in place, or freed one and made another at the same address.
    pub fn forget_layer_tables(&self) -> Result<()> {
        self.bind()?;
        let mut t = self.inner.tables.lock().unwrap_or_else(|e| e.into_inner());
        let old: Vec<_> = t.map.drain().map(|(_, r)| r.expected).collect();
        t.retired.extend(old);
        Ok(())
    }
}
