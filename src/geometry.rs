//! Shapes and byte offsets of sglang's host and device pools. Pure functions, no I/O.
//!
//! Symbols: `L` host layers, `P` page size in tokens, `size` host token slots,
//! item = bytes per (index, layer) — the token stride for MHA/MLA, the page stride for the DSA
//! indexer — `layout_dim = item × L`, `H` heads and `D = item / H` head bytes (page_head).
//!
//! Host layouts (one buffer per component; MHA has K and V):
//! ```text
//! layer_first        [L][slots][item]
//! page_first         [slots][L][item]
//! page_first_direct  [pages][L][P][item]
//! page_head          [pages][H][P][L][D]      (MHA only)
//! ```
//! The device pool is always layer_first, one buffer per live layer (and per component).

use std::fmt;
use std::str::FromStr;

use crate::error::{Result, TransferError};

/// Which of sglang's three host pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolKind {
    /// `MHATokenToKVPoolHost`: K and V, token slots.
    Mha,
    /// `MLATokenToKVPoolHost`: one buffer, token slots.
    Mla,
    /// `DSAIndexerPoolHost`: one uint8 buffer, page-sized items, indices are pages.
    DsaIndexer,
}

impl PoolKind {
    /// Every pool kind.
    pub const ALL: [PoolKind; 3] = [PoolKind::Mha, PoolKind::Mla, PoolKind::DsaIndexer];
    /// K and V for MHA, one buffer otherwise.
    pub fn components(self) -> usize {
        if self == PoolKind::Mha {
            2
        } else {
            1
        }
    }
    /// sglang's name.
    pub fn name(self) -> &'static str {
        match self {
            PoolKind::Mha => "mha",
            PoolKind::Mla => "mla",
            PoolKind::DsaIndexer => "dsa",
        }
    }
}

impl fmt::Display for PoolKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PoolKind {
    type Err = TransferError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "mha" => Ok(PoolKind::Mha),
            "mla" => Ok(PoolKind::Mla),
            "dsa" | "dsa_indexer" | "dsa-indexer" => Ok(PoolKind::DsaIndexer),
            other => Err(TransferError::UnknownName { what: "pool kind", name: other.into(), expected: "mha, mla, dsa" }),
        }
    }
}

/// Host layout, sglang's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// `[L][slots][item]`.
    LayerFirst,
    /// `[slots][L][item]`.
    PageFirst,
    /// `[pages][L][P][item]`.
    PageFirstDirect,
    /// `[pages][H][P][L][D]` (MHA only).
    PageHead,
    /// page_first_direct with each page block stored head-group-major,
    /// `[pages][HG][L][P][hg × D]` (MHA only; `HG` = the pool's `head_num`, `hg = H / HG`
    /// heads per group): every (page, head group, layer) is one contiguous run, so a reader with
    /// another tensor-parallel degree fetches its heads in one piece. `HG = 1` is byte for byte
    /// page_first_direct. sglang's `transfer_kv_*_pfdhg*` ops move it.
    PageFirstDirectHeadGroups,
}

/// The name of [`Layout::PageFirstDirectHeadGroups`] (sglang's pools call it page_first_direct
/// with head groups and have no name of their own for it yet; one place to follow a rename).
pub const PAGE_FIRST_DIRECT_HG: &str = "page_first_direct_hg";

impl Layout {
    /// Every layout.
    pub const ALL: [Layout; 5] =
        [Layout::LayerFirst, Layout::PageFirst, Layout::PageFirstDirect, Layout::PageHead, Layout::PageFirstDirectHeadGroups];
    /// sglang's name.
    pub fn name(self) -> &'static str {
        match self {
            Layout::LayerFirst => "layer_first",
            Layout::PageFirst => "page_first",
            Layout::PageFirstDirect => "page_first_direct",
            Layout::PageHead => "page_head",
            Layout::PageFirstDirectHeadGroups => PAGE_FIRST_DIRECT_HG,
        }
    }
}

