//! An engine on CUDA: its stream, its per-layer device allocations and its host region
//! (registered here with `cuMemHostRegister`). Transfers are enqueued on the engine's stream;
//! a completion event lets the forward pass wait for one layer only.
//!
//! `cargo run --example cuda_engine` (prints why it skips without a driver or GPU)

use hicache_io::exec::cuda::{CudaBuffer, CudaExecutor, LaunchTuning};
use hicache_io::exec::{Buffer, ExecutorKind};
use hicache_io::{Device, DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, LayerMap, Layout, PoolKind, Profile};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let probe = match Device::open(ExecutorKind::Cuda) {
        Ok(Device::Cuda(e)) => e,
        Ok(_) => unreachable!(),
        Err(e) => {
            println!("cuda engine: skipped ({e})");
            return Ok(());
        }
    };
    // The engine's stream; hicache-io enqueues on it.
    let ctx = cudarc::driver::CudaContext::new(0)?;
    let stream = ctx.new_stream()?;
    let exec = CudaExecutor::from_stream(stream.clone(), LaunchTuning::default())?;
    drop(probe);
    let device = Device::Cuda(exec.clone());

    // MLA cache, 4 layers × 4096 tokens × 656 B (FP8 DSA MLA record), engine-allocated.
    let config = DevicePoolConfig { kind: PoolKind::Mla, bytes_per_token: 656, slots: 4096, page_size: 64, layers: LayerMap::new(4) };
    let engine_layers: Vec<cudarc::driver::CudaSlice<u8>> =
        (0..4).map(|_| stream.alloc_zeros::<u8>(4096 * 656)).collect::<Result<_, _>>()?;
    let layers = engine_layers
        .iter()
        .map(|s| {
            use cudarc::driver::DevicePtr;
            let (ptr, _sync) = s.device_ptr(&stream);
            // SAFETY: the slices outlive the pool (dropped after it, below).
            Buffer::Cuda(unsafe { CudaBuffer::from_device_ptr(&exec, ptr, 4096 * 656) })
        })
        .collect();
    let mut dev = DevicePool::from_buffers(&device, &config, vec![layers])?;
    let host_cfg = HostPoolConfig { layout: Layout::PageFirst, size: 8192, head_num: 1, profile: Profile::Extended, integrity: None };
    let host_bytes = HostPool::new(&DevicePool::new(&Device::cpu(), &config)?, &host_cfg)?.geometry().buffer_bytes() as usize;
    let mut region = vec![7u8; host_bytes];
    // SAFETY: `region` outlives the host pool and is not touched while transfers run.
    let hbuf = unsafe { CudaBuffer::from_host_ptr(&exec, region.as_mut_ptr(), host_bytes as u64, true)? };
    let mut host = HostPool::from_buffers(&dev, &host_cfg, vec![Buffer::Cuda(hbuf)])?;

    let tokens: Vec<i64> = (0..512).collect();
    host.load_to_device_per_layer(&mut dev, &tokens, &tokens, 2, IoBackend::Kernel)?;
    let layer2_ready = exec.record()?; // the forward pass would wait on this event
    host.backup_from_device_all_layer(&dev, &tokens, &tokens, IoBackend::Kernel)?;
    layer2_ready.wait()?;
    exec.synchronize()?;
    assert!(dev.read_buffer(0, 2)?[..512 * 656].iter().all(|&b| b == 7));
    drop((host, dev));
    println!("cuda engine on {}: load + backup on the engine's stream and memory: ok", ctx.name()?);
    Ok(())
}
