//! One-layer loads: layer_first, page_first, page_head and head-group-major host layers into
//! one device layer.

use super::*;
use crate::exec::Device;
use crate::geometry::{IoBackend, Layout, PoolKind, Profile};
use crate::plan::Op;
use crate::pool::DevicePool;
use crate::{Result, TransferError};

// ---- one-layer loads ---------------------------------------------------------------------

/// `transfer_kv_per_layer`: one layer, layer_first to layer_first. `src_k[s]`, `src_v[s]`
/// (items of `item_size` bytes) → `dst_k[d]`, `dst_v[d]`; negative indices are skipped.
pub fn transfer_kv_per_layer<'i>(
    device: &Device,
    src_k: &RawTensor,
    dst_k: &RawTensor,
    src_v: &RawTensor,
    dst_v: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    item_size: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_per_layer", src_indices, dst_indices);
    let item = launcher(src_indices, dst_indices, item_size)?;
    let src = kv(src_k, src_v, "src_k", "src_v");
    let dst = kv(dst_k, dst_v, "dst_k", "dst_v");
    check_overlaps_kernel(&src, &dst)?;
    let call = lf_pair(device, PoolKind::Mha, item, &[&src[0], &src[1]], &[&dst[0], &dst[1]], IoBackend::Kernel, src_indices, dst_indices)?;
    run_all(vec![call])
}

/// `transfer_kv_per_layer_mla`: [`transfer_kv_per_layer`] with one buffer.
pub fn transfer_kv_per_layer_mla<'i>(
    device: &Device,
    src: &RawTensor,
    dst: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    item_size: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_per_layer_mla", src_indices, dst_indices);
    let item = launcher(src_indices, dst_indices, item_size)?;
    let (s, d) = (arg("src", src), arg("dst", dst));
    check_overlaps(std::slice::from_ref(&s), std::slice::from_ref(&d))?;
    let call = lf_pair(device, PoolKind::Mla, item, &[&s], &[&d], IoBackend::Kernel, src_indices, dst_indices)?;
    run_all(vec![call])
}

/// One layer_first layer to another: the source as a one-layer layer_first host pool, the
/// destination as a one-layer device pool.
pub(super) fn lf_pair(
    device: &Device,
    kind: PoolKind,
    item: u64,
    src: &[&Arg<'_>],
    dst: &[&Arg<'_>],
    io: IoBackend,
    hi: Indices<'_>,
    di: Indices<'_>,
) -> Result<Call> {
    let dev = device_pool(device, kind, item, 1, &dst.iter().map(|a| vec![*a]).collect::<Vec<_>>())?;
    let slots = common_slots(src, item)?;
    let host = host_pool(&dev, Layout::LayerFirst, 1, Profile::Sglang, src, slots)?;
    Call::new(dev, host, Op::Load { layer_id: 0, is_draft: false }, io, hi, di)
}

/// A device pool of `layers` slots per component where every slot is the caller's one layer
/// (the plan of a one-layer call addresses slot `layer_id` alone).
pub(super) fn one_layer_device(
    device: &Device,
    kind: PoolKind,
    item: u64,
    page: u64,
    layers: u64,
    comps: &[&Arg<'_>],
) -> Result<DevicePool<'static>> {
    let n = usize::try_from(layers)
        .ok()
        .filter(|&n| n <= crate::geometry::MAX_LAYERS)
        .ok_or_else(|| bad(&comps[0].name, format!("{layers} layers exceed the limit of {}", crate::geometry::MAX_LAYERS)))?;
    device_pool(device, kind, item, page, &comps.iter().map(|a| vec![*a; n]).collect::<Vec<_>>())
}

pub(super) fn layer_index(layer_id: i64) -> Result<usize> {
    usize::try_from(layer_id).map_err(|_| bad("layer_id", format!("must not be negative, got {layer_id}")))
}

/// `transfer_kv_per_layer_pf_lf`: layer `layer_id` of a page_first host buffer
/// (`[slots][L][item]`, `src_layout_dim = L × item_size`) → one layer_first device layer.
pub fn transfer_kv_per_layer_pf_lf<'i>(
    device: &Device,
    src_k: &RawTensor,
    dst_k: &RawTensor,
    src_v: &RawTensor,
    dst_v: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    layer_id: i64,
    item_size: i64,
    src_layout_dim: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_per_layer_pf_lf", src_indices, dst_indices);
    let src = kv(src_k, src_v, "src_k", "src_v");
    let dst = kv(dst_k, dst_v, "dst_k", "dst_v");
    paged_load(device, PoolKind::Mha, Layout::PageFirst, &src, &dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim, 1, 1)
}

/// `transfer_kv_per_layer_mla_pf_lf`: [`transfer_kv_per_layer_pf_lf`] with one buffer.
pub fn transfer_kv_per_layer_mla_pf_lf<'i>(
    device: &Device,
    src: &RawTensor,
    dst: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    layer_id: i64,
    item_size: i64,
    src_layout_dim: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_per_layer_mla_pf_lf", src_indices, dst_indices);
    let (s, d) = ([arg("src", src)], [arg("dst", dst)]);
    paged_load(device, PoolKind::Mla, Layout::PageFirst, &s, &d, src_indices, dst_indices, layer_id, item_size, src_layout_dim, 1, 1)
}

