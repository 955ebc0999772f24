"""The engine tests' shared fixture: the tiny model, made once per session."""

from __future__ import annotations

import os

import pytest

from .harness import missing_modules, problem_or_skip


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The tiny Llama (``model.py``), made once per session (or kept in
    ``$HICACHE_ENGINE_MODELS`` between sessions)."""
    problem_or_skip(None if not missing_modules(["torch", "transformers", "safetensors"]) else "torch, transformers or safetensors not installed")
    from . import model

    root = os.environ.get("HICACHE_ENGINE_MODELS") or str(tmp_path_factory.mktemp("models"))
    return model.build(os.path.join(root, "tiny-llama"))


