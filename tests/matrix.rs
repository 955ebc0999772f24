//! The support table against sglang's pool code, written out here independently of the planner,
//! for both profiles, and docs/support-matrix.md's copy of `hicache-io matrix` kept in sync.

use hicache_io::geometry::{IoBackend, Layout, PoolKind, Profile};
use hicache_io::plan::{decide, kernel_word, Capabilities, Cell, TableOp};

const OK: &str = "ok";
const E1_PF: &str = "Unsupported layout: page_first";
const E1_PFD: &str = "Unsupported layout: page_first_direct";
const E1_PH: &str = "Unsupported layout: page_head";
const E1_PFDHG: &str = "Unsupported layout: page_first_direct_hg";
const E1_PU: &str = "Unsupported layout: page_unified";
const MLA_SHARD_PU: &str = "Layer-sharded HiCache backup does not support layout: page_unified";
const MLA_SHARD_DIRECT_PU: &str = "Layer-sharded direct HiCache backup only supports layer_first layout, got page_unified";
const E2_KERNEL: &str = "Unsupported IO backend: kernel";
const DSA_SHARD_PF: &str =
    "Layer-sharded DSA indexer HiCache backup with page_first layout is not supported without a per-layer LF->PF kernel.";
const DSA_SHARD_DIRECT_PF: &str = "Layer-sharded direct DSA indexer backup only supports layer_first layout, got page_first";
const DSA_SHARD_DIRECT_PFD: &str = "Layer-sharded direct DSA indexer backup only supports layer_first layout, got page_first_direct";
const MLA_SHARD_PF: &str = "Layer-sharded MLA HiCache backup with page_first layout requires the JIT one-layer kernel.";
const MLA_SHARD_PFD: &str = "Layer-sharded HiCache backup does not support layout: page_first_direct";
const MLA_SHARD_DIRECT_PF: &str = "Layer-sharded direct HiCache backup only supports layer_first layout, got page_first";
const MLA_SHARD_DIRECT_PFD: &str = "Layer-sharded direct HiCache backup only supports layer_first layout, got page_first_direct";
const MHA_SHARD: &str = "Layer-sharded HiCache backup is not supported for mha host pools in sglang (use profile extended)";

/// (layout, kernel, direct) for load and non-sharded backup: the same for every pool except
/// that page_head and page_first_direct_hg exist only for MHA (whose head-group-major pages move
/// with the pfdhg kernels only), and page_unified for MHA and MLA (kernel io only).
fn plain(kind: PoolKind) -> Vec<(Layout, &'static str, &'static str)> {
    let mha = kind == PoolKind::Mha;
    vec![
        (Layout::LayerFirst, OK, OK),
        (Layout::PageFirst, OK, E1_PF),
        (Layout::PageFirstDirect, E1_PFD, OK),
        (Layout::PageHead, if mha { OK } else { E1_PH }, E1_PH),
        (Layout::PageFirstDirectHeadGroups, if mha { OK } else { E1_PFDHG }, E1_PFDHG),
        (Layout::PageUnified, if kind == PoolKind::DsaIndexer { E1_PU } else { OK }, E1_PU),
    ]
}

fn sharded(kind: PoolKind, profile: Profile) -> Vec<(Layout, &'static str, &'static str)> {
    use Layout::*;
    match (kind, profile) {
        (PoolKind::Mha, Profile::Sglang) => Layout::ALL.iter().map(|&l| (l, MHA_SHARD, MHA_SHARD)).collect(),
        (PoolKind::Mha, Profile::Extended) => plain(kind),
        (PoolKind::Mla, Profile::Sglang) => vec![
            (LayerFirst, OK, OK),
            (PageFirst, MLA_SHARD_PF, MLA_SHARD_DIRECT_PF),
            (PageFirstDirect, MLA_SHARD_PFD, MLA_SHARD_DIRECT_PFD),
            (PageHead, E1_PH, E1_PH),
            (PageFirstDirectHeadGroups, E1_PFDHG, E1_PFDHG),
            (PageUnified, MLA_SHARD_PU, MLA_SHARD_DIRECT_PU),
        ],
        (PoolKind::Mla, Profile::Extended) => vec![
            (LayerFirst, OK, OK),
            (PageFirst, OK, E1_PF),
            (PageFirstDirect, MLA_SHARD_PFD, OK),
            (PageHead, E1_PH, E1_PH),
            (PageFirstDirectHeadGroups, E1_PFDHG, E1_PFDHG),
            (PageUnified, OK, E1_PU),
        ],
        (PoolKind::DsaIndexer, Profile::Sglang) => vec![
            (LayerFirst, OK, OK),
            (PageFirst, DSA_SHARD_PF, DSA_SHARD_DIRECT_PF),
            (PageFirstDirect, E1_PFD, DSA_SHARD_DIRECT_PFD),
            (PageHead, E1_PH, E1_PH),
            (PageFirstDirectHeadGroups, E1_PFDHG, E1_PFDHG),
            (PageUnified, E1_PU, E1_PU),
        ],
        (PoolKind::DsaIndexer, Profile::Extended) => plain(kind),
    }
}

