//! Faults in the middle of a transfer (a test-only fault injector fails the k-th step of an
//! executor): the error names what completed, completed layers hold the right bytes, layers that
//! did not complete are untouched, the source is never written, and the next call on the same
//! pools works. On cpu and wgpu, for loads, backups and layer-sharded backups.

mod common;

use common::contents;

use hicache_io::error::TransferError;
use hicache_io::plan::Op;
use hicache_io::tools::oracle::{self, OracleBuffers};
use hicache_io::{Device, DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, LayerMap, Layout, PoolKind, Profile};

const LAYERS: usize = 4;

/// MLA pools of `LAYERS` layers (`sharded`: the device pool a layer shard of all of them), every
/// byte random.
fn mla_pools(device: &Device, sharded: bool) -> (DevicePool<'static>, HostPool<'static>) {
    let mut layers = LayerMap::new(LAYERS);
    if sharded {
        layers.layer_shard = Some((0, LAYERS));
    }
    let dc = DevicePoolConfig { kind: PoolKind::Mla, bytes_per_token: 64, slots: 32, page_size: 4, layers };
    let hc = HostPoolConfig { layout: Layout::LayerFirst, size: 32, head_num: 1, profile: Profile::Extended, integrity: None };
    let (dev, host, _) = common::pools(device, &dc, &hc, Some(common::Fill { seed: 9, device: true, host: true }));
    (dev, host)
}

#[test]
fn sharded_backup_fault_names_completed_layers() {
    let (hi, di): (Vec<i64>, Vec<i64>) = ((8..16).collect(), (20..28).collect());
    for device in common::devices() {
        let n = device.name();
        for fail_at in 0..LAYERS as u64 {
            let (dev, mut host) = mla_pools(&device, true);
            let (dev0, host0) = contents(&dev, &host);
            let (mut want_dev, mut want_host) = (dev0.clone(), host0.clone());
            oracle::apply(host.pair(), Op::Backup, &hi, &di, OracleBuffers { host: &mut want_host, device: &mut want_dev });
            device.inject_fault(fail_at);
            let err = host.backup_from_device_all_layer(&dev, &hi, &di, IoBackend::Kernel).unwrap_err();
            let TransferError::Partial { failed_step, total_steps, completed_layers, source } = &err else {
                panic!("{n}: expected a partial-failure error, got {err:?}")
            };
            assert_eq!((*failed_step, *total_steps), (fail_at as usize, LAYERS), "{n}");
            assert_eq!(completed_layers, &(0..fail_at).collect::<Vec<_>>(), "{n}");
            assert!(source.to_string().contains("injected fault"), "{n}: {source}");
            assert!(err.to_string().contains("layers completed"), "{n}: {err}");
            // Completed layers hold the backup, the others are untouched; the source is untouched.
            let (dev1, host1) = contents(&dev, &host);
            assert!(dev1 == dev0, "{n}: the source changed");
            let layer_bytes = host.geometry().slots() as usize * host.geometry().item_bytes() as usize;
            for l in 0..LAYERS {
                let r = l * layer_bytes..(l + 1) * layer_bytes;
                let expect = if (l as u64) < fail_at { &want_host[0][r.clone()] } else { &host0[0][r.clone()] };
                assert!(host1[0][r] == *expect, "{n}: fault at {fail_at}, layer {l}");
            }
            // The next call on the same pools works and completes the backup.
            host.backup_from_device_all_layer(&dev, &hi, &di, IoBackend::Kernel).unwrap();
            assert!(contents(&dev, &host) == (want_dev, want_host), "{n}: retry after fault at {fail_at}");
        }
    }
}

#[test]
fn single_step_faults_write_nothing_and_pools_stay_usable() {
    let (hi, di): (Vec<i64>, Vec<i64>) = ((8..16).collect(), (20..28).collect());
    for device in common::devices() {
        let n = device.name();
        for io in IoBackend::ALL {
            for op in [Op::Backup, Op::Load { layer_id: 2, is_draft: false }] {
                let (mut dev, mut host) = mla_pools(&device, false);
                let before = contents(&dev, &host);
                let (mut want_dev, mut want_host) = before.clone();
                oracle::apply(host.pair(), op, &hi, &di, OracleBuffers { host: &mut want_host, device: &mut want_dev });
                device.inject_fault(0);
                let run = |dev: &mut DevicePool, host: &mut HostPool| match op {
                    Op::Backup => host.backup_from_device_all_layer(dev, &hi, &di, io),
                    Op::BackupLayer { layer_id, is_draft } => host.backup_from_device_per_layer(dev, &hi, &di, layer_id, is_draft, io),
                    _ => host.load_to_device_per_layer(dev, &hi, &di, 2, io),
                };
                let err = run(&mut dev, &mut host).unwrap_err();
                assert!(err.to_string().contains("injected fault"), "{n} {io} {op:?}: {err}");
                assert!(contents(&dev, &host) == before, "{n} {io} {op:?}: a failed step wrote bytes");
                run(&mut dev, &mut host).unwrap();
                assert!(contents(&dev, &host) == (want_dev, want_host), "{n} {io} {op:?}: retry");
            }
        }
    }
}

