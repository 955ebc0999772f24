"""Session setup: hicache_io.sglang.install() and the CPU shims, once, when this conftest is
imported (before pytest imports the test modules, which import sglang's pool modules).

Where torch or sglang 0.5.23 cannot be imported nothing is installed and every test module
skips itself (see _env.py); HICACHE_REQUIRE_SGLANG=1 turns that into a failure here."""

from __future__ import annotations

import os
import sys

import pytest

from . import _env

PROBLEM = _env.sglang_problem()
if PROBLEM is not None and os.environ.get("HICACHE_REQUIRE_SGLANG") == "1":
    raise RuntimeError(f"HICACHE_REQUIRE_SGLANG=1 but {PROBLEM}")

INSTALL_REPORT = None
SHIM_REPORT = None
if PROBLEM is None:
    import hicache_io.sglang

    INSTALL_REPORT = hicache_io.sglang.install()
    from . import cpu_shims

    SHIM_REPORT = cpu_shims.apply()


@pytest.fixture(autouse=True)
def _restore_sglang_state():
    """Every test starts and ends with sglang's CPU flags (S4/S5 off) and the pool modules'
    names bound to hicache-io's functions (no recorder left behind)."""
    if PROBLEM is not None:
        yield
        return
    from . import cpu_shims

    cpu_shims.reset_paths()
    yield
    cpu_shims.reset_paths()
    from .harness import POOL_MODULES

    for name in POOL_MODULES:
        mod = sys.modules.get(name)
        if mod is None:
            continue
        for attr, value in vars(mod).items():
            assert not hasattr(value, "__spied__"), f"{name}.{attr} still wrapped by a Spy"


def pytest_report_header(config):
    if PROBLEM is not None:
        return f"sglang_client: skipped ({PROBLEM})"
    return f"sglang_client: hicache_io.sglang.install() -> sglang {INSTALL_REPORT['sglang']}, sgl_kernel: {INSTALL_REPORT['sgl_kernel']}, jit: {INSTALL_REPORT['jit']}, {len(INSTALL_REPORT['torch_ops'])} torch ops"


@pytest.fixture
def local(tmp_path):
    """``make(cls=LinkedTree, extra={...}, **kw)``: a linked tree (``linker_tree.LinkedTree``
    or a subclass) on the local store in ``tmp_path / "l3"``, closed after the test."""
    from .linker_tree import LinkedTree

    trees = []

    def make(cls=LinkedTree, **kw):
        extra = {"store": "local", "path": str(tmp_path / "l3"), **kw.pop("extra", {})}
        trees.append(cls(extra, **kw))
        return trees[-1]

    yield make
    for t in trees:
        t.close()
