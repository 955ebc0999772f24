//! Item checksums on cuda: the summing gathers write one sum per (index pair, address pair) into
//! device memory, a copy brings them into pinned memory, and the host settles them — records a
//! backup's, verifies a load's against the host pool's table — once the event after that copy
//! has completed, at the next call that looks (any wait, poll or synchronize of this executor,
//! and every issue of a transfer). Nothing on the issue path waits for the device, and no host
//! function sits in the streams (it would stall the engine's layer pipeline behind the host).
//!
//! Settling follows issue order. Entries are queued under the lock that orders their stream's
//! work (the stream's scratch), so one stream's entries are in device order; work on the other
//! stream that depends on them was ordered after them on the device (an event wait issued later,
//! so queued later). Completion is read newest first, then settled oldest first: a newer entry
//! seen complete implies every entry it depends on is seen complete too, and a backup's record
//! always lands before a dependent load's verification.
//!
//! `direct` copies (DMA) cannot sum: their items settle as unknown in the same order (a backup
//! forgets their checksums, a load counts them unverified). A stream that failed settles its
//! entries as unknown too, never as zeroed sums.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::result;
use cudarc::driver::sys;
use cudarc::driver::DriverError;

use super::driver::drv;
use crate::error::{Result, TransferError};
use crate::exec::settle::Settle;
use crate::exec::ChecksumBinding;
use crate::integrity::{ItemMismatch, MismatchSink};
use crate::plan::ChecksumMode;

/// One step's sums: device memory the kernel adds into and the pinned memory they are copied to.
pub(super) struct SumsBuf {
    pub(super) dev: sys::CUdeviceptr,
    host: *mut u64,
    /// Bytes of each.
    cap: usize,
}

/// What an entry settles, and for a summing gather the buffer its sums arrive in (entry
/// `i · pairs + l` is index pair `i`'s item of address pair `l`).
struct What {
    settle: Settle,
    buf: Option<SumsBuf>,
}

struct Entry {
    /// Recorded after the step's work; null when it could not be (or the sums could not be
    /// copied back): the entry then settles as unknown once every older entry has settled.
    event: sys::CUevent,
    what: What,
    mode: ChecksumMode,
    binding: ChecksumBinding,
    /// A plain (synchronous) call's entry: it returned before its sums arrived, so its
    /// mismatches are reported by the executor's next `synchronize`.
    orphan: bool,
}

#[derive(Default)]
struct State {
    pending: VecDeque<Entry>,
    free: Vec<SumsBuf>,
    /// Buffers of entries that could not be queued (work that may still use them was enqueued):
    /// freed only when the executor drops.
    retired: Vec<SumsBuf>,
    /// Mismatches of plain calls, for the next `synchronize`.
    unreported: Vec<ItemMismatch>,
}

/// The executor's queue of sums to settle.
#[derive(Default)]
pub(crate) struct SumsQueue {
    state: Mutex<State>,
}

// SAFETY: device and pinned host pointers and events, used only under the mutex with the
// context bound.
unsafe impl Send for SumsQueue {}
unsafe impl Sync for SumsQueue {}

fn oom(what: &str, bytes: usize, e: DriverError) -> TransferError {
    TransferError::OutOfMemory { what: what.into(), requested: bytes as u64, limit: format!("{e:?}") }
}

