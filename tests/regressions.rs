//! Regression tests for defects found by outside checks: each one failed before its fix.
//! Every executor present here runs each case; a rejected call must leave every byte as it was.

mod common;

use hicache_io::error::TransferError;
use hicache_io::plan::Op;
use hicache_io::tools::check::Rng;
use hicache_io::tools::oracle::{self, OracleBuffers};
use hicache_io::{Device, DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, LayerMap, Layout, PoolKind, Profile};

struct Pools {
    dev: DevicePool<'static>,
    host: HostPool<'static>,
    /// Mirrors of the contents, for the oracle.
    dev_bytes: Vec<Vec<Vec<u8>>>,
    host_bytes: Vec<Vec<u8>>,
}

fn filled(device: &Device, dc: &DevicePoolConfig, hc: &HostPoolConfig, seed: u64) -> Pools {
    let mut dev = DevicePool::new(device, dc).unwrap();
    let mut host = HostPool::new(&dev, hc).unwrap();
    let mut rng = Rng::new(seed);
    let g = dev.geometry().clone();
    let mut dev_bytes = Vec::new();
    let mut host_bytes = Vec::new();
    for c in 0..g.kind().components() {
        let mut layers = Vec::new();
        for s in 0..g.buffer_count() {
            let mut b = vec![0u8; g.layer_bytes() as usize];
            rng.fill(&mut b);
            dev.write_buffer(c, s, &b).unwrap();
            layers.push(b);
        }
        dev_bytes.push(layers);
        let mut b = vec![0u8; host.geometry().buffer_bytes() as usize];
        rng.fill(&mut b);
        host.write_buffer(c, &b).unwrap();
        host_bytes.push(b);
    }
    Pools { dev, host, dev_bytes, host_bytes }
}

impl Pools {
    fn snapshot(&self) -> (Vec<Vec<Vec<u8>>>, Vec<Vec<u8>>) {
        let g = self.dev.geometry();
        let comps = g.kind().components();
        let dev = (0..comps).map(|c| (0..g.buffer_count()).map(|s| self.dev.read_buffer(c, s).unwrap()).collect()).collect();
        let host = (0..comps).map(|c| self.host.read_buffer(c).unwrap()).collect();
        (dev, host)
    }
    fn run(&mut self, op: Op, io: IoBackend, hi: &[i64], di: &[i64]) -> Result<(), TransferError> {
        match op {
            Op::Load { layer_id, is_draft: false } => self.host.load_to_device_per_layer(&mut self.dev, hi, di, layer_id, io),
            Op::Load { layer_id, is_draft: true } => self.host.load_draft_to_device(&mut self.dev, hi, di, layer_id, io),
            Op::Backup => self.host.backup_from_device_all_layer(&self.dev, hi, di, io),
            Op::BackupLayer { layer_id, is_draft } => self.host.backup_from_device_per_layer(&self.dev, hi, di, layer_id, is_draft, io),
        }
    }
    /// Runs the call; on success compares every byte with the oracle, on failure asserts that
    /// nothing changed. Returns the call's result.
    fn run_checked(&mut self, tag: &str, op: Op, io: IoBackend, hi: &[i64], di: &[i64]) -> Result<(), TransferError> {
        let before = self.snapshot();
        let res = self.run(op, io, hi, di);
        match &res {
            Ok(()) => {
                oracle::apply(self.host.pair(), op, hi, di, OracleBuffers { host: &mut self.host_bytes, device: &mut self.dev_bytes });
                let (dev, host) = self.snapshot();
                assert!(host == self.host_bytes, "{tag}: host bytes differ from the oracle");
                assert!(dev == self.dev_bytes, "{tag}: device bytes differ from the oracle");
            }
            Err(_) => assert!(self.snapshot() == before, "{tag}: a rejected call changed a buffer"),
        }
        res
    }
}

