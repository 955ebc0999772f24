//! KV memory the way serving engines allocate it, on the simulated driver: an expandable-segment
//! style reservation mapped chunk by chunk with a layer straddling two chunks (PyTorch's
//! `expandable_segments:True`, memory-saver regions), a stream-ordered pool (`cudaMallocAsync`),
//! and the memory-saver cycle (unmapped between two backups, then mapped again). Every op is
//! compared with the bytes it should move; memory that is not mapped is refused before a kernel
//! touches it, and an unmap while work is queued is reported, never a silent copy. Skips outside
//! the simulator (fails when `HICACHE_CUDA_SIM=1` and the simulator is absent).
#![cfg(feature = "cuda")]

mod common;

use std::ffi::c_void;

use cudarc::driver::{result, sys};
use hicache_io::exec::cuda::CudaExecutor;
use hicache_io::exec::ExecutorKind;
use hicache_io::kvcacheio::{self as kv, CudaIndices, Memory, RawTensor};
use hicache_io::Device;

const CHUNK: usize = 2 << 20;
const ITEM: usize = 512;
const SLOTS: usize = 3072; // 1.5 MiB a layer: layer 1 straddles the first chunk boundary
const LAYERS: usize = 3;

type Errors = unsafe extern "C" fn(*mut u64, *mut u64);
type Clear = unsafe extern "C" fn();

fn sim_errors() -> (u64, u64) {
    let (mut r, mut f) = (0, 0);
    // SAFETY: the simulator's own hook (present: checked by `on_sim`).
    unsafe { (*sys::culib().get::<Errors>(b"hicache_cuda_sim_errors\0").unwrap())(&mut r, &mut f) };
    (r, f)
}

fn sim_clear() {
    // SAFETY: as above.
    unsafe { (*sys::culib().get::<Clear>(b"hicache_cuda_sim_clear_errors\0").unwrap())() };
}

fn on_sim() -> bool {
    std::env::var("HICACHE_CUDA_SIM").is_ok_and(|v| v == "1")
}

fn ok(rc: sys::CUresult, what: &str) {
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "{what}");
}

fn prop() -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct; zero is its documented default for every field we leave.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    p
}

/// A reservation of `chunks` chunks, each a physical allocation mapped side by side and made
/// accessible: (base, handles).
fn expandable(chunks: usize) -> (u64, Vec<u64>) {
    let mut base = 0;
    // SAFETY: driver calls with valid outputs.
    unsafe {
        ok(sys::cuMemAddressReserve(&mut base, chunks * CHUNK, 0, 0, 0), "cuMemAddressReserve");
        let p = prop();
        let handles: Vec<u64> = (0..chunks)
            .map(|i| {
                let mut h = 0;
                ok(sys::cuMemCreate(&mut h, CHUNK, &p, 0), "cuMemCreate");
                ok(sys::cuMemMap(base + (i * CHUNK) as u64, CHUNK, 0, h, 0), "cuMemMap");
                h
            })
            .collect();
        grant(base, chunks * CHUNK);
        (base, handles)
    }
}

fn grant(base: u64, len: usize) {
    // SAFETY: a plain C struct.
    let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    access.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = 0;
    access.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    // SAFETY: one descriptor.
    ok(unsafe { sys::cuMemSetAccess(base, len, &access, 1) }, "cuMemSetAccess");
}

fn write(p: u64, bytes: &[u8]) {
    unsafe { result::memcpy_htod_sync(p, bytes) }.unwrap();
    result::ctx::synchronize().unwrap();
}

fn read(p: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    unsafe { result::memcpy_dtoh_sync(&mut v, p) }.unwrap();
    v
}

fn list(v: &[i64]) -> u64 {
    let p = unsafe { result::malloc_sync(v.len() * 8) }.unwrap();
    write(p, bytemuck_i64(v));
    p
}

fn bytemuck_i64(v: &[i64]) -> &[u8] {
    // SAFETY: i64 has no padding; the slice is read only.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 8) }
}

fn layer(p: u64) -> RawTensor {
    unsafe { RawTensor::new(p, (SLOTS * ITEM) as u64, vec![SLOTS as u64, ITEM as u64], Memory::CudaDevice) }
}

fn pinned(len: usize) -> (*mut u8, RawTensor) {
    let p = unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP) }.unwrap() as *mut u8;
    unsafe { std::ptr::write_bytes(p, 0, len) };
    let rows = len / (LAYERS * ITEM);
    (p, unsafe { RawTensor::new(p as u64, len as u64, vec![rows as u64, (LAYERS * ITEM) as u64], Memory::Host) })
}

