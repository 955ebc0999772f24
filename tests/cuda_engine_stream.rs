//! The cuda executor under a serving engine: backups copy the KV the engine's stream finished
//! writing (they wait for it on the device), and the engine's stream can wait for a layer load
//! without blocking the host. The engine's writes sit behind a slow host function on its stream,
//! so a backup that does not wait copies stale bytes (and the simulated driver reports a race).
//! Runs on a GPU or on the simulated driver (`scripts/cuda-sim.sh`); skips without either,
//! unless `HICACHE_REQUIRE_CUDA=1`.
#![cfg(feature = "cuda")]

mod common;

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaStream};
use hicache_io::exec::cuda::CudaExecutor;
use hicache_io::exec::{Buffer, ExecutorKind};
use hicache_io::{Device, DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, LayerMap, Layout, PoolKind, Profile};

const SLOTS: usize = 256;
/// Bytes of one device layer.
const LAYER_BYTES: usize = SLOTS * ITEM;
const ITEM: usize = 576;
const LAYERS: usize = 3;

unsafe extern "C" fn slow(_: *mut c_void) {
    std::thread::sleep(std::time::Duration::from_millis(30));
}

fn setup() -> Option<(Arc<CudaStream>, CudaExecutor)> {
    let Some(Device::Cuda(probe)) = common::open(ExecutorKind::Cuda) else { return None };
    drop(probe);
    let ctx = CudaContext::new(0).unwrap();
    let engine = ctx.new_stream().unwrap();
    let exec = CudaExecutor::new(0).unwrap();
    exec.set_engine_stream(Some(engine.clone())).unwrap();
    Some((engine, exec))
}

/// The device address of each layer (the engine's view of the pool's memory).
fn layer_ptrs(dev: &DevicePool) -> Vec<u64> {
    (0..LAYERS)
        .map(|l| match dev.buffer(0, l).unwrap() {
            Buffer::Cuda(b) => b.device_ptr(),
            _ => unreachable!("a cuda pool"),
        })
        .collect()
}

/// The engine writes `value` into every byte of each device layer, behind a slow host function
/// on its stream; nothing here waits for it.
fn engine_writes(engine: &CudaStream, layers: &[u64], value: u8) {
    unsafe { result::stream::launch_host_function(engine.cu_stream(), slow, std::ptr::null_mut()) }.unwrap();
    for &ptr in layers {
        // SAFETY: the pool's layer buffer, alive until the end of the test.
        unsafe { result::memset_d8_async(ptr, value, LAYER_BYTES, engine.cu_stream()) }.unwrap();
    }
}

/// An MLA pool pair of `LAYERS` layers, as allocated.
fn mla_pools(device: &Device) -> (DevicePool<'static>, HostPool<'static>) {
    let cfg = DevicePoolConfig {
        kind: PoolKind::Mla,
        bytes_per_token: ITEM as u64,
        slots: SLOTS as u64,
        page_size: 16,
        layers: LayerMap::new(LAYERS),
    };
    let host_cfg =
        HostPoolConfig { layout: Layout::LayerFirst, size: SLOTS as u64, head_num: 1, profile: Profile::Extended, integrity: None };
    let (dev, host, _) = common::pools(device, &cfg, &host_cfg, None);
    (dev, host)
}

#[test]
fn backups_copy_what_the_engine_stream_wrote() {
    let Some((engine, exec)) = setup() else { return };
    let device = Device::Cuda(exec.clone());
    let (mut dev, mut host) = mla_pools(&device);
    assert_eq!(dev.geometry().layer_bytes() as usize, LAYER_BYTES);
    let layers = layer_ptrs(&dev);
    let idx: Vec<i64> = (0..64).collect();
    let host_bytes = |host: &HostPool| host.read_buffer(0).unwrap();
    let slot_bytes = |bytes: &[u8], layer: usize, slot: usize| {
        let host_slots = bytes.len() / (LAYERS * ITEM); // host layer_first: [L][slots][item]
        let at = (layer * host_slots + slot) * ITEM;
        bytes[at..at + ITEM].to_vec()
    };
    let mut value = 0x40;
    for io in [IoBackend::Kernel, IoBackend::Direct] {
        // A plain call.
        value += 1;
        engine_writes(&engine, &layers, value);
        host.backup_from_device_all_layer(&dev, &idx, &idx, io).unwrap();
        let bytes = host_bytes(&host);
        for layer in 0..LAYERS {
            assert!(slot_bytes(&bytes, layer, 5).iter().all(|b| *b == value), "{io:?}: layer {layer} holds stale KV");
        }
        // Through a pipeline opened before the engine's writes.
        value += 1;
        let mut p = host.pipeline(&mut dev).unwrap();
        engine_writes(&engine, &layers, value);
        let t = p.backup(&idx, &idx, io).unwrap();
        p.wait(t).unwrap();
        p.finish().unwrap();
        let bytes = host_bytes(&host);
        for layer in 0..LAYERS {
            assert!(slot_bytes(&bytes, layer, 63).iter().all(|b| *b == value), "{io:?} (pipeline): layer {layer} holds stale KV");
        }
    }
    engine.synchronize().unwrap();
}

