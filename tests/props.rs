//! Property tests: every executor equals the oracle byte for byte over random cells, geometry
//! and indices (both profiles); wgpu again with binding windows forced tiny so every window
//! edge is crossed; and sharded backup + per-layer loads restore a device pool exactly.

mod common;

use hicache_io::error::TransferError;
use hicache_io::exec::ExecutorKind;
use hicache_io::geometry::{IoBackend, Layout, PoolKind, Profile};
use hicache_io::plan::{decide, Cell, TableOp};
use hicache_io::tools::check::{all_cells, random_case, run_case, supported_cells, Outcome, Rng};
use hicache_io::{Device, DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, LayerMap};
use proptest::prelude::*;

fn assert_case(device: &Device, profile: Profile, cell_idx: usize, seed: u64) -> Result<(), TestCaseError> {
    let cells = supported_cells(profile);
    let cell = cells[cell_idx % cells.len()];
    let case = random_case(cell, profile, &mut Rng::new(seed));
    match run_case(device, &case).map_err(|e| TestCaseError::fail(format!("{e}")))? {
        Outcome::Match { .. } => Ok(()),
        other => Err(TestCaseError::fail(format!("{} {cell} seed {seed}: {other:?} ({case:?})", device.name()))),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn cpu_equals_oracle(cell in 0usize..64, seed in any::<u64>(), sglang in any::<bool>()) {
        let profile = if sglang { Profile::Sglang } else { Profile::Extended };
        assert_case(&Device::cpu(), profile, cell, seed)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn gpu_executors_equal_oracle(cell in 0usize..64, seed in any::<u64>(), sglang in any::<bool>()) {
        let profile = if sglang { Profile::Sglang } else { Profile::Extended };
        for device in gpu_devices() {
            assert_case(device, profile, cell, seed)?;
        }
    }
}

fn gpu_devices() -> &'static [Device] {
    static DEVICES: std::sync::OnceLock<Vec<Device>> = std::sync::OnceLock::new();
    DEVICES.get_or_init(|| [ExecutorKind::Wgpu, ExecutorKind::Cuda].into_iter().filter_map(common::open).collect())
}

/// Every supported cell on wgpu with windows of 64..512 bytes: pools of a few KiB span many
/// windows, and every item chunk is found in exactly one of them. Then with gather steps of at
/// most 3 index pairs: the planner splits every call, and the bytes are the same.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_tiny_windows_equal_oracle() {
    use hicache_io::exec::wgpu::{WgpuExecutor, WgpuOptions};
    let mut rng = Rng::new(99);
    // Windows start at binding offsets: on an adapter whose offsets are coarser than a window
    // (SwiftShader's 256 bytes), the window is the next multiple of them.
    let align = match WgpuExecutor::new() {
        Ok(e) => e.device().limits().min_storage_buffer_offset_alignment as u64,
        Err(e) if common::required(ExecutorKind::Wgpu) => panic!("{e}"),
        Err(e) => return eprintln!("skipping: {e}"),
    };
    // The last setting also splits every call into steps of at most 3 index pairs.
    for (window, items) in [(64u64, None), (96, None), (256, None), (512, None), (1 << 20, Some(3))] {
        let window = window.div_ceil(align) * align;
        let opts = WgpuOptions { max_window: Some(window), max_gather_items: items, ..Default::default() };
        let exec = WgpuExecutor::with_options(opts).unwrap();
        let device = Device::Wgpu(exec);
        // Item checksums summed across windows, each equal to the oracle's (extended cases).
        let mut sums = 0;
        for profile in [Profile::Extended, Profile::Sglang] {
            for cell in supported_cells(profile) {
                for _ in 0..2 {
                    let case = random_case(cell, profile, &mut rng);
                    match run_case(&device, &case).unwrap() {
                        Outcome::Match { checksums, .. } => sums += checksums,
                        // Items wider than the window cannot be bound: the planner says so with a
                        // typed error, before anything moves.
                        Outcome::Rejected(TransferError::WindowTooSmall { required, .. }) if required > window => {}
                        Outcome::Rejected(e) => panic!("window {window} {cell}: rejected {e}"),
                        other => panic!("window {window} {cell}: {other:?} ({case:?})"),
                    }
                }
            }
        }
        assert!(sums > 100, "window {window}: only {sums} checksums compared");
    }
}

