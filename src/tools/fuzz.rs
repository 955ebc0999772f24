//! Hostile input, through the public API only: random geometries, layer maps, index lists and
//! plans, a share of them malformed on purpose (sizes that overflow, absurd allocations, wrong
//! layers, indices at the integer limits, partial pages, duplicates, plans of other pools).
//! Every call must either match the oracle byte for byte or return a typed error that leaves
//! every byte unchanged; a panic is counted (the CLI runs this in a child process too, so an
//! abort or a signal shows). Used by `hicache-io fuzz`, its test, and `scripts/fuzz.sh`.

use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::TransferError;
use crate::exec::Device;
use crate::geometry::{DeviceGeometry, IoBackend, LayerMap, Layout, PagePadding, PoolKind, Profile};
use crate::plan::{Op, Request};
use crate::pool::{DevicePoolConfig, HostPoolConfig};
use crate::rng::Rng;
use crate::tools::check::{random_case, supported_cells, Mirrored};

/// Pools larger than this are built (to check the configuration) but not filled or moved (the
/// large-item cases, 1 MiB items, stay below it).
const FILL_LIMIT: u64 = 32 << 20;

/// Counts of one fuzz run.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct FuzzTally {
    /// Cases tried.
    pub tried: u64,
    /// Configurations refused (pool construction returned an error).
    pub rejected_config: u64,
    /// Accepted configurations too large to fill (checked, not moved).
    pub large: u64,
    /// Calls that ran and matched the oracle (no-ops included).
    pub matched: u64,
    /// Cases of pools with padded pages (DeepSeek-V4's C4 token parts), run or refused.
    pub padded: u64,
    /// Calls refused with a typed error, every byte unchanged.
    pub rejected_call: u64,
    /// Panics caught (must be 0).
    pub panics: u64,
    /// Well-formed calls (unmutated random cases of supported cells) that were refused (must
    /// be 0: a planner that refuses too much is as wrong as one that accepts too much).
    pub refused_well_formed: u64,
    /// Accepted calls whose bytes differ from the oracle, or refused calls that changed a byte
    /// (must be 0).
    pub corrupted: u64,
    /// Loads whose items were backed up with checksums and loaded back untouched (a backup,
    /// then a load of the same items).
    pub verified_loads: u64,
    /// Integrity errors in these ordinary cases, where nothing was damaged (must be 0).
    pub false_alarms: u64,
    /// The first failures, for the report.
    pub failures: Vec<String>,
}

impl FuzzTally {
    /// True when nothing panicked and nothing was corrupted.
    pub fn clean(&self) -> bool {
        self.panics == 0 && self.corrupted == 0 && self.refused_well_formed == 0 && self.false_alarms == 0
    }
    fn fail(&mut self, what: String) {
        if self.failures.len() < 10 {
            self.failures.push(what);
        }
    }
}

const HOSTILE_U64: [u64; 10] = [0, 1, 3, 7, 1 << 32, (1 << 32) - 1, 1 << 40, 1 << 62, u64::MAX, u64::MAX - 1];
const HOSTILE_I64: [i64; 8] = [-1, -2, i64::MIN, i64::MAX, i64::MAX - 1, 1 << 31, 1 << 32, -(1 << 40)];

fn maybe_u64(rng: &mut Rng, v: u64, percent: u64) -> u64 {
    if rng.chance(percent) {
        rng.pick(&HOSTILE_U64)
    } else {
        v
    }
}

