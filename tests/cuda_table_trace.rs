//! sglang's backups on CUDA address layers by tables of layer addresses in GPU memory
//! (`make_kernel_ptr_table`) with CUDA index lists. Once each table has been read (its first
//! use), the all-layer ops (MHA and MLA into page_first, layer_first into layer_first, the DSA
//! indexer's page rows) make no driver call that blocks the calling thread, on the simulated
//! driver's call trace; then the bytes are checked. A table rewritten in place moves nothing and
//! is reported at the next synchronize; forgetting the tables reads it again. Skips outside the
//! simulator (fails when `HICACHE_CUDA_SIM=1` and the simulator is absent).
#![cfg(feature = "cuda")]

mod common;

use std::ffi::c_void;

use cudarc::driver::{result, sys};
use hicache_io::exec::ExecutorKind;
use hicache_io::kvcacheio::{self as kv, CudaIndices, Memory, RawTensor};
use hicache_io::{Device, TransferError};

const LAYERS: usize = 6;
const ITEM: usize = 128;
const SLOTS: usize = 256;
/// The DSA indexer: page rows of 64 tokens × 132 bytes, page indices.
const PAGE_ROW: usize = 64 * 132;
const PAGES: usize = 8;

fn dev_alloc(bytes: usize, fill: impl Fn(usize) -> u8) -> u64 {
    let p = unsafe { result::malloc_sync(bytes) }.unwrap();
    let v: Vec<u8> = (0..bytes).map(fill).collect();
    unsafe { result::memcpy_htod_sync(p, &v) }.unwrap();
    p
}

fn dev_read(p: u64, bytes: usize) -> Vec<u8> {
    let mut v = vec![0u8; bytes];
    unsafe { result::memcpy_dtoh_sync(&mut v, p) }.unwrap();
    v
}

fn table_of(entries: &[u64]) -> u64 {
    let p = unsafe { result::malloc_sync(entries.len() * 8) }.unwrap();
    unsafe { result::memcpy_htod_sync(p, entries) }.unwrap();
    p
}

fn list(v: &[i64]) -> u64 {
    let p = unsafe { result::malloc_sync(v.len() * 8) }.unwrap();
    unsafe { result::memcpy_htod_sync(p, v) }.unwrap();
    p
}

fn pinned(bytes: usize) -> *mut u8 {
    let p = unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP) }.unwrap() as *mut u8;
    unsafe { std::ptr::write_bytes(p, 0, bytes) };
    p
}

