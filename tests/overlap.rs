//! Completion handles and layer-wise loading on every executor present: asynchronous loads and
//! backups land exactly the oracle's bytes, per-layer handles complete in order, a forgotten
//! handle can never expose a pool mid-transfer, and faults still name what landed.
#![allow(clippy::needless_range_loop)] // K and V by index, as the pools number them

mod common;

use hicache_io::plan::Op;
use hicache_io::tools::oracle::{self, OracleBuffers};
use hicache_io::{
    Device, DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, LayerMap, Layout, PoolKind, Profile, TransferError,
};

use common::{contents, Contents};

/// MHA pools of `layers`, `slots` tokens, page size 4, every byte random; with what they hold.
fn mha_pools(device: &Device, layers: LayerMap, slots: u64, layout: Layout) -> (DevicePool<'static>, HostPool<'static>, Contents) {
    let dc = DevicePoolConfig { kind: PoolKind::Mha, bytes_per_token: 256, slots, page_size: 4, layers };
    let hc = HostPoolConfig { layout, size: slots, head_num: 1, profile: Profile::Extended, integrity: None };
    common::pools(device, &dc, &hc, Some(common::Fill { seed: slots, device: true, host: true }))
}

fn indices(n: i64) -> (Vec<i64>, Vec<i64>) {
    ((0..n).map(|i| (i * 7) % n).collect(), (0..n).rev().collect())
}

#[test]
fn async_loads_and_backups_land_the_oracles_bytes() {
    for device in common::devices() {
        let n = device.name();
        for io in IoBackend::ALL {
            let (mut dev, mut host, (mut want_dev, mut want_host)) = mha_pools(&device, LayerMap::new(3), 64, Layout::LayerFirst);
            let (hi, di) = indices(64);
            let t = host.load_to_device_per_layer_async(&mut dev, &hi, &di, 1, io).unwrap();
            t.wait().unwrap();
            oracle::apply(
                host.pair(),
                Op::Load { layer_id: 1, is_draft: false },
                &hi,
                &di,
                OracleBuffers { host: &mut want_host, device: &mut want_dev },
            );
            let t = host.backup_from_device_all_layer_async(&dev, &di, &hi, io).unwrap();
            while !t.is_done().unwrap() {
                std::thread::yield_now();
            }
            drop(t);
            oracle::apply(host.pair(), Op::Backup, &di, &hi, OracleBuffers { host: &mut want_host, device: &mut want_dev });
            assert!(contents(&dev, &host) == (want_dev, want_host), "{n} {io}");
        }
    }
}

#[test]
fn layer_wise_loads_complete_layer_by_layer() {
    for device in common::devices() {
        let n = device.name();
        let mut layers = LayerMap::new(6);
        layers.layer_shard = Some((1, 5));
        layers.drafts = 1;
        let (mut dev, host, (mut want_dev, mut want_host)) = mha_pools(&device, layers.clone(), 4096, Layout::PageFirst);
        let (hi, di) = indices(4096);
        let loads = host.load_layers(&mut dev, &hi, &di, IoBackend::Kernel).unwrap();
        assert_eq!(loads.layer_ids(), vec![1, 2, 3, 4, 6], "{n}: owned layers in order, then the draft");
        for l in loads.layer_ids() {
            loads.wait_layer(l).unwrap();
            assert!(loads.is_layer_done(l).unwrap(), "{n}: layer {l}");
        }
        // A layer these loads did not load (outside the shard) is named with the loads and the
        // pool's real shape (it used to say "4 target layers and 0 draft layers").
        let e = loads.wait_layer(0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "layer 0 was not loaded by these layer loads (loaded: [1, 2, 3, 4, 6]; the device pool has 6 target layers, owns 1..5, and has 1 draft layers)",
            "{n}"
        );
        loads.wait().unwrap();
        for l in [1usize, 2, 3, 4] {
            oracle::apply(
                host.pair(),
                Op::Load { layer_id: l, is_draft: false },
                &hi,
                &di,
                OracleBuffers { host: &mut want_host, device: &mut want_dev },
            );
        }
        oracle::apply(
            host.pair(),
            Op::Load { layer_id: 6, is_draft: true },
            &hi,
            &di,
            OracleBuffers { host: &mut want_host, device: &mut want_dev },
        );
        assert!(contents(&dev, &host) == (want_dev, want_host), "{n}");
    }
}

