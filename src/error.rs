//! Typed errors. Where sglang raises an error for the same situation, `Display` is sglang's text
//! verbatim (its `pool_host` allocators and dispatchers, and the `sgl-kernel` launchers); the
//! variants carry the offending values so callers can match on them instead of parsing strings.

use crate::names::{Layout, PoolKind};

/// Every way a transfer, a pool construction or an executor call can fail.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    // ---- sglang's own messages (verbatim Display) -------------------------------------------
    /// sglang `ValueError(f"Unsupported layout: {layout}")` (E1).
    #[error("Unsupported layout: {layout}")]
    UnsupportedLayout {
        /// The host layout.
        layout: String,
    },
    /// sglang `ValueError(f"Unsupported IO backend: {io_backend}")` (E2). Also the DSA quirk:
    /// `kernel` with an indexer page stride not divisible by 8 (profile `sglang`).
    #[error("Unsupported IO backend: {io_backend}")]
    UnsupportedIoBackend {
        /// The io backend name.
        io_backend: String,
    },
    /// dsa.py, layer-sharded `kernel` backup into `page_first`.
    #[error("Layer-sharded DSA indexer HiCache backup with page_first layout is not supported without a per-layer LF->PF kernel.")]
    ShardedDsaPageFirst,
    /// dsa.py, layer-sharded `direct` backup into anything but `layer_first`.
    #[error("Layer-sharded direct DSA indexer backup only supports layer_first layout, got {layout}")]
    ShardedDsaDirectLayout {
        /// The host layout.
        layout: Layout,
    },
    /// mla.py, layer-sharded `kernel` backup into `page_first` without the JIT kernel.
    #[error("Layer-sharded MLA HiCache backup with page_first layout requires the JIT one-layer kernel.")]
    ShardedMlaPageFirst,
    /// mla.py, layer-sharded `kernel` backup into another layout.
    #[error("Layer-sharded HiCache backup does not support layout: {layout}")]
    ShardedLayout {
        /// The host layout.
        layout: Layout,
    },
    /// mla.py, layer-sharded `direct` backup into anything but `layer_first`.
    #[error("Layer-sharded direct HiCache backup only supports layer_first layout, got {layout}")]
    ShardedDirectLayout {
        /// The host layout.
        layout: Layout,
    },
    /// dsa.py `_get_indexer_page_indices`: token count not a multiple of the page size.
    #[error("Index buffer transfer expects page-aligned indices for DSA.")]
    DsaUnalignedCount {
        /// Entries in the index list.
        len: usize,
        /// Tokens per page `P`.
        page_size: u64,
    },
    /// Launcher / `transfer_kv_direct` check: index lists of different lengths.
    #[error("Source and destination indices must have the same length")]
    LengthMismatch {
        /// Length of the source list.
        src_len: usize,
        /// Length of the destination list.
        dst_len: usize,
    },
    /// Launcher check for the `kernel` io backend.
    #[error("Item byte size must be divisible by {word}")]
    ItemNotWordAligned {
        /// Bytes of one item.
        item_bytes: u64,
        /// The copy word in bytes.
        word: u64,
    },
    /// `transfer_kv_direct` check.
    #[error("Page size must be positive")]
    PageSizeNotPositive,
    /// `transfer_kv_direct` / page_first_direct check.
    #[error("Source indices size must be divisible by page size")]
    DirectCountNotPageMultiple {
        /// Entries in the index list.
        len: usize,
        /// Tokens per page `P`.
        page_size: u64,
    },

    /// All-layer launcher check: the source layer table's length against `num_layers`
    /// (`which` is `"k "` for the MHA ops, empty for MLA).
    #[error("Number of layers in source {which}tensor does not match num_layers")]
    NumLayersMismatch {
        /// `"k "` (MHA) or `""` (MLA).
        which: &'static str,
        /// The `num_layers` argument.
        num_layers: i64,
        /// Entries in the source layer table.
        table_len: usize,
    },
    /// `transfer_kv_direct` check: the two layer lists differ in length.
    #[error("Source and destination layers must have the same number of layers")]
    LayerListMismatch {
        /// Source layers.
        src_len: usize,
        /// Destination layers.
        dst_len: usize,
    },

    // ---- hicache-io's own checks (sglang has none) -------------------------------------------
    /// A scalar argument of a `kvcacheio` op that sglang's kernel refuses (the head-group ops'
    /// `page_size`, `head_num`, group bytes, layout dimension).
    #[error("{message}")]
    BadArgument {
        /// The argument's name (sglang's).
        arg: &'static str,
        /// Its value.
        value: i64,
        /// What sglang's check says.
        message: String,
    },
    /// A tensor argument of a `kvcacheio` op that cannot be what the op reads or writes: too
    /// small, a shape that disagrees with the sizes passed, memory the executor cannot address,
    /// or a destination that overlaps another argument.
    #[error("{arg}: {reason}")]
    BadTensor {
        /// The argument's name (sglang's), with its list position.
        arg: String,
        /// What is wrong.
        reason: String,
    },
    /// MHA has no layer-sharded backup branch in sglang (profile `sglang`).
    #[error("Layer-sharded HiCache backup is not supported for {kind} host pools in sglang (use profile extended)")]
    ShardedUnsupportedPool {
        /// The pool kind.
        kind: PoolKind,
    },
    /// An index outside its pool. `side` is "host" or "device" (the kvcacheio ops say "source"
    /// or "destination", sglang's words); `position` is its place in the list.
    #[error("{side} index {index} at position {position} is out of range (pool holds {bound} {unit})")]
    IndexOutOfRange {
        /// `"host"` or `"device"`; `"source"` or `"destination"` from the kvcacheio ops.
        side: &'static str,
        /// The offending index.
        index: i64,
        /// Its position in the list.
        position: usize,
        /// The pool holds indices `0..bound`.
        bound: u64,
        /// What an index counts (slots or pages).
        unit: &'static str,
    },
    /// A page group (page_first_direct, DSA) that is not one whole page in order, nor all
    /// negative (`start`/`end`: its first and last entries).
    #[error("{side} indices {start}..={end} at position {position} are not one whole page of {page_size} consecutive slots starting at a multiple of {page_size}")]
    NotWholePage {
        /// `"host"` or `"device"`; `"source"` or `"destination"` from the kvcacheio ops.
        side: &'static str,
        /// First entry of the group.
        start: i64,
        /// Last entry of the group.
        end: i64,
        /// Its position in the list.
        position: usize,
        /// Tokens per page `P`.
        page_size: u64,
    },
    /// Two entries write the same destination item (the result would depend on ordering, and
    /// differ between executors).
    #[error("{side} {} {index} is written twice (positions {first} and {second})", unit.strip_suffix('s').unwrap_or(unit))]
    DuplicateDestination {
        /// `"host"` or `"device"` (pools), `"destination"` (kvcacheio ops).
        side: &'static str,
        /// What an index counts (slots or pages).
        unit: &'static str,
        /// The offending index.
        index: i64,
        /// Position of the first write.
        first: usize,
        /// Position of the second write.
        second: usize,
    },
    /// A `kernel` step beyond what the executor's copy kernel runs (refused by the planner).
    #[error("{executor} kernel: {value} {what}, at most {limit}")]
    ExecutorLimit {
        /// The executor.
        executor: &'static str,
        /// What is counted.
        what: &'static str,
        /// The call's value.
        value: u64,
        /// The executor's limit.
        limit: u64,
    },
    /// A layer a [`crate::LayerLoads`] did not load.
    #[error(
        "layer {layer_id} was not loaded by these layer loads (loaded: {loaded:?}; the device pool has {target_layers} target layers, owns {}..{}, and has {draft_layers} draft layers)",
        owned.0,
        owned.1
    )]
    LayerNotLoaded {
        /// The layer id asked for.
        layer_id: usize,
        /// The layer ids loaded, in order.
        loaded: Vec<usize>,
        /// Target layers of the model.
        target_layers: usize,
        /// The owned range of target layers.
        owned: (usize, usize),
        /// Draft (MTP) pools.
        draft_layers: usize,
    },
    /// A layer id that the device pool does not have.
    #[error("layer {layer_id} is out of range: the device pool has {target_layers} target layers and {draft_layers} draft layers")]
    LayerOutOfRange {
        /// The layer id asked for.
        layer_id: usize,
        /// Target layers of the model.
        target_layers: usize,
        /// Draft (MTP) pools.
        draft_layers: usize,
    },
    /// A pool buffer that does not exist.
    #[error("no buffer (component {comp}, slot {slot:?}): the pool has {components} components of {slots} buffers")]
    NoSuchBuffer {
        /// Component asked for (0 = K or the only buffer, 1 = V).
        comp: usize,
        /// Buffer slot asked for (device pools).
        slot: Option<usize>,
        /// Components the pool has.
        components: usize,
        /// Buffers per component.
        slots: usize,
    },
    /// A buffer whose size does not match its geometry.
    #[error("{what}: expected {expected} bytes, got {actual}")]
    BufferSize {
        /// What was checked.
        what: String,
        /// Bytes expected.
        expected: u64,
        /// Bytes found.
        actual: u64,
    },
    /// A buffer offset or size the executor cannot address.
    #[error("{what}: {value} is not a multiple of the required alignment {required}")]
    Misaligned {
        /// What was checked.
        what: String,
        /// The value found.
        value: u64,
        /// The alignment required.
        required: u64,
    },
    /// A `kernel` copy unit (the item, or one head's share of it for page_head) that is not a
    /// multiple of the word every executor copies: rejected the same way everywhere, rather
    /// than copied on one executor and truncated or misaligned on another.
    #[error("{chunk_bytes}-byte copy chunks (item {item_bytes} B / {heads} heads) are not a multiple of the {word}-byte copy word")]
    ChunkNotWordAligned {
        /// Bytes of one copy chunk.
        chunk_bytes: u64,
        /// Bytes of one item.
        item_bytes: u64,
        /// Heads per item.
        heads: u64,
        /// The copy word in bytes.
        word: u64,
    },
    /// A pool configuration that cannot describe a pool: zero sizes, heads not dividing the
    /// item, sizes whose arithmetic overflows, too many layers.
    #[error("invalid configuration: {0}")]
    InvalidConfig(#[doc = "What is wrong."] String),
    /// A name that parses to nothing (pool kind, profile, executor).
    #[error("unknown {what} {name:?} (expected one of: {expected})")]
    UnknownName {
        /// What was checked.
        what: &'static str,
        /// The name given.
        name: String,
        /// Bytes expected.
        expected: &'static str,
    },
    /// A host pool used with a device pool it was not built for.
    #[error("host pool was built for another device pool ({0})")]
    PoolMismatch(#[doc = "The two geometries."] String),
    /// A plan executed with pools, a profile, a direction or an executor other than the ones it
    /// was made for.
    #[error("plan was made for {0}")]
    StalePlan(#[doc = "What the plan was made for."] String),
    /// An item chunk that no binding window of this executor can hold.
    #[error("{executor}: {chunk_bytes}-byte item chunks need binding windows of {required} bytes, the largest is {window}")]
    WindowTooSmall {
        /// The executor.
        executor: &'static str,
        /// Bytes of one copy chunk.
        chunk_bytes: u64,
        /// The largest window in bytes.
        window: u64,
        /// The alignment required.
        required: u64,
    },
    /// Objects of two executor instances mixed in one call (pools, buffers or plans).
    #[error("executor mismatch: expected {expected}, found {found}")]
    ExecutorMismatch {
        /// Bytes expected.
        expected: String,
        /// What was found instead.
        found: String,
    },
    /// An allocation refused (by the pool bound or by the allocator), before anything else was
    /// allocated for the pool.
    #[error("out of memory: {what} needs {requested} bytes ({limit})")]
    OutOfMemory {
        /// What was checked.
        what: String,
        /// Bytes asked for.
        requested: u64,
        /// Why they cannot be had.
        limit: String,
    },
    /// A plan of several steps failed at step `failed_step`: steps before it completed (their
    /// bytes reached the destination), it and the steps after it did not. The source is never
    /// written. `completed_layers` lists the host layers whose every byte has landed.
    #[error("transfer failed at step {failed_step} of {total_steps} (layers completed: {completed_layers:?}): {source}")]
    Partial {
        /// Index of the step that failed.
        failed_step: usize,
        /// Steps in the plan.
        total_steps: usize,
        /// Host layers whose every step completed.
        completed_layers: Vec<u64>,
        /// The failure of that step.
        source: Box<TransferError>,
    },
    /// A call whose index lists were in CUDA memory failed its device-side checks: nothing of it
    /// was copied. Reported at the next synchronizing call (or the next call on the executor),
    /// naming the call; `source` is the error the host checks would have returned.
    #[error("{call} (issued earlier, its CUDA index lists checked on the device; nothing was copied): {source}")]
    DeviceIndexCheck {
        /// The call that was refused.
        call: &'static str,
        /// What the check found.
        source: Box<TransferError>,
    },
    /// A caller's table of layer addresses in device memory no longer holds what it held when
    /// the call was planned (the first use of a table reads it once; a table rewritten in place,
    /// or freed and replaced by another at the same address, must be announced with
    /// `forget_layer_tables`). Found on the device before the copies: nothing of the call moved.
    #[error(
        "the layer table at {table:#x} changed after it was first read (entry {entry} differs): nothing was copied;          after rewriting a table in place, call forget_layer_tables()"
    )]
    LayerTableChanged {
        /// Device address of the table.
        table: u64,
        /// The first entry found changed.
        entry: u64,
    },
    /// A load read host items whose bytes do not match the checksums their backups recorded:
    /// the call's other items landed; these were copied too but must be treated as a cache miss
    /// (reload them from elsewhere). The fields name the first such item (lowest layer,
    /// component, host index); `items` lists every one.
    #[error(
        "integrity check failed: host item {host_index} of layer {layer} (loaded into device slot {device_index}) has checksum {found:#018x}, its backup recorded {expected:#018x}{}",
        if items.len() > 1 { format!(" ({} items failed in all)", items.len()) } else { String::new() }
    )]
    Integrity {
        /// Host layer of the first mismatching item.
        layer: u64,
        /// Its host index (token slot; indexer page for the DSA indexer).
        host_index: u64,
        /// The device index it was loaded into.
        device_index: u64,
        /// The checksum its backup recorded.
        expected: u64,
        /// The checksum of the bytes the load read.
        found: u64,
        /// Every mismatching item of the call.
        items: Vec<ItemMismatch>,
    },
    /// An executor that cannot run here (no driver, no adapter, not compiled in).
    #[error("{backend}: unavailable ({reason})")]
    Unavailable {
        /// Executor name.
        backend: &'static str,
        /// Why.
        reason: String,
    },
    /// The executor's device is lost (wgpu: the device was lost or destroyed; cuda: a sticky
    /// fault of the context, such as an illegal address): this call and every later one on it
    /// fail with this error, as do the pools made on it. A new executor (wgpu: on the same
    /// adapter) works; a CUDA context with a sticky fault stays unusable for the process.
    #[error("{backend}: device lost ({cause})")]
    DeviceLost {
        /// Executor name.
        backend: &'static str,
        /// What the driver said.
        cause: String,
    },
    /// A failure inside an executor after validation (driver error, timeout).
    #[error("{backend} executor failed: {message}")]
    Executor {
        /// Executor name.
        backend: &'static str,
        /// What the driver or API said.
        message: String,
    },
}

