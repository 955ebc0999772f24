//! Criterion benchmarks: every executor present × path × item size × pattern × N × L, loads of
//! one layer and backups of all layers, with throughput in bytes moved. Each group also times
//! the executor's own one-copy ceiling of the same bytes, so ratios come from one run.
//!
//! `cargo bench` runs the quick subset of `hicache-io bench` (random items, N = 4096, L = 8;
//! 8448, 1152 and 128 B); `HICACHE_BENCH_FULL=1 cargo bench` the whole matrix (long: the L = 61
//! cells need several GiB of memory, more than a small machine has, and wgpu skips pools above its
//! buffer limit). Filter with e.g. `cargo bench -- 'cpu/128B'`.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use hicache_io::exec::{probe_all, Device};
use hicache_io::tools::bench::{specs, BenchSpec, Fixture};

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

criterion_group!(benches, transfers);
criterion_main!(benches);
