//! The one validation table and the lowering of accepted requests into plans.
//!
//! [`decide`] is the table: for a profile and a [`Cell`] (pool kind, operation, layout, io
//! backend) it returns the path sglang would run (named after its op) or the error sglang
//! raises, verbatim. [`HostPool::plan`](crate::HostPool::plan) checks one call in sglang's order
//! (in the order listed under "Order of checks" below) and lowers it into a [`Plan`]: plain data that every executor runs the same
//! way. Executors never decide support; their limits reach this module as [`Capabilities`].
//!
//! # Order of checks
//! sglang's pool code checks a call in this order, and so does the planner, so that the same
//! call fails with the same message:
//! 1. layers: a load of a layer this rank does not own, or of a DSA skip-topk layer, is a no-op
//!    before anything else is looked at; a layer id the model does not have, or a draft id past
//!    the drafts, is an error;
//! 2. DSA indexer: token indices become pages (`Index buffer transfer expects page-aligned
//!    indices for DSA.` when a list is not a whole number of pages), before the table;
//! 3. the table ([`decide`]): layout and io backend;
//! 4. the launcher checks: equal lengths, the `kernel` word (item, then per-head chunk), the
//!    `direct` page multiple;
//! 5. an empty call is a no-op;
//! 6. hicache-io's own checks: index ranges, whole pages, unique destinations, executor
//!    capabilities.
//!
//! Plans are unforgeable: only this module builds them, their fields are private, and a plan
//! runs only on the executor instance and pools it was made for.

use std::sync::Arc;

use crate::error::{Result, TransferError};
use crate::geometry::{Addr, BufRef, DeviceGeometry, HostGeometry, IoBackend, LayerMap, Layout, PoolKind, PoolPair, Profile};

/// What an executor can address; read by the planner so that backend limits are rejected (or
/// worked around by splitting) here, in the same place as everything else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Executor name, for messages.
    pub name: &'static str,
    /// Smallest word the `kernel` path copies; every copy chunk must be a multiple of it.
    pub kernel_word: u64,
    /// Alignment of every offset and length of a `direct` copy.
    pub direct_align: u64,
    /// Largest range a `kernel` step can bind at once (wgpu: the storage binding limit), and the
    /// alignment of a bound range's start. An item chunk must fit one aligned window.
    pub max_binding: u64,
    /// Alignment of a bound window's start.
    pub binding_align: u64,
    /// Most index pairs one `kernel` step may carry (wgpu: the index table is one binding and
    /// one dispatch); larger calls are split into several steps.
    pub max_gather_items: u64,
    /// Largest index a `kernel` step can address (wgpu: 32-bit signed indices).
    pub max_index: u64,
    /// Most bytes a device pool may hold in all (read by the pools before allocating).
    pub max_pool_bytes: u64,
    /// Most bytes a host pool may hold in all.
    pub max_host_pool_bytes: u64,
    /// Most invocations a `kernel` step gives one item chunk (a power of two): the gather's
    /// shape for this adapter (wgpu: 1 on CPU adapters, up to 64 on GPUs, one per word).
    pub max_lanes: u64,
    /// Largest buffer of one pool segment: a pool buffer above it is split into segments of
    /// whole copy chunks (see [`Capabilities::segment_bytes`]); `u64::MAX` keeps one buffer.
    pub max_segment: u64,
    /// Most loop iterations one `kernel` invocation may run (wgpu: 65,535, the most some
    /// drivers run before they stop a loop without a word, as Mesa's llvmpipe does): the
    /// planner gives an item more lanes until each stays within it, and refuses a chunk shape
    /// no lane count fits. `u64::MAX`: no limit.
    pub max_loop_trips: u64,
    /// Whether the executor checks index lists held in its own (CUDA) memory on the device
    /// ([`Plan::device_check`]); only such an executor gets plans of device lists.
    pub device_index_lists: bool,
    /// Whether the `kernel` copies compute item checksums as they copy (recording them for
    /// backups, verifying them for loads: see [`crate::integrity`]).
    pub checksums: bool,
    /// Whether the `direct` copies compute them too (`checksums` and this: a `direct` plan's
    /// backups otherwise leave their items' checksums unknown, and its loads read them
    /// unverified).
    pub direct_checksums: bool,
    /// Which io backend `auto` picks, by item size and run length.
    pub auto: AutoTable,
}

/// The faster io backend by steps of one or several layers, item size and mean run length
/// (consecutive items), for `auto`: measured per executor (see `hicache-io bench --io auto`), or
/// [`AutoTable::DEFAULT`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AutoTable {
    /// `direct[m][i][r]`: `direct` is faster for steps of one layer (`m = 0`, loads) or of
    /// several (`m = 1`, backups), items near `AUTO_ITEMS[i]` bytes, runs near `AUTO_RUNS[r]`.
    pub direct: [[[bool; 4]; 6]; 2],
    /// True when measured on this executor (false: the default rule).
    pub calibrated: bool,
}

/// Item sizes of the `auto` table, bytes (MLA records and DSA pages among them).
pub const AUTO_ITEMS: [u64; 6] = [128, 656, 1152, 4096, 8448, 16384];
/// Run lengths of the `auto` table, items.
pub const AUTO_RUNS: [u64; 4] = [1, 4, 16, 64];

impl AutoTable {
    /// Before calibration: `direct` once a run is at least 8 KiB (a copy per run then costs
    /// less than the gather's per-item work on every executor measured).
    pub const DEFAULT: AutoTable = {
        let mut direct = [[[false; 4]; 6]; 2];
        let mut m = 0;
        while m < 2 {
            let mut i = 0;
            while i < 6 {
                let mut r = 0;
                while r < 4 {
                    direct[m][i][r] = AUTO_ITEMS[i] * AUTO_RUNS[r] >= 8192;
                    r += 1;
                }
                i += 1;
            }
            m += 1;
        }
        AutoTable { direct, calibrated: false }
    };

