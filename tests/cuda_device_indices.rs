//! CUDA index lists (sglang passes them to every `kernel` op) are checked on the device, not
//! copied to the host: a valid call moves the right bytes; a call with an index out of range or a
//! destination written twice moves nothing, and its error — the one the host checks give for the
//! same lists, naming the op — comes from the next synchronize or the next op on the executor.
//! Pointer-table entries are classified by the driver: device memory past its allocation or host
//! memory that is not pinned is refused. Runs on a GPU or on the simulated driver
//! (`scripts/cuda-sim.sh`); skips without either, unless `HICACHE_REQUIRE_CUDA=1`.
#![cfg(feature = "cuda")]

mod common;

use std::ffi::c_void;

use cudarc::driver::{result, sys};
use hicache_io::exec::cuda::CudaExecutor;
use hicache_io::exec::ExecutorKind;
use hicache_io::kvcacheio::{self as kv, CudaIndices, Memory, RawTensor};
use hicache_io::{Device, TransferError};

const ITEM: usize = 576;
const SLOTS: usize = 64;
const BYTES: usize = ITEM * SLOTS;

struct Mem {
    ptr: u64,
    len: usize,
    host: bool,
}

impl Drop for Mem {
    fn drop(&mut self) {
        // SAFETY: allocated below; the executor was synchronized by the test.
        unsafe {
            if self.host {
                let _ = result::free_host(self.ptr as *mut c_void);
            } else {
                let _ = result::free_sync(self.ptr);
            }
        }
    }
}

impl Mem {
    fn device(bytes: &[u8]) -> Mem {
        let ptr = unsafe { result::malloc_sync(bytes.len()) }.unwrap();
        unsafe { result::memcpy_htod_sync(ptr, bytes) }.unwrap();
        // A copy from pageable memory may return before its DMA lands: wait for it.
        result::ctx::synchronize().unwrap();
        Mem { ptr, len: bytes.len(), host: false }
    }
    fn pinned(bytes: &[u8]) -> Mem {
        let p = unsafe { result::malloc_host(bytes.len(), sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP) }.unwrap();
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p as *mut u8, bytes.len()) };
        Mem { ptr: p as u64, len: bytes.len(), host: true }
    }
    fn indices(v: &[i64]) -> Mem {
        Mem::device(bytemuck::cast_slice(v))
    }
    fn bytes(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        if self.host {
            unsafe { std::ptr::copy_nonoverlapping(self.ptr as *const u8, out.as_mut_ptr(), self.len) };
        } else {
            unsafe { result::memcpy_dtoh_sync(&mut out, self.ptr) }.unwrap();
        }
        out
    }
    fn tensor(&self, rows: usize) -> RawTensor {
        let memory = if self.host { Memory::Host } else { Memory::CudaDevice };
        // SAFETY: our allocation, alive until the test's end.
        unsafe { RawTensor::new(self.ptr, self.len as u64, vec![rows as u64, (self.len / rows) as u64], memory) }
    }
    fn list(&self) -> CudaIndices {
        // SAFETY: `len / 8` i64s of device memory, alive and unchanged until the test syncs.
        unsafe { CudaIndices::new(self.ptr, self.len / 8) }
    }
}

fn setup() -> Option<(Device, CudaExecutor)> {
    let Some(Device::Cuda(exec)) = common::open(ExecutorKind::Cuda) else { return None };
    // The test's own allocations use the executor's (primary) context.
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    ctx.bind_to_thread().unwrap();
    Some((Device::Cuda(exec.clone()), exec))
}

fn pattern(seed: u8) -> Vec<u8> {
    (0..BYTES).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1).collect()
}

/// A per-layer MLA load, host (pinned) → device, with device index lists.
fn load(device: &Device, src: &Mem, dst: &Mem, hi: &Mem, di: &Mem) -> hicache_io::Result<()> {
    kv::transfer_kv_per_layer_mla(device, &src.tensor(SLOTS), &dst.tensor(SLOTS), hi.list(), di.list(), ITEM as i64)
}

