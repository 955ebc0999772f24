//! Launching a gather step: its launch description, its tables uploaded, the kernel enqueued.

use cudarc::driver::result;

use super::driver::drv;
use super::{CudaBuffer, CudaExecutor};
use crate::error::Result;
use crate::exec::cuda_launch::gather_launch;
use crate::exec::{Bindings, Stream};
use crate::plan::GatherStep;

impl CudaExecutor {
    pub(super) fn gather(&self, g: &GatherStep, bufs: &Bindings<'_, CudaBuffer>, on: Stream) -> Result<()> {
        let side = if on == Stream::Side { Some(self.side_stream()?) } else { None };
        let (stream, scratch) = match &side {
            Some(s) => (s.stream.cu_stream(), &s.scratch),
            None => (self.cu_stream(), &self.inner.scratch),
        };
        let launch = gather_launch(g, |b| bufs.get(b).dev_ptr, self.inner.tuning, self.inner.max_threads)?;
        let mut scratch = scratch.lock().unwrap_or_else(|e| e.into_inner());
        let args = scratch.upload(stream, g, &launch)?;
        let [table, src_idx, dst_idx] = args;
        let mut kernel_args = launch.args(table, src_idx, dst_idx);
        let mut params = kernel_args.params();
        let f = if launch.word == 8 { self.inner.f_w8 } else { self.inner.f_w4 };
        // SAFETY: the arguments match the kernel's signature; the tables live in the scratch
        // area, which later uploads overwrite only in stream order (after this kernel).
        unsafe { result::launch_kernel(f, (launch.blocks, 1, 1), (launch.threads_per_block, 1, 1), 0, stream, &mut params) }
            .map_err(|e| drv("cuLaunchKernel", e))
    }
}
