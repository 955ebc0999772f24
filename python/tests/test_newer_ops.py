"""The ops of today's sglang: the head-group-major (pfdhg) pair against the logical 6-D host
array, embedding ranges and the CPU row move against numpy fancy indexing, the JIT entry points
(destination first) against the classic ops' references, and hostile inputs with sglang's
messages; a call that raises leaves the destination as it was."""

import numpy as np
import pytest

from hicache_io import hicache, kvcacheio as kv

# (kv heads, head groups, layers, page size, head dim): sglang's head-group shapes, fewer layers.
HEAD_GROUP_CONFIGS = [(8, 8, 6, 16, 128), (8, 4, 4, 8, 64), (16, 2, 5, 16, 128), (16, 4, 3, 8, 128), (8, 1, 3, 4, 32), (4, 4, 1, 4, 64)]
PAGES = 3


def host_6d(rng, heads, groups, layers, page, dim, dtype):
    """The logical host array (page, HG, L, P, hg, D) of one component."""
    shape = (PAGES, groups, layers, page, heads // groups, dim)
    return (rng.standard_normal(shape) * 8).astype(dtype)


@pytest.mark.parametrize("heads,groups,layers,page,dim", HEAD_GROUP_CONFIGS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_pfdhg_load_every_layer(heads, groups, layers, page, dim, dtype):
    rng = np.random.default_rng(heads * 100 + groups * 10 + layers)
    rows = PAGES * page
    hk, hv = host_6d(rng, heads, groups, layers, page, dim, dtype), host_6d(rng, heads, groups, layers, page, dim, dtype)
    item = heads * dim * np.dtype(dtype).itemsize
    src = np.arange(rows, dtype=np.int64)
    dst = src[::-1].copy()
    for layer in range(layers):
        dk, dv = np.zeros((rows, heads, dim), dtype), np.zeros((rows, heads, dim), dtype)
        kv.transfer_kv_per_layer_pfdhg_lf(hk.reshape(-1), dk, hv.reshape(-1), dv, src, dst, layer, item, item * layers, page, groups)
        for host, dev in ((hk, dk), (hv, dv)):
            # device[d] == host[s // P, :, layer, s % P, :, :].reshape(H, D)
            want = host[src // page, :, layer, src % page].reshape(rows, heads, dim)
            np.testing.assert_array_equal(dev[dst], want)


@pytest.mark.parametrize("heads,groups,layers,page,dim", HEAD_GROUP_CONFIGS)
def test_pfdhg_backup_then_load_round_trips(heads, groups, layers, page, dim):
    rng = np.random.default_rng(7 + heads + groups)
    rows, dtype = PAGES * page, np.float16
    item = heads * dim * 2
    dev_k = [rng.standard_normal((rows, heads, dim)).astype(dtype) for _ in range(layers)]
    dev_v = [rng.standard_normal((rows, heads, dim)).astype(dtype) for _ in range(layers)]
    hk = np.zeros((PAGES, groups, layers, page, heads // groups, dim), dtype)
    hv = np.zeros_like(hk)
    dev_src = rng.permutation(rows).astype(np.int64)
    host_dst = np.arange(rows, dtype=np.int64)
    kv.transfer_kv_all_layer_lf_pfdhg(dev_k, hk.reshape(-1), dev_v, hv.reshape(-1), dev_src, host_dst, item, item * layers, layers, page, groups)
    hg = heads // groups
    for layer in range(layers):
        for host, dev in ((hk, dev_k), (hv, dev_v)):
            # host[d // P, g, layer, d % P, j, :] == device[layer][s, g * hg + j, :]
            got = host[host_dst // page, :, layer, host_dst % page].reshape(rows, heads, dim)
            np.testing.assert_array_equal(got, dev[layer][dev_src])
    # Load back with the lists swapped: the original device bytes.
    for layer in range(layers):
        bk, bv = np.zeros((rows, heads, dim), dtype), np.zeros((rows, heads, dim), dtype)
        kv.transfer_kv_per_layer_pfdhg_lf(hk.reshape(-1), bk, hv.reshape(-1), bv, host_dst, dev_src, layer, item, item * layers, page, groups)
        np.testing.assert_array_equal(bk, dev_k[layer])
        np.testing.assert_array_equal(bv, dev_v[layer])


@pytest.mark.parametrize("quota", [2, 8, 16, 32, 132])
def test_pfdhg_quota_does_not_change_results(quota):
    rng = np.random.default_rng(quota)
    heads, groups, layers, page, dim = 8, 4, 4, 8, 64
    hk = host_6d(rng, heads, groups, layers, page, dim, np.float16)
    rows, item = PAGES * page, heads * dim * 2
    idx = np.arange(rows, dtype=np.int64)
    ref = np.zeros((rows, heads, dim), np.float16)
    kv.transfer_kv_per_layer_pfdhg_lf(hk.reshape(-1), ref, hk.reshape(-1), ref, idx, idx, 1, item, item * layers, page, groups)
    got = np.zeros_like(ref)
    # One destination for K and V, read from one source: the same bytes written twice.
    kv.transfer_kv_per_layer_pfdhg_lf(hk.reshape(-1), got, hk.reshape(-1), got, idx, idx, 1, item, item * layers, page, groups, block_quota=quota)
    np.testing.assert_array_equal(got, ref)


PFDHG_BAD = [
    (dict(block_quota=0), "block_quota"),
    (dict(page_size=0), "page_size"),
    (dict(head_num=0), "head_num"),
    (dict(head_num=3), "item_size"),
    (dict(item_size=24, src_layout_dim=24, head_num=2), "Per-head-group"),
    (dict(src_layout_dim=513), "src_layout_dim"),
]


@pytest.mark.parametrize("override,match", PFDHG_BAD)
def test_pfdhg_bad_arguments_raise_and_move_nothing(override, match):
    # sglang's fixture: fp16, 4 heads x 64, one layer, pages of 4.
    args = dict(layer_id=0, item_size=512, src_layout_dim=512, page_size=4, head_num=4, block_quota=2, num_warps_per_block=32)
    args.update(override)
    host = np.ones(3 * 4 * 256, np.float16)
    dk, dv = np.zeros((12, 4, 64), np.float16), np.zeros((12, 4, 64), np.float16)
    idx = np.arange(12, dtype=np.int64)
    with pytest.raises(RuntimeError, match=match):
        kv.transfer_kv_per_layer_pfdhg_lf(host, dk, host, dv, idx, idx, **args)
    assert not dk.any() and not dv.any()


def test_pfdhg_empty_lists_are_a_no_op():
    host = np.ones(3 * 4 * 256, np.float16)
    dk = np.zeros((12, 4, 64), np.float16)
    empty = np.zeros(0, np.int64)
    kv.transfer_kv_per_layer_pfdhg_lf(host, dk, host, dk, empty, empty, 0, 512, 512, 4, 4)
    kv.transfer_kv_all_layer_lf_pfdhg([dk], host.copy(), [dk], host.copy(), empty, empty, 512, 512, 1, 4, 4)
    assert not dk.any()


def test_pfdhg_refuses_out_of_range_with_source_destination_words():
    host = np.ones(3 * 4 * 256, np.float16)
    dk, dv = np.zeros((12, 4, 64), np.float16), np.zeros((12, 4, 64), np.float16)
    with pytest.raises(IndexError, match="source index 12 at position 1 is out of range"):
        kv.transfer_kv_per_layer_pfdhg_lf(host, dk, host, dv, [0, 12], [0, 1], 0, 512, 512, 4, 4)
    with pytest.raises(ValueError, match="destination slot 3 is written twice"):
        kv.transfer_kv_per_layer_pfdhg_lf(host, dk, host, dv, [0, 1], [3, 3], 0, 512, 512, 4, 4)
    assert not dk.any() and not dv.any()


# ---- embedding ranges ------------------------------------------------------------------------


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_transfer_embedding_ranges_direct(direction):
    rng = np.random.default_rng(3)
    # sglang's shape: 37 bf16-sized elements (74-byte rows), fragmented host starts.
    host = rng.integers(0, 1 << 15, (28, 37)).astype(np.int16)
    dev = np.full((16, 37), -1, np.int16)
    host_starts, dev_starts, lengths = [1, 11, 23], [2, 6, 10], [4, 4, 2]
    if direction == "h2d":
        src, dst, ss, ds = host, dev, host_starts, dev_starts
    else:
        dev = rng.integers(0, 1 << 15, (16, 37)).astype(np.int16)
        host = np.full((28, 37), -1, np.int16)
        src, dst, ss, ds = dev, host, dev_starts, host_starts
    want = dst.copy()
    for s, d, n in zip(ss, ds, lengths):
        want[d : d + n] = src[s : s + n]
    assert kv.transfer_embedding_ranges_direct(src, dst, ss, ds, lengths) is None
    np.testing.assert_array_equal(dst, want)


@pytest.mark.parametrize(
    "ss,ds,n,exc,match",
    [
        ([0], [0, 1], [1], RuntimeError, "same number of ranges"),
        ([-1], [0], [1], RuntimeError, "must not be negative"),
        ([6], [0], [3], IndexError, "source index 8 at position 0 is out of range"),
        ([0, 4], [0, 2], [3, 3], ValueError, "written twice"),
    ],
)
def test_embedding_ranges_refuse_and_move_nothing(ss, ds, n, exc, match):
    src = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    dst = np.zeros((8, 4), np.float32)
    with pytest.raises(exc, match=match):
        kv.transfer_embedding_ranges_direct(src, dst, ss, ds, n)
    assert not dst.any()


def test_embedding_ranges_refuse_other_rows_and_dtypes():
    src = np.zeros((8, 4), np.float32)
    with pytest.raises(ValueError, match="rows of 32 bytes"):
        kv.transfer_embedding_ranges_direct(src, np.zeros((8, 8), np.float32), [0], [0], [1])
    with pytest.raises(RuntimeError, match="same dtype"):
        kv.transfer_embedding_ranges_direct(src, np.zeros((8, 4), np.int32), [0], [0], [1])


# ---- copy_all_layer_kv_cache_cpu -------------------------------------------------------------


def kv_pool(rng, layers=3, rows=12, dims=(16, 40)):
    return [rng.standard_normal((rows, dims[b % 2])).astype(np.float16) for b in range(2 * layers)]


@pytest.mark.parametrize("index_dtype", [np.int64, np.int32])
def test_copy_all_layer_kv_cache_cpu_moves_rows_simultaneously(index_dtype):
    rng = np.random.default_rng(11)
    bufs = kv_pool(rng)
    ref = [b.copy() for b in bufs]
    tgt = np.array([1, 2, 3, 0, 9], index_dtype)  # a rotation plus one plain move
    src = np.array([0, 1, 2, 3, 4], index_dtype)
    for r in ref:
        r[tgt] = r[src].copy()
    ptrs = np.array([b.ctypes.data for b in bufs], np.uint64)
    strides = np.array([b.strides[0] for b in bufs], np.int64)
    kv.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, r in zip(bufs, ref):
        np.testing.assert_array_equal(b, r)


def test_copy_all_layer_kv_cache_cpu_checks_with_sglangs_messages():
    rng = np.random.default_rng(12)
    bufs = kv_pool(rng)
    before = [b.copy() for b in bufs]
    ptrs = np.array([b.ctypes.data for b in bufs], np.uint64)
    strides = np.array([b.strides[0] for b in bufs], np.int64)
    loc = np.array([1, 2], np.int64)
    cases = [
        ((ptrs.astype(np.int64), strides, loc, loc), "CHECK_EQ(data_ptrs.scalar_type(), at::kUInt64) failed. Long vs UInt64"),
        ((ptrs, strides.astype(np.int32), loc, loc), "CHECK_EQ(strides.scalar_type(), at::kLong) failed. Int vs Long"),
        ((ptrs, strides, loc, loc.astype(np.int32)), "CHECK_EQ(tgt_loc.scalar_type(), src_loc.scalar_type()) failed. Long vs Int"),
        ((ptrs, strides[:3], loc, loc), "CHECK_EQ(strides.numel(), num_bufs) failed. 3 vs 6"),
        ((ptrs, strides, loc, loc[:1]), "CHECK_EQ(src_loc.numel(), num_locs) failed. 1 vs 2"),
        ((ptrs, strides, np.array([[1, 2], [3, 4]])[:, 0], loc), "tgt_loc must be contiguous"),
        ((ptrs, strides, loc.astype(np.float32), loc.astype(np.float32)), "not implemented for 'Float'"),
    ]
    for args, match in cases:
        with pytest.raises(RuntimeError, match=__import__("re").escape(match)):
            kv.copy_all_layer_kv_cache_cpu(*args)
    # Beyond sglang: a target named twice, a negative location.
    with pytest.raises(ValueError, match="destination row 1 is written twice"):
        kv.copy_all_layer_kv_cache_cpu(ptrs, strides, np.array([1, 1]), np.array([2, 3]))
    with pytest.raises(IndexError, match="index -1"):
        kv.copy_all_layer_kv_cache_cpu(ptrs, strides, np.array([-1]), np.array([2]))
    for b, r in zip(bufs, before):
        np.testing.assert_array_equal(b, r)
    # Empty locations: nothing to do.
    kv.copy_all_layer_kv_cache_cpu(ptrs, strides, np.zeros(0, np.int64), np.zeros(0, np.int64))


# ---- JIT entry points ------------------------------------------------------------------------


def test_jit_one_layer_contiguous_and_int32_indices():
    rng = np.random.default_rng(21)
    rows, heads, dim, dtype = 64, 4, 32, np.float16
    ks, vs = rng.standard_normal((rows, heads * dim)).astype(dtype), rng.standard_normal((rows, heads * dim)).astype(dtype)
    kd, vd = np.zeros_like(ks), np.zeros_like(vs)
    si = rng.permutation(rows)[:20].astype(np.int32)
    di = rng.permutation(rows)[:20].astype(np.int32)
    hicache.transfer_hicache_one_layer(kd, vd, di, ks, vs, si, block_quota=4, unroll=2)
    want_k, want_v = np.zeros_like(kd), np.zeros_like(vd)
    want_k[di], want_v[di] = ks[si], vs[si]
    np.testing.assert_array_equal(kd, want_k)
    np.testing.assert_array_equal(vd, want_v)


def test_jit_one_layer_from_and_to_a_page_first_view():
    """sglang's page_first pools pass ``k_buffer.transpose(0, 1)[layer]``: rows at a stride of
    all layers, inside the page_first buffer."""
    rng = np.random.default_rng(22)
    slots, layers, heads, dim, dtype = 48, 5, 2, 16, np.float32
    host_k = rng.standard_normal((slots, layers, heads, dim)).astype(dtype)
    host_v = rng.standard_normal((slots, layers, heads, dim)).astype(dtype)
    layer = 3
    kd, vd = np.zeros((slots, heads, dim), dtype), np.zeros((slots, heads, dim), dtype)
    si, di = rng.permutation(slots)[:17].astype(np.int64), rng.permutation(slots)[:17].astype(np.int64)
    view_k, view_v = host_k.transpose(1, 0, 2, 3)[layer], host_v.transpose(1, 0, 2, 3)[layer]
    hicache.transfer_hicache_one_layer(kd, vd, di, view_k, view_v, si, element_dim=heads * dim)
    np.testing.assert_array_equal(kd[di], host_k[si, layer])
    np.testing.assert_array_equal(vd[di], host_v[si, layer])
    # And back into another layer of the page_first buffer (MLA variant on K alone).
    before = host_k.copy()
    hicache.transfer_hicache_one_layer_mla(host_k.transpose(1, 0, 2, 3)[1], si, kd, di, element_dim=heads * dim)
    want = before.copy()
    want[si, 1] = kd[di]
    np.testing.assert_array_equal(host_k, want)


def test_jit_all_layer_through_pointer_tables():
    rng = np.random.default_rng(23)
    layers, rows, elems, dtype = 3, 32, 64, np.float16
    src_k = [rng.standard_normal((rows, elems)).astype(dtype) for _ in range(layers)]
    src_v = [rng.standard_normal((rows, elems)).astype(dtype) for _ in range(layers)]
    dst_k = [np.zeros((rows, elems), dtype) for _ in range(layers)]
    dst_v = [np.zeros((rows, elems), dtype) for _ in range(layers)]
    table = lambda arrs: np.array([a.ctypes.data for a in arrs], np.uint64)  # noqa: E731
    si, di = rng.permutation(rows)[:9].astype(np.int64), rng.permutation(rows)[:9].astype(np.int32)
    stride = elems * 2
    hicache.transfer_hicache_all_layer(table(dst_k), table(dst_v), di, table(src_k), table(src_v), si, kv_cache_src_stride_bytes=stride, kv_cache_dst_stride_bytes=stride)
    for l in range(layers):
        np.testing.assert_array_equal(dst_k[l][di], src_k[l][si])
        np.testing.assert_array_equal(dst_v[l][di], src_v[l][si])
    mla_dst = [np.zeros((rows, elems), dtype) for _ in range(layers)]
    hicache.transfer_hicache_all_layer_mla(table(mla_dst), di, table(src_k), si, cache_src_stride_bytes=stride, cache_dst_stride_bytes=stride, element_size=stride)
    for l in range(layers):
        np.testing.assert_array_equal(mla_dst[l][di], src_k[l][si])
    with pytest.raises(AssertionError, match="element_size is required"):
        hicache.transfer_hicache_all_layer(table(dst_k), table(dst_v), di, table(src_k), table(src_v), si, kv_cache_src_stride_bytes=stride, kv_cache_dst_stride_bytes=2 * stride)


def test_jit_staged_write_back_moves_whole_pages():
    rng = np.random.default_rng(24)
    layers, rows, elems, page, dtype = 4, 64, 32, 8, np.float16
    src_k = [rng.standard_normal((rows, elems)).astype(dtype) for _ in range(layers)]
    src_v = [rng.standard_normal((rows, elems)).astype(dtype) for _ in range(layers)]
    table = lambda arrs: np.array([a.ctypes.data for a in arrs], np.uint64)  # noqa: E731
    dst_k, dst_v = np.zeros((48, layers, elems), dtype), np.zeros((48, layers, elems), dtype)
    staging = np.zeros((2 * page, layers, elems), dtype)
    src_pages, dst_pages = [5, 1, 6], [2, 0, 4]
    si = np.concatenate([np.arange(p * page, (p + 1) * page) for p in src_pages]).astype(np.int64)
    di = np.concatenate([np.arange(p * page, (p + 1) * page) for p in dst_pages]).astype(np.int64)
    hicache.transfer_hicache_all_layer_staged_lf_pf(table(src_k), table(src_v), si, di, staging, staging.copy(), dst_k, dst_v, page_size=page)
    for l in range(layers):
        np.testing.assert_array_equal(dst_k[di, l], src_k[l][si])
        np.testing.assert_array_equal(dst_v[di, l], src_v[l][si])
    assert not staging.any()
    mla = np.zeros((48, layers, elems), dtype)
    hicache.transfer_hicache_all_layer_mla_staged_lf_pf(table(src_k), si, di, staging, mla, page_size=page)
    for l in range(layers):
        np.testing.assert_array_equal(mla[di, l], src_k[l][si])
    # sglang's MHA pools pass (size, L, H, D) buffers and staging.
    heads = 2
    dst4 = np.zeros((48, layers, heads, elems // heads), dtype)
    staging4 = np.zeros((2 * page, layers, heads, elems // heads), dtype)
    hicache.transfer_hicache_all_layer_staged_lf_pf(table(src_k), table(src_v), si, di, staging4, staging4.copy(), dst4, dst4.copy(), page_size=page)
    for l in range(layers):
        np.testing.assert_array_equal(dst4[di, l].reshape(len(di), elems), src_k[l][si])
    for kwargs, match in [(dict(page_size=0), "page_size must be positive"), (dict(page_size=page, element_size=32), "element size mismatch")]:
        with pytest.raises(RuntimeError, match=match):
            hicache.transfer_hicache_all_layer_mla_staged_lf_pf(table(src_k), si, di, staging, mla, **kwargs)


def test_jit_checks():
    a = np.zeros((8, 16), np.float16)
    with pytest.raises(RuntimeError, match="HicacheKernel: cache dimension mismatch."):
        hicache.transfer_hicache_one_layer(a, a.copy(), [0], np.zeros((5, 5), np.float16), np.zeros((5, 5), np.float16), [1], element_dim=16)
    with pytest.raises(RuntimeError, match="HicacheKernel MLA: cache dimension mismatch."):
        hicache.transfer_hicache_one_layer_mla(a, [0], np.zeros((5, 5), np.float16), [1])
    with pytest.raises(RuntimeError, match="same dtype"):
        hicache.transfer_hicache_one_layer_mla(a, [0], np.zeros((8, 16), np.float32), [1])
    with pytest.raises(RuntimeError, match="block_quota"):
        hicache.transfer_hicache_one_layer_mla(a, [0], a.copy(), [1], block_quota=-1)
    with pytest.raises(ValueError, match="broadcast or reversed"):
        hicache.transfer_hicache_one_layer_mla(a, [0], np.broadcast_to(np.zeros(16, np.float16), (8, 16)), [1])
    # As sglang's view(-1, element_dim): a contiguous (8, 24) cache is 12 rows of 16.
    src = np.arange(8 * 24, dtype=np.float16).reshape(8, 24)
    hicache.transfer_hicache_one_layer_mla(a, [0], src, [11], block_quota=0, unroll=0)
    np.testing.assert_array_equal(a[0], src.reshape(12, 16)[11])
    a[...] = 0
    assert hicache.can_use_hicache_jit_kernel(element_size=1152)
    assert not hicache.can_use_write_back_jit_kernel(element_size=1160)
    assert not a.any()


def test_jit_probes_and_keywords_of_sglang_0_5_23():
    """sglang 0.5.23 passes ``page_size=`` to the probe and to every copy; it only gates
    sglang's TMA path, which hicache-io does not have."""
    assert hicache.can_use_hicache_jit_kernel(element_size=1152, page_size=64)
    assert hicache.can_use_hicache_jit_kernel(element_size=8, unroll=None, block_quota=None, page_size=None)
    assert not hicache.can_use_hicache_jit_kernel(element_size=12, page_size=1)
    assert not hicache.use_hicache_tma_kernel(element_size=1024, block_quota=4, page_size=64)
    assert [hicache.hicache_tma_rows_per_chunk(e) for e in (16, 256, 576, 1024, 32768)] == [128, 128, 32, 32, 1]
    a = np.arange(8 * 16, dtype=np.float16).reshape(8, 16)
    d = np.zeros_like(a)
    hicache.transfer_hicache_one_layer(d, d.copy(), np.array([2], np.int32), a, a.copy(), np.array([5], np.int32), element_dim=16, page_size=64)
    np.testing.assert_array_equal(d[2], a[5])
    m = np.zeros_like(a)
    hicache.transfer_hicache_one_layer_mla(cache_dst=m, indices_dst=[1], cache_src=a, indices_src=[7], page_size=1)
    np.testing.assert_array_equal(m[1], a[7])


def test_jit_all_layer_into_a_page_first_buffer_by_its_layer_table():
    """sglang's K-only pool backs up page_first with ``transfer_hicache_all_layer_mla(ptr_dst=
    k_data_ptrs, cache_dst_stride_bytes=layout_dim, cache_src_stride_bytes=row, element_size=row)``:
    the destination table holds ``k_buffer.transpose(0, 1)[l]`` of every layer."""
    rng = np.random.default_rng(25)
    layers, rows, heads, dim, dtype = 3, 40, 2, 8, np.float32
    row = heads * dim * 4
    src = [rng.standard_normal((rows, heads, dim)).astype(dtype) for _ in range(layers)]
    host = np.zeros((rows, layers, heads, dim), dtype)
    table = lambda arrs: np.array([a.ctypes.data for a in arrs], np.uint64)  # noqa: E731
    host_table = table([host.transpose(1, 0, 2, 3)[l] for l in range(layers)])
    si, di = rng.permutation(rows)[:11].astype(np.int64), rng.permutation(rows)[:11].astype(np.int64)
    hicache.transfer_hicache_all_layer_mla(ptr_dst=host_table, indices_dst=di, ptr_src=table(src), indices_src=si, cache_dst_stride_bytes=layers * row, cache_src_stride_bytes=row, element_size=row, page_size=4)
    want = np.zeros_like(host)
    for l in range(layers):
        want[di, l] = src[l][si]
    np.testing.assert_array_equal(host, want)
    # K and V, the MHA shape of the same call.
    hk, hv = np.zeros_like(host), np.zeros_like(host)
    hicache.transfer_hicache_all_layer(table([hk.transpose(1, 0, 2, 3)[l] for l in range(layers)]), table([hv.transpose(1, 0, 2, 3)[l] for l in range(layers)]), di, table(src), table(src[::-1]), si, kv_cache_src_stride_bytes=row, kv_cache_dst_stride_bytes=layers * row, element_size=row)
    np.testing.assert_array_equal(hk, want)
    for l in range(layers):
        np.testing.assert_array_equal(hv[di, l], src[layers - 1 - l][si])
    # A table that is not every layer of one page_first buffer, or strided source rows: refused,
    # nothing moved.
    before = host.copy()
    with pytest.raises(ValueError, match="not one"):
        hicache.transfer_hicache_all_layer_mla(host_table[:2], di, table(src[:2]), si, cache_dst_stride_bytes=layers * row, cache_src_stride_bytes=row, element_size=row)
    with pytest.raises(ValueError, match="strided device rows"):
        hicache.transfer_hicache_all_layer_mla(table(src), si, host_table, di, cache_dst_stride_bytes=row, cache_src_stride_bytes=layers * row, element_size=row)
    np.testing.assert_array_equal(host, before)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_nvfp4_page_rows_from_address_tables(layout):
    """sglang's MiniMax M3 NVFP4 pool: a device slab (L, pages, row) and a host buffer in its
    layout, both addressed by uint64 tables of per-layer row 0 (the host's strided for
    page_first), rows moved both ways and compared with numpy."""
    rng = np.random.default_rng(5)
    layers, row, host_pages, dev_pages = 3, 384, 7, 5
    slab = rng.integers(0, 256, (layers, dev_pages, row), dtype=np.uint8)
    if layout == "layer_first":
        host = rng.integers(0, 256, (layers, host_pages, row), dtype=np.uint8)
        views = [host[layer] for layer in range(layers)]
    else:
        host = rng.integers(0, 256, (host_pages, layers, 1, row), dtype=np.uint8)
        views = [host[:, layer, 0] for layer in range(layers)]
    host_table = np.array([v.ctypes.data for v in views], np.uint64)
    dev_table = np.array([slab[layer].ctypes.data for layer in range(layers)], np.uint64)
    host_stride = views[0].strides[0]
    hp, dp = np.array([6, 0, 3], np.int64), np.array([1, 4, 0], np.int64)
    want = [v.copy() for v in views]
    for layer in range(layers):
        want[layer][hp] = slab[layer][dp]
    kv.transfer_page_rows(host_table, dev_table, hp, dp, host_stride=host_stride, device_stride=row, row_bytes=row, load=False)
    for layer in range(layers):
        assert np.array_equal(views[layer], want[layer]), f"backup layer {layer}"
    hp, dp = np.array([2, 5], np.int64), np.array([3, 2], np.int64)
    want = slab.copy()
    for layer in range(layers):
        want[layer][dp] = views[layer][hp]
    kv.transfer_page_rows(host_table, dev_table, hp, dp, host_stride=host_stride, device_stride=row, row_bytes=row, load=True)
    assert np.array_equal(slab, want)
    # sglang's words; nothing moves.
    before = slab.copy()
    with pytest.raises(RuntimeError, match="page-row bytes must be a positive multiple of 128"):
        kv.transfer_page_rows(host_table, dev_table, hp, dp, host_stride=host_stride, device_stride=row, row_bytes=100, load=True)
    with pytest.raises(RuntimeError, match="page-row strides must be 128B aligned"):
        kv.transfer_page_rows(host_table, dev_table, hp, dp, host_stride=host_stride, device_stride=row + 8, row_bytes=row, load=True)
    assert np.array_equal(slab, before)


@pytest.mark.parametrize("load", [False, True])
def test_nvfp4_page_rows_refuse_a_read_only_destination(load):
    """Lists of arrays: the side ``load`` writes (host rows on a backup, device rows on a load)
    must be writable, as for every other op; the side it reads may be read-only."""
    rng = np.random.default_rng(9)
    layers, row = 2, 256
    host = [rng.integers(0, 256, (4, row), dtype=np.uint8) for _ in range(layers)]
    dev = [rng.integers(0, 256, (3, row), dtype=np.uint8) for _ in range(layers)]
    written, read = (dev, host) if load else (host, dev)
    for a in written:
        a.flags.writeable = False
    before = [a.copy() for a in written]
    hp, dp = np.array([3, 1], np.int64), np.array([0, 2], np.int64)
    with pytest.raises(ValueError, match="read-only"):
        kv.transfer_page_rows(host, dev, hp, dp, host_stride=row, device_stride=row, row_bytes=row, load=load)
    for a, b in zip(written, before):
        np.testing.assert_array_equal(a, b)
    # The other way round moves: the read side may be read-only.
    for a in written:
        a.flags.writeable = True
    for a in read:
        a.flags.writeable = False
    kv.transfer_page_rows(host, dev, hp, dp, host_stride=row, device_stride=row, row_bytes=row, load=load)
    for layer in range(layers):
        if load:
            np.testing.assert_array_equal(dev[layer][dp], host[layer][hp])
        else:
            np.testing.assert_array_equal(host[layer][hp], dev[layer][dp])


# ---- page_unified: one host buffer (pages, G, L, 2, P, hg, D), sglang's JIT entry points ----

UNIFIED_CONFIGS = [(8, 4, 3, 4, 16), (8, 8, 2, 2, 8), (4, 1, 2, 8, 32), (16, 2, 2, 4, 64)]


def unified_host(rng, heads, groups, layers, page, dim, pages=PAGES):
    """A page_unified MHA host array, random float16 bits."""
    shape = (pages, groups, layers, 2, page, heads // groups, dim)
    return rng.integers(0, 1 << 16, shape, dtype=np.uint16).view(np.float16)


@pytest.mark.parametrize("heads,groups,layers,page,dim", UNIFIED_CONFIGS)
def test_page_unified_load_back_every_layer(heads, groups, layers, page, dim):
    rng = np.random.default_rng(heads * 100 + groups)
    host = unified_host(rng, heads, groups, layers, page, dim)
    rows = PAGES * page
    src, dst = np.arange(rows, dtype=np.int64), np.arange(rows, dtype=np.int64)[::-1].copy()
    for layer in range(layers):
        k, v = np.zeros((rows, heads, dim), np.float16), np.zeros((rows, heads, dim), np.float16)
        hicache.transfer_hicache_one_layer_page_unified_lf(k, v, host, src, dst, layer)
        for s, d in zip(src, dst):
            for kv_i, dev in ((0, k), (1, v)):
                want = host[s // page, :, layer, kv_i, s % page].reshape(heads, dim)
                assert np.array_equal(dev[d].view(np.uint16), want.view(np.uint16)), (layer, s, kv_i)


@pytest.mark.parametrize("heads,groups,layers,page,dim", UNIFIED_CONFIGS)
def test_page_unified_write_back_then_load_back(heads, groups, layers, page, dim):
    rng = np.random.default_rng(7 + heads + groups)
    rows = 4 * page
    dev_k = [rng.integers(0, 1 << 16, (rows, heads, dim), dtype=np.uint16).view(np.float16) for _ in range(layers)]
    dev_v = [rng.integers(0, 1 << 16, (rows, heads, dim), dtype=np.uint16).view(np.float16) for _ in range(layers)]
    host = np.zeros((PAGES + 1, groups, layers, 2, page, heads // groups, dim), np.float16)
    staging = np.zeros((2,) + host.shape[1:], np.float16)
    src_pages, dst_pages = np.array([2, 0], np.int64), np.array([1, 3], np.int64)
    hicache.transfer_hicache_all_layer_staged_lf_page_unified(dev_k, dev_v, src_pages, dst_pages, staging, host)
    hg = heads // groups
    for sp, dp in zip(src_pages, dst_pages):
        for layer in range(layers):
            for kv_i, dev in ((0, dev_k), (1, dev_v)):
                got = host[dp, :, layer, kv_i]  # (G, P, hg, D)
                want = dev[layer][sp * page : (sp + 1) * page].reshape(page, groups, hg, dim).transpose(1, 0, 2, 3)
                assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    # Host pages not written stay as they were; staging is untouched.
    assert not host[0].any() and not host[2].any() and not staging.any()
    # Back into fresh device layers at the source rows: the original bytes.
    toks = lambda pages: np.concatenate([np.arange(p * page, (p + 1) * page) for p in pages]).astype(np.int64)  # noqa: E731
    for layer in range(layers):
        k, v = np.zeros_like(dev_k[layer]), np.zeros_like(dev_v[layer])
        hicache.transfer_hicache_one_layer_page_unified_lf(k, v, host, toks(dst_pages), toks(src_pages), layer)
        for sp in src_pages:
            sl = slice(sp * page, (sp + 1) * page)
            assert np.array_equal(k[sl].view(np.uint16), dev_k[layer][sl].view(np.uint16))
            assert np.array_equal(v[sl].view(np.uint16), dev_v[layer][sl].view(np.uint16))


def test_page_unified_mla_is_page_first_direct_bytes():
    rng = np.random.default_rng(3)
    layers, page, dim = 3, 4, 72
    host = rng.integers(0, 1 << 16, (PAGES, layers, page, dim), dtype=np.uint16).view(np.float16)
    rows = PAGES * page
    src = rng.permutation(rows).astype(np.int64)
    for layer in range(layers):
        dev = np.zeros((rows, dim), np.float16)
        hicache.transfer_hicache_one_layer_mla_page_unified_lf(dev, host, src, np.arange(rows, dtype=np.int64), layer)
        assert np.array_equal(dev.view(np.uint16), host[src // page, layer, src % page].view(np.uint16))
    layers_dev = [rng.integers(0, 1 << 16, (rows, dim), dtype=np.uint16).view(np.float16) for _ in range(layers)]
    back = np.zeros_like(host)
    hicache.transfer_hicache_all_layer_mla_staged_lf_page_unified(layers_dev, np.array([0, 1, 2]), np.array([2, 0, 1]), np.zeros((1,) + host.shape[1:], np.float16), back)
    for sp, dp in ((0, 2), (1, 0), (2, 1)):
        for layer in range(layers):
            assert np.array_equal(back[dp, layer].view(np.uint16), layers_dev[layer][sp * page : (sp + 1) * page].view(np.uint16))


def test_page_unified_refusals_move_nothing():
    assert hicache.can_use_page_unified_load_back_jit_kernel(group_bytes=48)
    assert not hicache.can_use_page_unified_load_back_jit_kernel(group_bytes=40)
    rng = np.random.default_rng(5)
    heads, groups, layers, page, dim = 8, 4, 2, 4, 16
    host = unified_host(rng, heads, groups, layers, page, dim)
    rows = PAGES * page
    k, v = np.zeros((rows, heads, dim), np.float16), np.zeros((rows, heads, dim), np.float16)
    ok = np.arange(rows, dtype=np.int64)
    for bad_src, bad_dst, layer in ((np.append(ok[:-1], rows), ok, 0), (ok, np.append(ok[:-1], 0), 0), (ok, ok, layers)):
        with pytest.raises(Exception):
            hicache.transfer_hicache_one_layer_page_unified_lf(k, v, host, bad_src, bad_dst, layer)
        assert not k.any() and not v.any()
    with pytest.raises(RuntimeError, match="page_unified: src must be"):
        hicache.transfer_hicache_one_layer_page_unified_lf(k, v, host.reshape(PAGES, groups, layers, 2, page, -1), ok, ok, 0)
    before = host.copy()
    dev = [np.ones((rows, heads, dim), np.float16)] * layers
    with pytest.raises(RuntimeError, match="element size mismatch"):
        hicache.transfer_hicache_all_layer_staged_lf_page_unified(dev, dev, np.array([0]), np.array([1]), np.zeros((1, groups, layers, 2, page, heads // groups, dim), np.float32), host)
    with pytest.raises(Exception):
        hicache.transfer_hicache_all_layer_staged_lf_page_unified(dev, dev, np.array([0]), np.array([PAGES]), np.zeros((1,) + host.shape[1:], np.float16), host)
    assert np.array_equal(host.view(np.uint16), before.view(np.uint16))
    # A strided host array is refused (a reshape would copy it, and the write-back land in the copy).
    big = np.zeros((2 * PAGES,) + host.shape[1:], np.float16)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        hicache.transfer_hicache_all_layer_staged_lf_page_unified(dev, dev, np.array([0]), np.array([1]), np.zeros((1,) + host.shape[1:], np.float16), big[::2])
    assert not big.any()