/// What the host checks say about the same call with host lists.
fn host_error(device: &Device, src: &Mem, dst: &Mem, hi: &[i64], di: &[i64]) -> String {
    kv::transfer_kv_per_layer_mla(device, &src.tensor(SLOTS), &dst.tensor(SLOTS), hi, di, ITEM as i64).unwrap_err().to_string()
}

fn expect_device_error(e: TransferError, call: &str, want: &str) {
    match e {
        TransferError::DeviceIndexCheck { call: c, source } => {
            assert_eq!(c, call);
            assert_eq!(source.to_string(), want);
        }
        other => panic!("expected a device index check error, got {other}"),
    }
}

#[test]
fn valid_device_lists_move_the_right_bytes() {
    let Some((device, exec)) = setup() else { return };
    let (src, dst) = (Mem::pinned(&pattern(3)), Mem::device(&vec![0u8; BYTES]));
    let (h, d): (Vec<i64>, Vec<i64>) = (vec![5, 0, -1, 63, 7], vec![1, 2, 3, 60, -1]);
    let (hm, dm) = (Mem::indices(&h), Mem::indices(&d));
    load(&device, &src, &dst, &hm, &dm).unwrap();
    exec.synchronize().unwrap();
    let (s, got) = (src.bytes(), dst.bytes());
    let mut want = vec![0u8; BYTES];
    for (&a, &b) in h.iter().zip(&d) {
        if a >= 0 && b >= 0 {
            want[b as usize * ITEM..][..ITEM].copy_from_slice(&s[a as usize * ITEM..][..ITEM]);
        }
    }
    assert!(got == want, "device layer differs from the expected bytes");
    // And a backup (device → host page_first, one layer) with device lists.
    let host = Mem::pinned(&vec![0u8; BYTES]);
    let (bs, bd) = (Mem::indices(&[1, 60]), Mem::indices(&[9, 10]));
    kv::transfer_kv_per_layer_mla_lf_pf(
        &device,
        &dst.tensor(SLOTS),
        &host.tensor(SLOTS),
        bs.list(),
        bd.list(),
        0,
        ITEM as i64,
        ITEM as i64,
    )
    .unwrap();
    exec.synchronize().unwrap();
    let hb = host.bytes();
    assert_eq!(&hb[9 * ITEM..10 * ITEM], &s[5 * ITEM..6 * ITEM]);
    assert_eq!(&hb[10 * ITEM..11 * ITEM], &s[63 * ITEM..64 * ITEM]);
}

#[test]
fn an_invalid_device_list_moves_nothing_and_reports_the_host_checks_error() {
    let Some((device, exec)) = setup() else { return };
    let (src, dst) = (Mem::pinned(&pattern(5)), Mem::device(&vec![0u8; BYTES]));
    let cases: [(Vec<i64>, Vec<i64>); 3] = [
        // A host index out of range at position 3 (and a device one later: the host's first).
        (vec![0, 1, 2, 64, 4], vec![0, 1, 2, 3, 99]),
        // A device index out of range.
        (vec![0, 1, 2, 3], vec![0, 1, 70, 3]),
        // A destination written twice (positions 1 and 3), a skipped pair not counted.
        (vec![0, 1, 2, 3, -1], vec![5, 6, 7, 6, 5]),
    ];
    for (h, d) in cases {
        let want = host_error(&device, &src, &dst, &h, &d);
        // The lists stay allocated until the stream has run the call.
        let (hm, dm) = (Mem::indices(&h), Mem::indices(&d));
        load(&device, &src, &dst, &hm, &dm).expect("enqueued; checked on the device");
        let e = exec.synchronize().unwrap_err();
        expect_device_error(e, "transfer_kv_per_layer_mla", &want);
        assert!(dst.bytes().iter().all(|b| *b == 0), "{h:?} → {d:?}: bytes moved");
        // Reported once.
        exec.synchronize().unwrap();
    }
}

