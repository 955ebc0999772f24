//! An engine on wgpu: it owns the device, the queue and the KV buffers; hicache-io runs its
//! transfers on them without copying into pools of its own.
//!
//! `cargo run --example wgpu_engine` (prints why it skips when no adapter is present)

use hicache_io::exec::wgpu::{WgpuBuffer, WgpuExecutor, WgpuOptions, REQUIRED_USAGES};
use hicache_io::exec::Buffer;
use hicache_io::{Device, DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, LayerMap, Layout, PoolKind, Profile};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The engine's own device and queue.
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    let adapter = match pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions::default())) {
        Ok(a) => a,
        Err(e) => {
            println!("wgpu engine: skipped ({e})");
            return Ok(());
        }
    };
    let (gpu, queue) =
        pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor { required_limits: adapter.limits(), ..Default::default() }))?;

    // DSA indexer cache: 4 layers × 32 pages of 64 tokens × 132 B.
    let config = DevicePoolConfig { kind: PoolKind::DsaIndexer, bytes_per_token: 132, slots: 32, page_size: 64, layers: LayerMap::new(4) };
    let page_bytes = 64 * 132;
    let engine_layers: Vec<wgpu::Buffer> = (0..4)
        .map(|l| {
            let b = gpu.create_buffer(&wgpu::BufferDescriptor {
                label: Some("engine kv layer"),
                size: 32 * page_bytes,
                usage: REQUIRED_USAGES,
                mapped_at_creation: false,
            });
            queue.write_buffer(&b, 0, &vec![l as u8 + 1; (32 * page_bytes) as usize]);
            b
        })
        .collect();

    let exec = WgpuExecutor::from_device(gpu.clone(), queue.clone(), WgpuOptions::default())?;
    let device = Device::Wgpu(exec.clone());
    // SAFETY: the engine's layers were created on `gpu`, the executor's own device.
    let mut dev = DevicePool::from_buffers(
        &device,
        &config,
        vec![engine_layers.iter().cloned().map(|b| Buffer::Wgpu(unsafe { WgpuBuffer::wrap(&exec, b) })).collect()],
    )?;
    let mut host = HostPool::new(
        &dev,
        &HostPoolConfig { layout: Layout::PageFirstDirect, size: 64 * 64, head_num: 1, profile: Profile::Extended, integrity: None },
    )?;

    // Back up device pages 5 and 9 to host pages 0 and 1, load layer 3's copy into page 20.
    let tokens = |pages: &[i64]| pages.iter().flat_map(|p| p * 64..(p + 1) * 64).collect::<Vec<_>>();
    host.backup_from_device_all_layer(&dev, &tokens(&[0, 1]), &tokens(&[5, 9]), IoBackend::Direct)?;
    host.load_to_device_per_layer(&mut dev, &tokens(&[1]), &tokens(&[20]), 3, IoBackend::Direct)?;
    let layer3 = dev.read_buffer(0, 3)?;
    assert!(layer3[(20 * page_bytes) as usize..(21 * page_bytes) as usize].iter().all(|&b| b == 4));
    println!("wgpu engine on {}: backup + load on the engine's buffers: ok", adapter.get_info().name);
    Ok(())
}
