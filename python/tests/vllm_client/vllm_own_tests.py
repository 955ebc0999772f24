"""A pytest plugin for vLLM 0.33.0's and 0.34.0's own offloading tests (from its sdist, fetched at test time by
``scripts/fetch-vllm-tests.py``): every connector those tests build with their mock spec gets
``HicacheOffloadingSpec`` instead, wherever a test would let vLLM's scheduler and connector drive
a real spec.

    cd vllm-0.33.0 && python -m pytest -p vllm_own_tests tests/v1/kv_connector/unit/offloading_connector

(with this folder on ``PYTHONPATH``). The tests that cannot take a real spec are deselected,
each group with its reason (printed), and the run says how many times vLLM's code built the spec
and its worker.

What it found for 0.33.0 (``docs/vllm.md``): every test of the connector suite that builds a spec
scripts vLLM's mock manager or reads the mock worker's log (128 tests); the other 588 pass and
never build one. So vLLM's own suite cannot exercise a real spec; ``test_engine.py`` here drives
vLLM's real scheduler, connector and manager with this spec instead.

vLLM's tests read ``facebook/opt-125m``'s ``config.json`` through the Hugging Face cache: a stub
of it is written into a temporary ``HF_HOME`` (offline) unless ``HF_HOME`` is set."""

import json
import os
import tempfile

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "HF_HOME" not in os.environ:
    _home = tempfile.mkdtemp(prefix="hicache-io-hf-")
    _repo = os.path.join(_home, "hub", "models--facebook--opt-125m")
    _snap = os.path.join(_repo, "snapshots", "0" * 40)
    os.makedirs(_snap)
    os.makedirs(os.path.join(_repo, "refs"))
    with open(os.path.join(_repo, "refs", "main"), "w") as f:
        f.write("0" * 40)
    with open(os.path.join(_snap, "config.json"), "w") as f:
        # The model's shape as its config states it (vLLM reads sizes, not weights).
        json.dump(
            {"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768, "num_attention_heads": 12, "num_hidden_layers": 12, "ffn_dim": 3072,
             "max_position_embeddings": 2048, "vocab_size": 50272, "word_embed_proj_dim": 768, "do_layer_norm_before": True, "torch_dtype": "float16",
             "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1},
            f,
        )
    os.environ["HF_HOME"] = _home

import pytest  # noqa: E402


def pytest_configure(config):
    import vllm

    if vllm.__version__ != "0.33.0":
        # vLLM 0.34 refuses an x86 CPU without triton-cpu in its config check; these tests run
        # no kernel.
        import vllm.triton_utils

        vllm.triton_utils.HAS_TRITON = True

#: Tests that cannot take a real spec, by what they need (matched on the test's fixtures or
#: its file).
MOCK_ONLY = {
    "request_runner": "asserts the scheduler's manager is a MagicMock and scripts it (prepare_store.side_effect, lookup.return_value, call counts); reads the mock worker's transfer log",
}
MOCK_FILES = {
    "test_worker.py": "drives OffloadingConnectorWorker with a MagicMock spec and worker",
    "test_gpu_worker.py": "vLLM's own CPU<->GPU handler: asserts CUDA or XPU tensors",
}

built = {"specs": 0, "workers": 0}


def _spec_cls():
    from hicache_io.vllm import HicacheOffloadingSpec

    class CountedSpec(HicacheOffloadingSpec):
        """``HicacheOffloadingSpec`` with the CPU budget the mock's tests do not give."""

        def __init__(self, config):
            config.extra_config.setdefault("cpu_bytes_to_use", 64 << 20)
            super().__init__(config)
            built["specs"] += 1

        def get_worker(self, kv_caches):
            w = super().get_worker(kv_caches)
            built["workers"] += 1
            return w

    return CountedSpec


@pytest.fixture(autouse=True)
def _hicache_spec(monkeypatch):
    # vLLM's factory looks a spec name up in its registry before its module path.
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    monkeypatch.setitem(OffloadingSpecFactory._registry, "MockOffloadingSpec", _spec_cls)
    yield


#: Tests that script the mock manager in their own body (0.34's lookahead tests), by the source.
MOCK_SCRIPTED = "scripts the scheduler's mock manager in its body (manager.<method>.side_effect / return_value, also through _as_mock)"


def _scripts_manager(item) -> bool:
    import inspect
    import re

    try:
        src = inspect.getsource(getattr(item, "function", None) or (lambda: None))
    except (OSError, TypeError):
        return False
    return re.search(r"manager\)?\.\w+\.(side_effect|return_value)", src) is not None


def pytest_collection_modifyitems(config, items):
    keep, dropped = [], {}
    for item in items:
        reason = next((why for fx, why in MOCK_ONLY.items() if fx in getattr(item, "fixturenames", ())), None)
        reason = reason or MOCK_FILES.get(os.path.basename(str(item.fspath)))
        reason = reason or (MOCK_SCRIPTED if _scripts_manager(item) else None)
        if reason:
            dropped.setdefault(reason, []).append(item)
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=[i for v in dropped.values() for i in v])
        items[:] = keep
        for why, its in dropped.items():
            print(f"hicache-io: {len(its)} vLLM tests cannot take a real spec ({why})")


def pytest_sessionfinish(session, exitstatus):
    print(f"\nhicache-io: HicacheOffloadingSpec built {built['specs']} times, its worker {built['workers']} times by vLLM's tests")
