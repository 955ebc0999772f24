"""hicache_io.sglang.install() itself, checked through sglang 0.5.23's own code.

The two failures that used to stop sglang at the door:
(a) sglang's host pools, with its CUDA code paths, call
    ``can_use_hicache_jit_kernel(page_size=..., element_size=...)``; hicache-io's probe lacked the
    ``page_size`` keyword (TypeError at pool construction).
(b) hicache-io's MooncakeStore.register_mem_pool_host on a real sglang pool passed a Python list
    to sglang's ``get_page_buffer_meta``, which calls ``.tolist()`` on it. Covered against a real
    Mooncake master in test_storage.py (every get_page_buffer_meta call recorded there); here with
    a recording stand-in for the Mooncake client, so it runs without Mooncake too.
"""

from ._env import require_sglang

require_sglang()

import ast  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import importlib.metadata  # noqa: E402
import inspect  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import hicache_io  # noqa: E402
import hicache_io.sglang  # noqa: E402
from hicache_io import hicache, kvcacheio  # noqa: E402

from . import cpu_shims  # noqa: E402
from . import sgl_pools as sp  # noqa: E402
from .harness import POOL_MODULES, check_equal  # noqa: E402

JIT_MODULE = "sglang.kernels.ops.kvcache.hicache"


def test_install_report_and_sgl_kernel_module():
    report = hicache_io.sglang.installed()
    assert report is not None and report["sglang"] == "0.5.23"
    assert sys.modules["sgl_kernel.kvcacheio"] is kvcacheio
    assert sys.modules["sgl_kernel"].kvcacheio is kvcacheio
    assert hicache_io.sglang.install() == report  # idempotent


def _jit_imports(module) -> list[tuple[str, str, object]]:
    """(name, bound_as, hicache-io's function) of every import from a JIT module hicache-io
    serves in module: `sglang.kernels.ops.kvcache.hicache` (hicache_io.hicache) and the modules
    of ``hicache_io.sglang.JIT_OPS`` (the Mamba state copies: hicache_io.kvcacheio)."""
    served = {JIT_MODULE: hicache, **{m: kvcacheio for m in hicache_io.sglang.JIT_OPS}}
    tree = ast.parse(inspect.getsource(module))
    return [
        (a.name, a.asname or a.name, getattr(served[n.module], a.name))
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module in served
        for a in n.names
    ]


@pytest.mark.parametrize("module", POOL_MODULES, ids=lambda m: m.rsplit(".", 1)[-1])
def test_pool_modules_bind_hicache_io_jit_functions(module):
    """Every JIT name a pool module imports (aliases included: `... as jit_X`) is hicache-io's."""
    mod = sys.modules[module]
    pairs = _jit_imports(mod)
    assert pairs, f"{module} imports nothing from a JIT module hicache-io serves?"
    for name, bound, ours in pairs:
        assert getattr(mod, bound) is ours, f"{module}.{bound} is not hicache-io's {name}"


def test_jit_module_is_hicache_io():
    jit = sys.modules[JIT_MODULE]
    for name in hicache_io.sglang.JIT_NAMES:
        assert getattr(jit, name) is getattr(hicache, name), name
    assert jit.use_hicache_tma_kernel(element_size=256, block_quota=4, page_size=64) is False


@pytest.mark.parametrize("module", cpu_shims.AOT_MODULES, ids=lambda m: m.rsplit(".", 1)[-1])
def test_aot_names_are_hicache_io(module):
    """S2 re-ran each module's `if _is_cuda: from sgl_kernel.kvcacheio import ...`: every name it
    imports is hicache_io.kvcacheio's."""
    mod = sys.modules[module]
    names = [a.name for stmt in cpu_shims.guarded_aot_imports(mod) for a in stmt.names]
    assert names
    for name in names:
        assert getattr(mod, name) is getattr(kvcacheio, name), f"{module}.{name}"


def test_s2_covers_every_guarded_kvcacheio_import_in_mem_cache():
    """Guard against a new sglang module importing the AOT ops behind `_is_cuda`: S2 must know it."""
    import sglang.srt.mem_cache as mem_cache

    root = pathlib.Path(list(mem_cache.__path__)[0])
    found = set()
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.If) and "_is_cuda" in {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}:
                if any(isinstance(s, ast.ImportFrom) and s.module == "sgl_kernel.kvcacheio" for s in node.body):
                    found.add("sglang.srt.mem_cache." + ".".join(path.relative_to(root).with_suffix("").parts))
    assert found == set(cpu_shims.AOT_MODULES)


