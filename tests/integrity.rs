//! Item checksums: recorded by the copies of backups, verified by the copies of loads, with an
//! independent computation of what each item's checksum must be (the item's bytes on the
//! device, keyed from `integrity::STORAGE_SEED`), and every way an item can go bad detected.

mod common;

use hicache_io::integrity::{self, Keys, STORAGE_SEED};
use hicache_io::rng::Rng;
use hicache_io::{
    Device, DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, LayerMap, Layout, PoolKind, Profile, TransferError,
};

const SLOTS: u64 = 32;

/// Pools of `kind` in `layout` with `heads` heads a token, the device's bytes random.
fn checked_pools(
    device: &Device,
    kind: PoolKind,
    layout: Layout,
    heads: u64,
    integrity: Option<bool>,
    profile: Profile,
) -> (DevicePool<'static>, HostPool<'static>) {
    let bytes_per_token = match kind {
        PoolKind::DsaIndexer => 132,
        _ => 64 * heads,
    };
    let (slots, page_size) = match kind {
        PoolKind::DsaIndexer => (8, 4),
        _ => (SLOTS, 4),
    };
    let mut layers = LayerMap::new(3);
    layers.drafts = 1;
    let dc = DevicePoolConfig { kind, bytes_per_token, slots, page_size, layers };
    let hc = HostPoolConfig { layout, size: 64, head_num: heads, profile, integrity };
    let (dev, host, _) = common::pools(device, &dc, &hc, Some(common::Fill { seed: 5, device: true, host: false }));
    (dev, host)
}

/// The checksum an item must have: its bytes on the device, independently keyed.
fn expected(dev: &DevicePool, comp: usize, slot: usize, index: u64) -> u64 {
    let item = dev.geometry().item_bytes() as usize;
    let bytes = dev.read_buffer(comp, slot).unwrap();
    let keys = Keys::new(STORAGE_SEED, item / 4 + 1).unwrap();
    integrity::checksum(&bytes[index as usize * item..][..item], &keys)
}

/// A plain call's result once its work is done: cpu and wgpu report a load's mismatches from
/// the call itself; cuda's calls return once enqueued, and the next synchronize reports them.
fn landed(device: &Device, r: Result<(), TransferError>) -> Result<(), TransferError> {
    r.and_then(|_| device.synchronize())
}

fn tokens(units: &[u64], p: u64, dsa: bool) -> Vec<i64> {
    if dsa {
        units.iter().flat_map(|u| (u * p..(u + 1) * p).map(|t| t as i64)).collect()
    } else {
        units.iter().map(|&u| u as i64).collect()
    }
}

#[test]
fn backups_record_each_items_checksum_and_loads_verify_it() {
    for device in common::devices() {
        let name = device.name();
        for (kind, layout, heads) in [
            (PoolKind::Mha, Layout::PageFirst, 1),
            (PoolKind::Mha, Layout::LayerFirst, 1),
            // 128, 256 and 512-byte items in one chunk (the cpu executor's register-keyed
            // paths, as 64 B).
            (PoolKind::Mha, Layout::LayerFirst, 2),
            (PoolKind::Mha, Layout::PageFirst, 2),
            (PoolKind::Mha, Layout::LayerFirst, 4),
            (PoolKind::Mha, Layout::PageFirst, 8),
            (PoolKind::Mha, Layout::PageHead, 4),
            (PoolKind::Mha, Layout::PageFirstDirectHeadGroups, 2),
            (PoolKind::Mla, Layout::PageFirst, 1),
            (PoolKind::DsaIndexer, Layout::LayerFirst, 1),
            (PoolKind::DsaIndexer, Layout::PageFirst, 1),
        ] {
            let (mut dev, mut host) = checked_pools(&device, kind, layout, heads, None, Profile::Extended);
            assert!(host.integrity_enabled(), "{name} {kind:?} {layout}");
            let dsa = kind == PoolKind::DsaIndexer;
            let (hu, du): (Vec<u64>, Vec<u64>) = if dsa { (vec![3, 5], vec![1, 6]) } else { ((8..16).collect(), (20..28).collect()) };
            let p = dev.geometry().page_size();
            host.backup_from_device_all_layer(&dev, &tokens(&hu, p, dsa), &tokens(&du, p, dsa), IoBackend::Kernel).unwrap();
            for c in 0..kind.components() {
                for layer in 0..4u64 {
                    for (h, d) in hu.iter().zip(&du) {
                        let want = expected(&dev, c, layer as usize, *d);
                        assert_eq!(
                            host.item_checksum(*h, layer, c as u8).unwrap(),
                            Some(want),
                            "{name} {kind:?} {layout} c{c} L{layer} item {h}"
                        );
                    }
                }
            }
            // Never backed up: unknown.
            assert_eq!(host.item_checksum(0, 0, 0).unwrap(), None);
            let stats = host.integrity_stats().unwrap();
            assert_eq!(stats.recorded, hu.len() as u64 * 4 * kind.components() as u64);
            // Loads back into other slots verify every item.
            let back: Vec<u64> = if dsa { vec![0, 2] } else { (0..8).collect() };
            host.load_to_device_per_layer(&mut dev, &tokens(&hu, p, dsa), &tokens(&back, p, dsa), 1, IoBackend::Kernel).unwrap();
            let stats = host.integrity_stats().unwrap();
            assert_eq!((stats.verified, stats.unverified, stats.mismatched), (hu.len() as u64 * kind.components() as u64, 0, 0));
        }
    }
}

