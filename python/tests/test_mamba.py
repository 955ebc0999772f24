"""sglang's JIT Mamba state copies (``transfer_kv_mamba_pf_lf`` / ``_lf_pf``) against a numpy
reference: per-layer loads from a page_first host buffer of state slots, all-layer backups from
a list of state tensors or sglang's uint64 table of their addresses, the JIT kernel's checks in
its words, and hostile input that moves nothing."""

import numpy as np
import pytest

from hicache_io import kvcacheio as kv

# (slots on the host, device slots, layers, item bytes): sglang's temporal/conv state rows are
# multiples of 16 bytes, from one vector to several pages.
SHAPES = [(8, 6, 3, 16), (12, 10, 4, 48), (5, 7, 2, 4112), (3, 3, 1, 32)]


def host_states(rng, slots, layers, item):
    """A page_first host buffer as sglang allocates it: ``(slots, layers, 1, item)`` bytes."""
    return rng.integers(0, 256, (slots, layers, 1, item), dtype=np.uint8)


@pytest.mark.parametrize("slots,dev_slots,layers,item", SHAPES)
def test_load_every_layer(slots, dev_slots, layers, item):
    rng = np.random.default_rng(slots * 31 + item)
    host = host_states(rng, slots, layers, item)
    n = min(slots, dev_slots)
    src = rng.permutation(slots)[:n].astype(np.int64)
    dst = rng.permutation(dev_slots)[:n].astype(np.int64)
    for layer in range(layers):
        dev = rng.integers(0, 256, (dev_slots, item), dtype=np.uint8)
        want = dev.copy()
        want[dst] = host[src, layer, 0]
        kv.transfer_kv_mamba_pf_lf(host, dev, src, dst, layer, item, item * layers)
        np.testing.assert_array_equal(dev, want)


@pytest.mark.parametrize("slots,dev_slots,layers,item", SHAPES)
@pytest.mark.parametrize("table", [False, True])
def test_backup_every_layer_then_load_back(slots, dev_slots, layers, item, table):
    rng = np.random.default_rng(dev_slots * 17 + item + table)
    dev = [rng.integers(0, 256, (dev_slots, item), dtype=np.uint8) for _ in range(layers)]
    n = min(slots, dev_slots)
    src = rng.permutation(dev_slots)[:n].astype(np.int64)
    dst = rng.permutation(slots)[:n].astype(np.int64)
    host = host_states(rng, slots, layers, item)
    want = host.copy()
    for layer in range(layers):
        want[dst, layer, 0] = dev[layer][src]
    # sglang passes a uint64 table of the layers' addresses (its device_ptrs).
    src_ptrs = np.array([d.ctypes.data for d in dev], dtype=np.uint64) if table else dev
    kv.transfer_kv_mamba_lf_pf(src_ptrs, host, src, dst, item, item * layers, layers, num_warps_per_item=8)
    np.testing.assert_array_equal(host, want)
    for layer in range(layers):
        back = np.zeros((dev_slots, item), np.uint8)
        kv.transfer_kv_mamba_pf_lf(host, back, dst, src, layer, item, item * layers)
        np.testing.assert_array_equal(back[src], dev[layer][src])


def test_empty_lists_move_nothing():
    host = np.arange(4 * 2 * 16, dtype=np.uint8).reshape(4, 2, 1, 16)
    dev = np.zeros((4, 16), np.uint8)
    empty = np.zeros(0, np.int64)
    kv.transfer_kv_mamba_pf_lf(host, dev, empty, empty, 1, 16, 32)
    kv.transfer_kv_mamba_lf_pf([dev, dev.copy()], host, empty, empty, 16, 32, 2)
    assert not dev.any()
    np.testing.assert_array_equal(host, np.arange(4 * 2 * 16, dtype=np.uint8).reshape(4, 2, 1, 16))


@pytest.mark.parametrize(
    "item,num_layers,exc,match",
    [
        (0, 2, RuntimeError, "transfer_mamba: item_size must be positive"),
        (-16, 2, RuntimeError, "transfer_mamba: item_size must be positive"),
        (24, 2, RuntimeError, r"transfer_mamba: item_size must be 16-byte aligned \(uint4\)"),
        (8, 2, RuntimeError, r"transfer_mamba: item_size must be 16-byte aligned \(uint4\)"),
    ],
)
def test_the_jit_kernels_checks_in_its_words(item, num_layers, exc, match):
    host = np.zeros((4, 2, 1, 48), np.uint8)
    dev = [np.ones((4, 48), np.uint8) for _ in range(2)]
    idx = np.array([0, 1], np.int64)
    with pytest.raises(exc, match=match):
        kv.transfer_kv_mamba_lf_pf(dev, host, idx, idx, item, 2 * 48, num_layers)
    with pytest.raises(exc, match=match):
        kv.transfer_kv_mamba_pf_lf(host, dev[0], idx, idx, 0, item, 2 * 48)
    assert not host.any() and all((d == 1).all() for d in dev)


def test_num_layers_must_be_positive_and_match_the_table():
    host = np.zeros((4, 2, 1, 16), np.uint8)
    idx = np.array([0], np.int64)
    with pytest.raises(RuntimeError, match="transfer_mamba: num_layers must be positive"):
        kv.transfer_kv_mamba_lf_pf([], host, idx, idx, 16, 32, 0)
    with pytest.raises(Exception, match="num_layers"):
        kv.transfer_kv_mamba_lf_pf([np.ones((4, 16), np.uint8)], host, idx, idx, 16, 32, 2)
    assert not host.any()


def test_hostile_indices_move_nothing():
    rng = np.random.default_rng(3)
    host = host_states(rng, 6, 2, 32)
    before = host.copy()
    dev = [rng.integers(0, 256, (6, 32), dtype=np.uint8) for _ in range(2)]
    # A host slot past the buffer, a device slot past the layer, a destination written twice.
    for src, dst, exc in (
        ([0, 1], [2, 6], IndexError),
        ([0, 6], [2, 3], IndexError),
        ([0, 1], [2, 2], ValueError),
    ):
        with pytest.raises(exc):
            kv.transfer_kv_mamba_lf_pf(dev, host, np.array(src, np.int64), np.array(dst, np.int64), 32, 64, 2)
        np.testing.assert_array_equal(host, before)
    out = np.zeros((6, 32), np.uint8)
    with pytest.raises(IndexError):
        kv.transfer_kv_mamba_pf_lf(host, out, np.array([0, 9], np.int64), np.array([0, 1], np.int64), 0, 32, 64)
    with pytest.raises(Exception, match="layer"):
        kv.transfer_kv_mamba_pf_lf(host, out, np.array([0], np.int64), np.array([0], np.int64), 2, 32, 64)
    assert not out.any()


def test_sglang_imports_them_from_its_jit_module():
    from hicache_io import sglang as hsg

    assert hsg.JIT_OPS["sglang.kernels.ops.mamba.transfer_mamba"] == ("transfer_kv_mamba_pf_lf", "transfer_kv_mamba_lf_pf")
