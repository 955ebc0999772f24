//! Lowering: gathers (address pairs, lanes) for `kernel`, coalesced runs for `direct`.

use std::sync::Arc;

use super::*;
use crate::geometry::{DeviceGeometry, HostGeometry, Layout};

/// Lanes per item (log2) of a gather of `heads` chunks of `chunk` bytes: the adapter's policy for
/// the chunk's words (`caps.max_lanes`), raised where one invocation would run more loop
/// iterations than `caps.max_loop_trips` (per head, its words per lane plus one, counted in the
/// executor's smallest word, which it may fall back to); `None` when no lane count fits.
pub(super) fn gather_lanes(caps: &Capabilities, chunk: u64, heads: u64) -> Option<u32> {
    let words = chunk / if chunk.is_multiple_of(16) { 16 } else { caps.kernel_word.max(1) };
    let mut log2 = words.max(1).next_power_of_two().min(caps.max_lanes.max(1).next_power_of_two()).trailing_zeros();
    if caps.max_loop_trips == u64::MAX {
        return Some(log2);
    }
    let narrow = (chunk / caps.kernel_word.max(1)).max(1);
    let trips = |l: u32| heads.saturating_mul(narrow.div_ceil(1u64 << l).saturating_add(1));
    while trips(log2) > caps.max_loop_trips {
        if 1u64 << log2 >= narrow {
            return None;
        }
        log2 += 1;
    }
    Some(log2)
}

/// `kernel` steps: one per layer group, each split into pieces of at most
/// `caps.max_gather_items` index pairs (destinations are unique, so the split changes no byte).
pub(super) fn lower_gather(
    host: &HostGeometry,
    dev: &DeviceGeometry,
    caps: &Capabilities,
    direction: Direction,
    layer_groups: &[Vec<(u64, u32)>],
    hi: Arc<[i64]>,
    di: Arc<[i64]>,
) -> (Vec<Step>, u64) {
    let heads = host.head_num();
    let comps = host.kind().components() as u8;
    let live = hi.iter().zip(di.iter()).filter(|(h, d)| **h >= 0 && **d >= 0).count() as u64;
    let (src, dst) = match direction {
        Direction::HostToDevice => (hi, di),
        Direction::DeviceToHost => (di, hi),
    };
    // The gather's shape (checked by `check_indices`), and at most 2^31 invocations a step.
    let lanes_log2 = gather_lanes(caps, host.chunk_bytes(), heads).unwrap_or(0);
    let per = usize::try_from(caps.max_gather_items.min((1u64 << 31) >> lanes_log2).max(1)).unwrap_or(usize::MAX);
    let pieces: Vec<[Arc<[i64]>; 2]> = if src.len() <= per {
        vec![[src, dst]]
    } else {
        src.chunks(per).zip(dst.chunks(per)).map(|(s, d)| [Arc::from(s), Arc::from(d)]).collect()
    };
    let mut steps = Vec::with_capacity(layer_groups.len() * pieces.len());
    let mut layer_count = 0u64;
    for layers in layer_groups {
        let mut pairs = Vec::with_capacity(layers.len() * comps as usize);
        let mut items = Vec::with_capacity(layers.len() * comps as usize);
        for &(hl, ds) in layers {
            for c in 0..comps {
                items.push((hl, c));
                let (h, d) = (host.addr(c, hl), dev.addr(c, ds, heads));
                pairs.push(match direction {
                    Direction::HostToDevice => AddrPair { src: h, dst: d },
                    Direction::DeviceToHost => AddrPair { src: d, dst: h },
                });
            }
        }
        layer_count += layers.len() as u64;
        for [s, d] in &pieces {
            steps.push(Step {
                kind: StepKind::Gather(GatherStep {
                    src_indices: s.clone(),
                    dst_indices: d.clone(),
                    device_lists: None,
                    chunk_bytes: host.chunk_bytes(),
                    heads,
                    pairs: pairs.clone(),
                    items: items.clone(),
                    checksum: None,
                    lanes_log2,
                }),
                layers: layers.iter().map(|l| l.0).collect(),
                checksum: None,
                unsummed: None,
            });
        }
    }
    (steps, live * layer_count * comps as u64 * host.item_bytes())
}

