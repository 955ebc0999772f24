//! All-layer backups into a host layout, and the one-layer backups sglang lacks.

use super::*;
use crate::exec::Device;
use crate::geometry::{IoBackend, Layout, PoolKind, Profile};
use crate::plan::Op;
use crate::Result;

// ---- all-layer backups into a layout -----------------------------------------------------

/// `transfer_kv_all_layer_lf_pf`: every layer of the source lists → its layer of a page_first
/// host buffer (`dst_layout_dim = num_layers × item_size`).
pub fn transfer_kv_all_layer_lf_pf<'i>(
    device: &Device,
    src_k_layers: &[RawTensor],
    dst_k: &RawTensor,
    src_v_layers: &[RawTensor],
    dst_v: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    item_size: i64,
    dst_layout_dim: i64,
    num_layers: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_all_layer_lf_pf", src_indices, dst_indices);
    check_num_layers(false, num_layers, src_k_layers.len())?;
    let dst = kv(dst_k, dst_v, "dst_k", "dst_v");
    let src = [("src_k_layers", src_k_layers), ("src_v_layers", src_v_layers)];
    layout_backup(device, PoolKind::Mha, Layout::PageFirst, &src, &dst, src_indices, dst_indices, item_size, dst_layout_dim, 1, 1)
}

/// `transfer_kv_all_layer_mla_lf_pf`: [`transfer_kv_all_layer_lf_pf`] with one buffer.
pub fn transfer_kv_all_layer_mla_lf_pf<'i>(
    device: &Device,
    src_layers: &[RawTensor],
    dst: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    item_size: i64,
    dst_layout_dim: i64,
    num_layers: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_all_layer_mla_lf_pf", src_indices, dst_indices);
    check_num_layers(true, num_layers, src_layers.len())?;
    let d = [arg("dst", dst)];
    layout_backup(
        device,
        PoolKind::Mla,
        Layout::PageFirst,
        &[("src_layers", src_layers)],
        &d,
        src_indices,
        dst_indices,
        item_size,
        dst_layout_dim,
        1,
        1,
    )
}

/// `transfer_kv_all_layer_lf_ph`: every layer → its layer of a page_head host buffer.
pub fn transfer_kv_all_layer_lf_ph<'i>(
    device: &Device,
    src_k_layers: &[RawTensor],
    dst_k: &RawTensor,
    src_v_layers: &[RawTensor],
    dst_v: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    item_size: i64,
    dst_layout_dim: i64,
    num_layers: i64,
    page_size: i64,
    head_num: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_all_layer_lf_ph", src_indices, dst_indices);
    check_num_layers(false, num_layers, src_k_layers.len())?;
    let dst = kv(dst_k, dst_v, "dst_k", "dst_v");
    let src = [("src_k_layers", src_k_layers), ("src_v_layers", src_v_layers)];
    layout_backup(
        device,
        PoolKind::Mha,
        Layout::PageHead,
        &src,
        &dst,
        src_indices,
        dst_indices,
        item_size,
        dst_layout_dim,
        page_size,
        head_num,
    )
}

/// `transfer_kv_all_layer_lf_pfdhg`: every layer → its layer of a head-group-major
/// page_first_direct host buffer (`[pages][head_num][L][page_size][item / head_num]`,
/// `dst_layout_dim = num_layers × item_size`; `head_num` counts head groups). Empty index lists
/// are a no-op once the integers pass.
pub fn transfer_kv_all_layer_lf_pfdhg<'i>(
    device: &Device,
    src_k_layers: &[RawTensor],
    dst_k: &RawTensor,
    src_v_layers: &[RawTensor],
    dst_v: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    item_size: i64,
    dst_layout_dim: i64,
    num_layers: i64,
    page_size: i64,
    head_num: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_all_layer_lf_pfdhg", src_indices, dst_indices);
    check_num_layers(false, num_layers, src_k_layers.len())?;
    head_group_args(item_size, "dst_layout_dim", dst_layout_dim, page_size, head_num)?;
    launcher(src_indices, dst_indices, item_size)?;
    if src_indices.is_empty() {
        return earlier_reports(device);
    }
    let dst = kv(dst_k, dst_v, "dst_k", "dst_v");
    let src = [("src_k_layers", src_k_layers), ("src_v_layers", src_v_layers)];
    layout_backup(
        device,
        PoolKind::Mha,
        Layout::PageFirstDirectHeadGroups,
        &src,
        &dst,
        src_indices,
        dst_indices,
        item_size,
        dst_layout_dim,
        page_size,
        head_num,
    )
}

