//! Token copies between page-padded buffers: DeepSeek-V4's C4 caches.

use super::args::OpArgs;
use super::catalogue::spec::ArgKind;
use super::*;
use crate::exec::Device;
use crate::geometry::{DeviceGeometry, IoBackend, LayerMap, Layout, PagePadding, PoolKind, Profile};
use crate::plan::Op;
use crate::{Result, TransferError};

/// Tokens of one C4 page.
pub const DSV4_PAGE_TOKENS: u64 = 64;
/// A C4 token's value (nope and rope parts).
pub const DSV4_VALUE_BYTES: u64 = 576;
/// A C4 token's scale.
pub const DSV4_SCALE_BYTES: u64 = 8;
/// A C4 page: 64 values, then 64 scales, padded to a multiple of 576 bytes (37,440).
pub const DSV4_PAGE_BYTES: u64 = (DSV4_PAGE_TOKENS * (DSV4_VALUE_BYTES + DSV4_SCALE_BYTES)).div_ceil(576) * 576;

/// The two parts of a C4 token, each a padded-page item: `(item bytes, offset in the page)`.
const DSV4_PARTS: [(u64, u64); 2] = [(DSV4_VALUE_BYTES, 0), (DSV4_SCALE_BYTES, DSV4_PAGE_TOKENS * DSV4_VALUE_BYTES)];

/// [`Shape::Dsv4Tokens`](super::catalogue::Shape::Dsv4Tokens): `transfer_cache_dsv4_mla`. For
/// every layer `l` and pair `i`, token `src_indices[i]` of C4 buffer `src_ptrs[l]` → token
/// `dst_indices[i]` of `dst_ptrs[l]` (`block_size`, sglang's launch shape, is checked by the
/// Python binding and otherwise ignored): its 576-byte value at `page × 37440 + slot × 576` and its
/// 8-byte scale at `page × 37440 + 36864 + slot × 8` (`page = t / 64`, `slot = t % 64`). Both
/// sides have the same layout and may be any memory the executor moves. A layer holds the whole
/// pages its extent allows, and every layer of a side is bounded by its smallest. Beyond
/// sglang (which reads indices as 32-bit and trusts them): tokens must lie inside their
/// buffers, no destination token may be written twice, sources and destinations must not
/// overlap; nothing moves unless all pass.
pub(super) fn dsv4_tokens(device: &Device, a: &OpArgs<'_, '_>) -> Result<()> {
    let (src_name, src) = a.list(ArgKind::InLayers)?;
    let (dst_name, dst) = a.list(ArgKind::OutLayers)?;
    let (si, di) = a.indices()?;
    if src.len() != dst.len() {
        return Err(TransferError::LayerListMismatch { src_len: src.len(), dst_len: dst.len() });
    }
    if si.len() != di.len() {
        return Err(TransferError::LengthMismatch { src_len: si.len(), dst_len: di.len() });
    }
    if src.is_empty() || si.is_empty() {
        return earlier_reports(device);
    }
    let pages = |name: &str, list: &[RawTensor]| -> Result<u64> {
        let fewest = list.iter().map(|t| t.len / DSV4_PAGE_BYTES).min().unwrap_or(0);
        if fewest == 0 {
            let (j, t) = list.iter().enumerate().min_by_key(|(_, t)| t.len).expect("a layer");
            return Err(bad(&format!("{name}[{j}]"), format!("{} bytes hold no {DSV4_PAGE_BYTES}-byte C4 page", t.len)));
        }
        Ok(fewest)
    };
    let (src_pages, dst_pages) = (pages(src_name, src)?, pages(dst_name, dst)?);
    // Each layer as the whole pages every layer of its side holds: no copy reaches further.
    let trimmed = |list: &[RawTensor], pages: u64| -> Vec<RawTensor> {
        list.iter()
            .map(|t| {
                let mut t = t.clone();
                t.len = pages * DSV4_PAGE_BYTES;
                t
            })
            .collect()
    };
    let (src, dst) = (trimmed(src, src_pages), trimmed(dst, dst_pages));
    let reads: Vec<Arg<'_>> = src.iter().enumerate().map(|(j, t)| arg(format!("{src_name}[{j}]"), t)).collect();
    let writes: Vec<Arg<'_>> = dst.iter().enumerate().map(|(j, t)| arg(format!("{dst_name}[{j}]"), t)).collect();
    check_overlaps(&reads, &writes)?;
    // One call per (part, layer): the value and the scale are two padded-page items of the same
    // token. Every call has the same token bounds, so CUDA index lists share one device check.
    let mut calls = Vec::with_capacity(2 * reads.len());
    for (item, offset) in DSV4_PARTS {
        let padding = PagePadding { page_bytes: DSV4_PAGE_BYTES, offset };
        for (r, w) in reads.iter().zip(&writes) {
            let geometry = DeviceGeometry::new(PoolKind::Mla, item, dst_pages * DSV4_PAGE_TOKENS, DSV4_PAGE_TOKENS, LayerMap::new(1))?
                .with_padding(padding)?;
            let dev = DeviceSide::new(device, geometry, vec![vec![wrap(device, w)?]])?;
            // A host side holds (size / P + 1) × P slots: ask for one page less.
            let size = (src_pages - 1) * DSV4_PAGE_TOKENS;
            let sides = dev.with_host(Layout::LayerFirst, size, 1, Profile::Sglang, Some(padding), vec![wrap(device, r)?])?;
            calls.push(Call::new(sides, Op::Load { layer_id: 0, is_draft: false }, IoBackend::Kernel, si, di)?);
        }
    }
    a.run(calls)
}

