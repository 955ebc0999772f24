//! The gather shader (`kernel`): its source, and one dispatch per (address pair, window pair).

use super::*;
use crate::error::Result;
use crate::exec::{Bindings, Executor};
use crate::geometry::Addr;
use crate::plan::{lcm, GatherStep};

/// The gather shader for words of type `word` (`u32` or `vec4<u32>`), with item checksums
/// (`sum`: the lines between `//<sum` and `//sum>`) or without (those between `//<plain` and
/// `//plain>`); the lines tagged `w4` or `w16` are for one word type only.
pub(super) fn shader_source(word: &str, sum: bool, int64: bool) -> String {
    let drop = [if sum { "plain" } else { "sum" }, if word == "u32" { "w16" } else { "w4" }, if int64 { "i16" } else { "i64" }];
    let mut out = String::with_capacity(SHADER.len());
    // Tagged sections nest (`w4` inside `sum`): a line is kept when no open tag is dropped.
    let mut open: Vec<&str> = Vec::new();
    for line in SHADER.lines() {
        let t = line.trim();
        if let Some(tag) = t.strip_prefix("//<") {
            open.push(tag);
            continue;
        }
        if let Some(tag) = t.strip_prefix("//").and_then(|t| t.strip_suffix('>')).filter(|t| !t.contains(' ')) {
            if open.last() == Some(&tag) {
                open.pop();
                continue;
            }
        }
        if !open.iter().any(|t| drop.contains(t)) {
            out.push_str(line);
            out.push('\n');
        }
    }
    let wide = if word == "u32" { "u64" } else { "vec4<u64>" };
    out.replace("WIDE", wide).replace("WORD", word)
}
/// Loop iterations one invocation of the gather shader may run, all its loops together: Mesa's
/// llvmpipe (lavapipe) stops an invocation's loops after 65,535 iterations without a word,
/// which silently truncated chunks of more than 65,535 words per lane.
pub(super) const GATHER_MAX_TRIPS: u64 = 65_535;