/// Mutates a well-formed case into a possibly hostile one.
fn mutate(
    rng: &mut Rng,
    dc: &mut DevicePoolConfig,
    hc: &mut HostPoolConfig,
    op: &mut Op,
    io: &mut IoBackend,
    hi: &mut Vec<i64>,
    di: &mut Vec<i64>,
) {
    dc.bytes_per_token = maybe_u64(rng, dc.bytes_per_token, 4);
    dc.slots = maybe_u64(rng, dc.slots, 4);
    dc.page_size = maybe_u64(rng, dc.page_size, 3);
    if rng.chance(3) {
        dc.layers.drafts = rng.pick(&[usize::MAX, 1 << 40, 1 << 17, 70_000]);
    }
    if rng.chance(3) {
        let n = dc.layers.layer_num;
        dc.layers.layer_shard = Some(rng.pick(&[(n, n), (2, 1), (0, n + 1), (usize::MAX - 1, usize::MAX)]));
    }
    if rng.chance(2) {
        dc.layers.skipped.push(false);
    }
    if rng.chance(2) {
        dc.layers.layer_num = 0;
    }
    hc.size = maybe_u64(rng, hc.size, 4);
    if rng.chance(5) {
        hc.head_num = rng.pick(&[0u64, 3, 5, 7, 1 << 40]);
    }
    if rng.chance(5) {
        hc.layout = rng.pick(&Layout::ALL);
    }
    if rng.chance(5) {
        hc.profile = rng.pick(&[Profile::Sglang, Profile::Extended]);
    }
    if rng.chance(10) {
        *io = rng.pick(&[IoBackend::Kernel, IoBackend::Direct, IoBackend::Auto]);
    }
    if rng.chance(8) {
        let layer_id = rng.pick(&[0usize, 1, 2, 5, 9, usize::MAX]);
        *op = rng.pick(&[
            Op::Load { layer_id, is_draft: false },
            Op::Load { layer_id, is_draft: true },
            Op::Backup,
            Op::BackupLayer { layer_id, is_draft: false },
            Op::BackupLayer { layer_id, is_draft: true },
        ]);
    }
    // Index lists.
    for list in [&mut *hi, &mut *di] {
        if list.is_empty() {
            continue;
        }
        if rng.chance(6) {
            let at = rng.below(list.len() as u64) as usize;
            list[at] = rng.pick(&HOSTILE_I64);
        }
        if rng.chance(5) {
            let (a, b) = (rng.below(list.len() as u64) as usize, rng.below(list.len() as u64) as usize);
            list[a] = list[b];
        }
        if rng.chance(4) {
            list.pop();
        }
        if list.is_empty() {
            continue;
        }
        if rng.chance(3) {
            let at = rng.below(list.len() as u64) as usize;
            list[at] = list[at].wrapping_add(1);
        }
    }
    if rng.chance(2) {
        std::mem::swap(hi, di);
    }
}

/// Runs `cases` random (partly hostile) cases on `device`; `progress` after each.
pub fn fuzz_device(device: &Device, seed: u64, cases: u64, mut progress: impl FnMut(&FuzzTally)) -> FuzzTally {
    let mut t = FuzzTally::default();
    let mut rng = Rng::new(seed);
    // A second instance of the same executor, for plans that must not run across instances.
    let other = Device::open(device.kind()).ok();
    for _ in 0..cases {
        let case_seed = rng.next_u64();
        t.tried += 1;
        match catch_unwind(AssertUnwindSafe(|| one_case(device, other.as_ref(), case_seed, &mut t))) {
            Ok(()) => {}
            Err(p) => {
                t.panics += 1;
                let msg =
                    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                t.fail(format!("seed {case_seed}: panic: {msg}"));
            }
        }
        progress(&t);
    }
    t
}

/// One case: build (maybe refuse) the pools, run one call, check bytes; sometimes a storage
/// helper round trip and a plan of other pools.
fn one_case(device: &Device, other_device: Option<&Device>, seed: u64, t: &mut FuzzTally) {
    // One case in eight moves padded pages (DeepSeek-V4's C4 token parts), drawn from its own
    // stream so that every other seed draws the case it always did.
    if Rng::new(seed ^ PADDED_SALT).chance(12) {
        return padded_case(device, seed, t);
    }
    let mut rng = Rng::new(seed);
    let c = draw_case(&mut rng);
    let Some(mut m) = build(device, &c.dc, &c.hc, seed, t) else { return };
    let (op, io) = (c.op, c.io);
    let tag = |what: &str| format!("seed {seed}: {what} ({op:?} {io} {} {:?})", c.hc.layout, c.dc.kind);
    // A fifth of the calls go through the asynchronous API (enqueued, then waited on).
    let result = if rng.chance(20) { m.call_async(op, io, &c.hi, &c.di) } else { m.call(op, io, &c.hi, &c.di) };
    let result_ok = result.is_ok();
    match result {
        Ok(()) => {
            m.apply_oracle(op, &c.hi, &c.di);
            t.matched += 1;
        }
        Err(e) => count_refusal(&e, c.mutated, t, &tag),
    }
    check_mirror(&m, t, &tag("call"));
    // A successful backup, loaded back: with checksums, the load verifies what it recorded.
    if result_ok && op.direction() == crate::plan::Direction::DeviceToHost && rng.chance(50) {
        load_after_backup(&mut m, &c, t, &tag);
    }
    // Storage helpers: a page read and written back changes nothing.
    if rng.chance(30) {
        storage_round_trip(&mut m, &c, &mut rng, t, &tag);
    }
    // A plan made for these pools, run on other pools of the same geometry: refused, nothing moves.
    if let Some(other_device) = other_device.filter(|_| rng.chance(10)) {
        foreign_plan(&m, other_device, &c, seed, t, &tag);
    }
}

