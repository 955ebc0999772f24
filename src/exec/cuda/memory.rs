//! Device memory and pinned host memory, owned or borrowed from an engine.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::result;
use cudarc::driver::sys;

use super::{CudaExecutor, Inner};
use crate::error::{Result, TransferError};

/// Device memory, or pinned mapped host memory with its device pointer.
pub struct CudaBuffer {
    pub(super) dev_ptr: sys::CUdeviceptr,
    pub(super) host_ptr: *mut u8,
    pub(super) len: u64,
    pub(super) owned: bool,
    /// Host memory we registered with `cuMemHostRegister` (unregistered on drop).
    pub(super) registered: bool,
    /// Borrowed for one stream-ordered op (`kvcacheio`): the caller keeps the memory alive
    /// until the stream reaches it, as for any op on its stream, so dropping does not wait.
    pub(super) stream_ordered: bool,
    pub(super) exec: Arc<Inner>,
}

// SAFETY: raw device/host pointers; access is serialised by the pools' borrow rules and the
// executor's stream.
unsafe impl Send for CudaBuffer {}
unsafe impl Sync for CudaBuffer {}

impl CudaBuffer {
    /// The host address of pinned mapped host memory; `None` for device memory.
    pub fn host_address(&self) -> Option<u64> {
        (!self.host_ptr.is_null()).then_some(self.host_ptr as u64)
    }

    /// Wraps an engine's device allocation (one layer buffer).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be device memory of `exec`'s context, valid for as long as the buffer
    /// (and any pool holding it) lives, and not written by others while a transfer runs.
    pub unsafe fn from_device_ptr(exec: &CudaExecutor, ptr: sys::CUdeviceptr, len: u64) -> CudaBuffer {
        CudaBuffer {
            dev_ptr: ptr,
            host_ptr: std::ptr::null_mut(),
            len,
            owned: false,
            registered: false,
            stream_ordered: false,
            exec: exec.inner.clone(),
        }
    }

    /// Wraps an engine's host region. With `register`, it is page-locked and mapped here
    /// (`cuMemHostRegister`, undone on drop); otherwise it must already be pinned or registered
    /// with device mapping.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid host memory for as long as the buffer lives, and not
    /// accessed by others while a transfer runs.
    pub unsafe fn from_host_ptr(exec: &CudaExecutor, ptr: *mut u8, len: u64, register: bool) -> Result<CudaBuffer> {
        exec.bind()?;
        unsafe {
            if register {
                let rc = sys::cuMemHostRegister_v2(
                    ptr as *mut c_void,
                    len as usize,
                    sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
                );
                if rc != sys::CUresult::CUDA_SUCCESS {
                    return Err(super::driver::rc_err(format!("cuMemHostRegister({len} bytes)"), rc));
                }
            }
            let mut dev_ptr = 0;
            let rc = sys::cuMemHostGetDevicePointer_v2(&mut dev_ptr, ptr as *mut c_void, 0);
            if rc != sys::CUresult::CUDA_SUCCESS {
                if register {
                    let _ = sys::cuMemHostUnregister(ptr as *mut c_void);
                }
                return Err(TransferError::Executor {
                    backend: "cuda",
                    message: format!("host region is not mapped for the device (register it): {rc:?}"),
                });
            }
            Ok(CudaBuffer {
                dev_ptr,
                host_ptr: ptr,
                len,
                owned: false,
                registered: register,
                stream_ordered: false,
                exec: exec.inner.clone(),
            })
        }
    }