#[test]
fn a_corrupted_byte_fails_the_load_naming_the_item_and_the_rest_lands() {
    // Items of 64 to 512 B (each a register-keyed size on cpu), one bit flipped in their last block.
    for (device, heads) in common::devices().into_iter().flat_map(|d| [1, 2, 4, 8].map(|h| (d.clone(), h))) {
        let name = format!("{} {heads}", device.name());
        let (mut dev, mut host) = checked_pools(&device, PoolKind::Mha, Layout::PageFirst, heads, None, Profile::Extended);
        let hi: Vec<i64> = (8..16).collect();
        let di: Vec<i64> = (20..28).collect();
        host.backup_from_device_all_layer(&dev, &hi, &di, IoBackend::Kernel).unwrap();
        let g = host.geometry().clone();
        // One bit of host item 11, layer 2, V.
        let off = g.addr(1, 2).offset(11, 0) + g.item_bytes() - 15;
        let before = host.read_buffer(1).unwrap()[off as usize];
        host.inject_host_corruption(1, off, &[before ^ 0x10]).unwrap();
        let back: Vec<i64> = (0..8).collect();
        let err = landed(&device, host.load_to_device_per_layer(&mut dev, &hi, &back, 2, IoBackend::Kernel)).unwrap_err();
        match &err {
            TransferError::Integrity { layer, host_index, device_index, items, .. } => {
                assert_eq!((*layer, *host_index, *device_index), (2, 11, 3));
                assert_eq!(items.len(), 1);
                assert_eq!(items[0].component, 1);
            }
            other => panic!("{name}: {other:?}"),
        }
        assert!(err.to_string().contains("host item 11 of layer 2"), "{name}: {err}");
        // Every item landed, the bad one as it was read.
        let h = host.read_buffer(1).unwrap();
        let d = dev.read_buffer(1, 2).unwrap();
        let item = g.item_bytes() as usize;
        for (k, &s) in hi.iter().enumerate() {
            let o = g.addr(1, 2).offset(s as u64, 0) as usize;
            assert_eq!(&d[k * item..][..item], &h[o..o + item]);
        }
        // K of the same layer had no fault.
        landed(&device, host.load_to_device_per_layer(&mut dev, &hi[..3], &back[..3], 2, IoBackend::Kernel)).unwrap();
    }
}

