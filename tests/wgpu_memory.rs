//! wgpu host pools in host-visible memory (`MAPPABLE_PRIMARY_BUFFERS`): allocated mappable
//! where the adapter allows, read and written through the mapping (at offsets that are not
//! map-aligned too), and moving the same bytes as staged pools and the cpu executor.

mod common;

use hicache_io::exec::wgpu::{PoolMemory, WgpuExecutor, WgpuOptions};
use hicache_io::exec::{BackendKind, Buffer};
use hicache_io::{Device, DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, LayerMap, Layout, PoolKind, Profile};

fn wgpu(mapped_host: Option<bool>) -> Option<(Device, WgpuExecutor)> {
    common::open(BackendKind::Wgpu)?;
    let exec = WgpuExecutor::with_options(WgpuOptions { mapped_host, ..Default::default() }).unwrap();
    Some((Device::Wgpu(exec.clone()), exec))
}

/// An MLA pool pair with 12-byte records, so page spans start off the 8-byte map alignment.
fn run(device: &Device) -> (Vec<u8>, Vec<u8>, bool) {
    let cfg = DevicePoolConfig { kind: PoolKind::Mla, bytes_per_token: 12, slots: 64, page_size: 1, layers: LayerMap::new(3) };
    let mut dev = DevicePool::new(device, &cfg).unwrap();
    for s in 0..3 {
        dev.write_buffer(0, s, &(0..64 * 12).map(|i| (i * 7 + s * 31) as u8).collect::<Vec<_>>()).unwrap();
    }
    let mut host =
        HostPool::new(&dev, &HostPoolConfig { layout: Layout::PageFirstDirect, size: 40, head_num: 1, profile: Profile::Extended })
            .unwrap();
    let mapped = match host.buffer(0).unwrap() {
        Buffer::Wgpu(b) => b.raw().usage().contains(wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::MAP_WRITE),
        _ => false,
    };
    host.backup_from_device_all_layer(&dev, &[3, 4, 5, 9], &[10, 11, 12, 40], IoBackend::Direct).unwrap();
    // Storage helpers: flat pages out and in at unaligned offsets (page 5 starts at byte 180).
    let page = host.get_data_page(4).unwrap();
    host.set_from_flat_data_page(5, &page).unwrap();
    host.set_from_flat_data_page(7, &[0xAB; 36]).unwrap();
    host.load_to_device_per_layer(&mut dev, &[5, 7, 9], &[0, 1, 2], 1, IoBackend::Direct).unwrap();
    (host.read_buffer(0).unwrap(), dev.read_buffer(0, 1).unwrap(), mapped)
}

#[test]
fn mapped_host_pools_move_the_same_bytes() {
    let Some((mapped, exec)) = wgpu(None) else { return };
    let (staged, _) = wgpu(Some(false)).unwrap();
    let want = run(&Device::cpu());
    let got = run(&mapped);
    let feature = exec.device().features().contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS);
    assert_eq!(got.2, feature, "host pools are mappable exactly when the feature is on");
    assert_eq!((&got.0, &got.1), (&want.0, &want.1), "mapped host pool differs from the cpu executor");
    let plain = run(&staged);
    assert!(!plain.2, "mapped_host: Some(false) allocates plain storage buffers");
    assert_eq!((&plain.0, &plain.1), (&want.0, &want.1), "staged host pool differs from the cpu executor");
    // Where the pools live, as `info` reports it.
    if exec.adapter_info().device_type == wgpu::DeviceType::Cpu {
        assert_eq!(exec.host_pool_memory(), PoolMemory::Unified);
    } else if feature {
        assert_ne!(exec.host_pool_memory(), PoolMemory::DeviceLocal);
    }
    assert!(mapped.describe().contains("host pools"), "{}", mapped.describe());
}