/// page_head and per-head chunks that are not a multiple of the portable 4-byte word: one
/// decision on every executor (rejected, naming chunk and word), never wrong bytes.
#[test]
fn page_head_small_chunks_are_one_portable_decision() {
    for device in common::devices() {
        for (bytes_per_token, heads, layers) in [(8u64, 4u64, 1usize), (24, 4, 1), (24, 4, 3), (12, 4, 2), (8, 8, 2)] {
            let tag = format!("{} page_head {bytes_per_token} B / {heads} heads, {layers} layers", device.name());
            let dc = DevicePoolConfig { kind: PoolKind::Mha, bytes_per_token, slots: 2, page_size: 1, layers: LayerMap::new(layers) };
            let hc = HostPoolConfig { layout: Layout::PageHead, size: 2, head_num: heads, profile: Profile::Extended, integrity: None };
            let mut p = filled(&device, &dc, &hc, 3);
            let err = p.run_checked(&format!("{tag} backup"), Op::Backup, IoBackend::Kernel, &[1], &[1]).expect_err(&tag);
            let chunk = bytes_per_token / heads;
            assert!(
                matches!(err, TransferError::ChunkNotWordAligned { chunk_bytes, word: 4, .. } if chunk_bytes == chunk),
                "{tag}: {err:?}"
            );
            let err = p.run_checked(&format!("{tag} load"), Op::Load { layer_id: 0, is_draft: false }, IoBackend::Kernel, &[1], &[0]);
            assert!(matches!(err, Err(TransferError::ChunkNotWordAligned { .. })), "{tag}: {err:?}");
        }
        // A chunk of whole words still moves, byte for byte.
        let dc = DevicePoolConfig { kind: PoolKind::Mha, bytes_per_token: 16, slots: 2, page_size: 1, layers: LayerMap::new(3) };
        let hc = HostPoolConfig { layout: Layout::PageHead, size: 2, head_num: 4, profile: Profile::Extended, integrity: None };
        let mut p = filled(&device, &dc, &hc, 4);
        p.run_checked("page_head 4-byte heads", Op::Backup, IoBackend::Kernel, &[1, 0], &[0, 1]).unwrap();
    }
}

/// A load of a layer this rank does not own, or of a DSA skip-topk layer, returns before the
/// table is consulted (sglang's order), in both profiles and for every layout and io backend.
#[test]
fn unowned_and_skipped_layer_loads_return_before_the_table() {
    for device in common::devices() {
        for profile in [Profile::Sglang, Profile::Extended] {
            for layout in [Layout::LayerFirst, Layout::PageFirst, Layout::PageFirstDirect] {
                for io in IoBackend::ALL {
                    for page in [64u64, 1] {
                        let tag = format!("{} {profile} dsa {layout} {io} P={page}", device.name());
                        let mut layers = LayerMap::new(4);
                        layers.skipped[1] = true;
                        let dc = DevicePoolConfig { kind: PoolKind::DsaIndexer, bytes_per_token: 132, slots: 4, page_size: page, layers };
                        let hc = HostPoolConfig { layout, size: 4 * page, head_num: 1, profile, integrity: None };
                        let mut p = filled(&device, &dc, &hc, 5);
                        let hi: Vec<i64> = (0..page as i64).collect();
                        let di: Vec<i64> = (page as i64..2 * page as i64).collect();
                        p.run_checked(&tag, Op::Load { layer_id: 1, is_draft: false }, io, &hi, &di)
                            .unwrap_or_else(|e| panic!("{tag}: skip-topk layer load must be a no-op, got {e}"));
                    }
                }
            }
            // Layer-sharded MLA: a layer outside the owned range, with a layout the table rejects.
            let mut layers = LayerMap::new(4);
            layers.layer_shard = Some((2, 4));
            let dc = DevicePoolConfig { kind: PoolKind::Mla, bytes_per_token: 64, slots: 8, page_size: 4, layers };
            let hc = HostPoolConfig { layout: Layout::PageFirst, size: 8, head_num: 1, profile, integrity: None };
            let mut p = filled(&device, &dc, &hc, 6);
            let tag = format!("{} {profile} mla sharded page_first direct", device.name());
            p.run_checked(&tag, Op::Load { layer_id: 0, is_draft: false }, IoBackend::Direct, &[0, 1, 2, 3], &[4, 5, 6, 7])
                .unwrap_or_else(|e| panic!("{tag}: unowned layer load must be a no-op, got {e}"));
            // An owned layer still meets the table.
            let err = p.run_checked(&tag, Op::Load { layer_id: 2, is_draft: false }, IoBackend::Direct, &[0, 1, 2, 3], &[4, 5, 6, 7]);
            assert_eq!(err.unwrap_err().to_string(), "Unsupported layout: page_first");
        }
    }
}

