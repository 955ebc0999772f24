//! Index lists in CUDA memory, checked on the device: the check kernel's three launches before a
//! call's gathers (which copy nothing unless the checks passed) into the call's own status slot,
//! and the reports read back without blocking the host, turned into the planner's errors at the
//! next synchronizing call or the next op.

use std::collections::VecDeque;
use std::ffi::c_void;

use cudarc::driver::result;
use cudarc::driver::sys;
use cudarc::driver::DriverError;

use super::driver::drv;
use crate::error::{Result, TransferError};
use crate::exec::cuda_launch::CheckArgs;
use crate::plan::DeviceIndexCheck;

/// Threads per block of the check kernel, and the most blocks it runs (a grid-stride loop).
const CHECK_THREADS: u32 = 256;
const CHECK_MAX_BLOCKS: u32 = 1024;

/// A stream's claim words for the uniqueness check, one per destination slot (all ones when
/// free; every call releases its claims, so the words are set once, when the area grows). The
/// checks of one call are enqueued together under the stream's scratch lock, so calls on one
/// stream never interleave their phases. Grown, never freed on the issue path: an outgrown area
/// is kept until the executor drops.
#[derive(Default)]
pub(super) struct CheckArea {
    owner: sys::CUdeviceptr,
    owner_len: u64,
    retired: Vec<sys::CUdeviceptr>,
}

// SAFETY: device pointers, used only under the executor's mutex with the context bound.
unsafe impl Send for CheckArea {}

fn oom(what: &str, bytes: u64, e: DriverError) -> TransferError {
    TransferError::OutOfMemory { what: what.into(), requested: bytes, limit: format!("cuMemAlloc: {e:?}") }
}

fn failed(what: &str, rc: sys::CUresult) -> TransferError {
    super::driver::rc_err(what, rc)
}

impl CheckArea {
    /// Enqueues the checks of `c` on `stream` into the call's own status slot `status` (reset,
    /// then phases 0, 1 and 2 of `hicache_check_indices`, then phase 3 for each layer table).
    ///
    /// # Safety
    /// The context is bound, `stream` is live, `f` is `hicache_check_indices`, `status` is a
    /// 32-byte status slot no other queued call uses, and `c`'s lists are `c.lists.len` `i64`s of
    /// device memory of this context that outlive the stream's work.
    pub(super) unsafe fn enqueue(&mut self, stream: sys::CUstream, f: sys::CUfunction, c: &DeviceIndexCheck, status: u64) -> Result<()> {
        // SAFETY: driver calls on live handles, the context bound (the caller's contract).
        unsafe {
            let need = if c.dst_is_host { c.host_bound } else { c.device_bound };
            if self.owner_len < need {
                let len = need.checked_next_power_of_two().unwrap_or(need).max(4096);
                let bytes = len
                    .checked_mul(4)
                    .ok_or_else(|| oom("cuda index-check claims", u64::MAX, DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)))?;
                let owner = result::malloc_sync(bytes as usize).map_err(|e| oom("cuda index-check claims", bytes, e))?;
                let rc = sys::cuMemsetD32Async(owner, u32::MAX, len as usize, stream);
                if rc != sys::CUresult::CUDA_SUCCESS {
                    let _ = result::free_sync(owner);
                    return Err(failed("cuMemsetD32Async (index-check claims)", rc));
                }
                // Queued checks may still use the old area: keep it until `free`.
                if self.owner != 0 {
                    self.retired.push(self.owner);
                }
                self.owner = owner;
                self.owner_len = len;
            }
            result::memset_d8_async(status, 0xFF, 32, stream).map_err(|e| drv("cuMemsetD8Async (index-check status)", e))?;
            let blocks = (c.lists.len as u64).div_ceil(CHECK_THREADS as u64).clamp(1, CHECK_MAX_BLOCKS as u64) as u32;
            for phase in 0..3i32 {
                let mut args = CheckArgs::new(c, self.owner, status, phase);
                let mut params = args.params();
                if let Err(e) = result::launch_kernel(f, (blocks, 1, 1), (CHECK_THREADS, 1, 1), 0, stream, &mut params) {
                    // Claims of an earlier phase would stay set and fail every later call on
                    // this stream as a duplicate: free them all (best effort; the stream has
                    // probably failed too).
                    if phase > 0 {
                        let _ = sys::cuMemsetD32Async(self.owner, u32::MAX, self.owner_len as usize, stream);
                    }
                    return Err(drv("cuLaunchKernel (hicache_check_indices)", e));
                }
            }
            for (first, g) in c.tables.iter() {
                let mut args = CheckArgs::table(g, first, status);
                let mut params = args.params();
                let blocks = g.len.div_ceil(CHECK_THREADS as u64).clamp(1, CHECK_MAX_BLOCKS as u64) as u32;
                result::launch_kernel(f, (blocks, 1, 1), (CHECK_THREADS, 1, 1), 0, stream, &mut params)
                    .map_err(|e| drv("cuLaunchKernel (hicache_check_indices, layer tables)", e))?;
            }
            Ok(())
        }
    }

    /// Frees everything (the stream has been synchronized).
    pub(super) fn free(&mut self) {
        // SAFETY: allocated by `enqueue`; nothing queued uses them any more.
        unsafe {
            for p in self.retired.drain(..).chain(Some(self.owner).filter(|p| *p != 0)) {
                let _ = result::free_sync(p);
            }
        }
        *self = CheckArea::default();
    }
}

/// Status slots per page (32 bytes each, in device memory, with a pinned report of the same size).
const SLOTS_PER_PAGE: usize = 128;

