#!/usr/bin/env bash
# The long hostile-input run: 10,000 cases per executor present (cpu, wgpu, cuda), in one
# process per executor so that an abort or a signal ends that executor's run with a non-zero
# status. Prints "tried N, rejected R, ..., panics 0, corrupted 0" per executor.
#   scripts/fuzz.sh [cases] [seed]
set -euo pipefail
cd "$(dirname "$0")/.."
cases="${1:-10000}"
seed="${2:-7}"
cargo build --release --quiet
status=0
info="$(./target/release/hicache-io info)"
for backend in cpu wgpu cuda; do
    if ! grep -q "^$backend: available" <<<"$info"; then
        echo "$backend: not available here, skipped"
        continue
    fi
    ./target/release/hicache-io fuzz --backend "$backend" --cases "$cases" --seed "$seed" || status=$?
done
exit "$status"