/// `Result` with [`TransferError`].
pub type Result<T, E = TransferError> = std::result::Result<T, E>;

impl TransferError {
    /// [`TransferError::Partial`]: step `failed_step` of `total_steps` failed with `source`
    /// after `completed_layers` (ascending host layers) had landed.
    pub(crate) fn partial(failed_step: usize, total_steps: usize, completed_layers: Vec<u64>, source: TransferError) -> TransferError {
        TransferError::Partial { failed_step, total_steps, completed_layers, source: Box::new(source) }
    }

    /// The same error with its index lists named `host` and `device` instead of the pools'
    /// "host" / "device" (the kvcacheio ops name them after sglang's source and destination).
    pub(crate) fn with_sides(self, host: &'static str, device: &'static str) -> TransferError {
        let name = |side: &'static str| match side {
            "host" => host,
            "device" => device,
            other => other,
        };
        match self {
            TransferError::IndexOutOfRange { side, index, position, bound, unit } => {
                TransferError::IndexOutOfRange { side: name(side), index, position, bound, unit }
            }
            TransferError::NotWholePage { side, start, end, position, page_size } => {
                TransferError::NotWholePage { side: name(side), start, end, position, page_size }
            }
            TransferError::DuplicateDestination { side, unit, index, first, second } => {
                TransferError::DuplicateDestination { side: name(side), unit, index, first, second }
            }
            other => other,
        }
    }
}

/// One item whose bytes did not match the checksum its backup recorded (see
/// [`TransferError::Integrity`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ItemMismatch {
    /// Host layer (live target layers, then one per draft).
    pub layer: u64,
    /// Component: 0 = K (or the only buffer), 1 = V.
    pub component: u8,
    /// Host index (token slot; indexer page for the DSA indexer).
    pub host_index: u64,
    /// Device index it was loaded into (same unit).
    pub device_index: u64,
    /// The checksum the backup recorded.
    pub expected: u64,
    /// The checksum of the bytes the load read.
    pub found: u64,
}