#[test]
fn corrupted_checksums_swapped_and_replayed_pages_are_detected() {
    for device in common::devices() {
        let name = device.name();
        let (mut dev, mut host) = checked_pools(&device, PoolKind::Mha, Layout::PageFirst, 1, None, Profile::Extended);
        let hi: Vec<i64> = (8..16).collect();
        let di: Vec<i64> = (20..28).collect();
        host.backup_from_device_all_layer(&dev, &hi, &di, IoBackend::Kernel).unwrap();
        let back: Vec<i64> = (0..8).collect();
        // A table entry.
        assert!(host.inject_checksum_corruption(9, 0, 0, 1 << 40).unwrap());
        let err = landed(&device, host.load_to_device_per_layer(&mut dev, &hi, &back, 0, IoBackend::Kernel)).unwrap_err();
        assert!(matches!(err, TransferError::Integrity { host_index: 9, layer: 0, .. }), "{name}: {err:?}");
        host.backup_from_device_all_layer(&dev, &hi, &di, IoBackend::Kernel).unwrap();
        // Two pages swapped (pages 2 and 3: tokens 8..12 and 12..16).
        let (a, b) = (host.get_data_page(8).unwrap(), host.get_data_page(12).unwrap());
        let page_spans = |host: &HostPool, i: i64| host.get_page_buffer_meta(&(i..i + 4).collect::<Vec<_>>()).unwrap();
        for (src, dst) in [(&a, 12i64), (&b, 8)] {
            let mut at = 0;
            for (c, off, len) in page_spans(&host, dst) {
                host.inject_host_corruption(c, off, &src[at..at + len as usize]).unwrap();
                at += len as usize;
            }
        }
        let err = landed(&device, host.load_to_device_per_layer(&mut dev, &hi, &back, 1, IoBackend::Kernel)).unwrap_err();
        let TransferError::Integrity { items, .. } = &err else { panic!("{name}: {err:?}") };
        assert_eq!(items.len(), 16, "8 tokens × K and V");
        // An older page replayed over a newer backup.
        host.backup_from_device_all_layer(&dev, &hi, &di, IoBackend::Kernel).unwrap();
        let old = host.get_data_page(8).unwrap();
        let mut data = dev.read_buffer(0, 3).unwrap();
        data[20 * 64] ^= 0xff;
        dev.write_buffer(0, 3, &data).unwrap();
        host.backup_from_device_all_layer(&dev, &hi, &di, IoBackend::Kernel).unwrap();
        let mut at = 0;
        for (c, off, len) in page_spans(&host, 8) {
            host.inject_host_corruption(c, off, &old[at..at + len as usize]).unwrap();
            at += len as usize;
        }
        let err = landed(&device, host.load_draft_to_device(&mut dev, &hi, &back, 3, IoBackend::Kernel)).unwrap_err();
        assert!(matches!(err, TransferError::Integrity { host_index: 8, layer: 3, .. }), "{name}: {err:?}");
    }
}

#[test]
fn direct_copies_record_and_verify_where_they_can() {
    // Items of 64 to 512 B (each a register-keyed size on cpu).
    for (device, heads) in common::devices().into_iter().flat_map(|d| [1, 2, 4, 8].map(|h| (d.clone(), h))) {
        let name = format!("{} {heads}", device.name());
        let (mut dev, mut host) = checked_pools(&device, PoolKind::Mha, Layout::LayerFirst, heads, None, Profile::Extended);
        let hi: Vec<i64> = (8..16).chain(20..24).collect();
        let di: Vec<i64> = (20..28).chain(4..8).collect();
        let back: Vec<i64> = (0..12).collect();
        if !device.capabilities().direct_checksums {
            // Recorded by a kernel backup, then overwritten by direct copies that cannot sum:
            // forgotten, and read back unverified (never as corrupt).
            host.backup_from_device_all_layer(&dev, &hi, &di, IoBackend::Kernel).unwrap();
            let mut data = dev.read_buffer(0, 1).unwrap();
            data.iter_mut().for_each(|b| *b ^= 0x33);
            dev.write_buffer(0, 1, &data).unwrap();
            host.backup_from_device_all_layer(&dev, &hi, &di, IoBackend::Direct).unwrap();
            assert!(hi.iter().all(|h| host.item_checksum(*h as u64, 1, 0).unwrap().is_none()), "{name}");
            let before = host.integrity_stats().unwrap();
            host.load_to_device_per_layer(&mut dev, &hi, &back, 1, IoBackend::Direct).unwrap();
            host.load_to_device_per_layer(&mut dev, &hi, &back, 1, IoBackend::Kernel).unwrap();
            let after = host.integrity_stats().unwrap();
            assert_eq!((after.unverified - before.unverified, after.mismatched), (2 * 2 * hi.len() as u64, 0), "{name}");
            continue;
        }
        host.backup_from_device_all_layer(&dev, &hi, &di, IoBackend::Direct).unwrap();
        for (h, d) in hi.iter().zip(&di) {
            assert_eq!(host.item_checksum(*h as u64, 2, 1).unwrap(), Some(expected(&dev, 1, 2, *d as u64)), "{name} item {h}");
        }
        let off = host.geometry().addr(0, 1).offset(21, 0) + host.geometry().item_bytes() - 4;
        host.inject_host_corruption(0, off, &[0x5a]).unwrap();
        let err = landed(&device, host.load_to_device_per_layer(&mut dev, &hi, &back, 1, IoBackend::Direct)).unwrap_err();
        assert!(matches!(err, TransferError::Integrity { host_index: 21, device_index: 9, layer: 1, .. }), "{name}: {err:?}");
        host.load_to_device_per_layer(&mut dev, &hi, &back, 0, IoBackend::Direct).unwrap();
    }
}

