//! Staging and scratch: gather steps' index lists and address-pair tables, uploaded through
//! pinned slots into a device area, without blocking the host.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::result;
use cudarc::driver::sys;
use cudarc::driver::DriverError;

use super::checks::CheckArea;
use super::driver::drv;
use crate::error::{Result, TransferError};
use crate::exec::cuda_launch::GatherLaunch;
use crate::plan::GatherStep;

/// Staging slots the ring may grow to before an upload waits for the oldest one: enough for the
/// per-layer steps of the largest models in flight at once (61 layers, K and V, drafts) without a
/// host wait; past that, memory stays bounded.
const MAX_STAGING_SLOTS: usize = 512;

/// One pinned staging buffer and the event recorded after the copy out of it.
struct Slot {
    host: *mut u8,
    cap: usize,
    event: sys::CUevent,
    /// A copy out of `host` was enqueued and may not have run yet.
    pending: bool,
}

/// Device scratch for gather steps (index lists and the address-pair table) and the pinned
/// staging slots they are uploaded through. Reused across steps and calls. Nothing here blocks
/// the host on the issue path: a staging slot is reused only once its upload has left it (asked
/// with `cuEventQuery`), and when every slot is busy the ring grows; a device area that is
/// outgrown is kept, not freed (`cuMemFree` would stall every stream), until the executor is
/// dropped. A step whose index lists are the ones already on the device (the steps of a
/// layer-sharded backup share them) uploads only its table. Later uploads overwrite the device
/// area only in stream order, after the kernels that read it.
#[derive(Default)]
pub(super) struct Scratch {
    dev: sys::CUdeviceptr,
    dev_cap: usize,
    /// Outgrown device areas, still possibly read by queued kernels: freed by `free`.
    retired: Vec<sys::CUdeviceptr>,
    slots: Vec<Slot>,
    next: usize,
    /// The index lists now in `dev`. Holding them keeps their allocations alive, so an equal
    /// pointer always means the same contents. `None` whenever an upload did not complete.
    indices: Option<[Arc<[i64]>; 2]>,
    /// Device words of the checks of CUDA index lists run on this stream.
    pub(super) check: CheckArea,
}

// SAFETY: raw driver handles, used only under the executor's mutex with the context bound.
unsafe impl Send for Scratch {}