#[test]
fn the_engine_stream_waits_for_a_layer_on_the_device() {
    let Some((engine, exec)) = setup() else { return };
    let device = Device::Cuda(exec.clone());
    let (mut dev, mut host) = mla_pools(&device);
    let layers = layer_ptrs(&dev);
    let idx: Vec<i64> = (0..SLOTS as i64).collect();
    // Host pool: every byte 9, through a backup of a device pool the engine filled.
    engine_writes(&engine, &layers, 9);
    host.backup_from_device_all_layer(&dev, &idx, &idx, IoBackend::Kernel).unwrap();
    // Device layers back to 0, on the executor's own stream (ordered before its loads).
    for layer in 0..LAYERS {
        dev.write_buffer(0, layer, &vec![0u8; dev.geometry().layer_bytes() as usize]).unwrap();
    }
    // SAFETY: pinned staging the engine reads each layer into.
    let out = unsafe { result::malloc_host(SLOTS * ITEM, 0) }.unwrap() as *mut u8;
    {
        let loads = host.load_layers(&mut dev, &idx, &idx, IoBackend::Kernel).unwrap();
        // The engine's forward pass: layer 2 waits for its load on the device, then reads it.
        loads.wait_layer_on_stream(2, &engine).unwrap();
        // SAFETY: layer 2's device memory and `out` both hold SLOTS * ITEM bytes.
        unsafe {
            assert_eq!(
                sys::cuMemcpyDtoHAsync_v2(out as *mut c_void, layers[2], SLOTS * ITEM, engine.cu_stream()),
                sys::CUresult::CUDA_SUCCESS
            );
        }
        engine.synchronize().unwrap();
        loads.wait().unwrap();
    }
    // SAFETY: `out` holds SLOTS * ITEM bytes the copy above filled.
    let seen = unsafe { std::slice::from_raw_parts(out, SLOTS * ITEM) };
    assert!(seen.iter().all(|b| *b == 9), "the engine read layer 2 before its load landed");
    unsafe { result::free_host(out as *mut c_void) }.unwrap();
}

/// Checksums keep the engine's pipeline: the engine's stream waits for a checksumming layer load
/// on the device (no host wait), and the layer's completion then names the item whose bytes went
/// bad in host memory; the other layers are sound, and every item landed.
#[test]
fn a_damaged_item_is_reported_by_its_layer_after_a_device_side_wait() {
    let Some((engine, exec)) = setup() else { return };
    let device = Device::Cuda(exec.clone());
    let (mut dev, mut host) = mla_pools(&device);
    assert!(host.integrity_enabled());
    let layers = layer_ptrs(&dev);
    let idx: Vec<i64> = (0..SLOTS as i64).collect();
    engine_writes(&engine, &layers, 9);
    host.backup_from_device_all_layer(&dev, &idx, &idx, IoBackend::Kernel).unwrap();
    let off = host.geometry().addr(0, 1).offset(7, 0) + 3;
    host.inject_host_corruption(0, off, &[0x77]).unwrap();
    let loads = host.load_layers(&mut dev, &idx, &idx, IoBackend::Kernel).unwrap();
    loads.wait_layer_on_stream(1, &engine).unwrap();
    engine.synchronize().unwrap();
    match loads.wait_layer(1) {
        Err(hicache_io::TransferError::Integrity { host_index: 7, layer: 1, items, .. }) => assert_eq!(items.len(), 1),
        other => panic!("layer 1: {other:?}"),
    }
    loads.wait_layer(0).unwrap();
    loads.wait_layer(2).unwrap();
    drop(loads);
    let stats = host.integrity_stats().unwrap();
    assert_eq!((stats.verified, stats.mismatched), (3 * SLOTS as u64 - 1, 1));
    let mut d = dev.read_buffer(0, 1).unwrap();
    assert_eq!(d[7 * ITEM + 3], 0x77, "the damaged item landed as it was read");
    d[7 * ITEM + 3] = 9;
    assert!(d.iter().all(|b| *b == 9));
}
