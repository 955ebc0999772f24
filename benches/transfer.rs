//! Criterion benchmarks: every executor present × path × item size × pattern × N × L, loads of
//! one layer and backups of all layers, with throughput in bytes moved. Each group also times
//! the executor's own one-copy ceiling of the same bytes, so ratios come from one run.
//!
//! `cargo bench` runs the quick subset of `hicache-io bench` (random items, N = 4096, L = 8;
//! 8448, 1152 and 128 B); `HICACHE_BENCH_FULL=1 cargo bench` the whole matrix (long: the L = 61
//! cells need several GiB of memory, more than a small machine has, and wgpu skips pools above its
//! buffer limit). Filter with e.g. `cargo bench -- 'cpu/128B'`.
//!
//! `cargo bench -- l3/` times the L3 store's checksummed passes over one batch of pages (the
//! native part of `scripts/bench-l3.py`'s checksummed rows): `stage_put` copies each object of
//! the batch into the store's staging buffer and checksums it in the same read (and checks the
//! pages against the item checksums their backup recorded), `land_staged` copies the objects
//! back into the pool, checksums them and records the pages' item checksums; `pages_intact` is
//! the item checks alone (each page's items summed and compared with what their backup
//! recorded), read from memory; `ceiling` is one copy of the same bytes. Batches rotate over a
//! pool larger than the caches, as a store's do.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use hicache_io::exec::{probe_all, Device};
use hicache_io::geometry::PageShare;
use hicache_io::integrity::STORAGE_SEED;
use hicache_io::tools::bench::{specs, BenchSpec, Fixture};
use hicache_io::{DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, LayerMap, Layout, PageObjects, PoolKind, Profile};

fn devices() -> Vec<Device> {
    probe_all()
        .into_iter()
        .filter_map(|(k, d)| match d {
            Ok(d) => Some(d),
            Err(e) => {
                eprintln!("skipping {}: {e}", k.name());
                None
            }
        })
        .collect()
}

fn group_name(dev: &Device, s: &BenchSpec) -> String {
    format!("{}/{}B/{}/N{}/L{}", dev.name(), s.item, s.pattern.name(), s.items, s.layers)
}

fn transfers(c: &mut Criterion) {
    for dev in devices() {
        let all = specs(std::env::var_os("HICACHE_BENCH_FULL").is_none_or(|v| v != "1"));
        // One group per (executor, item, pattern, N, L): the paths and the ceiling side by side.
        let mut i = 0;
        while i < all.len() {
            let head = all[i];
            let same = |s: &BenchSpec| s.item == head.item && s.pattern == head.pattern && s.items == head.items && s.layers == head.layers;
            let cells: Vec<BenchSpec> = all[i..].iter().take_while(|s| same(s)).copied().collect();
            i += cells.len();
            let mut group = c.benchmark_group(group_name(&dev, &head));
            group.sample_size(10).warm_up_time(Duration::from_millis(200)).measurement_time(Duration::from_secs(1));
            let mut ceiling_bytes = Vec::new();
            for spec in &cells {
                let mut fx = match Fixture::new(&dev, spec, 7) {
                    Ok(f) => f,
                    Err(e) => {
                        eprintln!("{} {spec}: {e}", dev.name());
                        continue;
                    }
                };
                let plan = fx.plan(spec.io).expect("supported path");
                group.throughput(Throughput::Bytes(plan.bytes()));
                ceiling_bytes.push(plan.bytes());
                let id = format!("{:?}/{}/{}", spec.op, spec.layout, spec.io).to_lowercase();
                group.bench_function(BenchmarkId::from_parameter(id), |b| b.iter(|| fx.run(&plan).expect("transfer")));
                group.bench_function(BenchmarkId::new("plan", format!("{:?}/{}/{}", spec.op, spec.layout, spec.io).to_lowercase()), |b| {
                    b.iter(|| fx.plan(spec.io).expect("plan"))
                });
            }
            ceiling_bytes.sort_unstable();
            ceiling_bytes.dedup();
            for bytes in ceiling_bytes {
                group.throughput(Throughput::Bytes(bytes));
                group.bench_function(BenchmarkId::new("ceiling", bytes), |b| {
                    b.iter_custom(|iters| {
                        let per = dev.time_one_copy(bytes, Duration::from_millis(50)).expect("ceiling");
                        Duration::from_secs_f64(per * iters as f64)
                    })
                });
            }
            group.finish();
        }
    }
}

/// One `l3/` case: a pool of `pages` pages whose objects a store moves `batch` pages at a time.
struct L3Case {
    name: &'static str,
    kind: PoolKind,
    bytes_per_token: u64,
    page: u64,
    layers: usize,
    layout: Layout,
    head_num: u64,
    /// The unified key scheme's objects (`None`: one object a component).
    shares: Option<Vec<PageShare>>,
    pages: u64,
    batch: u64,
}

