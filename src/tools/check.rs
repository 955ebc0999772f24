//! Cross-executor equivalence: randomized transfers over every supported cell, run on an
//! executor through the pools API and compared byte for byte with the [`crate::tools::oracle`] module.
//! Used by `hicache-io check`, the property tests and the GPU check script.

use crate::error::{Result, TransferError};
use crate::exec::Device;
use crate::geometry::{dsa_bytes_per_token, IoBackend, LayerMap, Layout, PoolKind, Profile};
use crate::plan::{decide, kernel_word, Capabilities, Op, Request, TableOp};
use crate::pool::{DevicePool, DevicePoolConfig, HostPool, HostPoolConfig};
use crate::tools::oracle::{self, OracleBuffers};

pub use crate::plan::{all_cells, Cell};
pub use crate::rng::Rng;

/// A random call in one cell: geometry, operation and indices.
#[derive(Debug, Clone)]
pub struct Case {
    /// The table cell.
    pub cell: Cell,
    /// Device pool configuration.
    pub device: DevicePoolConfig,
    /// Host pool configuration.
    pub host: HostPoolConfig,
    /// The call.
    pub op: Op,
    /// Host token indices.
    pub host_indices: Vec<i64>,
    /// Device token indices.
    pub device_indices: Vec<i64>,
    /// Seed of the pools' initial contents.
    pub seed: u64,
}

/// Draws a random case for `cell` (small pools; every layout feature exercised: drafts,
/// sharding, skip-topk layers, negative entries, runs and scattered pages).
pub fn random_case(cell: Cell, profile: Profile, rng: &mut Rng) -> Case {
    let seed = rng.next_u64();
    let kind = cell.kind;
    // One case in eight (MHA, MLA): an item around a power-of-two word count, 2^14..2^18 words
    // of 4 or 16 bytes, in a small pool: executor limits on long items (a loop, a dispatch
    // dimension, a 16-bit count) show up as wrong bytes here rather than in a user's pool.
    let large = kind != PoolKind::DsaIndexer && rng.chance(12);
    let page_size = random_page_size(cell, profile, large, rng);
    let head_num = random_head_num(cell, large, rng);
    let bytes_per_token = random_bytes_per_token(kind, profile, head_num, large, rng);
    let layers = random_layers(cell, large, rng);
    let (host_pages, device_pages) = if large { (2 + rng.below(2), 2 + rng.below(2)) } else { (2 + rng.below(10), 2 + rng.below(10)) };
    let device = DevicePoolConfig {
        kind,
        bytes_per_token,
        slots: if kind == PoolKind::DsaIndexer { device_pages } else { device_pages * page_size + rng.below(page_size) },
        page_size,
        layers: layers.clone(),
    };
    let host =
        HostPoolConfig { layout: cell.layout, size: host_pages * page_size - 1 - rng.below(page_size), head_num, profile, integrity: None };
    let op = random_op(cell, &layers, rng);
    let (host_indices, device_indices) = random_indices(kind, cell, page_size, &host, &device, rng);
    Case { cell, device, host, op, host_indices, device_indices, seed }
}

/// Tokens per page: 1 or 2 for a large item, else up to 16 (DSA: up to 8, and even where
/// sglang's kernel gate needs it).
fn random_page_size(cell: Cell, profile: Profile, large: bool, rng: &mut Rng) -> u64 {
    match cell.kind {
        _ if large => rng.pick(&[1u64, 2]),
        // sglang's kernel gate needs an even page for 132 B tokens; extended lifts it.
        PoolKind::DsaIndexer if profile == Profile::Sglang && cell.io == IoBackend::Kernel => rng.pick(&[2u64, 4, 8]),
        PoolKind::DsaIndexer => rng.pick(&[1u64, 2, 4, 8]),
        _ => rng.pick(&[1u64, 2, 4, 8, 16]),
    }
}

/// Heads of the host layout: more than one only where the layout splits items by head.
fn random_head_num(cell: Cell, large: bool, rng: &mut Rng) -> u64 {
    match cell.layout {
        l if l.head_chunks(cell.kind) && large => rng.pick(&[1u64, 2]),
        Layout::PageHead => rng.pick(&[1u64, 2, 4]),
        // Head groups: one (plain page_first_direct bytes) up to one per head of 8.
        Layout::PageFirstDirectHeadGroups => rng.pick(&[1u64, 2, 4, 8]),
        Layout::PageUnified if cell.kind == PoolKind::Mha => rng.pick(&[1u64, 2, 4, 8]),
        _ => 1,
    }
}

