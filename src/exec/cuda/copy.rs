//! `direct` copies: `cuMemcpyBatchAsync` in calls of at most `BATCH_MAX` copies where the driver
//! and stream allow it, else one `cuMemcpyAsync` per run.

use cudarc::driver::sys;

use super::driver::{is_default_stream, rc_err, BATCH_MAX};
use super::{CudaBuffer, CudaExecutor};
use crate::error::Result;
use crate::exec::{Bindings, Stream};

impl CudaExecutor {
    /// Enqueues `runs` on stream `on`. The batch descriptors are built `BATCH_MAX` runs at a
    /// time, so their memory is bounded by a batch, not by the call.
    pub(super) fn copies(&self, runs: &crate::plan::CopyStep, bufs: &Bindings<'_, CudaBuffer>, on: Stream) -> Result<()> {
        let stream = self.raw_stream(on)?;
        let dst = |r: &crate::plan::Run| bufs.get(r.dst).dev_ptr + r.dst_offset;
        let src = |r: &crate::plan::Run| bufs.get(r.src).dev_ptr + r.src_offset;
        let mut done = 0;
        if let Some(batch) = self.inner.batch.filter(|_| runs.len() > 1 && !is_default_stream(stream)) {
            let src_host = runs.run(0).is_some_and(|r| bufs.get(r.src).is_host());
            let dst_host = runs.run(0).is_some_and(|r| bufs.get(r.dst).is_host());
            let loc = |host: bool| sys::CUmemLocation {
                type_: if host {
                    sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST
                } else {
                    sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE
                },
                id: if host { 0 } else { self.inner.ctx.ordinal() as i32 },
            };
            let mut attrs = sys::CUmemcpyAttributes {
                srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                srcLocHint: loc(src_host),
                dstLocHint: loc(dst_host),
                flags: 0,
            };
            let cap = BATCH_MAX.min(runs.len());
            let (mut dsts, mut srcs, mut sizes): (Vec<sys::CUdeviceptr>, Vec<sys::CUdeviceptr>, Vec<usize>) =
                (Vec::with_capacity(cap), Vec::with_capacity(cap), Vec::with_capacity(cap));
            while done < runs.len() {
                let chunk = runs.runs_in(done, done + BATCH_MAX);
                let n = chunk.len();
                dsts.clear();
                srcs.clear();
                sizes.clear();
                for r in chunk {
                    dsts.push(dst(&r));
                    srcs.push(src(&r));
                    sizes.push(r.len as usize);
                }
                let mut idx = [0usize];
                let mut fail = usize::MAX;
                // SAFETY: arrays of `n` entries, live for the call (the driver copies the
                // descriptors); addresses are inside pool allocations (validated plan).
                let rc = unsafe {
                    batch(dsts.as_mut_ptr(), srcs.as_mut_ptr(), sizes.as_mut_ptr(), n, &mut attrs, idx.as_mut_ptr(), 1, &mut fail, stream)
                };
                match rc {
                    sys::CUresult::CUDA_SUCCESS => done += n,
                    // Not for this stream or these memory kinds: one copy per run instead.
                    sys::CUresult::CUDA_ERROR_NOT_SUPPORTED | sys::CUresult::CUDA_ERROR_INVALID_VALUE => {
                        log::debug!("cuMemcpyBatchAsync: {rc:?}; falling back to one copy per run");
                        break;
                    }
                    other => return Err(rc_err(format!("cuMemcpyBatchAsync failed at run {}", done + fail.min(n)), other)),
                }
            }
        }
        for (i, r) in runs.runs_in(done, runs.len()).enumerate() {
            let i = done + i;
            // SAFETY: as above; UVA pointers in either direction.
            let rc = unsafe { sys::cuMemcpyAsync(dst(&r), src(&r), r.len as usize, stream) };
            if rc != sys::CUresult::CUDA_SUCCESS {
                return Err(rc_err(format!("cuMemcpyAsync (run {i})"), rc));
            }
        }
        Ok(())
    }
}
