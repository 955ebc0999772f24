//! An engine that owns its KV cache in host memory (the cpu executor): per-layer buffers it
//! allocated and a host region, wrapped by reference. Loads one layer, backs up all layers.
//!
//! `cargo run --example cpu_engine`

use hicache_io::{DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, LayerMap, Layout, PoolKind, Profile};

fn main() -> Result<(), hicache_io::TransferError> {
    // The engine's memory: an MLA cache, 4 layers × 1024 token slots × 576 bf16 (1152 B).
    let (layers, slots, record, page) = (4usize, 1024usize, 1152usize, 64u64);
    let mut kv: Vec<Vec<u8>> = (0..layers).map(|l| vec![l as u8 + 1; slots * record]).collect();
    let config = DevicePoolConfig {
        kind: PoolKind::Mla,
        bytes_per_token: record as u64,
        slots: slots as u64,
        page_size: page,
        layers: LayerMap::new(layers),
    };
    let host_cfg = HostPoolConfig { layout: Layout::PageFirst, size: 4096, head_num: 1, profile: Profile::Extended, integrity: None };
    // The host region is sized by the layout: ask a geometry-only pool, then allocate.
    let host_bytes = HostPool::new(&DevicePool::new(&hicache_io::Device::cpu(), &config)?, &host_cfg)?.geometry().buffer_bytes();
    let mut host_region = vec![0u8; host_bytes as usize];

    let mut dev = DevicePool::from_cpu_slices(&config, vec![kv.iter_mut().map(|b| b.as_mut_slice()).collect()])?;
    let mut host = HostPool::from_cpu_slices(&dev, &host_cfg, vec![host_region.as_mut_slice()])?;

    // Back up pages 2 and 3 of every layer into host pages 40 and 41, then load layer 1 back
    // into pages 10 and 11.
    let dev_slots: Vec<i64> = (2 * 64..4 * 64).collect();
    let host_slots: Vec<i64> = (40 * 64..42 * 64).collect();
    host.backup_from_device_all_layer(&dev, &host_slots, &dev_slots, IoBackend::Kernel)?;
    let back: Vec<i64> = (10 * 64..12 * 64).collect();
    host.load_to_device_per_layer(&mut dev, &host_slots, &back, 1, IoBackend::Kernel)?;
    drop((host, dev));

    assert!(kv[1][10 * 64 * record..12 * 64 * record].iter().all(|&b| b == 2));
    println!("cpu engine: backed up {} tokens × {layers} layers, restored layer 1 in place: ok", dev_slots.len());
    Ok(())
}