/// `transfer_kv_per_layer_ph_lf`: layer `layer_id` of a page_head host buffer
/// (`[pages][head_num][page_size][L][item / head_num]`) → one layer_first device layer.
pub fn transfer_kv_per_layer_ph_lf<'i>(
    device: &Device,
    src_k: &RawTensor,
    dst_k: &RawTensor,
    src_v: &RawTensor,
    dst_v: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    layer_id: i64,
    item_size: i64,
    src_layout_dim: i64,
    page_size: i64,
    head_num: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_per_layer_ph_lf", src_indices, dst_indices);
    let src = kv(src_k, src_v, "src_k", "src_v");
    let dst = kv(dst_k, dst_v, "dst_k", "dst_v");
    paged_load(
        device,
        PoolKind::Mha,
        Layout::PageHead,
        &src,
        &dst,
        src_indices,
        dst_indices,
        layer_id,
        item_size,
        src_layout_dim,
        page_size,
        head_num,
    )
}

/// The checks of sglang's head-group kernels on their integers, before any tensor is looked
/// at: a positive page and group count, groups that split the item evenly into whole 8-byte
/// words, and a layout dimension of whole items.
pub(super) fn head_group_args(item_size: i64, layout_dim_name: &'static str, layout_dim: i64, page_size: i64, head_num: i64) -> Result<()> {
    let arg = |arg: &'static str, value: i64, message: String| TransferError::BadArgument { arg, value, message };
    if page_size <= 0 {
        return Err(arg("page_size", page_size, format!("page_size must be positive, got {page_size}")));
    }
    if head_num <= 0 {
        return Err(arg("head_num", head_num, format!("head_num (head groups) must be positive, got {head_num}")));
    }
    if item_size <= 0 || item_size % head_num != 0 {
        return Err(arg("item_size", item_size, format!("item_size {item_size} must be a positive multiple of head_num {head_num}")));
    }
    let group = item_size / head_num;
    if group % 8 != 0 {
        return Err(arg(
            "head_num",
            head_num,
            format!("Per-head-group bytes {group} (item_size {item_size} / head_num {head_num}) must be a multiple of 8"),
        ));
    }
    if layout_dim <= 0 || layout_dim % item_size != 0 {
        return Err(arg(
            layout_dim_name,
            layout_dim,
            format!("{layout_dim_name} {layout_dim} must be a positive multiple of item_size {item_size}"),
        ));
    }
    Ok(())
}

/// `transfer_kv_per_layer_pfdhg_lf`: layer `layer_id` of a head-group-major page_first_direct
/// host buffer (`[pages][head_num][L][page_size][item / head_num]`, `src_layout_dim = L ×
/// item_size`; `head_num` counts head groups) → one layer_first device layer. Empty index lists
/// are a no-op once the integers pass.
pub fn transfer_kv_per_layer_pfdhg_lf<'i>(
    device: &Device,
    src_k: &RawTensor,
    dst_k: &RawTensor,
    src_v: &RawTensor,
    dst_v: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    layer_id: i64,
    item_size: i64,
    src_layout_dim: i64,
    page_size: i64,
    head_num: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_per_layer_pfdhg_lf", src_indices, dst_indices);
    head_group_args(item_size, "src_layout_dim", src_layout_dim, page_size, head_num)?;
    launcher(src_indices, dst_indices, item_size)?;
    if src_indices.is_empty() {
        return earlier_reports(device);
    }
    let src = kv(src_k, src_v, "src_k", "src_v");
    let dst = kv(dst_k, dst_v, "dst_k", "dst_v");
    paged_load(
        device,
        PoolKind::Mha,
        Layout::PageFirstDirectHeadGroups,
        &src,
        &dst,
        src_indices,
        dst_indices,
        layer_id,
        item_size,
        src_layout_dim,
        page_size,
        head_num,
    )
}

/// Host slots of a page_first / page_head buffer: whole pages of `P × layout_dim` bytes.
pub(super) fn paged_slots(comps: &[&Arg<'_>], layout_dim: u64, p: u64) -> Result<u64> {
    let page = layout_dim.checked_mul(p).ok_or_else(|| bad(&comps[0].name, "page bytes overflow"))?;
    Ok(common_slots(comps, page)? * p)
}

/// A load of `layer_id` from a page_first / page_head host buffer (`kernel`).
pub(super) fn paged_load(
    device: &Device,
    kind: PoolKind,
    layout: Layout,
    src: &[Arg<'_>],
    dst: &[Arg<'_>],
    hi: Indices<'_>,
    di: Indices<'_>,
    layer_id: i64,
    item_size: i64,
    src_layout_dim: i64,
    page_size: i64,
    head_num: i64,
) -> Result<()> {
    let item = launcher(hi, di, item_size)?;
    let (page, heads) = (positive("page_size", page_size)?, positive("head_num", head_num)?);
    let layers = layers_of("src_layout_dim", src_layout_dim, item)?;
    let layer_id = layer_index(layer_id)?;
    check_overlaps_kernel(src, dst)?;
    let dst_refs: Vec<&Arg<'_>> = dst.iter().collect();
    let src_refs: Vec<&Arg<'_>> = src.iter().collect();
    let dev = one_layer_device(device, kind, item, page, layers, &dst_refs)?;
    let slots = paged_slots(&src_refs, item * layers, page)?;
    let host = host_pool(&dev, layout, heads, Profile::Sglang, &src_refs, slots)?;
    run_all(vec![Call::new(dev, host, Op::Load { layer_id, is_draft: false }, IoBackend::Kernel, hi, di)?])
}