def test_torch_ops_that_sglang_gates_on():
    """sglang checks hasattr(torch.ops.sgl_kernel, ...) before using these two."""
    assert hasattr(torch.ops.sgl_kernel, "get_device_accessible_ptr")
    assert hasattr(torch.ops.sgl_kernel, "transfer_embedding_ranges_direct")
    t = torch.zeros(16, dtype=torch.uint8)
    # no CUDA device here: a host tensor's own address
    assert torch.ops.sgl_kernel.get_device_accessible_ptr(t[4:], 0) == t.data_ptr() + 4
    g = sp.gen(5)
    src = torch.randint(0, 256, (10, 74), dtype=torch.uint8, generator=g)  # 74-byte rows
    dst = torch.randint(0, 256, (12, 74), dtype=torch.uint8, generator=g)
    expected = dst.clone()
    for s, d, n in ((0, 5, 2), (7, 0, 3), (3, 9, 1)):
        expected[d : d + n] = src[s : s + n]
    torch.ops.sgl_kernel.transfer_embedding_ranges_direct(src, dst, [0, 7, 3], [5, 0, 9], [2, 3, 1])
    check_equal("transfer_embedding_ranges_direct", dst, expected)


def test_sglang_pointer_tables():
    """sglang's make_kernel_ptr_table and its get_device_accessible_ptr resolution."""
    from sglang.srt.mem_cache.pool_host import common

    with cpu_shims.sglang_paths(cuda=True):
        host = sp.mha_host(sp.mha_device(), "page_first")
    views = list(host.k_data_refs)  # the strided per-layer views of the page_first buffer
    table = common.make_kernel_ptr_table(views, "cpu", host_memory_registered=True)
    assert table.dtype == torch.uint64 and table.tolist() == [v.data_ptr() for v in views]
    common._resolve_device_accessible_ptr_fn.cache_clear()
    assert common._resolve_device_accessible_ptr_fn() is kvcacheio.get_device_accessible_ptr


def test_embedding_cache_controller_binds_transfer_embedding_ranges_direct():
    try:
        mod = importlib.import_module("sglang.srt.mem_cache.embedding_cache_controller")
    except ImportError as e:
        # requirements.txt has what it imports (openai, partial-json-parser); CI must run it.
        if os.environ.get("HICACHE_REQUIRE_SGLANG") == "1":
            raise
        pytest.skip(f"sglang's embedding cache controller does not import here: {e}")
    assert mod.transfer_embedding_ranges_direct is kvcacheio.transfer_embedding_ranges_direct


# --------------------------------------------------------------------------------- (a) page_size keyword


def test_probe_signature_takes_sglang_keywords():
    params = inspect.signature(hicache.can_use_hicache_jit_kernel).parameters
    assert {"element_size", "page_size", "unroll", "block_quota"} <= set(params)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pools_build_with_cuda_paths(kind):
    """(a): sglang's own host pools, CUDA paths on, call hicache-io's probe with page_size=: the
    pools build and take the JIT route."""
    module = sys.modules[f"sglang.srt.mem_cache.pool_host.{kind}"]
    probe = module.can_use_hicache_jit_kernel
    assert probe is hicache.can_use_hicache_jit_kernel
    calls = []

    def recorder(**kwargs):
        calls.append(kwargs)
        return probe(**kwargs)

    module.can_use_hicache_jit_kernel = recorder
    try:
        with cpu_shims.sglang_paths(cuda=True):
            host = sp.mha_host(sp.mha_device(), "page_first") if kind == "mha" else sp.mla_host(sp.mla_device(), "page_first")
    finally:
        module.can_use_hicache_jit_kernel = probe
    assert host.can_use_jit is True
    assert calls and all(set(c) >= {"page_size", "element_size"} for c in calls), calls
    assert calls[0]["page_size"] == sp.P


def test_probe_decides_the_route():
    """With sglang's CUDA paths on, hicache-io's probe decides: 8-byte rows (its minimum) go
    through the JIT names, bytes checked."""
    with cpu_shims.sglang_paths(cuda=True, device_kernels=False):
        res = sp.run_mha("layer_first", "kernel", head_num=1, head_dim=4, seed=4)
    assert res["can_use_jit"] is True
    assert (res["backup_calls"], res["load_calls"]) == (["jit_transfer_hicache_all_layer"], ["jit_transfer_hicache_one_layer"])


def test_rows_the_probe_refuses_fall_back_to_the_aot_op():
    """12-byte rows: the probe says no, so sglang calls the AOT op, which refuses them with
    sgl-kernel's own message (item sizes are multiples of 8 there too) and moves nothing."""
    from .harness import Spy, snapshot

    with cpu_shims.sglang_paths(cuda=True, device_kernels=False):
        dev = sp.mha_device(head_num=1, head_dim=6)
        host = sp.mha_host(dev, "layer_first")
    assert host.can_use_jit is False
    before = snapshot([host.kv_buffer])[0]
    h = host.alloc(2 * sp.P)
    with Spy() as spy, pytest.raises(RuntimeError, match="Item byte size must be divisible by 8"):
        host.backup_from_device_all_layer(dev, h, torch.arange(sp.P, 3 * sp.P, dtype=torch.int64), "kernel")
    assert spy.take() == ["transfer_kv_all_layer"]
    check_equal("refused call moved nothing", host.kv_buffer, before)