    /// The faster io backend for steps of `layers` layers, `item_bytes` items in runs of
    /// `mean_run` items (nearest table cell on a log scale).
    pub fn choose(&self, layers: usize, item_bytes: u64, mean_run: f64) -> IoBackend {
        let near = |grid: &[u64], v: f64| {
            let lv = v.max(1.0).log2();
            (0..grid.len())
                .min_by(|&a, &b| ((grid[a] as f64).log2() - lv).abs().total_cmp(&((grid[b] as f64).log2() - lv).abs()))
                .unwrap_or(0)
        };
        if self.direct[usize::from(layers > 1)][near(&AUTO_ITEMS, item_bytes as f64)][near(&AUTO_RUNS, mean_run)] {
            IoBackend::Direct
        } else {
            IoBackend::Kernel
        }
    }
}

impl Capabilities {
    /// What every executor of this crate supports; used by `hicache-io matrix`.
    pub const PORTABLE: Capabilities = Capabilities {
        name: "portable",
        kernel_word: 4,
        direct_align: 4,
        max_binding: 128 << 20,
        binding_align: 256,
        max_gather_items: 1 << 24,
        max_index: i32::MAX as u64,
        max_pool_bytes: u64::MAX,
        max_host_pool_bytes: u64::MAX,
        max_segment: u64::MAX,
        max_lanes: 1,
        max_loop_trips: u64::MAX,
        device_index_lists: false,
        checksums: false,
        direct_checksums: false,
        auto: AutoTable::DEFAULT,
    };
    /// Host-memory executors: no alignment or binding limit.
    pub const UNLIMITED: Capabilities = Capabilities {
        name: "unlimited",
        kernel_word: 4,
        direct_align: 1,
        max_binding: u64::MAX,
        binding_align: 1,
        max_gather_items: u64::MAX,
        max_index: u64::MAX,
        max_pool_bytes: u64::MAX,
        max_host_pool_bytes: u64::MAX,
        max_segment: u64::MAX,
        max_lanes: 1,
        max_loop_trips: u64::MAX,
        device_index_lists: false,
        checksums: false,
        direct_checksums: false,
        auto: AutoTable::DEFAULT,
    };

    /// The segment size of a pool buffer of `bytes` whose copy chunks are `chunk_bytes` (at
    /// multiples of it): `bytes` when it fits one buffer, else the largest multiple of
    /// `lcm(chunk, binding alignment, 16)` within `max_segment`, so that no chunk straddles two
    /// segments and every binding window and 16-byte word stays inside one. `None` when one
    /// chunk does not fit a segment.
    pub fn segment_bytes(&self, bytes: u64, chunk_bytes: u64) -> Option<u64> {
        if bytes <= self.max_segment {
            return Some(bytes);
        }
        let granule = lcm(lcm(chunk_bytes.max(1), self.binding_align.max(1)), 16);
        Some(self.max_segment / granule * granule).filter(|&s| s > 0)
    }

    /// Bytes a `kernel` window must be a multiple of for chunks of `chunk_bytes`.
    pub fn window_granule(&self, chunk_bytes: u64) -> u64 {
        lcm(lcm(chunk_bytes, self.binding_align), self.kernel_word)
    }
}

/// The word the launcher check of the `kernel` io backend uses: sglang's 8 bytes in profile
/// `sglang`, the executor's own word in profile `extended`.
pub fn kernel_word(profile: Profile, caps: &Capabilities) -> u64 {
    match profile {
        Profile::Sglang => 8,
        Profile::Extended => caps.kernel_word,
    }
}

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

fn sg(op: &'static str) -> Result<PathInfo> {
    Ok(PathInfo { op, extension: false })
}
fn ext(op: &'static str) -> Result<PathInfo> {
    Ok(PathInfo { op, extension: true })
}
fn e1(layout: Layout) -> Result<PathInfo> {
    Err(TransferError::UnsupportedLayout { layout: layout.name().into() })
}

/// Load and non-sharded backup: the same cells for every pool (page_head only for MHA), named
/// after sglang's ops (MLA and the DSA indexer use the `_mla` kernels).
fn plain(kind: PoolKind, op: TableOp, layout: Layout, io: IoBackend) -> Result<PathInfo> {
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
        (Load | Backup, Direct, LayerFirst) => "transfer_kv_direct",
        _ => return e1(layout),
    })
}

/// The validation table. `item_bytes` matters only for the DSA indexer's `kernel` gate;
/// `word` is [`kernel_word`] of the profile and executor.
pub fn decide(profile: Profile, cell: Cell, item_bytes: u64, word: u64) -> Result<PathInfo> {
    use IoBackend::*;
    use Layout::*;
    let Cell { kind, op, layout, io } = cell;
    let extended = profile == Profile::Extended;
    // The host pool cannot even be allocated with page_head (or head groups) unless it is MHA.
    if layout.splits_heads() && kind != PoolKind::Mha {
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

// ------------------------------------------------------------------------------------------
// Plans
// ------------------------------------------------------------------------------------------

/// One (layer, component) pair of a gather/scatter: where each item is read and written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddrPair {
    pub(crate) src: Addr,
    pub(crate) dst: Addr,
}

impl AddrPair {
    /// The source side.
    pub fn src(&self) -> &Addr {
        &self.src
    }
    /// The destination side.
    pub fn dst(&self) -> &Addr {
        &self.dst
    }
}

/// `kernel` io backend: for each index pair `i` (item-major; skipped when either index is
/// negative), for each address pair (layers, K then V), for each head `h < heads`, copy
/// `chunk_bytes` from `src.offset(s_i, h)` to `dst.offset(d_i, h)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatherStep {
    pub(crate) src_indices: Arc<[i64]>,
    pub(crate) dst_indices: Arc<[i64]>,
    /// Device addresses of this step's source and destination index lists when they are in
    /// CUDA memory (then `src_indices` / `dst_indices` hold only their length, as `-1`s).
    pub(crate) device_lists: Option<[u64; 2]>,
    pub(crate) chunk_bytes: u64,
    pub(crate) heads: u64,
    pub(crate) pairs: Vec<AddrPair>,
    /// The host item of each pair: `(host layer, component)`.
    pub(crate) items: Vec<(u64, u8)>,
    /// Whether the copies checksum the items they move (record on backups, verify on loads).
    pub(crate) checksum: Option<ChecksumMode>,
    pub(crate) lanes_log2: u32,
}