impl WgpuExecutor {
    /// Encodes one gather step: an index table, one parameter record per dispatch, one
    /// dispatch per (address pair, window pair) that holds an item.
    pub(super) fn gather(
        &self,
        g: &GatherStep,
        bufs: &Bindings<'_, WgpuBuffer>,
        enc: &mut wgpu::CommandEncoder,
        out: &mut Vec<PendingSums>,
    ) -> Result<()> {
        let inner = &self.inner;
        let (word, lanes_log2) = self.word_and_lanes(g, bufs);
        // The planner bounds indices by `max_index` (i32) and counts by `max_gather_items`.
        let pairs: Vec<[i32; 2]> =
            g.src_indices.iter().zip(g.dst_indices.iter()).map(|(&s, &d)| [s.max(-1) as i32, d.max(-1) as i32]).collect();
        let index_buf = self.buffer_with("hicache-io indices", bytemuck::cast_slice(&pairs), wgpu::BufferUsages::STORAGE)?;
        let dispatches = self.dispatches(g, bufs, word, lanes_log2)?;
        // One Params record per dispatch, at the uniform offset alignment.
        let stride = (std::mem::size_of::<Params>() as u64).next_multiple_of(inner.limits.min_uniform_buffer_offset_alignment as u64);
        let mut params = vec![0u8; (stride * dispatches.len() as u64) as usize];
        for (i, (_, p, _, _)) in dispatches.iter().enumerate() {
            let at = i * stride as usize;
            params[at..at + std::mem::size_of::<Params>()].copy_from_slice(bytemuck::bytes_of(p));
        }
        let param_buf = self.buffer_with("hicache-io params", &params, wgpu::BufferUsages::UNIFORM)?;
        let sums = match (g.checksum, &bufs.integrity) {
            (Some(mode), Some(b)) => Some(self.sum_buffers(g, mode, b)?),
            _ => None,
        };
        let groups: Vec<wgpu::BindGroup> = dispatches
            .iter()
            .map(|(li, _, sw, dw)| {
                let l = &g.pairs[*li];
                let mut entries = vec![
                    entry(0, &param_buf, 0, std::mem::size_of::<Params>() as u64),
                    entry(1, &index_buf, 0, index_buf.size()),
                    entry(2, &bufs.get(l.src.buf).segments[sw.seg], sw.start, sw.len),
                    entry(3, &bufs.get(l.dst.buf).segments[dw.seg], dw.start, dw.len),
                ];
                if let Some(s) = &sums {
                    let (b, at) = s.layout.at(*li);
                    entries.push(entry(5, &s.buffers[b], at, 8 * pairs.len() as u64));
                }
                let layout = if sums.is_some() { &inner.sum_layout } else { &inner.layout };
                inner.device.create_bind_group(&wgpu::BindGroupDescriptor { label: None, layout, entries: &entries })
            })
            .collect();
        let workgroups = ((pairs.len() as u64) << lanes_log2).div_ceil(64);
        let max_x = inner.limits.max_compute_workgroups_per_dimension as u64;
        let (x, y) = (workgroups.min(max_x), workgroups.div_ceil(max_x));
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("hicache-io gather"), timestamp_writes: None });
        pass.set_pipeline(match (word, sums.is_some()) {
            (16, false) => &inner.pipe16,
            (_, false) => &inner.pipe4,
            (16, true) => &inner.sum16,
            (_, true) => &inner.sum4,
        });
        for (i, bg) in groups.iter().enumerate() {
            pass.set_bind_group(0, bg, &[(i as u64 * stride) as u32]);
            pass.dispatch_workgroups(x as u32, y as u32, 1);
        }
        drop(pass);
        if let Some(s) = sums {
            for (b, staging) in s.buffers.iter().zip(&s.pending.staging) {
                enc.copy_buffer_to_buffer(b, 0, staging, 0, b.size());
            }
            out.push(s.pending);
        }
        // wgpu keeps the index, parameter and sums buffers alive until the submission completes.
        Ok(())
    }

    /// The shader's word (16 bytes when every offset, size and the window allow, else 4) and
    /// invocations per item (the plan step's `lanes_log2`).
    fn word_and_lanes(&self, g: &GatherStep, bufs: &Bindings<'_, WgpuBuffer>) -> (u64, u32) {
        let inner = &self.inner;
        let base_granule = self.capabilities().window_granule(g.chunk_bytes);
        let fits16 = |a: &Addr| aligned16(a) && bufs.get(a.buf).segments.iter().all(|b| b.size().is_multiple_of(16));
        let word: u64 = if g.chunk_bytes.is_multiple_of(16)
            && lcm(base_granule, 16) <= inner.max_window
            && g.pairs.iter().all(|l| fits16(&l.src) && fits16(&l.dst))
        {
            16
        } else {
            4
        };
        (word, g.lanes_log2())
    }

    /// One dispatch per address pair and per pair of binding windows that holds an item (one
    /// pair for pools that fit one binding, the common case). Windows tile each segment in whole
    /// granules (`lcm(chunk, offset alignment, word)`), so an item chunk never straddles an edge.
    fn dispatches(&self, g: &GatherStep, bufs: &Bindings<'_, WgpuBuffer>, word: u64, lanes_log2: u32) -> Result<Vec<Dispatch>> {
        let inner = &self.inner;
        let granule = lcm(lcm(g.chunk_bytes, inner.limits.min_storage_buffer_offset_alignment as u64), word);
        // The planner checked that one granule fits the window (`Capabilities::max_binding`).
        let win = (inner.max_window / granule * granule).max(granule);
        let key_base = match (g.checksum, &bufs.integrity) {
            (Some(_), Some(b)) => crate::integrity::key_base(b.table.keys().seed(), 0),
            _ => 0,
        };
        let mut out = Vec::new();
        for (li, l) in g.pairs.iter().enumerate() {
            let (sb, db) = (bufs.get(l.src.buf), bufs.get(l.dst.buf));
            let (sws, dws) = (windows(sb, win), windows(db, win));
            let mut used: Vec<(usize, usize)> = if sws.len() == 1 && dws.len() == 1 {
                vec![(0, 0)]
            } else {
                let live = g.src_indices.iter().zip(g.dst_indices.iter()).filter(|(s, d)| **s >= 0 && **d >= 0);
                live.flat_map(|(&s, &d)| {
                    (0..g.heads)
                        .map(move |h| (window_of(sb, win, l.src.offset(s as u64, h)), window_of(db, win, l.dst.offset(d as u64, h))))
                })
                .collect()
            };
            used.sort_unstable();
            used.dedup();
            for (si, di) in used {
                let (sw, dw) = (sws[si], dws[di]);
                let p = Params {
                    src: side(&l.src, &sw)?,
                    dst: side(&l.dst, &dw)?,
                    n_items: g.src_indices.len() as u32,
                    heads: g.heads as u32,
                    words_per_chunk: (g.chunk_bytes / word) as u32,
                    word_shift: word.trailing_zeros(),
                    lanes_log2,
                    key_base,
                    _pad: [0; 2],
                };
                out.push((li, p, sw, dw));
            }
        }
        Ok(out)
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub(super) struct SideParams {
    rel0: u32,
    page: u32,
    page_stride: u32,
    row_stride: u32,
    head_stride: u32,
    unit_lo: u32,
    unit_hi: u32,
    win_len: u32,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub(super) struct Params {
    src: SideParams,
    dst: SideParams,
    n_items: u32,
    heads: u32,
    words_per_chunk: u32,
    word_shift: u32,
    lanes_log2: u32,
    /// [`crate::integrity::key_base`] of the item checksums' seed (checksumming pipelines).
    key_base: u32,
    _pad: [u32; 2],
}

/// One binding window: `len` bytes at `start` of segment `seg`, `abs` bytes into the pool.
#[derive(Debug, Clone, Copy)]
pub(super) struct Window {
    pub(super) seg: usize,
    start: u64,
    pub(super) len: u64,
    abs: u64,
}
/// One dispatch: address pair index, parameters, source and destination windows.
pub(super) type Dispatch = (usize, Params, Window, Window);

/// A side's parameters for one window: the units (`idx / page`) whose bytes can touch it and
/// the window-relative offset of the first (wrapped when negative). A unit's bytes for one
/// address lie within `page_stride` bytes of its start, so the range holds every unit with a
/// chunk inside the window, and relative offsets stay within a few windows of zero.
pub(super) fn side(a: &Addr, w: &Window) -> Result<SideParams> {
    let u = |v: u64| u32::try_from(v).map_err(|_| err(format!("stride {v} exceeds u32")));
    let ps = a.page_stride.max(1);
    let (lo_b, hi_b) = (w.abs, w.abs + w.len);
    let unit_lo = if lo_b > a.base { (lo_b - a.base) / ps } else { 0 };
    let unit_hi = if hi_b > a.base { (hi_b - a.base).div_ceil(ps) } else { 0 };
    let cap = |v: u64| v.min(u32::MAX as u64) as u32;
    if w.len.saturating_add(ps.saturating_mul(2)) > 1 << 32 {
        return Err(err(format!("a {}-byte window with {ps}-byte units exceeds 32-bit offsets", w.len)));
    }
    let rel0 = (a.base as i128 + unit_lo as i128 * ps as i128 - lo_b as i128) as u32;
    Ok(SideParams {
        rel0,
        page: u(a.page)?,
        page_stride: u(a.page_stride)?,
        row_stride: u(a.row_stride)?,
        head_stride: u(a.head_stride)?,
        unit_lo: cap(unit_lo),
        unit_hi: cap(unit_hi),
        win_len: u(w.len)?,
    })
}

pub(super) fn aligned16(a: &Addr) -> bool {
    [a.base, a.page_stride, a.row_stride, a.head_stride].iter().all(|v| v % 16 == 0)
}
/// Binding windows of `win` bytes tiling each segment of `b` (the last of each shorter).
pub(super) fn windows(b: &WgpuBuffer, win: u64) -> Vec<Window> {
    let mut out = Vec::new();
    for (k, seg) in b.segments.iter().enumerate() {
        let size = seg.size();
        out.extend((0..size.div_ceil(win)).map(|j| Window {
            seg: k,
            start: j * win,
            len: win.min(size - j * win),
            abs: k as u64 * b.seg + j * win,
        }));
    }
    out
}

/// Index (into [`windows`]) of the window holding byte `offset` of `b`.
pub(super) fn window_of(b: &WgpuBuffer, win: u64, offset: u64) -> usize {
    let per_seg = b.seg.div_ceil(win) as usize;
    (offset / b.seg) as usize * per_seg + ((offset % b.seg) / win) as usize
}

pub(super) fn bgl_entry(binding: u32, ty: wgpu::BufferBindingType, dynamic: bool) -> wgpu::BindGroupLayoutEntry {
    wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer { ty, has_dynamic_offset: dynamic, min_binding_size: None },
        count: None,
    }
}

pub(super) fn entry(binding: u32, buffer: &wgpu::Buffer, offset: u64, size: u64) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry {
        binding,
        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding { buffer, offset, size: wgpu::BufferSize::new(size) }),
    }
}