fn pattern(seed: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i * 31 + seed * 7) % 251) as u8).collect()
}

/// Bytes of a host page (every layer's item of one slot).
const PAGE: usize = LAYERS * ITEM;

/// The rows every part backs up: source rows of the device layers, destination rows of the
/// host buffer, and both lists on the device.
struct Rows {
    src: Vec<i64>,
    dst: Vec<i64>,
    d_src: u64,
    d_dst: u64,
}

impl Rows {
    fn new() -> Rows {
        let (src, dst): (Vec<i64>, Vec<i64>) = ((0..96).map(|i| (i * 31) % SLOTS as i64).collect(), (0..96).map(|i| 2000 + i).collect());
        let (d_src, d_dst) = (list(&src), list(&dst));
        Rows { src, dst, d_src, d_dst }
    }

    /// The device lists, `(src, dst)` (`back`: swapped, for loads).
    fn idx(&self, back: bool) -> (CudaIndices, CudaIndices) {
        let n = self.src.len();
        let (a, b) = unsafe { (CudaIndices::new(self.d_src, n), CudaIndices::new(self.d_dst, n)) };
        if back {
            (b, a)
        } else {
            (a, b)
        }
    }
}

/// An expandable segment of three 1.5 MiB layers over three 2 MiB chunks, and a pinned host
/// page_first buffer.
struct Segment {
    base: u64,
    handles: Vec<u64>,
    layers: Vec<u64>,
    lt: Vec<RawTensor>,
    host: *mut u8,
    host_t: RawTensor,
}

impl Segment {
    fn host_bytes(&self) -> Vec<u8> {
        unsafe { std::slice::from_raw_parts(self.host, SLOTS * PAGE) }.to_vec()
    }

    /// The MLA backup of every layer into the host buffer.
    fn backup(&self, device: &Device, rows: &Rows) -> Result<(), hicache_io::TransferError> {
        let (src, dst) = rows.idx(false);
        kv::transfer_kv_all_layer_mla_lf_pf(device, &self.lt, &self.host_t, src, dst, ITEM as i64, PAGE as i64, LAYERS as i64)
    }
}

#[test]
fn engine_allocators_are_classified_and_moved_byte_exact() {
    // On a GPU (scripts/gpu-check.sh) parts 1-3 run; part 4 checks the simulator itself.
    let Some(Device::Cuda(exec)) = common::open(ExecutorKind::Cuda) else {
        assert!(!on_sim(), "cuda on the simulator");
        eprintln!("skipping: no cuda executor");
        return;
    };
    let device = Device::Cuda(exec.clone());
    cudarc::driver::CudaContext::new(0).unwrap().bind_to_thread().unwrap();
    let rows = Rows::new();
    let seg = expandable_segment(&exec, &device, &rows);
    let table = straddling_layer_table(&exec, &device, &rows, &seg);
    memory_saver_cycle(&exec, &device, &rows, &seg);
    let (host2, host2_t, pooled) = stream_ordered_pool(&exec, &device, &rows);
    if !on_sim() {
        // A real pool may keep freed memory mapped for reuse: the refusal below is the
        // simulator's (which releases at once).
        return;
    }
    let (src, dst) = rows.idx(false);
    let e = kv::transfer_kv_per_layer_mla_lf_pf(&device, &pooled, &host2_t, src, dst, 1, ITEM as i64, PAGE as i64).unwrap_err();
    assert!(e.to_string().contains("not"), "{e}");
    assert_eq!(sim_errors(), (0, 0));
    simulator_reports_misuse(exec.cu_stream());

    unsafe {
        for p in [rows.d_src, rows.d_dst, table] {
            result::free_sync(p).unwrap();
        }
        result::free_host(seg.host as *mut c_void).unwrap();
        result::free_host(host2 as *mut c_void).unwrap();
    }
}