#[test]
fn the_next_op_reports_an_earlier_failed_check_and_does_not_run() {
    let Some((device, exec)) = setup() else { return };
    let (src, dst) = (Mem::pinned(&pattern(7)), Mem::device(&vec![0u8; BYTES]));
    let (bad_h, bad_d) = (Mem::indices(&[0, 1]), Mem::indices(&[4, 4]));
    let (good_h, good_d) = (Mem::indices(&[2]), Mem::indices(&[9]));
    let want = host_error(&device, &src, &dst, &[0, 1], &[4, 4]);
    load(&device, &src, &dst, &bad_h, &bad_d).unwrap();
    // Let the failed call's report arrive (the op polls; it never waits).
    result::ctx::synchronize().unwrap();
    let e = load(&device, &src, &dst, &good_h, &good_d).unwrap_err();
    expect_device_error(e, "transfer_kv_per_layer_mla", &want);
    exec.synchronize().unwrap();
    assert!(dst.bytes().iter().all(|b| *b == 0), "the refused op or the failed call moved bytes");
    load(&device, &src, &dst, &good_h, &good_d).unwrap();
    exec.synchronize().unwrap();
    assert_eq!(&dst.bytes()[9 * ITEM..10 * ITEM], &src.bytes()[2 * ITEM..3 * ITEM]);
}

#[test]
fn tensors_are_classified_by_the_driver() {
    let Some((device, exec)) = setup() else { return };
    let (src, dst) = (Mem::pinned(&pattern(9)), Mem::device(&vec![0u8; BYTES]));
    let (h, d) = (Mem::indices(&[0]), Mem::indices(&[1]));
    // A device tensor said to be longer than its allocation.
    let long = unsafe { RawTensor::new(dst.ptr, 2 * BYTES as u64, vec![2 * SLOTS as u64, ITEM as u64], Memory::CudaDevice) };
    let e = kv::transfer_kv_per_layer_mla(&device, &src.tensor(SLOTS), &long, h.list(), d.list(), ITEM as i64).unwrap_err();
    assert!(e.to_string().contains("extend past their allocation"), "{e}");
    // Pinned host memory given as device memory (a layer table of host addresses) is host memory.
    let as_device = unsafe { RawTensor::new(src.ptr, BYTES as u64, vec![SLOTS as u64, ITEM as u64], Memory::CudaDevice) };
    kv::transfer_kv_per_layer_mla(&device, &as_device, &dst.tensor(SLOTS), h.list(), d.list(), ITEM as i64).unwrap();
    exec.synchronize().unwrap();
    assert_eq!(&dst.bytes()[ITEM..2 * ITEM], &src.bytes()[..ITEM]);
    // Pageable host memory given as device memory is refused before anything moves.
    let pageable = vec![0u8; BYTES];
    let fake = unsafe { RawTensor::new(pageable.as_ptr() as u64, BYTES as u64, vec![SLOTS as u64, ITEM as u64], Memory::CudaDevice) };
    let e = kv::transfer_kv_per_layer_mla(&device, &fake, &dst.tensor(SLOTS), h.list(), d.list(), ITEM as i64).unwrap_err();
    assert!(e.to_string().contains("not memory the CUDA driver knows"), "{e}");
}

const LAYERS: usize = 3;

/// An all-layer MLA load's memory: a pinned host buffer of `pattern(seed)` (layer_first, one
/// slot per row) read as every layer's source, and `LAYERS` zeroed device layers; then the
/// source and destination tensors.
fn all_layer_load(seed: u8) -> (Mem, Vec<Mem>, Vec<RawTensor>, Vec<RawTensor>) {
    let host = Mem::pinned(&pattern(seed));
    let layers: Vec<Mem> = (0..LAYERS).map(|_| Mem::device(&vec![0u8; BYTES])).collect();
    let srcs: Vec<RawTensor> = (0..LAYERS).map(|_| host.tensor(SLOTS)).collect();
    let tensors: Vec<RawTensor> = layers.iter().map(|m| m.tensor(SLOTS)).collect();
    (host, layers, srcs, tensors)
}

