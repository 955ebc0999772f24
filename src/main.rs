//! `hicache-io`: info | matrix | check (the main job, also with no arguments) | bench.
//!
//! Machine-readable output (`--json`) is pure JSON on stdout; progress and human lines go to
//! stderr.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use hicache_io::check::Tally;
use hicache_io::exec::{probe_all, Device, ExecutorKind};
use hicache_io::geometry::{PoolKind, Profile};
use hicache_io::matrix::{matrix, render_markdown};

#[derive(Parser)]
#[command(name = "hicache-io", version, about = "sglang HiCache KV transfers on cpu, wgpu and cuda, with one validation table")]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Executors and devices present here.
    Info,
    /// Every cell of pool × operation × layout × io backend: the op it runs or the exact error.
    Matrix {
        #[arg(long, default_value = "extended")]
        profile: Profile,
        /// Pools to show (mha, mla, dsa); all by default.
        #[arg(long, value_delimiter = ',')]
        pool: Vec<PoolKind>,
        /// Page size the DSA indexer item assumes (132 B/token × this; 1 to 2^32).
        #[arg(long, default_value_t = 64)]
        dsa_page_size: u64,
        #[arg(long)]
        json: bool,
    },
    /// Randomized transfers over every supported cell on each executor, compared byte for byte
    /// with the oracle. Exit status 1 on any mismatch.
    Check(CheckArgs),
    /// Hostile input through the public API (malformed sizes, layers, indices, foreign plans):
    /// every call must match the oracle or be refused with every byte unchanged, and nothing may
    /// panic. Exit status 1 otherwise.
    Fuzz(FuzzArgs),
    /// Throughput per executor, path and item size, with the ratio to the executor's own
    /// one-copy ceiling measured in the same run and the planning share.
    Bench(BenchArgs),
}

#[derive(clap::Args)]
struct BenchArgs {
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

#[derive(clap::Args)]
struct FuzzArgs {
    /// Executors to fuzz; every available one by default.
    #[arg(long = "executor", alias = "backend", value_delimiter = ',')]
    executor: Vec<ExecutorKind>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Cases per executor (at least 1).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
    cases: u64,
    /// Corruption injections per executor that keeps item checksums (host bits, table entries,
    /// swapped and replayed items, damaged storage pages); default: as many as `--cases`.
    #[arg(long)]
    inject: Option<u64>,
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Default)]
struct CheckArgs {
    /// Executors to check (cpu, wgpu, cuda); every available one by default.
    #[arg(long = "executor", alias = "backend", value_delimiter = ',')]
    executor: Vec<ExecutorKind>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Random cases per cell and executor (at least 1).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    rounds: u64,
    #[arg(long, default_value = "extended")]
    profile: Profile,
    /// Make every call with this io backend (e.g. `auto`) instead of each cell's own.
    #[arg(long)]
    io: Option<hicache_io::IoBackend>,
    #[arg(long)]
    json: bool,
}

/// Mesa's Vulkan device-select layer prints "XDG_RUNTIME_DIR is invalid or not set" on machines
/// without a runtime dir (containers, CI), which reads like an error. Give this process a private
/// one when it has none; real driver errors still print.
fn ensure_runtime_dir() {
    let valid = std::env::var_os("XDG_RUNTIME_DIR").is_some_and(|d| std::path::Path::new(&d).is_dir());
    if valid {
        return;
    }
    let user = std::env::var("USER").unwrap_or_else(|_| "user".into());
    let dir = std::env::temp_dir().join(format!("hicache-io-runtime-{user}"));
    let made = std::fs::create_dir_all(&dir).is_ok();
    #[cfg(unix)]
    if made {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
    }
    if made {
        // Single-threaded here: nothing else reads the environment yet.
        std::env::set_var("XDG_RUNTIME_DIR", &dir);
    }
}

