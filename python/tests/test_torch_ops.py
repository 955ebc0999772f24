"""``torch.ops.sgl_kernel.<op>`` through :func:`hicache_io.kvcacheio.register_torch_ops`, and the
JIT entry points on torch tensors (strided page_first views, int32 indices). Skipped without
torch; CI installs it for the sglang client suite and runs these there."""

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hicache_io import hicache, kvcacheio as kv  # noqa: E402
from hicache_io.torch_ops import SCHEMAS  # noqa: E402


@pytest.fixture(scope="module")
def ops():
    names = kv.register_torch_ops()
    assert names == list(SCHEMAS)
    assert kv.register_torch_ops() == names  # a second call is a no-op
    return torch.ops.sgl_kernel


def test_every_kvcacheio_op_is_registered_with_sglangs_schema(ops):
    public = {n for n in kv.__all__ if n.startswith(("transfer_", "copy_", "get_"))}
    # sglang's JIT ops (the Mamba state copies) are functions only, as in sglang.
    jit = {s["name"] for s in kv.CATALOGUE if isinstance(s["sglang"], dict)}
    assert jit and public - jit == set(SCHEMAS)
    for name, schema in SCHEMAS.items():
        got = str(getattr(ops, name).default._schema)
        # torch prints the schema normalised; compare argument names and types.
        want = torch._C.parse_schema(f"sgl_kernel::{name}{schema}")
        assert got == str(want), name


def test_positional_dispatch_moves_the_right_bytes(ops):
    g = torch.Generator().manual_seed(1)
    src_k, src_v = torch.randn(64, 128, generator=g, dtype=torch.float16), torch.randn(64, 128, generator=g, dtype=torch.float16)
    dst_k, dst_v = torch.zeros_like(src_k), torch.zeros_like(src_v)
    si, di = torch.randperm(64, generator=g)[:16], torch.randperm(64, generator=g)[:16]
    ops.transfer_kv_per_layer.default(src_k, dst_k, src_v, dst_v, si, di, 256, 2, 32)
    assert torch.equal(dst_k[di], src_k[si]) and torch.equal(dst_v[di], src_v[si])
    # Layer tables as sglang passes them (int64 host addresses).
    layers = [torch.randn(64, 64, generator=g) for _ in range(3)]
    out = [torch.zeros(64, 64) for _ in range(3)]
    table = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
    ops.transfer_kv_all_layer_mla.default(table(layers), table(out), si, di, 256, 3, 2, 32)
    for a, b in zip(layers, out):
        assert torch.equal(b[di], a[si])


def test_get_device_accessible_ptr_as_sglangs_gate_and_tables_use_it(ops):
    """sglang calls ``get_device_accessible_ptr`` only when ``torch.ops.sgl_kernel`` has it, on
    per-layer views of its host buffers; without a CUDA device a host tensor's address is itself
    (interior views keep their offset)."""
    assert hasattr(torch.ops.sgl_kernel, "get_device_accessible_ptr")
    buf = torch.zeros(16, 3, 8)
    for layer in range(3):
        view = buf.transpose(0, 1)[layer]
        assert ops.get_device_accessible_ptr.default(view, 0) == view.data_ptr() == buf.data_ptr() + layer * 32
        assert kv.get_device_accessible_ptr(view, 0) == view.data_ptr()


def test_embedding_and_cpu_copy_through_the_dispatcher(ops):
    src = torch.arange(28 * 37, dtype=torch.bfloat16).reshape(28, 37)
    dst = torch.full((16, 37), -1, dtype=torch.bfloat16)
    ops.transfer_embedding_ranges_direct.default(src, dst, [1, 11, 23], [2, 6, 10], [4, 4, 2])
    want = torch.full((16, 37), -1, dtype=torch.bfloat16)
    for s, d, n in zip([1, 11, 23], [2, 6, 10], [4, 4, 2]):
        want[d : d + n] = src[s : s + n]
    assert torch.equal(dst, want)
    bufs = [torch.randn(12, 16) for _ in range(4)]
    ref = [b.clone() for b in bufs]
    tgt, srcl = torch.tensor([1, 2, 0], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
    for r in ref:
        r[tgt.long()] = r[srcl.long()].clone()
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs], dtype=torch.int64)
    ops.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, srcl)  # the overload packet, as sglang calls it
    for b, r in zip(bufs, ref):
        assert torch.equal(b, r)
    with pytest.raises(RuntimeError, match=re.escape("CHECK_EQ(data_ptrs.scalar_type(), at::kUInt64) failed. Long vs UInt64")):
        kv.copy_all_layer_kv_cache_cpu(ptrs.to(torch.int64), strides, tgt, srcl)
    with pytest.raises(RuntimeError, match="tgt_loc must be contiguous"):
        kv.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)[:, 0], srcl[:2])