/// Part 1: an expandable segment whose layer 1 straddles chunks 0 and 1, layer 2 chunks 1 and 2:
/// backed up, loaded back per layer from the page_first host buffer, and a direct (copy-engine)
/// copy between two layers across a chunk boundary.
fn expandable_segment(exec: &CudaExecutor, device: &Device, rows: &Rows) -> Segment {
    let (base, handles) = expandable(3);
    let layers: Vec<u64> = (0..LAYERS).map(|l| base + (l * SLOTS * ITEM) as u64).collect();
    for (l, &p) in layers.iter().enumerate() {
        write(p, &pattern(l, SLOTS * ITEM));
    }
    let lt: Vec<RawTensor> = layers.iter().map(|&p| layer(p)).collect();
    let (host, host_t) = pinned(SLOTS * PAGE);
    let seg = Segment { base, handles, layers, lt, host, host_t };
    seg.backup(device, rows).unwrap();
    exec.synchronize().unwrap();
    let got = seg.host_bytes();
    for l in 0..LAYERS {
        let want = pattern(l, SLOTS * ITEM);
        for (&s, &d) in rows.src.iter().zip(&rows.dst) {
            let (s, d) = (s as usize, d as usize);
            assert_eq!(&got[d * PAGE + l * ITEM..][..ITEM], &want[s * ITEM..][..ITEM], "expandable backup layer {l} row {s}");
        }
    }
    for (l, t) in seg.lt.iter().enumerate() {
        let (dst, src) = rows.idx(true);
        kv::transfer_kv_per_layer_mla_pf_lf(device, &seg.host_t, t, dst, src, l as i64, ITEM as i64, PAGE as i64).unwrap();
    }
    let direct_src: Vec<i64> = (1000..1100).collect();
    let direct_dst: Vec<i64> = (2900..3000).collect();
    kv::transfer_kv_direct(device, &seg.lt[1..2], &seg.lt[2..3], &direct_src, &direct_dst, 1).unwrap();
    exec.synchronize().unwrap();
    let l1 = read(seg.layers[1], SLOTS * ITEM);
    let l2 = read(seg.layers[2], SLOTS * ITEM);
    assert_eq!(&l2[2900 * ITEM..3000 * ITEM], &l1[1000 * ITEM..1100 * ITEM], "direct copy across chunks");
    for (l, &p) in seg.layers.iter().enumerate() {
        let now = read(p, SLOTS * ITEM);
        let want = pattern(l, SLOTS * ITEM);
        for &s in &rows.src {
            let s = s as usize;
            if l == 2 && (2900..3000).contains(&s) {
                continue;
            }
            assert_eq!(&now[s * ITEM..][..ITEM], &want[s * ITEM..][..ITEM], "load back layer {l} row {s}");
        }
    }
    seg
}

/// A layer table of the segment (GPU memory) with CUDA lists: the executor bounds each layer by
/// the chunks that follow each other, so the straddling layers keep their extent. The table.
fn straddling_layer_table(exec: &CudaExecutor, device: &Device, rows: &Rows, seg: &Segment) -> u64 {
    let table = {
        let p = unsafe { result::malloc_sync(LAYERS * 8) }.unwrap();
        write(p, unsafe { std::slice::from_raw_parts(seg.layers.as_ptr() as *const u8, LAYERS * 8) });
        p
    };
    let tab = unsafe { exec.layer_table(table, LAYERS) }.unwrap();
    let (src, dst) = rows.idx(false);
    kv::transfer_kv_all_layer_mla_lf_pf(device, &tab, &seg.host_t, src, dst, ITEM as i64, PAGE as i64, LAYERS as i64).unwrap();
    exec.synchronize().unwrap();
    table
}

/// Part 2: the memory-saver cycle, chunk 1 unmapped between two backups. A call that reaches it
/// is refused before anything moves; mapped again (the same physical memory), it moves.
fn memory_saver_cycle(exec: &CudaExecutor, device: &Device, rows: &Rows, seg: &Segment) {
    unsafe { ok(sys::cuMemUnmap(seg.base + CHUNK as u64, CHUNK), "cuMemUnmap") };
    let before = seg.host_bytes();
    let e = seg.backup(device, rows).unwrap_err();
    assert!(e.to_string().contains("not mapped") || e.to_string().contains("not device memory"), "{e}");
    exec.synchronize().unwrap();
    assert_eq!(seg.host_bytes(), before, "a refused call moved bytes");
    unsafe { ok(sys::cuMemMap(seg.base + CHUNK as u64, CHUNK, 0, seg.handles[1], 0), "cuMemMap again") };
    grant(seg.base + CHUNK as u64, CHUNK);
    unsafe { std::ptr::write_bytes(seg.host, 0, SLOTS * PAGE) };
    seg.backup(device, rows).unwrap();
    exec.synchronize().unwrap();
    let again = seg.host_bytes();
    for l in 0..LAYERS {
        let now = read(seg.layers[l], SLOTS * ITEM);
        for (&s, &d) in rows.src.iter().zip(&rows.dst) {
            let (s, d) = (s as usize, d as usize);
            assert_eq!(&again[d * PAGE + l * ITEM..][..ITEM], &now[s * ITEM..][..ITEM], "after remap layer {l} row {s}");
        }
    }
}

