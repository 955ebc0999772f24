//! Bad input: every class returns a typed error before any byte moves, on every executor, and
//! every buffer of both pools reads back unchanged. Defined no-ops leave them unchanged too.

mod common;

use hicache_io::error::TransferError;
use hicache_io::{Device, DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, LayerMap, Layout, PoolKind, Profile};

struct Pools {
    dev: DevicePool<'static>,
    host: HostPool<'static>,
}

/// Pools of `kind` in `layout`, `page` tokens a page, two heads, every byte of both random.
fn pools_of(device: &Device, kind: PoolKind, layout: Layout, bytes_per_token: u64, page: u64, profile: Profile, layers: LayerMap) -> Pools {
    let slots = if kind == PoolKind::DsaIndexer { 16 } else { 16 * page };
    let dc = DevicePoolConfig { kind, bytes_per_token, slots, page_size: page, layers };
    let hc = HostPoolConfig { layout, size: 16 * page, head_num: 2, profile, integrity: None };
    let (dev, host, _) = common::pools(device, &dc, &hc, Some(common::Fill { seed: 5, device: true, host: true }));
    Pools { dev, host }
}

fn snapshot(p: &Pools) -> Vec<Vec<u8>> {
    let g = p.dev.geometry();
    let mut out = Vec::new();
    for c in 0..g.kind().components() {
        out.push(p.host.read_buffer(c).unwrap());
        for s in 0..g.buffer_count() {
            out.push(p.dev.read_buffer(c, s).unwrap());
        }
    }
    out
}

/// Runs `f`, asserts it failed with `check`, and that nothing changed.
fn rejected(p: &mut Pools, what: &str, f: impl FnOnce(&mut Pools) -> Result<(), TransferError>, check: impl Fn(&TransferError) -> bool) {
    let before = snapshot(p);
    let err = f(p).expect_err(what);
    assert!(check(&err), "{what}: unexpected error {err:?}");
    assert!(snapshot(p) == before, "{what}: a rejected call changed a buffer");
}

fn unchanged_ok(p: &mut Pools, what: &str, f: impl FnOnce(&mut Pools) -> Result<(), TransferError>) {
    let before = snapshot(p);
    f(p).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(snapshot(p) == before, "{what}: a no-op changed a buffer");
}

fn range(a: i64, b: i64) -> Vec<i64> {
    (a..b).collect()
}

