"""sglang 0.5.23's ``Engine`` on CPU, its HiCache on hicache-io through the wheel's one setting
(``HICACHE_IO_SGLANG=1``), generating greedy tokens equal to the same engine without HiCache.

Every reused prefix's source is asserted from sglang's own report (``cached_tokens_details``:
device, host, storage), since a silent miss recomputes and still gives equal tokens:

- L2: a prefix stored, evicted from the device by filler prompts, served from the host pool
  (``page_first``/kernel and ``page_first_direct``/direct here; every host layout x io backend of
  the MHA pool with ``HICACHE_ENGINE_LAYOUTS=all``);
- L3 on ``LocalStore``: after ``flush_cache()`` (device and host emptied), from the directory;
  and from sglang's HTTP server (``python -m sglang.launch_server``), a new process over the same
  directory;
- L3 on ``MooncakeStore`` against a master this test starts on loopback;
- sglang's direct L3 (``UnifiedCacheLinker``, no host tier) on hicache-io's linker and the local
  store: the prefix evicted by filler prompts comes back through the linker (sglang counts it as
  "host"), tokens equal;
- negative controls: the same engines with hicache-io's loads broken (HiCache's host->device
  loads; the linker's copies) must give other tokens, so that the comparisons can fail;
- hicache-io's counted calls, in the scheduler process, show that it moved the bytes and that
  the hook (not this test) installed it there.
"""

from __future__ import annotations

import json
import os

import pytest

from . import model
from .harness import expected, get, missing_modules, problem_or_skip, run_driver, run_pairs, site_file, step, toolchain_problem

SGLANG_VERSION = "0.5.23"
PREFIX = 400  # tokens: 25 pages of 16
# (layout, io backend) -> the run whose L2 step serves it. CI runs page_first/kernel with
# LocalStore and page_first_direct/direct with MooncakeStore; HICACHE_ENGINE_LAYOUTS=all adds
# LocalStore runs of page_first_direct/direct and of the rest sglang offers for the MHA pool
# (page_first_direct_hg and page_unified: sglang 0.5.23 never selects them).
ALL = os.environ.get("HICACHE_ENGINE_LAYOUTS") == "all"
LOCAL_CELLS = ["page_first/kernel"] + (["page_first_direct/direct", "layer_first/kernel", "page_head/kernel", "layer_first/direct"] if ALL else [])
L2_RUNS = {"page_first_direct/direct": "mooncake", **{c: c for c in LOCAL_CELLS}}
# Modules sglang's Engine imports on CPU beyond the sglang client suite's venv.
ENGINE_MODULES = ["uvloop", "fastapi", "uvicorn", "multipart", "setproctitle", "xxhash", "interegular", "einops", "distro", "zstandard", "xgrammar", "partial_json_parser", "jsonschema", "soundfile"]


def _problem() -> "str | None":
    missing = missing_modules(["torch", "sglang"])
    if missing:
        return f"not installed: {', '.join(missing)}"
    import importlib.metadata

    version = importlib.metadata.version("sglang")
    if version != SGLANG_VERSION:
        return f"sglang {version} installed; these tests run sglang {SGLANG_VERSION}"
    missing = missing_modules(ENGINE_MODULES)
    if missing:
        return f"sglang's engine needs {', '.join(missing)} (python/tests/engines/requirements.txt)"
    if site_file("hicache_io_sglang.pth") is None:
        return "hicache-io's hook (hicache_io_sglang.pth) is not in site-packages: install the wheel (pip install ./python)"
    return toolchain_problem()


PROBLEM = _problem()
PREFIX_IDS, PROMPTS = model.prompts(PREFIX, 6)
FILL = [model.prompts(300, 1, seed=s)[1][0] for s in range(10, 14)]


def store_config(kind: str, where: str) -> str:
    import json

    raw = {"backend_name": "hicache_io", "module_path": "hicache_io.storage", "interface_v1": 1}
    if kind == "local":
        raw.update(class_name="LocalStore", hicache_io_local_dir=where)
    else:
        raw.update(class_name="MooncakeStore", master_server_address=where, protocol="tcp", metadata_server="P2PHANDSHAKE", local_hostname="127.0.0.1", global_segment_size=64 << 20, local_buffer_size=16 << 20)
    return json.dumps(raw)


def hicache(layout: str, io: str, store: "tuple[str, str] | None") -> dict:
    args = {"enable_hierarchical_cache": True, "hicache_ratio": 8, "hicache_io_backend": io, "hicache_mem_layout": layout, "hicache_write_policy": "write_through"}
    if store is not None:
        args.update(hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=store_config(*store))
    return args


def linker(where: str) -> dict:
    extra = {"store": "local", "path": where}
    return {"enable_unified_cache_external_linker": True, "unified_cache_external_linker_backend": "dynamic", "unified_cache_external_linker_config": {"linker": "HicacheLinker", "linker_module_path": "hicache_io.sglang_linker", "linker_extra_config": extra}}


