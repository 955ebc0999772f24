//! Shapes and byte offsets of sglang's host and device pools. Pure functions, no I/O.
//!
//! Symbols (DESIGN.md): `L` host layers, `P` page size in tokens, `size` host token slots,
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
    pub const ALL: [PoolKind; 3] = [PoolKind::Mha, PoolKind::Mla, PoolKind::DsaIndexer];
    /// K and V for MHA, one buffer otherwise.
    pub fn components(self) -> usize {
        if self == PoolKind::Mha {
            2
        } else {
            1
        }
    }
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
            other => Err(TransferError::Geometry(format!("unknown pool kind {other:?} (mha, mla, dsa)"))),
        }
    }
}

/// Host layout, sglang's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    LayerFirst,
    PageFirst,
    PageFirstDirect,
    PageHead,
}

impl Layout {
    pub const ALL: [Layout; 4] = [Layout::LayerFirst, Layout::PageFirst, Layout::PageFirstDirect, Layout::PageHead];
    pub fn name(self) -> &'static str {
        match self {
            Layout::LayerFirst => "layer_first",
            Layout::PageFirst => "page_first",
            Layout::PageFirstDirect => "page_first_direct",
            Layout::PageHead => "page_head",
        }
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
}

impl IoBackend {
    pub const ALL: [IoBackend; 2] = [IoBackend::Kernel, IoBackend::Direct];
    pub fn name(self) -> &'static str {
        match self {
            IoBackend::Kernel => "kernel",
            IoBackend::Direct => "direct",
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
            other => Err(TransferError::Geometry(format!("unknown profile {other:?} (sglang, extended)"))),
        }
    }
}

/// DSA indexer bytes per token per layer: fp8 keys plus one fp32 scale per quant block
/// (132 for DeepSeek V3.2: `128 + 128/128*4`).
pub fn dsa_bytes_per_token(index_head_dim: u64, quant_block_size: u64) -> u64 {
    index_head_dim + index_head_dim / quant_block_size * 4
}

/// Which layers a device pool holds and how they map to host layers.
///
/// Device layer ids are global model layer ids `0..layer_num`; a layer-sharded pool owns
/// `owned.0..owned.1`; DSA skip-topk layers have no buffer. Draft (MTP) pools follow as extra
/// single-layer buffers. Host layers are the live target layers in order, then one per draft.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerMap {
    pub layer_num: usize,
    pub layer_shard: Option<(usize, usize)>,
    pub skipped: Vec<bool>,
    pub drafts: usize,
}

impl LayerMap {
    pub fn new(layer_num: usize) -> Self {
        LayerMap { layer_num, layer_shard: None, skipped: vec![false; layer_num], drafts: 0 }
    }
    pub fn owned(&self) -> (usize, usize) {
        self.layer_shard.unwrap_or((0, self.layer_num))
    }
    pub fn is_sharded(&self) -> bool {
        self.layer_shard.is_some()
    }
    /// Target layer ids that have a device buffer and a host layer, in order.
    pub fn live_layers(&self) -> Vec<usize> {
        let (start, end) = self.owned();
        (start..end).filter(|&l| !self.skipped[l]).collect()
    }
    pub fn live_count(&self) -> usize {
        self.live_layers().len()
    }
    /// Host layer (= device buffer slot) of a live target layer, `None` when the layer is not
    /// owned or skipped (sglang then returns without copying).
    pub fn target_slot(&self, layer_id: usize) -> Option<usize> {
        let (start, end) = self.owned();
        if layer_id < start || layer_id >= end || self.skipped[layer_id] {
            return None;
        }
        Some((start..layer_id).filter(|&l| !self.skipped[l]).count())
    }
    /// Host layer (= device buffer slot) of draft pool `k` (`layer_id = layer_num + k`).
    pub fn draft_slot(&self, k: usize) -> usize {
        self.live_count() + k
    }
    /// Host layer count `L`.
    pub fn host_layers(&self) -> usize {
        self.live_count() + self.drafts
    }
    pub fn validate(&self) -> Result<()> {
        if self.layer_num == 0 {
            return Err(TransferError::Geometry("layer_num must be positive".into()));
        }
        if self.skipped.len() != self.layer_num {
            return Err(TransferError::Geometry(format!("skip list has {} entries for {} layers", self.skipped.len(), self.layer_num)));
        }
        if let Some((s, e)) = self.layer_shard {
            if s >= e || e > self.layer_num {
                return Err(TransferError::Geometry(format!("owned layer range {s}..{e} is empty or exceeds {} layers", self.layer_num)));
            }
        }
        if self.host_layers() == 0 {
            return Err(TransferError::Geometry("the pool has no live layer".into()));
        }
        Ok(())
    }
}

/// Device pool geometry: layer_first, one buffer of `slots × item` bytes per live layer and
/// component.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceGeometry {
    pub kind: PoolKind,
    /// Bytes per slot: token stride (MHA/MLA) or indexer page stride (DSA).
    pub item_bytes: u64,
    /// Slots per layer buffer: tokens (MHA/MLA) or indexer pages (DSA).
    pub slots: u64,
    /// Tokens per page `P`.
    pub page_size: u64,
    pub layers: LayerMap,
}