#[test]
fn token_pools_reject_bad_indices() {
    for device in common::devices() {
        let n = device.name();
        for (kind, layout, io) in [
            (PoolKind::Mha, Layout::PageFirst, IoBackend::Kernel),
            (PoolKind::Mha, Layout::LayerFirst, IoBackend::Direct),
            (PoolKind::Mla, Layout::PageFirstDirect, IoBackend::Direct),
            (PoolKind::Mha, Layout::PageHead, IoBackend::Kernel),
        ] {
            let mut p = pools_of(&device, kind, layout, 64, 4, Profile::Extended, LayerMap::new(3));
            let host_slots = p.host.geometry().slots() as i64;
            let dev_slots = p.dev.geometry().slots() as i64;
            let tag = format!("{n} {kind} {layout} {io}");
            rejected(
                &mut p,
                &format!("{tag} length"),
                |p| p.host.load_to_device_per_layer(&mut p.dev, &range(0, 8), &range(0, 4), 1, io),
                |e| {
                    matches!(e, TransferError::LengthMismatch { src_len: 8, dst_len: 4 })
                        && e.to_string() == "Source and destination indices must have the same length"
                },
            );
            // Out of range in the last page only: no partial write of the earlier pages.
            let mut hi = range(0, 8);
            hi.extend(range(host_slots, host_slots + 4));
            rejected(
                &mut p,
                &format!("{tag} host range"),
                |p| p.host.load_to_device_per_layer(&mut p.dev, &hi, &range(0, 12), 0, io),
                |e| matches!(e, TransferError::IndexOutOfRange { side: "host", position: 8, .. }),
            );
            rejected(
                &mut p,
                &format!("{tag} device range"),
                |p| p.host.backup_from_device_all_layer(&p.dev, &range(0, 4), &range(dev_slots - 2, dev_slots + 2), io),
                |e| matches!(e, TransferError::IndexOutOfRange { side: "device", position: 2, .. }),
            );
            rejected(
                &mut p,
                &format!("{tag} duplicate destination"),
                |p| p.host.backup_from_device_all_layer(&p.dev, &[4, 5, 6, 7, 4, 5, 6, 7], &range(0, 8), io),
                |e| matches!(e, TransferError::DuplicateDestination { side: "host", index: 4, first: 0, second: 4, .. }),
            );
            rejected(
                &mut p,
                &format!("{tag} layer"),
                |p| p.host.load_to_device_per_layer(&mut p.dev, &range(0, 4), &range(0, 4), 3, io),
                |e| matches!(e, TransferError::LayerOutOfRange { layer_id: 3, .. }),
            );
            rejected(
                &mut p,
                &format!("{tag} draft layer without drafts"),
                |p| p.host.load_draft_to_device(&mut p.dev, &range(0, 4), &range(0, 4), 3, io),
                |e| matches!(e, TransferError::LayerOutOfRange { layer_id: 3, draft_layers: 0, .. }),
            );
            if io == IoBackend::Direct {
                rejected(
                    &mut p,
                    &format!("{tag} count not a page multiple"),
                    |p| p.host.load_to_device_per_layer(&mut p.dev, &range(0, 3), &range(0, 3), 0, io),
                    |e| e.to_string() == "Source indices size must be divisible by page size",
                );
            }
            if layout == Layout::PageFirstDirect {
                rejected(
                    &mut p,
                    &format!("{tag} unaligned page"),
                    |p| p.host.load_to_device_per_layer(&mut p.dev, &range(2, 6), &range(0, 4), 0, io),
                    |e| matches!(e, TransferError::NotWholePage { side: "host", start: 2, .. }),
                );
                rejected(
                    &mut p,
                    &format!("{tag} non-contiguous page"),
                    |p| p.host.load_to_device_per_layer(&mut p.dev, &range(0, 4), &[8, 9, 11, 10], 0, io),
                    |e| matches!(e, TransferError::NotWholePage { side: "device", .. }),
                );
            }
            let other = if layout == Layout::PageFirstDirect { IoBackend::Kernel } else { IoBackend::Direct };
            if layout != Layout::LayerFirst {
                rejected(
                    &mut p,
                    &format!("{tag} unsupported cell"),
                    |p| p.host.load_to_device_per_layer(&mut p.dev, &range(0, 4), &range(0, 4), 0, other),
                    |e| e.to_string() == format!("Unsupported layout: {layout}"),
                );
            }
            unchanged_ok(&mut p, &format!("{tag} empty"), |p| p.host.load_to_device_per_layer(&mut p.dev, &[], &[], 0, io));
            unchanged_ok(&mut p, &format!("{tag} all negative"), |p| {
                p.host.backup_from_device_all_layer(&p.dev, &[-1, -1, -1, -1], &range(0, 4), io)
            });
        }
    }
}

