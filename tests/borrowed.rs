//! Borrowed memory: pools that wrap an engine's own buffers behave byte for byte like pools
//! that own theirs (cpu and wgpu; cuda compiles and skips without a GPU), and undersized,
//! mis-counted or wrongly-flagged buffers are rejected before any byte moves.
#![allow(clippy::needless_range_loop, clippy::too_many_arguments)] // index loops mirror sglang's test code

mod common;

use hicache_io::exec::{Buffer, ExecutorKind};
use hicache_io::plan::Op;
use hicache_io::tools::check::{random_case, supported_cells, Case, Rng};
use hicache_io::{Device, DevicePool, HostPool, Profile, TransferError};

/// Initial bytes for a case: `[comp][buffer]` device layers and the host buffers (one per
/// component; page_unified's one).
fn contents(case: &Case) -> (Vec<Vec<Vec<u8>>>, Vec<Vec<u8>>) {
    let owned = DevicePool::new(&Device::cpu(), &case.device).unwrap();
    let host = HostPool::new(&owned, &case.host).unwrap();
    let g = owned.geometry();
    let mut rng = Rng::new(case.seed);
    let comps = g.kind().components();
    let mut dev = vec![vec![vec![0u8; g.layer_bytes() as usize]; g.buffer_count()]; comps];
    let mut hst = vec![vec![0u8; host.geometry().buffer_bytes() as usize]; host.geometry().buffers()];
    dev.iter_mut().flatten().for_each(|b| rng.fill(b));
    hst.iter_mut().for_each(|b| rng.fill(b));
    (dev, hst)
}

fn apply(case: &Case, host: &mut HostPool, dev: &mut DevicePool) {
    let (hi, di, io) = (&case.host_indices, &case.device_indices, case.cell.io);
    match case.op {
        Op::Load { layer_id, is_draft: false } => host.load_to_device_per_layer(dev, hi, di, layer_id, io).unwrap(),
        Op::Load { layer_id, is_draft: true } => host.load_draft_to_device(dev, hi, di, layer_id, io).unwrap(),
        Op::Backup => host.backup_from_device_all_layer(dev, hi, di, io).unwrap(),
        Op::BackupLayer { layer_id, is_draft } => host.backup_from_device_per_layer(dev, hi, di, layer_id, is_draft, io).unwrap(),
    }
}

/// Runs `case` on owned pools of `device`; returns the final bytes.
fn run_owned(device: &Device, case: &Case) -> (Vec<Vec<Vec<u8>>>, Vec<Vec<u8>>) {
    let (dev0, host0) = contents(case);
    let mut dev = DevicePool::new(device, &case.device).unwrap();
    let mut host = HostPool::new(&dev, &case.host).unwrap();
    for (c, bufs) in dev0.iter().enumerate() {
        for (s, b) in bufs.iter().enumerate() {
            dev.write_buffer(c, s, b).unwrap();
        }
    }
    for (c, b) in host0.iter().enumerate() {
        host.write_buffer(c, b).unwrap();
    }
    apply(case, &mut host, &mut dev);
    let g = dev.geometry().clone();
    let d = (0..g.kind().components()).map(|c| (0..g.buffer_count()).map(|s| dev.read_buffer(c, s).unwrap()).collect()).collect();
    let h = (0..host.geometry().buffers()).map(|c| host.read_buffer(c).unwrap()).collect();
    (d, h)
}

#[test]
fn cpu_borrowed_slices_match_owned_pools() {
    let mut rng = Rng::new(3);
    for profile in [Profile::Extended, Profile::Sglang] {
        for cell in supported_cells(profile) {
            let case = random_case(cell, profile, &mut rng);
            let want = run_owned(&Device::cpu(), &case);
            // The engine's memory: plain Vecs, wrapped by reference.
            let (mut dev_mem, mut host_mem) = contents(&case);
            {
                let layers: Vec<Vec<&mut [u8]>> = dev_mem.iter_mut().map(|c| c.iter_mut().map(|b| b.as_mut_slice()).collect()).collect();
                let mut dev = DevicePool::from_cpu_slices(&case.device, layers).unwrap();
                let mut host =
                    HostPool::from_cpu_slices(&dev, &case.host, host_mem.iter_mut().map(|b| b.as_mut_slice()).collect()).unwrap();
                apply(&case, &mut host, &mut dev);
            }
            assert!(dev_mem == want.0 && host_mem == want.1, "{cell}: borrowed and owned pools differ");
        }
    }
}

