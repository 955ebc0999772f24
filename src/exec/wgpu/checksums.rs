//! Item checksums of the summing gathers: their device buffers, and the readback that settles
//! them in submission order.

use std::sync::Arc;

use super::*;
use crate::error::Result;
use crate::exec::settle::Settle;
use crate::exec::ChecksumBinding;
use crate::plan::{ChecksumMode, GatherStep};

/// The checksums of one step, settled in submission order: a gather's sums on their way back
/// (its sums buffers' mappable copies, laid out by `layout`), or the items of `direct` copies,
/// which cannot sum (settled as unknown).
pub(super) struct PendingSums {
    pub(super) staging: Vec<wgpu::Buffer>,
    /// Staging buffers mapped so far, and whether a mapping failed.
    mapped: Arc<std::sync::atomic::AtomicUsize>,
    pub(super) failed: Arc<std::sync::atomic::AtomicBool>,
    /// Where address pair `l`'s entries (two u32 per index pair) lie; `None` for copies.
    pub(super) layout: Option<SumsLayout>,
    what: Settle,
    mode: ChecksumMode,
    binding: ChecksumBinding,
}

impl PendingSums {
    /// Starts mapping the staging buffers: called right after the submission that fills them.
    pub(super) fn map(&self) {
        use std::sync::atomic::Ordering::Release;
        for b in &self.staging {
            let (mapped, failed) = (self.mapped.clone(), self.failed.clone());
            b.map_async(wgpu::MapMode::Read, .., move |r| match r {
                Ok(()) => _ = mapped.fetch_add(1, Release),
                Err(_) => failed.store(true, Release),
            });
        }
    }
    pub(super) fn is_ready(&self) -> bool {
        use std::sync::atomic::Ordering::Acquire;
        self.failed.load(Acquire) || self.mapped.load(Acquire) == self.staging.len()
    }
    /// The items of `direct` copies, which cannot sum: settled as unknown.
    pub(super) fn unknown(
        mode: ChecksumMode,
        binding: ChecksumBinding,
        step: &crate::plan::CopyStep,
        runs: std::ops::Range<usize>,
    ) -> PendingSums {
        PendingSums {
            staging: Vec::new(),
            mapped: Default::default(),
            failed: Default::default(),
            layout: None,
            what: Settle::Unknown(step.clone(), runs),
            mode,
            binding,
        }
    }
    /// Records or verifies every live item's checksum from the mapped readback; unknown ones
    /// (copies that cannot sum, or a failed readback) are forgotten by a backup and count as
    /// unverified for a load.
    pub(super) fn settle(&self) {
        let views: Option<Vec<wgpu::BufferView>> = match (self.layout, self.failed.load(std::sync::atomic::Ordering::Acquire)) {
            (Some(_), false) => self.staging.iter().map(|b| b.get_mapped_range(..).ok()).collect(),
            _ => None,
        };
        match (&views, self.layout) {
            (Some(v), Some(layout)) => {
                let sum = |i: usize, l: usize| {
                    let (b, at) = layout.at(l);
                    let e = &v[b][at as usize..];
                    let word = |k: usize| u32::from_le_bytes([e[4 * k], e[4 * k + 1], e[4 * k + 2], e[4 * k + 3]]) as u64;
                    word(2 * i) | word(2 * i + 1) << 32
                };
                self.binding.settle_step(self.mode, &self.what, Some(&sum));
            }
            _ => self.binding.settle_step(self.mode, &self.what, None),
        }
        if views.is_some() {
            drop(views);
            for b in &self.staging {
                b.unmap();
            }
        }
    }
}
/// A checksumming gather's device buffers (see [`WgpuExecutor::sum_buffers`]).
pub(super) struct SumBuffers {
    pub(super) buffers: Vec<wgpu::Buffer>,
    pub(super) layout: SumsLayout,
    pub(super) pending: PendingSums,
}

/// Where a gather's sums lie: `per_buffer` address pairs per sums buffer, `stride` bytes each
/// (a binding offset alignment).
#[derive(Clone, Copy)]
pub(super) struct SumsLayout {
    per_buffer: usize,
    stride: u64,
}

impl SumsLayout {
    /// The buffer and byte offset of address pair `li`'s entries.
    pub(super) fn at(&self, li: usize) -> (usize, u64) {
        (li / self.per_buffer, (li % self.per_buffer) as u64 * self.stride)
    }
}

impl WgpuExecutor {
    /// The device buffers of a checksumming gather: zeroed sums (two u32 per
    /// index pair and address pair, each address pair's at a binding offset, packed into as
    /// few buffers as the buffer size allows) and their mappable copies.
    pub(super) fn sum_buffers(&self, g: &GatherStep, mode: ChecksumMode, b: &ChecksumBinding) -> Result<SumBuffers> {
        let inner = &self.inner;
        let n = g.src_indices.len() as u64;
        let align = inner.limits.min_storage_buffer_offset_alignment as u64;
        let stride = (8 * n.max(1)).next_multiple_of(align);
        // Within one binding (the planner bounds `n` by it) and one buffer.
        let per_buffer = (inner.max_buffer.min(1 << 28) / stride).max(1) as usize;
        let pairs = g.pairs.len();
        let make = |label: &'static str, size: u64, usage: wgpu::BufferUsages| {
            inner.device.create_buffer(&wgpu::BufferDescriptor { label: Some(label), size, usage, mapped_at_creation: false })
        };
        let layout = SumsLayout { per_buffer, stride };
        let (mut buffers, mut staging) = (Vec::new(), Vec::new());
        for first in (0..pairs).step_by(per_buffer) {
            let size = stride * (pairs - first).min(per_buffer) as u64;
            // New buffers are zeroed (WebGPU guarantees it).
            buffers.push(make("hicache-io sums", size, wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC));
            staging.push(make("hicache-io sums readback", size, wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST));
        }
        Ok(SumBuffers {
            buffers,
            layout,
            pending: PendingSums {
                staging,
                mapped: Default::default(),
                failed: Default::default(),
                layout: Some(layout),
                what: Settle::Sums { src: g.src_indices.clone(), dst: g.dst_indices.clone(), items: g.items.clone() },
                mode,
                binding: b.clone(),
            },
        })
    }
}
