//! Pipelines: loads on the main stream and backups on the backup stream, in flight together.
//! Whatever the two streams overlap, the pools end up with the bytes of running every call in
//! issue order (the oracle); a backup that touches nothing a load touches does not wait for
//! the loads (cpu, where the backup stream is a second worker); a leaked pipeline never exposes
//! a pool mid-transfer.
#![allow(clippy::needless_range_loop)] // K and V by index, as the pools number them

mod common;

use hicache_io::plan::Op;
use hicache_io::tools::check::Rng;
use hicache_io::tools::oracle::{self, OracleBuffers};
use hicache_io::{
    Device, DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, LayerMap, Layout, PoolKind, Profile, TransferError,
};

use common::{contents, Contents};

const P: u64 = 4;

/// MHA pools of `layers` layers, `bytes_per_token`, `slots` tokens, page size 4: the host's
/// bytes random, the device's random where `noisy_device` (else zero); with what they hold.
fn mha_pools(
    device: &Device,
    layers: usize,
    slots: u64,
    bytes_per_token: u64,
    layout: Layout,
    noisy_device: bool,
) -> (DevicePool<'static>, HostPool<'static>, Contents) {
    let dc = DevicePoolConfig { kind: PoolKind::Mha, bytes_per_token, slots, page_size: P, layers: LayerMap::new(layers) };
    let hc = HostPoolConfig { layout, size: slots, head_num: 1, profile: Profile::Extended, integrity: None };
    common::pools(device, &dc, &hc, Some(common::Fill { seed: slots ^ bytes_per_token, device: noisy_device, host: true }))
}

/// Token indices of whole pages.
fn tokens(pages: &[u64]) -> Vec<i64> {
    pages.iter().flat_map(|&p| (p * P..(p + 1) * P).map(|t| t as i64)).collect()
}

/// `k` distinct pages below `bound`, in random order.
fn distinct_pages(rng: &mut Rng, k: usize, bound: u64) -> Vec<u64> {
    let mut all: Vec<u64> = (0..bound).collect();
    for i in 0..k {
        let j = i + rng.below((all.len() - i) as u64) as usize;
        all.swap(i, j);
    }
    all.truncate(k);
    all
}

fn apply(host: &HostPool, op: Op, hi: &[i64], di: &[i64], want: &mut Contents) {
    oracle::apply(host.pair(), op, hi, di, OracleBuffers { host: &mut want.1, device: &mut want.0 });
}

/// Random loads, backups and per-layer backups over a few pages, so the two streams meet
/// often: the pools end with the issue-order bytes on every executor, layout and io backend.
#[test]
fn interleaved_loads_and_backups_land_the_issue_order_bytes() {
    for device in common::devices() {
        let n = device.name();
        let cells = [
            (Layout::LayerFirst, IoBackend::Kernel),
            (Layout::LayerFirst, IoBackend::Direct),
            (Layout::PageFirst, IoBackend::Kernel),
            (Layout::PageFirstDirect, IoBackend::Direct),
        ];
        for (layout, io) in cells {
            {
                for seed in 0..4u64 {
                    let (mut dev, mut host, mut want) = mha_pools(&device, 3, 256, 64, layout, true);
                    let mut rng = Rng::new(seed * 31 + io as u64);
                    let mut pipe = host.pipeline(&mut dev).unwrap();
                    let mut ops = Vec::new();
                    for _ in 0..24 {
                        let k = 1 + rng.below(6) as usize;
                        let (hp, dp) = (distinct_pages(&mut rng, k, 12), distinct_pages(&mut rng, k, 12));
                        let (hi, di) = (tokens(&hp), tokens(&dp));
                        let layer = rng.below(3) as usize;
                        let op = match rng.below(4) {
                            0 | 1 => {
                                pipe.load(&hi, &di, layer, io).unwrap();
                                Op::Load { layer_id: layer, is_draft: false }
                            }
                            2 => {
                                pipe.backup(&hi, &di, io).unwrap();
                                Op::Backup
                            }
                            _ => {
                                pipe.backup_layer(&hi, &di, layer, false, io).unwrap();
                                Op::BackupLayer { layer_id: layer, is_draft: false }
                            }
                        };
                        ops.push((op, hi, di));
                    }
                    pipe.finish().unwrap();
                    let host_ref = &host;
                    for (op, hi, di) in &ops {
                        apply(host_ref, *op, hi, di, &mut want);
                    }
                    assert!(contents(&dev, &host) == want, "{n} {layout:?} {io} seed {seed}");
                }
            }
        }
    }
}

/// Large pools: loads that take a while on the cpu executor (so that a backup on the side
/// stream would overtake them if it were not ordered).
fn big_pools(device: &Device) -> (DevicePool<'static>, HostPool<'static>, Contents) {
    mha_pools(device, 4, 1 << 15, 1024, Layout::LayerFirst, false)
}