fn main() -> ExitCode {
    // A reader that stops early (`hicache-io matrix | head -1`) ends the process quietly, as it
    // does other command-line tools, instead of a panic in `println!` (Rust ignores SIGPIPE).
    #[cfg(target_os = "linux")]
    // SAFETY: restores the default disposition of one signal, before any other thread runs.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    ensure_runtime_dir();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    match cli.cmd.unwrap_or(Cmd::Check(CheckArgs { seed: 1, rounds: 8, profile: Profile::Extended, ..Default::default() })) {
        Cmd::Info => info(),
        Cmd::Matrix { profile, pool, dsa_page_size, json } => {
            if let Err(e) = hicache_io::matrix::check_dsa_page_size(dsa_page_size) {
                eprintln!("--dsa-page-size {dsa_page_size}: {e}");
                return ExitCode::from(2);
            }
            let pools = if pool.is_empty() { PoolKind::ALL.to_vec() } else { pool };
            if json {
                println!("{}", serde_json::to_string_pretty(&matrix(profile, &pools, dsa_page_size)).expect("json"));
            } else {
                print!("{}", render_markdown(profile, &pools, dsa_page_size));
            }
            ExitCode::SUCCESS
        }
        Cmd::Check(args) => check(args),
        Cmd::Bench(args) => bench(args),
        Cmd::Fuzz(args) => fuzz(args),
    }
}

/// The executors to run on: `--executor` if given, else `HICACHE_IO_EXECUTOR` (or its older name
/// `HICACHE_IO_BACKEND`) if set (an unknown name is an error; `auto` means every executor
/// present), else every executor present.
fn open_devices(requested: &[ExecutorKind]) -> Option<Vec<Device>> {
    let mut requested = requested.to_vec();
    if requested.is_empty() {
        match hicache_io::exec::executor_from_env() {
            Ok(Some(k)) => requested.push(k),
            Ok(None) => {}
            Err(e) => {
                eprintln!("{e}");
                return None;
            }
        }
    }
    let kinds = if requested.is_empty() { ExecutorKind::ALL.to_vec() } else { requested.clone() };
    let mut devices = Vec::new();
    for k in kinds {
        match Device::open(k) {
            Ok(d) => {
                eprintln!("{}: {}", k.name(), d.describe());
                devices.push(d);
            }
            Err(e) if requested.is_empty() => eprintln!("{e} — skipped"),
            Err(e) => {
                eprintln!("{e}");
                return None;
            }
        }
    }
    Some(devices)
}

