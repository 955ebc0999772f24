//! The oracle: what an accepted call must do to the bytes, written as a plain byte loop from the
//! layout shapes (see [`crate::geometry`]). It shares no code with the planner or the executors
//! (it reads only the configured sizes of the geometry, never its strides or addresses) and does
//! not validate: ask the planner first.
//!
//! Semantics, the same for both io backends: for each index pair (token slots; for the DSA
//! indexer, the first token of each page divided by `P`), skipped when either side is negative,
//! for each (host layer, device buffer) pair of the operation and each component, the item moves
//! between host position `(layer, slot)` and device position `slot`.

use crate::geometry::{Layout, PoolKind, PoolPair};
use crate::plan::Op;

/// Host bytes per component buffer `[comp]`, device bytes `[comp][buffer]`.
pub struct OracleBuffers<'a> {
    /// Host buffers: one per component (page_unified: one).
    pub host: &'a mut [Vec<u8>],
    /// Device buffers, `[comp][slot]`.
    pub device: &'a mut [Vec<Vec<u8>>],
}

/// Host byte offset of (component `c`, layer, unit, byte `b` of the item) in the component's
/// host buffer (page_unified: the pool's one buffer), from the layout shapes.
fn host_byte(pair: &PoolPair, c: u64, layer: u64, unit: u64, b: u64) -> u64 {
    let h = pair.host();
    let item = h.item_bytes();
    let l = h.layer_num();
    let dsa = h.kind() == PoolKind::DsaIndexer;
    let slots = if dsa { (h.size() + h.page_size() + 1) / h.page_size() } else { h.size() };
    // Padded pages (layer_first): [L][pages][page_bytes], the items `offset` into each page.
    if let Some(pad) = h.padding() {
        let p = h.page_size();
        return (layer * (slots / p) + unit / p) * pad.page_bytes + pad.offset + (unit % p) * item + b;
    }
    match h.layout() {
        // [L][slots][item]
        Layout::LayerFirst => (layer * slots + unit) * item + b,
        // [slots][L][item]
        Layout::PageFirst => (unit * l + layer) * item + b,
        // [pages][L][P][item]; the indexer's pages are its slots ([pages][L][1][item])
        Layout::PageFirstDirect => {
            let p = if dsa { 1 } else { h.page_size() };
            (((unit / p) * l + layer) * p + unit % p) * item + b
        }
        // [pages][H][P][L][D]
        Layout::PageHead => {
            let (p, hn) = (h.page_size(), h.head_num());
            let d = item / hn;
            let (head, within) = (b / d, b % d);
            ((((unit / p) * hn + head) * p + unit % p) * l + layer) * d + within
        }
        // [pages][HG][L][P][hg × D]
        Layout::PageFirstDirectHeadGroups => {
            let (p, groups) = (h.page_size(), h.head_num());
            let d = item / groups;
            let (group, within) = (b / d, b % d);
            ((((unit / p) * groups + group) * l + layer) * p + unit % p) * d + within
        }
        // MHA [pages][G][L][2][P][d] (one buffer, K before V); MLA [pages][L][1][P][item]
        Layout::PageUnified => {
            let (p, groups, comps) = (h.page_size(), h.head_num(), if h.kind() == PoolKind::Mha { 2 } else { 1 });
            let d = item / groups;
            let (group, within) = (b / d, b % d);
            (((((unit / p) * groups + group) * l + layer) * comps + c) * p + unit % p) * d + within
        }
    }
}

/// Device byte offset of (unit, byte `b` of the item): `[slots][item]`, or with padded pages
/// `[pages][page_bytes]`, the items `offset` into each page.
fn device_byte(pair: &PoolPair, unit: u64, b: u64) -> u64 {
    let d = pair.device();
    match d.padding() {
        Some(pad) => (unit / d.page_size()) * pad.page_bytes + pad.offset + (unit % d.page_size()) * d.item_bytes() + b,
        None => unit * d.item_bytes() + b,
    }
}

/// (host layer, device buffer) pairs of an operation.
fn layer_pairs(pair: &PoolPair, op: Op) -> Vec<(u64, usize)> {
    let m = pair.device().layers();
    let (start, end) = m.layer_shard.unwrap_or((0, m.layer_num));
    let live: Vec<usize> = (start..end).filter(|&l| !m.skipped[l]).collect();
    let total = live.len() + m.drafts;
    match op {
        Op::Backup => (0..total).map(|i| (i as u64, i)).collect(),
        Op::Load { layer_id, is_draft: true } | Op::BackupLayer { layer_id, is_draft: true } => {
            let k = layer_id - m.layer_num;
            vec![((live.len() + k) as u64, live.len() + k)]
        }
        Op::Load { layer_id, is_draft: false } | Op::BackupLayer { layer_id, is_draft: false } => {
            match live.iter().position(|&l| l == layer_id) {
                Some(i) => vec![(i as u64, i)],
                None => vec![],
            }
        }
    }
}

/// Applies an accepted call to the buffers.
pub fn apply(pair: &PoolPair, op: Op, host_indices: &[i64], device_indices: &[i64], bufs: OracleBuffers<'_>) {
    let h = pair.host();
    let layers = layer_pairs(pair, op);
    // A layer this pool does not own: the call is a no-op whatever its indices say.
    if layers.is_empty() {
        return;
    }
    let units: Vec<(i64, i64)> = if h.kind() == PoolKind::DsaIndexer {
        let p = h.page_size() as usize;
        (0..host_indices.len() / p)
            .map(|g| (host_indices[g * p], device_indices[g * p]))
            .map(|(a, b)| (a.div_euclid(p as i64), b.div_euclid(p as i64)))
            .collect()
    } else {
        host_indices.iter().copied().zip(device_indices.iter().copied()).collect()
    };
    let comps = if h.kind() == PoolKind::Mha { 2 } else { 1 };
    // page_unified's one host buffer holds every component.
    let hb = |c: usize| if h.layout() == Layout::PageUnified { 0 } else { c };
    let item = h.item_bytes();
    for (hu, du) in units {
        if hu < 0 || du < 0 {
            continue;
        }
        for &(hl, slot) in &layers {
            for c in 0..comps {
                for b in 0..item {
                    let ho = host_byte(pair, c as u64, hl, hu as u64, b) as usize;
                    let dof = device_byte(pair, du as u64, b) as usize;
                    match op {
                        Op::Load { .. } => bufs.device[c][slot][dof] = bufs.host[hb(c)][ho],
                        Op::Backup | Op::BackupLayer { .. } => bufs.host[hb(c)][ho] = bufs.device[c][slot][dof],
                    }
                }
            }
        }
    }
}