/// A drawn case: the pool configurations, the call, its index lists, and whether it was mutated.
struct FuzzCase {
    dc: DevicePoolConfig,
    hc: HostPoolConfig,
    op: Op,
    io: IoBackend,
    hi: Vec<i64>,
    di: Vec<i64>,
    mutated: bool,
}

/// Draws a random case of a supported cell, mutated into a possibly hostile one 70% of the time.
fn draw_case(rng: &mut Rng) -> FuzzCase {
    let profile = rng.pick(&[Profile::Sglang, Profile::Extended]);
    let cells = supported_cells(profile);
    let base = random_case(rng.pick(&cells), profile, rng);
    let (mut dc, mut hc, mut op, mut io) = (base.device, base.host, base.op, base.cell.io);
    let (mut hi, mut di) = (base.host_indices, base.device_indices);
    let mutated = rng.chance(70);
    if mutated {
        mutate(rng, &mut dc, &mut hc, &mut op, &mut io, &mut hi, &mut di);
    }
    FuzzCase { dc, hc, op, io, hi, di, mutated }
}

/// Counts a refused call, and the failures among refusals: an integrity error where nothing was
/// damaged, a well-formed call refused, an executor failing after validation.
fn count_refusal(e: &TransferError, mutated: bool, t: &mut FuzzTally, tag: &dyn Fn(&str) -> String) {
    t.rejected_call += 1;
    if matches!(e, TransferError::Integrity { .. }) {
        t.false_alarms += 1;
        t.fail(tag(&format!("an integrity error where nothing was damaged: {e}")));
    }
    if !mutated {
        t.refused_well_formed += 1;
        t.fail(tag(&format!("a well-formed call was refused: {e}")));
    }
    if matches!(e, TransferError::Executor { .. } | TransferError::Partial { .. }) {
        t.corrupted += 1;
        t.fail(tag(&format!("an executor failed after validation: {e}")));
    }
}

/// Loads back the items a successful backup wrote (the first live layer, else the first draft):
/// with checksums, the load verifies what the backup recorded and raises nothing.
fn load_after_backup(m: &mut Mirrored, c: &FuzzCase, t: &mut FuzzTally, tag: &dyn Fn(&str) -> String) {
    let map = m.dev.geometry().layers().clone();
    let load = match map.live_layers().first() {
        Some(&l) => Some(Op::Load { layer_id: l, is_draft: false }),
        None if map.drafts > 0 => Some(Op::Load { layer_id: map.layer_num, is_draft: true }),
        None => None,
    };
    let before = m.host.integrity_stats().map_or(0, |s| s.verified);
    if let Some(load) = load {
        match m.call(load, c.io, &c.hi, &c.di) {
            Ok(()) => {
                m.apply_oracle(load, &c.hi, &c.di);
                if m.host.integrity_stats().is_some_and(|s| s.verified > before) {
                    t.verified_loads += 1;
                }
            }
            Err(e @ TransferError::Integrity { .. }) => {
                t.false_alarms += 1;
                t.fail(tag(&format!("loading back a backup raised an integrity error: {e}")));
            }
            // A mutated call's indices may be fine for the backup and not for the load
            // (duplicate device slots): a refusal moves nothing.
            Err(_) => {}
        }
        check_mirror(m, t, &tag("load after backup"));
    }
}

/// Storage helpers: a page (at a drawn index, maybe hostile) read and written back changes nothing.
fn storage_round_trip(m: &mut Mirrored, c: &FuzzCase, rng: &mut Rng, t: &mut FuzzTally, tag: &dyn Fn(&str) -> String) {
    let some = rng.below(64) as i64;
    let index = rng.pick(&[0i64, c.dc.page_size as i64, some, -1, i64::MAX]);
    if let Ok(page) = m.host.get_data_page(index) {
        if let Err(e) = m.host.set_from_flat_data_page(index, &page) {
            t.corrupted += 1;
            t.fail(tag(&format!("set_from_flat_data_page refused the page get_data_page returned: {e}")));
        }
        check_mirror(m, t, &tag("storage round trip"));
    }
    let _ = m.host.get_page_buffer_meta(&c.hi);
}

