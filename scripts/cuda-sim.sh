#!/usr/bin/env bash
# Runs a command against the simulated CUDA driver (cuda-sim/): builds it, puts it first on the
# loader's path as libcuda.so / libcuda.so.1, and turns on seeded random delays per stream op.
#
#   scripts/cuda-sim.sh target/release/hicache-io check --backend cuda
#   scripts/cuda-sim.sh cargo test --test pipeline
#
# Settings (environment): HICACHE_CUDA_SIM_DELAY_US (largest delay per op, default 200),
# HICACHE_CUDA_SIM_SEED (default 1), HICACHE_CUDA_SIM_DEVICES (1 or 2), HICACHE_CUDA_SIM_TRACE
# (a file: one line per driver call), HICACHE_CUDA_SIM_LOG=1 (verbose), HICACHE_CUDA_SIM_STRICT=0
# (a race or device fault does not change the exit status; by default the process exits 86).
# HICACHE_REQUIRE_CUDA=1 is set, so a test that cannot open the cuda executor fails.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
target="$root/target/cuda-sim"
cargo build -q --release --manifest-path "$root/cuda-sim/Cargo.toml" --target-dir "$target"
lib="$target/lib"
mkdir -p "$lib"
ln -sf "$target/release/libhicache_cuda_sim.so" "$lib/libcuda.so"
ln -sf "$target/release/libhicache_cuda_sim.so" "$lib/libcuda.so.1"
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export HICACHE_CUDA_SIM_DELAY_US="${HICACHE_CUDA_SIM_DELAY_US:-200}"
export HICACHE_REQUIRE_CUDA=1 HICACHE_CUDA_SIM=1
exec "$@"
