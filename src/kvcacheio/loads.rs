//! One-layer loads: layer_first, page_first, page_head and head-group-major host layers into
//! one device layer.

use super::args::{refs, OpArgs};
use super::catalogue::spec::ArgKind;
use super::*;
use crate::exec::Device;
use crate::geometry::{IoBackend, Layout, PoolKind, Profile};
use crate::plan::Op;
use crate::{Result, TransferError};

/// [`Shape::LayerPair`](super::catalogue::Shape::LayerPair): `transfer_kv_per_layer` and its
/// MLA twin, one layer_first layer to another.
pub(super) fn layer_pair(device: &Device, a: &OpArgs<'_, '_>) -> Result<()> {
    let (hi, di) = a.indices()?;
    let item = launcher(hi, di, a.int("item_size")?)?;
    let (src, dst) = (a.tensors(ArgKind::In), a.tensors(ArgKind::Out));
    check_overlaps_kernel(&src, &dst)?;
    let call = lf_pair(device, kind_of(src.len()), item, &refs(&src), &refs(&dst), IoBackend::Kernel, hi, di)?;
    a.run(vec![call])
}

/// One layer_first layer to another: the source as a one-layer layer_first host side, the
/// destination as a one-layer device side.
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
    let dev = device_side(device, kind, item, 1, &dst.iter().map(|a| vec![*a]).collect::<Vec<_>>())?;
    let slots = common_slots(src, item)?;
    let sides = host_side(dev, Layout::LayerFirst, 1, Profile::Sglang, src, slots)?;
    Call::new(sides, Op::Load { layer_id: 0, is_draft: false }, io, hi, di)
}

/// A device side of `layers` slots per component where every slot is the caller's one layer
/// (the plan of a one-layer call addresses slot `layer_id` alone).
pub(super) fn one_layer_device(
    device: &Device,
    kind: PoolKind,
    item: u64,
    page: u64,
    layers: u64,
    comps: &[&Arg<'_>],
) -> Result<DeviceSide> {
    let n = usize::try_from(layers)
        .ok()
        .filter(|&n| n <= crate::geometry::MAX_LAYERS)
        .ok_or_else(|| bad(&comps[0].name, format!("{layers} layers exceed the limit of {}", crate::geometry::MAX_LAYERS)))?;
    device_side(device, kind, item, page, &comps.iter().map(|a| vec![*a; n]).collect::<Vec<_>>())
}

pub(super) fn layer_index(layer_id: i64) -> Result<usize> {
    usize::try_from(layer_id).map_err(|_| bad("layer_id", format!("must not be negative, got {layer_id}")))
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

/// Bytes one token slot takes in a host buffer of `layout`: `L × item`, times the components for
/// page_unified (whose one buffer holds K and V).
pub(super) fn slot_bytes(layout: Layout, kind: crate::geometry::PoolKind, item: u64, layers: u64) -> Result<u64> {
    let comps = if layout == Layout::PageUnified { kind.components() as u64 } else { 1 };
    item.checked_mul(layers).and_then(|b| b.checked_mul(comps)).ok_or_else(|| bad("item_size", "layout bytes overflow"))
}

/// Host slots of a page_first / page_head buffer: whole pages of `P × layout_dim` bytes.
pub(super) fn paged_slots(comps: &[&Arg<'_>], layout_dim: u64, p: u64) -> Result<u64> {
    let page = layout_dim.checked_mul(p).ok_or_else(|| bad(&comps[0].name, "page bytes overflow"))?;
    Ok(common_slots(comps, page)? * p)
}

/// [`Shape::PagedLoad`](super::catalogue::Shape::PagedLoad): layer `layer_id` of a page_first
/// (`[slots][L][item]`), page_head (`[pages][head_num][page_size][L][item / head_num]`) or
/// head-group-major page_first_direct (`[pages][head_num][L][page_size][item / head_num]`,
/// `head_num` counting head groups) host buffer, or the one page_unified buffer
/// (`[pages][head_num][L][C][page_size][item / head_num]`), into one layer_first device layer;
/// `src_layout_dim = L × item_size`. The head-group layout checks sglang's integers first, and
/// empty index lists are a no-op once they pass.
pub(super) fn paged_load(device: &Device, a: &OpArgs<'_, '_>, layout: Layout) -> Result<()> {
    let (hi, di) = a.indices()?;
    let (item_size, dim) = (a.int("item_size")?, a.int("src_layout_dim")?);
    let (page_size, head_num) = (a.int_or("page_size", 1)?, a.int_or("head_num", 1)?);
    if layout == Layout::PageFirstDirectHeadGroups {
        head_group_args(item_size, "src_layout_dim", dim, page_size, head_num)?;
    }
    let item = launcher(hi, di, item_size)?;
    // sglang's head-group kernels return on empty lists once their checks pass.
    if layout == Layout::PageFirstDirectHeadGroups && hi.is_empty() {
        return earlier_reports(device);
    }
    let (page, heads) = (positive("page_size", page_size)?, positive("head_num", head_num)?);
    let layers = layers_of("src_layout_dim", dim, item)?;
    let layer_id = layer_index(a.int("layer_id")?)?;
    let (src, dst) = (a.tensors(ArgKind::In), a.tensors(ArgKind::Out));
    check_overlaps_kernel(&src, &dst)?;
    let kind = kind_of(dst.len());
    let dev = one_layer_device(device, kind, item, page, layers, &refs(&dst))?;
    let slots = paged_slots(&refs(&src), slot_bytes(layout, kind, item, layers)?, page)?;
    let sides = host_side(dev, layout, heads, Profile::Sglang, &refs(&src), slots)?;
    a.run(vec![Call::new(sides, Op::Load { layer_id, is_draft: false }, IoBackend::Kernel, hi, di)?])
}
