//! Shared test helpers: which executors to run on, when a missing one fails the run, and a
//! pool pair's bytes.
#![allow(dead_code)]

use hicache_io::exec::{Device, ExecutorKind};
use hicache_io::{DevicePool, HostPool};

/// A pool pair's bytes: device `[comp][buffer]`, host `[comp]`.
pub type Contents = (Vec<Vec<Vec<u8>>>, Vec<Vec<u8>>);

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
pub fn devices() -> Vec<Device> {
    let mut out = vec![Device::cpu()];
    for kind in [ExecutorKind::Wgpu, ExecutorKind::Cuda] {
        if let Some(d) = open(kind) {
            out.push(d);
        }
    }
    out
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
