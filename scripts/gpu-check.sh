#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU (one script, under 5 minutes):
#   1. hicache-io info (driver, device, kernel image, batched memcpy),
#   2. the CUDA executor against the oracle on every supported cell, both profiles,
#   3. the CUDA tests (when cargo is present) with HICACHE_REQUIRE_CUDA=1,
#   4. a short bench: kernel vs direct (batched and per-run copies), H2D loads and D2H backups,
#      DSA pages of 8448 B and MLA records of 1152 B and 656 B, 4096 random pages.
# Uses $HICACHE_IO_BIN (default target/release/hicache-io), building it if cargo is present.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
bin="${HICACHE_IO_BIN:-target/release/hicache-io}"
if command -v cargo >/dev/null; then
    cargo build --release --quiet
fi
[ -x "$bin" ] || { echo "no $bin and no cargo to build it" >&2; exit 2; }
export HICACHE_REQUIRE_CUDA=1 RUST_LOG="${RUST_LOG:-info}"

echo "== info"
"$bin" info
echo "== check: cuda vs oracle, every supported cell"
"$bin" check --backend cuda --rounds 20 --seed 1
"$bin" check --backend cuda --rounds 10 --seed 2 --profile sglang
if command -v cargo >/dev/null; then
    echo "== cuda tests"
    cargo test --release --quiet --test cuda --test borrowed --test sglang_ports
fi
echo "== bench: batched direct copies"
"$bin" bench --backend cuda --items 8448,1152,656 --budget-ms 200 --json > "$out/bench-cuda-batched.json"
"$bin" bench --backend cuda --items 8448,1152,656 --budget-ms 200 | tail -n +2
echo "== bench: one cuMemcpyAsync per run (HICACHE_CUDA_BATCH=0), direct paths only"
HICACHE_CUDA_BATCH=0 "$bin" bench --backend cuda --items 8448,1152,656 --budget-ms 200 | grep -E "exec|direct"
