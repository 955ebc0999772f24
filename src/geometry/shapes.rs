//! Device and host geometry: sizes, strides and the address of every item.

use super::*;
use crate::error::{Result, TransferError};

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
    /// `(idx, offset(idx, 0))` of each item of `items`, found with one division in all (a
    /// page's items are consecutive indices: a division per item cost more than summing it).
    pub fn offsets(&self, items: std::ops::Range<u64>) -> impl Iterator<Item = (u64, u64)> + '_ {
        let page = self.page.max(1);
        let (mut q, mut r) = (items.start / page, items.start % page);
        items.map(move |idx| {
            let at = self.base + q * self.page_stride + r * self.row_stride;
            r += 1;
            if r == page {
                (q, r) = (q + 1, 0);
            }
            (idx, at)
        })
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

/// Padded pages: each page of `P` tokens of a layer_first buffer fills `page_bytes` bytes, its
/// tokens' items `offset` bytes into the page, one after another. Token `t` of a layer lies at
/// `(t / P) × page_bytes + offset + (t % P) × item`. DeepSeek-V4's C4 caches are such buffers,
/// read as two of them: the 576-byte values at offset 0 and the 8-byte scales at `64 × 576`,
/// pages of 37,440 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagePadding {
    /// Bytes of one page.
    pub page_bytes: u64,
    /// Where the page's first item starts.
    pub offset: u64,
}

