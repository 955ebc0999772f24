//! page_first_direct: whole pages between a host buffer `[pages][L][P][...]` and device layers.

use super::args::OpArgs;
use super::catalogue::spec::ArgKind;
use super::*;
use crate::exec::Device;
use crate::geometry::{IoBackend, Layout, PoolKind, Profile};
use crate::plan::Op;
use crate::Result;

/// A page_first_direct host buffer's geometry from its shape `[pages][L][P][...]`:
/// `(layers, token slots, bytes per token)`.
pub(super) fn pfd_shape(a: &Arg<'_>, page_size: u64) -> Result<(u64, u64, u64)> {
    let d = a.t.dims();
    if d.len() < 3 || d[2] != page_size || d[..3].contains(&0) {
        return Err(bad(&a.name, format!("shape {d:?} is not [pages, layers, page_size = {page_size}, ...]")));
    }
    let tokens = d[0].checked_mul(d[1]).and_then(|x| x.checked_mul(d[2])).ok_or_else(|| bad(&a.name, "shape overflows"))?;
    if !a.t.len.is_multiple_of(tokens) {
        return Err(bad(&a.name, format!("{} bytes are not whole tokens of shape {d:?}", a.t.len)));
    }
    Ok((d[1], d[0] * d[2], a.t.len / tokens))
}

/// Splits sglang's direct pointer list `[K layers…, V layers…]` (or one MLA list) into
/// components; `mla` is decided from the other list's length, as sglang does.
pub(super) fn split_layers<'a>(name: &str, list: &'a [RawTensor], mla: bool) -> Result<Vec<Vec<Arg<'a>>>> {
    let comps = if mla { 1 } else { 2 };
    if list.is_empty() || !list.len().is_multiple_of(comps) {
        return Err(bad(name, format!("{} tensors do not split into {comps} equal component lists", list.len())));
    }
    let n = list.len() / comps;
    Ok((0..comps).map(|c| (0..n).map(|j| arg(format!("{name}[{}]", c * n + j), &list[c * n + j])).collect()).collect())
}

/// The page_first_direct components: one (MLA) or two (MHA) host tensors of one shape.
pub(super) fn pfd_host<'a>(name: &str, list: &'a [RawTensor], page: u64) -> Result<(Vec<Arg<'a>>, (u64, u64, u64))> {
    if list.is_empty() || list.len() > 2 {
        return Err(bad(name, format!("expected 1 (MLA) or 2 (K, V) page_first_direct buffers, got {}", list.len())));
    }
    let args: Vec<Arg<'a>> = list.iter().enumerate().map(|(i, t)| arg(format!("{name}[{i}]"), t)).collect();
    let shape = pfd_shape(&args[0], page)?;
    for a in &args[1..] {
        if pfd_shape(a, page)? != shape {
            return Err(bad(&a.name, format!("shape {:?} differs from {}'s", a.t.dims(), args[0].name)));
        }
    }
    Ok((args, shape))
}

/// The arguments of a page_first_direct op, checked in sglang's order (the counts first), then
/// ours: the host buffers' shape, the device layer list split into components with rows of one
/// host token, and no destination overlapping another argument.
pub(super) struct Pfd<'a> {
    host: Vec<Arg<'a>>,
    /// Device layers `[component][layer]`.
    dev: Vec<Vec<Arg<'a>>>,
    /// Host layers, token slots and bytes per token.
    pub(super) layers: u64,
    slots: u64,
    pub(super) item: u64,
    pub(super) page: u64,
    pub(super) kind: PoolKind,
}

