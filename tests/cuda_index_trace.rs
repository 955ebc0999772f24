//! sglang's layer pipeline with CUDA index lists (what it passes whenever `io_backend=kernel`):
//! 61 per-layer loads and an all-layer backup through the `kvcacheio` ops make no driver call
//! that blocks the calling thread — the lists are checked on the device, never copied to the
//! host — on the simulated driver's call trace; then the bytes are checked. Skips outside the
//! simulator (fails when `HICACHE_CUDA_SIM=1`, as `scripts/cuda-sim.sh` sets, and the simulator
//! is absent).
#![cfg(feature = "cuda")]

mod common;

use std::ffi::c_void;

use cudarc::driver::{result, sys};
use hicache_io::exec::ExecutorKind;
use hicache_io::kvcacheio::{self as kv, CudaIndices, Memory, RawTensor};
use hicache_io::Device;

const LAYERS: usize = 61;
const ITEM: usize = 656;
const SLOTS: usize = 512;

#[test]
fn sixty_one_layer_loads_and_a_backup_with_cuda_index_lists_never_block_the_host() {
    let Some(trace) = common::sim_trace("cuda-index-trace") else { return };
    let Some(Device::Cuda(exec)) = common::open(ExecutorKind::Cuda) else { panic!("cuda on the simulator") };
    let device = Device::Cuda(exec.clone());
    cudarc::driver::CudaContext::new(0).unwrap().bind_to_thread().unwrap();
    // The host pool: page_first, [slots][layers][item], pinned; the device pool: a layer each.
    let host_bytes = SLOTS * LAYERS * ITEM;
    let host =
        unsafe { result::malloc_host(host_bytes, sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP) }.unwrap() as *mut u8;
    let pattern: Vec<u8> = (0..host_bytes).map(|i| (i % 251) as u8).collect();
    unsafe { std::ptr::copy_nonoverlapping(pattern.as_ptr(), host, host_bytes) };
    let (layers, layer_t) = device_layers();
    let list = |v: &[i64]| -> u64 {
        let p = unsafe { result::malloc_sync(v.len() * 8) }.unwrap();
        unsafe { result::memcpy_htod_sync(p, v) }.unwrap();
        p
    };
    let (hi, di): (Vec<i64>, Vec<i64>) = ((0..128).collect(), (256..384).collect());
    let (bhi, bdi): (Vec<i64>, Vec<i64>) = ((384..512).collect(), (0..128).collect());
    let lists = [list(&hi), list(&di), list(&bdi), list(&bhi)];
    result::ctx::synchronize().unwrap();
    let idx = |p: u64, n: usize| unsafe { CudaIndices::new(p, n) };
    let host_t = unsafe { RawTensor::new(host as u64, host_bytes as u64, vec![SLOTS as u64, (LAYERS * ITEM) as u64], Memory::Host) };

    let before = std::fs::read_to_string(&trace).unwrap_or_default().lines().count();
    for (l, t) in layer_t.iter().enumerate() {
        kv::transfer_kv_per_layer_mla_pf_lf(
            &device,
            &host_t,
            t,
            idx(lists[0], 128),
            idx(lists[1], 128),
            l as i64,
            ITEM as i64,
            (LAYERS * ITEM) as i64,
        )
        .unwrap();
    }
    // Backup: device slots 0..128 of every layer → host slots 384..512 (src = device, dst = host).
    kv::transfer_kv_all_layer_mla_lf_pf(
        &device,
        &layer_t,
        &host_t,
        idx(lists[2], 128),
        idx(lists[3], 128),
        ITEM as i64,
        (LAYERS * ITEM) as i64,
        LAYERS as i64,
    )
    .unwrap();
    // And a layer-list op (one call per layer inside): device layers → a second set of layers.
    let (copies, copy_t) = device_layers();
    kv::transfer_kv_all_layer_mla(&device, &layer_t, &copy_t, idx(lists[1], 128), idx(lists[2], 128), ITEM as i64, LAYERS as i64).unwrap();
    let issued = std::fs::read_to_string(&trace).unwrap();
    exec.synchronize().unwrap();
    let calls: Vec<&str> = issued.lines().skip(before).collect();
    // Each per-layer load: three check launches and its gather; the backup (one plan over every
    // layer): one check and one gather; the layer-list op: one check its layers share, and a
    // gather per layer.
    let launches = calls.iter().filter(|l| l.contains(" cuLaunchKernel ")).count();
    assert_eq!(launches, 4 * LAYERS + 4 + 3 + LAYERS, "kernel launches of {} calls traced", calls.len());
    let blocking: Vec<&&str> = calls.iter().filter(|l| l.contains("blocked=1")).collect();
    assert!(blocking.is_empty(), "host-blocking driver calls while issuing: {blocking:#?}");

    let host_now = unsafe { std::slice::from_raw_parts(host, host_bytes) };
    check_bytes(&layers, &copies, &pattern, host_now);
    unsafe {
        for p in layers.into_iter().chain(copies).chain(lists) {
            result::free_sync(p).unwrap();
        }
        result::free_host(host as *mut c_void).unwrap();
    }
    let _ = std::fs::remove_file(&trace);
}

/// `LAYERS` device layers of `SLOTS` items, one allocation each, and their tensors.
fn device_layers() -> (Vec<u64>, Vec<RawTensor>) {
    let layers: Vec<u64> = (0..LAYERS).map(|_| unsafe { result::malloc_sync(SLOTS * ITEM) }.unwrap()).collect();
    let tensors = layers
        .iter()
        .map(|&p| unsafe { RawTensor::new(p, (SLOTS * ITEM) as u64, vec![SLOTS as u64, ITEM as u64], Memory::CudaDevice) })
        .collect();
    (layers, tensors)
}

/// The bytes the loads, the backup and the layer-list op moved (`pattern`: the host's bytes
/// before; `host_now`: after).
fn check_bytes(layers: &[u64], copies: &[u64], pattern: &[u8], host_now: &[u8]) {
    // The bytes: each layer got host slots 0..128 at device slots 256..384; the backup wrote
    // device slots 0..128 (whatever the new allocation held) to host slots 384..512.
    let page = LAYERS * ITEM;
    for (l, &p) in layers.iter().enumerate() {
        let mut got = vec![0u8; SLOTS * ITEM];
        unsafe { result::memcpy_dtoh_sync(&mut got, p) }.unwrap();
        for j in 0..128usize {
            let want = &pattern[j * page + l * ITEM..][..ITEM];
            assert_eq!(&got[(256 + j) * ITEM..][..ITEM], want, "layer {l} slot {}", 256 + j);
        }
        for j in 0..128usize {
            assert_eq!(&host_now[(384 + j) * page + l * ITEM..][..ITEM], &got[j * ITEM..][..ITEM], "backup layer {l} slot {j}");
        }
    }
    // The layer-list op: device slots 256..384 of each layer → slots 0..128 of its copy.
    for (l, (&p, &c)) in layers.iter().zip(copies).enumerate() {
        let (mut a, mut b) = (vec![0u8; SLOTS * ITEM], vec![0u8; SLOTS * ITEM]);
        unsafe { result::memcpy_dtoh_sync(&mut a, p) }.unwrap();
        unsafe { result::memcpy_dtoh_sync(&mut b, c) }.unwrap();
        assert_eq!(&b[..128 * ITEM], &a[256 * ITEM..384 * ITEM], "layer copy {l}");
    }
}
