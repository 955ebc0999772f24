"""Hostile arrays from Python, property-based (hypothesis, a fixed budget of examples, derandomized
so CI runs the same cases): the ``kvcacheio`` ops, the one-layer JIT names and a host pool's page helper,
called with arrays that are non-contiguous, negatively strided, broadcast (stride 0), Fortran
order, zero-sized, of another dtype, read-only, torch tensors, on torch's ``meta`` device, views of
numpy arrays and torch storages resized since (their memory given back), and index arrays of other
dtypes, NaN converted to int64, huge, short, with a repeated destination, strided or empty. Each
call must raise a typed error with no byte changed, or move exactly the bytes an oracle on the
arguments' logical values predicts and write nothing else (``hostile_worker.py`` says how). Calls
run in a worker process: one that crashes the interpreter fails the test with its case. Every
other op of the catalogue gets hostile arrays in every array position: no crash, no guard byte
written."""

import json
import os
import select
import subprocess
import sys
import tempfile

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import hostile_worker as hw  # noqa: E402
from common import child_env  # noqa: E402
from hicache_io import kvcacheio as kv  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
#: Examples per property (fixed, so that CI's time is too).
BUDGET = int(os.environ.get("HICACHE_HOSTILE_EXAMPLES", "300"))


#: The longest one call may take (a hang is a finding too).
CALL_TIMEOUT_S = 60


class Worker:
    """The worker process, started again after a crash or a hang; its stderr goes to a file."""

    def __init__(self):
        self.proc, self.err = None, None

    def ask(self, case):
        if self.proc is None or self.proc.poll() is not None:
            env = child_env()
            self.err = tempfile.TemporaryFile(mode="w+")
            self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "hostile_worker.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True, env=env)
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], CALL_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            rc = self.proc.wait()
            self.err.seek(0)
            err = self.err.read()[-2000:]
            self.proc = None
            return {"verdict": f"the worker died or hung (status {rc}): {err}"}
        return json.loads(line)

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


data_form = st.sampled_from(hw.DATA_FORMS)
index_form = st.sampled_from(hw.INDEX_FORMS)
ARGS = {"per_layer_mla": "ddii", "per_layer_mha": "ddddii", "all_layer_mla": "ddii", "jit_one_layer_mla": "ddii", "jit_one_layer": "ddddii", "embedding_ranges": "ddiii"}


#: Positions of the arrays each op reads (the others it writes).
SOURCES = {"per_layer_mla": {0}, "per_layer_mha": {0, 1}, "all_layer_mla": {0}, "jit_one_layer_mla": {0}, "jit_one_layer": {0, 1}, "embedding_ranges": {0}}


def accepted_forms(op, i):
    """The forms argument ``i`` of ``op`` is taken in as it is (a refusal of these is a defect)."""
    if ARGS[op][i] == "i":
        # (embedding ranges take plain sequences of ints, as sglang passes them: not torch tensors)
        return {"int64", "list"} | ({"torch"} if op != "embedding_ranges" else set()) | ({"int32"} if op.startswith("jit_") else set())
    return {"contig", "torch"} | ({"readonly"} if i in SOURCES[op] else set())


@st.composite
def cases(draw):
    op = draw(st.sampled_from(sorted(ARGS) + ["page_helpers"]))
    rows = draw(st.sampled_from([4, 16, 64]))
    if op == "page_helpers":
        forms = [draw(data_form), draw(st.sampled_from(["aligned", "unaligned", "huge"]))]
    else:
        forms = [draw(data_form) if k == "d" else draw(index_form) for k in ARGS[op]]
    # Mostly one hostile argument, so that the others cannot hide it behind an earlier refusal.
    if op != "page_helpers" and draw(st.booleans()):
        keep = draw(st.integers(0, len(forms) - 1))
        forms = [f if i == keep else ("contig" if ARGS[op][i] == "d" else "int64") for i, f in enumerate(forms)]
    return {"op": op, "seed": draw(st.integers(0, 2**32 - 1)), "rows": rows, "elems": draw(st.sampled_from([4, 8, 64])), "n": draw(st.integers(1, rows)), "forms": forms}


@settings(max_examples=BUDGET, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=cases())
def test_hostile_arrays_raise_or_move_exactly(worker, case):
    out = worker.ask(case)
    assert out["verdict"] == "ok", (case, out)
    # Well-formed calls, and forms the ops take as they are, must not be refused: torch arrays,
    # read-only sources, index lists, int32 indices for the JIT name.
    if case["op"] != "page_helpers" and all(f in accepted_forms(case["op"], i) for i, f in enumerate(case["forms"])):
        assert out["raised"] is None, ("a well-formed call was refused", case, out)


@settings(max_examples=BUDGET, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_every_catalogue_op_survives_hostile_arrays(worker, data):
    spec = data.draw(st.sampled_from([c for c in kv.CATALOGUE if c["name"] != "get_device_accessible_ptr"]))
    forms = []
    for _name, kind in spec["args"]:
        if kind == "Int":
            forms.append(data.draw(st.sampled_from([0, 1, 2, 8, 16, -1, 1 << 40, -(1 << 62)])))
        elif kind in ("Idx", "HostIdx", "Ints"):
            forms.append(data.draw(index_form))
        else:
            forms.append(data.draw(data_form))
    case = {"smoke": True, "op": spec["name"], "seed": data.draw(st.integers(0, 2**32 - 1)), "forms": forms}
    out = worker.ask(case)
    assert out["verdict"] == "ok", (case, out)


def test_the_worker_catches_what_it_must():
    """The harness can fail: a call that writes through a stale view is reported (the worker's
    oracle refuses it, and the call must raise), and a wrong prediction is reported."""
    w = Worker()
    try:
        for form in ("stale", "torch_stale"):
            if form == "torch_stale" and hw.torch is None:
                continue
            out = w.ask({"op": "per_layer_mla", "seed": 1, "rows": 64, "elems": 64, "n": 8, "forms": ["contig", form, "int64", "int64"]})
            assert out["verdict"] == "ok" and out["raised"], out  # refused, nothing written
        out = w.ask({"op": "per_layer_mla", "seed": 1, "rows": 16, "elems": 8, "n": 4, "forms": ["contig", "contig", "int64", "int64"]})
        assert out == {"verdict": "ok", "raised": None}, out
    finally:
        w.close()