#[test]
fn dsa_and_sharded_pools() {
    for device in common::devices() {
        let n = device.name();
        let mut layers = LayerMap::new(4);
        layers.layer_shard = Some((1, 3));
        layers.skipped[2] = true;
        layers.drafts = 1;
        // DSA indexer, P = 4 tokens per page, 16 B per token: 64 B pages.
        let mut p = pools_of(&device, PoolKind::DsaIndexer, Layout::PageFirst, 16, 4, Profile::Sglang, layers.clone());
        rejected(
            &mut p,
            &format!("{n} dsa unaligned count"),
            |p| p.host.load_to_device_per_layer(&mut p.dev, &range(0, 6), &range(0, 6), 1, IoBackend::Kernel),
            |e| e.to_string() == "Index buffer transfer expects page-aligned indices for DSA.",
        );
        rejected(
            &mut p,
            &format!("{n} dsa non-contiguous page"),
            |p| p.host.load_to_device_per_layer(&mut p.dev, &[4, 5, 6, 8], &range(0, 4), 1, IoBackend::Kernel),
            |e| matches!(e, TransferError::NotWholePage { side: "host", .. }),
        );
        rejected(
            &mut p,
            &format!("{n} seed: sharded direct page_first (sglang)"),
            |p| p.host.backup_from_device_all_layer(&p.dev, &range(0, 4), &range(0, 4), IoBackend::Direct),
            |e| e.to_string() == "Layer-sharded direct DSA indexer backup only supports layer_first layout, got page_first",
        );
        rejected(
            &mut p,
            &format!("{n} sharded kernel page_first (sglang)"),
            |p| p.host.backup_from_device_all_layer(&p.dev, &range(0, 4), &range(0, 4), IoBackend::Kernel),
            |e| matches!(e, TransferError::ShardedDsaPageFirst),
        );
        // Not owned (layer 0) and skip-topk (layer 2): sglang returns without copying.
        unchanged_ok(&mut p, &format!("{n} not owned"), |p| {
            p.host.load_to_device_per_layer(&mut p.dev, &range(0, 4), &range(0, 4), 0, IoBackend::Kernel)
        });
        unchanged_ok(&mut p, &format!("{n} skip-topk"), |p| {
            p.host.load_to_device_per_layer(&mut p.dev, &range(0, 4), &range(0, 4), 2, IoBackend::Kernel)
        });

        // sglang's 8-byte kernel check on a token pool (MLA record of 12 B).
        let mut q = pools_of(&device, PoolKind::Mla, Layout::LayerFirst, 12, 4, Profile::Sglang, LayerMap::new(2));
        rejected(
            &mut q,
            &format!("{n} item not a multiple of 8"),
            |p| p.host.load_to_device_per_layer(&mut p.dev, &range(0, 4), &range(0, 4), 0, IoBackend::Kernel),
            |e| e.to_string() == "Item byte size must be divisible by 8",
        );
        // MHA has no sharded path in sglang.
        let mut r = pools_of(&device, PoolKind::Mha, Layout::LayerFirst, 16, 4, Profile::Sglang, layers.clone());
        rejected(
            &mut r,
            &format!("{n} mha sharded (sglang)"),
            |p| p.host.backup_from_device_all_layer(&p.dev, &range(0, 4), &range(0, 4), IoBackend::Kernel),
            |e| matches!(e, TransferError::ShardedUnsupportedPool { kind: PoolKind::Mha }),
        );
    }
}

#[test]
fn buffers_and_pairs_are_checked() {
    for device in common::devices() {
        let n = device.name();
        let mut p = pools_of(&device, PoolKind::Mla, Layout::PageFirst, 32, 4, Profile::Extended, LayerMap::new(2));
        let q = pools_of(&device, PoolKind::Mla, Layout::PageFirst, 32, 4, Profile::Extended, LayerMap::new(3));
        let before = snapshot(&p);
        let e = p.host.backup_from_device_all_layer(&q.dev, &range(0, 4), &range(0, 4), IoBackend::Kernel).unwrap_err();
        assert!(matches!(e, TransferError::PoolMismatch(_)), "{n}: {e:?}");
        let e = p.host.write_buffer(0, &[0u8; 3]).unwrap_err();
        assert!(matches!(e, TransferError::BufferSize { .. }) || e.to_string().contains("bytes"), "{n}: {e:?}");
        let e = p.dev.write_buffer(0, 9, &[0u8; 4]).unwrap_err();
        assert!(matches!(e, TransferError::NoSuchBuffer { .. }), "{n}: {e:?}");
        assert!(snapshot(&p) == before, "{n}");
    }
}

/// A backend limit reaches the planner as a capability: wgpu copies need 4-byte alignment, so a
/// 6-byte item is rejected for `direct` there (and accepted on cpu), before anything moves.
#[test]
fn wgpu_direct_alignment_is_a_planner_decision() {
    for device in common::devices() {
        let mut p = pools_of(&device, PoolKind::Mla, Layout::LayerFirst, 6, 4, Profile::Extended, LayerMap::new(2));
        let call = |p: &mut Pools| p.host.load_to_device_per_layer(&mut p.dev, &range(0, 4), &range(4, 8), 1, IoBackend::Direct);
        if device.capabilities().direct_align > 1 {
            rejected(&mut p, "wgpu 6-byte direct", call, |e| matches!(e, TransferError::Misaligned { value: 6, required: 4, .. }));
        } else {
            call(&mut p).unwrap();
        }
    }
}