impl Scratch {
    /// A staging slot whose previous upload has left it: the next free one round-robin, a new one
    /// when all are busy, and (only past `MAX_STAGING_SLOTS`) the oldest once its upload is done.
    ///
    /// # Safety
    /// The context is bound.
    unsafe fn free_slot(&mut self) -> Result<usize> {
        let n = self.slots.len();
        for k in 0..n {
            let i = (self.next + k) % n;
            let slot = &mut self.slots[i];
            if slot.pending {
                // SAFETY: our event.
                match unsafe { result::event::query(slot.event) } {
                    Ok(()) => slot.pending = false,
                    Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => continue,
                    Err(e) => return Err(drv("cuEventQuery (staging slot)", e)),
                }
            }
            self.next = (i + 1) % n;
            return Ok(i);
        }
        if n < MAX_STAGING_SLOTS {
            let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| drv("cuEventCreate", e))?;
            self.slots.push(Slot { host: std::ptr::null_mut(), cap: 0, event, pending: false });
            self.next = 0;
            return Ok(n);
        }
        let i = self.next;
        log::debug!("cuda: all {n} staging slots busy; waiting for the oldest");
        // SAFETY: our event.
        unsafe { result::event::synchronize(self.slots[i].event) }.map_err(|e| drv("cuEventSynchronize", e))?;
        self.slots[i].pending = false;
        self.next = (i + 1) % n;
        Ok(i)
    }

    /// Uploads what gather step `g` needs; returns the device addresses of the address-pair
    /// table, the source indices and the destination indices (the step's own when its lists are
    /// in device memory: then only the table is uploaded).
    pub(super) fn upload(&mut self, stream: sys::CUstream, g: &GatherStep, launch: &GatherLaunch) -> Result<[sys::CUdeviceptr; 3]> {
        let n = if g.device_lists().is_some() { 0 } else { g.src_indices().len() };
        let index_bytes = n * 8;
        let table_bytes = std::mem::size_of_val(launch.table.as_slice());
        // Device layout: [src indices][dst indices][table], each 256-byte aligned.
        let align = |x: usize| x.next_multiple_of(256);
        let (si_off, di_off, t_off) = (0, align(index_bytes), 2 * align(index_bytes));
        let dev_need = t_off + align(table_bytes);
        let reuse = self.dev_cap >= dev_need
            && self.indices.as_ref().is_some_and(|[s, d]| Arc::ptr_eq(s, &g.src_indices) && Arc::ptr_eq(d, &g.dst_indices));
        // Until this upload is enqueued and recorded, the device area holds nothing reusable.
        self.indices = None;
        let stage_bytes = if reuse { table_bytes } else { t_off + table_bytes };
        // SAFETY: all driver calls on live handles with the context bound by the caller.
        unsafe {
            if self.dev_cap < dev_need {
                // Queued kernels may still read the old area: keep it until `free`.
                let cap = dev_need.next_power_of_two().max(64 << 10);
                let dev = result::malloc_sync(cap).map_err(|e| TransferError::OutOfMemory {
                    what: "cuda gather scratch".into(),
                    requested: cap as u64,
                    limit: format!("cuMemAlloc: {e:?}"),
                })?;
                if self.dev != 0 {
                    self.retired.push(self.dev);
                }
                self.dev = dev;
                self.dev_cap = cap;
            }
            let i = self.free_slot()?;
            let slot = &mut self.slots[i];
            if slot.cap < stage_bytes {
                if !slot.host.is_null() {
                    // Idle (its upload has left it): freeing pinned memory waits for nothing.
                    let _ = result::free_host(slot.host as *mut c_void);
                    slot.host = std::ptr::null_mut();
                    slot.cap = 0;
                }
                let cap = stage_bytes.next_power_of_two().max(4096);
                slot.host = result::malloc_host(cap, 0).map_err(|e| TransferError::OutOfMemory {
                    what: "cuda pinned staging".into(),
                    requested: cap as u64,
                    limit: format!("cuMemHostAlloc: {e:?}"),
                })? as *mut u8;
                slot.cap = cap;
            }
            let table_src = launch.table.as_ptr() as *const u8;
            let dst = if reuse {
                std::ptr::copy_nonoverlapping(table_src, slot.host, table_bytes);
                self.dev + t_off as u64
            } else {
                std::ptr::copy_nonoverlapping(g.src_indices().as_ptr() as *const u8, slot.host.add(si_off), index_bytes);
                std::ptr::copy_nonoverlapping(g.dst_indices().as_ptr() as *const u8, slot.host.add(di_off), index_bytes);
                std::ptr::copy_nonoverlapping(table_src, slot.host.add(t_off), table_bytes);
                self.dev
            };
            let rc = sys::cuMemcpyHtoDAsync_v2(dst, slot.host as *const c_void, stage_bytes, stream);
            if rc != sys::CUresult::CUDA_SUCCESS {
                return Err(super::driver::rc_err("cuMemcpyHtoDAsync (gather tables)", rc));
            }
            slot.pending = true;
            if let Err(e) = result::event::record(slot.event, stream) {
                // Without the event the slot's reuse cannot be ordered: drain the stream.
                let _ = result::stream::synchronize(stream);
                slot.pending = false;
                return Err(drv("cuEventRecord", e));
            }
        }
        if let Some([src, dst]) = g.device_lists() {
            // The device area's index lists are not this step's: nothing to reuse next time.
            return Ok([self.dev + t_off as u64, src, dst]);
        }
        self.indices = Some([g.src_indices.clone(), g.dst_indices.clone()]);
        Ok([self.dev + t_off as u64, self.dev + si_off as u64, self.dev + di_off as u64])
    }

    /// Frees everything (the stream has been synchronized).
    pub(super) fn free(&mut self) {
        // SAFETY: handles allocated by `upload`; nothing queued uses them any more.
        unsafe {
            for dev in self.retired.drain(..).chain((self.dev != 0).then_some(self.dev)) {
                let _ = result::free_sync(dev);
            }
            for slot in &mut self.slots {
                if !slot.host.is_null() {
                    let _ = result::free_host(slot.host as *mut c_void);
                }
                let _ = result::event::destroy(slot.event);
            }
        }
        self.check.free();
        *self = Scratch::default();
    }
}
