"""vLLM 0.33.0's own classes driving hicache-io (its scheduler, connector, manager, tiers).

These run where vLLM 0.33.0 is installed (CI: a venv of its own, layered on the sglang suite's
for torch; see ``requirements.txt``) and skip elsewhere, unless ``HICACHE_REQUIRE_VLLM=1``
(CI sets it), which makes a missing or different vLLM an error."""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402


def _problem():
    try:
        import hicache_io.vllm  # noqa: F401
    except ImportError as e:
        if os.environ.get("HICACHE_REQUIRE_VLLM") == "1":
            raise
        return str(e)
    return None


PROBLEM = _problem()


def pytest_collection_modifyitems(config, items):
    if PROBLEM is None:
        return
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason=f"vLLM 0.33.0 not usable here: {PROBLEM}")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)
