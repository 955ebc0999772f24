//! Hostile input through the public API: sizes that overflow, allocations no machine has,
//! objects of another executor instance, indices near the integer limits. Each must be a typed
//! error before any byte moves: never a panic, an abort or a signal.

mod common;

use hicache_io::error::TransferError;
use hicache_io::exec::ExecutorKind;
use hicache_io::{Device, DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, LayerMap, Layout, PoolKind, Profile};

fn cfg(kind: PoolKind, bytes_per_token: u64, slots: u64, page_size: u64, layers: LayerMap) -> DevicePoolConfig {
    DevicePoolConfig { kind, bytes_per_token, slots, page_size, layers }
}

fn host_cfg(layout: Layout, size: u64) -> HostPoolConfig {
    HostPoolConfig { layout, size, head_num: 1, profile: Profile::Extended, integrity: None }
}

/// Sizes whose products wrap u64 (or give a 0-slot pool) are configuration errors.
#[test]
fn overflowing_sizes_are_config_errors() {
    for device in common::devices() {
        let n = device.name();
        for (bpt, slots, page) in [(1u64 << 32, 1u64 << 32, 1u64), (u64::MAX, 2, 1), (1 << 40, 1 << 30, 1)] {
            let r = DevicePool::new(&device, &cfg(PoolKind::Mla, bpt, slots, page, LayerMap::new(2)));
            assert!(matches!(r, Err(TransferError::InvalidConfig(_)) | Err(TransferError::OutOfMemory { .. })), "{n}: {:?}", r.err());
        }
        // DSA: bytes_per_token × page_size wraps to a small item.
        let r = DevicePool::new(&device, &cfg(PoolKind::DsaIndexer, 1 << 63, 4, 2, LayerMap::new(1)));
        assert!(matches!(r, Err(TransferError::InvalidConfig(_))), "{n}: {:?}", r.err());
        // Host sizes that wrap when rounded to pages, or overflow the buffer size.
        let dev = DevicePool::new(&device, &cfg(PoolKind::Mla, 64, 16, 4, LayerMap::new(2))).unwrap();
        for size in [u64::MAX, u64::MAX - 3, (1 << 32) - 1, 1 << 60] {
            for layout in [Layout::LayerFirst, Layout::PageFirst, Layout::PageFirstDirect] {
                let r = HostPool::new(&dev, &host_cfg(layout, size));
                assert!(
                    matches!(r, Err(TransferError::InvalidConfig(_)) | Err(TransferError::OutOfMemory { .. })),
                    "{n} size {size} {layout}: {:?}",
                    r.err().map(|e| e.to_string())
                );
            }
        }
        // Layer counts that wrap.
        let mut layers = LayerMap::new(2);
        layers.drafts = usize::MAX;
        let r = DevicePool::new(&device, &cfg(PoolKind::Mla, 64, 16, 4, layers));
        assert!(matches!(r, Err(TransferError::InvalidConfig(_))), "{n}: {:?}", r.err());
    }
}

/// Allocations no machine can satisfy fail with the bytes asked for, before anything is
/// allocated (one buffer per draft included).
#[test]
fn huge_allocations_fail_with_the_size() {
    for device in common::devices() {
        let n = device.name();
        let r = DevicePool::new(&device, &cfg(PoolKind::Mla, 64, 1 << 40, 1, LayerMap::new(1)));
        match r {
            Err(TransferError::OutOfMemory { requested, .. }) => assert!(requested >= 64 << 40, "{n}: {requested}"),
            other => panic!("{n}: {:?}", other.err()),
        }
        let mut layers = LayerMap::new(1);
        layers.drafts = 1 << 40;
        let r = DevicePool::new(&device, &cfg(PoolKind::Mla, 64, 1 << 20, 1, layers));
        assert!(matches!(r, Err(TransferError::InvalidConfig(_)) | Err(TransferError::OutOfMemory { .. })), "{n}: {:?}", r.err());
        let dev = DevicePool::new(&device, &cfg(PoolKind::Mla, 64, 16, 1, LayerMap::new(1))).unwrap();
        let r = HostPool::new(&dev, &host_cfg(Layout::LayerFirst, 1 << 40));
        assert!(matches!(r, Err(TransferError::OutOfMemory { .. })), "{n}: {:?}", r.err());
    }
}

/// DSA token indices near i64::MAX: a typed error, not an overflow.
#[test]
fn dsa_tokens_near_the_integer_limit() {
    for device in common::devices() {
        let dev = DevicePool::new(&device, &cfg(PoolKind::DsaIndexer, 132, 8, 4, LayerMap::new(1))).unwrap();
        let host = HostPool::new(&dev, &host_cfg(Layout::LayerFirst, 32)).unwrap();
        let mut dev = dev;
        let big = i64::MAX - 2;
        for hi in [vec![big, big + 1, big + 2, 0], vec![i64::MAX - 3, i64::MAX - 2, i64::MAX - 1, i64::MAX]] {
            let r = host.load_to_device_per_layer(&mut dev, &hi, &[0, 1, 2, 3], 0, IoBackend::Kernel);
            assert!(r.is_err(), "{}: {hi:?}", device.name());
        }
    }
}

