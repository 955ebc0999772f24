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


def require_mooncake() -> None:
    """Module-level guard of the storage tests: :func:`common.mooncake_problem` (python/tests)."""
    import pytest
    from common import mooncake_problem

    try:
        problem = mooncake_problem()  # raises under HICACHE_REQUIRE_MOONCAKE=1
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"HICACHE_REQUIRE_MOONCAKE=1 but Mooncake Store not importable ({type(e).__name__}: {e})") from e
    if problem is not None:
        pytest.skip(problem, allow_module_level=True)