impl Layout {
    /// Whether the host item is split into `head_num` chunks stored apart (page_head's heads,
    /// page_first_direct_hg's head groups). Both exist for MHA only.
    pub fn splits_heads(self) -> bool {
        matches!(self, Layout::PageHead | Layout::PageFirstDirectHeadGroups)
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Layout {
    type Err = TransferError;
    /// Unknown names fail with sglang's `Unsupported layout: {layout}`.
    fn from_str(s: &str) -> Result<Self> {
        Layout::ALL.into_iter().find(|l| l.name() == s).ok_or_else(|| TransferError::UnsupportedLayout { layout: s.to_string() })
    }
}

/// sglang's `--hicache-io-backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IoBackend {
    /// Gather/scatter copy kernel (`transfer_kv_*`).
    Kernel,
    /// Copy engine: one copy per coalesced run (`transfer_kv_direct`, `*_direct_*`).
    Direct,
    /// hicache-io's choice per call (profile `extended` only): `kernel` or `direct`, whichever
    /// the executor's calibration says is faster for the call's item size and run length, among
    /// the ones the table allows.
    Auto,
}

impl IoBackend {
    /// The two concrete io backends (the table's columns; `Auto` picks one of them).
    pub const ALL: [IoBackend; 2] = [IoBackend::Kernel, IoBackend::Direct];
    /// sglang's name.
    pub fn name(self) -> &'static str {
        match self {
            IoBackend::Kernel => "kernel",
            IoBackend::Direct => "direct",
            IoBackend::Auto => "auto",
        }
    }
}

impl fmt::Display for IoBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for IoBackend {
    type Err = TransferError;
    /// Unknown names (including sglang's NPU-only `kernel_ascend`) fail with
    /// `Unsupported IO backend: {io_backend}`.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "kernel" => Ok(IoBackend::Kernel),
            "direct" => Ok(IoBackend::Direct),
            "auto" => Ok(IoBackend::Auto),
            other => Err(TransferError::UnsupportedIoBackend { io_backend: other.to_string() }),
        }
    }
}

/// Which validation table to obey.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Profile {
    /// sglang's accept/reject decisions and messages, drop-in.
    Sglang,
    /// sglang plus the paths sglang lacks (layer-sharded backups into every layout, the DSA
    /// `kernel` quirk lifted). The default.
    #[default]
    Extended,
}

impl Profile {
    /// sglang's name.
    pub fn name(self) -> &'static str {
        match self {
            Profile::Sglang => "sglang",
            Profile::Extended => "extended",
        }
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Profile {
    type Err = TransferError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "sglang" => Ok(Profile::Sglang),
            "extended" => Ok(Profile::Extended),
            other => Err(TransferError::UnknownName { what: "profile", name: other.into(), expected: "sglang, extended" }),
        }
    }
}

/// DSA indexer bytes per token per layer: fp8 keys plus one fp32 scale per quant block
/// (132 for DeepSeek V3.2: `128 + 128/128*4`).
pub fn dsa_bytes_per_token(index_head_dim: u64, quant_block_size: u64) -> u64 {
    index_head_dim + index_head_dim / quant_block_size * 4
}

/// Most host layers (live target layers plus drafts) a pool may have. Real models have fewer
/// than 200; the bound keeps per-layer tables and buffer counts small and their arithmetic exact.
pub const MAX_LAYERS: usize = 1 << 16;

/// Which layers a device pool holds and how they map to host layers.
///
/// Device layer ids are global model layer ids `0..layer_num`; a layer-sharded pool owns
/// `owned.0..owned.1`; DSA skip-topk layers have no buffer. Draft (MTP) pools follow as extra
/// single-layer buffers. Host layers are the live target layers in order, then one per draft.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerMap {
    /// Target layers of the model (`layer_num` in sglang).
    pub layer_num: usize,
    /// The owned range `start..end` of a layer-sharded pool; `None` owns every layer.
    pub layer_shard: Option<(usize, usize)>,
    /// `skipped[l]`: DSA skip-topk layer (no buffer, never transferred). One entry per layer.
    pub skipped: Vec<bool>,
    /// Packed MTP draft pools, one host layer each.
    pub drafts: usize,
}