#[test]
fn table_addressed_backups_with_cuda_index_lists_never_block_the_host() {
    let Some(trace) = common::sim_trace("cuda-table-trace") else { return };
    let Some(Device::Cuda(exec)) = common::open(ExecutorKind::Cuda) else { panic!("cuda on the simulator") };
    let device = Device::Cuda(exec.clone());
    cudarc::driver::CudaContext::new(0).unwrap().bind_to_thread().unwrap();

    // MHA: K and V layers, one allocation each (sglang's per-layer buffers); MLA: every layer in
    // one allocation (the table's entries evenly spaced); the DSA indexer: page rows.
    let k: Vec<u64> = (0..LAYERS).map(|l| dev_alloc(SLOTS * ITEM, move |i| (i * 7 + l * 31) as u8)).collect();
    let v: Vec<u64> = (0..LAYERS).map(|l| dev_alloc(SLOTS * ITEM, move |i| (i * 11 + l * 5 + 1) as u8)).collect();
    let mla = dev_alloc(LAYERS * SLOTS * ITEM, |i| (i * 13 + 3) as u8);
    let mla_layers: Vec<u64> = (0..LAYERS).map(|l| mla + (l * SLOTS * ITEM) as u64).collect();
    let idx_rows: Vec<u64> = (0..LAYERS).map(|l| dev_alloc(PAGES * PAGE_ROW, move |i| (i * 3 + l) as u8)).collect();
    let copies: Vec<u64> = (0..LAYERS).map(|_| dev_alloc(SLOTS * ITEM, |_| 0)).collect();
    let (kt, vt, mt, it, ct) = (table_of(&k), table_of(&v), table_of(&mla_layers), table_of(&idx_rows), table_of(&copies));
    // Host page_first buffers: [slots][layers][item].
    let page = LAYERS * ITEM;
    let (hk, hv, hm) = (pinned(SLOTS * page), pinned(SLOTS * page), pinned(SLOTS * page));
    let hi_rows = pinned(PAGES * LAYERS * PAGE_ROW);
    let host = |p: *mut u8, bytes: usize, row: usize| unsafe {
        RawTensor::new(p as u64, bytes as u64, vec![(bytes / row) as u64, row as u64], Memory::Host)
    };
    let (hk_t, hv_t, hm_t) = (host(hk, SLOTS * page, page), host(hv, SLOTS * page, page), host(hm, SLOTS * page, page));
    let hi_t = host(hi_rows, PAGES * LAYERS * PAGE_ROW, LAYERS * PAGE_ROW);
    let (dev_src, host_dst): (Vec<i64>, Vec<i64>) = ((0..64).map(|i| (i * 3) % SLOTS as i64).collect(), (100..164).collect());
    let (page_src, page_dst): (Vec<i64>, Vec<i64>) = (vec![5, 0, 7], vec![1, 6, 2]);
    let lists = [list(&dev_src), list(&host_dst), list(&page_src), list(&page_dst)];
    let idx = |p: u64, n: usize| unsafe { CudaIndices::new(p, n) };
    result::ctx::synchronize().unwrap();

    // First use: each table is read once (this waits for the stream).
    for (t, n) in [(kt, LAYERS), (vt, LAYERS), (mt, LAYERS), (it, LAYERS), (ct, LAYERS)] {
        unsafe { exec.layer_table(t, n) }.unwrap();
    }
    exec.synchronize().unwrap();

    let before = std::fs::read_to_string(&trace).unwrap_or_default().lines().count();
    let table = |t: u64| unsafe { exec.layer_table(t, LAYERS) }.unwrap();
    let (ktab, vtab, mtab, itab, ctab) = (table(kt), table(vt), table(mt), table(it), table(ct));
    let n = dev_src.len();
    kv::transfer_kv_all_layer_lf_pf(
        &device,
        &ktab,
        &hk_t,
        &vtab,
        &hv_t,
        idx(lists[0], n),
        idx(lists[1], n),
        ITEM as i64,
        page as i64,
        LAYERS as i64,
    )
    .unwrap();
    kv::transfer_kv_all_layer_mla_lf_pf(&device, &mtab, &hm_t, idx(lists[0], n), idx(lists[1], n), ITEM as i64, page as i64, LAYERS as i64)
        .unwrap();
    kv::transfer_kv_all_layer_mla_lf_pf(
        &device,
        &itab,
        &hi_t,
        idx(lists[2], 3),
        idx(lists[3], 3),
        PAGE_ROW as i64,
        (LAYERS * PAGE_ROW) as i64,
        LAYERS as i64,
    )
    .unwrap();
    kv::transfer_kv_all_layer_mla(&device, &mtab, &ctab, idx(lists[0], n), idx(lists[1], n), ITEM as i64, LAYERS as i64).unwrap();
    let issued = std::fs::read_to_string(&trace).unwrap();
    exec.synchronize().unwrap();
    let calls: Vec<&str> = issued.lines().skip(before).collect();
    assert!(calls.iter().any(|l| l.contains(" cuLaunchKernel ")), "the ops launched nothing: {calls:#?}");
    let blocking: Vec<&&str> = calls.iter().filter(|l| l.contains("blocked=1")).collect();
    assert!(blocking.is_empty(), "host-blocking driver calls while issuing: {blocking:#?}");

    // The bytes.
    let host_bytes = |p: *mut u8, len: usize| unsafe { std::slice::from_raw_parts(p, len) }.to_vec();
    let (gk, gv, gm, gi) = (
        host_bytes(hk, SLOTS * page),
        host_bytes(hv, SLOTS * page),
        host_bytes(hm, SLOTS * page),
        host_bytes(hi_rows, PAGES * LAYERS * PAGE_ROW),
    );
    let mla_now = dev_read(mla, LAYERS * SLOTS * ITEM);
    for l in 0..LAYERS {
        let (ks, vs) = (dev_read(k[l], SLOTS * ITEM), dev_read(v[l], SLOTS * ITEM));
        for (&s, &d) in dev_src.iter().zip(&host_dst) {
            let (s, d) = (s as usize, d as usize);
            assert_eq!(&gk[d * page + l * ITEM..][..ITEM], &ks[s * ITEM..][..ITEM], "K layer {l} slot {s}");
            assert_eq!(&gv[d * page + l * ITEM..][..ITEM], &vs[s * ITEM..][..ITEM], "V layer {l} slot {s}");
            assert_eq!(&gm[d * page + l * ITEM..][..ITEM], &mla_now[(l * SLOTS + s) * ITEM..][..ITEM], "MLA layer {l} slot {s}");
        }
        let rows = dev_read(idx_rows[l], PAGES * PAGE_ROW);
        for (&s, &d) in page_src.iter().zip(&page_dst) {
            let (s, d) = (s as usize, d as usize);
            assert_eq!(&gi[(d * LAYERS + l) * PAGE_ROW..][..PAGE_ROW], &rows[s * PAGE_ROW..][..PAGE_ROW], "indexer layer {l} page {s}");
        }
        let c = dev_read(copies[l], SLOTS * ITEM);
        for (&s, &d) in dev_src.iter().zip(&host_dst) {
            let (s, d) = (s as usize, d as usize);
            assert_eq!(&c[d * ITEM..][..ITEM], &mla_now[(l * SLOTS + s) * ITEM..][..ITEM], "layer copy {l} slot {s}");
        }
    }

    // A table rewritten in place (two layers swapped): the next call moves nothing and is
    // reported at the next synchronize.
    let mut swapped = k.clone();
    swapped.swap(0, 1);
    unsafe { result::memcpy_htod_sync(kt, &swapped) }.unwrap();
    result::ctx::synchronize().unwrap();
    let snapshot = (host_bytes(hk, SLOTS * page), host_bytes(hv, SLOTS * page));
    let ktab = table(kt);
    kv::transfer_kv_all_layer_lf_pf(
        &device,
        &ktab,
        &hk_t,
        &vtab,
        &hv_t,
        idx(lists[0], n),
        idx(lists[1], n),
        ITEM as i64,
        page as i64,
        LAYERS as i64,
    )
    .unwrap();
    let err = exec.synchronize().unwrap_err();
    match &err {
        TransferError::DeviceIndexCheck { source, .. } => {
            assert!(matches!(**source, TransferError::LayerTableChanged { table, entry: 0 } if table == kt), "{err}")
        }
        other => panic!("expected the table check, got {other}"),
    }
    assert_eq!((host_bytes(hk, SLOTS * page), host_bytes(hv, SLOTS * page)), snapshot, "a refused call moved bytes");
    // Forgotten, the table is read again and its new order moves.
    exec.forget_layer_tables().unwrap();
    let ktab = table(kt);
    assert_eq!(ktab.entries(), &swapped[..]);
    kv::transfer_kv_all_layer_lf_pf(
        &device,
        &ktab,
        &hk_t,
        &vtab,
        &hv_t,
        idx(lists[0], n),
        idx(lists[1], n),
        ITEM as i64,
        page as i64,
        LAYERS as i64,
    )
    .unwrap();
    exec.synchronize().unwrap();
    let gk = host_bytes(hk, SLOTS * page);
    let k1 = dev_read(k[1], SLOTS * ITEM);
    let (s, d) = (dev_src[3] as usize, host_dst[3] as usize);
    assert_eq!(&gk[d * page..][..ITEM], &k1[s * ITEM..][..ITEM], "layer 0 now reads K layer 1");

    // An index past a table's layers (bounded by their allocations): refused on the device.
    let past = list(&[SLOTS as i64]);
    let one = list(&[0]);
    result::ctx::synchronize().unwrap();
    kv::transfer_kv_all_layer_lf_pf(
        &device,
        &ktab,
        &hk_t,
        &vtab,
        &hv_t,
        idx(past, 1),
        idx(one, 1),
        ITEM as i64,
        page as i64,
        LAYERS as i64,
    )
    .unwrap();
    let err = exec.synchronize().unwrap_err();
    assert!(
        matches!(&err, TransferError::DeviceIndexCheck { source, .. } if matches!(**source, TransferError::IndexOutOfRange { .. })),
        "{err}"
    );

    unsafe {
        for p in k.into_iter().chain(v).chain(idx_rows).chain(copies).chain([mla, kt, vt, mt, it, ct, past, one]).chain(lists) {
            result::free_sync(p).unwrap();
        }
        for h in [hk, hv, hm, hi_rows] {
            result::free_host(h as *mut c_void).unwrap();
        }
    }
    let _ = std::fs::remove_file(&trace);
}