#[test]
fn cpu_borrowed_buffers_are_validated() {
    let case = random_case(supported_cells(Profile::Extended)[0], Profile::Extended, &mut Rng::new(1));
    let (mut dev_mem, _) = contents(&case);
    let mut small = dev_mem.clone();
    let n = small[0][0].len();
    small[0][0].truncate(n - 1);
    let layers: Vec<Vec<&mut [u8]>> = small.iter_mut().map(|c| c.iter_mut().map(|b| b.as_mut_slice()).collect()).collect();
    let err = DevicePool::from_cpu_slices(&case.device, layers).err().unwrap();
    assert!(matches!(err, TransferError::BufferSize { .. }), "{err:?}");
    let mut layers: Vec<Vec<&mut [u8]>> = dev_mem.iter_mut().map(|c| c.iter_mut().map(|b| b.as_mut_slice()).collect()).collect();
    layers[0].pop();
    let err = DevicePool::from_cpu_slices(&case.device, layers).err().unwrap();
    assert!(matches!(err, TransferError::InvalidConfig(_)), "{err:?}");
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_engine_buffers_match_owned_pools() {
    use hicache_io::exec::wgpu::{WgpuBuffer, WgpuExecutor, WgpuOptions, REQUIRED_USAGES};
    let Some(Device::Wgpu(probe)) = common::open(ExecutorKind::Wgpu) else { return };
    // The engine's device, queue and buffers; hicache-io runs on them.
    let (gpu, queue) = (probe.device().clone(), probe.queue().clone());
    let exec = WgpuExecutor::from_device(gpu.clone(), queue.clone(), WgpuOptions::default()).unwrap();
    let device = Device::Wgpu(exec.clone());
    let make = |bytes: &[u8], usage| {
        let b = gpu.create_buffer(&wgpu::BufferDescriptor {
            label: Some("engine"),
            size: (bytes.len() as u64).next_multiple_of(4),
            usage,
            mapped_at_creation: false,
        });
        let mut padded = bytes.to_vec();
        padded.resize(b.size() as usize, 0);
        queue.write_buffer(&b, 0, &padded);
        b
    };
    let mut rng = Rng::new(4);
    for profile in [Profile::Extended, Profile::Sglang] {
        for cell in supported_cells(profile) {
            let case = random_case(cell, profile, &mut rng);
            let want = run_owned(&device, &case);
            let (dev0, host0) = contents(&case);
            let layers = dev0
                .iter()
                .map(|c| c.iter().map(|b| Buffer::Wgpu(unsafe { WgpuBuffer::wrap(&exec, make(b, REQUIRED_USAGES)) })).collect())
                .collect();
            let mut dev = DevicePool::from_buffers(&device, &case.device, layers).unwrap();
            let hosts = host0.iter().map(|b| Buffer::Wgpu(unsafe { WgpuBuffer::wrap(&exec, make(b, REQUIRED_USAGES)) })).collect();
            let mut host = HostPool::from_buffers(&dev, &case.host, hosts).unwrap();
            apply(&case, &mut host, &mut dev);
            let g = dev.geometry().clone();
            for c in 0..host.geometry().buffers() {
                assert!(host.read_buffer(c).unwrap() == want.1[c], "{cell}: host {c}");
            }
            for c in 0..g.kind().components() {
                for s in 0..g.buffer_count() {
                    assert!(dev.read_buffer(c, s).unwrap() == want.0[c][s], "{cell}: device {c}/{s}");
                }
            }
        }
    }
    // A buffer without COPY_SRC is refused, naming the flag.
    let case = random_case(supported_cells(Profile::Extended)[0], Profile::Extended, &mut rng);
    let (dev0, _) = contents(&case);
    let layers = dev0
        .iter()
        .map(|c| {
            c.iter()
                .map(|b| {
                    Buffer::Wgpu(unsafe { WgpuBuffer::wrap(&exec, make(b, wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST)) })
                })
                .collect()
        })
        .collect();
    let err = DevicePool::from_buffers(&device, &case.device, layers).err().unwrap();
    assert!(err.to_string().contains("COPY_SRC"), "{err}");
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_borrowed_memory_skips_without_a_gpu() {
    use hicache_io::exec::cuda::CudaBuffer;
    let Some(Device::Cuda(exec)) = common::open(ExecutorKind::Cuda) else { return };
    let device = Device::Cuda(exec.clone());
    let case = random_case(supported_cells(Profile::Extended)[0], Profile::Extended, &mut Rng::new(8));
    let want = run_owned(&device, &case);
    let (dev0, mut host0) = contents(&case);
    // Engine-side allocations: device layers from an owned pool's buffers are not reachable, so
    // allocate through the executor and wrap raw pointers, as an engine would hand them over.
    let owned = DevicePool::new(&device, &case.device).unwrap();
    let layers = (0..dev0.len())
        .map(|c| {
            (0..dev0[c].len())
                .map(|s| {
                    let Ok(Buffer::Cuda(b)) = owned.buffer(c, s) else { unreachable!() };
                    Buffer::Cuda(unsafe {
                        CudaBuffer::from_device_ptr(&exec, b.device_ptr(), case.device.geometry().unwrap().layer_bytes())
                    })
                })
                .collect()
        })
        .collect();
    let mut dev = DevicePool::from_buffers(&device, &case.device, layers).unwrap();
    for (c, bufs) in dev0.iter().enumerate() {
        for (s, b) in bufs.iter().enumerate() {
            dev.write_buffer(c, s, b).unwrap();
        }
    }
    let hosts = host0
        .iter_mut()
        .map(|b| Buffer::Cuda(unsafe { CudaBuffer::from_host_ptr(&exec, b.as_mut_ptr(), b.len() as u64, true) }.unwrap()))
        .collect();
    let mut host = HostPool::from_buffers(&dev, &case.host, hosts).unwrap();
    apply(&case, &mut host, &mut dev);
    for c in 0..dev0.len() {
        assert!(host.read_buffer(c).unwrap() == want.1[c]);
        for s in 0..dev0[c].len() {
            assert!(dev.read_buffer(c, s).unwrap() == want.0[c][s]);
        }
    }
}
