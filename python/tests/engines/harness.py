"""Helpers of the engine tests: real engines generating tokens on CPU with hicache-io underneath (sglang 0.5.23's ``Engine``,
vLLM 0.33.0's ``LLM``), each in a subprocess with a timeout (sglang kills its parent when a
scheduler fails).

These need an engine's full CPU stack (see ``requirements.txt`` here and the README's test
section). Where it is absent every test here skips with the reason; ``HICACHE_REQUIRE_ENGINES``
(CI sets it) makes that a failure instead."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from typing import Callable


HERE = os.path.dirname(os.path.abspath(__file__))
#: Engines whose tests must run (``HICACHE_REQUIRE_ENGINES=sglang,vllm``; CI sets it in the pass of
#: each engine's venv): there a missing prerequisite fails instead of skipping.
REQUIRED = {e.strip() for e in os.environ.get("HICACHE_REQUIRE_ENGINES", "").split(",") if e.strip()}


def problem_or_skip(problem: "str | None", engine: "str | None" = None) -> None:
    """Skips the calling test (or fixture) for ``problem``; fails instead when ``engine`` (any
    engine, for ``None``) is required."""
    if problem is None:
        return
    import pytest

    if (engine in REQUIRED) if engine is not None else bool(REQUIRED):
        pytest.fail(f"HICACHE_REQUIRE_ENGINES={','.join(sorted(REQUIRED))} but {problem}", pytrace=False)
    pytest.skip(problem)


def missing_modules(names) -> "list[str]":
    return [n for n in names if importlib.util.find_spec(n) is None]


class DriverFailed(AssertionError):
    pass


def run_driver(script: str, spec: dict, workdir: str, name: str, env: dict, timeout: float = 240, python: str = sys.executable) -> "subprocess.Popen":
    """Starts ``script`` (a driver beside this file) on ``spec`` with ``python`` in a process
    (and session) of its own; collect its output with :func:`collect`."""
    spec_path = os.path.join(workdir, f"{name}.spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    out = os.path.join(workdir, f"{name}.out.json")
    log = open(os.path.join(workdir, f"{name}.log"), "w")
    # The venv's bin first: sglang finds ninja there for its extension build.
    path = os.path.dirname(python) + os.pathsep + os.environ.get("PATH", "")
    full_env = {**os.environ, "PATH": path, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **env}
    proc = subprocess.Popen([python, os.path.join(HERE, script), spec_path, out], cwd=workdir, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc._hicache = (name, out, log, time.monotonic(), timeout)  # type: ignore[attr-defined]
    return proc


def collect(proc: "subprocess.Popen") -> dict:
    """Waits for a driver; its JSON output, or :class:`DriverFailed` with the log's tail."""
    name, out, log, t0, timeout = proc._hicache  # type: ignore[attr-defined]
    try:
        rc = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        rc = "timeout"
    # The engine's own processes (sglang's scheduler, detokenizer) go with it, whatever the end:
    # left running they would slow the engines after them.
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    proc.wait()
    log.close()
    if rc != 0 or not os.path.exists(out):
        with open(log.name) as f:
            tail = "".join(line for line in f.readlines() if "Ignore import error" not in line)[-6000:]
        raise DriverFailed(f"engine run {name!r} failed ({rc}); its log ends:\n{tail}")
    with open(out) as f:
        result = json.load(f)
    result["log"] = log.name
    return result


def run_pairs(plan: list, start: Callable[..., "subprocess.Popen"], after: "Callable[[str, dict], None] | None" = None) -> dict:
    """Runs ``start(*entry)`` for each entry of ``plan`` (``(name, ...)``), two engines at a time
    (each is mostly one busy thread), in order: a run starts once every run two places before
    it ended. Returns name -> the driver's output, or ``{"error": ...}`` for a run that failed
    (:func:`get` raises it in the tests that read the run); ``after(name, output)`` runs on each
    output."""
    results: dict = {}
    started: list = []

    def finish(n: int) -> None:
        while len(started) > n:
            name, proc = started.pop(0)
            try:
                results[name] = collect(proc)
            except DriverFailed as e:
                results[name] = {"error": str(e)}
                continue
            if after is not None:
                after(name, results[name])

    for entry in plan:
        finish(1)
        started.append((entry[0], start(*entry)))
    finish(0)
    return results


def get(runs: dict, name: str) -> dict:
    """Run ``name``'s output; :class:`DriverFailed` (with its log) for a run that failed."""
    run = runs[name]
    if "error" in run:
        raise DriverFailed(run["error"])
    return run


def step(run: dict, name: str) -> dict:
    """The one step of ``run`` named ``name``."""
    (found,) = [s for s in run["steps"] if s["name"] == name]
    return found


def expected(runs: dict, prompt: int) -> list:
    """The tokens the engine without hicache-io gave prompt ``prompt`` (the ``plain`` run: one
    step a prompt, in order)."""
    return get(runs, "plain")["steps"][prompt]["tokens"]


def site_file(name: str) -> "str | None":
    path = os.path.join(sysconfig.get_paths()["purelib"], name)
    return path if os.path.exists(path) else None


def toolchain_problem() -> "str | None":
    """sglang builds its page-hash extension with torch's cpp_extension at first use: without
    ninja, g++ or OpenSSL's headers its L3 keys never match (pages written, never found)."""
    if shutil.which("ninja") is None and shutil.which("ninja", path=os.path.dirname(sys.executable)) is None:
        return "ninja not on PATH (sglang's page-hash extension cannot build)"
    if shutil.which("g++") is None:
        return "g++ not installed (sglang's page-hash extension cannot build)"
    if not os.path.exists("/usr/include/openssl/sha.h"):
        return "OpenSSL headers missing (Debian libssl-dev: sglang's page-hash extension includes them)"
    return None