impl LayerMap {
    /// `layer_num` owned layers, none skipped, no drafts.
    pub fn new(layer_num: usize) -> Self {
        LayerMap { layer_num, layer_shard: None, skipped: vec![false; layer_num], drafts: 0 }
    }
    /// The owned range (every layer when not sharded).
    pub fn owned(&self) -> (usize, usize) {
        self.layer_shard.unwrap_or((0, self.layer_num))
    }
    /// Whether the pool owns a strict shard of the layers (backups go layer by layer).
    pub fn is_sharded(&self) -> bool {
        self.layer_shard.is_some()
    }
    /// Target layer ids that have a device buffer and a host layer, in order.
    pub fn live_layers(&self) -> Vec<usize> {
        let (start, end) = self.owned();
        (start..end).filter(|&l| !self.skipped[l]).collect()
    }
    /// How many target layers are live.
    pub fn live_count(&self) -> usize {
        let (start, end) = self.owned();
        self.skipped[start..end].iter().filter(|s| !**s).count()
    }
    /// Host layer (= device buffer slot) of a live target layer, `None` when the layer is not
    /// owned or skipped (sglang then returns without copying).
    pub fn target_slot(&self, layer_id: usize) -> Option<usize> {
        let (start, end) = self.owned();
        if layer_id < start || layer_id >= end || self.skipped[layer_id] {
            return None;
        }
        Some(self.skipped[start..layer_id].iter().filter(|s| !**s).count())
    }
    /// Host layer (= device buffer slot) of draft pool `k` (`layer_id = layer_num + k`).
    pub fn draft_slot(&self, k: usize) -> usize {
        self.live_count() + k
    }
    /// Host layer count `L`.
    pub fn host_layers(&self) -> usize {
        self.live_count() + self.drafts
    }
    /// Checks the map once; every count it reports afterwards is exact (no wrap).
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(TransferError::InvalidConfig(m));
        if self.layer_num == 0 {
            return bad("layer_num must be positive".into());
        }
        if self.skipped.len() != self.layer_num {
            return bad(format!("skip list has {} entries for {} layers", self.skipped.len(), self.layer_num));
        }
        if let Some((s, e)) = self.layer_shard {
            if s >= e || e > self.layer_num {
                return bad(format!("owned layer range {s}..{e} is empty or exceeds {} layers", self.layer_num));
            }
        }
        if self.drafts > MAX_LAYERS || self.live_count() + self.drafts > MAX_LAYERS {
            return bad(format!("{} live layers + {} drafts exceed the limit of {MAX_LAYERS} host layers", self.live_count(), self.drafts));
        }
        if self.host_layers() == 0 {
            return bad("the pool has no live layer".into());
        }
        Ok(())
    }
}

/// Largest page size in tokens (sglang uses 1 to 256); keeps page arithmetic on `i64` token
/// indices exact.
pub const MAX_PAGE_SIZE: u64 = 1 << 32;

fn check_page_size(page_size: u64) -> Result<()> {
    if page_size == 0 {
        return Err(TransferError::PageSizeNotPositive);
    }
    if page_size > MAX_PAGE_SIZE {
        return Err(TransferError::InvalidConfig(format!("page size {page_size} exceeds {MAX_PAGE_SIZE} tokens")));
    }
    Ok(())
}

/// `a × b`, or an `InvalidConfig` error naming what overflowed.
pub(crate) fn mul(a: u64, b: u64, what: &str) -> Result<u64> {
    a.checked_mul(b).ok_or_else(|| TransferError::InvalidConfig(format!("{what} overflows: {a} × {b}")))
}

/// `a + b`, or an `InvalidConfig` error naming what overflowed.
pub(crate) fn add(a: u64, b: u64, what: &str) -> Result<u64> {
    a.checked_add(b).ok_or_else(|| TransferError::InvalidConfig(format!("{what} overflows: {a} + {b}")))
}

