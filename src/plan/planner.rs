//! The planning entry: one call checked in sglang's order, then lowered.

use std::borrow::Cow;
use std::sync::Arc;

use super::*;
use crate::error::{Result, TransferError};
use crate::geometry::{DeviceGeometry, HostGeometry, IoBackend, LayerMap, PoolKind, PoolPair, Profile};

/// Validates one call and lowers it. An `Err` means no byte may move; `Ok` with no steps is a
/// defined no-op (empty indices, a layer this pool does not own or a DSA skip-topk layer).
///
/// The order of checks (also in the module docs) follows sglang's pool code, so that the same call fails with the same
/// message:
/// 1. layers: a load of a layer this rank does not own, or of a DSA skip-topk layer, returns
///    (a no-op) before anything else is looked at; a layer id the model does not have, or a
///    draft id past the drafts, is an error;
/// 2. DSA indexer: token indices become pages (`Index buffer transfer expects page-aligned
///    indices for DSA.` when a list is not a whole number of pages) — before the table, as in
///    `dsa.py`;
/// 3. the table ([`decide`]): layout and io backend;
/// 4. the launcher checks: equal lengths, the `kernel` word (item, then per-head chunk), the
///    `direct` page multiple;
/// 5. an empty call is a no-op;
/// 6. hicache-io's own checks: index ranges, whole pages, unique destinations, executor
///    capabilities.
pub(crate) fn plan(profile: Profile, caps: &Capabilities, owner: u64, pair: &Arc<PoolPair>, req: &Request<'_>) -> Result<Plan> {
    if req.io_backend != IoBackend::Auto {
        return plan_io(profile, caps, owner, pair, req);
    }
    // `auto`: the calibrated choice first; if a check refuses it, the other path (below).
    if profile == Profile::Sglang {
        return Err(TransferError::UnsupportedIoBackend { io_backend: "auto".into() });
    }
    // Layers per step: a load moves one; a backup all of them, or one per step when sharded.
    let layers = match req.op {
        Op::Backup if !pair.device().layers().is_sharded() => pair.device().buffer_count(),
        _ => 1,
    };
    let preferred = match index_units(pair.host(), req) {
        Ok((hi, di)) => caps.auto.choose(layers, pair.host().item_bytes(), mean_run(&hi, &di)),
        Err(_) => IoBackend::Kernel,
    };
    let other = if preferred == IoBackend::Kernel { IoBackend::Direct } else { IoBackend::Kernel };
    // Only paths the table allows are tried, so a refusal is never the table's when the other
    // path is allowed; with neither allowed, the preferred path reports the table's refusal.
    let table_op = table_op(req.op, pair.device());
    let host = pair.host();
    let allowed = |io: IoBackend| {
        let cell = Cell { kind: host.kind(), op: table_op, layout: host.layout(), io };
        decide(profile, cell, host.item_bytes(), kernel_word(profile, caps)).is_ok()
    };
    let candidates: Vec<IoBackend> = [preferred, other].into_iter().filter(|&io| allowed(io)).collect();
    if candidates.is_empty() {
        return plan_io(profile, caps, owner, pair, &Request { io_backend: preferred, ..*req });
    }
    // `auto` resolves to a path before any index value is looked at: the paths whose launcher
    // checks the call's shape passes (lengths, words, page multiples), the calibrated choice
    // first. When every path refuses the call, the error is the one of the first path in a
    // fixed order (kernel, then direct), never the calibration's choice: executors calibrated
    // differently answer a wrong call alike.
    let word = kernel_word(profile, caps);
    let p = if host.kind() == PoolKind::DsaIndexer { host.page_size() } else { 1 };
    let units = |n: usize| if (n as u64).is_multiple_of(p) { n / p as usize } else { n };
    let (hl, dl) = (units(req.host_indices.len()), units(req.device_indices.len()));
    let fits = |io: IoBackend| launcher_checks(host, caps, word, io, hl, dl).is_ok();
    let fixed = |list: &[IoBackend]| [IoBackend::Kernel, IoBackend::Direct].into_iter().find(|io| list.contains(io));
    let fitting: Vec<IoBackend> = candidates.iter().copied().filter(|&io| fits(io)).collect();
    let Some(report) = fixed(&fitting) else {
        let io = fixed(&candidates).unwrap_or(preferred);
        return plan_io(profile, caps, owner, pair, &Request { io_backend: io, ..*req });
    };
    let mut refused = Vec::new();
    for io in fitting {
        match plan_io(profile, caps, owner, pair, &Request { io_backend: io, ..*req }) {
            Ok(p) => return Ok(p),
            Err(e) => refused.push((io, e)),
        }
    }
    Err(refused
        .into_iter()
        .find(|(io, _)| *io == report)
        .map(|(_, e)| e)
        .unwrap_or(TransferError::UnsupportedIoBackend { io_backend: "auto".into() }))
}