/// Bytes per token: a DSA indexer item, a large item (see [`random_case`]), or a few kernel
/// words per head.
fn random_bytes_per_token(kind: PoolKind, profile: Profile, head_num: u64, large: bool, rng: &mut Rng) -> u64 {
    let word = kernel_word(profile, &Capabilities::PORTABLE);
    match kind {
        PoolKind::DsaIndexer => {
            // index_head_dim / quant_block_size pairs; 132 B is DeepSeek V3.2.
            let (d, q) = rng.pick(&[(128u64, 128u64), (16, 8), (8, 4), (32, 16)]);
            dsa_bytes_per_token(d, q)
        }
        _ if large => {
            // Chunks of at most about 1 MiB, items of at most two of them.
            let w = rng.pick(&[word, 16]);
            let top = if w == 16 { 16 } else { 18 };
            let words = (1u64 << (14 + rng.below(top - 13))).wrapping_add_signed(rng.below(3) as i64 - 1);
            head_num * words * w
        }
        _ => head_num * word * rng.pick(&[1u64, 2, 3, 4, 6, 8, 16]),
    }
}

/// The layer map: 1 to 5 layers (1 or 2 when large), a shard for sharded backups, DSA
/// skip-topk layers, and drafts (at least one where no target layer has a host layer).
fn random_layers(cell: Cell, large: bool, rng: &mut Rng) -> LayerMap {
    let layer_num = if large { 1 + rng.below(2) as usize } else { 1 + rng.below(5) as usize };
    let mut layers = LayerMap::new(layer_num);
    if cell.op == TableOp::ShardedBackup {
        let start = rng.below(layer_num as u64) as usize;
        let end = start + 1 + rng.below((layer_num - start) as u64) as usize;
        layers.layer_shard = Some((start, end));
    }
    if cell.kind == PoolKind::DsaIndexer {
        for l in 0..layer_num {
            layers.skipped[l] = rng.chance(25);
        }
    }
    layers.drafts = rng.below(if large { 2 } else { 3 }) as usize;
    if layers.host_layers() == 0 {
        layers.drafts = 1;
    }
    layers
}

/// The call of the cell's row: a load (sometimes of a draft), a backup, or (in the sharded
/// backup's row) sometimes a per-layer backup.
fn random_op(cell: Cell, layers: &LayerMap, rng: &mut Rng) -> Op {
    let layer_num = layers.layer_num;
    match cell.op {
        TableOp::Load => {
            if layers.drafts > 0 && rng.chance(30) {
                Op::Load { layer_id: layer_num + rng.below(layers.drafts as u64) as usize, is_draft: true }
            } else {
                // Sometimes a layer this pool does not own (a defined no-op).
                Op::Load { layer_id: rng.below(layer_num as u64) as usize, is_draft: false }
            }
        }
        // A per-layer backup takes the sharded backup's row: one case in three, sometimes of a
        // layer the pool does not own, sometimes of a draft.
        TableOp::ShardedBackup if rng.chance(33) => {
            if layers.drafts > 0 && rng.chance(30) {
                Op::BackupLayer { layer_id: layer_num + rng.below(layers.drafts as u64) as usize, is_draft: true }
            } else {
                Op::BackupLayer { layer_id: rng.below(layer_num as u64) as usize, is_draft: false }
            }
        }
        _ => Op::Backup,
    }
}

