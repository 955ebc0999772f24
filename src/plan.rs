//! The one validation table and the lowering of accepted requests into plans.
//!
//! [`decide`] is the table: for (profile, pool kind, operation, layout, io backend) it returns
//! the path sglang would run (named after its op) or the error sglang raises, verbatim.
//! [`plan`] runs [`decide`], then checks the indices of one call and lowers it into a
//! [`Plan`]: plain data that every executor runs the same way. Executors never decide support;
//! their limits reach this module as [`Capabilities`].

use std::sync::Arc;

use crate::error::{Result, TransferError};
use crate::geometry::{DeviceGeometry, HostGeometry, IoBackend, Layout, PoolKind, PoolPair, Profile};

/// What an executor can address; read by the planner so that backend limits are rejected here,
/// in the same place as everything else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    pub name: &'static str,
    /// Smallest word the `kernel` path copies (profile `extended`; `sglang` always uses 8).
    pub kernel_word: u64,
    /// Alignment of every offset and length of a `direct` copy.
    pub direct_align: u64,
    /// Largest range a `kernel` step can bind at once (wgpu: the storage binding limit), and the
    /// alignment of a bound range's start. An item chunk must fit one aligned window.
    pub max_binding: u64,
    pub binding_align: u64,
}

impl Capabilities {
    /// What every executor of this crate supports; used by `hicache-io matrix`.
    pub const PORTABLE: Capabilities =
        Capabilities { name: "portable", kernel_word: 4, direct_align: 4, max_binding: 128 << 20, binding_align: 256 };
    /// Host-memory executors: no alignment or binding limit.
    pub const UNLIMITED: Capabilities =
        Capabilities { name: "unlimited", kernel_word: 4, direct_align: 1, max_binding: u64::MAX, binding_align: 1 };

    /// Bytes a `kernel` window must be a multiple of for chunks of `chunk_bytes`.
    pub fn window_granule(&self, chunk_bytes: u64) -> u64 {
        lcm(lcm(chunk_bytes, self.binding_align), self.kernel_word)
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
    pub const ALL: [TableOp; 3] = [TableOp::Load, TableOp::Backup, TableOp::ShardedBackup];
    pub fn name(self) -> &'static str {
        match self {
            TableOp::Load => "load",
            TableOp::Backup => "backup",
            TableOp::ShardedBackup => "sharded-backup",
        }
    }
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
        (Backup, Direct, PageFirstDirect) => "transfer_kv_all_layer_direct_lf_pf",
        (Load | Backup, Direct, LayerFirst) => "transfer_kv_direct",
        _ => return e1(layout),
    })
}

/// The validation table (reference §2.6). `item_bytes` matters only for the DSA indexer's
/// `kernel` gate; `kernel_word` is the executor's word (8 in profile `sglang`).
pub fn decide(
    profile: Profile,
    kind: PoolKind,
    op: TableOp,
    layout: Layout,
    io: IoBackend,
    item_bytes: u64,
    kernel_word: u64,
) -> Result<PathInfo> {
    use IoBackend::*;
    use Layout::*;
    let extended = profile == Profile::Extended;
    // The host pool cannot even be allocated with page_head unless it is MHA.
    if layout == PageHead && kind != PoolKind::Mha {
        return e1(layout);
    }
    // dsa.py: `use_kernel = io_backend == "kernel" and stride % 8 == 0`, else-branch raises.
    if kind == PoolKind::DsaIndexer && io == Kernel && item_bytes % if extended { kernel_word } else { 8 } != 0 {
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

/// A buffer of the pool pair: host component buffer, or device buffer `slot` (live target
/// layers in order, then drafts) of a component. Component 0 is K (or the only buffer), 1 is V.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BufRef {
    Host { comp: u8 },
    Device { comp: u8, slot: u32 },
}

/// Where item `idx`, head chunk `head` of one (buffer, layer) lies: byte offset
/// `base + (idx / page) × page_stride + (idx % page) × row_stride + head × head_stride`.
/// One formula covers layer_first (`page = 1`), page_first, page_first_direct and page_head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Addr {
    pub buf: BufRef,
    pub base: u64,
    pub page: u64,
    pub page_stride: u64,
    pub row_stride: u64,
    pub head_stride: u64,
}