#[test]
fn the_layers_of_an_all_layer_op_share_one_check_all_or_none() {
    let Some((device, exec)) = setup() else { return };
    let (host, layers, srcs, tensors) = all_layer_load(11);
    let (h, d) = (vec![0i64, 1, 2], vec![8i64, 9, 8]);
    let want = kv::transfer_kv_all_layer_mla(&device, &srcs, &tensors, &h, &d, ITEM as i64, LAYERS as i64).unwrap_err().to_string();
    let (hm, dm) = (Mem::indices(&h), Mem::indices(&d));
    kv::transfer_kv_all_layer_mla(&device, &srcs, &tensors, hm.list(), dm.list(), ITEM as i64, LAYERS as i64).unwrap();
    expect_device_error(exec.synchronize().unwrap_err(), "transfer_kv_all_layer_mla", &want);
    // One report for the op, not one per layer.
    exec.synchronize().unwrap();
    for (l, m) in layers.iter().enumerate() {
        assert!(m.bytes().iter().all(|b| *b == 0), "layer {l}: bytes moved");
    }
    let good = Mem::indices(&[10, 11, 12]);
    kv::transfer_kv_all_layer_mla(&device, &srcs, &tensors, hm.list(), good.list(), ITEM as i64, LAYERS as i64).unwrap();
    exec.synchronize().unwrap();
    let s = host.bytes();
    for m in &layers {
        let b = m.bytes();
        for (j, slot) in [10usize, 11, 12].into_iter().enumerate() {
            assert_eq!(&b[slot * ITEM..][..ITEM], &s[j * ITEM..][..ITEM]);
        }
    }
}

/// An all-layer op whose CUDA index lists fail their shared device check, interrupted by a
/// fault at its second layer: the `Partial` error names no completed layer (the first layer's
/// copies waited on the check and moved nothing), and the next synchronize reports the check.
#[test]
fn a_partial_failure_under_a_failed_device_check_names_no_completed_layer() {
    let Some((device, exec)) = setup() else { return };
    let (_host, layers, srcs, tensors) = all_layer_load(12);
    let (h, d) = (Mem::indices(&[0, 1, 2]), Mem::indices(&[8, 9, 8]));
    device.inject_fault(1);
    match kv::transfer_kv_all_layer_mla(&device, &srcs, &tensors, h.list(), d.list(), ITEM as i64, LAYERS as i64) {
        Err(TransferError::Partial { failed_step: 1, completed_layers, .. }) => {
            assert!(completed_layers.is_empty(), "layers {completed_layers:?} called completed; nothing moved")
        }
        other => panic!("expected a partial failure at layer 1, got {other:?}"),
    }
    assert!(matches!(exec.synchronize(), Err(TransferError::DeviceIndexCheck { .. })));
    exec.synchronize().unwrap();
    for (l, m) in layers.iter().enumerate() {
        assert!(m.bytes().iter().all(|b| *b == 0), "layer {l}: bytes moved");
    }
}

#[test]
fn a_misaligned_cuda_index_list_is_refused_before_anything_is_enqueued() {
    let Some((device, exec)) = setup() else { return };
    let (src, dst) = (Mem::pinned(&pattern(13)), Mem::device(&vec![0u8; BYTES]));
    let lists = Mem::indices(&[0, 1, 2, 3]);
    let (h, d) = unsafe { (CudaIndices::new(lists.ptr + 4, 1), CudaIndices::new(lists.ptr + 16, 1)) };
    let e = kv::transfer_kv_per_layer_mla(&device, &src.tensor(SLOTS), &dst.tensor(SLOTS), h, d, ITEM as i64).unwrap_err();
    assert!(e.to_string().contains("not 8-byte aligned"), "{e}");
    exec.synchronize().unwrap();
    assert!(dst.bytes().iter().all(|b| *b == 0));
}

/// The head-group-major case: 4 heads × 16 B rows = 64 B items, 2 head groups, 3 layers, pages
/// of 4, 4 pages.
struct Hgm {
    heads: usize,
    groups: usize,
    layers: usize,
    page: usize,
    row: usize,
    item: usize,
    rows: usize,
    host_bytes: usize,
}

impl Hgm {
    fn new() -> Hgm {
        let (heads, groups, layers, page, row, pages) = (4usize, 2usize, 3usize, 4usize, 16usize, 4usize);
        let (item, rows) = (heads * row, pages * page);
        Hgm { heads, groups, layers, page, row, item, rows, host_bytes: rows * layers * item }
    }