fn random_indices(
    kind: PoolKind,
    cell: Cell,
    p: u64,
    host: &HostPoolConfig,
    device: &DevicePoolConfig,
    rng: &mut Rng,
) -> (Vec<i64>, Vec<i64>) {
    // Index-space pages: host page_num (MHA/MLA) or indexer pages (DSA).
    let rounded = (host.size / p + 1) * p;
    let host_pages = match kind {
        PoolKind::DsaIndexer => (rounded + p + 1) / p,
        _ => rounded / p,
    };
    let dev_pages = match kind {
        PoolKind::DsaIndexer => device.slots,
        _ => device.slots / p,
    };
    let token_level = kind != PoolKind::DsaIndexer && cell.layout != Layout::PageFirstDirect && rng.chance(40);
    let (mut hi, mut di) = (Vec::new(), Vec::new());
    if token_level {
        // Scattered token slots (count a multiple of P so that direct accepts it).
        let n = p * (1 + rng.below(host_pages.min(dev_pages)));
        let hs = rng.distinct(rounded, n);
        let contiguous = rng.chance(50);
        let ds: Vec<u64> = if contiguous {
            let start = rng.below(device.slots - n + 1);
            (start..start + n).collect()
        } else {
            rng.distinct(device.slots, n)
        };
        for k in 0..n as usize {
            let neg = rng.chance(5);
            hi.push(if neg { -1 } else { hs[k] as i64 });
            di.push(ds[k] as i64);
        }
    } else {
        // sglang's test pattern: whole pages in random order, sometimes runs of pages.
        let n = 1 + rng.below(host_pages.min(dev_pages));
        let hps = if rng.chance(30) {
            let start = rng.below(host_pages - n + 1);
            (start..start + n).collect()
        } else {
            rng.distinct(host_pages, n)
        };
        let dps = if rng.chance(30) {
            let start = rng.below(dev_pages - n + 1);
            (start..start + n).collect()
        } else {
            rng.distinct(dev_pages, n)
        };
        for k in 0..n as usize {
            let neg = rng.chance(8);
            for t in 0..p {
                hi.push(if neg { -1 } else { (hps[k] * p + t) as i64 });
                di.push((dps[k] * p + t) as i64);
            }
        }
    }
    (hi, di)
}

/// The result of one case.
#[derive(Debug)]
pub enum Outcome {
    /// Ran and matched the oracle byte for byte.
    Match {
        /// Bytes moved.
        bytes: u64,
        /// Host items whose recorded checksum was compared with the oracle's (backups on an
        /// executor that keeps checksums).
        checksums: u64,
    },
    /// Ran and differed: where the first differing byte is.
    Mismatch {
        /// Which buffer.
        buffer: String,
        /// First differing byte.
        offset: usize,
    },
    /// The planner rejected it (the table said yes for the cell, the call said no).
    Rejected(TransferError),
}

/// A pool pair filled with random bytes, and a mirror of its contents for the oracle.
pub(crate) struct Mirrored {
    pub(crate) dev: DevicePool<'static>,
    pub(crate) host: HostPool<'static>,
    dev_bytes: Vec<Vec<Vec<u8>>>,
    host_bytes: Vec<Vec<u8>>,
}

impl Mirrored {
    /// Allocates the pools and fills every buffer with random bytes from `seed`.
    pub(crate) fn new(device: &Device, dc: &DevicePoolConfig, hc: &HostPoolConfig, seed: u64) -> Result<Mirrored> {
        Mirrored::with_geometry(device, dc.geometry()?, hc, seed)
    }

    /// [`Mirrored::new`] for pools of `geometry` (e.g. padded pages).
    pub(crate) fn with_geometry(
        device: &Device,
        geometry: crate::geometry::DeviceGeometry,
        hc: &HostPoolConfig,
        seed: u64,
    ) -> Result<Mirrored> {
        let mut rng = Rng::new(seed);
        let mut dev = DevicePool::with_geometry(device, geometry)?;
        let mut host = HostPool::new(&dev, hc)?;
        let g = dev.geometry().clone();
        let comps = g.kind().components();
        let mut dev_bytes: Vec<Vec<Vec<u8>>> =
            (0..comps).map(|_| (0..g.buffer_count()).map(|_| vec![0u8; g.layer_bytes() as usize]).collect()).collect();
        let mut host_bytes: Vec<Vec<u8>> =
            (0..host.geometry().buffers()).map(|_| vec![0u8; host.geometry().buffer_bytes() as usize]).collect();
        for (c, bufs) in dev_bytes.iter_mut().enumerate() {
            for (s, b) in bufs.iter_mut().enumerate() {
                rng.fill(b);
                dev.write_buffer(c, s, b)?;
            }
        }
        for (c, b) in host_bytes.iter_mut().enumerate() {
            rng.fill(b);
            host.write_buffer(c, b)?;
        }
        Ok(Mirrored { dev, host, dev_bytes, host_bytes })
    }