impl Addr {
    #[inline(always)]
    pub fn offset(&self, idx: u64, head: u64) -> u64 {
        // page == 1 (every layout but page_head / page_first_direct) skips two divisions.
        let paged = if self.page == 1 {
            idx * self.page_stride
        } else {
            (idx / self.page) * self.page_stride + (idx % self.page) * self.row_stride
        };
        self.base + paged + head * self.head_stride
    }
}

/// One (layer, component) pair of a gather/scatter: source and destination addressing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub src: Addr,
    pub dst: Addr,
}

/// `kernel` io backend: for each index pair `i` (item-major; skipped when either index is
/// negative), for each launch (layers, K then V), for each head `h < heads`, copy `chunk_bytes`
/// from `src.offset(s_i, h)` to `dst.offset(d_i, h)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatherStep {
    pub src_indices: Arc<[i64]>,
    pub dst_indices: Arc<[i64]>,
    pub chunk_bytes: u64,
    pub heads: u64,
    pub launches: Vec<Launch>,
}

/// One contiguous byte copy of the `direct` io backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub src: BufRef,
    pub src_offset: u64,
    pub dst: BufRef,
    pub dst_offset: u64,
    pub len: u64,
}

/// `direct` io backend: coalesced byte runs, copied in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyStep {
    pub runs: Vec<Run>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Gather(GatherStep),
    Copy(CopyStep),
}

/// Host to device (load) or device to host (backup).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Direction {
    HostToDevice,
    DeviceToHost,
}

/// The lowered form of one accepted call. Steps run in order (a layer-sharded backup has one
/// step per layer, like sglang's per-layer calls).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The pools and profile it was validated for (executing it elsewhere is refused).
    pub pair: Arc<PoolPair>,
    pub profile: Profile,
    pub direction: Direction,
    pub path: PathInfo,
    pub steps: Vec<Step>,
}

impl Plan {
    /// Bytes the plan copies.
    pub fn bytes(&self) -> u64 {
        self.steps
            .iter()
            .map(|s| match s {
                Step::Gather(g) => {
                    let live = g.src_indices.iter().zip(g.dst_indices.iter()).filter(|(s, d)| **s >= 0 && **d >= 0).count() as u64;
                    live * g.launches.len() as u64 * g.heads * g.chunk_bytes
                }
                Step::Copy(c) => c.runs.iter().map(|r| r.len).sum(),
            })
            .sum()
    }
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }
}

/// The operation of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `load_to_device_per_layer(layer_id, is_draft)`. For drafts, `layer_id = layer_num + k`
    /// selects draft pool `k` (device layer 0, host layer `live target layers + k`).
    Load { layer_id: usize, is_draft: bool },
    /// `backup_from_device_all_layer`; layer-sharded when the device pool is.
    Backup,
}

/// One call: operation, io backend and the two index lists (token slots; for the DSA indexer
/// the token indices are turned into pages here, like sglang).
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub op: Op,
    pub io_backend: IoBackend,
    pub host_indices: &'a [i64],
    pub device_indices: &'a [i64],
}

impl HostGeometry {
    /// Addressing of component `comp`, host layer `layer`.
    pub fn addr(&self, comp: u8, layer: u64) -> Addr {
        let item = self.item_bytes;
        let l = self.layer_num;
        let h = self.head_num;
        let d = item / h;
        let buf = BufRef::Host { comp };
        match self.layout {
            Layout::LayerFirst => {
                Addr { buf, base: layer * self.slots() * item, page: 1, page_stride: item, row_stride: 0, head_stride: d }
            }
            Layout::PageFirst => Addr { buf, base: layer * item, page: 1, page_stride: l * item, row_stride: 0, head_stride: d },
            Layout::PageFirstDirect => {
                let p = self.index_page_size();
                Addr { buf, base: layer * p * item, page: p, page_stride: l * p * item, row_stride: item, head_stride: d }
            }
            Layout::PageHead => {
                let p = self.page_size;
                Addr { buf, base: layer * d, page: p, page_stride: h * p * l * d, row_stride: l * d, head_stride: p * l * d }
            }
        }
    }
}