    /// Where head `head` of slot `slot`, layer `layer` lies in a page_first_direct_hg buffer.
    fn host_byte(&self, slot: usize, layer: usize, head: usize) -> usize {
        let hg = self.heads / self.groups;
        let (p, t, g, j) = (slot / self.page, slot % self.page, head / hg, head % hg);
        ((((p * self.groups + g) * self.layers + layer) * self.page + t) * hg + j) * self.row
    }

    /// The one-layer load of layer `layer` from host K and V pages into device layers.
    fn load(
        &self,
        device: &Device,
        (hk, hv): (&Mem, &Mem),
        (dk, dv): (&Mem, &Mem),
        lists: (CudaIndices, CudaIndices),
        layer: i64,
    ) -> hicache_io::Result<()> {
        let (item, layers) = (self.item as i64, self.layers as i64);
        let (src, dst) = lists;
        let (dk, dv) = (dk.tensor(self.rows), dv.tensor(self.rows));
        kv::transfer_kv_per_layer_pfdhg_lf(
            device,
            &hk.tensor(1),
            &dk,
            &hv.tensor(1),
            &dv,
            src,
            dst,
            layer,
            item,
            item * layers,
            self.page as i64,
            self.groups as i64,
        )
    }
}

/// The head-group-major pair with device index lists: a load of one layer from pinned pages, a
/// backup of every layer into fresh pinned pages, both against the element formula; then a list
/// with a destination written twice moves nothing and reports sglang's words for the sides.
#[test]
fn head_group_major_pages_with_device_lists() {
    let Some((device, exec)) = setup() else { return };
    let c = Hgm::new();
    let pat = |seed: u8, n: usize| (0..n).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect::<Vec<u8>>();
    let (hk, hv) = (Mem::pinned(&pat(1, c.host_bytes)), Mem::pinned(&pat(2, c.host_bytes)));
    let (dk, dv) = (Mem::device(&vec![0u8; c.rows * c.item]), Mem::device(&vec![0u8; c.rows * c.item]));
    let src: Vec<i64> = (0..c.rows as i64).collect();
    let dst: Vec<i64> = src.iter().rev().copied().collect();
    let (sm, dm) = (Mem::indices(&src), Mem::indices(&dst));
    c.load(&device, (&hk, &hv), (&dk, &dv), (sm.list(), dm.list()), 2).unwrap();
    exec.synchronize().unwrap();
    for (h, d) in [(&hk, &dk), (&hv, &dv)] {
        let (hb, db) = (h.bytes(), d.bytes());
        for (&s, &t) in src.iter().zip(&dst) {
            for head in 0..c.heads {
                let at = t as usize * c.item + head * c.row;
                let from = c.host_byte(s as usize, 2, head);
                assert_eq!(&db[at..at + c.row], &hb[from..from + c.row], "load slot {s} head {head}");
            }
        }
    }
    hgm_backup_of_every_layer(&device, &exec, &c, (&dk, &dv), (&src, &dst), (&sm, &dm));
    hgm_double_destination_moves_nothing(&device, &exec, &c, (&hk, &hv));
}

/// Every device layer (`dk` for K, `dv` for V, the load's destinations) into fresh pinned pages,
/// from the load's destination slots back to its source slots (`sm`, `dm`: their device lists).
fn hgm_backup_of_every_layer(
    device: &Device,
    exec: &CudaExecutor,
    c: &Hgm,
    (dk, dv): (&Mem, &Mem),
    (src, dst): (&[i64], &[i64]),
    (sm, dm): (&Mem, &Mem),
) {
    let (bk, bv) = (Mem::pinned(&vec![0u8; c.host_bytes]), Mem::pinned(&vec![0u8; c.host_bytes]));
    let kl: Vec<RawTensor> = (0..c.layers).map(|_| dk.tensor(c.rows)).collect();
    let vl: Vec<RawTensor> = (0..c.layers).map(|_| dv.tensor(c.rows)).collect();
    let (item, layers) = (c.item as i64, c.layers as i64);
    let (page, groups) = (c.page as i64, c.groups as i64);
    kv::transfer_kv_all_layer_lf_pfdhg(
        device,
        &kl,
        &bk.tensor(1),
        &vl,
        &bv.tensor(1),
        dm.list(),
        sm.list(),
        item,
        item * layers,
        layers,
        page,
        groups,
    )
    .unwrap();
    exec.synchronize().unwrap();
    for (h, d) in [(&bk, dk), (&bv, dv)] {
        let (hb, db) = (h.bytes(), d.bytes());
        for (&s, &t) in dst.iter().zip(src) {
            for layer in 0..c.layers {
                for head in 0..c.heads {
                    let from = s as usize * c.item + head * c.row;
                    let at = c.host_byte(t as usize, layer, head);
                    assert_eq!(&hb[at..at + c.row], &db[from..from + c.row], "backup layer {layer}");
                }
            }
        }
    }
}

