//! `direct` copies: `cuMemcpyBatchAsync` in calls of at most `BATCH_MAX` copies where the driver
//! and stream allow it, else one `cuMemcpyAsync` per run.

use cudarc::driver::sys;

use super::driver::{is_default_stream, BATCH_MAX};
use super::{CudaBuffer, CudaExecutor};
use crate::error::{Result, TransferError};
use crate::exec::{Bindings, Stream};

impl CudaExecutor {
    pub(super) fn copies(&self, runs: &[crate::plan::Run], bufs: &Bindings<'_, CudaBuffer>, on: Stream) -> Result<()> {
        let stream = self.raw_stream(on)?;
        let mut dsts: Vec<sys::CUdeviceptr> = runs.iter().map(|r| bufs.get(r.dst).dev_ptr + r.dst_offset).collect();
        let mut srcs: Vec<sys::CUdeviceptr> = runs.iter().map(|r| bufs.get(r.src).dev_ptr + r.src_offset).collect();
        let mut sizes: Vec<usize> = runs.iter().map(|r| r.len as usize).collect();
        let mut done = 0;
        if let Some(batch) = self.inner.batch.filter(|_| runs.len() > 1 && !is_default_stream(stream)) {
            let src_host = runs.first().is_some_and(|r| bufs.get(r.src).is_host());
            let dst_host = runs.first().is_some_and(|r| bufs.get(r.dst).is_host());
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
            while done < runs.len() {
                let n = (runs.len() - done).min(BATCH_MAX);
                let mut idx = [0usize];
                let mut fail = usize::MAX;
                // SAFETY: arrays of at least `done + n` entries, live for the call (the driver
                // copies the descriptors); addresses are inside pool allocations (validated plan).
                let rc = unsafe {
                    batch(
                        dsts[done..].as_mut_ptr(),
                        srcs[done..].as_mut_ptr(),
                        sizes[done..].as_mut_ptr(),
                        n,
                        &mut attrs,
                        idx.as_mut_ptr(),
                        1,
                        &mut fail,
                        stream,
                    )
                };
                match rc {
                    sys::CUresult::CUDA_SUCCESS => done += n,
                    // Not for this stream or these memory kinds: one copy per run instead.
                    sys::CUresult::CUDA_ERROR_NOT_SUPPORTED | sys::CUresult::CUDA_ERROR_INVALID_VALUE => {
                        log::debug!("cuMemcpyBatchAsync: {rc:?}; falling back to one copy per run");
                        break;
                    }
                    other => {
                        return Err(TransferError::Executor {
                            backend: "cuda",
                            message: format!("cuMemcpyBatchAsync failed at run {}: {other:?}", done + fail.min(n)),
                        })
                    }
                }
            }
        }
        for i in done..runs.len() {
            // SAFETY: as above; UVA pointers in either direction.
            let rc = unsafe { sys::cuMemcpyAsync(dsts[i], srcs[i], sizes[i], stream) };
            if rc != sys::CUresult::CUDA_SUCCESS {
                return Err(TransferError::Executor { backend: "cuda", message: format!("cuMemcpyAsync (run {i}): {rc:?}") });
            }
        }
        Ok(())
    }
}