/// The table's operation of a call: a backup of a layer-sharded device pool is its own row.
pub(super) fn table_op(op: Op, dev: &DeviceGeometry) -> TableOp {
    match op {
        Op::Load { .. } => TableOp::Load,
        Op::Backup if dev.layers().is_sharded() => TableOp::ShardedBackup,
        Op::Backup => TableOp::Backup,
        Op::BackupLayer { .. } => TableOp::ShardedBackup,
    }
}

/// Mean length of the runs `transfer_kv_direct` would coalesce (live pairs per run).
pub(crate) fn mean_run(hi: &[i64], di: &[i64]) -> f64 {
    let mut live = 0u64;
    let mut runs = 0u64;
    for i in 0..hi.len().min(di.len()) {
        if hi[i] < 0 || di[i] < 0 {
            continue;
        }
        live += 1;
        let continues = i > 0 && hi[i - 1] >= 0 && di[i - 1] >= 0 && hi[i] - hi[i - 1] == 1 && di[i] - di[i - 1] == 1;
        if !continues {
            runs += 1;
        }
    }
    if runs == 0 {
        1.0
    } else {
        live as f64 / runs as f64
    }
}

/// [`plan`] for a concrete io backend.
pub(super) fn plan_io(profile: Profile, caps: &Capabilities, owner: u64, pair: &Arc<PoolPair>, req: &Request<'_>) -> Result<Plan> {
    let (host, dev) = (pair.host(), pair.device());
    let direction = req.op.direction();
    let table_op = table_op(req.op, dev);
    let io = req.io_backend;
    let empty = |path: PathInfo| Plan {
        owner,
        pair: pair.clone(),
        profile,
        direction,
        path,
        io,
        steps: Arc::from([]),
        bytes: 0,
        device_check: None,
        host_units: Arc::from([]),
        tuning: None,
    };
    // 1. Layers.
    let Some(layer_groups) = resolve_layers(dev, req.op, table_op)? else {
        return Ok(empty(PathInfo { op: "no-op: layer not owned by this pool", extension: false }));
    };
    // 2. DSA pages.
    let (hi, di) = index_units(host, req)?;
    // 3. The table.
    let cell = Cell { kind: host.kind(), op: table_op, layout: host.layout(), io: req.io_backend };
    let word = kernel_word(profile, caps);
    let path = decide(profile, cell, host.item_bytes(), word)?;
    // 4. Launcher checks. Padded pages move by kernel only: a direct run would cross the
    // padding between pages.
    if (host.padding().is_some() || dev.padding().is_some()) && req.io_backend != IoBackend::Kernel {
        return Err(TransferError::UnsupportedIoBackend { io_backend: req.io_backend.name().into() });
    }
    check_padded_windows(host, dev, caps)?;
    launcher_checks(host, caps, word, req.io_backend, hi.len(), di.len())?;
    // 5. Nothing to move.
    if hi.is_empty() {
        return Ok(empty(path));
    }
    // 6. Indices and capabilities.
    if host.kind() == PoolKind::DsaIndexer {
        check_whole_pages("host", req.host_indices, host.page_size())?;
        check_whole_pages("device", req.device_indices, host.page_size())?;
    }
    let live = check_indices(host, dev, caps, direction, req.io_backend, &hi, &di)?;
    let host_units: Arc<[i64]> = Arc::from(&hi[..]);
    let (steps, bytes) = match req.io_backend {
        IoBackend::Kernel => lower_gather(host, dev, caps, direction, &layer_groups, host_units.clone(), Arc::from(&di[..]), live),
        _ => lower_direct(host, dev, direction, &layer_groups, &hi, &di, live),
    };
    Ok(Plan { steps: steps.into(), bytes, host_units, ..empty(path) })
}