impl<'a> Pfd<'a> {
    /// `host_is_dst`: the op writes the host buffers (a backup) rather than the device layers.
    pub(super) fn new(
        host: (&str, &'a [RawTensor]),
        dev: (&str, &'a [RawTensor]),
        src_indices: &[i64],
        dst_indices: &[i64],
        page_size: i64,
        host_is_dst: bool,
    ) -> Result<Pfd<'a>> {
        direct_counts(src_indices, dst_indices, page_size)?;
        let page = page_size as u64;
        let (host_args, (layers, slots, item)) = pfd_host(host.0, host.1, page)?;
        let dev_lists = split_layers(dev.0, dev.1, host_args.len() == 1)?;
        check_rows(&dev_lists, item)?;
        let dev_flat: Vec<Arg<'a>> = dev_lists.iter().flatten().cloned().collect();
        if host_is_dst {
            check_overlaps(&dev_flat, &host_args)?;
        } else {
            check_overlaps(&host_args, &dev_flat)?;
        }
        let kind = if host_args.len() == 1 { PoolKind::Mla } else { PoolKind::Mha };
        Ok(Pfd { host: host_args, dev: dev_lists, layers, slots, item, page, kind })
    }

    /// Device layers per component.
    pub(super) fn dev_layers(&self) -> usize {
        self.dev[0].len()
    }

    /// Device layer `j` of every component.
    pub(super) fn dev_layer(&self, j: usize) -> Vec<&Arg<'a>> {
        self.dev.iter().map(|l| &l[j]).collect()
    }

    /// The host side over these buffers against `dev`.
    pub(super) fn host_side(&self, dev: DeviceSide, profile: Profile) -> Result<Sides> {
        host_side(dev, Layout::PageFirstDirect, 1, profile, &self.host.iter().collect::<Vec<_>>(), self.slots)
    }
}

/// [`Shape::DirectLoad`](super::catalogue::Shape::DirectLoad): layer `layer_id + j` of
/// page_first_direct host buffers → device layer `j` (`src_ptrs`: `[K]` or `[K, V]` host buffers
/// `[pages][L][P][...]`; `dst_ptrs`: the device layers, K then V). Whole pages only; page-aligned
/// indices.
pub(super) fn direct_load(device: &Device, args: &OpArgs<'_, '_>) -> Result<()> {
    let (src_indices, dst_indices) = args.host_indices()?;
    let (src_ptrs, dst_ptrs) = (args.list(ArgKind::InList)?, args.list(ArgKind::OutList)?);
    let a = Pfd::new(src_ptrs, dst_ptrs, src_indices, dst_indices, args.int("page_size")?, false)?;
    let layer_id = layer_index(args.int("layer_id")?)?;
    // Device layer j is host layer layer_id + j: one call per device layer, each validated first.
    let calls = (0..a.dev_layers())
        .map(|j| {
            let dev = one_layer_device(device, a.kind, a.item, a.page, a.layers, &a.dev_layer(j))?;
            let sides = a.host_side(dev, Profile::Sglang)?;
            Call::new(
                sides,
                Op::Load { layer_id: layer_id + j, is_draft: false },
                IoBackend::Direct,
                src_indices.into(),
                dst_indices.into(),
            )
        })
        .collect::<Result<Vec<_>>>()?;
    args.run(calls)
}

/// [`Shape::DirectBackup`](super::catalogue::Shape::DirectBackup): every device layer → its
/// layer of page_first_direct host buffers (`src_ptrs`: K layers then V layers, or the MLA
/// layers; `dst_ptrs`: `[K]` or `[K, V]` host buffers `[pages][L][P][...]`).
pub(super) fn direct_backup(device: &Device, args: &OpArgs<'_, '_>) -> Result<()> {
    let (src_indices, dst_indices) = args.host_indices()?;
    let (src_ptrs, dst_ptrs) = (args.list(ArgKind::InList)?, args.list(ArgKind::OutList)?);
    let a = Pfd::new(dst_ptrs, src_ptrs, src_indices, dst_indices, args.int("page_size")?, true)?;
    if a.dev_layers() as u64 != a.layers {
        return Err(bad(src_ptrs.0, format!("{} layers per component, the host buffers hold {}", a.dev_layers(), a.layers)));
    }
    let dev = device_side(device, a.kind, a.item, a.page, &a.dev.iter().map(|l| l.iter().collect()).collect::<Vec<_>>())?;
    let sides = a.host_side(dev, Profile::Sglang)?;
    let (hi, di) = backup_lists(src_indices, dst_indices);
    args.run(vec![Call::new(sides, Op::Backup, IoBackend::Direct, hi.into(), di.into())?])
}

pub(super) fn check_rows(lists: &[Vec<Arg<'_>>], item: u64) -> Result<()> {
    for a in lists.iter().flatten() {
        if a.t.row_bytes() != item {
            return Err(bad(&a.name, format!("rows of {} bytes, the host's tokens are {item}", a.t.row_bytes())));
        }
    }
    Ok(())
}