/// A buffer of a pool pair: host component buffer, or device buffer `slot` (live target
/// layers in order, then drafts) of a component. Component 0 is K (or the only buffer), 1 is V.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BufRef {
    /// The host pool's buffer of component `comp`.
    Host {
        /// Component (0 = K or the only buffer, 1 = V).
        comp: u8,
    },
    /// The device pool's buffer `slot` of component `comp`.
    Device {
        /// Component (0 = K or the only buffer, 1 = V).
        comp: u8,
        /// Buffer slot: live target layers in order, then drafts.
        slot: u32,
    },
}

/// Where item `idx`, head chunk `head` of one (buffer, layer) lies: byte offset
/// `base + (idx / page) × page_stride + (idx % page) × row_stride + head × head_stride`.
/// One formula covers layer_first (`page = 1`), page_first, page_first_direct and page_head.
/// Built only by the geometry, so its strides always describe a validated pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Addr {
    pub(crate) buf: BufRef,
    pub(crate) base: u64,
    pub(crate) page: u64,
    pub(crate) page_stride: u64,
    pub(crate) row_stride: u64,
    pub(crate) head_stride: u64,
}

impl Addr {
    /// Byte offset of item `idx`, head chunk `head`. Exact for every index below the pool's
    /// slot count (the planner range-checks indices first).
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
    /// The buffer this address is in.
    pub fn buf(&self) -> BufRef {
        self.buf
    }
    /// `(base, page, page_stride, row_stride, head_stride)`, as the copy kernels take them.
    pub fn strides(&self) -> (u64, u64, u64, u64, u64) {
        (self.base, self.page, self.page_stride, self.row_stride, self.head_stride)
    }
}

/// Device pool geometry: layer_first, one buffer of `slots × item` bytes per live layer and
/// component. Built by [`DeviceGeometry::new`], which checks every size once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceGeometry {
    kind: PoolKind,
    item_bytes: u64,
    slots: u64,
    page_size: u64,
    layers: LayerMap,
    layer_bytes: u64,
    total_bytes: u64,
}

impl DeviceGeometry {
    /// `item_bytes` per slot (token stride, or indexer page stride for DSA), `slots` per layer
    /// buffer (tokens, or indexer pages), `page_size` tokens per page.
    pub fn new(kind: PoolKind, item_bytes: u64, slots: u64, page_size: u64, layers: LayerMap) -> Result<Self> {
        check_page_size(page_size)?;
        if item_bytes == 0 || slots == 0 {
            return Err(TransferError::InvalidConfig("device item bytes and slots must be positive".into()));
        }
        layers.validate()?;
        let layer_bytes = mul(slots, item_bytes, "device layer buffer bytes (slots × item)")?;
        let buffers = (layers.host_layers() * kind.components()) as u64;
        let total_bytes = mul(layer_bytes, buffers, "device pool bytes (layer bytes × buffers)")?;
        Ok(DeviceGeometry { kind, item_bytes, slots, page_size, layers, layer_bytes, total_bytes })
    }
    /// Pool kind.
    pub fn kind(&self) -> PoolKind {
        self.kind
    }
    /// Bytes per slot: token stride (MHA/MLA) or indexer page stride (DSA).
    pub fn item_bytes(&self) -> u64 {
        self.item_bytes
    }
    /// Slots per layer buffer: tokens (MHA/MLA) or indexer pages (DSA).
    pub fn slots(&self) -> u64 {
        self.slots
    }
    /// Tokens per page `P`.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }
    /// The layer map.
    pub fn layers(&self) -> &LayerMap {
        &self.layers
    }
    /// Bytes of one layer buffer.
    pub fn layer_bytes(&self) -> u64 {
        self.layer_bytes
    }
    /// Bytes of every buffer together.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }
    /// Buffers per component: live target layers then drafts.
    pub fn buffer_count(&self) -> usize {
        self.layers.host_layers()
    }
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

/// Host pool geometry. Built by [`HostGeometry::new`], which rounds the size like sglang and
/// checks every size once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostGeometry {
    kind: PoolKind,
    layout: Layout,
    page_size: u64,
    size: u64,
    layer_num: u64,
    item_bytes: u64,
    head_num: u64,
    slots: u64,
    buffer_bytes: u64,
}