/// [`Shape::PageRows`](super::catalogue::Shape::PageRows): `transfer_page_rows` (MiniMax M3's
/// NVFP4 caches). For every layer `l` and pair `i`, `row_bytes` bytes between host row
/// `host_ptrs[l] + host_pages[i] × host_stride` and device row
/// `device_ptrs[l] + device_pages[i] × device_stride`, host to device when `load`, else back.
/// sglang's checks (row bytes and strides in 128-byte units) with its words; beyond sglang:
/// strides of at least one row (rows that overlap would be written twice), every page inside
/// its layer (each layer of a side bounded by its smallest), destinations unique, sides
/// disjoint; nothing moves unless all pass.
pub(super) fn page_rows(device: &Device, a: &OpArgs<'_, '_>) -> Result<()> {
    let (host_name, host) = a.list(ArgKind::InLayers)?;
    let (device_name, dev) = a.list(ArgKind::OutLayers)?;
    let (hi, di) = a.indices()?;
    let (host_stride, device_stride, row_bytes, load) =
        (a.int("host_stride")?, a.int("device_stride")?, a.int("row_bytes")?, a.int("load")? != 0);
    let refuse = |arg: &'static str, value: i64, message: &str| TransferError::BadArgument { arg, value, message: message.into() };
    if row_bytes <= 0 || row_bytes % 128 != 0 {
        return Err(refuse("row_bytes", row_bytes, "page-row bytes must be a positive multiple of 128"));
    }
    for (arg, stride) in [("host_stride", host_stride), ("device_stride", device_stride)] {
        if stride % 128 != 0 {
            return Err(refuse(arg, stride, "page-row strides must be 128B aligned"));
        }
        if stride < row_bytes {
            return Err(refuse(arg, stride, &format!("{arg} {stride} is less than row_bytes {row_bytes}: rows would overlap")));
        }
    }
    if host.len() != dev.len() {
        return Err(TransferError::LayerListMismatch { src_len: host.len(), dst_len: dev.len() });
    }
    if hi.len() != di.len() {
        return Err(TransferError::LengthMismatch { src_len: hi.len(), dst_len: di.len() });
    }
    if host.is_empty() || hi.is_empty() {
        return earlier_reports(device);
    }
    let (row, hs, ds) = (row_bytes as u64, host_stride as u64, device_stride as u64);
    let rows = |name: &str, list: &[RawTensor], stride: u64| -> Result<u64> {
        let fewest = list.iter().map(|t| if t.len < row { 0 } else { (t.len - row) / stride + 1 }).min().unwrap_or(0);
        if fewest == 0 {
            let (j, t) = list.iter().enumerate().min_by_key(|(_, t)| t.len).expect("a layer");
            return Err(bad(&format!("{name}[{j}]"), format!("{} bytes hold no {row}-byte page row", t.len)));
        }
        Ok(fewest)
    };
    let (host_rows, dev_rows) = (rows(host_name, host, hs)?, rows(device_name, dev, ds)?);
    let hosts: Vec<Arg<'_>> = host.iter().enumerate().map(|(j, t)| arg(format!("{host_name}[{j}]"), t)).collect();
    let devs: Vec<Arg<'_>> = dev.iter().enumerate().map(|(j, t)| arg(format!("{device_name}[{j}]"), t)).collect();
    let (reads, writes, stride) = if load { (&hosts, &devs, ds) } else { (&devs, &hosts, hs) };
    strided_overlaps(reads, writes, stride, row)?;
    let op = if load { Op::Load { layer_id: 0, is_draft: false } } else { Op::Backup };
    let mut calls = Vec::with_capacity(hosts.len());
    for (h, d) in hosts.iter().zip(&devs) {
        let geometry = DeviceGeometry::new(PoolKind::Mla, row, dev_rows, 1, LayerMap::new(1))?
            .with_padding(PagePadding { page_bytes: ds, offset: 0 })?;
        let dev_side = DeviceSide::new(device, geometry, vec![vec![wrap(device, d)?]])?;
        let padding = Some(PagePadding { page_bytes: hs, offset: 0 });
        let sides = dev_side.with_host(Layout::LayerFirst, host_rows - 1, 1, Profile::Sglang, padding, vec![wrap(device, h)?])?;
        calls.push(Call::new(sides, op, IoBackend::Kernel, hi, di)?);
    }
    a.run(calls)
}

/// The overlap checks of strided layers: no destination layer may share a byte with a source
/// layer (spans), and two destination layers may share a span only where their rows interleave
/// without touching (sglang's page_first host layers: views `row` bytes apart, one `stride`),
/// i.e. their start addresses differ, modulo the stride, by at least a row either way.
fn strided_overlaps(reads: &[Arg<'_>], writes: &[Arg<'_>], stride: u64, row: u64) -> Result<()> {
    let span = |t: &RawTensor| (t.memory, t.addr, t.addr.saturating_add(t.len));
    let meets = |a: &RawTensor, b: &RawTensor| {
        let ((am, a0, a1), (bm, b0, b1)) = (span(a), span(b));
        am == bm && a0 < b1 && b0 < a1 && a.len > 0 && b.len > 0
    };
    for (i, w) in writes.iter().enumerate() {
        if let Some(r) = reads.iter().find(|r| meets(w.t, r.t)) {
            return Err(bad(&w.name, format!("destination overlaps {}", r.name)));
        }
        for o in &writes[i + 1..] {
            let apart = w.t.addr.abs_diff(o.t.addr) % stride;
            if meets(w.t, o.t) && (apart < row || stride - apart < row) {
                return Err(bad(&o.name, format!("destination rows overlap {}", w.name)));
            }
        }
    }
    Ok(())
}