/// An asynchronous plan of several steps (a layer-sharded backup: one per layer) whose second
/// submission fails after the call has returned: its handle reports the failure, though its
/// last submission ran (wgpu queues submissions; other executors have none to fail). The pools
/// stay usable.
#[test]
fn an_async_plan_reports_a_failed_submission_of_any_step() {
    let (hi, di): (Vec<i64>, Vec<i64>) = ((8..16).collect(), (20..28).collect());
    for device in common::devices().into_iter().filter(|d| d.name() == "wgpu") {
        let (dev, mut host) = mla_pools(&device, true);
        let (mut want_dev, mut want_host) = contents(&dev, &host);
        oracle::apply(host.pair(), Op::Backup, &hi, &di, OracleBuffers { host: &mut want_host, device: &mut want_dev });
        device.inject_submission_fault(1);
        let t = host.backup_from_device_all_layer_async(&dev, &hi, &di, IoBackend::Kernel).unwrap();
        let err = t.wait().unwrap_err();
        assert!(err.to_string().contains("injected submission fault"), "{err}");
        host.backup_from_device_all_layer(&dev, &hi, &di, IoBackend::Kernel).unwrap();
        assert!(contents(&dev, &host) == (want_dev, want_host), "retry");
    }
}

/// A wgpu device destroyed under its pools (as a driver reset or an unplugged GPU loses it):
/// the call that sees it and every later one fail with `DeviceLost` naming the cause, the pools
/// and new allocations too, and nothing panics; a new executor on the same adapter works.
#[cfg(feature = "wgpu")]
#[test]
fn a_lost_wgpu_device_fails_every_call_and_a_new_one_works() {
    let Some(device) = common::open(hicache_io::exec::ExecutorKind::Wgpu) else { return };
    let (hi, di): (Vec<i64>, Vec<i64>) = ((8..16).collect(), (20..28).collect());
    let (mut dev, mut host) = mla_pools(&device, false);
    host.backup_from_device_all_layer(&dev, &hi, &di, IoBackend::Kernel).unwrap();
    let Device::Wgpu(w) = &device else { unreachable!() };
    w.device().destroy();
    let lost = |r: Result<(), TransferError>, what: &str| match r {
        Err(TransferError::DeviceLost { backend: "wgpu", .. }) => {}
        other => panic!("{what}: expected a lost device, got {other:?}"),
    };
    for round in 0..2 {
        lost(host.backup_from_device_all_layer(&dev, &hi, &di, IoBackend::Kernel), &format!("backup, round {round}"));
        lost(host.load_to_device_per_layer(&mut dev, &hi, &di, 1, IoBackend::Direct), &format!("load, round {round}"));
        lost(dev.read_buffer(0, 0).map(|_| ()), "device pool read");
        lost(host.write_buffer(0, &vec![0u8; host.geometry().buffer_bytes() as usize]), "host pool write");
        lost(device.synchronize(), "synchronize");
        let dc = DevicePoolConfig { kind: PoolKind::Mla, bytes_per_token: 64, slots: 32, page_size: 4, layers: LayerMap::new(1) };
        lost(DevicePool::new(&device, &dc).map(|_| ()), "a new pool");
    }
    drop((dev, host));
    let fresh = common::open(hicache_io::exec::ExecutorKind::Wgpu).expect("a new wgpu executor");
    let (dev, mut host) = mla_pools(&fresh, false);
    let (mut want_dev, mut want_host) = contents(&dev, &host);
    oracle::apply(host.pair(), Op::Backup, &hi, &di, OracleBuffers { host: &mut want_host, device: &mut want_dev });
    host.backup_from_device_all_layer(&dev, &hi, &di, IoBackend::Kernel).unwrap();
    assert!(contents(&dev, &host) == (want_dev, want_host), "the new executor's backup");
}