fn l3_passes(c: &mut Criterion) {
    // Head-group objects as scripts/bench-l3.py's: a TP=2 rank of 8 kv heads of 256 B, 8 layers,
    // 16-token pages; one object a (kv head, component), 32 KiB, 15 pages a batch (the 4 MiB
    // staging bound); DSA indexer pages of 8448 B, 128 a batch.
    let head_groups = (0..4u64).flat_map(|g| (0..2u8).map(move |comp| PageShare { comp, layers: (0, 8), bytes: (g * 256, (g + 1) * 256) }));
    let cases = [
        L3Case {
            name: "dsa-8448B",
            kind: PoolKind::DsaIndexer,
            bytes_per_token: 132,
            page: 64,
            layers: 1,
            layout: Layout::PageFirst,
            head_num: 1,
            shares: None,
            pages: 2048,
            batch: 128,
        },
        L3Case {
            name: "head-group-32KiB",
            kind: PoolKind::Mha,
            bytes_per_token: 1024,
            page: 16,
            layers: 8,
            layout: Layout::PageFirstDirectHeadGroups,
            head_num: 4,
            shares: Some(head_groups.collect()),
            pages: 256,
            batch: 15,
        },
    ];
    let device = Device::cpu();
    for case in &cases {
        let dsa = case.kind == PoolKind::DsaIndexer;
        let slots = if dsa { case.pages } else { case.pages * case.page };
        let config = DevicePoolConfig {
            kind: case.kind,
            bytes_per_token: case.bytes_per_token,
            slots,
            page_size: case.page,
            layers: LayerMap::new(case.layers),
        };
        let dev = DevicePool::new(&device, &config).expect("device pool");
        let host_config = HostPoolConfig {
            layout: case.layout,
            size: case.pages * case.page,
            head_num: case.head_num,
            profile: Profile::Extended,
            integrity: None,
        };
        let mut host = HostPool::new(&dev, &host_config).expect("host pool");
        // Every page backed up once, so the pool holds the item checksums a store checks.
        let all: Vec<i64> = (0..(case.pages * case.page) as i64).collect();
        host.backup_from_device_all_layer(&dev, &all, &all, IoBackend::Kernel).expect("backup");
        let objects = match &case.shares {
            Some(s) => PageObjects::Shares(s),
            None => PageObjects::Components,
        };
        let batches: Vec<Vec<i64>> = all
            .chunks((case.batch * case.page) as usize)
            .filter(|b| b.len() == (case.batch * case.page) as usize)
            .map(<[i64]>::to_vec)
            .collect();
        let meta = host.get_page_buffer_meta(&batches[0]).expect("pages");
        let (per_batch, longest) = (meta.len(), meta.iter().map(|m| m.2).max().unwrap_or(0));
        let object = match &case.shares {
            Some(s) => s.iter().map(|s| (s.layers.1 - s.layers.0) * case.page * (s.bytes.1 - s.bytes.0)).max().unwrap_or(0),
            None => longest,
        };
        let objects_per_batch = match &case.shares {
            Some(s) => s.len() * case.batch as usize,
            None => per_batch,
        };
        // As the store lays sealed objects out (hicache_io.l3.placements.sealing).
        let stride = (object + 16).div_ceil(64) as usize * 64;
        let mut staging = vec![0u8; objects_per_batch * stride];
        let bytes = object * objects_per_batch as u64;
        let mut group = c.benchmark_group(format!("l3/{}/{}pages", case.name, case.batch));
        group.sample_size(10).warm_up_time(Duration::from_millis(200)).measurement_time(Duration::from_secs(1));
        group.throughput(Throughput::Bytes(bytes));
        let mut k = 0usize;
        group.bench_function("stage_put", |b| {
            b.iter(|| {
                k = (k + 1) % batches.len();
                host.stage_put(&batches[k], objects, STORAGE_SEED, &mut staging, stride).expect("stage_put")
            })
        });
        group.bench_function("pages_intact", |b| {
            b.iter(|| {
                k = (k + 1) % batches.len();
                host.pages_intact(&batches[k]).expect("pages_intact")
            })
        });
        let (sums, _) = host.stage_put(&batches[0], objects, STORAGE_SEED, &mut staging, stride).expect("stage_put");
        let (eligible, write) = (vec![true; sums.len()], vec![true; sums.len()]);
        group.bench_function("land_staged", |b| {
            // The staged objects of batch 0 landed on every batch in turn: they match the sums
            // given, so each batch's pages are trusted and their item checksums recorded.
            b.iter(|| {
                k = (k + 1) % batches.len();
                host.land_staged(&batches[k], objects, STORAGE_SEED, &staging, stride, &sums, &eligible, &write).expect("land_staged")
            })
        });
        let source = vec![1u8; (bytes as usize) * batches.len()];
        let mut target = vec![0u8; bytes as usize];
        group.bench_function("ceiling", |b| {
            b.iter(|| {
                k = (k + 1) % batches.len();
                target.copy_from_slice(&source[k * bytes as usize..(k + 1) * bytes as usize]);
            })
        });
        group.finish();
    }
}

criterion_group!(benches, transfers, l3_passes);
criterion_main!(benches);
