//! `hicache-io check`: every supported cell and the newer op families on each executor, compared
//! byte for byte with the oracle and the ops' definitions.

use std::process::ExitCode;

use hicache_io::exec::{Device, ExecutorKind};
use hicache_io::geometry::Profile;
use hicache_io::tools::check::{Cell, Tally};

use crate::{open_devices, print_summary, progress, status, verdict};

#[derive(clap::Args, Default)]
pub(crate) struct CheckArgs {
    /// Executors to check (cpu, wgpu, cuda); every available one by default.
    #[arg(long = "executor", alias = "backend", value_delimiter = ',')]
    pub(crate) executor: Vec<ExecutorKind>,
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Random cases per cell and executor (at least 1).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) rounds: u64,
    #[arg(long, default_value = "extended")]
    pub(crate) profile: Profile,
    /// Make every call with this io backend (e.g. `auto`) instead of each cell's own.
    #[arg(long)]
    pub(crate) io: Option<hicache_io::IoBackend>,
    #[arg(long)]
    pub(crate) json: bool,
}

/// One executor's rows: each cell's tally, and each newer op's (`None`: not on caller memory).
type CellRows = Vec<(Cell, Tally)>;
type OpRows = Vec<(&'static str, Option<Tally>)>;
/// Every executor's rows, by name.
type Report<R> = Vec<(&'static str, R)>;

pub(crate) fn check(args: CheckArgs) -> ExitCode {
    if args.io == Some(hicache_io::IoBackend::Auto) && args.profile == Profile::Sglang {
        eprintln!("--io auto: the auto io backend exists only in profile extended (sglang answers \"Unsupported IO backend: auto\")");
        return ExitCode::from(2);
    }
    let Some(devices) = open_devices(&args.executor) else { return ExitCode::FAILURE };
    let (report, ops_report, mut failed) = run(&devices, &args);
    if args.json {
        print_json(&report, &ops_report);
    } else {
        print_tables(&report, &ops_report, args.profile);
    }
    failed |= summarize(&devices, &report, &ops_report, args.json);
    if devices.is_empty() {
        eprintln!("no executor available");
        failed = true;
    }
    status(failed)
}

/// Every cell and op on every device, with a progress bar per device; whether a device failed
/// to run them.
fn run(devices: &[Device], args: &CheckArgs) -> (Report<CellRows>, Report<OpRows>, bool) {
    let mut failed = false;
    let mut report = Vec::new();
    let mut ops_report = Vec::new();
    for dev in devices {
        let cells = hicache_io::tools::check::supported_cells(args.profile).len() as u64;
        let bar = progress(cells * args.rounds, dev.name().to_string());
        let res = hicache_io::tools::check::check_device_io(dev, args.profile, args.seed, args.rounds, args.io, |cell, _| {
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
        match hicache_io::tools::check_ops::check_ops(dev, args.seed, args.rounds, |_, _| {}) {
            Ok(rows) => ops_report.push((dev.name(), rows)),
            Err(e) => {
                eprintln!("{}: {e}", dev.name());
                failed = true;
            }
        }
    }
    (report, ops_report, failed)
}

fn print_json(report: &[(&str, CellRows)], ops_report: &[(&str, OpRows)]) {
    let v: Vec<_> = report
        .iter()
        .zip(ops_report)
        .map(|((n, rows), (_, ops))| {
            serde_json::json!({
                "backend": n,
                "cells": rows.iter().map(|(c, t)| serde_json::json!({"cell": c, "tally": t})).collect::<Vec<_>>(),
                "ops": ops.iter().map(|(op, t)| serde_json::json!({"op": op, "tally": t})).collect::<Vec<_>>(),
            })
        })
        .collect();
    println!("{}", serde_json::to_string_pretty(&v).expect("json"));
}

fn print_tables(report: &[(&str, CellRows)], ops_report: &[(&str, OpRows)], profile: Profile) {
    let head = "cell (profile ".to_string() + profile.name() + ")";
    println!("\n{:<48} {:>6} {:>9} {:>8} {:>10} {:>7}  result", head, "exec", "cases", "matched", "bytes", "sums");
    for (name, rows) in report {
        for (cell, t) in rows {
            let cell = cell.to_string();
            println!("{:<48} {:>6} {:>9} {:>8} {:>10} {:>7}  {}", cell, name, t.cases, t.matched, t.bytes, t.checksums, verdict(t));
        }
    }
    println!("\n{:<48} {:>6} {:>9} {:>8} {:>10}  result", "op (drawn and hostile calls)", "exec", "cases", "matched", "bytes");
    for (name, rows) in ops_report {
        for (op, t) in rows {
            match t {
                Some(t) => println!("{:<48} {:>6} {:>9} {:>8} {:>10}  {}", op, name, t.cases, t.matched, t.bytes, verdict(t)),
                None => println!("{:<48} {:>6} {:>9} {:>8} {:>10}  not on caller memory here", op, name, "-", "-", "-"),
            }
        }
    }
}

/// One summary line per executor for the ops and for the cells; whether any differed.
fn summarize(devices: &[Device], report: &[(&str, CellRows)], ops_report: &[(&str, OpRows)], json: bool) -> bool {
    let mut failed = false;
    for (name, rows) in ops_report {
        let bad = rows.iter().filter(|(_, t)| t.as_ref().is_some_and(|t| t.matched != t.cases)).count();
        failed |= bad > 0;
        if bad > 0 {
            print_summary(json, &format!("{name}: {bad} of the newer ops differ from their definitions"), &[]);
        }
    }
    for (name, rows) in report {
        let bad = rows.iter().filter(|(_, t)| t.matched != t.cases).count();
        let cases: u64 = rows.iter().map(|(_, t)| t.cases).sum();
        let sums: u64 = rows.iter().map(|(_, t)| t.checksums).sum();
        let keeps = devices.iter().find(|d| d.name() == *name).is_some_and(|d| d.capabilities().checksums);
        let line = format!(
            "{name}: {} of {} cells, {cases} cases, {}; item checksums: {}",
            rows.len() - bad,
            rows.len(),
            if bad == 0 { "all match the oracle" } else { "MISMATCHES" },
            if keeps { format!("{sums} recorded by backups, each equal to the oracle's") } else { "not kept on this executor".into() }
        );
        print_summary(json, &line, &[]);
        failed |= bad > 0;
    }
    failed
}