/// A handle that is forgotten instead of waited: the pools stay consistent, because every read
/// (and dropping the pools) waits for the executor's queue first.
#[test]
fn forgotten_handles_never_expose_a_pool_mid_transfer() {
    for device in common::devices() {
        let n = device.name();
        let (mut dev, host, (mut want_dev, mut want_host)) = mha_pools(&device, LayerMap::new(2), 1 << 14, Layout::LayerFirst);
        let (hi, di) = indices(1 << 14);
        std::mem::forget(host.load_to_device_per_layer_async(&mut dev, &hi, &di, 0, IoBackend::Kernel).unwrap());
        oracle::apply(
            host.pair(),
            Op::Load { layer_id: 0, is_draft: false },
            &hi,
            &di,
            OracleBuffers { host: &mut want_host, device: &mut want_dev },
        );
        assert!(contents(&dev, &host) == (want_dev, want_host), "{n}");
        // Dropping pools with a transfer in flight waits for it.
        std::mem::forget(host.load_to_device_per_layer_async(&mut dev, &hi, &di, 1, IoBackend::Direct).unwrap());
        drop(dev);
        drop(host);
    }
}

/// A synchronous call on an executor with queued work runs after it (stream order).
#[test]
fn synchronous_calls_queue_behind_asynchronous_ones() {
    for device in common::devices() {
        let (mut dev_a, host_a, _) = mha_pools(&device, LayerMap::new(2), 1 << 14, Layout::LayerFirst);
        let (mut dev_b, host_b, (mut want_dev, mut want_host)) = mha_pools(&device, LayerMap::new(2), 64, Layout::LayerFirst);
        let (big_hi, big_di) = indices(1 << 14);
        let (hi, di) = indices(64);
        let t = host_a.load_to_device_per_layer_async(&mut dev_a, &big_hi, &big_di, 0, IoBackend::Kernel).unwrap();
        host_b.load_to_device_per_layer(&mut dev_b, &hi, &di, 1, IoBackend::Kernel).unwrap();
        oracle::apply(
            host_b.pair(),
            Op::Load { layer_id: 1, is_draft: false },
            &hi,
            &di,
            OracleBuffers { host: &mut want_host, device: &mut want_dev },
        );
        assert!(contents(&dev_b, &host_b) == (want_dev, want_host), "{}", device.name());
        t.wait().unwrap();
    }
}

/// A fault while layers are enqueued: the error comes back, the layers before it land.
#[test]
fn faults_during_layer_wise_loads() {
    for device in common::devices() {
        let n = device.name();
        let (mut dev, host, (want_dev, _)) = mha_pools(&device, LayerMap::new(4), 64, Layout::LayerFirst);
        let (hi, di) = indices(64);
        device.inject_fault(2);
        let err = host.load_layers(&mut dev, &hi, &di, IoBackend::Direct).err().expect("fault");
        assert!(err.to_string().contains("injected fault"), "{n}: {err}");
        // The error says which layers completed (host layers 0 and 1, each one step here).
        match &err {
            TransferError::Partial { failed_step, total_steps, completed_layers, .. } => {
                assert_eq!((*failed_step, *total_steps, completed_layers.as_slice()), (2, 4, &[0u64, 1][..]), "{n}");
            }
            other => panic!("{n}: not Partial: {other:?}"),
        }
        // Layers 0 and 1 landed, layers 2 and 3 did not move.
        let (got_dev, _) = contents(&dev, &host);
        assert!(got_dev[0][2] == want_dev[0][2] && got_dev[0][3] == want_dev[0][3], "{n}: later layers moved");
        assert!(got_dev[0][0] != want_dev[0][0] && got_dev[0][1] != want_dev[0][1], "{n}: earlier layers did not land");
    }
}