#[test]
fn writes_without_checksums_leave_items_unverified_never_corrupt() {
    for device in common::devices() {
        let name = device.name();
        let (mut dev, mut host) = checked_pools(&device, PoolKind::Mha, Layout::LayerFirst, 1, None, Profile::Extended);
        let hi: Vec<i64> = (8..16).collect();
        let di: Vec<i64> = (20..28).collect();
        host.backup_from_device_all_layer(&dev, &hi, &di, IoBackend::Kernel).unwrap();
        // New device bytes backed up by a plan made for a pool without checksums (same geometry):
        // its copies compute none, so the old ones are forgotten, not left stale.
        let mut data = dev.read_buffer(0, 0).unwrap();
        data.iter_mut().for_each(|b| *b = b.wrapping_add(1));
        dev.write_buffer(0, 0, &data).unwrap();
        let plain = HostPool::new(
            &dev,
            &HostPoolConfig { layout: Layout::LayerFirst, size: 64, head_num: 1, profile: Profile::Extended, integrity: Some(false) },
        )
        .unwrap();
        let req = hicache_io::Request { op: hicache_io::Op::Backup, io_backend: IoBackend::Kernel, host_indices: &hi, device_indices: &di };
        let plan = plain.plan(&dev, &req).unwrap();
        assert!(!plan.is_checksummed());
        host.execute_backup(&dev, &plan).unwrap();
        assert_eq!(host.item_checksum(8, 0, 0).unwrap(), None, "{name}");
        let back: Vec<i64> = (0..8).collect();
        host.load_to_device_per_layer(&mut dev, &hi, &back, 0, IoBackend::Kernel).unwrap();
        assert_eq!(host.integrity_stats().unwrap().unverified, 16);
        // A whole-buffer write forgets every checksum.
        host.backup_from_device_all_layer(&dev, &hi, &di, IoBackend::Kernel).unwrap();
        let raw = host.read_buffer(0).unwrap();
        host.write_buffer(0, &raw).unwrap();
        assert_eq!(host.item_checksum(8, 1, 1).unwrap(), None);
        host.load_to_device_per_layer(&mut dev, &hi, &back, 1, IoBackend::Kernel).unwrap();
    }
}

#[test]
fn sglang_profile_is_off_unless_asked_and_extended_can_opt_out() {
    for device in common::devices() {
        let name = device.name();
        let (_, host) = checked_pools(&device, PoolKind::Mha, Layout::PageFirst, 1, None, Profile::Sglang);
        assert!(!host.integrity_enabled(), "{name}");
        let (_, host) = checked_pools(&device, PoolKind::Mha, Layout::PageFirst, 1, Some(true), Profile::Sglang);
        assert!(host.integrity_enabled(), "{name}");
        let (mut dev, mut host) = checked_pools(&device, PoolKind::Mha, Layout::PageFirst, 1, Some(false), Profile::Extended);
        assert!(!host.integrity_enabled(), "{name}");
        assert_eq!(host.integrity_stats(), None, "{name}");
        let hi: Vec<i64> = (8..16).collect();
        host.backup_from_device_all_layer(&dev, &hi, &hi, IoBackend::Kernel).unwrap();
        host.inject_host_corruption(0, 0, &[1]).unwrap();
        landed(&device, host.load_to_device_per_layer(&mut dev, &hi, &hi, 0, IoBackend::Kernel)).unwrap();
    }
}

