//! Token copies between page-padded buffers: DeepSeek-V4's C4 caches.

use super::args::OpArgs;
use super::catalogue::ArgKind;
use super::*;
use crate::exec::Device;
use crate::geometry::{DeviceGeometry, IoBackend, LayerMap, Layout, PagePadding, PoolKind, Profile};
use crate::plan::Op;
use crate::pool::{DevicePool, HostPool, HostPoolConfig};
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
            let dev = DevicePool::wrap_geometry(device, geometry, vec![vec![wrap(device, w)?]])?;
            // HostPool rounds a requested size up to (size / P + 1) × P: ask for one page less.
            let config = HostPoolConfig {
                layout: Layout::LayerFirst,
                size: (src_pages - 1) * DSV4_PAGE_TOKENS,
                head_num: 1,
                profile: Profile::Sglang,
                integrity: Some(false),
            };
            let host = HostPool::from_buffers(&dev, &config, vec![wrap(device, r)?])?;
            calls.push(Call::new(dev, host, Op::Load { layer_id: 0, is_draft: false }, IoBackend::Kernel, si, di)?);
        }
    }
    a.run(calls)
}