/// Device pool geometry: layer_first, one buffer of `slots × item` bytes per live layer and
/// component (pages of `page_bytes` with [`PagePadding`]). Built by [`DeviceGeometry::new`],
/// which checks every size once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceGeometry {
    kind: PoolKind,
    item_bytes: u64,
    slots: u64,
    page_size: u64,
    layers: LayerMap,
    layer_bytes: u64,
    total_bytes: u64,
    padding: Option<PagePadding>,
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
        Ok(DeviceGeometry { kind, item_bytes, slots, page_size, layers, layer_bytes, total_bytes, padding: None })
    }
    /// The same pool with padded pages: `slots` must be whole pages and each page's items must
    /// fit after `offset` (`offset + P × item ≤ page_bytes`); a layer buffer then holds
    /// `pages - 1` whole pages and the used part of the last, `offset + P × item` bytes.
    /// Padding whose `page_bytes` or `offset` is not a whole number of items puts items at any
    /// byte; executors that bind buffers in windows or segments (wgpu) cut them only at whole
    /// items, and refuse such pools larger than one window when a call is planned.
    pub fn with_padding(mut self, padding: PagePadding) -> Result<Self> {
        let p = self.page_size;
        if !self.slots.is_multiple_of(p) {
            return Err(TransferError::InvalidConfig(format!("padded pages need whole pages: {} slots, page size {p}", self.slots)));
        }
        let used = add(padding.offset, mul(p, self.item_bytes, "padded page items (P × item)")?, "padded page use")?;
        if used > padding.page_bytes {
            return Err(TransferError::InvalidConfig(format!(
                "padded page of {} bytes cannot hold {p} items of {} bytes after offset {}",
                padding.page_bytes, self.item_bytes, padding.offset
            )));
        }
        let whole = mul(self.slots / p - 1, padding.page_bytes, "device layer buffer bytes (pages × page bytes)")?;
        self.layer_bytes = add(whole, used, "device layer buffer bytes")?;
        let buffers = (self.layers.host_layers() * self.kind.components()) as u64;
        self.total_bytes = mul(self.layer_bytes, buffers, "device pool bytes (layer bytes × buffers)")?;
        self.padding = Some(padding);
        Ok(self)
    }
    /// Padded pages, when the pool has them.
    pub fn padding(&self) -> Option<PagePadding> {
        self.padding
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
        let buf = BufRef::Device { comp, slot };
        if let Some(pad) = self.padding {
            let (p, item) = (self.page_size, self.item_bytes);
            return Addr { buf, base: pad.offset, page: p, page_stride: pad.page_bytes, row_stride: item, head_stride: item / heads };
        }
        Addr { buf, base: 0, page: 1, page_stride: self.item_bytes, row_stride: 0, head_stride: self.item_bytes / heads }
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
    padding: Option<PagePadding>,
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
        // sglang defines page_unified for MHA and MLA pools only.
        if !layout.exists_for(kind) {
            return Err(TransferError::UnsupportedLayout { layout: layout.name().into() });
        }
        if layout.head_chunks(kind) {
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
        // page_unified keeps every component in its one buffer.
        let (buffer_bytes, buffers) = if layout == Layout::PageUnified {
            (mul(buffer_bytes, kind.components() as u64, "host buffer bytes (× components)")?, 1)
        } else {
            (buffer_bytes, kind.components() as u64)
        };
        mul(buffer_bytes, buffers, "host pool bytes")?;
        Ok(HostGeometry {
            kind,
            layout,
            page_size,
            size,
            layer_num,
            item_bytes,
            head_num: if layout.head_chunks(kind) { head_num } else { 1 },
            slots,
            buffer_bytes,
            padding: None,
        })
    }
    /// The same host buffer with padded pages (layer_first only): each layer is
    /// `page_num × page_bytes` bytes, the last layer's last page used up to its last item.
    fn with_padding(mut self, padding: PagePadding) -> Result<Self> {
        if self.layout != Layout::LayerFirst || self.kind == PoolKind::DsaIndexer {
            return Err(TransferError::InvalidConfig(format!(
                "padded pages need a layer_first MHA or MLA host pool, not {} {}",
                self.kind, self.layout
            )));
        }
        let used = add(padding.offset, mul(self.page_size, self.item_bytes, "padded page items (P × item)")?, "padded page use")?;
        if used > padding.page_bytes {
            return Err(TransferError::InvalidConfig(format!(
                "padded page of {} bytes cannot hold {} items of {} bytes after offset {}",
                padding.page_bytes, self.page_size, self.item_bytes, padding.offset
            )));
        }
        let pages = mul(self.page_num(), self.layer_num, "host pages (pages × L)")?;
        let whole = mul(pages - 1, padding.page_bytes, "host buffer bytes (pages × page bytes)")?;
        self.buffer_bytes = add(whole, used, "host buffer bytes")?;
        mul(self.buffer_bytes, self.buffers() as u64, "host pool bytes")?;
        self.padding = Some(padding);
        Ok(self)
    }
    /// Padded pages, when the pool has them.
    pub fn padding(&self) -> Option<PagePadding> {
        self.padding
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
    /// `H` for page_head, `HG` for page_first_direct_hg, `G` for MHA page_unified (1 otherwise).
    pub fn head_num(&self) -> u64 {
        self.head_num
    }
    /// Host buffers: one per component (K, V for MHA), or one for page_unified, which keeps
    /// both components in it.
    pub fn buffers(&self) -> usize {
        if self.layout == Layout::PageUnified {
            1
        } else {
            self.kind.components()
        }
    }
    /// The buffer component `comp` lives in.
    pub fn buffer_of(&self, comp: u8) -> u8 {
        if self.layout == Layout::PageUnified {
            0
        } else {
            comp
        }
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
    /// Bytes of one host buffer (there are [`HostGeometry::buffers`] of them).
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
        if let Some(pad) = self.padding {
            let p = self.page_size;
            let base = layer * self.page_num() * pad.page_bytes + pad.offset;
            return Addr { buf, base, page: p, page_stride: pad.page_bytes, row_stride: item, head_stride: d };
        }
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
            // One buffer, [pages][G][L][C][P][d]: C components, d = one head group's share.
            Layout::PageUnified => {
                let (p, c) = (self.page_size, self.kind.components() as u64);
                Addr {
                    buf: BufRef::Host { comp: 0 },
                    base: (layer * c + comp as u64) * p * d,
                    page: p,
                    page_stride: c * l * p * item,
                    row_stride: d,
                    head_stride: c * l * p * d,
                }
            }
        }
    }
    /// The storage helpers' flat page `page` (index-granular) of one component, as byte spans
    /// `(offset, len)` in the order sglang flattens its slice:
    /// layer_first `[L][P][item]` (one span per layer), page_first `[P][L][item]`,
    /// page_first_direct `[L][P][item]`, page_head `[H][P][L][D]`, page_first_direct_hg
    /// `[HG][L][P][hg × D]` (one span each), page_unified `[G][L][C][P][hg × D]` (one span, in
    /// its one buffer, holding every component). The DSA
    /// indexer's page is one slot, so every layout gives `[L][item]`.
    pub fn flat_page_spans(&self, page: u64) -> Vec<(u64, u64)> {
        let (spans, shift) = self.flat_page_template();
        spans.into_iter().map(|(off, len)| (off + page * shift, len)).collect()
    }

    /// [`HostGeometry::flat_page_spans`] of page 0, and the shift from one page to the next
    /// (every span of page `k` lies `k · shift` after page 0's).
    pub fn flat_page_template(&self) -> (Vec<(u64, u64)>, u64) {
        let p = self.index_page_size();
        if let Some(pad) = self.padding {
            let layer = self.page_num() * pad.page_bytes;
            return ((0..self.layer_num).map(|l| (l * layer + pad.offset, p * self.item_bytes)).collect(), pad.page_bytes);
        }
        match self.layout {
            Layout::LayerFirst => {
                ((0..self.layer_num).map(|l| (l * self.slots * self.item_bytes, p * self.item_bytes)).collect(), p * self.item_bytes)
            }
            _ => {
                // page_unified's page holds every component.
                let len = p * self.layout_dim() * (self.kind.components() / self.buffers()) as u64;
                (vec![(0, len)], len)
            }
        }
    }
}