/// Every supported cell on wgpu with pools split into segments of about 1–4 KiB (and windows
/// smaller than a segment): every pool of a case spans many segments, each chunk lies in one,
/// `direct` runs are split at segment edges, and the bytes equal the oracle's.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_tiny_segments_equal_oracle() {
    use hicache_io::exec::wgpu::{WgpuExecutor, WgpuOptions};
    let mut rng = Rng::new(7);
    for (segment, window) in [(1024u64, 1u64 << 20), (2048, 256), (4096, 1024)] {
        let opts = WgpuOptions { max_segment: Some(segment), max_window: Some(window), ..Default::default() };
        let exec = match WgpuExecutor::with_options(opts) {
            Ok(e) => e,
            Err(e) if common::required(ExecutorKind::Wgpu) => panic!("{e}"),
            Err(e) => return eprintln!("skipping: {e}"),
        };
        let device = Device::Wgpu(exec);
        let (mut segmented, mut sums) = (0, 0);
        for profile in [Profile::Extended, Profile::Sglang] {
            for cell in supported_cells(profile) {
                for _ in 0..3 {
                    let case = random_case(cell, profile, &mut rng);
                    match run_case(&device, &case) {
                        Ok(Outcome::Match { checksums, .. }) => {
                            segmented += 1;
                            sums += checksums;
                        }
                        // An item wider than a segment cannot be placed: refused before anything moves.
                        Err(TransferError::OutOfMemory { .. }) => {}
                        Ok(Outcome::Rejected(TransferError::WindowTooSmall { required, .. })) if required > window => {}
                        other => panic!("segment {segment} window {window} {cell}: {other:?} ({case:?})"),
                    }
                }
            }
        }
        assert!(segmented > 150, "segment {segment}: only {segmented} cases ran");
        assert!(sums > 100, "segment {segment}: only {sums} checksums compared");
    }
}

/// Issue 5's round trip: for every layout and io backend a layer-sharded backup accepts
/// (profile extended), backing up every owned layer and draft and then loading each one into a
/// fresh device pool restores the transferred slots exactly, on every executor.
#[test]
fn sharded_backup_then_loads_restore_the_device_pool() {
    for device in common::devices() {
        for cell in all_cells().into_iter().filter(|c| c.op == TableOp::ShardedBackup) {
            if decide(Profile::Extended, cell, 8448, 4).is_err() {
                continue;
            }
            if decide(Profile::Extended, Cell { op: TableOp::Load, ..cell }, 8448, 4).is_err() {
                continue;
            }
            for seed in 0..3u64 {
                roundtrip(&device, cell.kind, cell.layout, cell.io, seed);
            }
        }
    }
}

