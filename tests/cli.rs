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
    assert!(out.contains("cpu: 39 of 39 cells"), "{out}");
    let (ok, out) = run(&["check", "--backend", "cpu", "--rounds", "3", "--profile", "sglang"]);
    assert!(ok && out.contains("all match the oracle"), "{out}");
}

#[test]
fn check_wgpu_names_the_adapter() {
    if common::open(hicache_io::BackendKind::Wgpu).is_none() {
        return;
    }
    let (ok, out) = run(&["check", "--backend", "wgpu", "--rounds", "2"]);
    assert!(ok, "{out}");
    assert!(out.contains("wgpu: ") && out.contains("all match the oracle"), "{out}");
    if std::env::var("CI").is_ok() {
        assert!(out.contains("llvmpipe"), "expected lavapipe in CI: {out}");
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
