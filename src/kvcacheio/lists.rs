//! All-layer copies between layer lists (`kernel`) and `transfer_kv_direct`.

use super::args::OpArgs;
use super::catalogue::spec::ArgKind;
use super::*;
use crate::exec::Device;
use crate::geometry::{IoBackend, PoolKind};
use crate::{Result, TransferError};

/// sgl-kernel's first check of the all-layer `kernel` ops: the source layer table holds
/// `num_layers` entries (`mla`: the MLA ops' wording). Bindings that read their arguments
/// before calling an op make it first too, so that it keeps its place in sglang's order.
pub fn check_num_layers(mla: bool, num_layers: i64, table_len: usize) -> Result<()> {
    if num_layers != table_len as i64 {
        return Err(TransferError::NumLayersMismatch { which: if mla { "" } else { "k " }, num_layers, table_len });
    }
    Ok(())
}

/// [`Shape::LayerLists`](super::catalogue::Shape::LayerLists): for every layer `j`, the source
/// lists' layer `j` → the destination lists' layer `j` (layer_first both sides). `kernel`
/// (`transfer_kv_all_layer`, `_mla`): items of `item_size`, sglang passing device tables of
/// layer base pointers. `direct` (`transfer_kv_direct`): coalesced runs of consecutive index
/// pairs, rows along dimension 0; `page_size` only gates the index count, as in sglang.
pub(super) fn layer_lists_op(device: &Device, a: &OpArgs<'_, '_>, io: IoBackend) -> Result<()> {
    let src = a.lists(&[ArgKind::InLayers, ArgKind::InList]);
    let dst = a.lists(&[ArgKind::OutLayers, ArgKind::OutList]);
    let (hi, di) = a.indices()?;
    let item = match io {
        IoBackend::Direct => {
            if src[0].1.len() != dst[0].1.len() {
                return Err(TransferError::LayerListMismatch { src_len: src[0].1.len(), dst_len: dst[0].1.len() });
            }
            let (hi, di) = a.host_indices()?;
            direct_counts(hi, di, a.int("page_size")?)?;
            None
        }
        IoBackend::Kernel | IoBackend::Auto => Some(a.int("item_size")?),
    };
    let kind = kind_of(src.len());
    a.run(layer_lists(device, kind, &[src, dst].concat(), io, hi, di, item)?)
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

/// Layer `j` of the source lists → layer `j` of the destination lists, one pair of sides per layer
/// (`lists`: source components, then destination components), every layer validated first.
pub(super) fn layer_lists(
    device: &Device,
    kind: PoolKind,
    lists: &[(&str, &[RawTensor])],
    io: IoBackend,
    hi: Indices<'_>,
    di: Indices<'_>,
    item_size: Option<i64>,
) -> Result<Vec<Call>> {
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
    Ok(calls)
}
