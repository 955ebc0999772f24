//! The one support table: [`decide`] gives the path sglang would run, or its error verbatim.

use crate::error::{Result, TransferError};
use crate::geometry::{IoBackend, Layout, PoolKind, Profile};

/// The operations of the support table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TableOp {
    /// `load_to_device_per_layer`.
    Load,
    /// `backup_from_device_all_layer`, device pool not sharded.
    Backup,
    /// `backup_from_device_all_layer` on a layer-sharded device pool.
    ShardedBackup,
}

impl TableOp {
    /// Every operation, in table order.
    pub const ALL: [TableOp; 3] = [TableOp::Load, TableOp::Backup, TableOp::ShardedBackup];
    /// The name used by `hicache-io matrix`.
    pub fn name(self) -> &'static str {
        match self {
            TableOp::Load => "load",
            TableOp::Backup => "backup",
            TableOp::ShardedBackup => "sharded-backup",
        }
    }
}

/// One cell of the support table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct Cell {
    /// Pool kind.
    pub kind: PoolKind,
    /// Operation.
    pub op: TableOp,
    /// Host layout.
    pub layout: Layout,
    /// io backend.
    pub io: IoBackend,
}

impl std::fmt::Display for Cell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {} {}", self.kind, self.op.name(), self.layout, self.io)
    }
}

/// Every cell, in table order (pool, operation, layout, io backend).
pub fn all_cells() -> Vec<Cell> {
    let mut v = Vec::new();
    for kind in PoolKind::ALL {
        for op in TableOp::ALL {
            for layout in Layout::ALL {
                for io in IoBackend::ALL {
                    v.push(Cell { kind, op, layout, io });
                }
            }
        }
    }
    v
}

/// An accepted cell: the op that runs it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PathInfo {
    /// sglang's op name, or a `hicache-io:` name for paths sglang lacks.
    pub op: &'static str,
    /// True for paths that exist only in profile `extended`.
    pub extension: bool,
}

pub(super) fn sg(op: &'static str) -> Result<PathInfo> {
    Ok(PathInfo { op, extension: false })
}
pub(super) fn ext(op: &'static str) -> Result<PathInfo> {
    Ok(PathInfo { op, extension: true })
}
pub(super) fn e1(layout: Layout) -> Result<PathInfo> {
    Err(TransferError::UnsupportedLayout { layout: layout.name().into() })
}

/// Load and non-sharded backup: the same cells for every pool (page_head only for MHA), named
/// after sglang's ops (MLA and the DSA indexer use the `_mla` kernels).
pub(super) fn plain(kind: PoolKind, op: TableOp, layout: Layout, io: IoBackend) -> Result<PathInfo> {
    use IoBackend::*;
    use Layout::*;
    use TableOp::*;
    let mla = kind != PoolKind::Mha;
    let pick = |mha: &'static str, mla_op: &'static str| if mla { mla_op } else { mha };
    sg(match (op, io, layout) {
        (Load, Kernel, LayerFirst) => pick("transfer_kv_per_layer", "transfer_kv_per_layer_mla"),
        (Load, Kernel, PageFirst) => pick("transfer_kv_per_layer_pf_lf", "transfer_kv_per_layer_mla_pf_lf"),
        (Load, Kernel, PageHead) if !mla => "transfer_kv_per_layer_ph_lf",
        (Load, Direct, PageFirstDirect) => "transfer_kv_per_layer_direct_pf_lf",
        (Backup, Kernel, LayerFirst) => pick("transfer_kv_all_layer", "transfer_kv_all_layer_mla"),
        (Backup, Kernel, PageFirst) => pick("transfer_kv_all_layer_lf_pf", "transfer_kv_all_layer_mla_lf_pf"),
        (Backup, Kernel, PageHead) if !mla => "transfer_kv_all_layer_lf_ph",
        (Load, Kernel, PageFirstDirectHeadGroups) if !mla => "transfer_kv_per_layer_pfdhg_lf",
        (Backup, Kernel, PageFirstDirectHeadGroups) if !mla => "transfer_kv_all_layer_lf_pfdhg",
        (Backup, Direct, PageFirstDirect) => "transfer_kv_all_layer_direct_lf_pf",
        (Load, Kernel, PageUnified) => pick("transfer_hicache_one_layer_page_unified_lf", "transfer_hicache_one_layer_mla_page_unified_lf"),
        (Backup, Kernel, PageUnified) => {
            pick("transfer_hicache_all_layer_staged_lf_page_unified", "transfer_hicache_all_layer_mla_staged_lf_page_unified")
        }
        (Load | Backup, Direct, LayerFirst) => "transfer_kv_direct",
        _ => return e1(layout),
    })
}

/// The validation table. `item_bytes` matters only for the DSA indexer's `kernel` gate;
/// `word` is `kernel_word` of the profile and executor.
pub fn decide(profile: Profile, cell: Cell, item_bytes: u64, word: u64) -> Result<PathInfo> {
    use IoBackend::*;
    use Layout::*;
    let Cell { kind, op, layout, io } = cell;
    let extended = profile == Profile::Extended;
    // The host pool cannot even be allocated with page_head (or head groups) unless it is MHA.
    if !layout.exists_for(kind) {
        return e1(layout);
    }
    // dsa.py: `use_kernel = io_backend == "kernel" and stride % 8 == 0`, else-branch raises.
    if kind == PoolKind::DsaIndexer && io == Kernel && !item_bytes.is_multiple_of(word) {
        return Err(TransferError::UnsupportedIoBackend { io_backend: "kernel".into() });
    }
    if op != TableOp::ShardedBackup {
        return plain(kind, op, layout, io);
    }
    // Layer-sharded backups: one per-layer call per owned layer and draft.
    match (kind, io, layout) {
        (PoolKind::Mha, _, _) if !extended => Err(TransferError::ShardedUnsupportedPool { kind }),
        (PoolKind::Mha, Kernel, LayerFirst) => ext("hicache-io: per-layer lf->lf"),
        (PoolKind::Mha, Kernel, PageHead) => ext("hicache-io: per-layer lf->ph"),
        (PoolKind::Mha, Kernel, PageFirstDirectHeadGroups) => ext("hicache-io: per-layer lf->pfdhg"),
        (PoolKind::Mha, Kernel, PageUnified) => ext("hicache-io: per-layer lf->page_unified"),
        (PoolKind::Mla, Kernel, PageUnified) if extended => ext("hicache-io: per-layer lf->page_unified (mla)"),
        (PoolKind::Mha, Direct, LayerFirst) => ext("hicache-io: per-layer transfer_kv_direct"),
        (_, Kernel, LayerFirst) => sg("transfer_kv_per_layer_mla"),
        (_, Direct, LayerFirst) => sg("transfer_kv_direct"),
        (_, Kernel, PageFirst) if extended => ext("hicache-io: per-layer lf->pf"),
        (_, Direct, PageFirstDirect) if extended => ext("hicache-io: per-layer direct lf->pfd"),
        (PoolKind::Mla, Kernel, PageFirst) => Err(TransferError::ShardedMlaPageFirst),
        (PoolKind::Mla, Kernel, _) => Err(TransferError::ShardedLayout { layout }),
        (PoolKind::Mla, Direct, _) if !extended => Err(TransferError::ShardedDirectLayout { layout }),
        (PoolKind::DsaIndexer, Kernel, PageFirst) => Err(TransferError::ShardedDsaPageFirst),
        (PoolKind::DsaIndexer, Direct, _) if !extended => Err(TransferError::ShardedDsaDirectLayout { layout }),
        _ => e1(layout),
    }
}