    /// The pools API call for `op`.
    pub(crate) fn call(&mut self, op: Op, io: IoBackend, hi: &[i64], di: &[i64]) -> Result<()> {
        match op {
            Op::Load { layer_id, is_draft: false } => self.host.load_to_device_per_layer(&mut self.dev, hi, di, layer_id, io),
            Op::Load { layer_id, is_draft: true } => self.host.load_draft_to_device(&mut self.dev, hi, di, layer_id, io),
            Op::Backup => self.host.backup_from_device_all_layer(&self.dev, hi, di, io),
            Op::BackupLayer { layer_id, is_draft } => self.host.backup_from_device_per_layer(&self.dev, hi, di, layer_id, is_draft, io),
        }
    }

    /// The asynchronous form of the call (waited on before returning); draft loads have none
    /// and run synchronously.
    pub(crate) fn call_async(&mut self, op: Op, io: IoBackend, hi: &[i64], di: &[i64]) -> Result<()> {
        match op {
            Op::Load { layer_id, is_draft: false } => self.host.load_to_device_per_layer_async(&mut self.dev, hi, di, layer_id, io)?.wait(),
            Op::Backup => self.host.backup_from_device_all_layer_async(&self.dev, hi, di, io)?.wait(),
            Op::Load { is_draft: true, .. } | Op::BackupLayer { .. } => self.call(op, io, hi, di),
        }
    }

    /// Applies an accepted call to the mirror.
    pub(crate) fn apply_oracle(&mut self, op: Op, hi: &[i64], di: &[i64]) {
        oracle::apply(self.host.pair(), op, hi, di, OracleBuffers { host: &mut self.host_bytes, device: &mut self.dev_bytes });
    }

    /// Where the pools first differ from the mirror, if anywhere.
    pub(crate) fn first_mismatch(&self) -> Result<Option<(String, usize)>> {
        self.dev.device().synchronize()?;
        for (c, want) in self.host_bytes.iter().enumerate() {
            if let Some(offset) = first_diff(&self.host.read_buffer(c)?, want) {
                return Ok(Some((format!("host buffer {c}"), offset)));
            }
        }
        for (c, bufs) in self.dev_bytes.iter().enumerate() {
            for (s, want) in bufs.iter().enumerate() {
                if let Some(offset) = first_diff(&self.dev.read_buffer(c, s)?, want) {
                    return Ok(Some((format!("device component {c} buffer {s}"), offset)));
                }
            }
        }
        Ok(None)
    }
}

/// Runs one case on `device` and compares with the oracle. One case in four (by seed) goes
/// through the asynchronous API (enqueued, then waited on), so both paths are checked.
pub fn run_case(device: &Device, case: &Case) -> Result<Outcome> {
    let mut m = Mirrored::new(device, &case.device, &case.host, case.seed)?;
    let req = Request { op: case.op, io_backend: case.cell.io, host_indices: &case.host_indices, device_indices: &case.device_indices };
    let plan = match m.host.plan(&m.dev, &req) {
        Ok(p) => p,
        Err(e) => return Ok(Outcome::Rejected(e)),
    };
    let bytes = plan.bytes();
    if case.seed.is_multiple_of(4) {
        m.call_async(case.op, case.cell.io, &case.host_indices, &case.device_indices)?;
    } else {
        m.call(case.op, case.cell.io, &case.host_indices, &case.device_indices)?;
    }
    m.apply_oracle(case.op, &case.host_indices, &case.device_indices);
    if let Some((buffer, offset)) = m.first_mismatch()? {
        return Ok(Outcome::Mismatch { buffer, offset });
    }
    match m.checksum_mismatch(&plan)? {
        Ok(checksums) => Ok(Outcome::Match { bytes, checksums }),
        Err(buffer) => Ok(Outcome::Mismatch { buffer, offset: 0 }),
    }
}