/// What a checksumming copy does with the checksum of each item it moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChecksumMode {
    /// A backup: record it in the host pool's table.
    Record,
    /// A load: compare it with the recorded one.
    Verify,
}

impl GatherStep {
    /// Source indices (negative: skip).
    pub fn src_indices(&self) -> &[i64] {
        &self.src_indices
    }
    /// Destination indices (negative: skip).
    pub fn dst_indices(&self) -> &[i64] {
        &self.dst_indices
    }
    /// Device addresses of the source and destination index lists (`i64`, as many as
    /// [`GatherStep::src_indices`] has entries) when they live in CUDA memory and are checked
    /// there ([`Plan::device_check`]); `None` when the lists above are the indices.
    pub fn device_lists(&self) -> Option<[u64; 2]> {
        self.device_lists
    }
    /// Bytes per (item, head).
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes
    }
    /// Head chunks per item (1 unless page_head or page_first_direct_hg).
    pub fn heads(&self) -> u64 {
        self.heads
    }
    /// The (layer, component) address pairs, K before V.
    pub fn pairs(&self) -> &[AddrPair] {
        &self.pairs
    }
    /// `(host layer, component)` of each address pair.
    pub fn items(&self) -> &[(u64, u8)] {
        &self.items
    }
    /// Whether (and how) the copies checksum the items.
    pub fn checksum(&self) -> Option<ChecksumMode> {
        self.checksum
    }
    /// Invocations per item chunk, `2^lanes_log2`: about one per 16-byte word of the chunk (4-byte
    /// words when the chunk is not whole 16-byte words), at most the executor's `max_lanes`.
    pub fn lanes_log2(&self) -> u32 {
        self.lanes_log2
    }
}

/// One contiguous byte copy of the `direct` io backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub(crate) src: BufRef,
    pub(crate) src_offset: u64,
    pub(crate) dst: BufRef,
    pub(crate) dst_offset: u64,
    pub(crate) len: u64,
    /// The run's host items: `items` consecutive ones from `host_unit` (into device units from
    /// `device_unit`), of host layer `host_layer` and component `comp`, each `len / items` bytes.
    pub(crate) items: u64,
    pub(crate) host_unit: u64,
    pub(crate) device_unit: u64,
    pub(crate) host_layer: u64,
    pub(crate) comp: u8,
}

impl Run {
    /// A run of `items = (count, host unit, device unit, host layer, component)`.
    fn new((src, src_offset): (BufRef, u64), (dst, dst_offset): (BufRef, u64), len: u64, items: (u64, u64, u64, u64, u8)) -> Run {
        let (items, host_unit, device_unit, host_layer, comp) = items;
        Run { src, src_offset, dst, dst_offset, len, items, host_unit, device_unit, host_layer, comp }
    }
    /// `(src buffer, src offset, dst buffer, dst offset, bytes)`.
    pub fn parts(&self) -> (BufRef, u64, BufRef, u64, u64) {
        (self.src, self.src_offset, self.dst, self.dst_offset, self.len)
    }
}

/// What one step does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepKind {
    /// A gather/scatter (`kernel`).
    Gather(GatherStep),
    /// Coalesced byte runs, copied in order (`direct`).
    Copy(Vec<Run>),
}

/// One step of a plan, and the host layers it writes or reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub(crate) kind: StepKind,
    pub(crate) layers: Vec<u64>,
    /// Whether a `direct` step's copies checksum the items they move (a `kernel` step says so in
    /// its [`GatherStep`]).
    pub(crate) checksum: Option<ChecksumMode>,
    /// For a `direct` step of a checksummed pool whose executor's copies cannot sum
    /// ([`Capabilities::direct_checksums`]): the executor settles the step's items as unknown,
    /// in queue order (a backup forgets their checksums, a load counts them unverified).
    pub(crate) unsummed: Option<ChecksumMode>,
}

impl Step {
    /// What the step does.
    pub fn kind(&self) -> &StepKind {
        &self.kind
    }
    /// Host layers this step moves (a layer split over several steps is listed by each).
    pub fn layers(&self) -> &[u64] {
        &self.layers
    }
    /// How a step that moves items without checksumming them settles them in queue order (see
    /// [`Capabilities::direct_checksums`]).
    pub fn unsummed(&self) -> Option<ChecksumMode> {
        self.unsummed
    }
    /// Whether (and how) the step's copies checksum the items they move.
    pub fn checksum(&self) -> Option<ChecksumMode> {
        match &self.kind {
            StepKind::Gather(g) => g.checksum,
            StepKind::Copy(_) => self.checksum,
        }
    }
}

/// Host to device (load) or device to host (backup).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Direction {
    /// Host pool to device pool.
    HostToDevice,
    /// Device pool to host pool.
    DeviceToHost,
}

/// The lowered form of one accepted call. Steps run in order (a layer-sharded backup has one
/// step per layer, like sglang's per-layer calls). Only the planner builds plans, and a plan
/// runs only on the executor instance it was made for, with pools of the geometry and profile
/// it was validated for.
///
/// Its numbers cannot be edited (they reach pointer arithmetic in the executors):
/// ```compile_fail
/// fn forge(plan: &mut hicache_io::Plan) {
///     plan.steps.clear();
/// }
/// ```
/// ```compile_fail
/// fn forge(run: &mut hicache_io::plan::Run) {
///     run.src_offset = 1 << 40;
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    owner: u64,
    pair: Arc<PoolPair>,
    profile: Profile,
    direction: Direction,
    path: PathInfo,
    io: IoBackend,
    steps: Arc<[Step]>,
    bytes: u64,
    device_check: Option<DeviceIndexCheck>,
    /// Host indices (in units: pages for the DSA indexer) of the call, negative: skipped.
    host_units: Arc<[i64]>,
}