/// A plan made for `m`'s pools, run on pools of the same geometry on `other_device`: it must be
/// refused, moving nothing.
fn foreign_plan(m: &Mirrored, other_device: &Device, c: &FuzzCase, seed: u64, t: &mut FuzzTally, tag: &dyn Fn(&str) -> String) {
    let req = Request { op: c.op, io_backend: c.io, host_indices: &c.hi, device_indices: &c.di };
    if let Ok(plan) = m.host.plan(&m.dev, &req) {
        if let Ok(mut other) = Mirrored::new(other_device, &c.dc, &c.hc, seed ^ 1) {
            let r = match c.op {
                Op::Load { .. } => other.host.execute_load(&mut other.dev, &plan),
                Op::Backup | Op::BackupLayer { .. } => other.host.execute_backup(&other.dev, &plan),
            };
            if r.is_ok() {
                t.corrupted += 1;
                t.fail(tag("a plan ran on pools of another executor instance"));
            }
            check_mirror(&other, t, &tag("foreign plan"));
        }
    }
}

const PADDED_SALT: u64 = 0x7061_6464_6564;

/// A padded-page case: a layer_first MLA pool pair whose pages hold `P` items `offset` bytes
/// into `page_bytes`, one call of the `kernel` backend with distinct random tokens (partly
/// hostile), against the oracle; `direct` must be refused.
fn padded_case(device: &Device, seed: u64, t: &mut FuzzTally) {
    t.padded += 1;
    let mut rng = Rng::new(seed);
    let (s, geometry) = match padded_shape(&mut rng) {
        Ok(drawn) => drawn,
        Err(e) => {
            t.corrupted += 1;
            return t.fail(format!("seed {seed}: a padded geometry was refused: {e}"));
        }
    };
    let profile = rng.pick(&[Profile::Sglang, Profile::Extended]);
    let hc = HostPoolConfig { layout: Layout::LayerFirst, size: (s.host_pages - 1) * s.p, head_num: 1, profile, integrity: None };
    let mut m = match Mirrored::with_geometry(device, geometry, &hc, seed) {
        Ok(m) => m,
        Err(e) => {
            t.corrupted += 1;
            return t.fail(format!("seed {seed}: padded pools could not be built: {e}"));
        }
    };
    let PaddedCall { hi, di, layer_id, op, mutated, io } = padded_call(&mut rng, &s);
    let Padded { item, p, padding, layer_num, .. } = s;
    let tag = |what: &str| format!("seed {seed}: padded pages {what} ({op:?} {io}, item {item}, P {p}, {padding:?})");
    let well_formed = !mutated
        && io == IoBackend::Kernel
        && !(op == (Op::Load { layer_id: layer_num, is_draft: true }) && m.dev.geometry().layers().drafts == 0);
    match m.call(op, io, &hi, &di) {
        Ok(()) => {
            if io != IoBackend::Kernel {
                t.corrupted += 1;
                t.fail(tag("accepted by the direct backend"));
            }
            m.apply_oracle(op, &hi, &di);
            t.matched += 1;
        }
        Err(e) => {
            t.rejected_call += 1;
            let owned = matches!(op, Op::Backup) || layer_id < layer_num;
            if well_formed && owned {
                t.refused_well_formed += 1;
                t.fail(tag(&format!("a well-formed call was refused: {e}")));
            }
            if matches!(e, TransferError::Executor { .. } | TransferError::Partial { .. } | TransferError::Integrity { .. }) {
                t.corrupted += 1;
                t.fail(tag(&format!("failed after validation: {e}")));
            }
        }
    }
    check_mirror(&m, t, &tag("call"));
}

/// The shape of a padded-page case: item bytes, `P` items per page, the page padding, and the
/// device and host page and layer counts.
struct Padded {
    item: u64,
    p: u64,
    padding: PagePadding,
    dev_pages: u64,
    host_pages: u64,
    layer_num: usize,
}

/// Draws a padded-page shape and builds its MLA device geometry (an error if refused).
fn padded_shape(rng: &mut Rng) -> crate::error::Result<(Padded, DeviceGeometry)> {
    let item = rng.pick(&[8u64, 16, 24, 576]);
    let p = rng.pick(&[1u64, 2, 4, 64]);
    let spare = 8 * rng.below(4);
    let offset = rng.below(spare / 8 + 1) * 8;
    let padding = PagePadding { page_bytes: p * item + spare, offset };
    let (dev_pages, host_pages) = (1 + rng.below(3), 1 + rng.below(3));
    let layer_num = 1 + rng.below(3) as usize;
    let mut layers = LayerMap::new(layer_num);
    layers.drafts = rng.below(2) as usize;
    let geometry = DeviceGeometry::new(PoolKind::Mla, item, dev_pages * p, p, layers).and_then(|g| g.with_padding(padding))?;
    Ok((Padded { item, p, padding, dev_pages, host_pages, layer_num }, geometry))
}