impl HostGeometry {
    /// Builds a host geometry the sglang way. `requested_size` is rounded to
    /// `(requested_size / P + 1) × P` token slots. Fails with `Unsupported layout` for
    /// page_head on MLA/DSA, like sglang's allocator, and with `InvalidConfig` for sizes whose
    /// arithmetic overflows.
    pub fn new(
        kind: PoolKind,
        layout: Layout,
        page_size: u64,
        requested_size: u64,
        layer_num: u64,
        item_bytes: u64,
        head_num: u64,
    ) -> Result<Self> {
        check_page_size(page_size)?;
        if layer_num == 0 || item_bytes == 0 {
            return Err(TransferError::InvalidConfig("layer_num and item_bytes must be positive".into()));
        }
        if layout.splits_heads() {
            if kind != PoolKind::Mha {
                return Err(TransferError::UnsupportedLayout { layout: layout.name().into() });
            }
            // The per-head (page_head) or per-group arithmetic is exact only when H (HG) divides
            // the item.
            if head_num == 0 || !item_bytes.is_multiple_of(head_num) {
                return Err(TransferError::InvalidConfig(format!(
                    "{layout} needs head_num ({head_num}) to divide the item ({item_bytes} bytes)"
                )));
            }
        }
        let page_num = add(requested_size / page_size, 1, "host page count (size / P + 1)")?;
        let size = mul(page_num, page_size, "host token slots (page_num × P)")?;
        let slots = match kind {
            // indexer_page_num = (size + P + 1) / P
            PoolKind::DsaIndexer => add(size, add(page_size, 1, "indexer page count")?, "indexer page count")? / page_size,
            _ => size,
        };
        let layout_dim = mul(item_bytes, layer_num, "host layout_dim (item × L)")?;
        let buffer_bytes = mul(slots, layout_dim, "host buffer bytes (slots × item × L)")?;
        mul(buffer_bytes, kind.components() as u64, "host pool bytes")?;
        Ok(HostGeometry {
            kind,
            layout,
            page_size,
            size,
            layer_num,
            item_bytes,
            head_num: if layout.splits_heads() { head_num } else { 1 },
            slots,
            buffer_bytes,
        })
    }
    /// Pool kind.
    pub fn kind(&self) -> PoolKind {
        self.kind
    }
    /// Host layout.
    pub fn layout(&self) -> Layout {
        self.layout
    }
    /// `P`, tokens per page.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }
    /// Token slots after sglang's rounding: `page_num × P`.
    pub fn size(&self) -> u64 {
        self.size
    }
    /// `L`: live target layers plus one per draft.
    pub fn layer_num(&self) -> u64 {
        self.layer_num
    }
    /// Bytes per (slot, layer): token stride, or the indexer page stride for DSA.
    pub fn item_bytes(&self) -> u64 {
        self.item_bytes
    }
    /// `H` for page_head, `HG` for page_first_direct_hg (1 otherwise).
    pub fn head_num(&self) -> u64 {
        self.head_num
    }
    /// sglang's host `page_num`.
    pub fn page_num(&self) -> u64 {
        self.size / self.page_size
    }
    /// Slots along the index dimension: tokens (MHA/MLA) or indexer pages (DSA:
    /// `indexer_page_num = (size + P + 1) / P`).
    pub fn slots(&self) -> u64 {
        self.slots
    }
    /// Stride between consecutive slots in page_first: `item × L`.
    pub fn layout_dim(&self) -> u64 {
        self.item_bytes * self.layer_num
    }
    /// Bytes of one component buffer.
    pub fn buffer_bytes(&self) -> u64 {
        self.buffer_bytes
    }
    /// Pages of the index dimension in page-granular layouts (pfd/ph: `page_num`; DSA: its
    /// slots are pages already).
    pub fn index_pages(&self) -> u64 {
        match self.kind {
            PoolKind::DsaIndexer => self.slots,
            _ => self.page_num(),
        }
    }
    /// Tokens per "page" at the index granularity: `P` for MHA/MLA, 1 for DSA (its indices are
    /// pages already, and sglang passes `page_size=1` to the direct ops).
    pub fn index_page_size(&self) -> u64 {
        match self.kind {
            PoolKind::DsaIndexer => 1,
            _ => self.page_size,
        }
    }
    /// Bytes of one head's (page_head) or head group's (page_first_direct_hg) share of the
    /// item: the `kernel` copy unit; the item itself in the other layouts.
    pub fn chunk_bytes(&self) -> u64 {
        self.item_bytes / self.head_num
    }
    /// Addressing of component `comp`, host layer `layer`.
    pub fn addr(&self, comp: u8, layer: u64) -> Addr {
        let item = self.item_bytes;
        let l = self.layer_num;
        let h = self.head_num;
        let d = item / h;
        let buf = BufRef::Host { comp };
        match self.layout {
            Layout::LayerFirst => Addr { buf, base: layer * self.slots * item, page: 1, page_stride: item, row_stride: 0, head_stride: d },
            Layout::PageFirst => Addr { buf, base: layer * item, page: 1, page_stride: l * item, row_stride: 0, head_stride: d },
            Layout::PageFirstDirect => {
                let p = self.index_page_size();
                Addr { buf, base: layer * p * item, page: p, page_stride: l * p * item, row_stride: item, head_stride: d }
            }
            Layout::PageHead => {
                let p = self.page_size;
                Addr { buf, base: layer * d, page: p, page_stride: h * p * l * d, row_stride: l * d, head_stride: p * l * d }
            }
            // [pages][HG][L][P][d]: d = one head group's share of the item.
            Layout::PageFirstDirectHeadGroups => {
                let p = self.page_size;
                Addr { buf, base: layer * p * d, page: p, page_stride: l * p * item, row_stride: d, head_stride: l * p * d }
            }
        }
    }
    /// The storage helpers' flat page `page` (index-granular) of one component, as byte spans
    /// `(offset, len)` in the order sglang flattens its slice:
    /// layer_first `[L][P][item]` (one span per layer), page_first `[P][L][item]`,
    /// page_first_direct `[L][P][item]`, page_head `[H][P][L][D]`, page_first_direct_hg
    /// `[HG][L][P][hg × D]` (one span each). The DSA
    /// indexer's page is one slot, so every layout gives `[L][item]`.
    pub fn flat_page_spans(&self, page: u64) -> Vec<(u64, u64)> {
        let p = self.index_page_size();
        match self.layout {
            Layout::LayerFirst => {
                (0..self.layer_num).map(|l| (l * self.slots * self.item_bytes + page * p * self.item_bytes, p * self.item_bytes)).collect()
            }
            _ => {
                let len = p * self.layout_dim();
                vec![(page * len, len)]
            }
        }
    }
}