/// One call's status (`[key, index, first, _]` in device memory; `key` all ones when every
/// check passed) and the pinned report it is copied into after the call's gathers.
#[derive(Clone, Copy)]
pub(super) struct Slot {
    /// Device address of the status.
    pub(super) status: sys::CUdeviceptr,
    report: *mut u64,
}

/// A call's report in flight, and the event after its copy.
struct Pending {
    slot: Slot,
    event: sys::CUevent,
    check: DeviceIndexCheck,
}

/// The status slots of device-checked calls and their reports not yet looked at, oldest first.
/// A slot is the call's own (another thread's call on the same stream cannot reset it between
/// the call's steps); it is reused only after its report has been read, which proves every
/// gather that tested it has run.
#[derive(Default)]
pub(super) struct Reports {
    dev_pages: Vec<sys::CUdeviceptr>,
    host_pages: Vec<*mut u8>,
    free: Vec<Slot>,
    pending: VecDeque<Pending>,
}

// SAFETY: device and pinned host pointers and events, used only under the executor's mutex.
unsafe impl Send for Reports {}

impl Reports {
    /// A free status slot (a new page of them when none is free).
    ///
    /// # Safety
    /// The context is bound.
    pub(super) unsafe fn slot(&mut self) -> Result<Slot> {
        if self.free.is_empty() {
            let bytes = SLOTS_PER_PAGE * 32;
            // SAFETY: plain allocations with the context bound; freed by `free`.
            let dev = unsafe { result::malloc_sync(bytes) }.map_err(|e| oom("cuda index-check status", bytes as u64, e))?;
            let host = match unsafe { result::malloc_host(bytes, 0) } {
                Ok(p) => p as *mut u8,
                Err(e) => {
                    // SAFETY: allocated just above, never used.
                    let _ = unsafe { result::free_sync(dev) };
                    return Err(TransferError::OutOfMemory {
                        what: "cuda index-check reports".into(),
                        requested: bytes as u64,
                        limit: format!("cuMemHostAlloc: {e:?}"),
                    });
                }
            };
            self.dev_pages.push(dev);
            self.host_pages.push(host);
            // SAFETY: offsets inside the page just allocated.
            self.free.extend(
                (0..SLOTS_PER_PAGE).map(|i| Slot { status: dev + (i * 32) as u64, report: unsafe { host.add(i * 32) } as *mut u64 }),
            );
        }
        Ok(self.free.pop().expect("a free slot"))
    }

    /// Enqueues the copy of `slot`'s status into its pinned report, after everything on
    /// `stream` so far (the call's gathers), and remembers it. On failure the slot is not
    /// reused (queued work may still use it).
    ///
    /// # Safety
    /// The context is bound and `stream` is live; `slot` came from [`Reports::slot`] and its
    /// checks were enqueued on `stream`.
    pub(super) unsafe fn enqueue(&mut self, stream: sys::CUstream, slot: Slot, check: DeviceIndexCheck) -> Result<()> {
        // SAFETY: driver calls on live handles with the context bound; the pinned pages live
        // until `free`, which runs after the streams are drained.
        unsafe {
            let rc = sys::cuMemcpyDtoHAsync_v2(slot.report as *mut c_void, slot.status, 32, stream);
            if rc != sys::CUresult::CUDA_SUCCESS {
                return Err(failed("cuMemcpyDtoHAsync (index-check report)", rc));
            }
            let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| drv("cuEventCreate (index-check report)", e))?;
            if let Err(e) = result::event::record(event, stream) {
                let _ = result::event::destroy(event);
                return Err(drv("cuEventRecord (index-check report)", e));
            }
            self.pending.push_back(Pending { slot, event, check });
        }
        Ok(())
    }

    /// Reads the reports that have arrived (all of them, waiting, with `wait`), oldest first,
    /// and returns the first failed check as the planner's error (later failures are logged).
    ///
    /// # Safety
    /// The context is bound.
    pub(super) unsafe fn collect(&mut self, wait: bool) -> Result<()> {
        let mut first: Option<TransferError> = None;
        while let Some(p) = self.pending.front() {
            // SAFETY: our event.
            let done = unsafe {
                if wait {
                    result::event::synchronize(p.event)
                } else {
                    result::event::query(p.event)
                }
            };
            match done {
                Ok(()) => {}
                Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => break,
                Err(e) => return Err(first.unwrap_or_else(|| drv("cuEventQuery (index-check report)", e))),
            }
            let p = self.pending.pop_front().expect("front");
            // SAFETY: the copy into the report has completed (its event has).
            let [key, index, at_first] = unsafe { [0, 1, 2].map(|i| p.slot.report.add(i).read_volatile()) };
            // SAFETY: our event, no longer waited on.
            let _ = unsafe { result::event::destroy(p.event) };
            self.free.push(p.slot);
            if key != u64::MAX {
                let e = p.check.error(key >> 56, key & ((1 << 56) - 1), index as i64, at_first);
                match &first {
                    None => first = Some(e),
                    Some(_) => log::error!("cuda: {e}"),
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Frees everything (the streams have been synchronized).
    pub(super) fn free(&mut self) {
        // SAFETY: our events and pages; nothing queued uses them any more.
        unsafe {
            for p in self.pending.drain(..) {
                let _ = result::event::destroy(p.event);
            }
            for page in self.host_pages.drain(..) {
                let _ = result::free_host(page as *mut c_void);
            }
            for page in self.dev_pages.drain(..) {
                let _ = result::free_sync(page);
            }
        }
        self.free.clear();
    }
}