/// A padded case's call: token lists, the layer and op, whether an index was made hostile, and
/// the backend.
struct PaddedCall {
    hi: Vec<i64>,
    di: Vec<i64>,
    layer_id: usize,
    op: Op,
    mutated: bool,
    io: IoBackend,
}

/// Draws a padded case's call: distinct random tokens on both sides, an op, 40% of the time one
/// hostile index, and `direct` 10% of the time.
fn padded_call(rng: &mut Rng, s: &Padded) -> PaddedCall {
    let (p, layer_num) = (s.p, s.layer_num);
    let n = 1 + rng.below(s.dev_pages.min(s.host_pages) * p) as usize;
    let (mut hi, mut di) = (distinct_tokens(rng, n, s.host_pages * p), distinct_tokens(rng, n, s.dev_pages * p));
    let layer_id = rng.below(layer_num as u64 + 1) as usize;
    let op = rng.pick(&[
        Op::Load { layer_id, is_draft: false },
        Op::Backup,
        Op::BackupLayer { layer_id, is_draft: false },
        Op::Load { layer_id: layer_num, is_draft: true },
    ]);
    let mutated = rng.chance(40);
    if mutated {
        let list = if rng.chance(50) { &mut hi } else { &mut di };
        let at = rng.below(list.len() as u64) as usize;
        list[at] = rng.pick(&[-2, (s.host_pages.max(s.dev_pages) * p) as i64, list[0], i64::MAX, 1 << 32]);
    }
    let io = if rng.chance(10) { IoBackend::Direct } else { IoBackend::Kernel };
    PaddedCall { hi, di, layer_id, op, mutated, io }
}

/// `n` distinct tokens below `bound`, in random order (the first `n` of a partial shuffle).
fn distinct_tokens(rng: &mut Rng, n: usize, bound: u64) -> Vec<i64> {
    let mut all: Vec<i64> = (0..bound as i64).collect();
    for i in 0..n {
        let j = i + rng.below(bound - i as u64) as usize;
        all.swap(i, j);
    }
    all.truncate(n);
    all
}

/// Builds the pools of a case: `None` (counted) when the configuration is refused or too large
/// to fill; a refusal by the pools that the geometry accepted, or the reverse, is a corruption.
fn build(device: &Device, dc: &DevicePoolConfig, hc: &HostPoolConfig, seed: u64, t: &mut FuzzTally) -> Option<Mirrored> {
    let pools =
        || crate::pool::DevicePool::new(device, dc).and_then(|d| crate::pool::HostPool::new(&d, hc).map(|h| h.geometry().buffer_bytes()));
    match dc.geometry().map(|g| g.total_bytes()) {
        Err(_) => {
            if crate::pool::DevicePool::new(device, dc).is_ok() {
                t.corrupted += 1;
                t.fail(format!("seed {seed}: device pool accepted a configuration its geometry refuses"));
            } else {
                t.rejected_config += 1;
            }
            return None;
        }
        // Accepted huge pools are built (to check the configuration), not filled.
        Ok(bytes) if bytes > FILL_LIMIT => {
            match pools() {
                Ok(_) => t.large += 1,
                Err(_) => t.rejected_config += 1,
            }
            return None;
        }
        Ok(_) => {}
    }
    match pools() {
        Err(_) => {
            t.rejected_config += 1;
            return None;
        }
        Ok(b) if b > FILL_LIMIT => {
            t.large += 1;
            return None;
        }
        Ok(_) => {}
    }
    match Mirrored::new(device, dc, hc, seed) {
        Ok(m) => Some(m),
        Err(e) => {
            t.corrupted += 1;
            t.fail(format!("seed {seed}: pools that were just built could not be filled: {e}"));
            None
        }
    }
}

fn check_mirror(m: &Mirrored, t: &mut FuzzTally, tag: &str) {
    match m.first_mismatch() {
        Ok(None) => {}
        Ok(Some((buffer, offset))) => {
            t.corrupted += 1;
            t.fail(format!("{tag}: {buffer} differs from the oracle at byte {offset}"));
        }
        Err(e) => {
            t.corrupted += 1;
            t.fail(format!("{tag}: reading back failed: {e}"));
        }
    }
}