fn roundtrip(device: &Device, kind: PoolKind, layout: Layout, io: IoBackend, seed: u64) {
    let mut rng = Rng::new(seed + 1000);
    let p = if kind == PoolKind::DsaIndexer { 1 + rng.below(4) } else { 4 };
    let mut layers = LayerMap::new(6);
    layers.layer_shard = Some((1, 5));
    if kind == PoolKind::DsaIndexer {
        layers.skipped[3] = true;
    }
    layers.drafts = 1 + seed as usize % 2;
    let per_token = if kind == PoolKind::DsaIndexer { 132 } else { 64 };
    let cfg = DevicePoolConfig {
        kind,
        bytes_per_token: per_token,
        slots: if kind == PoolKind::DsaIndexer { 8 } else { 8 * p },
        page_size: p,
        layers: layers.clone(),
    };
    let mut dev = DevicePool::new(device, &cfg).unwrap();
    let mut host =
        HostPool::new(&dev, &HostPoolConfig { layout, size: 12 * p, head_num: 2, profile: Profile::Extended, integrity: None }).unwrap();
    let g = dev.geometry().clone();
    let mut original = Vec::new();
    for c in 0..kind.components() {
        for s in 0..g.buffer_count() {
            let mut b = vec![0u8; g.layer_bytes() as usize];
            rng.fill(&mut b);
            dev.write_buffer(c, s, &b).unwrap();
            original.push(b);
        }
    }
    // Device pages 1, 4, 6 go to host pages 9, 2, 5.
    let pages = |ps: &[i64]| ps.iter().flat_map(|q| q * p as i64..(q + 1) * p as i64).collect::<Vec<_>>();
    let (dev_idx, host_idx) = (pages(&[1, 4, 6]), pages(&[9, 2, 5]));
    host.backup_from_device_all_layer(&dev, &host_idx, &dev_idx, io).unwrap();
    let mut fresh = DevicePool::new(device, &cfg).unwrap();
    for l in layers.live_layers() {
        host.load_to_device_per_layer(&mut fresh, &host_idx, &dev_idx, l, io).unwrap();
    }
    for k in 0..layers.drafts {
        host.load_draft_to_device(&mut fresh, &host_idx, &dev_idx, layers.layer_num + k, io).unwrap();
    }
    let item = g.item_bytes() as usize;
    let unit = |t: i64| if kind == PoolKind::DsaIndexer { t as usize / p as usize } else { t as usize };
    let mut i = 0;
    for c in 0..kind.components() {
        for s in 0..g.buffer_count() {
            let got = fresh.read_buffer(c, s).unwrap();
            let mut want = vec![0u8; got.len()];
            for t in dev_idx.iter().copied() {
                let u = unit(t);
                want[u * item..(u + 1) * item].copy_from_slice(&original[i][u * item..(u + 1) * item]);
            }
            assert!(got == want, "{} {kind} {layout} {io} seed {seed}: component {c} buffer {s} not restored", device.name());
            i += 1;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// page_head (and per-head chunks) of 1, 2, 3, 6, ... bytes: every executor makes the same
    /// decision — whole 4-byte words move byte for byte, anything else is refused naming the
    /// chunk and the word.
    #[test]
    fn page_head_chunks_are_one_decision(heads in 1u64..5, chunk in prop::sample::select(vec![1u64, 2, 3, 4, 6, 8, 12]), seed in any::<u64>(), backup in any::<bool>()) {
        let mut rng = Rng::new(seed);
        let cell = hicache_io::plan::Cell { kind: PoolKind::Mha, op: if backup { TableOp::Backup } else { TableOp::Load }, layout: Layout::PageHead, io: IoBackend::Kernel };
        let mut case = random_case(cell, Profile::Extended, &mut rng);
        case.device.bytes_per_token = heads * chunk;
        case.host.head_num = heads;
        for device in std::iter::once(&Device::cpu()).chain(gpu_devices()) {
            match run_case(device, &case).map_err(|e| TestCaseError::fail(format!("{e}")))? {
                Outcome::Match { .. } => prop_assert!(chunk % 4 == 0, "{}: accepted a {chunk}-byte chunk", device.name()),
                Outcome::Rejected(TransferError::ChunkNotWordAligned { chunk_bytes, word: 4, .. }) => {
                    prop_assert!(chunk % 4 != 0 && chunk_bytes == chunk, "{}: refused a {chunk}-byte chunk", device.name())
                }
                // The item itself is not whole words: the launcher check (sglang's message) comes first.
                Outcome::Rejected(TransferError::ItemNotWordAligned { item_bytes, word: 4 }) => {
                    prop_assert!(item_bytes % 4 != 0 && item_bytes == heads * chunk, "{}: {item_bytes}", device.name())
                }
                other => prop_assert!(false, "{} {heads}×{chunk}: {other:?}", device.name()),
            }
        }
    }
}
