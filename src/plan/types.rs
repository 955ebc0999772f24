//! What the planner builds: [`Plan`]s of [`Step`]s (gathers and coalesced runs), and what a
//! caller asks for ([`Request`], [`Op`]).

use std::sync::Arc;

use super::*;
use crate::error::{Result, TransferError};
use crate::geometry::{Addr, BufRef, IoBackend, PoolPair, Profile};

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
    pub(super) fn new(
        (src, src_offset): (BufRef, u64),
        (dst, dst_offset): (BufRef, u64),
        len: u64,
        items: (u64, u64, u64, u64, u8),
    ) -> Run {
        let (items, host_unit, device_unit, host_layer, comp) = items;
        Run { src, src_offset, dst, dst_offset, len, items, host_unit, device_unit, host_layer, comp }
    }
    /// `(src buffer, src offset, dst buffer, dst offset, bytes)`.
    pub fn parts(&self) -> (BufRef, u64, BufRef, u64, u64) {
        (self.src, self.src_offset, self.dst, self.dst_offset, self.len)
    }
}

/// `items` consecutive items of a `direct` step: host units `host_unit ..` into device units
/// `device_unit ..` (or back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub(crate) host_unit: u64,
    pub(crate) device_unit: u64,
    pub(crate) items: u64,
}

/// `direct` io backend: for each address pair (component-major, then layer), for each span in
/// order, one contiguous copy ([`Run`]) of the span's items. Kept as pairs × spans, not as their
/// product: a layer moves only the base of its addresses, so one list of merged spans serves
/// every layer, and a plan costs what its index lists do, whatever the layer count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyStep {
    pub(crate) pairs: Vec<AddrPair>,
    /// The host item of each pair: `(host layer, component)`.
    pub(crate) items: Vec<(u64, u8)>,
    pub(crate) spans: Arc<Vec<Span>>,
    pub(crate) item_bytes: u64,
    /// Whether the host side is the source (a load).
    pub(crate) host_to_device: bool,
}

impl CopyStep {
    /// Runs in the step: pairs × spans.
    pub fn len(&self) -> usize {
        self.pairs.len() * self.spans.len()
    }
    /// Whether the step copies nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The address pairs, one per (component, layer).
    pub fn pairs(&self) -> &[AddrPair] {
        &self.pairs
    }
    /// The spans every pair copies.
    pub fn spans(&self) -> &[Span] {
        &self.spans
    }
    /// Run `k` (pair `k / spans`, span `k % spans`); `None` past the end.
    pub fn run(&self, k: usize) -> Option<Run> {
        let n = self.spans.len();
        (k < self.len()).then(|| self.make(k / n, k % n))
    }
    /// Runs `lo .. hi` in order (clamped to the step), without a division per run.
    pub fn runs_in(&self, lo: usize, hi: usize) -> Runs<'_> {
        let n = self.spans.len().max(1);
        let (lo, hi) = (lo.min(self.len()), hi.min(self.len()));
        Runs { step: self, pair: lo / n, span: lo % n, left: hi.saturating_sub(lo) }
    }
    /// Every run, in order.
    pub fn runs(&self) -> Runs<'_> {
        self.runs_in(0, self.len())
    }
    /// Runs `lo .. hi` (clamped) as pieces of one pair each: `(pair index, its spans)`, in order
    /// (for loops that keep a pair's addresses in registers).
    pub fn pieces(&self, lo: usize, hi: usize) -> impl Iterator<Item = (usize, &[Span])> + '_ {
        let n = self.spans.len().max(1);
        let (lo, hi) = (lo.min(self.len()), hi.min(self.len()));
        (lo / n..hi.div_ceil(n)).map(move |p| {
            let (a, b) = ((p * n).max(lo) - p * n, ((p + 1) * n).min(hi) - p * n);
            (p, &self.spans[a..b])
        })
    }
    /// The host item `(host layer, component)` of pair `pair`.
    pub fn item(&self, pair: usize) -> (u64, u8) {
        self.items[pair]
    }
    /// `(source unit, destination unit)` of a span's first item.
    #[inline(always)]
    pub fn units(&self, s: &Span) -> (u64, u64) {
        if self.host_to_device {
            (s.host_unit, s.device_unit)
        } else {
            (s.device_unit, s.host_unit)
        }
    }
    /// Bytes per item.
    pub fn item_bytes(&self) -> u64 {
        self.item_bytes
    }
    #[inline(always)]
    fn make(&self, pair: usize, span: usize) -> Run {
        let (p, s, (layer, comp)) = (&self.pairs[pair], &self.spans[span], self.items[pair]);
        let (su, du) = self.units(s);
        Run::new(
            (p.src.buf, p.src.offset(su, 0)),
            (p.dst.buf, p.dst.offset(du, 0)),
            s.items * self.item_bytes,
            (s.items, s.host_unit, s.device_unit, layer, comp),
        )
    }
}

