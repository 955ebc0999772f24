//! All-layer copies between layer lists (`kernel`) and `transfer_kv_direct`.

use super::*;
use crate::exec::Device;
use crate::geometry::{IoBackend, PoolKind};
use crate::{Result, TransferError};

// ---- all-layer copies between layer lists ------------------------------------------------

/// sgl-kernel's first check of the all-layer `kernel` ops: the source layer table holds
/// `num_layers` entries (`mla`: the MLA ops' wording). Bindings that read their arguments
/// before calling an op make it first too, so that it keeps its place in sglang's order.
pub fn check_num_layers(mla: bool, num_layers: i64, table_len: usize) -> Result<()> {
    if num_layers != table_len as i64 {
        return Err(TransferError::NumLayersMismatch { which: if mla { "" } else { "k " }, num_layers, table_len });
    }
    Ok(())
}

/// `transfer_kv_all_layer`: every layer `j < num_layers`, `src_*_layers[j]` → `dst_*_layers[j]`
/// (layer_first both sides; sglang passes device tables of layer base pointers).
pub fn transfer_kv_all_layer<'i>(
    device: &Device,
    src_k_layers: &[RawTensor],
    dst_k_layers: &[RawTensor],
    src_v_layers: &[RawTensor],
    dst_v_layers: &[RawTensor],
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    item_size: i64,
    num_layers: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_all_layer", src_indices, dst_indices);
    check_num_layers(false, num_layers, src_k_layers.len())?;
    let lists =
        [("src_k_layers", src_k_layers), ("src_v_layers", src_v_layers), ("dst_k_layers", dst_k_layers), ("dst_v_layers", dst_v_layers)];
    layer_lists(device, PoolKind::Mha, &lists, IoBackend::Kernel, src_indices, dst_indices, Some(item_size))
}

/// `transfer_kv_all_layer_mla`: [`transfer_kv_all_layer`] with one buffer per layer.
pub fn transfer_kv_all_layer_mla<'i>(
    device: &Device,
    src_layers: &[RawTensor],
    dst_layers: &[RawTensor],
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    item_size: i64,
    num_layers: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_all_layer_mla", src_indices, dst_indices);
    check_num_layers(true, num_layers, src_layers.len())?;
    let lists = [("src_layers", src_layers), ("dst_layers", dst_layers)];
    layer_lists(device, PoolKind::Mla, &lists, IoBackend::Kernel, src_indices, dst_indices, Some(item_size))
}

/// `transfer_kv_direct`: for every layer `j`, the coalesced runs of consecutive index pairs,
/// `src_layers[j]` → `dst_layers[j]` (rows along dimension 0). `page_size` only gates the
/// index count, as in sglang.
pub fn transfer_kv_direct(
    device: &Device,
    src_layers: &[RawTensor],
    dst_layers: &[RawTensor],
    src_indices: &[i64],
    dst_indices: &[i64],
    page_size: i64,
) -> Result<()> {
    if src_layers.len() != dst_layers.len() {
        return Err(TransferError::LayerListMismatch { src_len: src_layers.len(), dst_len: dst_layers.len() });
    }
    direct_counts(src_indices, dst_indices, page_size)?;
    let lists = [("src_layers", src_layers), ("dst_layers", dst_layers)];
    layer_lists(device, PoolKind::Mla, &lists, IoBackend::Direct, src_indices.into(), dst_indices.into(), None)
}

/// The checks of sglang's direct ops, in their order.
pub(super) fn direct_counts(hi: &[i64], di: &[i64], page_size: i64) -> Result<()> {
    if hi.len() != di.len() {
        return Err(TransferError::LengthMismatch { src_len: hi.len(), dst_len: di.len() });
    }
    if page_size <= 0 {
        return Err(TransferError::PageSizeNotPositive);
    }
    if !(hi.len() as u64).is_multiple_of(page_size as u64) {
        return Err(TransferError::DirectCountNotPageMultiple { len: hi.len(), page_size: page_size as u64 });
    }
    Ok(())
}

/// Layer `j` of the source lists → layer `j` of the destination lists, one pool pair per layer
/// (`lists`: source components, then destination components).
pub(super) fn layer_lists(
    device: &Device,
    kind: PoolKind,
    lists: &[(&str, &[RawTensor])],
    io: IoBackend,
    hi: Indices<'_>,
    di: Indices<'_>,
    item_size: Option<i64>,
) -> Result<()> {
    // `kernel`: sglang's item; `direct`: each layer's own row bytes.
    let item = match item_size {
        Some(size) => Some(launcher(hi, di, size)?),
        None => None,
    };
    let layers = lists[0].1.len();
    for (name, l) in lists {
        if l.len() != layers {
            return Err(bad(name, format!("has {} layers, the source has {layers}", l.len())));
        }
    }
    let comps = kind.components();
    let named: Vec<Vec<Arg<'_>>> =
        lists.iter().map(|(name, l)| l.iter().enumerate().map(|(j, t)| arg(format!("{name}[{j}]"), t)).collect()).collect();
    let (reads, writes): (Vec<&Vec<Arg<'_>>>, Vec<&Vec<Arg<'_>>>) = (named[..comps].iter().collect(), named[comps..].iter().collect());
    overlaps(
        &reads.iter().flat_map(|l| l.iter().cloned()).collect::<Vec<_>>(),
        &writes.iter().flat_map(|l| l.iter().cloned()).collect::<Vec<_>>(),
        io == IoBackend::Kernel,
    )?;
    if io == IoBackend::Direct {
        for j in 0..layers {
            for c in 0..comps {
                let (s, d) = (&reads[c][j], &writes[c][j]);
                if s.t.row_bytes() != d.t.row_bytes() {
                    return Err(bad(&d.name, format!("rows of {} bytes, the source's are {}", d.t.row_bytes(), s.t.row_bytes())));
                }
            }
        }
    }
    // Every layer is validated before the first one moves.
    let calls = (0..layers)
        .map(|j| {
            let src: Vec<&Arg<'_>> = reads.iter().map(|l| &l[j]).collect();
            let dst: Vec<&Arg<'_>> = writes.iter().map(|l| &l[j]).collect();
            let item = item.map_or_else(|| positive(&src[0].name, src[0].t.row_bytes() as i64), Ok)?;
            lf_pair(device, kind, item, &src, &dst, io, hi, di)
        })
        .collect::<Result<Vec<_>>>()?;
    run_all(calls)
}