impl SumsQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A sums buffer of at least `bytes` bytes: one whose entry has settled, or a new one.
    ///
    /// # Safety
    /// The context is bound.
    pub(super) unsafe fn buffer(&self, bytes: usize) -> Result<SumsBuf> {
        let bytes = bytes.max(8);
        {
            let mut st = self.lock();
            if let Some(i) = st.free.iter().position(|b| b.cap >= bytes) {
                return Ok(st.free.swap_remove(i));
            }
        }
        let cap = bytes.checked_next_power_of_two().unwrap_or(bytes).max(4096);
        // SAFETY: plain allocations with the context bound; freed by `free` (or on failure here).
        unsafe {
            let dev = result::malloc_sync(cap).map_err(|e| oom("cuda checksum sums", cap, e))?;
            match result::malloc_host(cap, 0) {
                Ok(host) => Ok(SumsBuf { dev, host: host as *mut u64, cap }),
                Err(e) => {
                    let _ = result::free_sync(dev);
                    Err(oom("cuda checksum sums (pinned)", cap, e))
                }
            }
        }
    }

    /// Gives back a buffer whose work was never enqueued.
    pub(super) fn unused(&self, buf: SumsBuf) {
        self.lock().free.push(buf);
    }

    /// Keeps a buffer that enqueued work may still use until the executor drops.
    pub(super) fn retire(&self, buf: SumsBuf) {
        self.lock().retired.push(buf);
    }

    /// After the summing gather on `stream` that adds into `buf` (`entries` sums): copies them
    /// into the pinned half and queues their settling. The caller holds the lock that orders
    /// `stream`'s work. `orphan`: a plain call's (see [`SumsQueue::take_unreported`]).
    ///
    /// # Safety
    /// The context is bound, `stream` is live and the kernel was enqueued on it.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn push_sums(
        &self,
        stream: sys::CUstream,
        buf: SumsBuf,
        entries: usize,
        g: &crate::plan::GatherStep,
        mode: ChecksumMode,
        binding: &ChecksumBinding,
        orphan: bool,
    ) -> Result<()> {
        // SAFETY: the pinned half holds `cap >= entries · 8` bytes and lives until `free`.
        let rc = unsafe { sys::cuMemcpyDtoHAsync_v2(buf.host as *mut c_void, buf.dev, entries * 8, stream) };
        let what = What {
            settle: Settle::Sums { src: g.src_indices.clone(), dst: g.dst_indices.clone(), items: g.items.clone() },
            buf: Some(buf),
        };
        if rc != sys::CUresult::CUDA_SUCCESS {
            // The kernel may have written the items: they settle as unknown, in order (the
            // buffer is kept until the executor drops).
            self.push_failed(what, mode, binding, orphan);
            return Err(super::driver::rc_err("cuMemcpyDtoHAsync (checksums)", rc));
        }
        // SAFETY: as the caller vouches.
        unsafe { self.push(stream, what, mode, binding, orphan) }
    }

    /// After `direct` runs on `stream`: queues their items' settling as unknown.
    ///
    /// # Safety
    /// As [`SumsQueue::push_sums`].
    pub(super) unsafe fn push_unknown(
        &self,
        stream: sys::CUstream,
        runs: &crate::plan::CopyStep,
        mode: ChecksumMode,
        binding: &ChecksumBinding,
        orphan: bool,
    ) -> Result<()> {
        // SAFETY: as the caller vouches.
        unsafe { self.push(stream, What { settle: Settle::Unknown(runs.clone(), 0..runs.len()), buf: None }, mode, binding, orphan) }
    }

    /// Queues an entry settled when its event has completed.
    ///
    /// Queue order is the order entries are pushed: one stream's entries are pushed under its
    /// scratch lock, so in device order; an entry on the other stream that depends on one of them
    /// (a pipeline's load ordered after its backup) was issued after it by the same thread. Two
    /// threads cannot race a backup and a load of one host pool: a backup borrows the host pool
    /// exclusively.
    unsafe fn push(&self, stream: sys::CUstream, what: What, mode: ChecksumMode, binding: &ChecksumBinding, orphan: bool) -> Result<()> {
        let event = match result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            // SAFETY: a live event and stream of the bound context.
            .and_then(|ev| {
                unsafe { result::event::record(ev, stream) }.map(|_| ev).inspect_err(|_| {
                    let _ = unsafe { result::event::destroy(ev) };
                })
            }) {
            Ok(ev) => ev,
            Err(e) => {
                // Without an event nothing tells when the sums arrive: their items settle as
                // unknown, once everything queued before them has settled.
                self.push_failed(what, mode, binding, orphan);
                return Err(drv("cuEventRecord (checksums)", e));
            }
        };
        let binding = own_sink(binding, orphan);
        self.lock().pending.push_back(Entry { event, what, mode, binding, orphan });
        Ok(())
    }

    /// Queues an entry whose sums will never be read (no event, or no copy back): its items
    /// settle as unknown when every older entry has settled.
    fn push_failed(&self, what: What, mode: ChecksumMode, binding: &ChecksumBinding, orphan: bool) {
        let binding = own_sink(binding, orphan);
        self.lock().pending.push_back(Entry { event: std::ptr::null_mut(), what, mode, binding, orphan });
    }

    /// Settles every entry whose sums have arrived (`wait`: all of them, waiting for each).
    ///
    /// # Safety
    /// The context is bound.
    pub(super) unsafe fn settle(&self, wait: bool) {
        let mut st = self.lock();
        if st.pending.is_empty() {
            return;
        }
        // Newest first: an entry seen complete implies every entry it depends on is.
        let n = st.pending.len();
        let mut status = vec![None; n];
        for i in (0..n).rev() {
            let ev = st.pending[i].event;
            if ev.is_null() {
                continue;
            }
            // SAFETY: our events.
            let r = unsafe {
                if wait {
                    result::event::synchronize(ev)
                } else {
                    result::event::query(ev)
                }
            };
            status[i] = match r {
                Ok(()) => Some(true),
                Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => None,
                // A failed stream: the sums may never have been written.
                Err(_) => Some(false),
            };
        }
        let mut keep = VecDeque::with_capacity(n);
        let pending = std::mem::take(&mut st.pending);
        for (entry, s) in pending.into_iter().zip(status) {
            // An entry without sums settles (as unknown) only after every older one.
            let s = if entry.event.is_null() { keep.is_empty().then_some(false) } else { s };
            match s {
                None => keep.push_back(entry),
                Some(ok) => st.settle_one(entry, ok),
            }
        }
        st.pending = keep;
    }

    /// The mismatches of plain calls settled since the last time, as one error.
    pub(super) fn take_unreported(&self) -> Option<TransferError> {
        crate::integrity::mismatch_error(std::mem::take(&mut self.lock().unreported))
    }

    /// Frees everything (the streams have been synchronized; the context is bound).
    pub(super) fn free(&self) {
        let st = &mut *self.lock();
        if let Some(e) = crate::integrity::mismatch_error(std::mem::take(&mut st.unreported)) {
            log::error!("cuda: dropped with unreported checksum mismatches of plain loads: {e}");
        }
        let pending = std::mem::take(&mut st.pending);
        let mut bufs: Vec<SumsBuf> = st.free.drain(..).chain(st.retired.drain(..)).collect();
        for e in pending {
            if !e.event.is_null() {
                // SAFETY: our event; nothing waits on it any more.
                let _ = unsafe { result::event::destroy(e.event) };
            }
            if let Some(buf) = e.what.buf {
                bufs.push(buf);
            }
        }
        for b in bufs {
            // SAFETY: allocated by `buffer`; nothing queued uses them any more.
            unsafe {
                let _ = result::free_sync(b.dev);
                let _ = result::free_host(b.host as *mut c_void);
            }
        }
    }
}