/// The host layers of `steps`, ascending, each once.
pub(crate) fn layers_of<'a>(steps: impl IntoIterator<Item = &'a Step>) -> Vec<u64> {
    let mut layers: Vec<u64> = steps.into_iter().flat_map(|s| s.layers().iter().copied()).collect();
    layers.sort_unstable();
    layers.dedup();
    layers
}

impl Plan {
    /// The plan with its copies checksumming every item (`on`, on an executor whose copies can:
    /// [`Capabilities::checksums`]; index lists on the host). `direct` steps on an executor
    /// without [`Capabilities::direct_checksums`] settle their items as unknown instead, in queue
    /// order. Other plans are unchanged, and their backups leave the items' checksums unknown.
    pub(crate) fn with_checksums(mut self, on: bool, caps: &Capabilities) -> Plan {
        if !on || !caps.checksums || self.device_check.is_some() {
            return self;
        }
        let mode = match self.direction {
            Direction::HostToDevice => ChecksumMode::Verify,
            Direction::DeviceToHost => ChecksumMode::Record,
        };
        let mut steps: Vec<Step> = self.steps.to_vec();
        for step in &mut steps {
            match &mut step.kind {
                StepKind::Gather(g) => g.checksum = Some(mode),
                StepKind::Copy(_) if caps.direct_checksums => step.checksum = Some(mode),
                StepKind::Copy(_) => step.unsummed = Some(mode),
            }
        }
        self.steps = steps.into();
        self
    }
    /// Whether every step checksums what it copies.
    pub fn is_checksummed(&self) -> bool {
        self.steps.iter().all(|s| s.checksum().is_some())
    }
    /// Whether every step settles its items' checksums in queue order: it computes them, or
    /// (`direct` copies that cannot) records them as unknown. Such a plan needs the host pool's
    /// table bound; a plan that does neither (made for a pool without checksums) is settled by
    /// the pool before it runs.
    pub fn settles_checksums(&self) -> bool {
        self.steps.iter().all(|s| s.checksum().is_some() || s.unsummed.is_some())
    }
    /// Host indices of the call (in units), `None` when they live in CUDA memory.
    pub(crate) fn host_units(&self) -> Option<&[i64]> {
        self.device_check.is_none().then_some(&self.host_units[..])
    }
    /// The checks of index values an executor must make on the device before any step of this
    /// plan moves a byte (a plan made for index lists in CUDA memory); `None` when the planner
    /// made them.
    pub fn device_check(&self) -> Option<&DeviceIndexCheck> {
        self.device_check.as_ref()
    }
    /// Names the host and device index lists in the errors of the plan's device check.
    pub(crate) fn name_sides(&mut self, host: &'static str, device: &'static str) {
        if let Some(c) = &mut self.device_check {
            c.sides = [host, device];
        }
    }
    /// Bytes the plan copies.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
    /// True when the call is a defined no-op.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }
    /// The steps, in order.
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }
    /// The host layers the plan moves, ascending, each once.
    pub fn layers(&self) -> Vec<u64> {
        layers_of(self.steps.iter())
    }
    /// The steps, shared (a queued transfer holds them).
    pub(crate) fn shared_steps(&self) -> Arc<[Step]> {
        self.steps.clone()
    }
    /// The path that runs it (sglang's op name).
    pub fn path(&self) -> &PathInfo {
        &self.path
    }
    /// The io backend that runs it (`auto` resolved to `kernel` or `direct`).
    pub fn io_backend(&self) -> IoBackend {
        self.io
    }
    /// Load or backup.
    pub fn direction(&self) -> Direction {
        self.direction
    }
    /// The profile it was validated under.
    pub fn profile(&self) -> Profile {
        self.profile
    }
    /// The pool pair it was validated for.
    pub fn pair(&self) -> &PoolPair {
        &self.pair
    }
    /// The executor instance it runs on.
    pub(crate) fn owner(&self) -> u64 {
        self.owner
    }
}

/// The operation of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `load_to_device_per_layer(layer_id, is_draft)`. For drafts, `layer_id = layer_num + k`
    /// selects draft pool `k` (device layer 0, host layer `live target layers + k`).
    Load {
        /// Model layer id (or `layer_num + k` for draft `k`).
        layer_id: usize,
        /// sglang's `is_draft`.
        is_draft: bool,
    },
    /// `backup_from_device_all_layer`; layer-sharded when the device pool is.
    Backup,
    /// `backup_from_device_per_layer`: one device layer → its host layer (what sglang lacks: a
    /// per-layer backup, e.g. to overlap a layer's backup with the next layer's compute). It
    /// takes the layer-sharded backup's row of the table (that backup runs the same per-layer
    /// path), and a layer the pool does not own is a no-op, as for loads.
    BackupLayer {
        /// Model layer id (or `layer_num + k` for draft `k`).
        layer_id: usize,
        /// A draft (MTP) pool's layer.
        is_draft: bool,
    },
}

impl Op {
    /// Load or backup.
    pub fn direction(self) -> Direction {
        match self {
            Op::Load { .. } => Direction::HostToDevice,
            Op::Backup | Op::BackupLayer { .. } => Direction::DeviceToHost,
        }
    }
}