#[test]
fn asynchronous_and_layer_wise_loads_report_at_completion() {
    for device in common::devices() {
        let name = device.name();
        let (mut dev, mut host) = checked_pools(&device, PoolKind::Mla, Layout::LayerFirst, 1, None, Profile::Extended);
        let hi: Vec<i64> = (8..16).collect();
        host.backup_from_device_all_layer(&dev, &hi, &hi, IoBackend::Kernel).unwrap();
        let off = host.geometry().addr(0, 1).offset(12, 0);
        host.inject_host_corruption(0, off, &[0xAA, 0x55]).unwrap();
        let t = host.load_to_device_per_layer_async(&mut dev, &hi, &hi, 1, IoBackend::Kernel).unwrap();
        assert!(matches!(t.wait(), Err(TransferError::Integrity { host_index: 12, layer: 1, .. })));
        let loads = host.load_layers(&mut dev, &hi, &hi, IoBackend::Kernel).unwrap();
        loads.wait_layer(0).unwrap();
        assert!(matches!(loads.wait_layer(1), Err(TransferError::Integrity { .. })));
        loads.wait_layer(2).unwrap_or_else(|e| panic!("{name}: layer 2 is sound: {e}"));
        drop(loads);
        // Waiting for all of them reports layer 1's item, though the last layer (the draft) is sound.
        let all = host.load_layers(&mut dev, &hi, &hi, IoBackend::Kernel).unwrap().wait();
        assert!(matches!(all, Err(TransferError::Integrity { host_index: 12, layer: 1, .. })), "{name}: {all:?}");
    }
}

#[test]
fn pages_carry_their_checksums_through_storage() {
    for device in common::devices() {
        let name = device.name();
        let (dev, mut host) = checked_pools(&device, PoolKind::Mha, Layout::PageHead, 2, None, Profile::Extended);
        let hi: Vec<i64> = (8..16).collect();
        host.backup_from_device_all_layer(&dev, &hi, &hi, IoBackend::Kernel).unwrap();
        let page = host.get_data_page(12).unwrap();
        let sums = host.page_checksums(12).unwrap();
        assert_eq!(sums.len(), 4 * 4 * 2);
        assert!(sums.iter().all(|s| s.is_some()));
        // Another pool (another machine) takes the page with its checksums.
        let (_, mut other) = checked_pools(&device, PoolKind::Mha, Layout::PageHead, 2, None, Profile::Extended);
        other.set_from_flat_data_page_checked(20, &page, &sums).unwrap();
        assert_eq!(other.page_checksums(20).unwrap(), sums);
        // A page damaged on the way is refused item by item; its checksums are forgotten.
        let mut bad = page.clone();
        bad[100] ^= 4;
        let err = other.set_from_flat_data_page_checked(24, &bad, &sums).unwrap_err();
        let TransferError::Integrity { items, .. } = &err else { panic!("{name}: {err:?}") };
        assert_eq!(items.len(), 1);
        assert_eq!(other.page_checksums(24).unwrap().iter().filter(|s| s.is_none()).count(), 1);
        // The plain setter records what it wrote; a wrong-length checksum list is refused.
        other.set_from_flat_data_page(28, &bad).unwrap();
        assert!(other.page_checksums(28).unwrap().iter().all(|s| s.is_some()));
        assert!(matches!(other.set_from_flat_data_page_checked(28, &page, &sums[1..]), Err(TransferError::BufferSize { .. })));
        // A page from a pool without checksums carries none: taken as unverified.
        let (_, plain) = checked_pools(&device, PoolKind::Mha, Layout::PageHead, 2, Some(false), Profile::Extended);
        assert!(plain.page_checksums(12).unwrap().is_empty());
        other.set_from_flat_data_page_checked(28, &page, &[]).unwrap();
        assert!(other.page_checksums(28).unwrap().iter().all(|s| s.is_none()));
    }
}

#[test]
fn injected_faults_are_all_detected_and_nothing_else_is_raised() {
    for device in common::devices() {
        let name = device.name();
        let t = hicache_io::tools::inject::inject_device(&device, 7, 500, |_| {});
        assert!(t.verified);
        assert!(t.clean(), "{name}: {t:?}");
        assert_eq!(t.detected + t.harmless, t.total(), "{name}: {t:?}");
        assert!(t.total() >= 500 && t.injected.iter().all(|&n| n >= 50), "{name}: {t:?}");
    }
}

#[test]
fn check_compares_recorded_checksums_with_the_oracle() {
    for device in common::devices() {
        let name = device.name();
        let rows = hicache_io::tools::check::check_device(&device, Profile::Extended, 3, 2, |_, _| {}).unwrap();
        assert!(rows.iter().all(|(_, t)| t.matched == t.cases), "{name}: {rows:?}");
        let sums: u64 = rows.iter().map(|(_, t)| t.checksums).sum();
        assert!(sums > 100, "{name}: only {sums} checksums compared");
    }
}