/// Most spans one page share may be cut into, once adjacent pieces are merged
/// ([`HostGeometry::page_share_spans`]).
pub const MAX_SHARE_SPANS: u64 = 1 << 16;
/// Most pieces (layer × token × head chunk) a page share may be walked in.
const MAX_SHARE_PIECES: u64 = 1 << 24;

/// One piece of a page share ([`HostGeometry::share_pieces`]): bytes `byte..byte + len` of the
/// item of `layer` and `token` (inside one head chunk), at byte `off` of its buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SharePiece {
    pub layer: u64,
    pub token: u64,
    pub byte: u64,
    pub len: u64,
    pub off: u64,
}

/// Where a page share lies: `(buffer, offset, bytes)` spans and the shift from one page to the next.
pub type ShareSpans = (Vec<(usize, u64, u64)>, u64);

/// A share of a host page, as a layout-free L3 object holds it: component `comp`'s host layers
/// `layers.0..layers.1` and bytes `bytes.0..bytes.1` of each of their items (e.g. one head
/// group's heads), in the order (layer, token of the page, byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageShare {
    /// Component (0 = K or the only one, 1 = V).
    pub comp: u8,
    /// Host layers `[start, end)`.
    pub layers: (u64, u64),
    /// Bytes `[start, end)` of each item.
    pub bytes: (u64, u64),
}