fn bench(args: BenchArgs) -> ExitCode {
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
    let mut specs = hicache_io::bench::specs(!args.full);
    if !args.items.is_empty() {
        let base = hicache_io::bench::specs(!args.full);
        let template: Vec<_> = base.iter().filter(|s| s.item == base[0].item).copied().collect();
        specs = args.items.iter().flat_map(|&item| template.iter().map(move |s| hicache_io::bench::BenchSpec { item, ..*s })).collect();
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
            match hicache_io::bench::run_spec(dev, spec, budget) {
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
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn bench_auto(devices: &[Device], args: &BenchArgs) -> ExitCode {
    use hicache_io::bench::{run_spec, specs, BenchSpec};
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
    use hicache_io::bench::{checksum_pair, specs};
    let items: Vec<u64> = if args.items.is_empty() { vec![8448, 1152] } else { args.items.clone() };
    let cells: Vec<_> = items
        .iter()
        .flat_map(|&item| specs(true).into_iter().filter(|s| s.item == 8448).map(move |s| hicache_io::bench::BenchSpec { item, ..s }))
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
        match hicache_io::bench::pipeline(dev, 8, 1024, compute) {
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

fn info() -> ExitCode {
    // The library's `Device::from_env` refuses an unknown name; so does every command here.
    if let Err(e) = hicache_io::exec::executor_from_env() {
        eprintln!("{e}");
        return ExitCode::FAILURE;
    }
    println!("hicache-io {}", env!("CARGO_PKG_VERSION"));
    for (kind, dev) in probe_all() {
        match dev {
            Ok(d) => {
                let c = d.capabilities();
                println!(
                    "{}: available — {} (kernel word {} B, direct alignment {} B; item checksums: {})",
                    kind.name(),
                    d.describe(),
                    c.kernel_word,
                    c.direct_align,
                    match (c.checksums, c.direct_checksums) {
                        (true, true) => "recorded and verified inside kernel and direct copies",
                        (true, false) => "recorded and verified inside kernel copies (direct ones leave them unknown)",
                        _ => "not computed (host pools keep none)",
                    }
                );
            }
            Err(e) => println!("{e}"),
        }
    }
    ExitCode::SUCCESS
}

fn check(args: CheckArgs) -> ExitCode {
    if args.io == Some(hicache_io::IoBackend::Auto) && args.profile == Profile::Sglang {
        eprintln!("--io auto: the auto io backend exists only in profile extended (sglang answers \"Unsupported IO backend: auto\")");
        return ExitCode::from(2);
    }
    let Some(devices) = open_devices(&args.executor) else { return ExitCode::FAILURE };
    let mut failed = false;
    let mut report = Vec::new();
    let mut ops_report = Vec::new();
    for dev in &devices {
        let cells = hicache_io::check::supported_cells(args.profile).len() as u64;
        let bar = indicatif::ProgressBar::new(cells * args.rounds);
        bar.set_style(indicatif::ProgressStyle::with_template("{prefix:>5} [{bar:40}] {pos}/{len} {msg}").unwrap().progress_chars("=> "));
        bar.set_prefix(dev.name());
        let res = hicache_io::check::check_device_io(dev, args.profile, args.seed, args.rounds, args.io, |cell, _| {
            bar.inc(1);
            bar.set_message(cell.to_string());
        });
        bar.finish_and_clear();
        match res {
            Ok(rows) => report.push((dev.name(), rows)),
            Err(e) => {
                eprintln!("{}: {e}", dev.name());
                failed = true;
            }
        }
        match hicache_io::check_ops::check_ops(dev, args.seed, args.rounds, |_, _| {}) {
            Ok(rows) => ops_report.push((dev.name(), rows)),
            Err(e) => {
                eprintln!("{}: {e}", dev.name());
                failed = true;
            }
        }
    }
    if args.json {
        let v: Vec<_> = report
            .iter()
            .zip(&ops_report)
            .map(|((n, rows), (_, ops))| {
                serde_json::json!({
                    "backend": n,
                    "cells": rows.iter().map(|(c, t)| serde_json::json!({"cell": c, "tally": t})).collect::<Vec<_>>(),
                    "ops": ops.iter().map(|(op, t)| serde_json::json!({"op": op, "tally": t})).collect::<Vec<_>>(),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
    } else {
        println!(
            "\n{:<48} {:>6} {:>9} {:>8} {:>10} {:>7}  result",
            "cell (profile ".to_string() + args.profile.name() + ")",
            "exec",
            "cases",
            "matched",
            "bytes",
            "sums"
        );
        for (name, rows) in &report {
            for (cell, t) in rows {
                println!(
                    "{:<48} {:>6} {:>9} {:>8} {:>10} {:>7}  {}",
                    cell.to_string(),
                    name,
                    t.cases,
                    t.matched,
                    t.bytes,
                    t.checksums,
                    verdict(t)
                );
            }
        }
    }
    if !args.json {
        println!("\n{:<48} {:>6} {:>9} {:>8} {:>10}  result", "op (drawn and hostile calls)", "exec", "cases", "matched", "bytes");
        for (name, rows) in &ops_report {
            for (op, t) in rows {
                match t {
                    Some(t) => println!("{:<48} {:>6} {:>9} {:>8} {:>10}  {}", op, name, t.cases, t.matched, t.bytes, verdict(t)),
                    None => println!("{:<48} {:>6} {:>9} {:>8} {:>10}  not on caller memory here", op, name, "-", "-", "-"),
                }
            }
        }
    }
    for (name, rows) in &ops_report {
        let bad = rows.iter().filter(|(_, t)| t.as_ref().is_some_and(|t| t.matched != t.cases)).count();
        failed |= bad > 0;
        if bad > 0 {
            print_summary(args.json, &format!("{name}: {bad} of the newer ops differ from their definitions"), &[]);
        }
    }
    for (name, rows) in &report {
        let bad: Vec<&Tally> = rows.iter().map(|(_, t)| t).filter(|t| t.matched != t.cases).collect();
        let cases: u64 = rows.iter().map(|(_, t)| t.cases).sum();
        let sums: u64 = rows.iter().map(|(_, t)| t.checksums).sum();
        let keeps = devices.iter().find(|d| d.name() == *name).is_some_and(|d| d.capabilities().checksums);
        let line = format!(
            "{name}: {} of {} cells, {cases} cases, {}; item checksums: {}",
            rows.len() - bad.len(),
            rows.len(),
            if bad.is_empty() { "all match the oracle" } else { "MISMATCHES" },
            if keeps { format!("{sums} recorded by backups, each equal to the oracle's") } else { "not kept on this executor".into() }
        );
        print_summary(args.json, &line, &[]);
        failed |= !bad.is_empty();
    }
    if devices.is_empty() {
        eprintln!("no executor available");
        failed = true;
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn fuzz(args: FuzzArgs) -> ExitCode {
    let Some(devices) = open_devices(&args.executor) else { return ExitCode::FAILURE };
    if devices.is_empty() {
        eprintln!("no executor available");
        return ExitCode::FAILURE;
    }
    let mut report = Vec::new();
    for dev in &devices {
        let bar = indicatif::ProgressBar::new(args.cases);
        bar.set_style(indicatif::ProgressStyle::with_template("{prefix:>5} [{bar:40}] {pos}/{len} {msg}").unwrap().progress_chars("=> "));
        bar.set_prefix(dev.name());
        let t = hicache_io::fuzz::fuzz_device(dev, args.seed, args.cases, |t| {
            bar.inc(1);
            bar.set_message(format!("panics {} corrupted {}", t.panics, t.corrupted));
        });
        bar.finish_and_clear();
        let injections = args.inject.unwrap_or(args.cases);
        let bar = indicatif::ProgressBar::new(injections);
        bar.set_style(indicatif::ProgressStyle::with_template("{prefix:>5} [{bar:40}] {pos}/{len} {msg}").unwrap().progress_chars("=> "));
        bar.set_prefix(format!("{} inject", dev.name()));
        let i = hicache_io::inject::inject_device(dev, args.seed, injections, |i| {
            bar.set_position(i.total());
            bar.set_message(format!("missed {} false alarms {}", i.missed, i.false_alarms));
        });
        bar.finish_and_clear();
        let ops = hicache_io::check_ops::check_ops(dev, args.seed, (args.cases / 100).max(1), |_, _| {});
        report.push((dev.name(), t, i, ops));
    }
    let mut clean = true;
    if args.json {
        let v: Vec<_> = report
            .iter()
            .map(|(n, t, i, ops)| {
                let ops = ops.as_ref().map(|o| o.iter().map(|(op, t)| serde_json::json!({"op": op, "tally": t})).collect::<Vec<_>>()).ok();
                serde_json::json!({"backend": n, "tally": t, "injection": i, "ops": ops})
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
    }
    for (name, t, i, ops) in &report {
        match ops {
            Ok(rows) if rows.iter().any(|(_, t)| t.is_some()) => {
                let (cases, matched) = rows.iter().flat_map(|(_, t)| t).fold((0, 0), |(c, m), t| (c + t.cases, m + t.matched));
                let failures: Vec<String> = rows.iter().flat_map(|(_, t)| t).filter_map(|t| t.first_failure.clone()).collect();
                print_summary(args.json, &format!("{name}: newer ops (DeepSeek-V4 tokens, Mamba states, NVFP4 page rows): {cases} calls, half of them hostile, {matched} as defined"), &failures);
                clean &= cases == matched;
            }
            Ok(_) => print_summary(args.json, &format!("{name}: newer ops: not on caller memory here"), &[]),
            Err(e) => {
                print_summary(args.json, &format!("{name}: newer ops: {e}"), &[]);
                clean = false;
            }
        }
        let line = format!(
            "{name}: tried {}, rejected {} ({} configurations, {} calls), matched the oracle {}, large pools checked {}, padded pages {}, panics {}, corrupted {}, well-formed refused {}",
            t.tried,
            t.rejected_config + t.rejected_call,
            t.rejected_config,
            t.rejected_call,
            t.matched,
            t.large,
            t.padded,
            t.panics,
            t.corrupted,
            t.refused_well_formed
        );
        print_summary(args.json, &line, &t.failures);
        clean &= t.clean();
        let line = if i.verified {
            let kinds: Vec<String> = hicache_io::inject::FAULTS.iter().zip(i.injected).map(|(k, n)| format!("{k} {n}")).collect();
            format!(
                "{name}: integrity: injected {} ({}), detected {}, harmless {} (identical bytes swapped), missed {}, false alarms {} (and {} in {} verified loads of the cases above)",
                i.total(),
                kinds.join(", "),
                i.detected,
                i.harmless,
                i.missed,
                i.false_alarms,
                t.false_alarms,
                t.verified_loads
            )
        } else {
            format!("{name}: integrity: not verified on this executor (its copies keep no checksums): nothing injected")
        };
        print_summary(args.json, &line, &i.failures);
        clean &= i.clean();
    }
    if clean {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// A summary line (stderr under `--json`, which keeps stdout for the JSON) and its failures.
fn print_summary(json: bool, line: &str, failures: &[String]) {
    if json {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
    for f in failures {
        eprintln!("  {f}");
    }
}

fn verdict(t: &Tally) -> String {
    if t.matched == t.cases {
        "ok".into()
    } else {
        format!("FAIL ({})", t.first_failure.as_deref().unwrap_or("?"))
    }
}