impl Mirrored {
    /// After a backup: every item it wrote has, in the host pool's table, the checksum of the
    /// oracle's bytes for it (computed here from the mirror, item by item), or none where the
    /// backup's copies do not checksum. `Ok(items compared)`, or `Err(which item differs)`.
    pub(crate) fn checksum_mismatch(&self, plan: &crate::plan::Plan) -> Result<std::result::Result<u64, String>> {
        if plan.direction() != crate::plan::Direction::DeviceToHost || !self.host.integrity_enabled() {
            return Ok(Ok(0));
        }
        let Some(units) = plan.host_units() else { return Ok(Ok(0)) };
        let g = self.host.geometry();
        let (chunk, heads) = (g.chunk_bytes() as usize, g.head_num());
        let keys = crate::integrity::Keys::new(crate::integrity::STORAGE_SEED, crate::integrity::words(chunk) * heads as usize)?;
        let layers = plan.layers();
        let summed = plan.is_checksummed();
        let mut compared = 0;
        for &l in &layers {
            for c in 0..g.kind().components() as u8 {
                let a = g.addr(c, l);
                for &u in units.iter().filter(|u| **u >= 0) {
                    let u = u as u64;
                    let want = summed.then(|| {
                        (0..heads).fold(0u64, |sum, h| {
                            let at = a.offset(u, h) as usize;
                            let buffer = &self.host_bytes[g.buffer_of(c) as usize];
                            sum.wrapping_add(crate::integrity::item_part(&buffer[at..at + chunk], h, &keys))
                        })
                    });
                    let got = self.host.item_checksum(u, l, c)?;
                    if got != want {
                        return Ok(Err(format!(
                            "checksum of host item {u} (layer {l}, component {c}): {got:x?}, the oracle's bytes give {want:x?}"
                        )));
                    }
                    compared += want.is_some() as u64;
                }
            }
        }
        Ok(Ok(compared))
    }
}

fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// Per-cell tally of a check run.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Tally {
    /// Cases run.
    pub cases: u64,
    /// Cases that matched the oracle.
    pub matched: u64,
    /// Cases that differed.
    pub mismatched: u64,
    /// Cases the planner refused (a failure: the cells are supported ones).
    pub rejected: u64,
    /// Bytes moved by matching cases.
    pub bytes: u64,
    /// Host items whose recorded checksum matched the oracle's, in matching cases.
    pub checksums: u64,
    /// The first failure, for the report.
    pub first_failure: Option<String>,
}

/// The cells `profile` accepts for a typical geometry of each pool kind (the cell's decision
/// depends on the item only for the DSA `kernel` gate, which random cases re-check).
pub fn supported_cells(profile: Profile) -> Vec<Cell> {
    let word = kernel_word(profile, &Capabilities::PORTABLE);
    all_cells().into_iter().filter(|c| decide(profile, *c, crate::tools::matrix::dsa_item(64), word).is_ok()).collect()
}

/// Runs `rounds` random cases per supported cell on `device`; `progress` is called after each.
pub fn check_device(
    device: &Device,
    profile: Profile,
    seed: u64,
    rounds: u64,
    progress: impl FnMut(Cell, &Tally),
) -> Result<Vec<(Cell, Tally)>> {
    check_device_io(device, profile, seed, rounds, None, progress)
}

/// [`check_device`], every call made with io backend `io` when given (`auto`: the cell's table
/// row decides, and the calibration where both paths are allowed).
pub fn check_device_io(
    device: &Device,
    profile: Profile,
    seed: u64,
    rounds: u64,
    io: Option<IoBackend>,
    mut progress: impl FnMut(Cell, &Tally),
) -> Result<Vec<(Cell, Tally)>> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::new();
    for cell in supported_cells(profile) {
        let mut t = Tally::default();
        for _ in 0..rounds {
            let mut case = random_case(cell, profile, &mut rng);
            if let Some(io) = io {
                case.cell.io = io;
            }
            t.cases += 1;
            match run_case(device, &case)? {
                Outcome::Match { bytes, checksums } => {
                    t.matched += 1;
                    t.bytes += bytes;
                    t.checksums += checksums;
                }
                Outcome::Mismatch { buffer, offset } => {
                    t.mismatched += 1;
                    t.first_failure.get_or_insert_with(|| format!("seed {}: {buffer} differs at byte {offset}", case.seed));
                }
                Outcome::Rejected(e) => {
                    t.rejected += 1;
                    t.first_failure.get_or_insert_with(|| format!("seed {}: rejected: {e}", case.seed));
                }
            }
            progress(cell, &t);
        }
        out.push((cell, t));
    }
    Ok(out)
}