# --------------------------------------------------------------------------------- (b) MooncakeStore on sglang pools


class RecordingMooncakeClient:
    """Stands in for MooncakeDistributedStore (not for any transfer op): records what the store
    registers and puts, so (b) runs where Mooncake is not installed."""

    def __init__(self):
        self.registered, self.puts, self.objects = [], [], {}

    def register_buffer(self, addr, nbytes):
        self.registered.append((addr, nbytes))
        return 0

    def unregister_buffer(self, addr):
        return 0

    def batch_put_from(self, keys, ptrs, sizes):
        import ctypes

        for k, p, n in zip(keys, ptrs, sizes):
            self.puts.append((k, p, n))
            self.objects[k] = ctypes.string_at(p, n)
        return [0] * len(keys)

    def get(self, key):
        return self.objects.get(key, b"")

    def put(self, key, data):
        self.objects[key] = bytes(data)
        return 0

    def close(self):
        pass


@pytest.mark.parametrize("kind,layout", [("mha", "page_first"), ("mla", "page_first"), ("mla", "page_first_direct")])
def test_mooncake_store_registers_sglang_pool(kind, layout):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from hicache_io.storage import MooncakeStore

    with cpu_shims.sglang_paths(cuda=True):
        host = sp.mha_host(sp.mha_device(), layout) if kind == "mha" else sp.mla_host(sp.mla_device(), layout, (sp.mla_device(layer_num=1),))
    seen = []
    inner = host.get_page_buffer_meta

    def recorder(indices):
        seen.append((type(indices), indices.dtype, indices.device.type))
        return inner(indices)

    host.get_page_buffer_meta = recorder
    client = RecordingMooncakeClient()
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=(kind == "mla"), enable_storage_metrics=False, is_page_first_layout=(layout == "page_first"), model_name="m", extra_config={})
    store = MooncakeStore(cfg, {}, store=client)
    store.register_mem_pool_host(host)
    assert client.registered == [(host.kv_buffer.data_ptr(), host.kv_buffer.numel() * host.kv_buffer.element_size())]
    host.kv_buffer.view(torch.uint8).copy_(torch.randint(0, 256, host.kv_buffer.view(torch.uint8).shape, dtype=torch.uint8, generator=sp.gen(1)))
    idx = host.alloc(2 * sp.P)
    assert store.batch_set_v1(["a", "b"], idx) == [True, True], store.last_error
    assert seen and all(s == (torch.Tensor, torch.int64, "cpu") for s in seen), seen
    # each object is exactly its page's bytes (torch views of the host buffer)
    P = sp.P
    for key, t0 in zip(["a", "b"], idx[::P].tolist()):
        if kind == "mha":
            pages = [host.kv_buffer[c, t0 : t0 + P] for c in (0, 1)]
            names = [f"m_{key}_0_k", f"m_{key}_0_v"]
        else:
            pages = [host.kv_buffer[t0 : t0 + P] if layout == "page_first" else host.kv_buffer[t0 // P]]
            names = [f"m_{key}__k"]
        for name, page in zip(names, pages):
            assert client.objects[name] == page.contiguous().view(torch.uint8).numpy().tobytes(), name
    # sglang's names carry no namespace: the prefix's sidecar record holds it, the pool's own
    # KV dtype included.
    record = json.loads(client.objects[f"m_hio-namespace_{'0' if kind == 'mha' else ''}"])
    assert record == store.namespace
    assert record["kv_dtype"] == str(host.dtype).replace("torch.", "") and record["layout"] == layout and record["model"] == "m"
    store.unregister_mem_pool_host()


# --------------------------------------------------------------------------------- version gate


@pytest.mark.parametrize("how", ["_sglang_version", "importlib.metadata.version"])
def test_install_refuses_other_sglang_versions(monkeypatch, how):
    if how == "_sglang_version":
        monkeypatch.setattr(hicache_io.sglang, "_sglang_version", lambda: "0.5.24")
    else:
        real = importlib.metadata.version
        monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.6.0" if name == "sglang" else real(name))
    monkeypatch.delenv("HICACHE_IO_SGLANG_ANY_VERSION", raising=False)
    with pytest.raises(RuntimeError, match="not a version hicache-io was checked against"):
        hicache_io.sglang.install()
    assert hicache_io.sglang.install(allow_other_versions=True)["sglang"] == "0.5.23"  # already installed: the report
    monkeypatch.setenv("HICACHE_IO_SGLANG_ANY_VERSION", "1")
    hicache_io.sglang.install()
    # nothing was undone by the refused calls
    assert sys.modules["sgl_kernel.kvcacheio"] is kvcacheio
    assert sys.modules["sglang.srt.mem_cache.pool_host.mha"].jit_transfer_hicache_one_layer is hicache.transfer_hicache_one_layer