/// The geometry of one sglang-shaped pool pair, checked to belong together once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolPair {
    host: HostGeometry,
    device: DeviceGeometry,
}

impl PoolPair {
    /// A host geometry built against a device geometry: same kind, item and page size; `L`
    /// from the device's live layers and drafts.
    pub fn new(device: DeviceGeometry, layout: Layout, host_size: u64, head_num: u64) -> Result<Self> {
        let host = HostGeometry::new(
            device.kind,
            layout,
            device.page_size,
            host_size,
            device.layers.host_layers() as u64,
            device.item_bytes,
            head_num,
        )?;
        Ok(PoolPair { host, device })
    }
    /// The host side.
    pub fn host(&self) -> &HostGeometry {
        &self.host
    }
    /// The device side.
    pub fn device(&self) -> &DeviceGeometry {
        &self.device
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sglang_sizing() {
        let g = HostGeometry::new(PoolKind::Mla, Layout::PageFirst, 64, 1000, 4, 1152, 1).unwrap();
        assert_eq!(g.page_num(), 1000 / 64 + 1);
        assert_eq!(g.size(), 16 * 64);
        let d = HostGeometry::new(PoolKind::DsaIndexer, Layout::LayerFirst, 64, 1000, 4, 64 * 132, 1).unwrap();
        assert_eq!(d.slots(), (1024 + 64 + 1) / 64);
        assert_eq!(dsa_bytes_per_token(128, 128), 132);
    }

    #[test]
    fn page_head_matches_sglang_formula() {
        let g = HostGeometry::new(PoolKind::Mha, Layout::PageHead, 16, 100, 4, 1024, 8).unwrap();
        let (p, h, item, l) = (16u64, 8u64, 1024u64, 4u64);
        let page_dim = item * l;
        for slot in [0u64, 5, 17, 63] {
            for layer in 0..l {
                for head in 0..h {
                    let sg = (slot / p) * p * page_dim + (page_dim / h) * head * p + ((slot % p) * page_dim) / h + (layer * item) / h;
                    assert_eq!(g.addr(0, layer).offset(slot, head), sg);
                }
            }
        }
    }

    /// The head-group-major element formula: `((((p·HG + g)·L + l)·P + t)·hg + j)·D + e`.
    #[test]
    fn head_groups_match_the_element_formula() {
        let (p, hgs, l, heads, dim, es) = (4u64, 4u64, 3u64, 8u64, 16u64, 2u64);
        let item = heads * dim * es;
        let g = HostGeometry::new(PoolKind::Mha, Layout::PageFirstDirectHeadGroups, p, 10, l, item, hgs).unwrap();
        let hg = heads / hgs;
        assert_eq!(g.chunk_bytes(), hg * dim * es);
        for slot in [0u64, 3, 5, 11] {
            for layer in 0..l {
                for group in 0..hgs {
                    let (page, t) = (slot / p, slot % p);
                    let element = (((page * hgs + group) * l + layer) * p + t) * hg * dim;
                    assert_eq!(g.addr(0, layer).offset(slot, group), element * es);
                }
            }
        }
        // One group is page_first_direct byte for byte.
        let one = HostGeometry::new(PoolKind::Mha, Layout::PageFirstDirectHeadGroups, p, 10, l, item, 1).unwrap();
        let pfd = HostGeometry::new(PoolKind::Mha, Layout::PageFirstDirect, p, 10, l, item, 1).unwrap();
        for slot in 0..12 {
            for layer in 0..l {
                assert_eq!(one.addr(1, layer).offset(slot, 0), pfd.addr(1, layer).offset(slot, 0));
            }
        }
        for kind in [PoolKind::Mla, PoolKind::DsaIndexer] {
            assert!(matches!(
                HostGeometry::new(kind, Layout::PageFirstDirectHeadGroups, p, 10, l, item, 1),
                Err(TransferError::UnsupportedLayout { .. })
            ));
        }
    }

    #[test]
    fn overflow_is_a_config_error() {
        assert!(matches!(HostGeometry::new(PoolKind::Mla, Layout::LayerFirst, 1, u64::MAX, 1, 1, 1), Err(TransferError::InvalidConfig(_))));
        assert!(matches!(DeviceGeometry::new(PoolKind::Mla, 1 << 32, 1 << 32, 1, LayerMap::new(1)), Err(TransferError::InvalidConfig(_))));
    }

    #[test]
    fn layer_map() {
        let mut m = LayerMap::new(6);
        m.layer_shard = Some((2, 5));
        m.skipped[3] = true;
        m.drafts = 1;
        assert_eq!(m.live_layers(), vec![2, 4]);
        assert_eq!(m.target_slot(4), Some(1));
        assert_eq!(m.target_slot(3), None);
        assert_eq!(m.target_slot(5), None);
        assert_eq!(m.draft_slot(0), 2);
        assert_eq!(m.host_layers(), 3);
    }
}