/// The runs of a [`CopyStep`], in order.
#[derive(Debug, Clone)]
pub struct Runs<'a> {
    step: &'a CopyStep,
    pair: usize,
    span: usize,
    left: usize,
}

impl Iterator for Runs<'_> {
    type Item = Run;
    #[inline]
    fn next(&mut self) -> Option<Run> {
        if self.left == 0 {
            return None;
        }
        let r = self.step.make(self.pair, self.span);
        self.left -= 1;
        self.span += 1;
        if self.span == self.step.spans.len() {
            (self.pair, self.span) = (self.pair + 1, 0);
        }
        Some(r)
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl ExactSizeIterator for Runs<'_> {}

/// What one step does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepKind {
    /// A gather/scatter (`kernel`).
    Gather(GatherStep),
    /// Coalesced byte runs, copied in order (`direct`).
    Copy(CopyStep),
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
    pub(super) owner: u64,
    pub(super) pair: Arc<PoolPair>,
    pub(super) profile: Profile,
    pub(super) direction: Direction,
    pub(super) path: PathInfo,
    pub(super) io: IoBackend,
    pub(super) steps: Arc<[Step]>,
    pub(super) bytes: u64,
    pub(super) device_check: Option<DeviceIndexCheck>,
    /// Host indices (in units: pages for the DSA indexer) of the call, negative: skipped.
    pub(super) host_units: Arc<[i64]>,
    /// The call's own launch tuning (`None`: the executor's).
    pub(super) tuning: Option<super::LaunchTuning>,
}

/// The host layers of `steps`, ascending, each once.
pub(crate) fn layers_of<'a>(steps: impl IntoIterator<Item = &'a Step>) -> Vec<u64> {
    let mut layers: Vec<u64> = steps.into_iter().flat_map(|s| s.layers().iter().copied()).collect();
    layers.sort_unstable();
    layers.dedup();
    layers
}

impl Plan {
    /// The launch tuning this call asked for (`None`: the executor's own).
    pub fn tuning(&self) -> Option<super::LaunchTuning> {
        self.tuning
    }

    /// Gives this plan a call's own launch tuning (clamped as [`super::LaunchTuning::from_args`] clamps).
    pub(crate) fn set_tuning(&mut self, tuning: Option<super::LaunchTuning>) {
        self.tuning = tuning.map(super::LaunchTuning::clamped);
    }

    /// The plan with its copies checksumming every item (`on`, on an executor whose copies can:
    /// [`Capabilities::checksums`]; index lists on the host). `direct` steps on an executor
    /// without [`Capabilities::direct_checksums`] settle their items as unknown instead, in queue
    /// order. Other plans are unchanged, and their backups leave the items' checksums unknown.
    /// An item wider than the executor's summing copies can sum is refused
    /// ([`Capabilities::max_checksum_item_words`]).
    pub(crate) fn with_checksums(mut self, on: bool, caps: &Capabilities) -> Result<Plan> {
        if !on || !caps.checksums || self.device_check.is_some() || self.steps.is_empty() {
            return Ok(self);
        }
        let words = self.pair.host().item_bytes().div_ceil(4);
        if words > caps.max_checksum_item_words {
            return Err(TransferError::ExecutorLimit {
                executor: caps.name,
                what: "32-bit words per item that a checksumming copy sums (turn the pool's integrity off to move larger items)",
                value: words,
                limit: caps.max_checksum_item_words,
            });
        }
        let mode = match self.direction {
            Direction::HostToDevice => ChecksumMode::Verify,
            Direction::DeviceToHost => ChecksumMode::Record,
        };
        let mark = |steps: &mut [Step]| {
            for step in steps {
                match &mut step.kind {
                    StepKind::Gather(g) => g.checksum = Some(mode),
                    StepKind::Copy(_) if caps.direct_checksums => step.checksum = Some(mode),
                    StepKind::Copy(_) => step.unsummed = Some(mode),
                }
            }
        };
        // In place: a fresh plan's steps are not shared (a copy of a `direct` plan's runs cost
        // as much as making them).
        match Arc::get_mut(&mut self.steps) {
            Some(steps) => mark(steps),
            None => {
                let mut steps: Vec<Step> = self.steps.to_vec();
                mark(&mut steps);
                self.steps = steps.into();
            }
        }
        Ok(self)
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
    /// Attaches the device checks of the layer tables the plan was made from; a plan without
    /// device index lists has no device check to carry them.
    pub(crate) fn guard_tables(&mut self, tables: super::TableGuards) -> crate::Result<()> {
        if tables.is_empty() {
            return Ok(());
        }
        match &mut self.device_check {
            Some(c) => {
                c.tables = tables;
                Ok(())
            }
            None => Err(crate::TransferError::BadArgument {
                arg: "indices",
                value: 0,
                message: "a remembered layer table is checked on the device with CUDA index lists; pass both lists in CUDA memory".into(),
            }),
        }
    }
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
