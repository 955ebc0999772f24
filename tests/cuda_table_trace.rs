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
use hicache_io::exec::cuda::CudaExecutor;
use hicache_io::exec::ExecutorKind;
use hicache_io::kvcacheio::{self as kv, CudaIndices, LayerTable, Memory, RawTensor};
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

/// A test's device and host memory: MHA K and V layers, one allocation each (sglang's per-layer
/// buffers); MLA, every layer in one allocation (the table's entries evenly spaced); the DSA
/// indexer's page rows; layer copies' destinations; their tables; pinned host page_first buffers
/// (`[slots][layers][item]`) and the index lists on the device.
struct Mem {
    k: Vec<u64>,
    v: Vec<u64>,
    mla: u64,
    idx_rows: Vec<u64>,
    copies: Vec<u64>,
    /// The tables of `k`, `v`, the MLA layers, `idx_rows` and `copies`.
    tables: [u64; 5],
    /// Host K, V, MLA and indexer buffers, and their tensors.
    hosts: [*mut u8; 4],
    tensors: [RawTensor; 4],
    dev_src: Vec<i64>,
    host_dst: Vec<i64>,
    page_src: Vec<i64>,
    page_dst: Vec<i64>,
    /// `dev_src`, `host_dst`, `page_src`, `page_dst` on the device.
    lists: [u64; 4],
}

/// Bytes of a host page (every layer's item of one slot).
const PAGE: usize = LAYERS * ITEM;

impl Mem {
    fn new() -> Mem {
        let k: Vec<u64> = (0..LAYERS).map(|l| dev_alloc(SLOTS * ITEM, move |i| (i * 7 + l * 31) as u8)).collect();
        let v: Vec<u64> = (0..LAYERS).map(|l| dev_alloc(SLOTS * ITEM, move |i| (i * 11 + l * 5 + 1) as u8)).collect();
        let mla = dev_alloc(LAYERS * SLOTS * ITEM, |i| (i * 13 + 3) as u8);
        let mla_layers: Vec<u64> = (0..LAYERS).map(|l| mla + (l * SLOTS * ITEM) as u64).collect();
        let idx_rows: Vec<u64> = (0..LAYERS).map(|l| dev_alloc(PAGES * PAGE_ROW, move |i| (i * 3 + l) as u8)).collect();
        let copies: Vec<u64> = (0..LAYERS).map(|_| dev_alloc(SLOTS * ITEM, |_| 0)).collect();
        let tables = [table_of(&k), table_of(&v), table_of(&mla_layers), table_of(&idx_rows), table_of(&copies)];
        let hosts = [pinned(SLOTS * PAGE), pinned(SLOTS * PAGE), pinned(SLOTS * PAGE), pinned(PAGES * LAYERS * PAGE_ROW)];
        let host = |p: *mut u8, bytes: usize, row: usize| unsafe {
            RawTensor::new(p as u64, bytes as u64, vec![(bytes / row) as u64, row as u64], Memory::Host)
        };
        let tensors = [
            host(hosts[0], SLOTS * PAGE, PAGE),
            host(hosts[1], SLOTS * PAGE, PAGE),
            host(hosts[2], SLOTS * PAGE, PAGE),
            host(hosts[3], PAGES * LAYERS * PAGE_ROW, LAYERS * PAGE_ROW),
        ];
        let (dev_src, host_dst): (Vec<i64>, Vec<i64>) = ((0..64).map(|i| (i * 3) % SLOTS as i64).collect(), (100..164).collect());
        let (page_src, page_dst): (Vec<i64>, Vec<i64>) = (vec![5, 0, 7], vec![1, 6, 2]);
        let lists = [list(&dev_src), list(&host_dst), list(&page_src), list(&page_dst)];
        result::ctx::synchronize().unwrap();
        Mem { k, v, mla, idx_rows, copies, tables, hosts, tensors, dev_src, host_dst, page_src, page_dst, lists }
    }

    /// Host buffer `j`'s bytes now.
    fn host_bytes(&self, j: usize) -> Vec<u8> {
        let len = if j == 3 { PAGES * LAYERS * PAGE_ROW } else { SLOTS * PAGE };
        unsafe { std::slice::from_raw_parts(self.hosts[j], len) }.to_vec()
    }