/// One call: operation, io backend and the two index lists (token slots; for the DSA indexer
/// the token indices are turned into pages here, like sglang).
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// Load or backup.
    pub op: Op,
    /// `kernel` or `direct`.
    pub io_backend: IoBackend,
    /// Host token slots (negative: skip).
    pub host_indices: &'a [i64],
    /// Device token slots (negative: skip).
    pub device_indices: &'a [i64],
}

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
fn table_op(op: Op, dev: &DeviceGeometry) -> TableOp {
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
fn plan_io(profile: Profile, caps: &Capabilities, owner: u64, pair: &Arc<PoolPair>, req: &Request<'_>) -> Result<Plan> {
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
    // 4. Launcher checks.
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
    check_indices(host, dev, caps, direction, req.io_backend, &hi, &di)?;
    let host_units: Arc<[i64]> = Arc::from(&hi[..]);
    let (steps, bytes) = match req.io_backend {
        IoBackend::Kernel => lower_gather(host, dev, caps, direction, &layer_groups, hi, di),
        _ => lower_direct(host, dev, direction, &layer_groups, &hi, &di),
    };
    Ok(Plan { owner, pair: pair.clone(), profile, direction, path, io, steps: steps.into(), bytes, device_check: None, host_units })
}

/// Index lists in CUDA device memory: `len` `i64` entries at `host` (the host pool's indices) and
/// at `device` (the device pool's), which the host does not read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceIndexLists {
    /// Device address of the host pool's indices.
    pub host: u64,
    /// Device address of the device pool's indices.
    pub device: u64,
    /// Entries in each list.
    pub len: usize,
}

/// The value checks the planner makes on host index lists, left to the executor for lists in
/// device memory, in the planner's order: host indices in range, device indices in range,
/// destinations unique among live pairs. The first failing (check, position) becomes the error
/// the planner would have returned ([`DeviceIndexCheck::error`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceIndexCheck {
    /// The lists.
    pub lists: DeviceIndexLists,
    /// Host indices must be below this.
    pub host_bound: u64,
    /// Device indices must be below this.
    pub device_bound: u64,
    /// Whether the host indices are the destinations (a backup).
    pub dst_is_host: bool,
    /// What an index counts.
    pub unit: &'static str,
    /// The call, for the error.
    pub call: &'static str,
    /// How the error names the host and the device lists (`"host"`, `"device"` for pools;
    /// the kvcacheio ops say `"source"` / `"destination"`).
    pub sides: [&'static str; 2],
}

impl DeviceIndexCheck {
    /// The error for the device's finding: `check` 0 (host range), 1 (device range) or 2
    /// (duplicate destination) at `position`, the index found there, and for a duplicate the
    /// position that wrote the destination first.
    pub fn error(&self, check: u64, position: u64, index: i64, first: u64) -> TransferError {
        let position = usize::try_from(position).unwrap_or(usize::MAX);
        let found = match check {
            0 => TransferError::IndexOutOfRange { side: self.sides[0], index, position, bound: self.host_bound, unit: self.unit },
            1 => TransferError::IndexOutOfRange { side: self.sides[1], index, position, bound: self.device_bound, unit: self.unit },
            _ => TransferError::DuplicateDestination {
                side: if self.dst_is_host { self.sides[0] } else { self.sides[1] },
                unit: self.unit,
                index,
                first: usize::try_from(first).unwrap_or(usize::MAX),
                second: position,
            },
        };
        TransferError::DeviceIndexCheck { call: self.call, source: Box::new(found) }
    }
}

/// Entries a device-checked list may have: 2^24, far more than one batch's tokens. The plan is
/// made on the host from the list's length (placeholder entries, about 40 bytes per entry while
/// planning), and positions must fit the device check's 32-bit claim words.
pub const MAX_DEVICE_LIST_LEN: usize = 1 << 24;

/// [`plan`] for index lists in CUDA memory: every check that needs no index value is made here,
/// as for host lists and in the same order; the value checks go to the plan's
/// [`DeviceIndexCheck`]. `kernel` only (a `direct` copy's runs are made from index values on
/// the host), and not for the DSA indexer (its token lists become page lists on the host).
#[allow(clippy::too_many_arguments)]
pub(crate) fn plan_device_lists(
    profile: Profile,
    caps: &Capabilities,
    owner: u64,
    pair: &Arc<PoolPair>,
    op: Op,
    io_backend: IoBackend,
    lists: DeviceIndexLists,
    call: &'static str,
) -> Result<Plan> {
    let host = pair.host();
    let refuse = |why: &str| TransferError::BadTensor { arg: "indices".into(), reason: format!("CUDA index lists: {why}") };
    if !caps.device_index_lists {
        return Err(refuse(&format!("the {} executor cannot read them (they need the cuda executor)", caps.name)));
    }
    if io_backend != IoBackend::Kernel {
        return Err(refuse("io backend kernel only (pass host indices to direct and auto)"));
    }
    if host.kind() == PoolKind::DsaIndexer {
        return Err(refuse("not for the DSA indexer (its token lists become pages on the host)"));
    }
    if lists.len > MAX_DEVICE_LIST_LEN {
        return Err(refuse(&format!("{} entries, at most {MAX_DEVICE_LIST_LEN}", lists.len)));
    }
    if host.slots().max(pair.device().slots()).saturating_sub(1) > caps.max_index {
        return Err(refuse("the pools are wider than this executor's indices"));
    }
    // Placeholders of the lists' length: negative entries are skipped by every value check and
    // every step, so the plan below is the call's shape with no value looked at.
    let mut placeholder: Vec<i64> = Vec::new();
    placeholder.try_reserve_exact(lists.len).map_err(|_| TransferError::OutOfMemory {
        what: "plan of CUDA index lists".into(),
        requested: lists.len as u64 * 8,
        limit: "host allocation failed".into(),
    })?;
    placeholder.resize(lists.len, -1);
    let req = Request { op, io_backend, host_indices: &placeholder, device_indices: &placeholder };
    let mut plan = plan_io(profile, caps, owner, pair, &req)?;
    if plan.is_empty() {
        return Ok(plan);
    }
    let direction = op.direction();
    let (src, dst) = match direction {
        Direction::HostToDevice => (lists.host, lists.device),
        Direction::DeviceToHost => (lists.device, lists.host),
    };
    let item = host.kind().components() as u64 * host.item_bytes();
    let (mut offset, mut bytes) = (0u64, 0u64);
    let mut group_start: Option<*const i64> = None;
    let mut steps: Vec<Step> = plan.steps.to_vec();
    for step in &mut steps {
        let layers = step.layers.len() as u64;
        if let StepKind::Gather(g) = &mut step.kind {
            // A layer group's pieces follow each other and cover the lists in order; every group
            // starts again with the first piece (the same list).
            if group_start.is_none() || group_start == Some(g.src_indices.as_ptr()) {
                group_start = Some(g.src_indices.as_ptr());
                offset = 0;
            }
            g.device_lists = Some([src + offset * 8, dst + offset * 8]);
            let n = g.src_indices.len() as u64;
            offset += n;
            // At most: the device may skip negative entries, which the host cannot count.
            bytes = bytes.saturating_add(n.saturating_mul(layers).saturating_mul(item));
        }
    }
    plan.steps = steps.into();
    plan.bytes = bytes;
    plan.device_check = Some(DeviceIndexCheck {
        lists,
        host_bound: host.slots(),
        device_bound: pair.device().slots(),
        dst_is_host: direction == Direction::DeviceToHost,
        unit: "slots",
        call,
        sides: ["host", "device"],
    });
    Ok(plan)
}

