//! An engine's layer pipeline must not stall on the host: issuing 61 per-layer loads and a
//! backup through a `Pipeline` (host index lists) makes no driver call that blocks the calling
//! thread, on the simulated driver's call trace. Skips outside the simulator (fails when
//! `HICACHE_CUDA_SIM=1`, as `scripts/cuda-sim.sh` sets, and the simulator is absent).
#![cfg(feature = "cuda")]

mod common;

use hicache_io::exec::ExecutorKind;
use hicache_io::{DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, LayerMap, Layout, PoolKind, Profile};

#[test]
fn sixty_one_layer_loads_and_a_backup_never_block_the_host() {
    let Some(trace) = common::sim_trace("cuda-trace") else { return };
    let device = common::open(ExecutorKind::Cuda).expect("cuda on the simulator");
    let layers = 61;
    let cfg = DevicePoolConfig { kind: PoolKind::Mla, bytes_per_token: 656, slots: 1024, page_size: 64, layers: LayerMap::new(layers) };
    let mut dev = DevicePool::new(&device, &cfg).unwrap();
    let host_cfg = HostPoolConfig { layout: Layout::PageFirst, size: 2048, head_num: 1, profile: Profile::Extended, integrity: None };
    let mut host = HostPool::new(&dev, &host_cfg).unwrap();
    let (hi, di): (Vec<i64>, Vec<i64>) = ((0..256).collect(), (512..768).collect());
    let (bhi, bdi): (Vec<i64>, Vec<i64>) = ((1024..1280).collect(), (0..256).collect());
    let before = std::fs::read_to_string(&trace).unwrap_or_default().lines().count();
    let mut p = host.pipeline(&mut dev).unwrap();
    let loads = p.load_layers(&hi, &di, IoBackend::Kernel).unwrap();
    let backup = p.backup(&bhi, &bdi, IoBackend::Kernel).unwrap();
    let issued = std::fs::read_to_string(&trace).unwrap();
    p.wait(loads.last().unwrap().1).unwrap();
    p.wait(backup).unwrap();
    p.finish().unwrap();
    let calls: Vec<&str> = issued.lines().skip(before).collect();
    assert!(calls.iter().filter(|l| l.contains(" cuLaunchKernel ")).count() > layers, "{} calls traced", calls.len());
    let blocking: Vec<&&str> = calls.iter().filter(|l| l.contains("blocked=1")).collect();
    assert!(blocking.is_empty(), "host-blocking driver calls while issuing: {blocking:#?}");
    assert_eq!(loads.len(), layers);
    let _ = std::fs::remove_file(&trace);
}