    fn free(self, more: &[u64]) {
        unsafe {
            for p in self.k.into_iter().chain(self.v).chain(self.idx_rows).chain(self.copies).chain([self.mla]).chain(self.tables) {
                result::free_sync(p).unwrap();
            }
            for &p in more.iter().chain(&self.lists) {
                result::free_sync(p).unwrap();
            }
            for h in self.hosts {
                result::free_host(h as *mut c_void).unwrap();
            }
        }
    }
}

fn idx(p: u64, n: usize) -> CudaIndices {
    unsafe { CudaIndices::new(p, n) }
}

fn table(exec: &CudaExecutor, t: u64) -> LayerTable {
    unsafe { exec.layer_table(t, LAYERS) }.unwrap()
}

/// The MHA backup of `n` indices from device list `src` to host list `dst`, K by `ktab`.
fn mha_backup(device: &Device, m: &Mem, ktab: &LayerTable, vtab: &LayerTable, (src, dst, n): (u64, u64, usize)) {
    let [hk, hv, _, _] = &m.tensors;
    kv::transfer_kv_all_layer_lf_pf(device, ktab, hk, vtab, hv, idx(src, n), idx(dst, n), ITEM as i64, PAGE as i64, LAYERS as i64).unwrap();
}

#[test]
fn table_addressed_backups_with_cuda_index_lists_never_block_the_host() {
    let Some(trace) = common::sim_trace("cuda-table-trace") else { return };
    let Some(Device::Cuda(exec)) = common::open(ExecutorKind::Cuda) else { panic!("cuda on the simulator") };
    let device = Device::Cuda(exec.clone());
    cudarc::driver::CudaContext::new(0).unwrap().bind_to_thread().unwrap();
    let m = Mem::new();
    issued_without_blocking(&exec, &device, &m, &trace);
    backed_up_bytes_match(&m);
    let past = changed_tables_and_bad_indices_are_refused(&exec, &device, &m);
    m.free(&past);
    let _ = std::fs::remove_file(&trace);
}

/// Once each table was read (its first use, which waits for the stream), the all-layer ops make
/// no host-blocking driver call while they are issued.
fn issued_without_blocking(exec: &CudaExecutor, device: &Device, m: &Mem, trace: &std::path::Path) {
    for t in m.tables {
        unsafe { exec.layer_table(t, LAYERS) }.unwrap();
    }
    exec.synchronize().unwrap();

    let before = std::fs::read_to_string(trace).unwrap_or_default().lines().count();
    let [kt, vt, mt, it, ct] = m.tables.map(|t| table(exec, t));
    let n = m.dev_src.len();
    mha_backup(device, m, &kt, &vt, (m.lists[0], m.lists[1], n));
    let [_, _, hm_t, hi_t] = &m.tensors;
    let (src, dst) = (idx(m.lists[0], n), idx(m.lists[1], n));
    kv::transfer_kv_all_layer_mla_lf_pf(device, &mt, hm_t, src, dst, ITEM as i64, PAGE as i64, LAYERS as i64).unwrap();
    let (rows, bytes) = (PAGE_ROW as i64, (LAYERS * PAGE_ROW) as i64);
    kv::transfer_kv_all_layer_mla_lf_pf(device, &it, hi_t, idx(m.lists[2], 3), idx(m.lists[3], 3), rows, bytes, LAYERS as i64).unwrap();
    kv::transfer_kv_all_layer_mla(device, &mt, &ct, idx(m.lists[0], n), idx(m.lists[1], n), ITEM as i64, LAYERS as i64).unwrap();
    let issued = std::fs::read_to_string(trace).unwrap();
    exec.synchronize().unwrap();
    let calls: Vec<&str> = issued.lines().skip(before).collect();
    assert!(calls.iter().any(|l| l.contains(" cuLaunchKernel ")), "the ops launched nothing: {calls:#?}");
    let blocking: Vec<&&str> = calls.iter().filter(|l| l.contains("blocked=1")).collect();
    assert!(blocking.is_empty(), "host-blocking driver calls while issuing: {blocking:#?}");
}