/// A backup whose copies cannot checksum (wgpu's `direct`) settles its items in queue order
/// without waiting for the transfers queued before it: an engine's pipeline keeps running. The
/// kernel backup queued first records the shared items, the direct one then forgets them, and a
/// load reads them unverified, never as corrupt.
#[test]
fn backups_that_cannot_checksum_do_not_wait_and_forget_in_order() {
    for device in common::devices() {
        let name = device.name();
        // 2 layers × 4096 slots × 16 KiB: a 128 MiB kernel backup, long enough to be in flight.
        let slots = 4096u64;
        let cfg = DevicePoolConfig { kind: PoolKind::Mla, bytes_per_token: 16384, slots, page_size: 1, layers: LayerMap::new(2) };
        let mut dev = DevicePool::new(&device, &cfg).unwrap();
        let mut rng = Rng::new(9);
        for b in 0..2 {
            let mut data = vec![0u8; dev.geometry().layer_bytes() as usize];
            rng.fill(&mut data);
            dev.write_buffer(0, b, &data).unwrap();
        }
        let hcfg = HostPoolConfig { layout: Layout::LayerFirst, size: slots, head_num: 1, profile: Profile::Extended, integrity: None };
        let mut host = HostPool::new(&dev, &hcfg).unwrap();
        let all: Vec<i64> = (0..slots as i64).collect();
        let (shared, from): (Vec<i64>, Vec<i64>) = ((0..8).collect(), (100..108).collect());
        {
            let mut pipe = host.pipeline(&mut dev).unwrap();
            let big = pipe.backup(&all, &all, IoBackend::Kernel).unwrap();
            let small = pipe.backup(&shared, &from, IoBackend::Direct).unwrap();
            assert!(!pipe.is_done(big).unwrap(), "{name}: the direct backup waited for the kernel backup queued before it");
            pipe.wait(small).unwrap();
            pipe.wait(big).unwrap();
            pipe.finish().unwrap();
        }
        let before = host.integrity_stats().unwrap();
        host.load_to_device_per_layer(&mut dev, &shared, &shared, 0, IoBackend::Kernel).unwrap();
        let after = host.integrity_stats().unwrap();
        let direct_sums = device.capabilities().direct_checksums;
        let (verified, unverified) = (after.verified - before.verified, after.unverified - before.unverified);
        assert_eq!((verified, unverified, after.mismatched), if direct_sums { (8, 0, 0) } else { (0, 8, 0) }, "{name}");
        // The kernel backup's other items are recorded and verify.
        host.load_to_device_per_layer(&mut dev, &all[8..64], &all[8..64], 1, IoBackend::Kernel).unwrap();
        assert_eq!(host.integrity_stats().unwrap().verified - after.verified, 56, "{name}");
    }
}

