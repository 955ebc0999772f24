#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU (one script, under 5 minutes):
#   1. hicache-io info (driver, device, kernel image, batched memcpy, wgpu adapter),
#   2. the CUDA executor against the oracle on every supported cell, both profiles,
#   3. the CUDA engine example (borrowed engine memory, completion handles, layer overlap),
#   4. the CUDA tests (when cargo is present) with HICACHE_REQUIRE_CUDA=1, the engine-stream
#      ordering tests among them,
#   5. hostile input on cuda (fuzz, 2,000 cases, with corruption injection) and the cost of
#      item checksums (the summing kernel against the plain one),
#   6. wgpu on the real GPU when its Vulkan driver is present (check, fuzz with corruption
#      injection, and the cost of item checksums),
#   7. a short bench: kernel vs direct (batched and per-run copies), H2D loads and D2H backups,
#      DSA pages of 8448 B and MLA records of 1152 B and 656 B, 4096 random pages; the kernel with
#      16-byte words (the default where aligned) against 8-byte words (HICACHE_CUDA_MAX_WORD=8),
#      each next to the contiguous cuMemcpyAsync reference the bench prints,
#   8. the Python package on CUDA tensors (torch), when a wheel is given in $HICACHE_IO_WHEEL, also
#      under PyTorch's expandable_segments:True and backend:cudaMallocAsync allocators
#      (build it with `maturin build --release -m python/Cargo.toml`; installed --no-deps into a
#      venv that sees the system's torch).
# Uses $HICACHE_IO_BIN (default target/release/hicache-io) and $HICACHE_IO_EXAMPLE (default
# target/release/examples/cuda_engine), building them if cargo is present. Writes logs and
# JSON under $OUT when it is set (else the current folder).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
bin="${HICACHE_IO_BIN:-target/release/hicache-io}"
example="${HICACHE_IO_EXAMPLE:-target/release/examples/cuda_engine}"
if command -v cargo >/dev/null; then
    cargo build --release --quiet --bin hicache-io --example cuda_engine || exit 2
fi
[ -x "$bin" ] || { echo "no $bin and no cargo to build it" >&2; exit 2; }
export HICACHE_REQUIRE_CUDA=1 RUST_LOG="${RUST_LOG:-info}"
status=0
step() { echo "== $1"; shift; "$@" || { echo "FAILED ($?): $*"; status=1; }; }

step "info" "$bin" info
step "check: cuda vs oracle, every supported cell (extended)" "$bin" check --backend cuda --rounds 20 --seed 1
step "check: cuda vs oracle, every supported cell (sglang)" "$bin" check --backend cuda --rounds 10 --seed 2 --profile sglang
if [ -x "$example" ]; then
    step "example: cuda_engine" "$example"
else
    echo "== example: $example missing (build it with cargo build --release --example cuda_engine)"
    status=1
fi
if command -v cargo >/dev/null; then
    step "cuda tests" cargo test --release --quiet --test cuda --test borrowed --test sglang_ports --test faults --test cuda_engine_stream --test pipeline \
        --test cuda_device_indices --test cuda_allocators
fi
step "fuzz: cuda, with 2000 corruption injections" "$bin" fuzz --backend cuda --cases 2000 --seed 3
step "bench: cuda item checksums on against off (the summing kernel against the plain one)" "$bin" bench --checksums --backend cuda --budget-ms 200
if "$bin" info | grep -q "^wgpu: available"; then
    step "check: wgpu on this GPU" "$bin" check --backend wgpu --rounds 4 --seed 4
    step "fuzz: wgpu on this GPU, with 2000 corruption injections" "$bin" fuzz --backend wgpu --cases 2000 --seed 5
    step "bench: wgpu item checksums on against off" "$bin" bench --checksums --backend wgpu --budget-ms 200
    step "bench: the same without 64-bit integers in the shader" env HICACHE_WGPU_INT64=0 "$bin" bench --checksums --backend wgpu --budget-ms 200
fi
echo "== bench: batched direct copies"
"$bin" bench --backend cuda --items 8448,1152,656 --budget-ms 200 --json > "$out/bench-cuda-batched.json" || status=1
"$bin" bench --backend cuda --items 8448,1152,656 --budget-ms 200 || status=1
echo "== bench: one cuMemcpyAsync per run (HICACHE_CUDA_BATCH=0)"
HICACHE_CUDA_BATCH=0 "$bin" bench --backend cuda --items 8448,1152,656 --budget-ms 200 --json > "$out/bench-cuda-per-run.json" || status=1
echo "== bench: the kernel with 8-byte words (HICACHE_CUDA_MAX_WORD=8; the runs above use 16-byte words where aligned)"
HICACHE_CUDA_MAX_WORD=8 "$bin" bench --backend cuda --items 8448,1152,656 --budget-ms 200 || status=1
HICACHE_CUDA_MAX_WORD=8 "$bin" bench --backend cuda --items 8448,1152,656 --budget-ms 200 --json > "$out/bench-cuda-w8.json" || status=1
if [ -n "${HICACHE_IO_WHEEL:-}" ]; then
    echo "== python: kvcacheio on CUDA tensors (torch)"
    pyenv="$(mktemp -d)/venv"
    python3 -m venv --system-site-packages "$pyenv" && "$pyenv/bin/pip" install -q --no-deps --no-index "$HICACHE_IO_WHEEL" || status=1
    if "$pyenv/bin/python" -c "import pytest" 2>/dev/null; then
        step "pytest python/tests/test_cuda.py" "$pyenv/bin/python" -m pytest -q python/tests/test_cuda.py
        # The allocators engines use: PyTorch's expandable segments (the virtual-memory API,
        # chunks mapped side by side) and its stream-ordered allocator (cudaMallocAsync).
        step "pytest python/tests/test_cuda.py under expandable_segments:True" \
            env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$pyenv/bin/python" -m pytest -q python/tests/test_cuda.py
        step "pytest python/tests/test_cuda.py under backend:cudaMallocAsync" \
            env PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync "$pyenv/bin/python" -m pytest -q python/tests/test_cuda.py
    else
        step "python/tests/test_cuda.py (as a script)" "$pyenv/bin/python" python/tests/test_cuda.py
        step "python/tests/test_cuda.py under expandable_segments:True" \
            env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$pyenv/bin/python" python/tests/test_cuda.py
        step "python/tests/test_cuda.py under backend:cudaMallocAsync" \
            env PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync "$pyenv/bin/python" python/tests/test_cuda.py
    fi
fi
echo "gpu-check: $([ $status = 0 ] && echo PASSED || echo FAILED)"
exit $status
