"""Whether this suite can run here: torch and sglang 0.5.23 importable (and, for the storage
tests, Mooncake Store). Without them every module skips, unless HICACHE_REQUIRE_SGLANG=1 /
HICACHE_REQUIRE_MOONCAKE=1 asks for a loud failure instead (CI sets them)."""

from __future__ import annotations

import os

SGLANG_VERSION = "0.5.23"


def sglang_problem() -> str | None:
    """None when torch and sglang 0.5.23 import, else why not."""
    try:
        import torch  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"torch not importable ({type(e).__name__}: {e})"
    try:
        import importlib.metadata

        version = importlib.metadata.version("sglang")
    except Exception as e:  # noqa: BLE001
        return f"sglang not installed ({type(e).__name__}: {e})"
    if version != SGLANG_VERSION:
        return f"sglang {version} installed; this suite drives sglang {SGLANG_VERSION}"
    try:
        import sglang  # noqa: F401  (not its pool modules: install() goes first)
    except Exception as e:  # noqa: BLE001
        return f"sglang {version} does not import ({type(e).__name__}: {e})"
    return None


def require_sglang() -> None:
    """Module-level guard of each test module."""
    import pytest

    problem = sglang_problem()
    if problem is None:
        return
    if os.environ.get("HICACHE_REQUIRE_SGLANG") == "1":
        raise RuntimeError(f"HICACHE_REQUIRE_SGLANG=1 but {problem}")
    pytest.skip(problem, allow_module_level=True)


def mooncake_problem() -> str | None:
    try:
        from hicache_io.l3.mooncake_client import store_module

        store_module()
    except Exception as e:  # noqa: BLE001
        return f"Mooncake Store not importable ({type(e).__name__}: {e})"
    return None


def require_mooncake() -> None:
    import pytest

    problem = mooncake_problem()
    if problem is None:
        return
    if os.environ.get("HICACHE_REQUIRE_MOONCAKE") == "1":
        raise RuntimeError(f"HICACHE_REQUIRE_MOONCAKE=1 but {problem}")
    pytest.skip(problem, allow_module_level=True)