/// A load's mismatches are reported by its own wait even while another thread polls the same
/// executor (and so may be the one that receives the load's readback): 300 loads of a damaged
/// item, each must fail.
#[test]
fn loads_report_mismatches_while_another_thread_polls_the_executor() {
    for device in common::devices() {
        let name = device.name();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let poller = {
            let (device, stop) = (device.clone(), stop.clone());
            std::thread::spawn(move || {
                let (mut dev, host) = checked_pools(&device, PoolKind::Mha, Layout::PageFirst, 1, None, Profile::Extended);
                let idx: Vec<i64> = (0..4).collect();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let t = host.load_to_device_per_layer_async(&mut dev, &idx, &idx, 0, IoBackend::Kernel).unwrap();
                    while !t.is_done().unwrap() {}
                }
            })
        };
        let (mut dev, mut host) = checked_pools(&device, PoolKind::Mha, Layout::PageFirst, 1, None, Profile::Extended);
        let hi: Vec<i64> = (8..16).collect();
        host.backup_from_device_all_layer(&dev, &hi, &hi, IoBackend::Kernel).unwrap();
        let off = host.geometry().addr(0, 0).offset(9, 0);
        host.inject_host_corruption(0, off, &[0x42 ^ host.read_buffer(0).unwrap()[off as usize]]).unwrap();
        let mut missed = 0;
        for _ in 0..300 {
            match landed(&device, host.load_to_device_per_layer(&mut dev, &hi, &hi, 0, IoBackend::Kernel)) {
                Err(TransferError::Integrity { host_index: 9, .. }) => {}
                Ok(()) => missed += 1,
                Err(e) => panic!("{name}: {e}"),
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        poller.join().unwrap();
        assert_eq!(missed, 0, "{name}: {missed} of 300 loads did not report the damaged item");
    }
}

/// Checksums settle in issue order across the two streams of a pipeline: each round backs items
/// up (pipeline backups run on the backup stream) and loads them back at once (the main stream,
/// ordered after the backup on the device where they share host slots), with nobody waiting in
/// between. Each load must verify against the backup just before it, never an older one, on
/// every executor (the simulated CUDA driver delays every stream op at random).
#[test]
fn settling_follows_issue_order_across_the_pipelines_streams() {
    for device in common::devices() {
        let name = device.name();
        let (mut dev, mut host) = checked_pools(&device, PoolKind::Mha, Layout::PageFirst, 1, None, Profile::Extended);
        let hi: Vec<i64> = (0..8).collect();
        let di: Vec<i64> = (16..24).collect();
        let back: Vec<i64> = (24..32).collect();
        let before = host.integrity_stats().unwrap();
        let mut rng = Rng::new(11);
        for round in 0..12 {
            // New bytes in the device slots the backup reads (a synchronous write).
            for c in 0..2 {
                let mut data = dev.read_buffer(c, 0).unwrap();
                rng.fill(&mut data[16 * 64..24 * 64]);
                dev.write_buffer(c, 0, &data).unwrap();
            }
            let mut pipe = host.pipeline(&mut dev).unwrap();
            let b = pipe.backup(&hi, &di, IoBackend::Kernel).unwrap();
            let l = pipe.load(&hi, &back, 0, IoBackend::Kernel).unwrap();
            pipe.wait(l).unwrap_or_else(|e| panic!("{name} round {round}: {e}"));
            pipe.wait(b).unwrap();
            pipe.finish().unwrap();
        }
        let after = host.integrity_stats().unwrap();
        assert_eq!((after.verified - before.verified, after.unverified - before.unverified, after.mismatched), (12 * 16, 0, 0), "{name}");
    }
}

#[test]
fn a_flipped_byte_in_any_head_chunk_fails_its_pages_item_check() {
    // What a put asks before it stores pages: pages_intact reads each layer's items of a page as
    // one region where the pool is in this process (one loop over an item's head chunks), and
    // chunk by chunk through the executor otherwise. A bit of every head chunk, in turn, of an
    // item in the middle of a page must fail that page, and only it.
    for device in common::devices() {
        for layout in [Layout::PageFirst, Layout::PageHead, Layout::PageFirstDirectHeadGroups, Layout::PageUnified] {
            for heads in [1, 2, 4] {
                let name = format!("{} {layout:?} {heads}", device.name());
                let (dev, mut host) = checked_pools(&device, PoolKind::Mha, layout, heads, None, Profile::Extended);
                // Pages 2..6 of 4 tokens.
                let hi: Vec<i64> = (8..24).collect();
                let di: Vec<i64> = (0..16).collect();
                host.backup_from_device_all_layer(&dev, &hi, &di, IoBackend::Kernel).unwrap();
                assert_eq!(host.pages_intact(&hi).unwrap(), vec![true; 4], "{name}");
                let g = host.geometry().clone();
                let buffer = g.buffer_of(1) as usize;
                for h in 0..g.head_num() {
                    // The last byte of head chunk `h` of host item 13 (page 3), layer 1, V.
                    let off = g.addr(1, 1).offset(13, h) + g.chunk_bytes() - 1;
                    let before = host.read_buffer(buffer).unwrap()[off as usize];
                    host.inject_host_corruption(buffer, off, &[before ^ 0x01]).unwrap();
                    assert_eq!(host.pages_intact(&hi).unwrap(), vec![true, false, true, true], "{name}: head {h}");
                    host.inject_host_corruption(buffer, off, &[before]).unwrap();
                    assert_eq!(host.pages_intact(&hi).unwrap(), vec![true; 4], "{name}: head {h} restored");
                }
            }
        }
    }
}

#[test]
fn staging_page_shares_checks_and_records_their_items_in_the_same_read() {
    // An L3 store's staging pass over head-split pages takes the items' sums from the copy's own
    // read (pieces of each item in each share): the objects' sums and the page verdicts must be
    // those of the separate calls, a flipped bit of any head must fail its page, and a landing
    // must record the items' checksums the backup recorded.
    use hicache_io::geometry::PageShare;
    use hicache_io::PageObjects;
    let device = Device::cpu();
    for layout in Layout::ALL {
        for heads in [2u64, 4] {
            let (dev, mut host) = checked_pools(&device, PoolKind::Mha, layout, heads, None, Profile::Extended);
            let g = host.geometry().clone();
            let (item, layers) = (g.item_bytes(), g.layer_num());
            // One share per head and component, then halves of the items cut at another layer.
            let per_head: Vec<PageShare> = (0..2u8)
                .flat_map(|comp| {
                    (0..heads).map(move |h| PageShare { comp, layers: (0, layers), bytes: (h * item / heads, (h + 1) * item / heads) })
                })
                .collect();
            let halves: Vec<PageShare> = (0..2u8)
                .flat_map(|comp| {
                    [(0, 1), (1, layers)]
                        .into_iter()
                        .flat_map(move |l| [(0, item / 2), (item / 2, item)].map(|b| PageShare { comp, layers: l, bytes: b }))
                })
                .collect();
            let hi: Vec<i64> = (8..24).collect();
            let di: Vec<i64> = (0..16).collect();
            let io = if layout == Layout::PageFirstDirect { IoBackend::Direct } else { IoBackend::Kernel };
            host.backup_from_device_all_layer(&dev, &hi, &di, io).unwrap();
            let recorded: Vec<_> = [8i64, 12, 16, 20].iter().map(|&p| host.page_checksums(p).unwrap()).collect();
            for shares in [&per_head, &halves] {
                let name = format!("{layout:?} {heads} heads, {} shares", shares.len());
                let objects = PageObjects::Shares(shares);
                let stride = (item * layers * 4).div_ceil(64) as usize * 64;
                let mut staging = vec![0u8; stride * shares.len() * 4];
                let (sums, intact) = host.stage_put(&hi, objects, STORAGE_SEED, &mut staging, stride).unwrap();
                assert_eq!(sums, host.object_sums(&hi, objects, STORAGE_SEED).unwrap(), "{name}");
                assert_eq!(intact, vec![true; 4], "{name}");
                // A bit of the last head's chunk of an item of page 3, layer 1, V.
                let buffer = g.buffer_of(1) as usize;
                let off = g.addr(1, 1).offset(13, g.head_num() - 1) + g.chunk_bytes() - 2;
                let byte = host.read_buffer(buffer).unwrap()[off as usize];
                host.inject_host_corruption(buffer, off, &[byte ^ 0x40]).unwrap();
                assert_eq!(
                    host.stage_put(&hi, objects, STORAGE_SEED, &mut staging, stride).unwrap().1,
                    vec![true, false, true, true],
                    "{name}"
                );
                host.inject_host_corruption(buffer, off, &[byte]).unwrap();
                host.stage_put(&hi, objects, STORAGE_SEED, &mut staging, stride).unwrap();
                // Landed into other pages: the same items, recorded from the landing's sums.
                let to: Vec<i64> = (40..56).collect();
                let all = vec![true; sums.len()];
                assert_eq!(host.land_staged(&to, objects, STORAGE_SEED, &staging, stride, &sums, &all, &all).unwrap(), sums, "{name}");
                for (k, &p) in [40i64, 44, 48, 52].iter().enumerate() {
                    assert_eq!(host.page_checksums(p).unwrap(), recorded[k], "{name}: page {p}");
                }
                // An object of page 44 not written (nor eligible): that page's items forgotten,
                // the others recorded as they landed.
                let mut some = all.clone();
                some[shares.len() + 1] = false;
                host.land_staged(&to, objects, STORAGE_SEED, &staging, stride, &sums, &some, &some).unwrap();
                for (k, &p) in [40i64, 44, 48, 52].iter().enumerate() {
                    let want = if p == 44 { vec![None; recorded[k].len()] } else { recorded[k].clone() };
                    assert_eq!(host.page_checksums(p).unwrap(), want, "{name}: page {p} after a partial landing");
                }
            }
        }
    }
}