/// Every item the ops moved, against the device's bytes.
fn backed_up_bytes_match(m: &Mem) {
    let [gk, gv, gm, gi] = [0, 1, 2, 3].map(|j| m.host_bytes(j));
    let mla_now = dev_read(m.mla, LAYERS * SLOTS * ITEM);
    for l in 0..LAYERS {
        let (ks, vs) = (dev_read(m.k[l], SLOTS * ITEM), dev_read(m.v[l], SLOTS * ITEM));
        for (&s, &d) in m.dev_src.iter().zip(&m.host_dst) {
            let (s, d) = (s as usize, d as usize);
            assert_eq!(&gk[d * PAGE + l * ITEM..][..ITEM], &ks[s * ITEM..][..ITEM], "K layer {l} slot {s}");
            assert_eq!(&gv[d * PAGE + l * ITEM..][..ITEM], &vs[s * ITEM..][..ITEM], "V layer {l} slot {s}");
            assert_eq!(&gm[d * PAGE + l * ITEM..][..ITEM], &mla_now[(l * SLOTS + s) * ITEM..][..ITEM], "MLA layer {l} slot {s}");
        }
        let rows = dev_read(m.idx_rows[l], PAGES * PAGE_ROW);
        for (&s, &d) in m.page_src.iter().zip(&m.page_dst) {
            let (s, d) = (s as usize, d as usize);
            assert_eq!(&gi[(d * LAYERS + l) * PAGE_ROW..][..PAGE_ROW], &rows[s * PAGE_ROW..][..PAGE_ROW], "indexer layer {l} page {s}");
        }
        let c = dev_read(m.copies[l], SLOTS * ITEM);
        for (&s, &d) in m.dev_src.iter().zip(&m.host_dst) {
            let (s, d) = (s as usize, d as usize);
            assert_eq!(&c[d * ITEM..][..ITEM], &mla_now[(l * SLOTS + s) * ITEM..][..ITEM], "layer copy {l} slot {s}");
        }
    }
}

/// A table rewritten in place (two layers swapped): the next call moves nothing and is reported
/// at the next synchronize; forgotten, the table is read again and its new order moves. Then an
/// index past a table's layers (bounded by their allocations): refused on the device. Returns the
/// device lists it made.
fn changed_tables_and_bad_indices_are_refused(exec: &CudaExecutor, device: &Device, m: &Mem) -> [u64; 2] {
    let [kt, ..] = m.tables;
    let mut swapped = m.k.clone();
    swapped.swap(0, 1);
    unsafe { result::memcpy_htod_sync(kt, &swapped) }.unwrap();
    result::ctx::synchronize().unwrap();
    let snapshot = (m.host_bytes(0), m.host_bytes(1));
    let (ktab, vtab) = (table(exec, kt), table(exec, m.tables[1]));
    let n = m.dev_src.len();
    mha_backup(device, m, &ktab, &vtab, (m.lists[0], m.lists[1], n));
    let err = exec.synchronize().unwrap_err();
    match &err {
        TransferError::DeviceIndexCheck { source, .. } => {
            assert!(matches!(**source, TransferError::LayerTableChanged { table, entry: 0 } if table == kt), "{err}")
        }
        other => panic!("expected the table check, got {other}"),
    }
    assert_eq!((m.host_bytes(0), m.host_bytes(1)), snapshot, "a refused call moved bytes");
    exec.forget_layer_tables().unwrap();
    let ktab = table(exec, kt);
    assert_eq!(ktab.entries(), &swapped[..]);
    mha_backup(device, m, &ktab, &vtab, (m.lists[0], m.lists[1], n));
    exec.synchronize().unwrap();
    let gk = m.host_bytes(0);
    let k1 = dev_read(m.k[1], SLOTS * ITEM);
    let (s, d) = (m.dev_src[3] as usize, m.host_dst[3] as usize);
    assert_eq!(&gk[d * PAGE..][..ITEM], &k1[s * ITEM..][..ITEM], "layer 0 now reads K layer 1");

    let (past, one) = (list(&[SLOTS as i64]), list(&[0]));
    result::ctx::synchronize().unwrap();
    mha_backup(device, m, &ktab, &vtab, (past, one, 1));
    let err = exec.synchronize().unwrap_err();
    assert!(
        matches!(&err, TransferError::DeviceIndexCheck { source, .. } if matches!(**source, TransferError::IndexOutOfRange { .. })),
        "{err}"
    );
    [past, one]
}
