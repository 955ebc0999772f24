//! `backup_from_device_per_layer`: one layer's backup, on every executor, byte for byte with
//! the oracle, in every cell of the layer-sharded backup's row; it writes only that layer, and
//! profile `sglang` refuses it where sglang's sharded backup is refused (the seed message).

mod common;

use hicache_io::plan::TableOp;
use hicache_io::tools::check::{random_case, run_case, supported_cells, Outcome, Rng};
use hicache_io::{Device, DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, LayerMap, Layout, Op, PoolKind, Profile};

#[test]
fn per_layer_backups_match_the_oracle_in_every_cell() {
    for device in common::devices() {
        let mut rng = Rng::new(41);
        let mut ran = 0;
        for cell in supported_cells(Profile::Extended).into_iter().filter(|c| c.op == TableOp::ShardedBackup) {
            for _ in 0..6 {
                let mut case = random_case(cell, Profile::Extended, &mut rng);
                let m = &case.device.layers;
                let (start, end) = m.owned();
                case.op = if m.drafts > 0 && rng.chance(30) {
                    Op::BackupLayer { layer_id: m.layer_num + rng.below(m.drafts as u64) as usize, is_draft: true }
                } else {
                    Op::BackupLayer { layer_id: start + rng.below((end - start) as u64) as usize, is_draft: false }
                };
                match run_case(&device, &case).unwrap() {
                    Outcome::Match { .. } => ran += 1,
                    other => panic!("{} {cell} {:?}: {other:?}", device.name(), case.op),
                }
            }
        }
        assert!(ran >= 60, "{}: only {ran} cases ran", device.name());
    }
}

/// The seed: a DSA indexer pool backed up into page_first one layer at a time.
fn dsa_pools(device: &Device, profile: Profile) -> (DevicePool<'static>, HostPool<'static>) {
    let dev = DevicePool::new(
        device,
        &DevicePoolConfig { kind: PoolKind::DsaIndexer, bytes_per_token: 132, slots: 8, page_size: 4, layers: LayerMap::new(3) },
    )
    .unwrap();
    let host = HostPool::new(&dev, &HostPoolConfig { layout: Layout::PageFirst, size: 32, head_num: 1, profile, integrity: None }).unwrap();
    (dev, host)
}

#[test]
fn one_layer_is_written_and_no_other() {
    for device in common::devices() {
        let (mut dev, mut host) = dsa_pools(&device, Profile::Extended);
        for slot in 0..3 {
            dev.write_buffer(0, slot, &vec![10 + slot as u8; dev.geometry().layer_bytes() as usize]).unwrap();
        }
        let hi: Vec<i64> = (8..12).collect();
        let di: Vec<i64> = (4..8).collect();
        host.backup_from_device_per_layer(&dev, &hi, &di, 1, false, IoBackend::Kernel).unwrap();
        let h = host.read_buffer(0).unwrap();
        let g = host.geometry();
        let (item, dim) = (g.item_bytes() as usize, g.layout_dim() as usize);
        // Host page 2 (tokens 8..12) holds layer 1's bytes; layers 0 and 2 of it stay zero.
        let page = &h[2 * dim..3 * dim];
        assert!(page[..item].iter().all(|&b| b == 0), "{}: layer 0 written", device.name());
        assert!(page[item..2 * item].iter().all(|&b| b == 11), "{}: layer 1 not written", device.name());
        assert!(page[2 * item..].iter().all(|&b| b == 0), "{}: layer 2 written", device.name());
        assert_eq!(h.iter().filter(|&&b| b != 0).count(), item, "{}: bytes outside the page written", device.name());
    }
}

#[test]
fn profile_sglang_refuses_it_with_the_seed_message() {
    let (dev, mut host) = dsa_pools(&Device::cpu(), Profile::Sglang);
    let before = host.read_buffer(0).unwrap();
    let hi: Vec<i64> = (8..12).collect();
    let di: Vec<i64> = (4..8).collect();
    let err = host.backup_from_device_per_layer(&dev, &hi, &di, 1, false, IoBackend::Kernel).unwrap_err();
    assert_eq!(
        err.to_string(),
        "Layer-sharded DSA indexer HiCache backup with page_first layout is not supported without a per-layer LF->PF kernel."
    );
    let err = host.backup_from_device_per_layer(&dev, &hi, &di, 1, false, IoBackend::Direct).unwrap_err();
    assert_eq!(err.to_string(), "Layer-sharded direct DSA indexer backup only supports layer_first layout, got page_first");
    assert_eq!(host.read_buffer(0).unwrap(), before);
    // A layer id past the model is an error, not a no-op.
    assert!(host.backup_from_device_per_layer(&dev, &hi, &di, 3, false, IoBackend::Kernel).is_err());
}