/// An all-layer backup of layer lists into a page_first / page_head host buffer (`kernel`).
pub(super) fn layout_backup(
    device: &Device,
    kind: PoolKind,
    layout: Layout,
    src: &[(&str, &[RawTensor])],
    dst: &[Arg<'_>],
    hi: Indices<'_>,
    di: Indices<'_>,
    item_size: i64,
    dst_layout_dim: i64,
    page_size: i64,
    head_num: i64,
) -> Result<()> {
    let item = launcher(hi, di, item_size)?;
    let (page, heads) = (positive("page_size", page_size)?, positive("head_num", head_num)?);
    let layers = layers_of("dst_layout_dim", dst_layout_dim, item)?;
    let named = named_lists(src, layers)?;
    check_overlaps(&named.iter().flatten().cloned().collect::<Vec<_>>(), dst)?;
    let dev = device_pool(device, kind, item, page, &named.iter().map(|l| l.iter().collect()).collect::<Vec<_>>())?;
    let dst_refs: Vec<&Arg<'_>> = dst.iter().collect();
    let slots = paged_slots(&dst_refs, item * layers, page)?;
    let host = host_pool(&dev, layout, heads, Profile::Sglang, &dst_refs, slots)?;
    let (h, d) = backup_lists(hi, di);
    run_all(vec![Call::new(dev, host, Op::Backup, IoBackend::Kernel, h, d)?])
}

/// A backup's (host, device) index lists from the op's (src = device, dst = host) lists.
pub(super) fn backup_lists<T>(src_indices: T, dst_indices: T) -> (T, T) {
    (dst_indices, src_indices)
}

/// Source layer lists with their names; each must hold `layers` tensors (sglang's layout_dim
/// says how many layers the host buffer has).
pub(super) fn named_lists<'a>(lists: &[(&str, &'a [RawTensor])], layers: u64) -> Result<Vec<Vec<Arg<'a>>>> {
    lists
        .iter()
        .map(|(name, l)| {
            if l.len() as u64 != layers {
                return Err(bad(name, format!("has {} layers, the layout dimension holds {layers}", l.len())));
            }
            Ok(l.iter().enumerate().map(|(j, t)| arg(format!("{name}[{j}]"), t)).collect())
        })
        .collect()
}

// ---- what sglang lacks: one-layer backups into page_first / page_first_direct ------------

/// One device layer → layer `layer_id` of a page_first host buffer (`dst_layout_dim =
/// L × item_size`). sglang has no such op ("without a per-layer LF->PF kernel"); profile
/// `extended`.
pub fn transfer_kv_per_layer_lf_pf<'i>(
    device: &Device,
    src_k: &RawTensor,
    dst_k: &RawTensor,
    src_v: &RawTensor,
    dst_v: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    layer_id: i64,
    item_size: i64,
    dst_layout_dim: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_per_layer_lf_pf", src_indices, dst_indices);
    let src = kv(src_k, src_v, "src_k", "src_v");
    let dst = kv(dst_k, dst_v, "dst_k", "dst_v");
    layer_backup(device, PoolKind::Mha, &src, &dst, src_indices, dst_indices, layer_id, item_size, dst_layout_dim)
}

/// [`transfer_kv_per_layer_lf_pf`] with one buffer (MLA, and the DSA indexer with page items).
pub fn transfer_kv_per_layer_mla_lf_pf<'i>(
    device: &Device,
    src: &RawTensor,
    dst: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    layer_id: i64,
    item_size: i64,
    dst_layout_dim: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_per_layer_mla_lf_pf", src_indices, dst_indices);
    let (s, d) = ([arg("src", src)], [arg("dst", dst)]);
    layer_backup(device, PoolKind::Mla, &s, &d, src_indices, dst_indices, layer_id, item_size, dst_layout_dim)
}

pub(super) fn layer_backup(
    device: &Device,
    kind: PoolKind,
    src: &[Arg<'_>],
    dst: &[Arg<'_>],
    hi: Indices<'_>,
    di: Indices<'_>,
    layer_id: i64,
    item_size: i64,
    dst_layout_dim: i64,
) -> Result<()> {
    let item = launcher(hi, di, item_size)?;
    let layers = layers_of("dst_layout_dim", dst_layout_dim, item)?;
    let layer_id = layer_index(layer_id)?;
    check_overlaps_kernel(src, dst)?;
    let dev = one_layer_device(device, kind, item, 1, layers, &src.iter().collect::<Vec<_>>())?;
    let dst_refs: Vec<&Arg<'_>> = dst.iter().collect();
    let slots = paged_slots(&dst_refs, item * layers, 1)?;
    let host = host_pool(&dev, Layout::PageFirst, 1, Profile::Extended, &dst_refs, slots)?;
    let (h, d) = backup_lists(hi, di);
    run_all(vec![Call::new(dev, host, Op::BackupLayer { layer_id, is_draft: false }, IoBackend::Kernel, h, d)?])
}

/// One device layer → layer `layer_id` of a page_first_direct host buffer, whole pages
/// (`src_ptrs`: `[K, V]` or `[C]` device layer; `dst_ptrs`: `[K, V]` or `[C]` host buffers
/// `[pages][L][P][...]`). sglang only backs up all layers this way; profile `extended`.
pub fn transfer_kv_per_layer_direct_lf_pf(
    device: &Device,
    src_ptrs: &[RawTensor],
    dst_ptrs: &[RawTensor],
    src_indices: &[i64],
    dst_indices: &[i64],
    layer_id: i64,
    page_size: i64,
) -> Result<()> {
    let a = Pfd::new(("dst_ptrs", dst_ptrs), ("src_ptrs", src_ptrs), src_indices, dst_indices, page_size, true)?;
    if a.dev_layers() != 1 {
        return Err(bad("src_ptrs", format!("one device layer per component expected, got {}", a.dev_layers())));
    }
    let layer_id = layer_index(layer_id)?;
    let dev = one_layer_device(device, a.kind, a.item, a.page, a.layers, &a.dev_layer(0))?;
    let host = a.host_pool(&dev, Profile::Extended)?;
    let (hi, di) = backup_lists(src_indices, dst_indices);
    run_all(vec![Call::new(dev, host, Op::BackupLayer { layer_id, is_draft: false }, IoBackend::Direct, hi.into(), di.into())?])
}
