"""``HICACHE_IO_SGLANG=1``: the hook the wheel installs (``hicache_io_sglang.pth``) makes a fresh
process's sglang hicache-io's as its modules load, with no call of the process's own; without the
variable nothing happens. And the CPU engine's ``sgl_kernel`` stand-in against a reference.

The engine itself runs on the hook in ``python/tests/engines``; these check its pieces in a bare
interpreter, one subprocess each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

import pytest

from . import _env

_env.require_sglang()

import torch  # noqa: E402

PROBE = r"""
import json, sys
import sglang.srt.mem_cache.pool_host.mha as mha
import sglang.srt.mem_cache.pool_host.common as common
import hicache_io.kvcacheio as kvcacheio
import hicache_io.sglang as hs
from hicache_io import _sglang_hook
import sgl_kernel
print(json.dumps({
    "hooked": any(getattr(f, _sglang_hook.MARK, False) for f in sys.meta_path),
    "installed": hs.installed() is not None,
    "mha_op": getattr(mha, "transfer_kv_per_layer", None) is kvcacheio.transfer_kv_per_layer,
    "register_noop": common._cuda_host_register.__module__ == "hicache_io.sglang_cpu",
    "stand_in": hasattr(sgl_kernel, "assign_req_to_token_pool_cpu"),
    "report": sorted(_sglang_hook.report()),
}))
"""


def probe(env_value):
    env = {k: v for k, v in os.environ.items() if k != "HICACHE_IO_SGLANG"}
    if env_value is not None:
        env["HICACHE_IO_SGLANG"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        return {"error": out.stderr[-3000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def pth():
    path = os.path.join(sysconfig.get_paths()["purelib"], "hicache_io_sglang.pth")
    if not os.path.exists(path):
        if os.environ.get("HICACHE_REQUIRE_SGLANG") == "1":
            pytest.fail(f"{path} missing: the wheel installs it")
        pytest.skip("hicache_io_sglang.pth is not installed (an editable or source-tree hicache_io): install the wheel")
    return path


def test_the_variable_makes_a_fresh_process_sglang_hicache_ios(pth):
    got = probe("1")
    assert "error" not in got, got.get("error")
    assert got["hooked"] and got["installed"], got
    assert got["mha_op"], "the pool module's guarded ops were not bound to hicache-io's"
    assert got["register_noop"] == (not torch.cuda.is_available())
    assert got["stand_in"]
    assert "sglang" in got["report"] and "sglang.srt.mem_cache.pool_host.mha" in got["report"]


def test_without_the_variable_nothing_happens(pth):
    got = probe(None)
    # Without hicache-io, sglang's CPU path cannot even import its pool modules (no sgl_kernel).
    assert "error" in got and "sgl_kernel" in got["error"], got


def reference_assign(req_pool_indices, req_to_token, start, end, out_cache_loc):
    offset = 0
    for row, s, e in zip(req_pool_indices.tolist(), start.tolist(), end.tolist()):
        for t in range(s, e):
            req_to_token[row, t] = out_cache_loc[offset]
            offset += 1


def test_assign_req_to_token_pool_cpu_matches_the_kernels_definition():
    from hicache_io.sglang_cpu import assign_req_to_token_pool_cpu

    g = torch.Generator().manual_seed(3)
    rows, pool_len = 6, 64
    req = torch.tensor([4, 1, 5], dtype=torch.int64)
    start = torch.tensor([0, 10, 63], dtype=torch.int64)
    end = torch.tensor([7, 10, 64], dtype=torch.int64)
    loc = torch.randint(0, 1 << 20, (8,), generator=g, dtype=torch.int64)
    got = torch.full((rows, pool_len), -1, dtype=torch.int32)
    want = got.clone()
    assign_req_to_token_pool_cpu(req, got, start, end, loc, pool_len)
    reference_assign(req, want, start, end, loc)
    assert torch.equal(got, want)
    # Out of range or too few slots: refused before anything is written.
    for bad in ((req, start, torch.tensor([7, 10, 65])), (torch.tensor([4, 1, 6]), start, end)):
        before = got.clone()
        with pytest.raises(ValueError):
            assign_req_to_token_pool_cpu(bad[0], got, bad[1], bad[2], loc, pool_len)
        assert torch.equal(got, before)
    with pytest.raises(ValueError):
        assign_req_to_token_pool_cpu(req, got, start, end, loc[:7], pool_len)
