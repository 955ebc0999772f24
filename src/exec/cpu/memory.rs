//! Host memory: owned buffers (huge pages for large ones on Linux) and borrowed slices.

use std::alloc::Layout as AllocLayout;
use std::ptr::NonNull;
use std::sync::Arc;

use super::{CpuExecutor, CpuQueues};
use crate::error::{Result, TransferError};

/// Alignment of owned cpu buffers (a cache line).
const ALIGN: usize = 64;

/// Host memory, zeroed. Buffers of 2 MiB and more are mapped from the OS on Linux (zero pages
/// on first touch, so a large pool does not touch every page up front) and asked for
/// transparent huge pages: random items of a large pool then cost far fewer TLB misses.
pub struct CpuBuffer {
    ptr: NonNull<u8>,
    pub(super) len: usize,
    /// How owned memory is freed on drop.
    memory: Memory,
    pub(super) owner: u64,
    /// The owning executor's queues: dropping waits for queued transfers that may use the memory.
    queues: Arc<CpuQueues>,
}

// SAFETY: the buffer is plain memory; concurrent writes are ruled out by the pools' `&mut`
// access to destination pools (shared pools: claims on the bytes a call touches) and the
// planner's unique-destination check.
unsafe impl Send for CpuBuffer {}
unsafe impl Sync for CpuBuffer {}

/// Where a buffer's memory came from.
enum Memory {
    /// The caller's.
    Borrowed,
    /// `alloc_zeroed` with this layout.
    Heap(AllocLayout),
    /// An anonymous mapping of this many bytes.
    #[cfg(target_os = "linux")]
    Mapped(usize),
}

impl Drop for CpuBuffer {
    fn drop(&mut self) {
        self.queues.idle();
        match self.memory {
            Memory::Borrowed => {}
            // SAFETY: allocated by `alloc_zeroed` with this layout in `CpuExecutor::alloc`.
            Memory::Heap(layout) => unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) },
            // SAFETY: mapped by `map_huge` with this length; nothing uses it any more.
            #[cfg(target_os = "linux")]
            Memory::Mapped(len) => unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), len);
            },
        }
    }
}

/// Bytes from which owned buffers are mapped on huge pages (one huge page).
#[cfg(target_os = "linux")]
const HUGE_PAGE: usize = 2 << 20;

/// A zeroed anonymous mapping of at least `len` bytes aligned to a huge page, with
/// `MADV_HUGEPAGE` (a hint: without transparent huge pages it is plain memory). `None` when
/// the OS refuses the mapping. Returns the address and the mapped length.
#[cfg(target_os = "linux")]
fn map_huge(len: usize) -> Option<(NonNull<u8>, usize)> {
    let mapped = len.checked_next_multiple_of(HUGE_PAGE)?;
    let total = mapped.checked_add(HUGE_PAGE)?;
    // SAFETY: a fresh private anonymous mapping; the unaligned head and tail are unmapped
    // again, so exactly `start..start + mapped` stays mapped and owned by the buffer.
    unsafe {
        let p = libc::mmap(std::ptr::null_mut(), total, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
        if p == libc::MAP_FAILED {
            return None;
        }
        let base = p as usize;
        let start = base.next_multiple_of(HUGE_PAGE);
        if start > base {
            libc::munmap(p, start - base);
        }
        let tail = base + total - (start + mapped);
        if tail > 0 {
            libc::munmap((start + mapped) as *mut libc::c_void, tail);
        }
        libc::madvise(start as *mut libc::c_void, mapped, libc::MADV_HUGEPAGE);
        Some((NonNull::new(start as *mut u8)?, mapped))
    }
}

impl CpuBuffer {
    /// `bytes` of zeroed host memory owned by executor `owner` (whose `queues` a drop waits for).
    pub(super) fn alloc(bytes: u64, owner: u64, queues: Arc<CpuQueues>) -> Result<CpuBuffer> {
        let oom = |limit: String| TransferError::OutOfMemory { what: "cpu buffer".into(), requested: bytes, limit };
        let len = usize::try_from(bytes).map_err(|_| oom("exceeds the address space".into()))?;
        #[cfg(target_os = "linux")]
        if len >= HUGE_PAGE {
            let (ptr, mapped) = map_huge(len).ok_or_else(|| oom("mmap refused it".into()))?;
            return Ok(CpuBuffer { ptr, len, memory: Memory::Mapped(mapped), owner, queues });
        }
        let layout = AllocLayout::from_size_align(len.max(1), ALIGN).map_err(|_| oom("exceeds the address space".into()))?;
        // SAFETY: the layout has a non-zero size. A null return is a refused allocation, reported
        // as an error rather than aborting the process.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| oom("the allocator refused it".into()))?;
        Ok(CpuBuffer { ptr, len, memory: Memory::Heap(layout), owner, queues })
    }
    /// Wraps caller memory for executor `owner`.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes for as long as the buffer (and any
    /// pool holding it) lives, and must not be accessed by anything else during a transfer.
    pub(crate) unsafe fn from_raw(ptr: NonNull<u8>, len: usize, exec: &CpuExecutor) -> CpuBuffer {
        CpuBuffer { ptr, len, memory: Memory::Borrowed, owner: exec.id, queues: exec.queues.clone() }
    }

    /// Start of the memory.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True for a 0-byte buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
