//! `direct` (one `copy_buffer_to_buffer` per coalesced run).

use super::*;

/// Above this many runs in one step, `direct` (one `copy_buffer_to_buffer` each) is far slower
/// than `kernel` on wgpu; a warning says so once.
pub(super) const MANY_RUNS: usize = 100_000;
/// Buffer copies per queue submission by default: about a megabyte of commands on lavapipe,
/// far past where the per-submission cost matters.
pub(super) const DEFAULT_COPIES_PER_SUBMISSION: u64 = 1 << 16;
/// One `direct` run, split where either side crosses a segment edge.
pub(super) fn copy_run(enc: &mut wgpu::CommandEncoder, src: &WgpuBuffer, src_offset: u64, dst: &WgpuBuffer, dst_offset: u64, len: u64) {
    let mut at = 0;
    while at < len {
        let (so, d_o) = (src_offset + at, dst_offset + at);
        let n = (src.seg - so % src.seg).min(dst.seg - d_o % dst.seg).min(len - at);
        enc.copy_buffer_to_buffer(
            &src.segments[(so / src.seg) as usize],
            so % src.seg,
            &dst.segments[(d_o / dst.seg) as usize],
            d_o % dst.seg,
            n,
        );
        at += n;
    }
}
