#!/usr/bin/env python3
"""Time to first token of a long shared prefix, per KV source, in the engines themselves: the
number a user picks a KV tier by.

For each engine, a prompt of ``--prefix`` shared tokens plus a short distinct tail is answered with
one token (``max_new_tokens=1``: the wall time of the call is the prefill, plus the engine's own
overhead, plus whatever brought the prefix back):

- sglang 0.5.23 (``Engine``, ``HICACHE_IO_SGLANG=1``): *recompute* (no prefix anywhere: a prefix
  never seen), *host pool* (HiCache's L2 on hicache-io, after fillers evicted the device copy),
  *L3 local* (``LocalStore`` after ``flush_cache()`` emptied device and host), *device* (sglang's
  own radix cache, for reference), and, in an engine of its own, *direct L3* (sglang's external
  linker on ``HicacheLinker`` and the local store, no host pool, after fillers evicted the
  device copy);
- vLLM 0.33.0 (``LLM``): *recompute*, *CPU tier* (``HicacheOffloadingSpec`` after
  ``reset_prefix_cache()``), *device* (vLLM's prefix cache), and *L3 local* (``HicacheTier`` on a
  local directory in the spec's ``secondary_tiers``: a new engine process over the directory
  another one wrote, its CPU tier empty).

Each source is asserted from the engine's own report (sglang's ``cached_tokens_details``, vLLM's
``num_cached_tokens``) and timed over ``--trials`` prompts, the median printed. The model is a
random-weight Llama made here (``--layers``, ``--hidden``: the default, 8 x 1024 with 16 heads, 4
KV heads, a vocabulary of 1024: about 92 M parameters, makes a 2000-token prefill cost seconds on 2 cores, against
megabytes of KV). Needs the engine tests' venvs (README): ``--sglang-python`` and
``--vllm-python`` name them (default: this Python for both; an engine whose Python lacks it is
skipped with the reason).

    python scripts/bench-engine.py --sglang-python VENV/bin/python --vllm-python VLLM_VENV/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINES = os.path.join(HERE, "..", "python", "tests", "engines")
sys.path.insert(0, ENGINES)

import harness  # noqa: E402
import model  # noqa: E402


def run(python: str, driver: str, spec: dict, work: str, name: str, env: dict, timeout: float) -> dict:
    """One driver run, as the engine tests start it (its own session, killed with its engine's
    processes at the end); raises the tests' ``DriverFailed`` with its log's end."""
    return harness.collect(harness.run_driver(driver, spec, work, name, env, timeout=timeout, python=python))


def median_of(result: dict, name: str, check) -> "tuple[float, int]":
    steps = [s for s in result["steps"] if s["name"] == name]
    for s in steps:
        check(s)
    return statistics.median(s["seconds"] for s in steps), len(steps)


def sglang_rows(a, model_dir: str, work: str) -> list:
    cold = [model.prompts(a.prefix, 1, seed=200 + i)[1][0] for i in range(a.trials)]
    fill = [model.prompts(a.prefix, 1, seed=300 + i)[1][0] for i in range(a.fillers)]
    steps = []
    for i in range(a.trials):
        # One prefix a trial; its four prompts differ in their tails.
        store, device, host, l3 = model.prompts(a.prefix, 4, seed=100 + i)[1]
        # The cold prompt last, after the flush: it leaves nothing in the way of the eviction.
        steps += [
            {"op": "generate", "name": "store", "prompts": [store], "max_new_tokens": 1},
            {"op": "generate", "name": "device", "prompts": [device], "max_new_tokens": 1},
            {"op": "generate", "name": "fill", "prompts": fill, "max_new_tokens": 1},
            {"op": "generate", "name": "host", "prompts": [host], "max_new_tokens": 1},
            {"op": "flush"},
            {"op": "generate", "name": "l3", "prompts": [l3], "max_new_tokens": 1},
            {"op": "flush"},
            {"op": "generate", "name": "recompute", "prompts": [cold[i]], "max_new_tokens": 1},
            {"op": "flush"},
        ]
    # The fillers fill the device pool: the prefix (least recently used) goes to the host pool.
    pool = a.fillers * (a.prefix + 32)
    engine = {
        "max_total_tokens": pool,
        "chunked_prefill_size": 4096,
        "context_length": a.prefix + 64,
        "enable_hierarchical_cache": True,
        "hicache_ratio": 4,
        "hicache_io_backend": "kernel",
        "hicache_mem_layout": "page_first",
        "hicache_write_policy": "write_through",
        "hicache_storage_backend": "dynamic",
        "hicache_storage_backend_extra_config": json.dumps({"backend_name": "hicache_io", "module_path": "hicache_io.storage", "class_name": "LocalStore", "interface_v1": 1, "hicache_io_local_dir": os.path.join(work, "l3")}),
    }
    env = {"SGLANG_USE_CPU_ENGINE": "1", "HICACHE_IO_SGLANG": "1", "TORCH_EXTENSIONS_DIR": os.path.join(work, "torch-extensions")}
    r = run(a.sglang_python, "sglang_driver.py", {"model": model_dir, "engine": engine, "steps": steps}, work, "sglang", env, a.timeout)
    rows = []
    for label, name, where in (("recompute", "recompute", None), ("device (sglang's radix cache)", "device", "device"), ("host pool (hicache-io L2)", "host", "host"), ("L3 local (LocalStore)", "l3", "storage")):
        t, n = median_of(r, name, sglang_source(a, where))
        rows.append(("sglang", label, t, n))
    return rows + sglang_linker_rows(a, model_dir, work, fill, env)


def sglang_source(a, where):
    """A check of a step's report: the prefix came from ``where`` (sglang's cache details), or
    from nowhere (``None``)."""
    reused = a.prefix // 16 * 16

    def check(s):
        d = s["details"] or {}
        got = {k: d.get(k, 0) for k in ("device", "host", "storage")}
        want = {k: (reused if k == where else 0) for k in got} if where else {k: 0 for k in got}
        assert got == want, f"sglang {where or 'recompute'}: {got}, expected {want}"

    return check


def sglang_linker_rows(a, model_dir: str, work: str, fill: list, env: dict) -> list:
    """sglang's direct L3 (no host pool) on ``HicacheLinker`` and the local store: the prefix
    the fillers evicted comes back from the store (sglang reports a linker hit as "host")."""
    steps = []
    for i in range(a.trials):
        store, linked = model.prompts(a.prefix, 2, seed=400 + i)[1]
        steps += [
            {"op": "generate", "name": "store", "prompts": [store], "max_new_tokens": 1},
            {"op": "generate", "name": "fill", "prompts": fill, "max_new_tokens": 1},
            {"op": "generate", "name": "linker", "prompts": [linked], "max_new_tokens": 1},
            {"op": "flush"},
        ]
    config = {"linker": "HicacheLinker", "linker_module_path": "hicache_io.sglang_linker", "linker_extra_config": {"store": "local", "path": os.path.join(work, "linker")}}
    engine = {"max_total_tokens": a.fillers * (a.prefix + 32), "chunked_prefill_size": 4096, "context_length": a.prefix + 64, "enable_unified_cache_external_linker": True, "unified_cache_external_linker_backend": "dynamic", "unified_cache_external_linker_config": config}
    r = run(a.sglang_python, "sglang_driver.py", {"model": model_dir, "engine": engine, "steps": steps}, work, "sglang-linker", env, a.timeout)
    t, n = median_of(r, "linker", sglang_source(a, "host"))
    return [("sglang", "direct L3 (HicacheLinker, local)", t, n)]


def vllm_rows(a, model_dir: str, work: str) -> list:
    steps = []
    for i in range(a.trials):
        cold = model.prompts(a.prefix, 1, seed=200 + i)[1][0]
        tail = model.prompts(a.prefix, 3, seed=100 + i)[1]
        steps += [
            {"op": "reset"},
            {"op": "generate", "name": "recompute", "prompts": [cold], "max_new_tokens": 1},
            {"op": "generate", "name": "store", "prompts": [tail[0]], "max_new_tokens": 1},
            {"op": "generate", "name": "device", "prompts": [tail[1]], "max_new_tokens": 1},
            {"op": "reset"},
            {"op": "generate", "name": "tier", "prompts": [tail[2]], "max_new_tokens": 1},
        ]
    llm = {
        "max_model_len": a.prefix + 64,
        "kv_transfer_config": {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "HicacheOffloadingSpec", "spec_module_path": "hicache_io.vllm", "cpu_bytes_to_use": 512 << 20},
        },
    }
    r = run(a.vllm_python, "vllm_driver.py", {"model": model_dir, "llm": llm, "steps": steps}, work, "vllm", {}, a.timeout)
    reused = a.prefix // 32 * 32

    def cached(n):
        def check(s):
            assert s["cached"] == n, f"vLLM: {s['cached']} tokens cached, expected {n}"

        return check

    rows = []
    for label, name, n in (("recompute", "recompute", 0), ("device (vLLM's prefix cache)", "device", reused), ("CPU tier (HicacheOffloadingSpec)", "tier", reused)):
        t, k = median_of(r, name, cached(n))
        rows.append(("vllm", label, t, k))

    # L3: one engine stores the prefixes (through its CPU tier to the directory); a new engine
    # over the same directory, its CPU tier empty, answers prompts over them: every prefix comes
    # back from the directory (promoted into the CPU tier, then loaded). Its first request is a
    # cold warm-up, not timed.
    extra = llm["kv_transfer_config"]["kv_connector_extra_config"]
    extra["secondary_tiers"] = [{"type": "HicacheTier", "module_path": "hicache_io.vllm", "store": "local", "path": os.path.join(work, "vllm-l3")}]
    prompts = [model.prompts(a.prefix, 2, seed=400 + i)[1] for i in range(a.trials)]
    stores = [{"op": "generate", "name": "store", "prompts": [p[0]], "max_new_tokens": 1} for p in prompts] + [{"op": "settle"}]
    run(a.vllm_python, "vllm_driver.py", {"model": model_dir, "llm": llm, "steps": stores}, work, "vllm-l3-store", {}, a.timeout)
    warm = model.prompts(a.prefix, 1, seed=600)[1][0]
    steps = [{"op": "generate", "name": "warm", "prompts": [warm], "max_new_tokens": 1}]
    steps += [{"op": "generate", "name": "l3", "prompts": [p[1]], "max_new_tokens": 1} for p in prompts]
    r = run(a.vllm_python, "vllm_driver.py", {"model": model_dir, "llm": llm, "steps": steps}, work, "vllm-l3", {}, a.timeout)
    (tier,) = r["tiers"]
    assert tier["loaded"] == a.trials * (a.prefix // 32) and tier["corrupt"] == 0, f"vLLM L3: {tier}"
    t, k = median_of(r, "l3", cached(reused))
    rows.append(("vllm", "L3 local (HicacheTier)", t, k))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=2000, help="shared prefix tokens")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--fillers", type=int, default=3, help="sglang: prompts that evict the device copy")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--sglang-python", default=sys.executable)
    ap.add_argument("--vllm-python", default=sys.executable)
    ap.add_argument("--only", choices=["sglang", "vllm"])
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--json", help="write the rows here too")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        model_dir = model.build(os.path.join(work, "model"), layers=a.layers, hidden=a.hidden, intermediate=a.hidden * 11 // 4, heads=16, kv_heads=4)
        rows, skipped = [], []
        for engine, fn in (("sglang", sglang_rows), ("vllm", vllm_rows)):
            if a.only not in (None, engine):
                continue
            print(f"{engine}: running ...", file=sys.stderr, flush=True)
            try:
                rows += fn(a, model_dir, work)
            except (RuntimeError, AssertionError) as e:
                skipped.append(f"{engine}: {e}")
    base = {e: t for e, label, t, _ in rows if label == "recompute"}
    print(f"TTFT, {a.prefix}-token shared prefix, {a.layers} x {a.hidden} Llama, median of {a.trials}")
    print(f"{'engine':8}{'prefix from':34}{'TTFT s':>9}{'vs recompute':>14}")
    for engine, label, t, _ in rows:
        print(f"{engine:8}{label:34}{t:9.3f}{base[engine] / t:13.2f}x")
    for s in skipped:
        print(f"skipped {s}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{"engine": e, "source": label, "ttft_s": t, "trials": n} for e, label, t, n in rows], f, indent=1)


if __name__ == "__main__":
    main()
