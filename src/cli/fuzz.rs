//! `hicache-io fuzz`: hostile input, corruption injection and hostile calls of the newer ops on
//! each executor.

use std::process::ExitCode;

use hicache_io::exec::{Device, ExecutorKind};
use hicache_io::tools::check::Tally;
use hicache_io::tools::fuzz::FuzzTally;
use hicache_io::tools::inject::InjectTally;

use crate::{open_devices, print_summary, progress, status};

#[derive(clap::Args)]
pub(crate) struct FuzzArgs {
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

/// The newer ops' rows on one executor (`None`: not on caller memory there).
type OpRows = hicache_io::Result<Vec<(&'static str, Option<Tally>)>>;

/// One executor's results.
struct Report {
    name: &'static str,
    fuzz: FuzzTally,
    inject: InjectTally,
    ops: OpRows,
}

pub(crate) fn fuzz(args: FuzzArgs) -> ExitCode {
    let Some(devices) = open_devices(&args.executor) else { return ExitCode::FAILURE };
    if devices.is_empty() {
        eprintln!("no executor available");
        return ExitCode::FAILURE;
    }
    let report: Vec<Report> = devices.iter().map(|dev| run(dev, &args)).collect();
    if args.json {
        let v: Vec<_> = report
            .iter()
            .map(|r| {
                let ops =
                    r.ops.as_ref().map(|o| o.iter().map(|(op, t)| serde_json::json!({"op": op, "tally": t})).collect::<Vec<_>>()).ok();
                serde_json::json!({"backend": r.name, "tally": r.fuzz, "injection": r.inject, "ops": ops})
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
    }
    let mut clean = true;
    for r in &report {
        clean &= summarize_ops(r, args.json);
        clean &= summarize_fuzz(r, args.json);
        clean &= summarize_injection(r, args.json);
    }
    status(!clean)
}

/// Fuzz cases, then injections, then the newer ops' hostile calls on one executor.
fn run(dev: &Device, args: &FuzzArgs) -> Report {
    let bar = progress(args.cases, dev.name().to_string());
    let fuzz = hicache_io::tools::fuzz::fuzz_device(dev, args.seed, args.cases, |t| {
        bar.inc(1);
        bar.set_message(format!("panics {} corrupted {}", t.panics, t.corrupted));
    });
    bar.finish_and_clear();
    let injections = args.inject.unwrap_or(args.cases);
    let bar = progress(injections, format!("{} inject", dev.name()));
    let inject = hicache_io::tools::inject::inject_device(dev, args.seed, injections, |i| {
        bar.set_position(i.total());
        bar.set_message(format!("missed {} false alarms {}", i.missed, i.false_alarms));
    });
    bar.finish_and_clear();
    let ops = hicache_io::tools::check_ops::check_ops(dev, args.seed, (args.cases / 100).max(1), |_, _| {});
    Report { name: dev.name(), fuzz, inject, ops }
}

/// The newer ops' line; whether every call went as defined.
fn summarize_ops(r: &Report, json: bool) -> bool {
    let name = r.name;
    match &r.ops {
        Ok(rows) if rows.iter().any(|(_, t)| t.is_some()) => {
            let (cases, matched) = rows.iter().flat_map(|(_, t)| t).fold((0, 0), |(c, m), t| (c + t.cases, m + t.matched));
            let failures: Vec<String> = rows.iter().flat_map(|(_, t)| t).filter_map(|t| t.first_failure.clone()).collect();
            let line = format!(
                "{name}: newer ops (DeepSeek-V4 tokens, Mamba states, NVFP4 page rows): {cases} calls, half of them hostile, {matched} as defined"
            );
            print_summary(json, &line, &failures);
            cases == matched
        }
        Ok(_) => {
            print_summary(json, &format!("{name}: newer ops: not on caller memory here"), &[]);
            true
        }
        Err(e) => {
            print_summary(json, &format!("{name}: newer ops: {e}"), &[]);
            false
        }
    }
}

/// The fuzz cases' line; whether they were clean.
fn summarize_fuzz(r: &Report, json: bool) -> bool {
    let t = &r.fuzz;
    let line = format!(
        "{}: tried {}, rejected {} ({} configurations, {} calls), matched the oracle {}, large pools checked {}, padded pages {}, panics {}, corrupted {}, well-formed refused {}",
        r.name,
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
    print_summary(json, &line, &t.failures);
    t.clean()
}

/// The injections' line; whether every fault was caught and nothing else raised.
fn summarize_injection(r: &Report, json: bool) -> bool {
    let (i, t) = (&r.inject, &r.fuzz);
    let line = if i.verified {
        let kinds: Vec<String> = hicache_io::tools::inject::FAULTS.iter().zip(i.injected).map(|(k, n)| format!("{k} {n}")).collect();
        format!(
            "{}: integrity: injected {} ({}), detected {}, harmless {} (identical bytes swapped), missed {}, false alarms {} (and {} in {} verified loads of the cases above)",
            r.name,
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
        format!("{}: integrity: not verified on this executor (its copies keep no checksums): nothing injected", r.name)
    };
    print_summary(json, &line, &i.failures);
    i.clean()
}
