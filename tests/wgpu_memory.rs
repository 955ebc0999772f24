//! wgpu host pools in host-visible memory (`MAPPABLE_PRIMARY_BUFFERS`): allocated mappable
//! where the adapter allows, read and written through the mapping (at offsets that are not
//! map-aligned too), and moving the same bytes as staged pools and the cpu executor.

mod common;

use hicache_io::exec::wgpu::{PoolMemory, WgpuExecutor, WgpuOptions};
use hicache_io::exec::{Buffer, ExecutorKind};
use hicache_io::{Device, DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, LayerMap, Layout, PoolKind, Profile};

fn wgpu(mapped_host: Option<bool>) -> Option<(Device, WgpuExecutor)> {
    common::open(ExecutorKind::Wgpu)?;
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
    let mut host = HostPool::new(
        &dev,
        &HostPoolConfig { layout: Layout::PageFirstDirect, size: 40, head_num: 1, profile: Profile::Extended, integrity: None },
    )
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

/// A host pool larger than the adapter's largest buffer (lavapipe: 2 GiB), end to end: pages
/// past the first segment are backed up (kernel and direct), read as flat pages and loaded back.
#[test]
fn host_pool_larger_than_one_buffer() {
    let Some((device, exec)) = wgpu(None) else { return };
    let max_buffer = exec.device().limits().max_buffer_size;
    let (item, layers, page) = (1152u64, 4usize, 64u64);
    // Enough tokens for a page_first host pool 1.25× the largest buffer (at least 2.5 GB here).
    let tokens = (max_buffer * 5 / 4).max(2_500_000_000) / (item * layers as u64) / page * page;
    let cfg =
        DevicePoolConfig { kind: PoolKind::Mla, bytes_per_token: item, slots: 4 * page, page_size: page, layers: LayerMap::new(layers) };
    let mut dev = DevicePool::new(&device, &cfg).unwrap();
    let data: Vec<Vec<u8>> = (0..layers).map(|l| (0..4 * page * item).map(|i| (i * 13 + l as u64 * 101) as u8).collect()).collect();
    for (l, d) in data.iter().enumerate() {
        dev.write_buffer(0, l, d).unwrap();
    }
    for (layout, io) in [(Layout::PageFirst, IoBackend::Kernel), (Layout::PageFirstDirect, IoBackend::Direct)] {
        let mut host =
            HostPool::new(&dev, &HostPoolConfig { layout, size: tokens, head_num: 1, profile: Profile::Extended, integrity: None })
                .unwrap();
        let bytes = host.geometry().buffer_bytes();
        assert!(bytes > max_buffer, "{bytes} bytes fit one buffer of {max_buffer}");
        if let Buffer::Wgpu(b) = host.buffer(0).unwrap() {
            assert!(b.segments().len() >= 2, "{layout}: {} segment(s)", b.segments().len());
        }
        // Device pages 1 and 3 -> the last two host pages (far past the first segment).
        let last = host.geometry().size() / page - 1;
        let host_tokens: Vec<i64> = ((last - 1) * page..(last + 1) * page).map(|t| t as i64).collect();
        let dev_tokens: Vec<i64> = (page..2 * page).chain(3 * page..4 * page).map(|t| t as i64).collect();
        host.backup_from_device_all_layer(&dev, &host_tokens, &dev_tokens, io).unwrap();
        // The flat page of host page `last` holds device page 3 of every layer.
        let flat = host.get_data_page(host_tokens[page as usize]).unwrap();
        let per_layer = |l: usize| data[l][(3 * page * item) as usize..(4 * page * item) as usize].to_vec();
        let mut want = Vec::new();
        match layout {
            // [P][L][item]
            Layout::PageFirst => {
                for t in 0..page as usize {
                    for d in &data {
                        want.extend_from_slice(&d[(3 * page as usize + t) * item as usize..][..item as usize]);
                    }
                }
            }
            // [L][P][item]
            _ => (0..layers).for_each(|l| want.extend(per_layer(l))),
        }
        assert!(flat == want, "{layout}: the last host page differs");
        // And back into device page 0 of layer 2.
        let mut back = DevicePool::new(&device, &cfg).unwrap();
        let page0: Vec<i64> = (0..page as i64).collect();
        host.load_to_device_per_layer(&mut back, &host_tokens[page as usize..], &page0, 2, io).unwrap();
        let got = back.read_buffer(0, 2).unwrap();
        assert!(got[..(page * item) as usize] == per_layer(2)[..], "{layout}: load from the last page differs");
    }
}

/// Host reads through the mapping on one thread while another thread loads from the same host
/// pool: mappings and submissions exclude each other, so neither fails and the bytes are right.
#[test]
fn mapped_reads_race_with_loads() {
    let Some((device, _)) = wgpu(None) else { return };
    let cfg = DevicePoolConfig { kind: PoolKind::Mla, bytes_per_token: 64, slots: 256, page_size: 1, layers: LayerMap::new(2) };
    let mut dev = DevicePool::new(&device, &cfg).unwrap();
    let mut host = HostPool::new(
        &dev,
        &HostPoolConfig { layout: Layout::PageFirst, size: 255, head_num: 1, profile: Profile::Extended, integrity: None },
    )
    .unwrap();
    let data: Vec<u8> = (0..host.geometry().buffer_bytes()).map(|i| (i % 251) as u8).collect();
    host.write_buffer(0, &data).unwrap();
    let idx: Vec<i64> = (0..256).collect();
    std::thread::scope(|s| {
        let reader = s.spawn(|| {
            for _ in 0..50 {
                assert_eq!(host.read_buffer(0).unwrap(), data);
                let _ = host.get_data_page(7).unwrap();
            }
        });
        for round in 0..50 {
            host.load_to_device_per_layer(&mut dev, &idx, &idx, round % 2, IoBackend::Kernel).unwrap();
        }
        reader.join().unwrap();
    });
    let want: Vec<u8> = (0..256usize).flat_map(|t| data[(t * 2 + 1) * 64..][..64].to_vec()).collect();
    assert_eq!(dev.read_buffer(0, 1).unwrap(), want);
}

/// The checksumming gather gives the same bits with 64-bit integers (where the adapter has
/// `SHADER_INT64`) and with 16-bit halves: every item's recorded checksum equals the crate's of
/// its bytes, for 4-byte and 16-byte words, several heads and the DSA indexer's pages.
#[test]
fn checksums_agree_with_and_without_64_bit_integers() {
    if common::open(ExecutorKind::Wgpu).is_none() {
        return;
    }
    for int64 in [false, true] {
        let exec = WgpuExecutor::with_options(WgpuOptions { int64: Some(int64), ..Default::default() }).unwrap();
        let d = exec_describe(&exec);
        assert!(d.contains("checksums in"), "{d}");
        if !int64 {
            assert!(d.contains("16-bit halves"), "{d}");
        }
        let device = Device::Wgpu(exec);
        for (kind, layout, heads, per_token) in [
            (PoolKind::Mha, Layout::PageFirst, 1, 64),
            (PoolKind::Mha, Layout::PageHead, 4, 36),
            (PoolKind::Mla, Layout::LayerFirst, 1, 1152),
            (PoolKind::DsaIndexer, Layout::PageFirst, 1, 132),
        ] {
            let (slots, page) = if kind == PoolKind::DsaIndexer { (8, 4) } else { (32, 4) };
            let cfg = DevicePoolConfig { kind, bytes_per_token: per_token * heads, slots, page_size: page, layers: LayerMap::new(2) };
            let mut dev = DevicePool::new(&device, &cfg).unwrap();
            let mut rng = hicache_io::rng::Rng::new(3);
            for c in 0..kind.components() {
                for b in 0..dev.geometry().buffer_count() {
                    let mut data = vec![0u8; dev.geometry().layer_bytes() as usize];
                    rng.fill(&mut data);
                    dev.write_buffer(c, b, &data).unwrap();
                }
            }
            let hcfg = HostPoolConfig { layout, size: 64, head_num: heads, profile: Profile::Extended, integrity: None };
            let mut host = HostPool::new(&dev, &hcfg).unwrap();
            let units: Vec<u64> = if kind == PoolKind::DsaIndexer { vec![1, 6] } else { (3..11).collect() };
            let p = if kind == PoolKind::DsaIndexer { page } else { 1 };
            let tokens: Vec<i64> = units.iter().flat_map(|u| (u * p..(u + 1) * p).map(|t| t as i64)).collect();
            host.backup_from_device_all_layer(&dev, &tokens, &tokens, IoBackend::Kernel).unwrap();
            let item = dev.geometry().item_bytes() as usize;
            let keys = hicache_io::integrity::Keys::new(hicache_io::integrity::STORAGE_SEED, item / 4 + 1).unwrap();
            for c in 0..kind.components() {
                for layer in 0..2usize {
                    let bytes = dev.read_buffer(c, layer).unwrap();
                    for &u in &units {
                        let want = hicache_io::integrity::checksum(&bytes[u as usize * item..][..item], &keys);
                        let got = host.item_checksum(u, layer as u64, c as u8).unwrap();
                        assert_eq!(got, Some(want), "int64 {int64}: {kind:?} {layout} c{c} L{layer} item {u}");
                    }
                }
            }
        }
    }
}

fn exec_describe(exec: &WgpuExecutor) -> String {
    Device::Wgpu(exec.clone()).describe()
}
