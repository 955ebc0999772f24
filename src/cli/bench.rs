//! `hicache-io bench`: throughput per executor, path and item size against the executor's own
//! one-copy ceiling; `--io auto`, `--checksums` and `--pipeline` compare variants in one run.

use std::process::ExitCode;

use hicache_io::exec::{Device, ExecutorKind};

use crate::{open_devices, status};

#[derive(clap::Args)]
pub(crate) struct BenchArgs {
    /// Executors to measure; every available one by default.
    #[arg(long = "executor", alias = "backend", value_delimiter = ',')]
    executor: Vec<ExecutorKind>,
    /// The whole matrix (the default is the quick subset: random pages, N = 4096, L = 8,
    /// 8448/1152/128 B items): 4 item sizes × 3 patterns × N 256/4096 × L 8/61.
    #[arg(long)]
    full: bool,
    /// Item sizes to measure (default: the subset's); e.g. `--items 8448,1152,656`.
    #[arg(long, value_delimiter = ',')]
    items: Vec<u64>,
    /// Time budget per measurement, in milliseconds.
    #[arg(long, default_value_t = 300)]
    budget_ms: u64,
    /// `auto`: the cells where both io backends are supported (layer_first), each with kernel,
    /// direct and auto, auto's choice, and auto's throughput over the better fixed path.
    #[arg(long)]
    io: Option<hicache_io::IoBackend>,
    /// Layer-wise loading against load-then-compute instead: 8 layers of 1024 random DSA pages,
    /// a busy-loop stand-in compute per layer on the calling thread.
    #[arg(long)]
    pipeline: bool,
    /// Stand-in compute per layer for `--pipeline`, in microseconds (default: one layer's load
    /// time).
    #[arg(long)]
    compute_us: Option<u64>,
    /// Item checksums on against off instead: the quick cells (kernel and direct, load and
    /// backup) of 8448 and 1152 B items (or `--items`), each measured both ways in one run, and
    /// the ratio.
    #[arg(long)]
    checksums: bool,
    #[arg(long)]
    json: bool,
}

pub(crate) fn bench(args: BenchArgs) -> ExitCode {
    let Some(devices) = open_devices(&args.executor) else { return ExitCode::FAILURE };
    if args.pipeline {
        return bench_pipeline(&devices, &args);
    }
    if args.io == Some(hicache_io::IoBackend::Auto) {
        return bench_auto(&devices, &args);
    }
    if args.checksums {
        return bench_checksums(&devices, &args);
    }
    let mut specs = hicache_io::tools::bench::specs(!args.full);
    if !args.items.is_empty() {
        let base = hicache_io::tools::bench::specs(!args.full);
        let template: Vec<_> = base.iter().filter(|s| s.item == base[0].item).copied().collect();
        specs =
            args.items.iter().flat_map(|&item| template.iter().map(move |s| hicache_io::tools::bench::BenchSpec { item, ..*s })).collect();
    }
    let budget = std::time::Duration::from_millis(args.budget_ms);
    if devices.is_empty() {
        eprintln!("no executor available");
        return ExitCode::FAILURE;
    }
    let bar = indicatif::ProgressBar::new((specs.len() * devices.len()) as u64);
    bar.set_style(indicatif::ProgressStyle::with_template("[{bar:40}] {pos}/{len} {msg}").unwrap().progress_chars("=> "));
    let mut results = Vec::new();
    let mut failed = false;
    for dev in &devices {
        for spec in &specs {
            bar.set_message(format!("{} {spec}", dev.name()));
            match hicache_io::tools::bench::run_spec(dev, spec, budget) {
                Ok(r) => results.push(r),
                Err(e) => {
                    bar.println(format!("{} {spec}: {e}", dev.name()));
                    failed |= !matches!(e, hicache_io::TransferError::BufferSize { .. });
                }
            }
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results).expect("json"));
    } else {
        println!("\n{:<5} {:<52} {:>9} {:>9} {:>10} {:>6} {:>7}", "exec", "cell", "MiB", "GB/s", "ceil GB/s", "ratio", "plan %");
        for r in &results {
            println!(
                "{:<5} {:<52} {:>9.1} {:>9.2} {:>10.2} {:>6.2} {:>7.2}",
                r.backend,
                r.spec.to_string(),
                r.bytes as f64 / (1 << 20) as f64,
                r.gbps,
                r.ceiling_gbps,
                r.ratio,
                100.0 * r.plan_share
            );
        }
    }
    status(failed)
}