/// Part 3: a stream-ordered pool on the executor's stream: allocated, written, backed up and
/// freed in stream order. The second host buffer, its tensor, and the freed layer (whose address
/// the simulator then refuses).
fn stream_ordered_pool(exec: &CudaExecutor, device: &Device, rows: &Rows) -> (*mut u8, RawTensor, RawTensor) {
    let s = exec.cu_stream();
    let mut pooled = 0;
    unsafe { ok(sys::cuMemAllocAsync(&mut pooled, SLOTS * ITEM, s), "cuMemAllocAsync") };
    let fill = pattern(9, SLOTS * ITEM);
    unsafe { ok(sys::cuMemcpyHtoDAsync_v2(pooled, fill.as_ptr() as *const c_void, fill.len(), s), "cuMemcpyHtoDAsync") };
    let (host2, host2_t) = pinned(SLOTS * ITEM * LAYERS);
    let one = layer(pooled);
    let (src, dst) = rows.idx(false);
    kv::transfer_kv_per_layer_mla_lf_pf(device, &one, &host2_t, src, dst, 1, ITEM as i64, PAGE as i64).unwrap();
    unsafe { ok(sys::cuMemFreeAsync(pooled, s), "cuMemFreeAsync") };
    exec.synchronize().unwrap();
    let got = unsafe { std::slice::from_raw_parts(host2, SLOTS * PAGE) };
    for (&s_, &d) in rows.src.iter().zip(&rows.dst) {
        let (s_, d) = (s_ as usize, d as usize);
        assert_eq!(&got[d * PAGE + ITEM..][..ITEM], &fill[s_ * ITEM..][..ITEM], "pool backup row {s_}");
    }
    (host2, host2_t, one)
}

/// Part 4, the simulator: memory of another stream's pool allocation used without ordering is a
/// race; a mapping used before cuMemSetAccess is a fault; an unmap while a copy is queued is
/// reported (race or fault), never silent.
fn simulator_reports_misuse(s: sys::CUstream) {
    let mut other: sys::CUstream = std::ptr::null_mut();
    unsafe { ok(sys::cuStreamCreate(&mut other, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32), "cuStreamCreate") };
    let mut racy = 0;
    unsafe {
        ok(sys::cuMemAllocAsync(&mut racy, 4096, other), "cuMemAllocAsync");
        ok(sys::cuMemsetD8Async(racy, 1, 4096, s), "cuMemsetD8Async");
    }
    let _ = unsafe { sys::cuStreamSynchronize(s) };
    let _ = unsafe { sys::cuStreamSynchronize(other) };
    assert!(sim_errors().0 >= 1, "a use not ordered after the stream-ordered allocation is a race");
    sim_clear();
    unsafe { ok(sys::cuMemFreeAsync(racy, other), "cuMemFreeAsync") };
    let _ = unsafe { sys::cuStreamSynchronize(other) };
    sim_clear();
    let (nb, _) = {
        let mut b = 0;
        unsafe {
            ok(sys::cuMemAddressReserve(&mut b, CHUNK, 0, 0, 0), "reserve");
            let p = prop();
            let mut h = 0;
            ok(sys::cuMemCreate(&mut h, CHUNK, &p, 0), "create");
            ok(sys::cuMemMap(b, CHUNK, 0, h, 0), "map");
            (b, h)
        }
    };
    let rc = unsafe { sys::cuMemsetD8Async(nb, 1, 64, s) };
    let sync = unsafe { sys::cuStreamSynchronize(s) };
    assert!(rc != sys::CUresult::CUDA_SUCCESS || sync != sys::CUresult::CUDA_SUCCESS, "a mapping without access was written");
    assert!(sim_errors().1 >= 1);
    sim_clear();
    let (b2, _) = expandable(1);
    unsafe {
        ok(sys::cuMemsetD8Async(b2, 1, 4096, s), "cuMemsetD8Async");
        ok(sys::cuMemUnmap(b2, CHUNK), "cuMemUnmap");
        let _ = sys::cuStreamSynchronize(s);
    }
    let (races, faults) = sim_errors();
    assert!(races + faults >= 1, "an unmap under queued work went unnoticed");
    sim_clear();
}
