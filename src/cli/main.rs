//! `hicache-io`: info | matrix | check (the main job, also with no arguments) | fuzz | bench.
//! One file per command beside this one (`check.rs`, `fuzz.rs`, `bench.rs`).
//!
//! Machine-readable output (`--json`) is pure JSON on stdout; progress and human lines go to
//! stderr.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use hicache_io::exec::{probe_all, Device, ExecutorKind};
use hicache_io::geometry::{PoolKind, Profile};
use hicache_io::tools::check::Tally;
use hicache_io::tools::matrix::{matrix, render_markdown};

mod bench;
mod check;
mod fuzz;

use bench::BenchArgs;
use check::CheckArgs;
use fuzz::FuzzArgs;

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
            if let Err(e) = hicache_io::tools::matrix::check_dsa_page_size(dsa_page_size) {
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
        Cmd::Check(args) => check::check(args),
        Cmd::Bench(args) => bench::bench(args),
        Cmd::Fuzz(args) => fuzz::fuzz(args),
    }
}

/// The executors to run on: `--executor` if given, else `HICACHE_IO_EXECUTOR` (or its older name
/// `HICACHE_IO_BACKEND`) if set (an unknown name is an error; `auto` means every executor
/// present), else every executor present.
pub(crate) fn open_devices(requested: &[ExecutorKind]) -> Option<Vec<Device>> {
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

/// A summary line (stderr under `--json`, which keeps stdout for the JSON) and its failures.
pub(crate) fn print_summary(json: bool, line: &str, failures: &[String]) {
    if json {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
    for f in failures {
        eprintln!("  {f}");
    }
}

pub(crate) fn verdict(t: &Tally) -> String {
    if t.matched == t.cases {
        "ok".into()
    } else {
        format!("FAIL ({})", t.first_failure.as_deref().unwrap_or("?"))
    }
}

/// A progress bar of `len` steps named `prefix` (on stderr).
pub(crate) fn progress(len: u64, prefix: String) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{prefix:>5} [{bar:40}] {pos}/{len} {msg}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix(prefix);
    bar
}

/// The exit status of a command that `failed` or not.
pub(crate) fn status(failed: bool) -> ExitCode {
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