fn bench_auto(devices: &[Device], args: &BenchArgs) -> ExitCode {
    use hicache_io::tools::bench::{run_spec, specs, BenchSpec};
    use hicache_io::{IoBackend, Layout};
    let items: Vec<u64> = if args.items.is_empty() { vec![8448, 1152, 128] } else { args.items.clone() };
    let base: Vec<BenchSpec> =
        specs(true).into_iter().filter(|s| s.layout == Layout::LayerFirst && s.io == IoBackend::Kernel && s.item == 8448).collect();
    let budget = std::time::Duration::from_millis(args.budget_ms);
    let mut rows = Vec::new();
    for dev in devices {
        // Calibrate before timing, so the first auto cell does not pay for it.
        let _ = dev.calibrated_capabilities();
        for &item in &items {
            for b in &base {
                let mut r = Vec::new();
                for io in [IoBackend::Kernel, IoBackend::Direct, IoBackend::Auto] {
                    match run_spec(dev, &BenchSpec { item, io, ..*b }, budget) {
                        Ok(x) => r.push(x),
                        Err(e) => {
                            eprintln!("{} {item} {io}: {e}", dev.name());
                            return ExitCode::FAILURE;
                        }
                    }
                }
                rows.push(r);
            }
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows).expect("json"));
        return ExitCode::SUCCESS;
    }
    println!(
        "{:<5} {:<44} {:>11} {:>11} {:>9} {:>7} {:>12} {:>13}",
        "exec", "cell", "kernel GB/s", "direct GB/s", "auto GB/s", "chose", "auto / best", "choice / best"
    );
    for r in &rows {
        let (k, d, a) = (&r[0], &r[1], &r[2]);
        let spec = BenchSpec { io: IoBackend::Auto, ..a.spec };
        let best = k.gbps.max(d.gbps);
        // The chosen path's own measurement over the better one: the quality of the choice,
        // free of the run-to-run noise between two timings of the same path.
        let chosen = if a.io_used == IoBackend::Kernel { k.gbps } else { d.gbps };
        println!(
            "{:<5} {:<44} {:>11.2} {:>11.2} {:>9.2} {:>7} {:>12.2} {:>13.2}",
            a.backend,
            spec.to_string(),
            k.gbps,
            d.gbps,
            a.gbps,
            a.io_used.name(),
            a.gbps / best,
            chosen / best
        );
    }
    ExitCode::SUCCESS
}

fn bench_checksums(devices: &[Device], args: &BenchArgs) -> ExitCode {
    use hicache_io::tools::bench::{checksum_pair, specs};
    let items: Vec<u64> = if args.items.is_empty() { vec![8448, 1152] } else { args.items.clone() };
    let cells: Vec<_> = items
        .iter()
        .flat_map(|&item| {
            specs(true).into_iter().filter(|s| s.item == 8448).map(move |s| hicache_io::tools::bench::BenchSpec { item, ..s })
        })
        .collect();
    let budget = std::time::Duration::from_millis(args.budget_ms);
    let bar = indicatif::ProgressBar::new((cells.len() * devices.len()) as u64);
    let mut rows = Vec::new();
    for dev in devices {
        if !dev.capabilities().checksums {
            bar.println(format!("{}: its copies do not compute checksums (its pools keep none)", dev.name()));
            bar.inc(cells.len() as u64);
            continue;
        }
        let direct = dev.capabilities().direct_checksums;
        if !direct {
            bar.println(format!("{}: its direct copies do not compute checksums: kernel cells only", dev.name()));
        }
        for spec in &cells {
            if !direct && spec.io == hicache_io::IoBackend::Direct {
                bar.inc(1);
                continue;
            }
            bar.set_message(format!("{} {spec}", dev.name()));
            match checksum_pair(dev, spec, budget, 5) {
                Ok(pair) => rows.push(pair),
                Err(e) => {
                    bar.finish_and_clear();
                    eprintln!("{} {spec}: {e}", dev.name());
                    return ExitCode::FAILURE;
                }
            }
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    if args.json {
        let v: Vec<_> = rows.iter().map(|(w, p)| serde_json::json!({"with": w, "without": p, "ratio": w.gbps / p.gbps})).collect();
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
        return ExitCode::SUCCESS;
    }
    println!("{:<5} {:<46} {:>12} {:>12} {:>16}", "exec", "cell", "plain GB/s", "summed GB/s", "summed / plain");
    for (w, p) in &rows {
        println!("{:<5} {:<46} {:>12.2} {:>12.2} {:>16.2}", w.backend, w.spec.to_string(), p.gbps, w.gbps, w.gbps / p.gbps);
    }
    ExitCode::SUCCESS
}

fn bench_pipeline(devices: &[Device], args: &BenchArgs) -> ExitCode {
    let compute = args.compute_us.map(std::time::Duration::from_micros);
    let mut results = Vec::new();
    for dev in devices {
        match hicache_io::tools::bench::pipeline(dev, 8, 1024, compute) {
            Ok(r) => results.push(r),
            Err(e) => {
                eprintln!("{}: {e}", dev.name());
                return ExitCode::FAILURE;
            }
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results).expect("json"));
        return ExitCode::SUCCESS;
    }
    println!(
        "{:<5} {:>6} {:>9} {:>11} {:>10} {:>10} {:>10} {:>11} {:>8} {:>12} {:>12}",
        "exec", "layers", "MiB/layer", "compute ms", "load ms", "seq ms", "pipe ms", "first ms", "overlap", "bk 1 str ms", "bk side ms"
    );
    for r in &results {
        println!(
            "{:<5} {:>6} {:>9.1} {:>11.2} {:>10.2} {:>10.2} {:>10.2} {:>11.2} {:>8.2} {:>12.2} {:>12.2}",
            r.backend,
            r.layers,
            r.layer_bytes as f64 / (1 << 20) as f64,
            r.compute_s * 1e3 * r.layers as f64,
            r.load_s * 1e3,
            r.sequential_s * 1e3,
            r.pipelined_s * 1e3,
            r.first_layer_s * 1e3,
            r.overlap,
            r.backup_one_stream_s * 1e3,
            r.backup_stream_s * 1e3
        );
    }
    ExitCode::SUCCESS
}