/// DSA indexer host pools in layer_first have storage helpers (sglang's `buffer[:, page, :]`):
/// the flat page is every host layer's item of that page, layer by layer.
#[test]
fn dsa_layer_first_storage_helpers() {
    for device in common::devices() {
        let mut layers = LayerMap::new(3);
        layers.drafts = 1;
        let dc = DevicePoolConfig { kind: PoolKind::DsaIndexer, bytes_per_token: 132, slots: 8, page_size: 64, layers };
        let hc = HostPoolConfig { layout: Layout::LayerFirst, size: 8 * 64, head_num: 1, profile: Profile::Sglang, integrity: None };
        let mut p = filled(&device, &dc, &hc, 7);
        let g = p.host.geometry().clone();
        let item = g.item_bytes() as usize;
        let slots = g.slots() as usize;
        let page = p.host.get_data_page(6 * 64).unwrap_or_else(|e| panic!("{}: {e}", device.name()));
        let want: Vec<u8> = (0..g.layer_num() as usize).flat_map(|l| p.host_bytes[0][(l * slots + 6) * item..][..item].to_vec()).collect();
        assert_eq!(page.len(), want.len());
        assert!(page == want, "{}: get_data_page bytes", device.name());
        // set_from_flat_data_page is its inverse.
        let new: Vec<u8> = (0..want.len()).map(|i| (i * 7 % 251) as u8).collect();
        p.host.set_from_flat_data_page(2 * 64, &new).unwrap();
        assert!(p.host.get_data_page(2 * 64).unwrap() == new);
        let host = p.host.read_buffer(0).unwrap();
        for l in 0..g.layer_num() as usize {
            assert!(host[(l * slots + 2) * item..][..item] == new[l * item..][..item], "layer {l}");
        }
    }
}

