//! The binary: `check` is the main job and exits 0 when every executor matches the oracle;
//! `matrix` prints the table (the seed's message in the sglang profile); `info` never fails.

mod common;

use std::process::Command;

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_hicache-io")).args(args).output().expect("run hicache-io");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
}

#[test]
fn check_cpu_passes() {
    let (ok, out) = run(&["check", "--backend", "cpu", "--rounds", "3", "--seed", "11"]);
    assert!(ok, "{out}");
    assert!(out.contains("cpu: 48 of 48 cells"), "{out}");
    let (ok, out) = run(&["check", "--backend", "cpu", "--rounds", "3", "--profile", "sglang"]);
    assert!(ok && out.contains("all match the oracle"), "{out}");
    // Every cell again with the auto io backend (the table's path, or the calibrated one).
    let (ok, out) = run(&["check", "--backend", "cpu", "--rounds", "2", "--io", "auto"]);
    assert!(ok && out.contains("cpu: 48 of 48 cells"), "{out}");
    let (ok, out) = run(&["check", "--backend", "cpu", "--io", "auto", "--profile", "sglang"]);
    assert!(!ok && out.contains("profile extended"), "{out}");
}

#[test]
fn check_wgpu_names_the_adapter() {
    if common::open(hicache_io::ExecutorKind::Wgpu).is_none() {
        return;
    }
    let (ok, out) = run(&["check", "--backend", "wgpu", "--rounds", "2"]);
    assert!(ok, "{out}");
    assert!(out.contains("wgpu: ") && out.contains("all match the oracle"), "{out}");
    if std::env::var("CI").is_ok() {
        // CI's stacks: lavapipe, or the one scripts/wgpu-stacks.sh selected.
        let swiftshader = std::env::var("VK_ICD_FILENAMES").is_ok_and(|v| v.contains("swiftshader"));
        let want = if swiftshader { "SwiftShader" } else { "llvmpipe" };
        assert!(out.contains(want), "expected {want} in CI: {out}");
    }
}

#[test]
fn matrix_shows_the_seed_message_only_in_sglang() {
    let seed = "Layer-sharded direct DSA indexer backup only supports layer_first layout, got page_first";
    let (ok, out) = run(&["matrix", "--profile", "sglang", "--pool", "dsa"]);
    assert!(ok && out.contains(seed), "{out}");
    let (ok, out) = run(&["matrix"]);
    assert!(ok && !out.contains(seed), "{out}");
    let (ok, out) = run(&["matrix", "--json", "--pool", "mla"]);
    assert!(ok && out.trim_start().starts_with('['), "{out}");
}

#[test]
fn info_reports_every_executor() {
    let (ok, out) = run(&["info"]);
    assert!(ok, "{out}");
    for name in ["cpu: available", "wgpu: ", "cuda: "] {
        assert!(out.contains(name), "{out}");
    }
}

fn run_env(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hicache-io"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run hicache-io");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Inputs the CLI used to accept silently: an unknown executor name in the environment, a
/// check of zero cases, a matrix for a 0-token or wrapping page.
#[test]
fn cli_refuses_what_it_cannot_honour() {
    let (ok, _, err) = run_env(&["check", "--rounds", "1"], &[("HICACHE_IO_BACKEND", "garbage")]);
    assert!(!ok && err.contains("garbage"), "{err}");
    let (ok, _, err) = run_env(&["check", "--backend", "cpu", "--rounds", "0"], &[]);
    assert!(!ok, "{err}");
    for size in ["0", "18446744073709551615"] {
        let (ok, out, err) = run_env(&["matrix", "--dsa-page-size", size], &[]);
        assert!(!ok && out.is_empty(), "{size}: {out} {err}");
    }
    // HICACHE_IO_BACKEND picks the executor when --backend is absent.
    let (ok, out, err) = run_env(&["check", "--rounds", "1"], &[("HICACHE_IO_BACKEND", "cpu")]);
    assert!(ok && out.contains("cpu: ") && !out.contains("wgpu: "), "{out} {err}");
    // Its new name HICACHE_IO_EXECUTOR first, and --executor (--backend still accepted).
    let (ok, out, err) = run_env(&["check", "--rounds", "1"], &[("HICACHE_IO_EXECUTOR", "cpu"), ("HICACHE_IO_BACKEND", "garbage")]);
    assert!(ok && out.contains("cpu: ") && !out.contains("wgpu: "), "{out} {err}");
    let (ok, _, err) = run_env(&["check", "--rounds", "1"], &[("HICACHE_IO_EXECUTOR", "garbage")]);
    assert!(!ok && err.contains("HICACHE_IO_EXECUTOR") && err.contains("garbage"), "{err}");
    let (ok, out, err) = run_env(&["check", "--executor", "cpu", "--rounds", "1"], &[]);
    assert!(ok && out.contains("cpu: ") && !out.contains("wgpu: "), "{out} {err}");
}

/// `--json` output is JSON alone on stdout (human lines go to stderr).
#[test]
fn json_output_parses() {
    let (ok, out, err) = run_env(&["check", "--backend", "cpu", "--rounds", "1", "--json"], &[]);
    assert!(ok, "{err}");
    serde_json::from_str::<serde_json::Value>(&out).unwrap_or_else(|e| panic!("check --json: {e}: {out}"));
    let (ok, out, err) = run_env(&["bench", "--backend", "cpu", "--items", "128", "--budget-ms", "1", "--json"], &[]);
    assert!(ok, "{err}");
    serde_json::from_str::<serde_json::Value>(&out).unwrap_or_else(|e| panic!("bench --json: {e}: {out}"));
    let (ok, out, err) = run_env(&["bench", "--pipeline", "--backend", "cpu", "--compute-us", "200", "--json"], &[]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("bench --pipeline --json: {e}: {out}"));
    assert_eq!(v[0]["layers"], 8, "{out}");
}

/// Without a runtime dir (containers, CI) Mesa's Vulkan layer used to print an error-looking
/// warning on every run; the CLI gives itself one.
#[test]
fn no_runtime_dir_warning() {
    let out = Command::new(env!("CARGO_BIN_EXE_hicache-io")).arg("info").env_remove("XDG_RUNTIME_DIR").output().expect("run hicache-io");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !text.contains("XDG_RUNTIME_DIR"), "{text}");
}

/// An unknown executor name in the environment is an error for `info` too (it used to exit 0).
#[test]
fn info_refuses_an_unknown_backend_name() {
    let (ok, _, err) = run_env(&["info"], &[("HICACHE_IO_BACKEND", "garbage")]);
    assert!(!ok && err.contains("HICACHE_IO_BACKEND") && err.contains("garbage"), "{err}");
    let (ok, _, err) = run_env(&["info"], &[("HICACHE_IO_BACKEND", "cpu")]);
    assert!(ok, "{err}");
}

/// A reader that stops early (`hicache-io matrix | head -1`) ends the process quietly, as it does
/// other command-line tools: no panic in the printing code.
#[cfg(target_os = "linux")]
#[test]
fn a_closed_pipe_is_not_a_panic() {
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_hicache-io"))
        .args(["matrix", "--profile", "extended"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run hicache-io");
    // Nothing read: the first write past the pipe's buffer (or any write) finds it closed.
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait for hicache-io");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_ne!(out.status.code(), Some(101), "{stderr}");
}
