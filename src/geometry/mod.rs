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
//! page_first_direct_hg [pages][HG][L][P][hg × D] (MHA only)
//! page_unified       [pages][G][L][2][P][hg × D]  (MHA: one buffer, K and V inside;
//!                    MLA: [pages][L][P][item]; not the DSA indexer)
//! ```
//! The device pool is always layer_first, one buffer per live layer (and per component).//!
//! Rooms: here the names (pool kinds, layouts, io backends, profiles), `layers` (which layers a
//! pool holds), `shapes` (device and host geometry, addresses).

mod layers;
mod shapes;

pub use layers::{LayerMap, MAX_LAYERS};
pub use shapes::*;

use std::str::FromStr;

use crate::error::{Result, TransferError};
pub use crate::names::{IoBackend, Layout, PoolKind, Profile, PAGE_FIRST_DIRECT_HG};

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

impl FromStr for Layout {
    type Err = TransferError;
    /// Unknown names fail with sglang's `Unsupported layout: {layout}`.
    fn from_str(s: &str) -> Result<Self> {
        Layout::ALL.into_iter().find(|l| l.name() == s).ok_or_else(|| TransferError::UnsupportedLayout { layout: s.to_string() })
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

    /// page_unified's load-back source formula, byte `(((((page·G + g)·L + l)·C + kv)·P + t)·g_bytes`
    /// for component `kv` (C = 2 for MHA, in one buffer; 1 for MLA, where it is page_first_direct).
    #[test]
    fn page_unified_matches_the_load_back_formula() {
        let (p, groups, l, item) = (4u64, 4u64, 3u64, 8 * 16 * 2);
        let g = HostGeometry::new(PoolKind::Mha, Layout::PageUnified, p, 10, l, item, groups).unwrap();
        let gb = item / groups;
        assert_eq!((g.buffers(), g.chunk_bytes(), g.buffer_bytes()), (1, gb, 2 * g.slots() * l * item));
        for slot in [0u64, 3, 5, 11] {
            for layer in 0..l {
                for kv in 0..2u8 {
                    for group in 0..groups {
                        let (page, t) = (slot / p, slot % p);
                        let want = ((((page * groups + group) * l + layer) * 2 + kv as u64) * p + t) * gb;
                        let a = g.addr(kv, layer);
                        assert_eq!((a.buf(), a.offset(slot, group)), (BufRef::Host { comp: 0 }, want));
                    }
                }
            }
        }
        let mla = HostGeometry::new(PoolKind::Mla, Layout::PageUnified, p, 10, l, 576, 4).unwrap();
        let pfd = HostGeometry::new(PoolKind::Mla, Layout::PageFirstDirect, p, 10, l, 576, 1).unwrap();
        assert_eq!(mla.head_num(), 1);
        for layer in 0..l {
            assert_eq!(mla.addr(0, layer).strides().1, pfd.addr(0, layer).strides().1);
            for slot in [0u64, 3, 5, 11] {
                assert_eq!(mla.addr(0, layer).offset(slot, 0), pfd.addr(0, layer).offset(slot, 0));
            }
        }
        assert!(HostGeometry::new(PoolKind::DsaIndexer, Layout::PageUnified, p, 10, l, 8448, 1).is_err());
        assert!(HostGeometry::new(PoolKind::Mha, Layout::PageUnified, p, 10, l, item, 3).is_err());
    }

    /// A page share's spans walk exactly the bytes (layer, token, byte) in order, for every MHA
    /// layout and page; a head group of a head-group-major layout is one span (pfdhg) or one per
    /// layer (page_unified).
    #[test]
    fn page_shares_walk_their_bytes_in_order() {
        let (p, l, item, groups) = (4u64, 3u64, 8 * 16u64, 4u64);
        for layout in Layout::ALL {
            let g = HostGeometry::new(PoolKind::Mha, layout, p, 10, l, item, groups).unwrap();
            for share in [
                PageShare { comp: 1, layers: (0, l), bytes: (32, 64) },
                PageShare { comp: 0, layers: (1, 3), bytes: (8, 72) },
                PageShare { comp: 1, layers: (2, 3), bytes: (0, item) },
            ] {
                let (spans, shift) = g.page_share_spans(share).unwrap();
                for page in [0u64, 2] {
                    let walked: Vec<(usize, u64)> =
                        spans.iter().flat_map(|&(buf, off, len)| (0..len).map(move |i| (buf, off + page * shift + i))).collect();
                    let mut want = Vec::new();
                    for layer in share.layers.0..share.layers.1 {
                        let a = g.addr(share.comp, layer);
                        for t in page * p..(page + 1) * p {
                            for b in share.bytes.0..share.bytes.1 {
                                want.push((g.buffer_of(share.comp) as usize, a.offset(t, b / g.chunk_bytes()) + b % g.chunk_bytes()));
                            }
                        }
                    }
                    assert_eq!(walked, want, "{layout} {share:?} page {page}");
                }
                if share.bytes == (32, 64) {
                    let runs = match layout {
                        Layout::PageFirstDirectHeadGroups => 1,
                        Layout::PageUnified => l as usize,
                        _ => spans.len(),
                    };
                    assert_eq!(spans.len(), runs, "{layout}");
                }
            }
        }
        let g = HostGeometry::new(PoolKind::Mha, Layout::PageUnified, p, 10, l, item, groups).unwrap();
        for bad in [
            PageShare { comp: 2, layers: (0, 1), bytes: (0, 8) },
            PageShare { comp: 0, layers: (1, 1), bytes: (0, 8) },
            PageShare { comp: 0, layers: (0, 4), bytes: (0, 8) },
            PageShare { comp: 0, layers: (0, 1), bytes: (8, item + 1) },
        ] {
            assert!(g.page_share_spans(bad).is_err(), "{bad:?}");
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
