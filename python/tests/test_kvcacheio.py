"""Every ``hicache_io.kvcacheio`` op against a numpy fancy-index reference, built the way
sglang's ``test_kvcacheio.py`` builds its references (random pages expanded to token indices,
``dst[di] = src[si]``), with its parametrizations; then bad input: sglang's exception class and
message, and the destination unchanged."""

import numpy as np
import pytest

from hicache_io import kvcacheio as kv

NUM_LAYERS = 4
TOTAL_ITEMS = 2048  # tokens per pool (sglang's test uses 10240; smaller keeps CI quick)
DTYPE = np.float16


def page_indices(rng, total_items, num_items, page_size):
    """sglang's index pattern: random distinct pages, each expanded to its tokens."""
    pages = rng.permutation(total_items // page_size)[: num_items // page_size]
    return (pages[:, None] * page_size + np.arange(page_size)).reshape(-1).astype(np.int64)


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(DTYPE)


PARAMS = [
    (page_size, num_items, item_elems)
    for page_size in (1, 16, 64)
    for num_items in (64, 256)
    for item_elems in (128, 256)
]


def item_bytes(item_elems):
    return item_elems * np.dtype(DTYPE).itemsize


@pytest.mark.parametrize("page_size,num_items,item_elems", PARAMS)
@pytest.mark.parametrize("is_mla", [False, True])
@pytest.mark.parametrize("all_layers", [False, True])
def test_transfer_kv_layer_first(page_size, num_items, item_elems, is_mla, all_layers):
    rng = np.random.default_rng(page_size * 7 + num_items + item_elems)
    comps = 1 if is_mla else 2
    src = [rand(rng, NUM_LAYERS, TOTAL_ITEMS, item_elems) for _ in range(comps)]
    dst = [np.zeros((NUM_LAYERS, TOTAL_ITEMS, item_elems), DTYPE) for _ in range(comps)]
    si = page_indices(rng, TOTAL_ITEMS, num_items, page_size)
    di = page_indices(rng, TOTAL_ITEMS, num_items, page_size)
    ref = [d.copy() for d in dst]
    ib = item_bytes(item_elems)
    if all_layers:
        for c in range(comps):
            ref[c][:, di] = src[c][:, si]
        if is_mla:
            kv.transfer_kv_all_layer_mla(list(src[0]), list(dst[0]), si, di, ib, NUM_LAYERS)
        else:
            kv.transfer_kv_all_layer(list(src[0]), list(dst[0]), list(src[1]), list(dst[1]), si, di, ib, NUM_LAYERS)
    else:
        layer = 2
        for c in range(comps):
            ref[c][layer, di] = src[c][layer, si]
        if is_mla:
            kv.transfer_kv_per_layer_mla(src[0][layer], dst[0][layer], si, di, ib)
        else:
            kv.transfer_kv_per_layer(src[0][layer], dst[0][layer], src[1][layer], dst[1][layer], si, di, ib)
    for c in range(comps):
        np.testing.assert_array_equal(dst[c], ref[c])


def table(layers):
    """sglang's form of a layer list: a table of base addresses."""
    return np.array([a.ctypes.data for a in layers], dtype=np.uint64)


def test_all_layer_accepts_sglang_pointer_tables():
    rng = np.random.default_rng(3)
    src = rand(rng, NUM_LAYERS, TOTAL_ITEMS, 128)
    dst = np.zeros_like(src)
    si = page_indices(rng, TOTAL_ITEMS, 256, 16)
    di = page_indices(rng, TOTAL_ITEMS, 256, 16)
    kv.transfer_kv_all_layer_mla(table(src), table(dst), si, di, 256, NUM_LAYERS)
    ref = np.zeros_like(src)
    ref[:, di] = src[:, si]
    np.testing.assert_array_equal(dst, ref)


@pytest.mark.parametrize("page_size,num_items,item_elems", PARAMS)
@pytest.mark.parametrize("is_mla", [False, True])
def test_page_first(page_size, num_items, item_elems, is_mla):
    """Backup into page_first ``[tokens][L][item]`` (all layers), then load one layer back."""
    rng = np.random.default_rng(11 + page_size + num_items)
    comps = 1 if is_mla else 2
    ib = item_bytes(item_elems)
    device = [rand(rng, NUM_LAYERS, TOTAL_ITEMS, item_elems) for _ in range(comps)]
    host = [np.zeros((TOTAL_ITEMS, NUM_LAYERS, item_elems), DTYPE) for _ in range(comps)]
    di = page_indices(rng, TOTAL_ITEMS, num_items, page_size)
    hi = page_indices(rng, TOTAL_ITEMS, num_items, page_size)
    if is_mla:
        kv.transfer_kv_all_layer_mla_lf_pf(list(device[0]), host[0], di, hi, ib, ib * NUM_LAYERS, NUM_LAYERS)
    else:
        kv.transfer_kv_all_layer_lf_pf(list(device[0]), host[0], list(device[1]), host[1], di, hi, ib, ib * NUM_LAYERS, NUM_LAYERS)
    for c in range(comps):
        ref = np.zeros_like(host[c])
        ref[hi] = device[c][:, di].transpose(1, 0, 2)
        np.testing.assert_array_equal(host[c], ref)
    # Load layer 1 back into fresh device layers.
    back = [np.zeros((TOTAL_ITEMS, item_elems), DTYPE) for _ in range(comps)]
    di2 = page_indices(rng, TOTAL_ITEMS, num_items, page_size)
    if is_mla:
        kv.transfer_kv_per_layer_mla_pf_lf(host[0], back[0], hi, di2, 1, ib, ib * NUM_LAYERS)
    else:
        kv.transfer_kv_per_layer_pf_lf(host[0], back[0], host[1], back[1], hi, di2, 1, ib, ib * NUM_LAYERS)
    for c in range(comps):
        ref = np.zeros_like(back[c])
        ref[di2] = host[c][hi, 1]
        np.testing.assert_array_equal(back[c], ref)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("head_num", [1, 2, 8])
def test_page_head(page_size, head_num):
    """page_head ``[pages][H][P][L][D]``: all-layer backup, then one layer back."""
    rng = np.random.default_rng(page_size * 31 + head_num)
    head_dim = 64
    item_elems = head_num * head_dim
    ib = item_bytes(item_elems)
    pages = TOTAL_ITEMS // page_size
    k = rand(rng, NUM_LAYERS, TOTAL_ITEMS, item_elems)
    v = rand(rng, NUM_LAYERS, TOTAL_ITEMS, item_elems)
    hk = np.zeros((pages, head_num, page_size, NUM_LAYERS, head_dim), DTYPE)
    hv = np.zeros_like(hk)
    di = page_indices(rng, TOTAL_ITEMS, 128, page_size)
    hi = page_indices(rng, TOTAL_ITEMS, 128, page_size)
    kv.transfer_kv_all_layer_lf_ph(list(k), hk, list(v), hv, di, hi, ib, ib * NUM_LAYERS, NUM_LAYERS, page_size, head_num)
    for dev, host in ((k, hk), (v, hv)):
        ref = np.zeros_like(host)
        for layer in range(NUM_LAYERS):
            for t_h, t_d in zip(hi, di):
                ref[t_h // page_size, :, t_h % page_size, layer] = dev[layer, t_d].reshape(head_num, head_dim)
        np.testing.assert_array_equal(host, ref)
    back_k = np.zeros((TOTAL_ITEMS, item_elems), DTYPE)
    back_v = np.zeros_like(back_k)
    kv.transfer_kv_per_layer_ph_lf(hk, back_k, hv, back_v, hi, di, 3, ib, ib * NUM_LAYERS, page_size, head_num)
    ref = np.zeros_like(back_k)
    ref[di] = k[3, di]
    np.testing.assert_array_equal(back_k, ref)
    ref[di] = v[3, di]
    np.testing.assert_array_equal(back_v, ref)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("is_mla", [False, True])
def test_transfer_kv_direct(page_size, is_mla):
    rng = np.random.default_rng(page_size + 5)
    layers = NUM_LAYERS * (1 if is_mla else 2)  # sglang passes [K..., V...] as one list
    src = [rand(rng, TOTAL_ITEMS, 8, 32) for _ in range(layers)]
    dst = [np.zeros((TOTAL_ITEMS, 8, 32), DTYPE) for _ in range(layers)]
    si = page_indices(rng, TOTAL_ITEMS, 256, page_size)
    di = page_indices(rng, TOTAL_ITEMS, 256, page_size)
    kv.transfer_kv_direct(src, dst, si, di, page_size)
    for s, d in zip(src, dst):
        ref = np.zeros_like(d)
        ref[di] = s[si]
        np.testing.assert_array_equal(d, ref)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("is_mla", [False, True])
def test_page_first_direct(page_size, is_mla):
    """page_first_direct ``[pages][L][P][H][D]``: all-layer backup and per-layer load."""
    rng = np.random.default_rng(page_size + 17)
    comps = 1 if is_mla else 2
    heads, head_dim = (1, 64) if is_mla else (4, 32)
    pages = TOTAL_ITEMS // page_size
    device = [[rand(rng, TOTAL_ITEMS, heads, head_dim) for _ in range(NUM_LAYERS)] for _ in range(comps)]
    host = [np.zeros((pages, NUM_LAYERS, page_size, heads, head_dim), DTYPE) for _ in range(comps)]
    di = page_indices(rng, TOTAL_ITEMS, 256, page_size)
    hi = page_indices(rng, TOTAL_ITEMS, 256, page_size)
    kv.transfer_kv_all_layer_direct_lf_pf([layer for c in device for layer in c], host, di, hi, page_size)
    for c in range(comps):
        ref = np.zeros_like(host[c])
        for t_h, t_d in zip(hi, di):
            for layer in range(NUM_LAYERS):
                ref[t_h // page_size, layer, t_h % page_size] = device[c][layer][t_d]
        np.testing.assert_array_equal(host[c], ref)
    back = [np.zeros((TOTAL_ITEMS, heads, head_dim), DTYPE) for _ in range(comps)]
    kv.transfer_kv_per_layer_direct_pf_lf(host, back, hi, di, 2, page_size)
    for c in range(comps):
        ref = np.zeros_like(back[c])
        ref[di] = device[c][2][di]
        np.testing.assert_array_equal(back[c], ref)


# ---- what sglang lacks ---------------------------------------------------------------------


@pytest.mark.parametrize("is_mla", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_per_layer_lf_pf(is_mla, page_size):
    """One layer at a time into page_first: after every layer, the same bytes as the all-layer op."""
    rng = np.random.default_rng(23 + page_size)
    comps = 1 if is_mla else 2
    ib = item_bytes(128)
    device = [rand(rng, NUM_LAYERS, TOTAL_ITEMS, 128) for _ in range(comps)]
    per_layer = [np.zeros((TOTAL_ITEMS, NUM_LAYERS, 128), DTYPE) for _ in range(comps)]
    all_layer = [np.zeros_like(h) for h in per_layer]
    di = page_indices(rng, TOTAL_ITEMS, 256, page_size)
    hi = page_indices(rng, TOTAL_ITEMS, 256, page_size)
    for layer in range(NUM_LAYERS):
        if is_mla:
            kv.transfer_kv_per_layer_mla_lf_pf(device[0][layer], per_layer[0], di, hi, layer, ib, ib * NUM_LAYERS)
        else:
            kv.transfer_kv_per_layer_lf_pf(device[0][layer], per_layer[0], device[1][layer], per_layer[1], di, hi, layer, ib, ib * NUM_LAYERS)
    if is_mla:
        kv.transfer_kv_all_layer_mla_lf_pf(list(device[0]), all_layer[0], di, hi, ib, ib * NUM_LAYERS, NUM_LAYERS)
    else:
        kv.transfer_kv_all_layer_lf_pf(list(device[0]), all_layer[0], list(device[1]), all_layer[1], di, hi, ib, ib * NUM_LAYERS, NUM_LAYERS)
    for c in range(comps):
        np.testing.assert_array_equal(per_layer[c], all_layer[c])
        assert per_layer[c].any()


@pytest.mark.parametrize("is_mla", [False, True])
def test_per_layer_direct_lf_pf(is_mla):
    rng = np.random.default_rng(29)
    page_size = 16
    comps = 1 if is_mla else 2
    pages = TOTAL_ITEMS // page_size
    device = [rand(rng, TOTAL_ITEMS, 2, 32) for _ in range(comps)]
    host = [np.zeros((pages, NUM_LAYERS, page_size, 2, 32), DTYPE) for _ in range(comps)]
    di = page_indices(rng, TOTAL_ITEMS, 128, page_size)
    hi = page_indices(rng, TOTAL_ITEMS, 128, page_size)
    kv.transfer_kv_per_layer_direct_lf_pf(device, host, di, hi, 3, page_size)
    for c in range(comps):
        ref = np.zeros_like(host[c])
        for t_h, t_d in zip(hi, di):
            ref[t_h // page_size, 3, t_h % page_size] = device[c][t_d]
        np.testing.assert_array_equal(host[c], ref)


# ---- semantics -----------------------------------------------------------------------------


def test_negative_indices_are_skipped():
    rng = np.random.default_rng(1)
    src = rand(rng, 64, 16)
    dst = np.zeros_like(src)
    si = np.array([3, -1, 5, 7], dtype=np.int64)
    di = np.array([0, 1, -1, 2], dtype=np.int64)
    kv.transfer_kv_per_layer_mla(src, dst, si, di, 32)
    ref = np.zeros_like(src)
    ref[0] = src[3]
    ref[2] = src[7]
    np.testing.assert_array_equal(dst, ref)


def test_read_only_sources_and_index_sequences_are_accepted():
    src = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    src.flags.writeable = False
    dst = np.zeros((64, 8), np.float32)
    kv.transfer_kv_per_layer_mla(src, dst, [1, 2], [3, 4], 32)
    np.testing.assert_array_equal(dst[3:5], src[1:3])


# ---- bad input: sglang's exception and message, nothing moved --------------------------------


def mla_arrays(rng):
    """``(source, destination, a copy of the destination)``: two random 64-row MLA arrays."""
    src = rand(rng, 64, 16)
    dst = rand(rng, 64, 16)
    return src, dst, dst.copy()


@pytest.mark.parametrize(
    "si,di,item,exc,msg",
    [
        ([1, 2], [3], 32, RuntimeError, "Source and destination indices must have the same length"),
        ([1, 2], [3, 4], 12, RuntimeError, "Item byte size must be divisible by 8"),
        ([1, 64], [3, 4], 32, IndexError, "source index 64 at position 1 is out of range"),
        ([1, 2], [3, 99], 32, IndexError, "destination index 99 at position 1 is out of range"),
        ([1, 2], [3, 3], 32, ValueError, "written twice"),
    ],
)
def test_bad_input_moves_nothing(si, di, item, exc, msg):
    src, dst, before = mla_arrays(np.random.default_rng(2))
    with pytest.raises(exc) as e:
        kv.transfer_kv_per_layer_mla(src, dst, np.array(si, np.int64), np.array(di, np.int64), item)
    assert msg in str(e.value)
    np.testing.assert_array_equal(dst, before)


def test_sglang_messages_of_the_layer_and_direct_checks():
    rng = np.random.default_rng(4)
    src = rand(rng, 2, 64, 16)
    dst = np.zeros_like(src)
    idx = np.arange(4, dtype=np.int64)
    with pytest.raises(RuntimeError, match="^Number of layers in source tensor does not match num_layers$"):
        kv.transfer_kv_all_layer_mla(list(src), list(dst), idx, idx, 32, 3)
    with pytest.raises(RuntimeError, match="^Number of layers in source k tensor does not match num_layers$"):
        kv.transfer_kv_all_layer(list(src), list(dst), list(src), list(dst), idx, idx, 32, 1)
    with pytest.raises(RuntimeError, match="^Source and destination layers must have the same number of layers$"):
        kv.transfer_kv_direct(list(src), list(dst[:1]), idx, idx, 1)
    with pytest.raises(RuntimeError, match="^Page size must be positive$"):
        kv.transfer_kv_direct(list(src), list(dst), idx, idx, 0)
    with pytest.raises(RuntimeError, match="^Source indices size must be divisible by page size$"):
        kv.transfer_kv_direct(list(src), list(dst), idx[:3], idx[:3], 2)
    with pytest.raises(RuntimeError, match="^Source indices must be of type long$"):
        kv.transfer_kv_per_layer_mla(src[0], dst[0], idx.astype(np.int32), idx, 32)
    with pytest.raises(RuntimeError, match="^Destination indices must be of type long$"):
        kv.transfer_kv_per_layer_mla(src[0], dst[0], idx, idx.astype(np.int32), 32)
    assert not dst.any()


def test_arguments_sglang_cannot_check():
    rng = np.random.default_rng(5)
    src, dst, before = mla_arrays(rng)
    idx = np.arange(4, dtype=np.int64)
    with pytest.raises(ValueError, match="overlaps"):
        kv.transfer_kv_per_layer_mla(dst, dst, idx, idx + 8, 32)
    ro = dst.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        kv.transfer_kv_per_layer_mla(src, ro, idx, idx, 32)
    with pytest.raises(ValueError, match="contiguous"):
        kv.transfer_kv_per_layer_mla(src, dst[:, ::2], idx, idx, 16)
    with pytest.raises(ValueError, match="not a multiple of item_size"):
        kv.transfer_kv_per_layer_mla_pf_lf(src, dst, idx, idx, 0, 32, 48)
    with pytest.raises(IndexError, match="layer 5 is out of range"):
        kv.transfer_kv_per_layer_mla_pf_lf(src, dst, idx, idx, 5, 8, 32)
    np.testing.assert_array_equal(dst, before)
    # One bad layer of many: no layer moves.
    layers_src = [rand(rng, 64, 16) for _ in range(3)]
    layers_dst = [np.zeros((64, 16), DTYPE) for _ in range(2)] + [np.zeros((8, 16), DTYPE)]
    with pytest.raises(IndexError):
        kv.transfer_kv_all_layer_mla(layers_src, layers_dst, idx, idx + 20, 32, 3)
    assert not any(d.any() for d in layers_dst)


def test_page_first_direct_pages_must_be_whole():
    rng = np.random.default_rng(6)
    host = [np.zeros((8, 2, 4, 16), DTYPE)]
    dev = [rand(rng, 32, 16), rand(rng, 32, 16)]
    with pytest.raises(ValueError, match="not one whole page"):
        kv.transfer_kv_all_layer_direct_lf_pf(dev, host, np.array([4, 5, 7, 6]), np.array([0, 1, 2, 3]), 4)
    assert not host[0].any()


def test_foreign_byte_order_and_odd_strides_are_refused():
    src = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    dst = np.zeros_like(src)
    with pytest.raises(ValueError, match="byte order"):
        kv.transfer_kv_per_layer_mla(src, dst, np.array([1, 128], dtype=">i8"), np.array([2, 3]), 32)
    with pytest.raises(ValueError, match="contiguous"):
        kv.transfer_kv_per_layer_mla(src[::2], dst, [1], [2], 32)
    assert not dst.any()