    /// [`CudaBuffer::from_device_ptr`] / [`CudaBuffer::from_host_ptr`] (never registering)
    /// for one stream-ordered `kvcacheio` op: dropping it does not wait for the stream. What the
    /// memory is comes from the driver, not from the caller (a layer table may hold host
    /// addresses, sglang's host pools do): device memory must belong to this executor's context
    /// and hold the whole span within one allocation; host memory must be pinned or registered
    /// for the device. `device_memory` is what the caller believed, for the message.
    ///
    /// # Safety
    /// As for those, and the memory must stay valid until the executor's stream has run every
    /// copy enqueued on it meanwhile.
    pub(crate) unsafe fn stream_ordered(exec: &CudaExecutor, ptr: u64, len: u64, device_memory: bool) -> Result<CudaBuffer> {
        exec.bind()?;
        let claimed = if device_memory { "CUDA device memory" } else { "host memory" };
        let attr = |a: sys::CUpointer_attribute, out: *mut c_void| -> sys::CUresult {
            // SAFETY: a plain query; `out` is large enough for the attribute asked.
            unsafe { sys::cuPointerGetAttribute(out, a, ptr) }
        };
        let mut kind: u32 = 0;
        let known = attr(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, &mut kind as *mut u32 as *mut c_void)
            == sys::CUresult::CUDA_SUCCESS;
        let is_device = known && kind == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
        if !known && device_memory {
            return Err(TransferError::Executor {
                backend: "cuda",
                message: format!("{ptr:#x} (given as {claimed}) is not memory the CUDA driver knows"),
            });
        }
        let mut b = if is_device {
            // cuMemAlloc memory names its context, which must be ours. Memory of the
            // virtual-memory API (PyTorch's expandable segments, memory-saver regions) and of
            // stream-ordered pools (cudaMallocAsync) belongs to no context: the query fails or
            // answers none, and the device ordinal decides.
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            let rc = attr(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_CONTEXT, &mut ctx as *mut _ as *mut c_void);
            if rc == sys::CUresult::CUDA_SUCCESS && !ctx.is_null() {
                if ctx != exec.inner.ctx.cu_ctx() {
                    return Err(TransferError::Executor {
                        backend: "cuda",
                        message: format!("device memory at {ptr:#x} belongs to another CUDA context (another device) than this executor's"),
                    });
                }
            } else {
                let ours = exec.inner.ctx.ordinal() as i32;
                let on = device_ordinal(ptr);
                if on != Some(ours) {
                    return Err(TransferError::Executor {
                        backend: "cuda",
                        message: format!(
                            "device memory at {ptr:#x} (no context: virtual-memory or pool memory) is on device {}, this executor's is {ours}",
                            on.map_or("?".to_string(), |d| d.to_string())
                        ),
                    });
                }
            }
            device_span_mapped(ptr, len, exec.inner.ctx.ordinal() as i32)?;
            unsafe { CudaBuffer::from_device_ptr(exec, ptr, len) }
        } else {
            let b = unsafe { CudaBuffer::from_host_ptr(exec, ptr as *mut u8, len, false)? };
            host_span_mapped(ptr, len, b.dev_ptr)?;
            b
        };
        b.stream_ordered = true;
        Ok(b)
    }

    /// Device address a kernel or copy uses.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.dev_ptr
    }
    /// True for pinned host memory.
    pub fn is_host(&self) -> bool {
        !self.host_ptr.is_null()
    }
}

/// The device the driver says `addr` is memory of.
fn device_ordinal(addr: u64) -> Option<i32> {
    let mut ord: i32 = -1;
    // SAFETY: a plain query into an `i32`.
    let rc = unsafe {
        sys::cuPointerGetAttribute(&mut ord as *mut i32 as *mut c_void, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr)
    };
    (rc == sys::CUresult::CUDA_SUCCESS).then_some(ord)
}

/// Checks that every byte of device span `ptr..ptr + len` is memory of device `ordinal`, walked
/// allocation by allocation: one `cuMemAlloc` or pool allocation, or several mappings of the
/// virtual-memory API side by side in one reservation (an expandable segment grows chunk by
/// chunk, and a tensor may straddle two). A gap (a chunk not mapped, or unmapped since) is
/// refused naming its address, before a kernel would fault on it.
fn device_span_mapped(ptr: u64, len: u64, ordinal: i32) -> Result<()> {
    let end = ptr
        .checked_add(len)
        .ok_or_else(|| TransferError::Executor { backend: "cuda", message: format!("{len} bytes at {ptr:#x} wrap") })?;
    let mut at = ptr;
    loop {
        let (mut start, mut size): (u64, usize) = (0, 0);
        // SAFETY: plain queries; the outputs are large enough for the attributes asked.
        let rc = unsafe {
            [
                sys::cuPointerGetAttribute(
                    &mut start as *mut u64 as *mut c_void,
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                    at,
                ),
                sys::cuPointerGetAttribute(
                    &mut size as *mut usize as *mut c_void,
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                    at,
                ),
            ]
        };
        let next = start.saturating_add(size as u64);
        if rc.iter().any(|rc| *rc != sys::CUresult::CUDA_SUCCESS) || start > at || next <= at || device_ordinal(at) != Some(ordinal) {
            let what = if at == ptr {
                "are not device memory the driver knows".to_string()
            } else {
                format!("extend past their allocation into {at:#x}, which is not mapped device memory of this device (a gap between mappings, or unmapped)")
            };
            return Err(TransferError::Executor { backend: "cuda", message: format!("{len} bytes at {ptr:#x} {what}") });
        }
        if next >= end {
            return Ok(());
        }
        at = next;
    }
}