/// (host layer, device buffer slot) pairs, one group per step.
type LayerGroups = Vec<Vec<(u64, u32)>>;

/// The layers of a call; `None` for a defined no-op.
fn resolve_layers(dev: &DeviceGeometry, op: Op, table_op: TableOp) -> Result<Option<LayerGroups>> {
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

/// What an accepted call touches, for ordering a pipeline's two streams: layers (a host layer
/// and its device buffer share the number), and host and device pages (sorted, unique;
/// skipped entries dropped). Pages, not tokens: a `direct` copy moves whole pages, and two
/// calls on different tokens of one page are ordered too, which is never wrong.
#[derive(Debug, Clone, Default)]
pub(crate) struct Footprint {
    layers: Vec<u64>,
    host: Vec<i64>,
    device: Vec<i64>,
}

impl Footprint {
    /// The footprint of `plan`, accepted for `req`.
    pub(crate) fn of(plan: &Plan, req: &Request<'_>) -> Footprint {
        let host = plan.pair().host();
        // An accepted plan's lists convert (the planner did the same); a no-op touches nothing.
        let Ok((hi, di)) = index_units(host, req) else { return Footprint::default() };
        if plan.is_empty() {
            return Footprint::default();
        }
        let per_unit = if host.kind() == PoolKind::DsaIndexer { 1 } else { host.page_size().max(1) as i64 };
        let pages = |v: Vec<i64>| {
            let mut p: Vec<i64> = v.into_iter().filter(|&x| x >= 0).map(|x| x / per_unit).collect();
            p.sort_unstable();
            p.dedup();
            p
        };
        Footprint { layers: plan.layers(), host: pages(hi), device: pages(di) }
    }

    /// Whether the two calls touch the same bytes: a common layer and a common host or device
    /// page (a load reads host pages and writes device pages, a backup the other way round, so
    /// any common page of a common layer is a read/write pair).
    pub(crate) fn conflicts(&self, other: &Footprint) -> bool {
        intersects(&self.layers, &other.layers) && (intersects(&self.host, &other.host) || intersects(&self.device, &other.device))
    }
}

/// Whether two sorted lists share an element.
fn intersects<T: Ord>(a: &[T], b: &[T]) -> bool {
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => return true,
        }
    }
    false
}

/// The index lists in index units: token slots, or for the DSA indexer one page per group of
/// `P` tokens (dsa.py `_get_indexer_page_indices`; empty lists pass through).
fn index_units(host: &HostGeometry, req: &Request<'_>) -> Result<(Vec<i64>, Vec<i64>)> {
    if host.kind() != PoolKind::DsaIndexer || (req.host_indices.is_empty() && req.device_indices.is_empty()) {
        return Ok((req.host_indices.to_vec(), req.device_indices.to_vec()));
    }
    let p = host.page_size();
    for list in [req.host_indices, req.device_indices] {
        if !(list.len() as u64).is_multiple_of(p) {
            return Err(TransferError::DsaUnalignedCount { len: list.len(), page_size: p });
        }
    }
    Ok((to_pages(req.host_indices, p), to_pages(req.device_indices, p)))
}