def test_an_existing_definition_is_refused_unless_overwritten():
    ns = "hicache_io_test_ns"
    lib = torch.library.Library(ns, "DEF")
    lib.define("transfer_kv_per_layer" + SCHEMAS["transfer_kv_per_layer"])
    with pytest.raises(RuntimeError, match="already defines transfer_kv_per_layer"):
        kv.register_torch_ops(ns)
    kv.register_torch_ops(ns, overwrite=True)
    src, dst = torch.arange(32, dtype=torch.float32).reshape(4, 8), torch.zeros(4, 8)
    getattr(torch.ops, ns).transfer_kv_per_layer.default(src, dst, src, dst, torch.tensor([3]), torch.tensor([0]), 32, 2, 32)
    assert torch.equal(dst[0], src[3])
    del lib


def test_pfdhg_on_torch_tensors():
    heads, groups, layers, page, dim, pages = 8, 4, 3, 4, 16, 3
    host = torch.randn(pages, groups, layers, page, heads // groups, dim).to(torch.bfloat16)
    rows, item = pages * page, heads * dim * 2
    dev = torch.zeros(rows, heads, dim, dtype=torch.bfloat16)
    idx = torch.arange(rows)
    kv.transfer_kv_per_layer_pfdhg_lf(host.view(-1), dev, host.view(-1), dev, idx, idx.flip(0), 2, item, item * layers, page, groups)
    want = host[idx // page, :, 2, idx % page].reshape(rows, heads, dim)
    assert torch.equal(dev[idx.flip(0)], want)


def test_jit_one_layer_on_a_page_first_transpose_view():
    slots, layers, heads, dim = 32, 4, 2, 32
    host_k = torch.randn(slots, layers, heads, dim, dtype=torch.float16)
    host_v = torch.randn(slots, layers, heads, dim, dtype=torch.float16)
    k_refs, v_refs = host_k.transpose(0, 1), host_v.transpose(0, 1)  # sglang's k_data_refs
    dk, dv = torch.zeros(slots, heads, dim, dtype=torch.float16), torch.zeros(slots, heads, dim, dtype=torch.float16)
    si = torch.randperm(slots)[:10].to(torch.int32)
    di = torch.randperm(slots)[:10].to(torch.int32)
    hicache.transfer_hicache_one_layer(dk, dv, di, k_refs[2], v_refs[2], si, element_dim=heads * dim)
    assert torch.equal(dk[di.long()], host_k[si.long(), 2]) and torch.equal(dv[di.long()], host_v[si.long(), 2])
    # Back into layer 0 of the page_first buffers (a layer-sharded backup through the JIT op).
    before = host_k.clone()
    hicache.transfer_hicache_one_layer(k_refs[0], v_refs[0], si, dk, dv, di, element_dim=heads * dim)
    want = before.clone()
    want[si.long(), 0] = dk[di.long()]
    assert torch.equal(host_k, want)
    np.testing.assert_array_equal(host_v[si.long(), 0].float().numpy(), dv[di.long()].float().numpy())


def test_an_existing_op_with_another_schema_is_not_routed():
    ns = "hicache_io_test_old"
    lib = torch.library.Library(ns, "DEF")
    # An old sgl-kernel schema (item size in elements, no tuning arguments).
    lib.define("transfer_kv_per_layer(Tensor src_k, Tensor dst_k, Tensor src_v, Tensor dst_v, Tensor src_indices, Tensor dst_indices, int item_size) -> ()")
    with pytest.raises(RuntimeError, match="not routed to hicache-io"):
        kv.register_torch_ops(ns, overwrite=True)
    del lib
