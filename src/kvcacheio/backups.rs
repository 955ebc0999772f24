//! All-layer backups into a host layout, and the one-layer backups sglang lacks.

use super::args::{refs, OpArgs};
use super::catalogue::spec::ArgKind;
use super::*;
use crate::exec::Device;
use crate::geometry::{IoBackend, Layout, Profile};
use crate::plan::Op;
use crate::Result;

/// [`Shape::LayoutBackup`](super::catalogue::Shape::LayoutBackup): every layer of the source
/// layer lists into its layer of a page_first, page_head, head-group-major page_first_direct
/// or page_unified host buffer (`dst_layout_dim = num_layers × item_size`; `head_num` counts head groups in the
/// last). The head-group layout checks sglang's integers first, and empty index lists are a
/// no-op once they pass.
pub(super) fn layout_backup(device: &Device, a: &OpArgs<'_, '_>, layout: Layout) -> Result<()> {
    let (hi, di) = a.indices()?;
    let (item_size, dim) = (a.int("item_size")?, a.int("dst_layout_dim")?);
    let (page_size, head_num) = (a.int_or("page_size", 1)?, a.int_or("head_num", 1)?);
    if layout == Layout::PageFirstDirectHeadGroups {
        head_group_args(item_size, "dst_layout_dim", dim, page_size, head_num)?;
    }
    let item = launcher(hi, di, item_size)?;
    // sglang's head-group kernels return on empty lists once their checks pass.
    if layout == Layout::PageFirstDirectHeadGroups && hi.is_empty() {
        return earlier_reports(device);
    }
    let (page, heads) = (positive("page_size", page_size)?, positive("head_num", head_num)?);
    let layers = layers_of("dst_layout_dim", dim, item)?;
    let src = a.lists(&[ArgKind::InLayers]);
    let dst = a.tensors(ArgKind::Out);
    let named = named_lists(&src, layers)?;
    check_overlaps(&named.iter().flatten().cloned().collect::<Vec<_>>(), &dst)?;
    let kind = kind_of(src.len());
    let dev = device_side(device, kind, item, page, &named.iter().map(|l| l.iter().collect()).collect::<Vec<_>>())?;
    let slots = paged_slots(&refs(&dst), slot_bytes(layout, kind, item, layers)?, page)?;
    let sides = host_side(dev, layout, heads, Profile::Sglang, &refs(&dst), slots)?;
    let (h, d) = backup_lists(hi, di);
    a.run(vec![Call::new(sides, Op::Backup, IoBackend::Kernel, h, d)?])
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

/// [`Shape::LayerBackup`](super::catalogue::Shape::LayerBackup): one device layer into layer
/// `layer_id` of a page_first host buffer (`dst_layout_dim = L × item_size`). sglang has no such
/// op ("without a per-layer LF->PF kernel"); profile `extended`.
pub(super) fn layer_backup(device: &Device, a: &OpArgs<'_, '_>) -> Result<()> {
    let (hi, di) = a.indices()?;
    let item = launcher(hi, di, a.int("item_size")?)?;
    let layers = layers_of("dst_layout_dim", a.int("dst_layout_dim")?, item)?;
    let layer_id = layer_index(a.int("layer_id")?)?;
    let (src, dst) = (a.tensors(ArgKind::In), a.tensors(ArgKind::Out));
    check_overlaps_kernel(&src, &dst)?;
    let dev = one_layer_device(device, kind_of(src.len()), item, 1, layers, &refs(&src))?;
    let slots = paged_slots(&refs(&dst), item * layers, 1)?;
    let sides = host_side(dev, Layout::PageFirst, 1, Profile::Extended, &refs(&dst), slots)?;
    let (h, d) = backup_lists(hi, di);
    a.run(vec![Call::new(sides, Op::BackupLayer { layer_id, is_draft: false }, IoBackend::Kernel, h, d)?])
}

/// [`Shape::DirectLayerBackup`](super::catalogue::Shape::DirectLayerBackup): one device layer
/// into layer `layer_id` of page_first_direct host buffers, whole pages (`src_ptrs`: `[K, V]` or
/// `[C]` device layer; `dst_ptrs`: `[K, V]` or `[C]` host buffers `[pages][L][P][...]`). sglang
/// only backs up all layers this way; profile `extended`.
pub(super) fn direct_layer_backup(device: &Device, args: &OpArgs<'_, '_>) -> Result<()> {
    let (src_indices, dst_indices) = args.host_indices()?;
    let (src_ptrs, dst_ptrs) = (args.list(ArgKind::InList)?, args.list(ArgKind::OutList)?);
    let a = Pfd::new(dst_ptrs, src_ptrs, src_indices, dst_indices, args.int("page_size")?, true)?;
    if a.dev_layers() != 1 {
        return Err(bad(src_ptrs.0, format!("one device layer per component expected, got {}", a.dev_layers())));
    }
    let layer_id = layer_index(args.int("layer_id")?)?;
    let dev = one_layer_device(device, a.kind, a.item, a.page, a.layers, &a.dev_layer(0))?;
    let sides = a.host_side(dev, Profile::Extended)?;
    let (hi, di) = backup_lists(src_indices, dst_indices);
    args.run(vec![Call::new(sides, Op::BackupLayer { layer_id, is_draft: false }, IoBackend::Direct, hi.into(), di.into())?])
}