/// The checks sglang's launchers make: equal lengths, the `kernel` word, whole `direct` pages.
/// The per-head chunk of page_head is checked against the executors' common word too: a chunk
/// that is not whole words would be truncated (sglang) or misaligned (GPU executors).
fn launcher_checks(host: &HostGeometry, caps: &Capabilities, word: u64, io: IoBackend, host_len: usize, device_len: usize) -> Result<()> {
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

/// hicache-io's own checks: ranges, whole pages, unique destinations, executor limits.
fn check_indices(
    host: &HostGeometry,
    dev: &DeviceGeometry,
    caps: &Capabilities,
    direction: Direction,
    io: IoBackend,
    hi: &[i64],
    di: &[i64],
) -> Result<()> {
    let unit = if host.kind() == PoolKind::DsaIndexer { "pages" } else { "slots" };
    check_range("host", hi, host.slots(), unit)?;
    check_range("device", di, dev.slots(), unit)?;
    let group = host.index_page_size();
    if io == IoBackend::Direct && host.layout() == Layout::PageFirstDirect && group > 1 {
        check_whole_pages("host", hi, group)?;
        check_whole_pages("device", di, group)?;
    }
    let (dst_side, dst_list, dst_bound) = match direction {
        Direction::HostToDevice => ("device", di, dev.slots()),
        Direction::DeviceToHost => ("host", hi, host.slots()),
    };
    check_unique(dst_side, dst_list, hi, di, dst_bound, unit)?;
    match io {
        IoBackend::Direct | IoBackend::Auto => {
            if !host.item_bytes().is_multiple_of(caps.direct_align) {
                return Err(TransferError::Misaligned {
                    what: format!("{} direct copy item bytes", caps.name),
                    value: host.item_bytes(),
                    required: caps.direct_align,
                });
            }
        }
        IoBackend::Kernel => {
            let granule = caps.window_granule(host.chunk_bytes());
            if granule > caps.max_binding {
                return Err(TransferError::WindowTooSmall {
                    executor: caps.name,
                    chunk_bytes: host.chunk_bytes(),
                    window: caps.max_binding,
                    required: granule,
                });
            }
            if gather_lanes(caps, host.chunk_bytes(), host.head_num()).is_none() {
                return Err(TransferError::ExecutorLimit {
                    executor: caps.name,
                    what: "head chunks per item (each costs an invocation two loop iterations at least)",
                    value: host.head_num(),
                    limit: caps.max_loop_trips / 2,
                });
            }
            // Indices a gather cannot address (a pool larger than the executor's index width).
            for (side, slots) in [("host", host.slots()), ("device", dev.slots())] {
                if slots - 1 > caps.max_index {
                    let list = if side == "host" { hi } else { di };
                    if let Some(position) = list.iter().position(|&x| x >= 0 && x as u64 > caps.max_index) {
                        return Err(TransferError::IndexOutOfRange {
                            side,
                            index: list[position],
                            position,
                            bound: caps.max_index + 1,
                            unit: "slots (executor index width)",
                        });
                    }
                }
            }
        }
    }
    Ok(())
}

/// Lanes per item (log2) of a gather of `heads` chunks of `chunk` bytes: the adapter's policy for
/// the chunk's words (`caps.max_lanes`), raised where one invocation would run more loop
/// iterations than `caps.max_loop_trips` (per head, its words per lane plus one, counted in the
/// executor's smallest word, which it may fall back to); `None` when no lane count fits.
fn gather_lanes(caps: &Capabilities, chunk: u64, heads: u64) -> Option<u32> {
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
fn lower_gather(
    host: &HostGeometry,
    dev: &DeviceGeometry,
    caps: &Capabilities,
    direction: Direction,
    layer_groups: &[Vec<(u64, u32)>],
    hi: Vec<i64>,
    di: Vec<i64>,
) -> (Vec<Step>, u64) {
    let heads = host.head_num();
    let comps = host.kind().components() as u8;
    let live = hi.iter().zip(&di).filter(|(h, d)| **h >= 0 && **d >= 0).count() as u64;
    let (src, dst) = match direction {
        Direction::HostToDevice => (hi, di),
        Direction::DeviceToHost => (di, hi),
    };
    // The gather's shape (checked by `check_indices`), and at most 2^31 invocations a step.
    let lanes_log2 = gather_lanes(caps, host.chunk_bytes(), heads).unwrap_or(0);
    let per = usize::try_from(caps.max_gather_items.min((1u64 << 31) >> lanes_log2).max(1)).unwrap_or(usize::MAX);
    let pieces: Vec<[Arc<[i64]>; 2]> = if src.len() <= per {
        vec![[src.into(), dst.into()]]
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
fn lower_direct(
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

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Least common multiple (`0` stays `0`; saturates instead of wrapping).
pub fn lcm(a: u64, b: u64) -> u64 {
    if a == 0 || b == 0 {
        return 0;
    }
    (a / gcd(a, b)).saturating_mul(b)
}

/// Token indices → page indices, one per group of `p`, from the group's first token like
/// sglang (`[:, 0] // P`; negative stays negative). Whether each group really is a whole page is
/// checked later, with hicache-io's own checks, so that sglang's errors come first.
fn to_pages(tokens: &[i64], p: u64) -> Vec<i64> {
    tokens.chunks(p as usize).map(|g| g[0].div_euclid(p as i64)).collect()
}

/// Each group of `p` must be a whole page (`k·p, k·p + 1, …, k·p + p − 1`) or all negative
/// (skipped). sglang reads only the first entry of each group and assumes the rest; every entry
/// is checked here, so that no accepted call means something other than its index list says.
/// `p` is at most 2^32 (checked by the geometry).
fn check_whole_pages(side: &'static str, idx: &[i64], p: u64) -> Result<()> {
    let pu = p as usize;
    let pi = p as i64;
    for (g, chunk) in idx.chunks_exact(pu).enumerate() {
        let first = chunk[0];
        let ok = if first < 0 {
            chunk.iter().all(|&x| x < 0)
        } else {
            // Branch-free over the page (it vectorizes): every entry minus its position is `first`.
            first % pi == 0
                && first.checked_add(pi - 1).is_some()
                && chunk.iter().zip(0..pi).fold(0i64, |acc, (&x, k)| acc | (x.wrapping_sub(k) ^ first)) == 0
        };
        if !ok {
            return Err(TransferError::NotWholePage { side, start: first, end: chunk[pu - 1], position: g * pu, page_size: p });
        }
    }
    Ok(())
}

fn check_range(side: &'static str, idx: &[i64], bound: u64, unit: &'static str) -> Result<()> {
    match idx.iter().position(|&x| x >= 0 && x as u64 >= bound) {
        Some(position) => Err(TransferError::IndexOutOfRange { side, index: idx[position], position, bound, unit }),
        None => Ok(()),
    }
}

/// Rejects a destination written twice by live pairs (an executor-dependent result otherwise).
/// Indices are already range-checked against `bound`.
fn check_unique(side: &'static str, dst: &[i64], hi: &[i64], di: &[i64], bound: u64, unit: &'static str) -> Result<()> {
    let words = usize::try_from(bound.div_ceil(64)).unwrap_or(usize::MAX);
    let mut seen: Vec<u64> = Vec::new();
    // A pool of 2^40 slots would need 128 GiB of bitmap; sort instead when the list is smaller.
    if seen.try_reserve_exact(words).is_err() || words / 8 > dst.len() + 1024 {
        return check_unique_sorted(side, dst, hi, di, unit);
    }
    seen.resize(words, 0);
    for (i, &d) in dst.iter().enumerate() {
        if hi[i] < 0 || di[i] < 0 {
            continue;
        }
        let (w, b) = ((d as u64 / 64) as usize, d as u64 % 64);
        if seen[w] & (1 << b) != 0 {
            return Err(duplicate(side, dst, hi, di, i, unit));
        }
        seen[w] |= 1 << b;
    }
    Ok(())
}

fn check_unique_sorted(side: &'static str, dst: &[i64], hi: &[i64], di: &[i64], unit: &'static str) -> Result<()> {
    let mut live: Vec<(i64, usize)> = (0..dst.len()).filter(|&i| hi[i] >= 0 && di[i] >= 0).map(|i| (dst[i], i)).collect();
    live.sort_unstable();
    match live.windows(2).filter(|w| w[0].0 == w[1].0).map(|w| w[1].1).min() {
        Some(i) => Err(duplicate(side, dst, hi, di, i, unit)),
        None => Ok(()),
    }
}

/// The error for a destination written again at position `second` (rare path: finds where it
/// was first written, for the message).
fn duplicate(side: &'static str, dst: &[i64], hi: &[i64], di: &[i64], second: usize, unit: &'static str) -> TransferError {
    let d = dst[second];
    let first = dst[..second].iter().enumerate().position(|(j, &x)| x == d && hi[j] >= 0 && di[j] >= 0).unwrap_or(0);
    TransferError::DuplicateDestination { side, unit, index: d, first, second }
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
fn page_spans(hi: &[i64], di: &[i64], p: u64) -> Vec<(u64, u64, u64)> {
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
fn push_run(runs: &mut Vec<Run>, r: Run) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_default_rule_and_nearest_cells() {
        let t = AutoTable::DEFAULT;
        assert_eq!(t.choose(1, 128.0 as u64, 1.0), IoBackend::Kernel);
        assert_eq!(t.choose(1, 8448, 1.0), IoBackend::Direct);
        assert_eq!(t.choose(8, 1152, 64.0), IoBackend::Direct);
        assert_eq!(t.choose(8, 1152, 2.0), IoBackend::Kernel);
        assert!((mean_run(&[0, 1, 2, 9], &[5, 6, 7, 1]) - 2.0).abs() < 1e-9);
        assert!((mean_run(&[0, -1, 2], &[0, 1, 2]) - 1.0).abs() < 1e-9);
    }

    /// `auto` answers a wrong call with the same error whichever path the calibration prefers.
    #[test]
    fn auto_answers_a_wrong_call_alike_whatever_the_calibration() {
        let dc =
            crate::pool::DevicePoolConfig { kind: PoolKind::Mla, bytes_per_token: 64, slots: 64, page_size: 4, layers: LayerMap::new(2) };
        let pair = Arc::new(PoolPair::new(dc.geometry().unwrap(), Layout::LayerFirst, 64, 1).unwrap());
        let op = Op::Load { layer_id: 0, is_draft: false };
        let calls: [(Vec<i64>, Vec<i64>); 2] = [(vec![0, 1], vec![2, 64]), ((0..8).collect(), vec![8, 9, 10, 11, 12, 13, 14, 8])];
        let answers = |direct: bool| -> Vec<String> {
            let caps = Capabilities { auto: AutoTable { direct: [[[direct; 4]; 6]; 2], calibrated: true }, ..Capabilities::UNLIMITED };
            assert_eq!(caps.auto.choose(1, 64, 8.0), if direct { IoBackend::Direct } else { IoBackend::Kernel });
            calls
                .iter()
                .map(|(hi, di)| {
                    let req = Request { op, io_backend: IoBackend::Auto, host_indices: hi, device_indices: di };
                    plan(Profile::Extended, &caps, 1, &pair, &req).unwrap_err().to_string()
                })
                .collect()
        };
        let (k, d) = (answers(false), answers(true));
        assert_eq!(k, d);
        assert!(k[0].contains("64") && k[0].contains("device"), "{}", k[0]);
        assert!(k[1].contains("written twice") || k[1].to_lowercase().contains("duplicate"), "{}", k[1]);
    }

    #[test]
    fn coalescing_like_transfer_kv_direct() {
        assert_eq!(coalesce(&[0, 1, 2, 7, 8], &[10, 11, 5, 6, 7]), vec![(0, 10, 2), (2, 5, 1), (7, 6, 2)]);
        assert_eq!(coalesce(&[0, -1, 2, 3], &[0, 1, 2, 3]), vec![(0, 0, 1), (2, 2, 2)]);
    }

    #[test]
    fn whole_pages_near_the_integer_limit() {
        assert!(check_whole_pages("host", &[i64::MAX - 3, i64::MAX - 2, i64::MAX - 1, i64::MAX], 4).is_ok());
        // (2^63 - 2) is a multiple of 3 whose page would end past i64::MAX.
        assert!(check_whole_pages("host", &[i64::MAX - 1, 0, 0], 3).is_err());
        // Interior entries count, not only the first and last.
        assert!(check_whole_pages("host", &[4, 6, 5, 7], 4).is_err());
        assert!(check_whole_pages("host", &[-1, 2, -1, -1], 4).is_err());
        assert!(check_whole_pages("host", &[4, 5, 6, 7, -1, -1, -1, -1], 4).is_ok());
    }

    #[test]
    fn duplicates_are_found_with_and_without_a_bitmap() {
        let (hi, di) = ([0i64, 1, 2, 3], [5i64, 9, 5, 7]);
        let e = check_unique("device", &di, &hi, &di, 10, "slots").unwrap_err();
        assert!(matches!(e, TransferError::DuplicateDestination { first: 0, second: 2, .. }), "{e:?}");
        let e = check_unique("device", &di, &hi, &di, 1 << 50, "slots").unwrap_err();
        assert!(matches!(e, TransferError::DuplicateDestination { first: 0, second: 2, .. }), "{e:?}");
    }
}