/// `direct` steps: runs of consecutive (host, device) pairs (`transfer_kv_direct`), or whole
/// pages for page_first_direct (only the first index of each page is read), one step per layer
/// group, layer by layer within it (each pass stays in one layer's buffers; destinations are
/// unique, so the order changes no byte).
pub(super) fn lower_direct(
    host: &HostGeometry,
    dev: &DeviceGeometry,
    direction: Direction,
    layer_groups: &[Vec<(u64, u32)>],
    hi: &[i64],
    di: &[i64],
) -> (Vec<Step>, u64) {
    let group = host.index_page_size();
    let spans = if host.layout() == Layout::PageFirstDirect { page_spans(hi, di, group) } else { coalesce(hi, di) };
    let comps = host.kind().components() as u8;
    let mut bytes = 0;
    let steps = layer_groups
        .iter()
        .map(|layers| {
            let mut runs: Vec<Run> = Vec::with_capacity(spans.len() * layers.len() * comps as usize);
            for c in 0..comps {
                for &(hl, ds) in layers {
                    let (ha, da) = (host.addr(c, hl), dev.addr(c, ds, 1));
                    for &(h0, d0, n) in &spans {
                        let len = n * host.item_bytes();
                        let (ho, doff) = (ha.offset(h0, 0), da.offset(d0, 0));
                        bytes += len;
                        let items = (n, h0, d0, hl, c);
                        push_run(
                            &mut runs,
                            match direction {
                                Direction::HostToDevice => Run::new((ha.buf(), ho), (da.buf(), doff), len, items),
                                Direction::DeviceToHost => Run::new((da.buf(), doff), (ha.buf(), ho), len, items),
                            },
                        );
                    }
                }
            }
            Step { kind: StepKind::Copy(runs), layers: layers.iter().map(|l| l.0).collect(), checksum: None, unsummed: None }
        })
        .collect();
    (steps, bytes)
}

/// `transfer_kv_direct` coalescing: maximal runs where both indices step by one; negative
/// entries break runs and are skipped. Returns (host start, device start, length).
pub fn coalesce(hi: &[i64], di: &[i64]) -> Vec<(u64, u64, u64)> {
    let mut out = Vec::new();
    let mut i = 0;
    let n = hi.len();
    while i < n {
        if hi[i] < 0 || di[i] < 0 {
            i += 1;
            continue;
        }
        let start = i;
        while i + 1 < n && hi[i + 1] >= 0 && di[i + 1] >= 0 && hi[i + 1] - hi[i] == 1 && di[i + 1] - di[i] == 1 {
            i += 1;
        }
        out.push((hi[start] as u64, di[start] as u64, (i + 1 - start) as u64));
        i += 1;
    }
    out
}

/// page_first_direct: one span per page group, from the group's first index.
pub(super) fn page_spans(hi: &[i64], di: &[i64], p: u64) -> Vec<(u64, u64, u64)> {
    let p = p as usize;
    (0..hi.len() / p)
        .map(|g| (hi[g * p], di[g * p]))
        .filter(|(h, d)| *h >= 0 && *d >= 0)
        .map(|(h, d)| (h as u64, d as u64, p as u64))
        .collect()
}

/// Appends a run, merging it into the previous one when it continues it in both buffers
/// (fewer, larger copies; same bytes).
#[inline]
/// Appends `r`, merged into the last run when it continues it (bytes and items alike).
pub(super) fn push_run(runs: &mut Vec<Run>, r: Run) {
    if let Some(last) = runs.last_mut() {
        if last.src == r.src
            && last.dst == r.dst
            && last.src_offset + last.len == r.src_offset
            && last.dst_offset + last.len == r.dst_offset
            && (last.host_layer, last.comp) == (r.host_layer, r.comp)
            && last.host_unit + last.items == r.host_unit
            && last.device_unit + last.items == r.device_unit
        {
            last.len += r.len;
            last.items += r.items;
            return;
        }
    }
    runs.push(r);
}