/// An index list larger than one wgpu binding (16,777,217 pairs of 8 bytes > 128 MiB): the
/// planner splits the call into steps that fit, and every executor moves the same bytes.
#[test]
fn index_lists_larger_than_one_binding_are_split() {
    let n: usize = (1 << 24) + 1;
    for device in common::devices() {
        let dc = DevicePoolConfig { kind: PoolKind::Mla, bytes_per_token: 4, slots: n as u64, page_size: 1, layers: LayerMap::new(1) };
        let hc = HostPoolConfig { layout: Layout::LayerFirst, size: n as u64, head_num: 1, profile: Profile::Extended, integrity: None };
        let mut dev = DevicePool::new(&device, &dc).unwrap();
        let mut host = HostPool::new(&dev, &hc).unwrap();
        let host_words: Vec<u32> = (0..host.geometry().slots() as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        host.write_buffer(0, bytemuck::cast_slice(&host_words)).unwrap();
        // Reverse order: device slot i gets host slot n - 1 - i.
        let hi: Vec<i64> = (0..n as i64).rev().collect();
        let di: Vec<i64> = (0..n as i64).collect();
        let plan = host
            .plan(
                &dev,
                &hicache_io::Request {
                    op: Op::Load { layer_id: 0, is_draft: false },
                    io_backend: IoBackend::Kernel,
                    host_indices: &hi,
                    device_indices: &di,
                },
            )
            .unwrap();
        let max = device.capabilities().max_gather_items;
        assert!(plan.steps().len() as u64 >= (n as u64).div_ceil(max), "{}: {} steps", device.name(), plan.steps().len());
        host.execute_load(&mut dev, &plan).unwrap_or_else(|e| panic!("{}: {e}", device.name()));
        let got = dev.read_buffer(0, 0).unwrap();
        let got: &[u32] = bytemuck::cast_slice(&got);
        let bad = (0..n).find(|&i| got[i] != host_words[n - 1 - i]);
        assert_eq!(bad, None, "{}: first wrong device slot", device.name());
    }
}

/// Items of around every power-of-two word count up to 2^18 words (1 MiB of 4-byte words, 4 MiB
/// of 16-byte words), both word shapes, per-head chunks too: every executor moves whole items.
/// wgpu's gather used to stop at 65,535 words per chunk and return `Ok` (found by an outside
/// adversarial run: the last 16 B of each 1 MiB item were never written).
#[test]
fn large_items_are_copied_whole() {
    for device in common::devices() {
        let mut sizes: Vec<u64> = Vec::new();
        // The simulated driver runs the copy kernel thread by thread on the cpu: there, 2^16 + 1
        // words already cross every 16-bit bound, and 4 MiB items took a minute.
        let powers: &[u32] = if common::on_cuda_sim(&device) { &[14, 16] } else { &[14, 16, 18] };
        for &p in powers {
            for word in [4u64, 16] {
                let w = 1u64 << p;
                sizes.extend([(w - 1) * word, w * word, (w + 1) * word]);
            }
        }
        // sizes around 2^16 words of 16 bytes: 1,048,560, 1,048,576 and 1,048,592 bytes; 262,148.
        sizes.extend([1_048_560, 262_148]);
        sizes.sort_unstable();
        sizes.dedup();
        for item in sizes {
            for io in [IoBackend::Kernel, IoBackend::Direct] {
                let tag = format!("{} mla layer_first {item} B {io}", device.name());
                let dc = DevicePoolConfig { kind: PoolKind::Mla, bytes_per_token: item, slots: 6, page_size: 1, layers: LayerMap::new(1) };
                let hc = HostPoolConfig { layout: Layout::LayerFirst, size: 4, head_num: 1, profile: Profile::Extended, integrity: None };
                let mut p = filled(&device, &dc, &hc, item);
                p.run_checked(&format!("{tag} load"), Op::Load { layer_id: 0, is_draft: false }, io, &[3, 0], &[1, 5])
                    .unwrap_or_else(|e| panic!("{tag}: {e}"));
                p.run_checked(&format!("{tag} backup"), Op::Backup, io, &[2, 4], &[5, 0]).unwrap_or_else(|e| panic!("{tag}: {e}"));
            }
        }
        // page_head: per-head chunks of 2^16 + 1 16-byte words and of 2^16 4-byte words.
        for (bytes_per_token, heads) in [(2 * 16 * 65_537u64, 2u64), (4 * 4 * 65_536, 4)] {
            let tag = format!("{} page_head {bytes_per_token} B / {heads} heads", device.name());
            let dc = DevicePoolConfig { kind: PoolKind::Mha, bytes_per_token, slots: 3, page_size: 1, layers: LayerMap::new(2) };
            let hc = HostPoolConfig { layout: Layout::PageHead, size: 2, head_num: heads, profile: Profile::Extended, integrity: None };
            let mut p = filled(&device, &dc, &hc, heads);
            p.run_checked(&format!("{tag} backup"), Op::Backup, IoBackend::Kernel, &[2, 0], &[0, 1])
                .unwrap_or_else(|e| panic!("{tag}: {e}"));
            p.run_checked(&format!("{tag} load"), Op::Load { layer_id: 1, is_draft: false }, IoBackend::Kernel, &[1], &[2])
                .unwrap_or_else(|e| panic!("{tag}: {e}"));
        }
    }
}

/// wgpu's `direct` steps go to the queue in submissions of a bounded number of buffer copies
/// (here 7, so a call of two hundred scattered items is dozens of submissions, each waiting
/// for the one before): plain and asynchronous loads and backups, with and without item
/// checksums, equal the oracle byte for byte. A ten-million-entry scattered load once lost the
/// device with every copy in one submission.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_direct_steps_go_in_bounded_submissions() {
    use hicache_io::exec::wgpu::{WgpuExecutor, WgpuOptions};
    use hicache_io::exec::ExecutorKind;
    let exec = match WgpuExecutor::with_options(WgpuOptions { max_copies_per_submission: Some(7), ..Default::default() }) {
        Ok(e) => e,
        Err(e) if common::required(ExecutorKind::Wgpu) => panic!("{e}"),
        Err(e) => return eprintln!("skipping: {e}"),
    };
    let device = Device::Wgpu(exec);
    let n = 200usize;
    for integrity in [Some(false), Some(true)] {
        let dc = DevicePoolConfig { kind: PoolKind::Mha, bytes_per_token: 32, slots: 512, page_size: 1, layers: LayerMap::new(3) };
        let hc = HostPoolConfig { layout: Layout::LayerFirst, size: 512, head_num: 1, profile: Profile::Extended, integrity };
        let mut p = filled(&device, &dc, &hc, 17);
        let mut rng = Rng::new(5);
        // No two items consecutive on both sides: one run (one buffer copy) per item.
        let mut hi: Vec<i64> = (0..n as i64).map(|i| 2 * i).collect();
        for i in (1..n).rev() {
            hi.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let di: Vec<i64> = (0..n as i64).map(|i| 511 - i).collect();
        let tag = format!("integrity {integrity:?}");
        p.run_checked(&format!("{tag}: backup"), Op::Backup, IoBackend::Direct, &di, &hi).unwrap();
        p.run_checked(&format!("{tag}: load"), Op::Load { layer_id: 1, is_draft: false }, IoBackend::Direct, &hi, &di).unwrap();
        // Asynchronous: the parts are tickets of the submit thread.
        let (hi2, di2): (Vec<i64>, Vec<i64>) = (hi.iter().map(|x| x + 1).collect(), di.iter().rev().copied().collect());
        p.host.backup_from_device_all_layer_async(&p.dev, &di2, &hi2, IoBackend::Direct).unwrap().wait().unwrap();
        p.host.load_to_device_per_layer_async(&mut p.dev, &hi2, &di2, 2, IoBackend::Direct).unwrap().wait().unwrap();
        for (op, h, d) in [(Op::Backup, &di2, &hi2), (Op::Load { layer_id: 2, is_draft: false }, &hi2, &di2)] {
            oracle::apply(p.host.pair(), op, h, d, OracleBuffers { host: &mut p.host_bytes, device: &mut p.dev_bytes });
        }
        let (dev, host) = p.snapshot();
        assert!(host == p.host_bytes, "{tag}: async host bytes differ from the oracle");
        assert!(dev == p.dev_bytes, "{tag}: async device bytes differ from the oracle");
    }
}

/// The probe of a ten-million-entry `direct` load on wgpu: host and device pools of 10M 4-byte
/// items, a random permutation of host items onto a reversed device list (no two consecutive:
/// 10M buffer copies). Minutes on lavapipe; run by hand (`--ignored`), it prints how long.
#[cfg(feature = "wgpu")]
#[test]
#[ignore = "minutes on a CPU adapter: run by hand"]
fn wgpu_ten_million_scattered_direct_load() {
    let Some(device) = common::open(hicache_io::exec::ExecutorKind::Wgpu) else { return };
    let n = 10_000_000usize;
    let dc = DevicePoolConfig { kind: PoolKind::Mla, bytes_per_token: 4, slots: n as u64, page_size: 1, layers: LayerMap::new(1) };
    let hc = HostPoolConfig { layout: Layout::LayerFirst, size: n as u64, head_num: 1, profile: Profile::Extended, integrity: None };
    let mut dev = DevicePool::new(&device, &dc).unwrap();
    let host = HostPool::new(&dev, &hc).unwrap();
    let words: Vec<u32> = (0..host.geometry().slots() as u32).map(|i| i.wrapping_mul(2_654_435_761) | 1).collect();
    let mut host = host;
    host.write_buffer(0, bytemuck::cast_slice(&words)).unwrap();
    let mut rng = Rng::new(1);
    let mut hi: Vec<i64> = (0..n as i64).collect();
    for i in (1..n).rev() {
        hi.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let di: Vec<i64> = (0..n as i64).rev().collect();
    let t = std::time::Instant::now();
    host.load_to_device_per_layer(&mut dev, &hi, &di, 0, IoBackend::Direct).unwrap();
    device.synchronize().unwrap();
    let secs = t.elapsed().as_secs_f64();
    let got = dev.read_buffer(0, 0).unwrap();
    let got: &[u32] = bytemuck::cast_slice(&got);
    assert_eq!((0..n).find(|&i| got[di[i] as usize] != words[hi[i] as usize]), None);
    eprintln!("{}: 10M scattered direct items in {secs:.1} s", device.label());
}