impl State {
    /// Settles one entry: its sums (`arrived`), or its items as unknown.
    fn settle_one(&mut self, e: Entry, arrived: bool) {
        if !e.event.is_null() {
            // SAFETY: our event, complete or failed; nothing waits on it.
            let _ = unsafe { result::event::destroy(e.event) };
        }
        let b = &e.binding;
        match (e.what.buf, &e.what.settle) {
            (Some(buf), Settle::Sums { src, items, .. }) => {
                let pairs = items.len();
                // SAFETY: the copy into the pinned half completed (its event did) and wrote
                // `src.len() · pairs` sums, which the buffer holds.
                let sums = arrived.then(|| unsafe { std::slice::from_raw_parts(buf.host, src.len() * pairs) });
                match sums {
                    Some(sums) => b.settle_step(e.mode, &e.what.settle, Some(&|i, l| sums[i * pairs + l])),
                    None => b.settle_step(e.mode, &e.what.settle, None),
                }
                match arrived {
                    true => self.free.push(buf),
                    // The stream failed: the device half may still be in use.
                    false => self.retired.push(buf),
                }
            }
            (buf, settle) => {
                // `direct` runs (no buffer): their items settle as unknown.
                debug_assert!(buf.is_none());
                b.settle_step(e.mode, settle, None);
            }
        }
        if e.orphan {
            if let Some(TransferError::Integrity { items, .. }) = b.sink.error() {
                self.unreported.extend(items);
            }
        }
    }
}

/// The binding an entry settles into: a plain call's gets a sink of its own (the call has
/// returned; its mismatches go to the executor's unreported list).
fn own_sink(binding: &ChecksumBinding, orphan: bool) -> ChecksumBinding {
    match orphan {
        true => ChecksumBinding { table: binding.table.clone(), sink: Arc::new(MismatchSink::default()) },
        false => binding.clone(),
    }
}