impl HostGeometry {
    /// Where `share` of the page of token slots `0..P` lies: `(buffer, offset, bytes)` spans in
    /// the share's order, adjacent spans merged, and the byte shift from one page to the next
    /// (page `k`'s spans are page 0's moved by `k × shift`). MHA and MLA pools without padded
    /// pages; a share must be non-empty, inside the pool, walked in at most 2^24 pieces and
    /// cut into at most [`MAX_SHARE_SPANS`] spans.
    pub fn page_share_spans(&self, share: PageShare) -> Result<ShareSpans> {
        let PageShare { comp, layers: (l0, l1), bytes: (b0, b1) } = share;
        let bad = |what: String| Err(TransferError::InvalidConfig(format!("page share: {what}")));
        if self.kind == PoolKind::DsaIndexer || self.padding.is_some() {
            return bad(format!("{} {} pools with padded pages have no page shares", self.kind, self.layout));
        }
        if comp as usize >= self.kind.components() {
            return bad(format!("component {comp} of a {} pool", self.kind));
        }
        if l0 >= l1 || l1 > self.layer_num || b0 >= b1 || b1 > self.item_bytes {
            return bad(format!("layers {l0}..{l1} of {}, bytes {b0}..{b1} of {}", self.layer_num, self.item_bytes));
        }
        let p = self.page_size;
        let (pieces, cuts) = self.share_piece_count(share);
        if pieces > MAX_SHARE_PIECES {
            return bad(format!("{pieces} pieces (layers {l0}..{l1} × {p} tokens × {cuts} chunks), more than {MAX_SHARE_PIECES}"));
        }
        let buffer = self.buffer_of(comp) as usize;
        let mut out: Vec<(usize, u64, u64)> = Vec::new();
        for piece in self.share_pieces(share) {
            match out.last_mut() {
                Some(last) if last.1 + last.2 == piece.off => last.2 += piece.len,
                _ => out.push((buffer, piece.off, piece.len)),
            }
        }
        if out.len() as u64 > MAX_SHARE_SPANS {
            return bad(format!("{} spans, more than {MAX_SHARE_SPANS}", out.len()));
        }
        let a = self.addr(comp, 0);
        Ok((out, a.offset(p, 0) - a.offset(0, 0)))
    }

    /// How many pieces [`HostGeometry::share_pieces`] walks `share` in (saturating), and the
    /// chunks each of its items is cut into (`share`'s bytes non-empty).
    pub(crate) fn share_piece_count(&self, share: PageShare) -> (u64, u64) {
        let PageShare { layers: (l0, l1), bytes: (b0, b1), .. } = share;
        let chunk = self.chunk_bytes().max(1);
        let cuts = (b1.saturating_sub(1) / chunk).saturating_sub(b0 / chunk) + 1;
        (l1.saturating_sub(l0).saturating_mul(self.page_size).saturating_mul(cuts), cuts)
    }

    /// The pieces of `share` (checked by [`HostGeometry::page_share_spans`]) of the page of token
    /// slots `0..P`, in the share's order (layer, token, byte), each inside one head chunk of one
    /// item: the one definition of a share's bytes.
    pub(crate) fn share_pieces(&self, share: PageShare) -> impl Iterator<Item = SharePiece> + '_ {
        let PageShare { comp, layers: (l0, l1), bytes: (b0, b1) } = share;
        let (p, chunk) = (self.page_size, self.chunk_bytes().max(1));
        (l0..l1).flat_map(move |layer| {
            let a = self.addr(comp, layer);
            (0..p).flat_map(move |token| {
                let starts = std::iter::successors(Some(b0).filter(|&b| b < b1), move |&b| {
                    Some(b + (chunk - b % chunk).min(b1 - b)).filter(|&n| n < b1)
                });
                starts.map(move |byte| SharePiece {
                    layer,
                    token,
                    byte,
                    len: (chunk - byte % chunk).min(b1 - byte),
                    off: a.offset(token, byte / chunk) + byte % chunk,
                })
            })
        })
    }
}

/// The geometry of one sglang-shaped pool pair, checked to belong together once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolPair {
    host: HostGeometry,
    device: DeviceGeometry,
}

impl PoolPair {
    /// A host geometry built against a device geometry: same kind, item and page size (and
    /// padded pages, layer_first only); `L` from the device's live layers and drafts.
    pub fn new(device: DeviceGeometry, layout: Layout, host_size: u64, head_num: u64) -> Result<Self> {
        let padding = device.padding;
        PoolPair::with_host_padding(device, layout, host_size, head_num, padding)
    }
    /// [`PoolPair::new`] with the host's own padded pages (`None`: none), e.g. page rows whose
    /// host and device strides differ.
    pub fn with_host_padding(
        device: DeviceGeometry,
        layout: Layout,
        host_size: u64,
        head_num: u64,
        padding: Option<PagePadding>,
    ) -> Result<Self> {
        let mut host = HostGeometry::new(
            device.kind,
            layout,
            device.page_size,
            host_size,
            device.layers.host_layers() as u64,
            device.item_bytes,
            head_num,
        )?;
        if let Some(padding) = padding {
            host = host.with_padding(padding)?;
        }
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