def steps(*, l2: int, l3: "int | None" = None) -> list:
    """Prompt 0 computes the prefix, the fillers evict it from the device (written through to the
    host pool), prompt ``l2`` reuses it from the host; with ``l3``, ``flush_cache()`` then empties
    device and host and prompt ``l3`` reuses it from storage."""
    out = [
        {"op": "generate", "name": "first", "prompts": [PROMPTS[0]]},
        {"op": "generate", "name": "fill", "prompts": FILL, "max_new_tokens": 1},
        {"op": "generate", "name": "l2", "prompts": [PROMPTS[l2]]},
    ]
    if l3 is not None:
        out += [{"op": "flush"}, {"op": "generate", "name": "l3", "prompts": [PROMPTS[l3]]}]
    return out


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """Every engine run of this module, two at a time (each is mostly one busy thread): name ->
    the driver's output (``steps``, ``processes``, ``seconds``)."""
    problem_or_skip(PROBLEM, engine="sglang")
    work = str(tmp_path_factory.mktemp("sglang-engines"))
    counts = os.path.join(work, "counts")
    base_env = {"SGLANG_USE_CPU_ENGINE": "1", "HICACHE_IO_SGLANG": "1", "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(work, "torch-extensions"))}
    master = None
    from common import mooncake_problem

    mooncake = mooncake_problem()  # raises under HICACHE_REQUIRE_MOONCAKE=1 (CI)
    plain_prompts = [{"op": "generate", "name": "all", "prompts": PROMPTS}]
    first_local = os.path.join(work, "l3-page_first-kernel")
    # Two at a time, a run starting when the one two places before it ended: the restart (third)
    # starts once page_first/kernel (first), whose directory it reads, has ended.
    plan = [
        ("page_first/kernel", hicache("page_first", "kernel", ("local", first_local)), steps(l2=1, l3=2), {}),
        ("plain", {}, plain_prompts, {}),
        # sglang's HTTP server (python -m sglang.launch_server), not Engine.
        ("restart", hicache("page_first", "kernel", ("local", first_local)), [{"op": "generate", "name": "l3", "prompts": [PROMPTS[3]]}], {}),
        ("broken", hicache("page_first", "kernel", None), steps(l2=1), {"HICACHE_ENGINE_TEST_BREAK_LOADS": "1"}),
        ("linker", linker(os.path.join(work, "linker")), steps(l2=1), {"HICACHE_ENGINE_TEST_LINKER": "1"}),
        ("linker-broken", linker(os.path.join(work, "linker-broken")), steps(l2=1), {"HICACHE_ENGINE_TEST_LINKER": "1", "HICACHE_ENGINE_TEST_BREAK_LOADS": "1"}),
    ]
    for cell in LOCAL_CELLS[1:]:
        layout, io = cell.split("/")
        plan.append((cell, hicache(layout, io, ("local", os.path.join(work, f"l3-{layout}-{io}"))), steps(l2=1, l3=2), {}))
    if mooncake is None:
        from hicache_io.storage import LocalMaster

        master = LocalMaster(lease_ms=200)
        plan.append(("mooncake", hicache("page_first_direct", "direct", ("mooncake", master.address)), steps(l2=1, l3=5), {}))
    counts_of = lambda name: os.path.join(counts, stem(name))  # noqa: E731

    def start(name, engine, run_steps, env):
        os.makedirs(counts_of(name))
        spec = {"model": tiny_model, "engine": engine, "steps": run_steps, "server": name == "restart"}
        return run_driver("sglang_driver.py", spec, work, stem(name), {**base_env, "HICACHE_ENGINE_TEST_COUNTS": counts_of(name), **env})

    try:
        results = run_pairs(plan, start, lambda name, out: out.update(processes=read_counts(counts_of(name))))
    finally:
        if master is not None:
            master.stop()
    results["_mooncake"] = mooncake
    return results


def stem(name: str) -> str:
    return name.replace("/", "-")


def read_counts(folder: str) -> dict:
    """pid -> what the driver's instrumentation recorded in that process."""
    out = {}
    for f in os.listdir(folder):
        if f.endswith(".json"):
            with open(os.path.join(folder, f)) as fh:
                out[f[: -len(".json")]] = json.load(fh)
    return out


def calls(run: dict) -> dict:
    """hicache-io's op calls, summed over the run's processes, and whether the hook had
    installed hicache-io in each process that made them."""
    total: dict = {}
    for proc in run["processes"].values():
        assert proc["installed"], "hicache-io ran in a process its hook had not installed (the test must not install it)"
        for op, n in proc["calls"].items():
            total[op] = total.get(op, 0) + n
    return total


def assert_equal_tokens(runs, run: dict, name: str, prompt: int) -> None:
    got = step(run, name)["tokens"]
    assert got == expected(runs, prompt), f"{name}: tokens differ from the engine without HiCache: {got} != {expected(runs, prompt)}"


@pytest.mark.parametrize("cell", list(L2_RUNS))
def test_l2_prefix_from_host_equal_tokens(runs, cell):
    if L2_RUNS[cell] == "mooncake" and runs["_mooncake"] is not None:
        pytest.skip(runs["_mooncake"])
    run = get(runs, L2_RUNS[cell])
    assert step(run, "first")["cached"] == 0
    details = step(run, "l2")["details"]
    # Every full page of the prefix came back from the host pool, none from the device.
    assert details["host"] == PREFIX and details["device"] == 0, details
    assert_equal_tokens(runs, run, "l2", 1)
    made = calls(run)
    loads = sum(n for op, n in made.items() if op.startswith("transfer_kv_per_layer"))
    backups = sum(n for op, n in made.items() if op.startswith("transfer_kv_all_layer"))
    assert loads > 0 and backups > 0, f"hicache-io moved no load or no backup: {made}"


@pytest.mark.parametrize("cell", LOCAL_CELLS)
def test_l3_local_store_after_flush_equal_tokens(runs, cell):
    run = get(runs, cell)
    details = step(run, "l3")["details"]
    assert details["storage"] == PREFIX and details["host"] == 0 and details["device"] == 0, details
    assert details["storage_backend"] == "LocalStore"
    assert_equal_tokens(runs, run, "l3", 2)


def test_l3_local_store_from_a_new_server_process(runs):
    """``HICACHE_IO_SGLANG=1 python -m sglang.launch_server``: a new server reads what another
    engine stored. Its schedulers are spawned by sglang's server (this test's driver is not
    their main module, so nothing of the test's runs there): on CPU the prefix can only reach the
    device through the ops the hook bound (sglang's own names do not exist there)."""
    run = get(runs, "restart")
    details = step(run, "l3")["details"]
    assert details["storage"] == PREFIX, f"the new server found nothing of what the first engine stored: {details}"
    assert_equal_tokens(runs, run, "l3", 3)


def test_l3_mooncake_store_equal_tokens(runs):
    if runs["_mooncake"] is not None:
        pytest.skip(runs["_mooncake"])  # HICACHE_REQUIRE_MOONCAKE=1 made it an error above
    run = get(runs, "mooncake")  # its L2 step: test_l2_prefix_from_host_equal_tokens[page_first_direct/direct]
    details = step(run, "l3")["details"]
    assert details["storage"] == PREFIX and details["storage_backend"] == "MooncakeStore", details
    assert_equal_tokens(runs, run, "l3", 5)


def test_broken_loads_change_the_tokens(runs):
    """The negative control: the prefix still comes 'from the host' by sglang's account, but no
    byte of it lands, and the tokens differ from the engine without HiCache."""
    run = get(runs, "broken")
    assert step(run, "l2")["details"]["host"] == PREFIX
    assert step(run, "l2")["tokens"] != expected(runs, 1), "tokens equal with the loads broken: the comparison cannot fail"
    assert calls(run).get("transfer_kv_per_layer_pf_lf", 0) > 0


def test_linker_prefix_from_the_local_store_equal_tokens(runs):
    """sglang's direct L3: the prefix the fillers evicted comes back through hicache-io's linker
    (sglang reports a linker hit as "host": there is no host pool), tokens equal."""
    run = get(runs, "linker")
    assert step(run, "first")["cached"] == 0
    details = step(run, "l2")["details"]
    assert details["host"] == PREFIX and details["device"] == 0, details
    assert_equal_tokens(runs, run, "l2", 1)
    made = calls(run)
    assert made.get("linker.load", 0) > 0 and made.get("linker.offload", 0) > 0, f"the linker loaded or stored nothing: {made}"


def test_linker_broken_loads_change_the_tokens(runs):
    """Its loads copy nothing (its offloads store every page): the prefix still comes "from the
    host" by sglang's account, and the tokens differ."""
    run = get(runs, "linker-broken")
    assert step(run, "l2")["details"]["host"] == PREFIX
    assert calls(run).get("linker.load", 0) > 0
    assert step(run, "l2")["tokens"] != expected(runs, 1), "tokens equal with the linker's loads broken: the comparison cannot fail"


def test_engine_without_hicache_makes_no_transfer(runs):
    """The baseline moves no byte through hicache-io's transfer ops (HiCache off), though its
    hook serves the CPU engine's own sgl_kernel imports there."""
    assert calls(get(runs, "plain")) == {}
    assert all(s["cached"] == 0 or s["details"] is None or s["details"]["host"] == 0 for s in get(runs, "plain")["steps"])
