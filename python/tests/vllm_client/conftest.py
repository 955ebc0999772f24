"""vLLM's own classes driving hicache-io (its scheduler, connector, manager, tiers), on 0.33.0
and on 0.34.0.

These run where one of those is installed (CI: a venv of its own for each, layered on the sglang
suite's for torch; see ``requirements.txt``) and skip elsewhere, unless
``HICACHE_REQUIRE_VLLM=1`` (or a version: CI sets ``0.33.0`` and ``0.34.0`` in its two passes),
which makes a missing or unsupported vLLM (or another version than named) an error."""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402


def _problem():
    required = os.environ.get("HICACHE_REQUIRE_VLLM", "")  # "1", or the version that must be found
    required = "" if required == "0" else required
    try:
        import hicache_io.vllm  # noqa: F401
    except ImportError as e:
        if required:
            raise
        return str(e)
    if required not in ("", "1") and hicache_io.vllm.VLLM_VERSION != required:
        raise RuntimeError(f"HICACHE_REQUIRE_VLLM={required}, but vLLM {hicache_io.vllm.VLLM_VERSION} is installed")
    if hicache_io.vllm.VLLM_VERSION != "0.33.0":
        # vLLM 0.34 refuses an x86 CPU without triton-cpu (no registry here serves it) in its
        # config check; these tests run its scheduler, connector and manager, no kernel.
        import vllm.triton_utils

        vllm.triton_utils.HAS_TRITON = True
    return None


PROBLEM = _problem()


def pytest_collection_modifyitems(config, items):
    if PROBLEM is None:
        return
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason=f"vLLM 0.33.0 or 0.34.0 not usable here: {PROBLEM}")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)
