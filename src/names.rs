//! The vocabulary every layer speaks: sglang's three host pools, its host layouts and io
//! backends, and the two validation profiles, with sglang's names. A leaf: errors carry these
//! values, and the geometry parses them (`FromStr`, with sglang's errors).

use std::fmt;

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
    /// One buffer holding K and V, each page block `[G][L][2][P][hg × D]` (MHA: `G` head groups =
    /// the pool's `head_num`, K before V inside each layer) or `[L][P][item]` (MLA: byte for byte
    /// page_first_direct). A (page, head group) is one contiguous span holding both components of
    /// every layer, and one component of a layer one run of `P × hg × D` bytes. sglang's
    /// `transfer_hicache_*page_unified*` kernels move it.
    PageUnified,
}

/// The name of [`Layout::PageFirstDirectHeadGroups`] (sglang's pools call it page_first_direct
/// with head groups and have no name of their own for it yet; one place to follow a rename).
pub const PAGE_FIRST_DIRECT_HG: &str = "page_first_direct_hg";

impl Layout {
    /// Every layout.
    pub const ALL: [Layout; 6] = [
        Layout::LayerFirst,
        Layout::PageFirst,
        Layout::PageFirstDirect,
        Layout::PageHead,
        Layout::PageFirstDirectHeadGroups,
        Layout::PageUnified,
    ];
    /// sglang's name.
    pub fn name(self) -> &'static str {
        match self {
            Layout::LayerFirst => "layer_first",
            Layout::PageFirst => "page_first",
            Layout::PageFirstDirect => "page_first_direct",
            Layout::PageHead => "page_head",
            Layout::PageFirstDirectHeadGroups => PAGE_FIRST_DIRECT_HG,
            Layout::PageUnified => "page_unified",
        }
    }
}

impl Layout {
    /// Whether the host item is split into `head_num` chunks stored apart (page_head's heads,
    /// page_first_direct_hg's head groups). Both exist for MHA only.
    pub fn splits_heads(self) -> bool {
        matches!(self, Layout::PageHead | Layout::PageFirstDirectHeadGroups)
    }
    /// Whether a `kind` host pool can be allocated in this layout (sglang's allocators): page_head
    /// and page_first_direct_hg exist for MHA only, page_unified for MHA and MLA.
    pub fn exists_for(self, kind: PoolKind) -> bool {
        !((self.splits_heads() && kind != PoolKind::Mha) || (self == Layout::PageUnified && kind == PoolKind::DsaIndexer))
    }
    /// Whether `kind`'s host item is split into `head_num` chunks in this layout: the
    /// head-splitting layouts, and page_unified's head groups (MHA).
    pub fn head_chunks(self, kind: PoolKind) -> bool {
        self.splits_heads() || (self == Layout::PageUnified && kind == PoolKind::Mha)
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
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