/// A backup of the device slots the loads just wrote: it must see the loaded bytes (it is
/// ordered after the loads in flight), and the loads must see the host pages before the
/// backup overwrites them.
#[test]
fn a_backup_of_slots_being_loaded_waits_for_the_loads() {
    for device in common::devices() {
        let n = device.name();
        let (mut dev, mut host, mut want) = big_pools(&device);
        let pages = (1u64 << 15) / P;
        let all: Vec<u64> = (0..pages).collect();
        let (hi, di) = (tokens(&all), tokens(&all.iter().rev().copied().collect::<Vec<_>>()));
        // Back up the first 64 device pages into host pages the loads read from.
        let (bdi, bhi) = (tokens(&all[..64]), tokens(&all[100..164]));
        let mut pipe = host.pipeline(&mut dev).unwrap();
        let loads = pipe.load_layers(&hi, &di, IoBackend::Kernel).unwrap();
        let backup = pipe.backup(&bhi, &bdi, IoBackend::Kernel).unwrap();
        pipe.wait(backup).unwrap();
        let last = loads.last().unwrap().1;
        assert!(pipe.is_done(last).unwrap(), "{n}: the backup finished before the loads it depends on");
        pipe.finish().unwrap();
        for l in 0..4 {
            apply(&host, Op::Load { layer_id: l, is_draft: false }, &hi, &di, &mut want);
        }
        apply(&host, Op::Backup, &bhi, &bdi, &mut want);
        assert!(contents(&dev, &host) == want, "{n}");
    }
}

/// On cpu the backup stream is its own worker: a backup that shares no page of any layer with
/// the loads in flight lands while they are still running. (Timing-based, so a few tries: on
/// a busy machine the side worker may start late once.)
#[test]
fn an_independent_backup_does_not_wait_for_loads_in_flight() {
    let device = Device::cpu();
    let mut overtook = 0;
    for _ in 0..5 {
        let (mut dev, mut host, mut want) = big_pools(&device);
        let pages = (1u64 << 15) / P;
        let half: Vec<u64> = (0..pages / 2).collect();
        let (hi, di) = (tokens(&half), tokens(&half.iter().rev().copied().collect::<Vec<_>>()));
        let other: Vec<u64> = (pages / 2..pages / 2 + 16).collect();
        let (bhi, bdi) = (tokens(&other), tokens(&other));
        let mut pipe = host.pipeline(&mut dev).unwrap();
        let loads = pipe.load_layers(&hi, &di, IoBackend::Kernel).unwrap();
        let backup = pipe.backup(&bhi, &bdi, IoBackend::Kernel).unwrap();
        pipe.wait(backup).unwrap();
        if !pipe.is_done(loads.last().unwrap().1).unwrap() {
            overtook += 1;
        }
        pipe.finish().unwrap();
        for l in 0..4 {
            apply(&host, Op::Load { layer_id: l, is_draft: false }, &hi, &di, &mut want);
        }
        apply(&host, Op::Backup, &bhi, &bdi, &mut want);
        assert!(contents(&dev, &host) == want);
        if overtook > 0 {
            return;
        }
    }
    panic!("in 5 tries the backup never landed before the loads issued ahead of it");
}

/// A leaked pipeline whose backups are still running on the backup stream when the pools are
/// free again: six backups of every page of every layer, each to other host pages (so every
/// intermediate state differs from the final one). Returns the pools, their bytes before, the
/// backups' index lists and the pages.
#[allow(clippy::type_complexity)]
fn leaked_backups(device: &Device) -> (DevicePool<'static>, HostPool<'static>, Contents, Vec<(Vec<i64>, Vec<i64>)>, Vec<u64>) {
    // 256 MiB a backup keeps a GPU busy; on the simulated driver its per-op delays do that; on
    // the host executors (cpu, wgpu's CPU adapters) six backups of 64 MiB still run for tens of
    // milliseconds after the pipeline is leaked, four times less work than 256 MiB for the test.
    let slots = match device.kind() {
        _ if common::on_cuda_sim(device) => 1 << 12,
        hicache_io::ExecutorKind::Cuda => 1 << 15,
        _ => 1 << 13,
    };
    let (mut dev, mut host, want) = mha_pools(device, 4, slots, 1024, Layout::LayerFirst, true);
    let pages = slots / P;
    let all: Vec<u64> = (0..pages).collect();
    let di = tokens(&all);
    let his: Vec<Vec<i64>> = (0..6).map(|k| tokens(&all.iter().map(|p| (p + 97 * k) % pages).collect::<Vec<_>>())).collect();
    let mut pipe = host.pipeline(&mut dev).unwrap();
    for hi in &his {
        pipe.backup(hi, &di, IoBackend::Kernel).unwrap();
    }
    std::mem::forget(pipe);
    (dev, host, want, his.into_iter().map(|hi| (hi, di.clone())).collect(), all)
}

