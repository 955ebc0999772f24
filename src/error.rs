//! Typed errors. Where sglang raises an error for the same situation, `Display` is sglang's text
//! verbatim (reference §1.5–1.8, §2.3–2.6); the variants carry the offending values so callers can
//! match on them instead of parsing strings.

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
    /// A page group (page_first_direct, DSA) that does not start on a page boundary or does not
    /// end `page_size - 1` slots later (`start`/`end`: its first and last entries).
    #[error("{side} indices {start}..={end} at position {position} are not one whole page of {page_size} slots starting at a multiple of {page_size}")]
    NotWholePage { side: &'static str, start: i64, end: i64, position: usize, page_size: u64 },
    /// Two entries write the same destination item (the result would depend on ordering, and
    /// differ between executors).
    #[error("{side} destination {unit} {index} is written twice (positions {first} and {second})")]
    DuplicateDestination { side: &'static str, unit: &'static str, index: i64, first: usize, second: usize },
    /// A layer id that the device pool does not have.
    #[error("layer {layer_id} is out of range: the device pool has {target_layers} target layers and {draft_layers} draft layers")]
    LayerOutOfRange { layer_id: usize, target_layers: usize, draft_layers: usize },
    /// A buffer whose size does not match its geometry.
    #[error("{what}: expected {expected} bytes, got {actual}")]
    BufferSize { what: String, expected: u64, actual: u64 },
    /// A buffer offset or size the executor cannot address.
    #[error("{what}: {value} is not a multiple of the required alignment {required}")]
    Misaligned { what: String, value: u64, required: u64 },
    /// Invalid geometry (zero sizes, heads not dividing the item, mismatched pools...).
    #[error("invalid geometry: {0}")]
    Geometry(String),
    /// Host and device pools live on different executors.
    #[error("host pool is on {host} but device pool is on {device}")]
    ExecutorMismatch { host: String, device: String },
    /// An executor that cannot run here (no driver, no adapter, not compiled in).
    #[error("{backend}: unavailable ({reason})")]
    Unavailable { backend: &'static str, reason: String },
    /// A failure inside an executor after validation (driver error, device lost, timeout).
    #[error("{backend} executor failed: {message}")]
    Executor { backend: &'static str, message: String },
}

pub type Result<T, E = TransferError> = std::result::Result<T, E>;
