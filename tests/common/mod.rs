//! Shared test helpers: which executors to run on, when a missing one fails the run, the one
//! pool pair builder and a pool pair's bytes, caller memory for the `kvcacheio` ops, and the
//! simulated driver's call trace.
#![allow(dead_code)]

use hicache_io::exec::{Device, ExecutorKind};
use hicache_io::kvcacheio::{Memory, RawTensor};
use hicache_io::rng::Rng;
use hicache_io::{DevicePool, DevicePoolConfig, HostPool, HostPoolConfig};

/// `buf` as an op's host tensor of shape `dims` (elements).
pub fn host_tensor(buf: &mut [u8], dims: &[u64]) -> RawTensor {
    // SAFETY: `buf` outlives every op of these tests and nothing else touches it meanwhile.
    unsafe { RawTensor::new(buf.as_mut_ptr() as u64, buf.len() as u64, dims.to_vec(), Memory::Host) }
}

/// `len` seeded random bytes.
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    Rng::new(seed).fill(&mut v);
    v
}

/// The file the simulated CUDA driver traces its calls into for this test process (`name`
/// tells the tests apart), set before the driver's first call; `None` (the test skips) outside
/// the simulator (`HICACHE_CUDA_SIM=1`, as `scripts/cuda-sim.sh` sets). One test per process:
/// the simulator reads the variable once.
pub fn sim_trace(name: &str) -> Option<std::path::PathBuf> {
    if std::env::var("HICACHE_CUDA_SIM").map_or(true, |v| v != "1") {
        eprintln!("skipping: not on the simulated driver (scripts/cuda-sim.sh)");
        return None;
    }
    let trace = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}.txt", std::process::id()));
    std::env::set_var("HICACHE_CUDA_SIM_TRACE", &trace);
    Some(trace)
}

/// A pool pair's bytes: device `[comp][buffer]`, host `[comp]`.
pub type Contents = (Vec<Vec<Vec<u8>>>, Vec<Vec<u8>>);

/// How [`pools`] fills a new pair: random bytes from `seed`, drawn component by component (each
/// device buffer of the component, then its host buffer), into the sides asked for.
#[derive(Clone, Copy)]
pub struct Fill {
    pub seed: u64,
    pub device: bool,
    pub host: bool,
}

/// The pool pair of configs `dc` and `hc` on `device`, filled as `fill` says (`None`: as
/// allocated), with what it was filled with: the sides not filled as zeros (new pools are), no
/// bytes at all without `fill`. The one builder of the Rust tests; their files pick configs.
pub fn pools(
    device: &Device,
    dc: &DevicePoolConfig,
    hc: &HostPoolConfig,
    fill: Option<Fill>,
) -> (DevicePool<'static>, HostPool<'static>, Contents) {
    let mut dev = DevicePool::new(device, dc).unwrap();
    let mut host = HostPool::new(&dev, hc).unwrap();
    let Some(fill) = fill else { return (dev, host, (Vec::new(), Vec::new())) };
    let mut rng = Rng::new(fill.seed);
    let g = dev.geometry().clone();
    let (mut dev_bytes, mut host_bytes) = (Vec::new(), Vec::new());
    for c in 0..g.kind().components() {
        let mut bufs = Vec::new();
        for s in 0..g.buffer_count() {
            let mut b = vec![0u8; g.layer_bytes() as usize];
            if fill.device {
                rng.fill(&mut b);
                dev.write_buffer(c, s, &b).unwrap();
            }
            bufs.push(b);
        }
        dev_bytes.push(bufs);
        let mut b = vec![0u8; host.geometry().buffer_bytes() as usize];
        if fill.host {
            rng.fill(&mut b);
            host.write_buffer(c, &b).unwrap();
        }
        host_bytes.push(b);
    }
    (dev, host, (dev_bytes, host_bytes))
}

/// Every byte of both pools.
pub fn contents(dev: &DevicePool, host: &HostPool) -> Contents {
    let g = dev.geometry();
    let comps = g.kind().components();
    let d = (0..comps).map(|c| (0..g.buffer_count()).map(|s| dev.read_buffer(c, s).unwrap()).collect()).collect();
    (d, (0..comps).map(|c| host.read_buffer(c).unwrap()).collect())
}

/// Every executor present here. A missing wgpu adapter fails when `CI` or
/// `HICACHE_REQUIRE_WGPU=1` is set, a missing CUDA device when `HICACHE_REQUIRE_CUDA=1`;
/// otherwise the test prints why it skips that executor.
///
/// `HICACHE_TEST_EXECUTORS` (names, comma-separated) narrows the list to those executors, each
/// then required: CI's pass on the simulated CUDA driver sets `cuda`, since the cpu and wgpu
/// executors already ran in its plain pass and the simulator changes nothing for them.
pub fn devices() -> Vec<Device> {
    if let Some(kinds) = only() {
        return kinds
            .into_iter()
            .map(|k| Device::open(k).unwrap_or_else(|e| panic!("HICACHE_TEST_EXECUTORS names {} but {e}", k.name())))
            .collect();
    }
    let mut out = vec![Device::cpu()];
    for kind in [ExecutorKind::Wgpu, ExecutorKind::Cuda] {
        if let Some(d) = open(kind) {
            out.push(d);
        }
    }
    out
}

/// The executors `HICACHE_TEST_EXECUTORS` names, if it is set (panics on an unknown name).
pub fn only() -> Option<Vec<ExecutorKind>> {
    let names = std::env::var("HICACHE_TEST_EXECUTORS").ok().filter(|v| !v.trim().is_empty())?;
    Some(names.split(',').map(|n| n.trim().parse().unwrap_or_else(|e| panic!("HICACHE_TEST_EXECUTORS: {e}"))).collect())
}

/// Whether `device` is the cuda executor on the simulated driver (`scripts/cuda-sim.sh` sets
/// `HICACHE_CUDA_SIM=1`), where every byte a call moves is traced: tests that need transfers in
/// flight size them down there, since its seeded delays per stream op keep them in flight.
pub fn on_cuda_sim(device: &Device) -> bool {
    device.kind() == ExecutorKind::Cuda && std::env::var("HICACHE_CUDA_SIM").is_ok_and(|v| v == "1")
}

pub fn required(kind: ExecutorKind) -> bool {
    let set = |k: &str| std::env::var(k).is_ok_and(|v| !v.is_empty() && v != "0");
    match kind {
        ExecutorKind::Cpu => true,
        ExecutorKind::Wgpu => set("CI") || set("HICACHE_REQUIRE_WGPU"),
        ExecutorKind::Cuda => set("HICACHE_REQUIRE_CUDA"),
    }
}

/// Opens one executor, or `None` with a printed reason (panics if it is required).
pub fn open(kind: ExecutorKind) -> Option<Device> {
    match Device::open(kind) {
        Ok(d) => Some(d),
        Err(e) if required(kind) => panic!("{} is required here but {e}", kind.name()),
        Err(e) => {
            eprintln!("skipping {}: {e}", kind.name());
            None
        }
    }
}
