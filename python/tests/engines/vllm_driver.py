"""Runs vLLM 0.33.0's ``LLM`` on CPU through a list of steps and writes what it saw as JSON.

``python vllm_driver.py SPEC.json OUT.json``. SPEC: ``{"model": DIR, "llm": {extra vllm.LLM
arguments}, "steps": [{"op": "generate", "name": N, "prompts": [[ids]], "max_new_tokens": K} |
{"op": "reset"} | {"op": "damage"} | {"op": "settle"}]}``. OUT: ``{"steps": [{"name", "tokens", "cached", "seconds"}],
"workers": N, "tiers": [each secondary tier's counters]}``.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the driver can
reach hicache-io's offloading worker: ``damage`` flips a byte in every chunk it holds (a load of
them must fail and be recomputed, never land), and ``HICACHE_ENGINE_TEST_BREAK_LOADS=1`` makes its
loads move nothing while reporting success (the negative control: the tokens must change).
``reset`` is ``reset_prefix_cache()``: afterwards a cached token can only come from the offload
tier."""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def workers() -> list:
    """hicache-io's offloading workers in this process (vLLM's worker-side connector's)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    from hicache_io.vllm import HicacheOffloadingWorker

    if not has_kv_transfer_group():
        return []
    found = getattr(getattr(get_kv_transfer_group(), "connector_worker", None), "worker", None)
    return [found] if isinstance(found, HicacheOffloadingWorker) else []


def scheduler_manager(llm):
    """The offloading manager of the engine's scheduler (in this process), or None."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    connector = core.scheduler.get_kv_connector() if core is not None else None
    sched = getattr(connector, "connector_scheduler", None)
    return getattr(sched, "manager", None)


def settle(llm) -> None:
    """Runs one-token requests until every offloading job is done: stores to the CPU tier
    complete (and cascade to the secondary tiers) only in the engine steps after them."""
    from vllm import SamplingParams

    core = llm.llm_engine.engine_core.engine_core
    sched = getattr(core.scheduler.get_kv_connector(), "connector_scheduler", None)
    manager = getattr(sched, "manager", None)
    tiers = getattr(manager, "secondary_tiers", [])
    params = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
    for _ in range(200):
        busy = bool(getattr(sched, "_jobs", None)) or bool(getattr(manager, "_jobs", None)) or any(t.has_pending_work() for t in tiers)
        if not busy:
            return
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        time.sleep(0.05)
    raise RuntimeError("offloading jobs still in flight after 200 steps")


def break_loads() -> None:
    from hicache_io.vllm import HicacheOffloadingWorker

    move = HicacheOffloadingWorker._move

    def no_loads(self, store, parts):
        return move(self, store, parts) if store else []

    HicacheOffloadingWorker._move = no_loads


def damage() -> int:
    """Flips one byte of every host row of every worker; returns the rows damaged."""
    n = 0
    for w in workers():
        if w.tier is None:
            continue
        for row in range(w.num_chunks * w.blocks_per_chunk):
            for j in range(len(w.row_bytes)):
                w.tier.inject_host_corruption(j, row, 7, b"\xa5")
                n += 1
    return n


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    if os.environ.get("HICACHE_ENGINE_TEST_BREAK_LOADS") == "1":
        break_loads()
    from vllm import LLM, SamplingParams

    args = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=32,
        dtype="float32",
        enable_prefix_caching=True,
        max_model_len=1024,
        max_num_seqs=4,
        seed=0,
    )
    args.update(spec.get("llm", {}))
    t0 = time.monotonic()
    llm = LLM(**args)
    out = {"steps": [], "start_s": round(time.monotonic() - t0, 1)}
    for step in spec["steps"]:
        if step["op"] == "reset":
            assert llm.reset_prefix_cache(), "reset_prefix_cache refused"
            continue
        if step["op"] == "damage":
            out["damaged_rows"] = damage()
            continue
        if step["op"] == "settle":
            settle(llm)
            continue
        params = SamplingParams(temperature=0, max_tokens=step.get("max_new_tokens", 16), ignore_eos=True, detokenize=False)
        for prompt in step["prompts"]:
            t = time.perf_counter()
            (r,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            t = time.perf_counter() - t
            out["steps"].append({"name": step["name"], "tokens": list(r.outputs[0].token_ids), "cached": r.num_cached_tokens or 0, "seconds": t})
    out["workers"] = len(workers())
    manager = scheduler_manager(llm)
    out["tiers"] = [dict(getattr(t, "stats", {})) for t in getattr(manager, "secondary_tiers", [])]
    out["seconds"] = round(time.monotonic() - t0, 1)
    with open(out_path, "w") as f:
        json.dump(out, f)
    # vLLM's in-process engine keeps threads that can hold the interpreter: the result is written.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