fn apply_backups(host: &HostPool, backups: &[(Vec<i64>, Vec<i64>)], want: &mut Contents) {
    for (hi, di) in backups {
        apply(host, Op::Backup, hi, di, want);
    }
}

/// Reads wait for both streams.
#[test]
fn a_leaked_pipeline_never_exposes_a_pool_to_reads() {
    for device in common::devices() {
        let (dev, host, mut want, backups, _) = leaked_backups(&device);
        let read = host.read_buffer(1).unwrap();
        apply_backups(&host, &backups, &mut want);
        assert!(read == want.1[1], "{}: read mid-backup", device.name());
        assert!(contents(&dev, &host) == want, "{}", device.name());
    }
}

/// A plain call runs after the backup stream's work (here: a load of host pages the backups
/// write).
#[test]
fn a_leaked_pipeline_orders_later_plain_calls() {
    for device in common::devices() {
        let (mut dev, host, mut want, backups, all) = leaked_backups(&device);
        let (lhi, ldi) = (tokens(&all[..8]), tokens(&all[8..16]));
        host.load_to_device_per_layer(&mut dev, &lhi, &ldi, 2, IoBackend::Kernel).unwrap();
        apply_backups(&host, &backups, &mut want);
        apply(&host, Op::Load { layer_id: 2, is_draft: false }, &lhi, &ldi, &mut want);
        assert!(contents(&dev, &host) == want, "{}", device.name());
    }
}

/// A second pipeline on the same pools: its loads run after the leaked pipeline's backups.
#[test]
fn a_leaked_pipeline_orders_the_next_pipeline() {
    for device in common::devices() {
        let (mut dev, mut host, mut want, backups, all) = leaked_backups(&device);
        let (lhi, ldi) = (tokens(&all[..8]), tokens(&all[8..16]));
        let mut pipe = host.pipeline(&mut dev).unwrap();
        pipe.load(&lhi, &ldi, 2, IoBackend::Kernel).unwrap();
        pipe.finish().unwrap();
        apply_backups(&host, &backups, &mut want);
        apply(&host, Op::Load { layer_id: 2, is_draft: false }, &lhi, &ldi, &mut want);
        assert!(contents(&dev, &host) == want, "{}", device.name());
    }
}

#[test]
fn tickets_belong_to_their_pipeline_and_refusals_move_nothing() {
    for device in common::devices() {
        let n = device.name();
        let (mut dev, mut host, want) = mha_pools(&device, 2, 64, 64, Layout::PageFirst, true);
        let (mut dev2, mut host2, _) = mha_pools(&device, 3, 64, 64, Layout::PageFirst, true);
        let mut p2 = host2.pipeline(&mut dev2).unwrap();
        let foreign = p2.load(&tokens(&[0]), &tokens(&[1]), 0, IoBackend::Kernel).unwrap();
        p2.finish().unwrap();
        let mut pipe = host.pipeline(&mut dev).unwrap();
        let err = pipe.wait(foreign).unwrap_err();
        assert!(matches!(err, TransferError::InvalidConfig(_)), "{n}: {err}");
        // Refused calls: sglang's messages, nothing moves.
        let err = pipe.load(&[0, 1], &[0], 0, IoBackend::Kernel).unwrap_err();
        assert!(matches!(err, TransferError::LengthMismatch { .. }), "{n}: {err}");
        let err = pipe.backup(&tokens(&[0]), &tokens(&[99]), IoBackend::Kernel).unwrap_err();
        assert!(matches!(err, TransferError::IndexOutOfRange { .. }), "{n}: {err}");
        let err = pipe.load(&tokens(&[0]), &tokens(&[1]), 7, IoBackend::Kernel).unwrap_err();
        assert!(matches!(err, TransferError::LayerOutOfRange { .. }), "{n}: {err}");
        pipe.finish().unwrap();
        assert!(contents(&dev, &host) == want, "{n}");
        // A pool pair of another geometry is refused when the pipeline opens.
        assert!(host.pipeline(&mut dev2).is_err(), "{n}");
    }
}

/// A fault while a pipeline issues layer-wise loads: `Partial`, naming the layers that landed.
#[test]
fn faults_during_pipelined_layer_loads() {
    for device in common::devices() {
        let n = device.name();
        let (mut dev, mut host, _) = mha_pools(&device, 4, 64, 64, Layout::LayerFirst, true);
        let all: Vec<u64> = (0..16).collect();
        let (hi, di) = (tokens(&all), tokens(&all));
        let mut pipe = host.pipeline(&mut dev).unwrap();
        device.inject_fault(2);
        match pipe.load_layers(&hi, &di, IoBackend::Direct).unwrap_err() {
            TransferError::Partial { failed_step, total_steps, completed_layers, .. } => {
                assert_eq!((failed_step, total_steps, completed_layers.as_slice()), (2, 4, &[0u64, 1][..]), "{n}");
            }
            other => panic!("{n}: not Partial: {other:?}"),
        }
        pipe.finish().unwrap();
    }
}