impl DeviceGeometry {
    /// Addressing of component `comp`, buffer `slot`; `heads` splits the item for page_head.
    pub fn addr(&self, comp: u8, slot: u32, heads: u64) -> Addr {
        Addr {
            buf: BufRef::Device { comp, slot },
            base: 0,
            page: 1,
            page_stride: self.item_bytes,
            row_stride: 0,
            head_stride: self.item_bytes / heads,
        }
    }
}

/// Validates one call against the table and its indices, and lowers it. An `Err` means no byte
/// may move; `Ok` with no steps is a defined no-op (empty indices, a layer this pool does not
/// own or a DSA skip-topk layer, as in sglang).
pub fn plan(profile: Profile, caps: &Capabilities, pair: &PoolPair, req: &Request<'_>) -> Result<Plan> {
    let host = &pair.host;
    let dev = &pair.device;
    if host.kind != dev.kind
        || host.item_bytes != dev.item_bytes
        || host.page_size != dev.page_size
        || host.layer_num != dev.layers.host_layers() as u64
    {
        return Err(TransferError::Geometry(format!(
            "host pool ({} item {} B, P {}, L {}) was not built for this device pool ({} item {} B, P {}, L {})",
            host.kind,
            host.item_bytes,
            host.page_size,
            host.layer_num,
            dev.kind,
            dev.item_bytes,
            dev.page_size,
            dev.layers.host_layers()
        )));
    }
    let table_op = match req.op {
        Op::Load { .. } => TableOp::Load,
        Op::Backup if dev.layers.is_sharded() => TableOp::ShardedBackup,
        Op::Backup => TableOp::Backup,
    };
    let kernel_word = if profile == Profile::Sglang { 8 } else { caps.kernel_word };
    let path = decide(profile, host.kind, table_op, host.layout, req.io_backend, host.item_bytes, kernel_word)?;
    let direction = match req.op {
        Op::Load { .. } => Direction::HostToDevice,
        Op::Backup => Direction::DeviceToHost,
    };
    let shared = Arc::new(pair.clone());
    let empty = Plan { pair: shared.clone(), profile, direction, path: path.clone(), steps: Vec::new() };

    // Layers: (host layer, device slot) pairs, one group per step.
    let layer_groups: Vec<Vec<(u64, u32)>> = match req.op {
        Op::Load { layer_id, is_draft } => {
            let m = &dev.layers;
            let slot = if is_draft {
                match layer_id.checked_sub(m.layer_num).filter(|k| *k < m.drafts) {
                    Some(k) => m.draft_slot(k),
                    None => return Err(layer_error(layer_id, dev)),
                }
            } else {
                if layer_id >= m.layer_num {
                    return Err(layer_error(layer_id, dev));
                }
                match m.target_slot(layer_id) {
                    Some(s) => s,
                    None => return Ok(empty), // not owned / skip-topk: sglang returns
                }
            };
            vec![vec![(slot as u64, slot as u32)]]
        }
        Op::Backup => {
            let all: Vec<(u64, u32)> = (0..dev.layers.host_layers()).map(|s| (s as u64, s as u32)).collect();
            if table_op == TableOp::ShardedBackup {
                all.into_iter().map(|p| vec![p]).collect()
            } else {
                vec![all]
            }
        }
    };

    // Indices: DSA turns token indices into pages first (dsa.py `_get_indexer_page_indices`).
    let (hi, di): (Vec<i64>, Vec<i64>) = if host.kind == PoolKind::DsaIndexer {
        if req.host_indices.is_empty() && req.device_indices.is_empty() {
            return Ok(empty);
        }
        let p = host.page_size;
        for list in [req.host_indices, req.device_indices] {
            if list.len() as u64 % p != 0 {
                return Err(TransferError::DsaUnalignedCount { len: list.len(), page_size: p });
            }
        }
        (to_pages("host", req.host_indices, p)?, to_pages("device", req.device_indices, p)?)
    } else {
        (req.host_indices.to_vec(), req.device_indices.to_vec())
    };
    if hi.len() != di.len() {
        return Err(TransferError::LengthMismatch { src_len: hi.len(), dst_len: di.len() });
    }
    let group = host.index_page_size();
    match req.io_backend {
        IoBackend::Kernel => {
            if host.item_bytes % kernel_word != 0 {
                return Err(TransferError::ItemNotWordAligned { item_bytes: host.item_bytes, word: kernel_word });
            }
        }
        IoBackend::Direct => {
            if hi.len() as u64 % group != 0 {
                return Err(TransferError::DirectCountNotPageMultiple { len: hi.len(), page_size: group });
            }
        }
    }
    if hi.is_empty() {
        return Ok(empty);
    }
    let unit = if host.kind == PoolKind::DsaIndexer { "pages" } else { "slots" };
    check_range("host", &hi, host.slots(), unit)?;
    check_range("device", &di, dev.slots, unit)?;
    let paged = req.io_backend == IoBackend::Direct && host.layout == Layout::PageFirstDirect && group > 1;
    if paged {
        check_whole_pages("host", &hi, group)?;
        check_whole_pages("device", &di, group)?;
    }
    let (dst_side, dst_list, dst_bound) = match direction {
        Direction::HostToDevice => ("device", &di, dev.slots),
        Direction::DeviceToHost => ("host", &hi, host.slots()),
    };
    check_unique(dst_side, dst_list, &hi, &di, dst_bound, unit)?;

    // Direct copies must satisfy the executor's alignment (wgpu: 4 bytes).
    if req.io_backend == IoBackend::Direct && caps.direct_align > 1 {
        let a = caps.direct_align;
        if host.item_bytes % a != 0 {
            return Err(TransferError::Misaligned {
                what: format!("{} direct copy item bytes", caps.name),
                value: host.item_bytes,
                required: a,
            });
        }
    }

    if req.io_backend == IoBackend::Kernel {
        let granule = caps.window_granule(host.item_bytes / host.head_num);
        if granule > caps.max_binding {
            return Err(TransferError::Misaligned {
                what: format!("{} binding window for {}-byte item chunks", caps.name, host.item_bytes / host.head_num),
                value: caps.max_binding,
                required: granule,
            });
        }
    }

    let comps = host.kind.components() as u8;
    let steps = match req.io_backend {
        IoBackend::Kernel => {
            let heads = host.head_num;
            let (si, dj): (Arc<[i64]>, Arc<[i64]>) = match direction {
                Direction::HostToDevice => (hi.into(), di.into()),
                Direction::DeviceToHost => (di.into(), hi.into()),
            };
            layer_groups
                .iter()
                .map(|layers| {
                    let mut launches = Vec::with_capacity(layers.len() * comps as usize);
                    for &(hl, ds) in layers {
                        for c in 0..comps {
                            let h = host.addr(c, hl);
                            let d = dev.addr(c, ds, heads);
                            launches.push(match direction {
                                Direction::HostToDevice => Launch { src: h, dst: d },
                                Direction::DeviceToHost => Launch { src: d, dst: h },
                            });
                        }
                    }
                    Step::Gather(GatherStep {
                        src_indices: si.clone(),
                        dst_indices: dj.clone(),
                        chunk_bytes: host.item_bytes / heads,
                        heads,
                        launches,
                    })
                })
                .collect()
        }
        IoBackend::Direct => {
            // Runs of consecutive (host, device) pairs (transfer_kv_direct), or whole pages for
            // page_first_direct (only the first index of each page is read).
            let spans = if host.layout == Layout::PageFirstDirect { page_spans(&hi, &di, group) } else { coalesce(&hi, &di) };
            layer_groups
                .iter()
                .map(|layers| {
                    let addrs: Vec<(Addr, Addr)> = (0..comps)
                        .flat_map(|c| layers.iter().map(move |&(hl, ds)| (c, hl, ds)))
                        .map(|(c, hl, ds)| (host.addr(c, hl), dev.addr(c, ds, 1)))
                        .collect();
                    let mut runs: Vec<Run> = Vec::with_capacity(spans.len() * addrs.len());
                    // Layer by layer (each pass stays in one layer's buffers; destinations
                    // are unique, so the order changes no byte).
                    for (ha, da) in &addrs {
                        for &(h0, d0, n) in &spans {
                            let len = n * host.item_bytes;
                            let (ho, doff) = (ha.offset(h0, 0), da.offset(d0, 0));
                            push_run(
                                &mut runs,
                                match direction {
                                    Direction::HostToDevice => Run { src: ha.buf, src_offset: ho, dst: da.buf, dst_offset: doff, len },
                                    Direction::DeviceToHost => Run { src: da.buf, src_offset: doff, dst: ha.buf, dst_offset: ho, len },
                                },
                            );
                        }
                    }
                    Step::Copy(CopyStep { runs })
                })
                .collect()
        }
    };
    Ok(Plan { pair: shared, profile, direction, path, steps })
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Least common multiple (`0` stays `0`).
pub fn lcm(a: u64, b: u64) -> u64 {
    if a == 0 || b == 0 {
        return 0;
    }
    a / gcd(a, b) * b
}

fn layer_error(layer_id: usize, dev: &DeviceGeometry) -> TransferError {
    TransferError::LayerOutOfRange { layer_id, target_layers: dev.layers.layer_num, draft_layers: dev.layers.drafts }
}

/// Token indices → page indices, one per group of `p` (the group must be a whole page or all
/// negative, which skips it).
fn to_pages(side: &'static str, tokens: &[i64], p: u64) -> Result<Vec<i64>> {
    check_whole_pages(side, tokens, p)?;
    Ok(tokens.chunks(p as usize).map(|g| if g[0] < 0 { -1 } else { g[0] / p as i64 }).collect())
}

/// Each group of `p` must be a whole page (`k·p .. k·p + p`) or all negative. Only the first
/// and last entries are read, like sglang reads only the first: reading every token of every
/// DSA page costs more than the planning budget (4 MiB of indices per 33 MiB moved), and the
/// interior is never used.
fn check_whole_pages(side: &'static str, idx: &[i64], p: u64) -> Result<()> {
    let pu = p as usize;
    for (g, chunk) in idx.chunks_exact(pu).enumerate() {
        let (first, last) = (chunk[0], chunk[pu - 1]);
        let ok = if first < 0 { last < 0 } else { first % p as i64 == 0 && last == first + p as i64 - 1 };
        if !ok {
            return Err(TransferError::NotWholePage { side, start: first, end: last, position: g * pu, page_size: p });
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
fn check_unique(side: &'static str, dst: &[i64], hi: &[i64], di: &[i64], bound: u64, unit: &'static str) -> Result<()> {
    let mut seen = vec![0u64; bound.div_ceil(64) as usize];
    for (i, &d) in dst.iter().enumerate() {
        if hi[i] < 0 || di[i] < 0 {
            continue;
        }
        let (w, b) = ((d as u64 / 64) as usize, d as u64 % 64);
        if seen[w] & (1 << b) != 0 {
            // Rare path: find where it was first written, for the message.
            let first = dst[..i].iter().enumerate().position(|(j, &x)| x == d && hi[j] >= 0 && di[j] >= 0).unwrap_or(0);
            return Err(TransferError::DuplicateDestination { side, unit, index: d, first, second: i });
        }
        seen[w] |= 1 << b;
    }
    Ok(())
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
fn push_run(runs: &mut Vec<Run>, r: Run) {
    if let Some(last) = runs.last_mut() {
        if last.src == r.src
            && last.dst == r.dst
            && last.src_offset + last.len == r.src_offset
            && last.dst_offset + last.len == r.dst_offset
        {
            last.len += r.len;
            return;
        }
    }
    runs.push(r);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addr_matches_geometry() {
        for layout in Layout::ALL {
            for kind in PoolKind::ALL {
                let (item, heads) = if layout == Layout::PageHead { (64, 4) } else { (48, 1) };
                let Ok(g) = HostGeometry::new(kind, layout, 4, 30, 3, item, heads) else { continue };
                for layer in 0..3 {
                    let a = g.addr(0, layer);
                    for slot in 0..g.slots() {
                        for head in 0..g.head_num {
                            assert_eq!(a.offset(slot, head), g.item_offset(layer, slot, head), "{kind} {layout}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn coalescing_like_transfer_kv_direct() {
        assert_eq!(coalesce(&[0, 1, 2, 7, 8], &[10, 11, 5, 6, 7]), vec![(0, 10, 2), (2, 5, 1), (7, 6, 2)]);
        assert_eq!(coalesce(&[0, -1, 2, 3], &[0, 1, 2, 3]), vec![(0, 0, 1), (2, 2, 2)]);
    }
}
