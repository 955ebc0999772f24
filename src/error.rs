//! Typed errors. Where sglang raises an error for the same situation, `Display` is sglang's text
//! verbatim (its `pool_host` allocators and dispatchers, and the `sgl-kernel` launchers); the
//! variants carry the offending values so callers can match on them instead of parsing strings.

use crate::geometry::{Layout, PoolKind};

/// Every way a transfer, a pool construction or an executor call can fail.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    // ---- sglang's own messages (verbatim Display) -------------------------------------------
    /// sglang `ValueError(f"Unsupported layout: {layout}")` (E1).
    #[error("Unsupported layout: {layout}")]
    UnsupportedLayout { layout: String },
    /// sglang `ValueError(f"Unsupported IO backend: {io_backend}")` (E2). Also the DSA quirk:
    /// `kernel` with an indexer page stride not divisible by 8 (profile `sglang`).
    #[error("Unsupported IO backend: {io_backend}")]
    UnsupportedIoBackend { io_backend: String },
    /// dsa.py, layer-sharded `kernel` backup into `page_first`.
    #[error("Layer-sharded DSA indexer HiCache backup with page_first layout is not supported without a per-layer LF->PF kernel.")]
    ShardedDsaPageFirst,
    /// dsa.py, layer-sharded `direct` backup into anything but `layer_first`.
    #[error("Layer-sharded direct DSA indexer backup only supports layer_first layout, got {layout}")]
    ShardedDsaDirectLayout { layout: Layout },
    /// mla.py, layer-sharded `kernel` backup into `page_first` without the JIT kernel.
    #[error("Layer-sharded MLA HiCache backup with page_first layout requires the JIT one-layer kernel.")]
    ShardedMlaPageFirst,
    /// mla.py, layer-sharded `kernel` backup into another layout.
    #[error("Layer-sharded HiCache backup does not support layout: {layout}")]
    ShardedLayout { layout: Layout },
    /// mla.py, layer-sharded `direct` backup into anything but `layer_first`.
    #[error("Layer-sharded direct HiCache backup only supports layer_first layout, got {layout}")]
    ShardedDirectLayout { layout: Layout },
    /// dsa.py `_get_indexer_page_indices`: token count not a multiple of the page size.
    #[error("Index buffer transfer expects page-aligned indices for DSA.")]
    DsaUnalignedCount { len: usize, page_size: u64 },
    /// Launcher / `transfer_kv_direct` check: index lists of different lengths.
    #[error("Source and destination indices must have the same length")]
    LengthMismatch { src_len: usize, dst_len: usize },
    /// Launcher check for the `kernel` io backend.
    #[error("Item byte size must be divisible by {word}")]
    ItemNotWordAligned { item_bytes: u64, word: u64 },
    /// `transfer_kv_direct` check.
    #[error("Page size must be positive")]
    PageSizeNotPositive,
    /// `transfer_kv_direct` / page_first_direct check.
    #[error("Source indices size must be divisible by page size")]
    DirectCountNotPageMultiple { len: usize, page_size: u64 },

    // ---- hicache-io's own checks (sglang has none) -------------------------------------------
    /// MHA has no layer-sharded backup branch in sglang (profile `sglang`).
    #[error("Layer-sharded HiCache backup is not supported for {kind} host pools in sglang (use profile extended)")]
    ShardedUnsupportedPool { kind: PoolKind },
    /// An index outside its pool. `side` is "host" or "device"; `position` is its place in the list.
    #[error("{side} index {index} at position {position} is out of range (pool holds {bound} {unit})")]
    IndexOutOfRange { side: &'static str, index: i64, position: usize, bound: u64, unit: &'static str },
    /// A page group (page_first_direct, DSA) that is not one whole page in order, nor all
    /// negative (`start`/`end`: its first and last entries).
    #[error("{side} indices {start}..={end} at position {position} are not one whole page of {page_size} consecutive slots starting at a multiple of {page_size}")]
    NotWholePage { side: &'static str, start: i64, end: i64, position: usize, page_size: u64 },
    /// Two entries write the same destination item (the result would depend on ordering, and
    /// differ between executors).
    #[error("{side} destination {unit} {index} is written twice (positions {first} and {second})")]
    DuplicateDestination { side: &'static str, unit: &'static str, index: i64, first: usize, second: usize },
    /// A layer id that the device pool does not have.
    #[error("layer {layer_id} is out of range: the device pool has {target_layers} target layers and {draft_layers} draft layers")]
    LayerOutOfRange { layer_id: usize, target_layers: usize, draft_layers: usize },
    /// A pool buffer that does not exist.
    #[error("no buffer (component {comp}, slot {slot:?}): the pool has {components} components of {slots} buffers")]
    NoSuchBuffer { comp: usize, slot: Option<usize>, components: usize, slots: usize },
    /// A buffer whose size does not match its geometry.
    #[error("{what}: expected {expected} bytes, got {actual}")]
    BufferSize { what: String, expected: u64, actual: u64 },
    /// A buffer offset or size the executor cannot address.
    #[error("{what}: {value} is not a multiple of the required alignment {required}")]
    Misaligned { what: String, value: u64, required: u64 },
    /// A `kernel` copy unit (the item, or one head's share of it for page_head) that is not a
    /// multiple of the word every executor copies: rejected the same way everywhere, rather
    /// than copied on one executor and truncated or misaligned on another.
    #[error("{chunk_bytes}-byte copy chunks (item {item_bytes} B / {heads} heads) are not a multiple of the {word}-byte copy word")]
    ChunkNotWordAligned { chunk_bytes: u64, item_bytes: u64, heads: u64, word: u64 },
    /// A pool configuration that cannot describe a pool: zero sizes, heads not dividing the
    /// item, sizes whose arithmetic overflows, too many layers.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A name that parses to nothing (pool kind, profile, executor).
    #[error("unknown {what} {name:?} (expected one of: {expected})")]
    UnknownName { what: &'static str, name: String, expected: &'static str },
    /// A host pool used with a device pool it was not built for.
    #[error("host pool was built for another device pool ({0})")]
    PoolMismatch(String),
    /// A plan executed with pools, a profile, a direction or an executor other than the ones it
    /// was made for.
    #[error("plan was made for {0}")]
    StalePlan(String),
    /// An item chunk that no binding window of this executor can hold.
    #[error("{executor}: {chunk_bytes}-byte item chunks need binding windows of {required} bytes, the largest is {window}")]
    WindowTooSmall { executor: &'static str, chunk_bytes: u64, window: u64, required: u64 },
    /// Objects of two executor instances mixed in one call (pools, buffers or plans).
    #[error("executor mismatch: expected {expected}, found {found}")]
    ExecutorMismatch { expected: String, found: String },
    /// An allocation refused (by the pool bound or by the allocator), before anything else was
    /// allocated for the pool.
    #[error("out of memory: {what} needs {requested} bytes ({limit})")]
    OutOfMemory { what: String, requested: u64, limit: String },
    /// A plan of several steps failed at step `failed_step`: steps before it completed (their
    /// bytes reached the destination), it and the steps after it did not. The source is never
    /// written. `completed_layers` lists the host layers whose every byte has landed.
    #[error("transfer failed at step {failed_step} of {total_steps} (layers completed: {completed_layers:?}): {source}")]
    Partial { failed_step: usize, total_steps: usize, completed_layers: Vec<u64>, source: Box<TransferError> },
    /// An executor that cannot run here (no driver, no adapter, not compiled in).
    #[error("{backend}: unavailable ({reason})")]
    Unavailable { backend: &'static str, reason: String },
    /// A failure inside an executor after validation (driver error, device lost, timeout).
    #[error("{backend} executor failed: {message}")]
    Executor { backend: &'static str, message: String },
}

/// `Result` with [`TransferError`].
pub type Result<T, E = TransferError> = std::result::Result<T, E>;