/// (host layer, device buffer slot) pairs, one group per step.
pub(super) type LayerGroups = Vec<Vec<(u64, u32)>>;

/// The layers of a call; `None` for a defined no-op.
pub(super) fn resolve_layers(dev: &DeviceGeometry, op: Op, table_op: TableOp) -> Result<Option<LayerGroups>> {
    let m: &LayerMap = dev.layers();
    let layer_error = |layer_id| TransferError::LayerOutOfRange { layer_id, target_layers: m.layer_num, draft_layers: m.drafts };
    Ok(Some(match op {
        Op::Load { layer_id, is_draft } | Op::BackupLayer { layer_id, is_draft } => {
            let slot = if is_draft {
                match layer_id.checked_sub(m.layer_num).filter(|k| *k < m.drafts) {
                    Some(k) => m.draft_slot(k),
                    None => return Err(layer_error(layer_id)),
                }
            } else {
                if layer_id >= m.layer_num {
                    return Err(layer_error(layer_id));
                }
                match m.target_slot(layer_id) {
                    Some(s) => s,
                    None => return Ok(None), // not owned / skip-topk: sglang returns
                }
            };
            vec![vec![(slot as u64, slot as u32)]]
        }
        Op::Backup => {
            let all: Vec<(u64, u32)> = (0..dev.buffer_count()).map(|s| (s as u64, s as u32)).collect();
            if table_op == TableOp::ShardedBackup {
                all.into_iter().map(|p| vec![p]).collect()
            } else {
                vec![all]
            }
        }
    }))
}

/// A call's host and device index lists in index units.
pub(super) type Units<'r> = (Cow<'r, [i64]>, Cow<'r, [i64]>);

/// The index lists in index units: token slots, or for the DSA indexer one page per group of
/// `P` tokens (dsa.py `_get_indexer_page_indices`; empty lists pass through).
pub(super) fn index_units<'r>(host: &HostGeometry, req: &Request<'r>) -> Result<Units<'r>> {
    if host.kind() != PoolKind::DsaIndexer || (req.host_indices.is_empty() && req.device_indices.is_empty()) {
        // Borrowed: a call's lists are copied once, into the plan.
        return Ok((Cow::Borrowed(req.host_indices), Cow::Borrowed(req.device_indices)));
    }
    let p = host.page_size();
    for list in [req.host_indices, req.device_indices] {
        if !(list.len() as u64).is_multiple_of(p) {
            return Err(TransferError::DsaUnalignedCount { len: list.len(), page_size: p });
        }
    }
    Ok((Cow::Owned(to_pages(req.host_indices, p)), Cow::Owned(to_pages(req.device_indices, p))))
}

/// The checks sglang's launchers make: equal lengths, the `kernel` word, whole `direct` pages.
/// The per-head chunk of page_head is checked against the executors' common word too: a chunk
/// that is not whole words would be truncated (sglang) or misaligned (GPU executors).
pub(super) fn launcher_checks(
    host: &HostGeometry,
    caps: &Capabilities,
    word: u64,
    io: IoBackend,
    host_len: usize,
    device_len: usize,
) -> Result<()> {
    if host_len != device_len {
        return Err(TransferError::LengthMismatch { src_len: host_len, dst_len: device_len });
    }
    match io {
        IoBackend::Kernel => {
            if !host.item_bytes().is_multiple_of(word) {
                return Err(TransferError::ItemNotWordAligned { item_bytes: host.item_bytes(), word });
            }
            if !host.chunk_bytes().is_multiple_of(caps.kernel_word) {
                return Err(TransferError::ChunkNotWordAligned {
                    chunk_bytes: host.chunk_bytes(),
                    item_bytes: host.item_bytes(),
                    heads: host.head_num(),
                    word: caps.kernel_word,
                });
            }
        }
        IoBackend::Direct | IoBackend::Auto => {
            let group = host.index_page_size();
            if !(host_len as u64).is_multiple_of(group) {
                return Err(TransferError::DirectCountNotPageMultiple { len: host_len, page_size: group });
            }
        }
    }
    Ok(())
}
