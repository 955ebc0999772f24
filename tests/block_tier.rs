//! `BlockTier` (vLLM's offloading worker's core) against an oracle, byte for byte: padded blocks
//! (only `row_bytes` of each move), several tensors per move, rows of the last store read
//! back; a damaged host row fails its load with `Integrity`, naming the tensor, row and block,
//! while the other rows land; bad moves (lengths, ranges, duplicate destinations, a tensor of
//! another shape, a tensor named twice) move nothing. On the cpu executor here; on cuda (a GPU
//! or the simulated driver) with device tensors; wgpu, whose memory is its own, refuses caller
//! tensors. `BlockTier::over_host`: the same over rows in the caller's memory (a region shared
//! with other processes), gap bytes untouched, checksums carried from one tier to another.

#![allow(clippy::needless_range_loop, clippy::type_complexity)] // indices name tensors and rows

mod common;

use hicache_io::blocks::{BlockMove, BlockShape, BlockTier, HostRows};
use hicache_io::kvcacheio::{Memory, RawTensor};
use hicache_io::{Device, TransferError};

const ROWS: u64 = 24;
const HOST_ROWS: u64 = 20;
/// (row bytes, stride) of the tensors: K and V of a padded page, and an unpadded one.
const SHAPES: [(u64, u64); 3] = [(96, 128), (96, 128), (256, 256)];

/// Engine tensors on the test's side: bytes and where they live.
trait Blocks {
    fn raw(&mut self, j: usize) -> RawTensor;
    fn bytes(&self, j: usize) -> Vec<u8>;
}

struct HostBlocks(Vec<Vec<u8>>);

impl Blocks for HostBlocks {
    fn raw(&mut self, j: usize) -> RawTensor {
        let stride = SHAPES[j].1;
        common::host_tensor(&mut self.0[j], &[ROWS, stride])
    }
    fn bytes(&self, j: usize) -> Vec<u8> {
        self.0[j].clone()
    }
}

fn shapes() -> Vec<BlockShape> {
    SHAPES.iter().map(|&(row_bytes, stride)| BlockShape { row_bytes, stride, rows: ROWS }).collect()
}

/// The oracle: host rows as a map of the last bytes stored in each.
struct Oracle {
    rows: Vec<Vec<Option<Vec<u8>>>>,
}

impl Oracle {
    fn store(&mut self, tensors: &[Vec<u8>], ids: &[usize], blocks: &[i64], rows: &[i64]) {
        for &j in ids {
            let (row, stride) = SHAPES[j];
            for (b, r) in blocks.iter().zip(rows) {
                let at = *b as usize * stride as usize;
                self.rows[j][*r as usize] = Some(tensors[j][at..at + row as usize].to_vec());
            }
        }
    }
    fn load(&self, tensors: &mut [Vec<u8>], ids: &[usize], rows: &[i64], blocks: &[i64]) {
        for &j in ids {
            let (row, stride) = SHAPES[j];
            for (r, b) in rows.iter().zip(blocks) {
                let at = *b as usize * stride as usize;
                let bytes = self.rows[j][*r as usize].clone().unwrap_or_else(|| vec![0; row as usize]);
                tensors[j][at..at + row as usize].copy_from_slice(&bytes);
            }
        }
    }
}

fn run_tier<B: Blocks>(device: &Device, blocks: &mut B, upload: &mut dyn FnMut(&mut B, &[Vec<u8>])) {
    let shapes = shapes();
    let pairs: Vec<(BlockShape, RawTensor)> = (0..3).map(|j| (shapes[j], blocks.raw(j))).collect();
    let tier = BlockTier::new(device, &pairs, HOST_ROWS).unwrap();
    run_on(device, tier, blocks, upload);
}