fn outcome(profile: Profile, kind: PoolKind, op: TableOp, layout: Layout, io: IoBackend, item: u64) -> String {
    match decide(profile, Cell { kind, op, layout, io }, item, kernel_word(profile, &Capabilities::PORTABLE)) {
        Ok(_) => OK.to_string(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn every_cell_matches_the_reference_table() {
    let mut checked = 0;
    for profile in [Profile::Sglang, Profile::Extended] {
        for kind in PoolKind::ALL {
            // DeepSeek V3.2 indexer page at P = 64: 8448 B, a multiple of 8.
            let item = if kind == PoolKind::DsaIndexer { 132 * 64 } else { 1152 };
            for op in TableOp::ALL {
                let rows = if op == TableOp::ShardedBackup { sharded(kind, profile) } else { plain(kind) };
                for (layout, kernel, direct) in rows {
                    assert_eq!(
                        outcome(profile, kind, op, layout, IoBackend::Kernel, item),
                        kernel,
                        "{profile} {kind} {} {layout} kernel",
                        op.name()
                    );
                    assert_eq!(
                        outcome(profile, kind, op, layout, IoBackend::Direct, item),
                        direct,
                        "{profile} {kind} {} {layout} direct",
                        op.name()
                    );
                    checked += 2;
                }
            }
        }
    }
    assert_eq!(checked, 2 * 3 * 3 * 6 * 2);
}

#[test]
fn dsa_kernel_quirk_is_sglang_only() {
    // Page size 1: 132 B items, not a multiple of 8. sglang raises E2 for `kernel` on every
    // allocatable layout, even where the layout alone would be E1; extended lifts the quirk.
    for op in TableOp::ALL {
        for layout in [Layout::LayerFirst, Layout::PageFirst, Layout::PageFirstDirect] {
            assert_eq!(outcome(Profile::Sglang, PoolKind::DsaIndexer, op, layout, IoBackend::Kernel, 132), E2_KERNEL);
            let ext = outcome(Profile::Extended, PoolKind::DsaIndexer, op, layout, IoBackend::Kernel, 132);
            assert_ne!(ext, E2_KERNEL, "{layout}");
            // And it equals the outcome with an 8-aligned item.
            assert_eq!(ext, outcome(Profile::Extended, PoolKind::DsaIndexer, op, layout, IoBackend::Kernel, 8448));
        }
        assert_eq!(outcome(Profile::Sglang, PoolKind::DsaIndexer, op, Layout::LayerFirst, IoBackend::Direct, 132), OK);
    }
}

#[test]
fn names_parse_with_sglang_messages() {
    assert_eq!("page_first".parse::<Layout>().unwrap(), Layout::PageFirst);
    assert_eq!("page_blob".parse::<Layout>().unwrap_err().to_string(), "Unsupported layout: page_blob");
    assert_eq!("direct".parse::<IoBackend>().unwrap(), IoBackend::Direct);
    assert_eq!("kernel_ascend".parse::<IoBackend>().unwrap_err().to_string(), "Unsupported IO backend: kernel_ascend");
}

/// The matrices of docs/support-matrix.md are the output of `hicache-io matrix`, regenerated, not hand-kept.
#[test]
fn readme_matrix_is_current() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/support-matrix.md")).unwrap();
    for profile in [Profile::Sglang, Profile::Extended] {
        let start = format!("<!-- matrix:{profile} -->\n");
        let from = readme.find(&start).unwrap_or_else(|| panic!("docs/support-matrix.md lacks {start:?}")) + start.len();
        let to = from + readme[from..].find("<!-- /matrix -->").expect("end marker");
        let want = hicache_io::tools::matrix::render_markdown(profile, &PoolKind::ALL, 64);
        assert_eq!(
            &readme[from..to],
            want,
            "docs/support-matrix.md: the matrix for {profile} is stale: run `hicache-io matrix --profile {profile}`"
        );
    }
}