impl DeviceGeometry {
    /// Bytes of one layer buffer.
    pub fn layer_bytes(&self) -> u64 {
        self.slots * self.item_bytes
    }
    /// Buffers per component: live target layers then drafts.
    pub fn buffer_count(&self) -> usize {
        self.layers.host_layers()
    }
    pub fn validate(&self) -> Result<()> {
        if self.item_bytes == 0 || self.slots == 0 {
            return Err(TransferError::Geometry("device item_bytes and slots must be positive".into()));
        }
        if self.page_size == 0 {
            return Err(TransferError::PageSizeNotPositive);
        }
        self.layers.validate()
    }
}

/// Host pool geometry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostGeometry {
    pub kind: PoolKind,
    pub layout: Layout,
    /// `P`, tokens per page.
    pub page_size: u64,
    /// Token slots after sglang's rounding: `page_num × P`.
    pub size: u64,
    /// `L`: live target layers plus one per draft.
    pub layer_num: u64,
    /// Bytes per (slot, layer): token stride, or the indexer page stride for DSA.
    pub item_bytes: u64,
    /// `H` for page_head (1 otherwise).
    pub head_num: u64,
}

impl HostGeometry {
    /// Builds a host geometry the sglang way. `requested_size` is rounded to
    /// `(requested_size / P + 1) × P` token slots. Fails with `Unsupported layout` for
    /// page_head on MLA/DSA, like sglang's allocator.
    pub fn new(
        kind: PoolKind,
        layout: Layout,
        page_size: u64,
        requested_size: u64,
        layer_num: u64,
        item_bytes: u64,
        head_num: u64,
    ) -> Result<Self> {
        if page_size == 0 {
            return Err(TransferError::PageSizeNotPositive);
        }
        if layer_num == 0 || item_bytes == 0 {
            return Err(TransferError::Geometry("layer_num and item_bytes must be positive".into()));
        }
        if layout == Layout::PageHead {
            if kind != PoolKind::Mha {
                return Err(TransferError::UnsupportedLayout { layout: layout.name().into() });
            }
            // sglang's ph arithmetic is exact only when H divides the item (reference §1.4).
            if head_num == 0 || item_bytes % head_num != 0 {
                return Err(TransferError::Geometry(format!(
                    "page_head needs head_num ({head_num}) to divide the item ({item_bytes} bytes)"
                )));
            }
        }
        let page_num = requested_size / page_size + 1;
        Ok(HostGeometry {
            kind,
            layout,
            page_size,
            size: page_num * page_size,
            layer_num,
            item_bytes,
            head_num: if layout == Layout::PageHead { head_num } else { 1 },
        })
    }
    /// sglang's host `page_num`.
    pub fn page_num(&self) -> u64 {
        self.size / self.page_size
    }
    /// Slots along the index dimension: tokens (MHA/MLA) or indexer pages (DSA:
    /// `indexer_page_num = (size + P + 1) / P`).
    pub fn slots(&self) -> u64 {
        match self.kind {
            PoolKind::DsaIndexer => (self.size + self.page_size + 1) / self.page_size,
            _ => self.size,
        }
    }
    /// Stride between consecutive slots in page_first: `item × L`.
    pub fn layout_dim(&self) -> u64 {
        self.item_bytes * self.layer_num
    }
    /// Bytes of one component buffer.
    pub fn buffer_bytes(&self) -> u64 {
        self.slots() * self.layout_dim()
    }
    /// Pages of the index dimension in page-granular layouts (pfd/ph: `page_num`; DSA: its
    /// slots are pages already).
    pub fn index_pages(&self) -> u64 {
        match self.kind {
            PoolKind::DsaIndexer => self.slots(),
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
    /// Byte offset of the item at (`layer`, `slot`, head chunk `head`) in one component buffer.
    /// `head` selects bytes `head × item/H ..` of the item (always 0 unless page_head).
    pub fn item_offset(&self, layer: u64, slot: u64, head: u64) -> u64 {
        let item = self.item_bytes;
        let l = self.layer_num;
        let h = self.head_num;
        let d = item / h;
        match self.layout {
            Layout::LayerFirst => layer * self.slots() * item + slot * item + head * d,
            Layout::PageFirst => slot * l * item + layer * item + head * d,
            Layout::PageFirstDirect => {
                let p = self.index_page_size();
                (slot / p) * l * p * item + layer * p * item + (slot % p) * item + head * d
            }
            Layout::PageHead => {
                let p = self.page_size;
                (slot / p) * h * p * l * d + head * p * l * d + (slot % p) * l * d + layer * d
            }
        }
    }
    /// Offset and length of page `page` (index-granular pages) in page_first layouts: the
    /// storage helpers' flat page (`[P][L][item]` for page_first, `[L][P][item]` for
    /// page_first_direct).
    pub fn page_span(&self, page: u64) -> (u64, u64) {
        let p = self.index_page_size();
        let len = p * self.layout_dim();
        (page * len, len)
    }
}

/// The geometry of one sglang-shaped pool pair, as used by the checker and benches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolPair {
    pub host: HostGeometry,
    pub device: DeviceGeometry,
}

impl PoolPair {
    /// A host geometry built against a device geometry: same kind, item and page size; `L`
    /// from the device's live layers and drafts.
    pub fn new(device: DeviceGeometry, layout: Layout, host_size: u64, head_num: u64) -> Result<Self> {
        device.validate()?;
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sglang_sizing() {
        let g = HostGeometry::new(PoolKind::Mla, Layout::PageFirst, 64, 1000, 4, 1152, 1).unwrap();
        assert_eq!(g.page_num(), 1000 / 64 + 1);
        assert_eq!(g.size, 16 * 64);
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
                    assert_eq!(g.item_offset(layer, slot, head), sg);
                }
            }
        }
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