/// A destination written twice: nothing moves, the error names the destination.
fn hgm_double_destination_moves_nothing(device: &Device, exec: &CudaExecutor, c: &Hgm, hosts: (&Mem, &Mem)) {
    let (fresh_k, fresh_v) = (Mem::device(&vec![0u8; c.rows * c.item]), Mem::device(&vec![0u8; c.rows * c.item]));
    let (bad_s, bad_d) = (Mem::indices(&[0, 1, 2]), Mem::indices(&[5, 6, 5]));
    let call = c.load(device, hosts, (&fresh_k, &fresh_v), (bad_s.list(), bad_d.list()), 0);
    call.expect("enqueued; checked on the device");
    device.wait_idle().unwrap(); // the check has run; its report is still pending
                                 // An op that moves nothing (empty lists) still reports the earlier failure, as any op does.
    let empty: [i64; 0] = [];
    let (hk, hv) = hosts;
    let (item, layers) = (c.item as i64, c.layers as i64);
    let (fk, fv) = (fresh_k.tensor(c.rows), fresh_v.tensor(c.rows));
    let e = kv::transfer_kv_per_layer_pfdhg_lf(
        device,
        &hk.tensor(1),
        &fk,
        &hv.tensor(1),
        &fv,
        &empty[..],
        &empty[..],
        0,
        item,
        item * layers,
        c.page as i64,
        c.groups as i64,
    )
    .unwrap_err();
    expect_device_error(e, "transfer_kv_per_layer_pfdhg_lf", "destination slot 5 is written twice (positions 0 and 2)");
    exec.synchronize().unwrap();
    assert!(fresh_k.bytes().iter().chain(&fresh_v.bytes()).all(|&b| b == 0), "a refused call moved bytes");
}

/// Embedding ranges on the copy engine, pinned → device and back, 74-byte rows.
#[test]
fn embedding_ranges_between_pinned_and_device_memory() {
    let Some((device, exec)) = setup() else { return };
    let row = 74usize;
    let host = Mem::pinned(&(0..28 * row).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    let dev = Mem::device(&vec![0xffu8; 16 * row]);
    let (hs, ds, n) = ([1i64, 11, 23], [2i64, 6, 10], [4i64, 4, 2]);
    kv::transfer_embedding_ranges_direct(&device, &host.tensor(28), &dev.tensor(16), &hs, &ds, &n).unwrap();
    exec.synchronize().unwrap();
    let (hb, db) = (host.bytes(), dev.bytes());
    let mut want = vec![0xffu8; 16 * row];
    for k in 0..3 {
        for i in 0..n[k] as usize {
            want[(ds[k] as usize + i) * row..][..row].copy_from_slice(&hb[(hs[k] as usize + i) * row..][..row]);
        }
    }
    assert!(db == want, "device rows differ");
    let back = Mem::pinned(&vec![0u8; 28 * row]);
    kv::transfer_embedding_ranges_direct(&device, &dev.tensor(16), &back.tensor(28), &ds, &hs, &n).unwrap();
    exec.synchronize().unwrap();
    let bb = back.bytes();
    for k in 0..3 {
        let at = hs[k] as usize * row;
        let len = n[k] as usize * row;
        assert_eq!(&bb[at..at + len], &hb[at..at + len]);
    }
}