/// Reading a buffer that does not exist is an error, not an index panic.
#[test]
fn missing_buffers_are_errors() {
    let device = Device::cpu();
    let dev = DevicePool::new(&device, &cfg(PoolKind::Mla, 64, 16, 1, LayerMap::new(1))).unwrap();
    assert!(dev.buffer(9, 9).is_err());
    assert!(dev.read_buffer(9, 9).is_err());
}

/// Two wgpu executors: pools of one never run with pools or buffers of the other (their buffer
/// ids would name unrelated buffers of the other instance).
#[cfg(feature = "wgpu")]
#[test]
fn two_wgpu_executors_never_mix() {
    let (Some(a), Some(b)) = (common::open(ExecutorKind::Wgpu), common::open(ExecutorKind::Wgpu)) else { return };
    let c = cfg(PoolKind::Mla, 64, 16, 1, LayerMap::new(2));
    let dev_a = DevicePool::new(&a, &c).unwrap();
    let host_a = HostPool::new(&dev_a, &host_cfg(Layout::LayerFirst, 16)).unwrap();
    let mut dev_b = DevicePool::new(&b, &c).unwrap();
    let mut host_b = HostPool::new(&dev_b, &host_cfg(Layout::LayerFirst, 16)).unwrap();
    host_b.write_buffer(0, &vec![7u8; host_b.geometry().buffer_bytes() as usize]).unwrap();
    let before_a = (host_a.read_buffer(0).unwrap(), dev_a.read_buffer(0, 0).unwrap());
    let before_b = (host_b.read_buffer(0).unwrap(), dev_b.read_buffer(0, 0).unwrap());
    let r = host_a.load_to_device_per_layer(&mut dev_b, &[0, 1], &[2, 3], 0, IoBackend::Kernel);
    assert!(matches!(r, Err(TransferError::ExecutorMismatch { .. })), "{r:?}");
    let r = host_b.backup_from_device_all_layer(&dev_a, &[0, 1], &[2, 3], IoBackend::Direct);
    assert!(matches!(r, Err(TransferError::ExecutorMismatch { .. })), "{r:?}");
    assert!((host_a.read_buffer(0).unwrap(), dev_a.read_buffer(0, 0).unwrap()) == before_a);
    assert!((host_b.read_buffer(0).unwrap(), dev_b.read_buffer(0, 0).unwrap()) == before_b);
    // Buffers allocated by executor A cannot be wrapped into a pool of executor B.
    let bufs = vec![vec![a.alloc(16 * 64).unwrap(), a.alloc(16 * 64).unwrap()]];
    let r = DevicePool::from_buffers(&b, &c, bufs);
    assert!(matches!(r, Err(TransferError::ExecutorMismatch { .. })), "{:?}", r.err());
    // Plans made for A's pools do not run on B's.
    let plan = host_a
        .plan(
            &dev_a,
            &hicache_io::Request { op: hicache_io::Op::Backup, io_backend: IoBackend::Kernel, host_indices: &[0], device_indices: &[1] },
        )
        .unwrap();
    assert!(host_b.execute_backup(&dev_b, &plan).is_err());
}

/// A wgpu item of u64::MAX bytes is a configuration error (it used to overflow while
/// rounding the allocation).
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_giant_item() {
    let Some(w) = common::open(ExecutorKind::Wgpu) else { return };
    let r = DevicePool::new(&w, &cfg(PoolKind::Mla, u64::MAX, 1, 1, LayerMap::new(1)));
    assert!(r.is_err());
    assert!(w.alloc(u64::MAX).is_err());
}

/// The bounded fuzz run (`scripts/fuzz.sh` runs the long one): hostile cases through the public
/// API on every executor present, in a child process so that an abort or a signal is counted.
/// (Needs the CLI binary: feature `cli`, on by default.)
#[cfg(feature = "cli")]
#[test]
fn fuzz_finds_no_panic_and_no_corruption() {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_hicache-io"));
    cmd.args(["fuzz", "--cases", "1500", "--seed", "11"]);
    let first = match common::only() {
        Some(kinds) => {
            cmd.arg("--executor").arg(kinds.iter().map(|k| k.name()).collect::<Vec<_>>().join(","));
            kinds[0].name()
        }
        None => "cpu",
    };
    let out = cmd.output().expect("run hicache-io fuzz");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "fuzz failed ({:?}):\n{text}", out.status);
    assert!(text.contains(&format!("{first}: tried 1500,")) && text.contains("panics 0, corrupted 0"), "{text}");
}