fn run_on<B: Blocks>(device: &Device, mut tier: BlockTier, blocks: &mut B, upload: &mut dyn FnMut(&mut B, &[Vec<u8>])) {
    let name = device.name();
    let mut oracle = Oracle { rows: vec![vec![None; HOST_ROWS as usize]; 3] };
    let mut engine: Vec<Vec<u8>> = (0..3).map(|j| blocks.bytes(j)).collect();
    let mut rng = hicache_io::rng::Rng::new(11);
    for round in 0..8u64 {
        let n = 1 + (rng.next_u64() % 8) as usize;
        let mut bl: Vec<i64> = (0..ROWS as i64).collect();
        let mut rw: Vec<i64> = (0..HOST_ROWS as i64).collect();
        for v in [&mut bl, &mut rw] {
            for i in (1..v.len()).rev() {
                v.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
        }
        let (bl, rw) = (&bl[..n], &rw[..n]);
        let ids: Vec<usize> = if round % 2 == 0 { vec![0, 1, 2] } else { vec![2, 0] };
        let calls: Vec<(usize, RawTensor)> = ids.iter().map(|&j| (j, blocks.raw(j))).collect();
        tier.run(BlockMove::Store, &calls, bl, rw).unwrap();
        oracle.store(&engine, &ids, bl, rw);
        for j in 0..3 {
            let want: Vec<u8> = oracle.rows[j].iter().flat_map(|r| r.clone().unwrap_or_else(|| vec![0; SHAPES[j].0 as usize])).collect();
            assert_eq!(tier.read_rows(j).unwrap(), want, "{name}: round {round}, tensor {j}'s rows");
        }
        // The engine's blocks change; a load brings stored rows back into other blocks.
        for (j, t) in engine.iter_mut().enumerate() {
            *t = common::random_bytes(t.len(), round * 7 + j as u64);
        }
        upload(blocks, &engine);
        let mut back: Vec<i64> = bl.to_vec();
        back.rotate_left(1);
        let calls: Vec<(usize, RawTensor)> = ids.iter().map(|&j| (j, blocks.raw(j))).collect();
        tier.run(BlockMove::Load, &calls, &back, rw).unwrap();
        oracle.load(&mut engine, &ids, rw, &back);
        for j in 0..3 {
            assert_eq!(blocks.bytes(j), engine[j], "{name}: round {round}, tensor {j} after the load");
        }
    }

    // A damaged row: its load fails naming it, the other rows land.
    let (bl, rw) = ([3i64, 4, 5], [0i64, 1, 2]);
    let calls: Vec<(usize, RawTensor)> = (0..3).map(|j| (j, blocks.raw(j))).collect();
    tier.run(BlockMove::Store, &calls, &bl, &rw).unwrap();
    oracle.store(&engine, &[0, 1, 2], &bl, &rw);
    tier.inject_host_corruption(1, 2, 17, &[0xa5]).unwrap();
    let dest = [9i64, 10, 11];
    let calls: Vec<(usize, RawTensor)> = (0..3).map(|j| (j, blocks.raw(j))).collect();
    // cuda's moves return once enqueued: its verdict comes from the next synchronize.
    match tier.run(BlockMove::Load, &calls, &dest, &rw).and_then(|_| tier.synchronize()) {
        Err(TransferError::Integrity { items, .. }) => {
            let named: Vec<(u64, u64)> = items.iter().map(|m| (m.host_index, m.device_index)).collect();
            assert_eq!(named, vec![(2, 11)], "{name}");
            // cuda reports per call (layer 0), the others name the tier tensor.
            assert_eq!(items[0].layer, if name == "cuda" { 0 } else { 1 }, "{name}");
        }
        other => panic!("{name}: expected an integrity failure, got {other:?}"),
    }
    oracle.load(&mut engine, &[0, 2], &rw, &dest);
    oracle.load(&mut engine, &[1], &rw[..2], &dest[..2]);
    for j in [0, 2] {
        assert_eq!(blocks.bytes(j), engine[j], "{name}: intact tensor {j} landed");
    }
    let got = blocks.bytes(1);
    let (row, stride) = SHAPES[1];
    for b in [9usize, 10] {
        assert_eq!(
            got[b * stride as usize..][..row as usize],
            engine[1][b * stride as usize..][..row as usize],
            "{name}: intact rows of tensor 1"
        );
    }

    // Refused before a byte moves.
    let before_rows: Vec<Vec<u8>> = (0..3).map(|j| tier.read_rows(j).unwrap()).collect();
    let before_blocks: Vec<Vec<u8>> = (0..3).map(|j| blocks.bytes(j)).collect();
    let cases: Vec<(BlockMove, Vec<usize>, Vec<i64>, Vec<i64>)> = vec![
        (BlockMove::Store, vec![0], vec![1, 2], vec![0]),
        (BlockMove::Store, vec![0, 1], vec![ROWS as i64], vec![0]),
        (BlockMove::Store, vec![0], vec![1], vec![HOST_ROWS as i64]),
        (BlockMove::Store, vec![0, 2], vec![1, 2], vec![5, 5]),
        (BlockMove::Load, vec![2, 0], vec![1, 1], vec![0, 1]),
        (BlockMove::Store, vec![1, 1], vec![1], vec![0]),
        (BlockMove::Store, vec![3], vec![1], vec![0]),
    ];
    for (dir, ids, bl, rw) in cases {
        let calls: Vec<(usize, RawTensor)> = ids.iter().map(|&j| (j, blocks.raw(j.min(2)))).collect();
        assert!(tier.run(dir, &calls, &bl, &rw).is_err(), "{name}: {dir:?} {ids:?} {bl:?} {rw:?} accepted");
    }
    // One tensor's memory as two tier tensors of a load: both would be written.
    let calls = vec![(0usize, blocks.raw(0)), (1usize, blocks.raw(0))];
    assert!(tier.run(BlockMove::Load, &calls, &[1], &[0]).is_err(), "{name}: a load writing one tensor twice accepted");
    // A tensor of another shape (tensor 2's memory as tensor 0).
    let calls = vec![(0usize, blocks.raw(2))];
    assert!(tier.run(BlockMove::Store, &calls, &[1], &[0]).is_err(), "{name}: a tensor of another size accepted");
    for j in 0..3 {
        assert_eq!(tier.read_rows(j).unwrap(), before_rows[j], "{name}: a refused move changed host rows of tensor {j}");
        assert_eq!(blocks.bytes(j), before_blocks[j], "{name}: a refused move changed tensor {j}");
    }
}

#[test]
fn block_tier_matches_the_oracle_on_every_executor() {
    for device in common::devices() {
        match device.name() {
            "cpu" => {
                let mut blocks = HostBlocks((0..3).map(|j| common::random_bytes((ROWS * SHAPES[j].1) as usize, 100 + j as u64)).collect());
                run_tier(&device, &mut blocks, &mut |b: &mut HostBlocks, engine: &[Vec<u8>]| b.0 = engine.to_vec());
            }
            "wgpu" => {
                // Its buffers are its own: an engine's memory cannot be wrapped.
                let mut t = vec![0u8; (ROWS * 128) as usize];
                let raw = common::host_tensor(&mut t, &[ROWS, 128]);
                let e = BlockTier::new(&device, &[(shapes()[0], raw)], HOST_ROWS).err().expect("wgpu wraps no caller memory");
                assert!(matches!(e, TransferError::BadTensor { .. }), "{e}");
            }
            #[cfg(feature = "cuda")]
            "cuda" => cuda::run(&device),
            other => panic!("unexpected executor {other}"),
        }
    }
}

/// Rows in the caller's region: tensors interleaved in 512-byte rows (96 + 96 + 256 data bytes,
/// then 64 bytes the tier must never touch).
const REGION_ROW: u64 = 512;
const OFFSETS: [u64; 3] = [0, 96, 192];
const GAP: u8 = 0xee;

fn region_with_gaps() -> Vec<u8> {
    let mut region = vec![GAP; (HOST_ROWS * REGION_ROW) as usize];
    for r in 0..HOST_ROWS as usize {
        for (j, &o) in OFFSETS.iter().enumerate() {
            let at = r * REGION_ROW as usize + o as usize;
            region[at..at + SHAPES[j].0 as usize].fill(0);
        }
    }
    region
}

fn gaps(region: &[u8]) -> Vec<u8> {
    region.chunks(REGION_ROW as usize).flat_map(|row| row[448..].to_vec()).collect()
}

#[test]
fn block_tier_over_caller_rows_matches_the_oracle_and_carries_checksums() {
    let device = Device::cpu();
    let mut region = region_with_gaps();
    let host =
        HostRows { region: common::host_tensor(&mut region, &[HOST_ROWS * REGION_ROW]), row_stride: REGION_ROW, offsets: OFFSETS.to_vec() };
    let mut blocks = HostBlocks((0..3).map(|j| common::random_bytes((ROWS * SHAPES[j].1) as usize, 100 + j as u64)).collect());
    let pairs: Vec<(BlockShape, RawTensor)> = (0..3).map(|j| (shapes()[j], blocks.raw(j))).collect();
    // SAFETY: `region` outlives the tier, and only the test writes it, between moves.
    let tier = unsafe { BlockTier::over_host(&device, &pairs, HOST_ROWS, &host) }.unwrap();
    run_on(&device, tier, &mut blocks, &mut |b: &mut HostBlocks, engine: &[Vec<u8>]| b.0 = engine.to_vec());
    assert!(gaps(&region).iter().all(|&b| b == GAP), "the tier wrote bytes between or after the tensors' rows");

    // Another tier over the same rows (another process mapping the region) knows no checksums
    // until given the first one's; then its loads verify against them.
    let mut region = region_with_gaps();
    let host =
        HostRows { region: common::host_tensor(&mut region, &[HOST_ROWS * REGION_ROW]), row_stride: REGION_ROW, offsets: OFFSETS.to_vec() };
    // SAFETY: as above (two tiers over one region, as two processes would map it).
    let mut a = unsafe { BlockTier::over_host(&device, &pairs, HOST_ROWS, &host) }.unwrap();
    let calls = |b: &mut HostBlocks| -> Vec<(usize, RawTensor)> { (0..3).map(|j| (j, b.raw(j))).collect() };
    a.run(BlockMove::Store, &calls(&mut blocks), &[1, 2, 3], &[4, 5, 6]).unwrap();
    let sums: Vec<Vec<Option<u64>>> = (0..3).map(|j| a.row_checksums(j, &[4, 5, 6]).unwrap()).collect();
    assert!(sums.iter().flatten().all(Option::is_some), "a store records every row's checksum");
    assert_eq!(a.row_checksums(0, &[7]).unwrap(), vec![None], "a row never stored has none");
    // SAFETY: as above.
    let mut b = unsafe { BlockTier::over_host(&device, &pairs, HOST_ROWS, &host) }.unwrap();
    for (j, s) in sums.iter().enumerate() {
        b.set_row_checksums(j, &[4, 5, 6], s).unwrap();
    }
    let want = blocks.bytes(0);
    b.run(BlockMove::Load, &calls(&mut blocks), &[10, 11, 12], &[4, 5, 6]).unwrap();
    let got = blocks.bytes(0);
    for (src, dst) in [(1usize, 10usize), (2, 11), (3, 12)] {
        assert_eq!(got[dst * 128..dst * 128 + 96], want[src * 128..src * 128 + 96], "row of block {src} into {dst}");
    }
    // A byte of row 5 (tensor 2) damaged in the shared memory: the other tier's load catches it.
    region[(5 * REGION_ROW + OFFSETS[2] + 7) as usize] ^= 1;
    match b.run(BlockMove::Load, &calls(&mut blocks), &[13, 14, 15], &[4, 5, 6]) {
        Err(TransferError::Integrity { items, .. }) => {
            assert_eq!(items.iter().map(|m| (m.layer, m.host_index, m.device_index)).collect::<Vec<_>>(), vec![(2, 5, 14)]);
        }
        other => panic!("expected an integrity failure, got {other:?}"),
    }
    // Forgotten checksums load unverified; bad rows or counts are refused.
    b.set_row_checksums(2, &[5], &[None]).unwrap();
    b.run(BlockMove::Load, &calls(&mut blocks), &[13, 14, 15], &[4, 5, 6]).unwrap();
    assert!(b.set_row_checksums(0, &[HOST_ROWS as i64], &[Some(1)]).is_err());
    assert!(b.set_row_checksums(0, &[-1], &[Some(1)]).is_err());
    assert!(b.set_row_checksums(0, &[1, 2], &[Some(1)]).is_err());
    assert!(b.set_row_checksums(3, &[1], &[Some(1)]).is_err());
    assert!(b.row_checksums(0, &[HOST_ROWS as i64]).is_err());

    // Layouts refused before anything is wrapped.
    let mut small = vec![0u8; (HOST_ROWS * REGION_ROW - 1) as usize];
    let bad: Vec<(HostRows, &str)> = vec![
        (
            HostRows {
                region: common::host_tensor(&mut small, &[HOST_ROWS * REGION_ROW - 1]),
                row_stride: REGION_ROW,
                offsets: OFFSETS.to_vec(),
            },
            "region too small",
        ),
        (HostRows { region: host.region.clone(), row_stride: REGION_ROW, offsets: vec![0, 96] }, "two offsets for three tensors"),
        (HostRows { region: host.region.clone(), row_stride: REGION_ROW, offsets: vec![0, 95, 192] }, "tensors 0 and 1 overlap"),
        (HostRows { region: host.region.clone(), row_stride: REGION_ROW, offsets: vec![0, 96, 257] }, "tensor 2 leaves the row"),
        (HostRows { region: host.region.clone(), row_stride: u64::MAX, offsets: OFFSETS.to_vec() }, "rows × stride overflows"),
        // SAFETY: never wrapped (refused first): device memory is not what the rows are.
        (
            HostRows {
                region: unsafe { RawTensor::new(host.region.addr(), host.region.len(), vec![host.region.len()], Memory::CudaDevice) },
                row_stride: REGION_ROW,
                offsets: OFFSETS.to_vec(),
            },
            "device memory",
        ),
    ];
    for (h, what) in bad {
        // SAFETY: the regions outlive the call (each is refused, so no tier keeps them).
        assert!(unsafe { BlockTier::over_host(&device, &pairs, HOST_ROWS, &h) }.is_err(), "{what}: accepted");
    }
}

/// Two strided views interleaved in one buffer, `STRIDED_ROW` bytes a block: view 0 of 96 bytes
/// at 0, view 1 of 128 bytes (112 of data) at 96, the rest another view's. Each view's span ends
/// with its last block's width (its memory ends there).
const STRIDED_ROW: u64 = 256;
const VIEWS: [(u64, u64, u64); 2] = [(0, 96, 96), (96, 128, 112)]; // (offset, width, data bytes)

/// Stores blocks of both views, scrambles the buffer's data bytes, loads the blocks back into
/// others: the loaded data equals the stored, and no byte outside the views' data ever changes.
/// `raw(offset, len)` describes a span of the buffer; `read`/`write` the whole buffer.
fn run_strided(device: &Device, raw: &dyn Fn(u64, u64) -> RawTensor, read: &dyn Fn() -> Vec<u8>, write: &dyn Fn(&[u8])) {
    let name = device.name();
    let span = |v: usize| (ROWS - 1) * STRIDED_ROW + VIEWS[v].1;
    let shapes: Vec<BlockShape> =
        VIEWS.iter().map(|&(_, _, data)| BlockShape { row_bytes: data, stride: STRIDED_ROW, rows: ROWS }).collect();
    let pairs: Vec<(BlockShape, RawTensor)> = (0..2).map(|v| (shapes[v], raw(VIEWS[v].0, span(v)))).collect();
    let mut tier = BlockTier::new(device, &pairs, HOST_ROWS).unwrap();
    let data = |row: usize, v: usize| {
        let at = row * STRIDED_ROW as usize + VIEWS[v].0 as usize;
        at..at + VIEWS[v].2 as usize
    };
    let before = read();
    let calls: Vec<(usize, RawTensor)> = (0..2).map(|v| (v, raw(VIEWS[v].0, span(v)))).collect();
    let (blocks, rows) = ([0i64, 5, ROWS as i64 - 1], [3i64, 4, 5]);
    tier.run(BlockMove::Store, &calls, &blocks, &rows).unwrap();
    tier.synchronize().unwrap();
    assert_eq!(read(), before, "{name}: a store changed the engine's buffer");
    let mut scrambled = common::random_bytes(before.len(), 99);
    for (i, b) in scrambled.iter_mut().enumerate() {
        let row = i / STRIDED_ROW as usize;
        if !(0..2).any(|v| data(row, v).contains(&i)) {
            *b = before[i]; // only data bytes change: the rest is not the views'
        }
    }
    write(&scrambled);
    let dest = [7i64, ROWS as i64 - 2, 1];
    tier.run(BlockMove::Load, &calls, &dest, &rows).unwrap();
    tier.synchronize().unwrap();
    let after = read();
    let mut want = scrambled.clone();
    for (&src, &dst) in blocks.iter().zip(&dest) {
        for v in 0..2 {
            want[data(dst as usize, v)].copy_from_slice(&before[data(src as usize, v)]);
        }
    }
    assert_eq!(after, want, "{name}: the load landed other bytes than the stored blocks' data");
    // Views whose data windows meet (view 1 moved 4 bytes into view 0's data): a load would
    // write those bytes twice, and is refused; a store only reads them.
    let meeting = vec![(0usize, raw(0, span(0))), (1usize, raw(92, span(1)))];
    assert!(tier.run(BlockMove::Load, &meeting, &[1], &[0]).is_err(), "{name}: a load into overlapping views accepted");
    let untouched = read();
    tier.run(BlockMove::Store, &meeting, &[1], &[0]).unwrap();
    tier.synchronize().unwrap();
    assert_eq!(read(), untouched);
    // A span that stops inside the last block's data, or runs past the last block's stride, is
    // refused.
    for len in [(ROWS - 1) * STRIDED_ROW + VIEWS[0].2 - 1, ROWS * STRIDED_ROW + 1] {
        let calls = vec![(0usize, raw(0, len))];
        assert!(tier.run(BlockMove::Store, &calls, &[1], &[0]).is_err(), "{name}: a span of {len} bytes accepted");
    }
}

#[test]
fn block_tier_moves_strided_views_without_touching_other_bytes() {
    let device = Device::cpu();
    let buf = std::cell::RefCell::new(common::random_bytes((ROWS * STRIDED_ROW) as usize, 5));
    let base = buf.borrow_mut().as_mut_ptr() as u64;
    // SAFETY: spans of `buf`, which outlives the tier; the test reads and writes it between moves.
    let raw = |offset: u64, len: u64| unsafe { RawTensor::new(base + offset, len, vec![ROWS, len / ROWS], Memory::Host) };
    run_strided(&device, &raw, &|| buf.borrow().clone(), &|b: &[u8]| buf.borrow_mut().copy_from_slice(b));
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use cudarc::driver::result;

    pub(super) struct DeviceBlocks {
        ptrs: Vec<u64>,
        device: Device,
    }

    impl Drop for DeviceBlocks {
        fn drop(&mut self) {
            let _ = self.device.wait_idle();
            for p in &self.ptrs {
                // SAFETY: allocated below; the executor is idle.
                let _ = unsafe { result::free_sync(*p) };
            }
        }
    }

    impl Blocks for DeviceBlocks {
        fn raw(&mut self, j: usize) -> RawTensor {
            let len = ROWS * SHAPES[j].1;
            // SAFETY: our allocation of `len` bytes, alive until the test's end.
            unsafe { RawTensor::new(self.ptrs[j], len, vec![ROWS, SHAPES[j].1], Memory::CudaDevice) }
        }
        fn bytes(&self, j: usize) -> Vec<u8> {
            self.device.wait_idle().unwrap();
            let mut out = vec![0u8; (ROWS * SHAPES[j].1) as usize];
            unsafe { result::memcpy_dtoh_sync(&mut out, self.ptrs[j]) }.unwrap();
            out
        }
    }

    fn upload(b: &mut DeviceBlocks, engine: &[Vec<u8>]) {
        b.device.wait_idle().unwrap();
        for (p, bytes) in b.ptrs.iter().zip(engine) {
            unsafe { result::memcpy_htod_sync(*p, bytes) }.unwrap();
        }
        result::ctx::synchronize().unwrap();
    }

    pub(super) fn run(device: &Device) {
        let ctx = cudarc::driver::CudaContext::new(0).unwrap();
        ctx.bind_to_thread().unwrap();
        let ptrs = (0..3).map(|j| unsafe { result::malloc_sync((ROWS * SHAPES[j].1) as usize) }.unwrap()).collect();
        let mut blocks = DeviceBlocks { ptrs, device: device.clone() };
        let init: Vec<Vec<u8>> = (0..3).map(|j| common::random_bytes((ROWS * SHAPES[j].1) as usize, 100 + j as u64)).collect();
        upload(&mut blocks, &init);
        run_tier(device, &mut blocks, &mut upload);
        // Strided views of one device buffer.
        let len = (ROWS * STRIDED_ROW) as usize;
        let p = unsafe { result::malloc_sync(len) }.unwrap();
        unsafe { result::memcpy_htod_sync(p, &common::random_bytes(len, 5)) }.unwrap();
        // SAFETY: spans of our allocation, alive until freed below, after the executor is idle.
        let raw = |offset: u64, l: u64| unsafe { RawTensor::new(p + offset, l, vec![ROWS, l / ROWS], Memory::CudaDevice) };
        let read = || {
            device.wait_idle().unwrap();
            let mut out = vec![0u8; len];
            unsafe { result::memcpy_dtoh_sync(&mut out, p) }.unwrap();
            out
        };
        let write = |b: &[u8]| {
            device.wait_idle().unwrap();
            unsafe { result::memcpy_htod_sync(p, b) }.unwrap();
            result::ctx::synchronize().unwrap();
        };
        run_strided(device, &raw, &read, &write);
        device.wait_idle().unwrap();
        unsafe { result::free_sync(p) }.unwrap();
        // Host tensors are not what a cuda tier moves.
        let mut t = vec![0u8; (ROWS * 128) as usize];
        let raw = common::host_tensor(&mut t, &[ROWS, 128]);
        assert!(BlockTier::new(device, &[(shapes()[0], raw)], HOST_ROWS).is_err());
    }
}