/// Checks that every byte of host span `ptr..ptr + len`, whose first byte the device reads at
/// `dev_ptr`, is pinned or registered memory mapped at the same offset from `dev_ptr`. Engines
/// register large host pools in chunks (sglang: `cudaHostRegister` per chunk of whole pages), so
/// a span may cover several registrations; a gap between them, or a chunk the device maps
/// elsewhere, would make a copy fault on the GPU (a sticky error that ends the context), so it is
/// refused here, naming the address. Where the driver does not say where a registration ends
/// (no `RANGE_START_ADDR` / `RANGE_SIZE` answer for host memory), the start's mapping is trusted,
/// as before.
fn host_span_mapped(ptr: u64, len: u64, dev_ptr: u64) -> Result<()> {
    let end = ptr.saturating_add(len);
    let mut at = ptr;
    while at < end {
        let (mut start, mut size): (u64, usize) = (0, 0);
        // SAFETY: plain queries; the outputs are large enough for the attributes asked.
        let rc = unsafe {
            [
                sys::cuPointerGetAttribute(
                    &mut start as *mut u64 as *mut c_void,
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                    at,
                ),
                sys::cuPointerGetAttribute(
                    &mut size as *mut usize as *mut c_void,
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                    at,
                ),
            ]
        };
        if rc.iter().any(|rc| *rc != sys::CUresult::CUDA_SUCCESS) {
            if at == ptr {
                return Ok(());
            }
            return Err(TransferError::Executor {
                backend: "cuda",
                message: format!("{len} bytes of host memory at {ptr:#x}: {at:#x} is not pinned or registered for the device"),
            });
        }
        if at != ptr {
            let mut alias = 0;
            // SAFETY: a plain query.
            let rc = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut alias, at as *mut c_void, 0) };
            if rc != sys::CUresult::CUDA_SUCCESS || alias != dev_ptr.wrapping_add(at - ptr) {
                return Err(TransferError::Executor {
                    backend: "cuda",
                    message: format!(
                        "{len} bytes of host memory at {ptr:#x} span registrations the device maps apart (at {at:#x}: {rc:?}); \
                         keep one transfer's buffer in one registration"
                    ),
                });
            }
        }
        let next = start.saturating_add(size as u64);
        if next <= at {
            return Ok(());
        }
        at = next;
    }
    Ok(())
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        if self.stream_ordered {
            return;
        }
        if !self.owned {
            // A queued copy may still use the engine's memory: the engine frees it once the
            // pool is dropped, so wait here first.
            let _ = self.exec.ctx.bind_to_thread();
            let _ = self.exec.sync_all();
            if self.registered {
                // SAFETY: registered by `from_host_ptr`.
                let _ = unsafe { sys::cuMemHostUnregister(self.host_ptr as *mut c_void) };
            }
            return;
        }
        let _ = self.exec.ctx.bind_to_thread();
        // Transfers in flight may still use this memory.
        let _ = self.exec.sync_all();
        // SAFETY: allocated by this executor with the matching call.
        unsafe {
            if self.host_ptr.is_null() {
                let _ = result::free_sync(self.dev_ptr);
            } else {
                let _ = result::free_host(self.host_ptr as *mut c_void);
            }
        }
    }
}
