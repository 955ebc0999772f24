"""Item checksums from Python: on by default in profile ``extended`` (off for ``sglang``), a
damaged host item fails its load with ``IntegrityError`` naming it while the rest lands, pages
carry their checksums between pools, and writes the pool cannot check are forgotten, never
reported as corruption."""


import numpy as np
import pytest

import hicache_io
from hicache_io import Device, DevicePool, HostPool, IntegrityError

from common import executors

ITEM, PAGE, LAYERS = 64, 4, 3


EXECUTORS = executors()


def integrity_pools(profile="extended", integrity=None, layout="page_first", executor="cpu"):
    """``(device pool, host pool)``: an MHA device pool of random bytes and a host pool of
    ``profile`` with item checksums as ``integrity`` says (the profile's default when ``None``)."""
    dpool = DevicePool(Device(executor), "mha", ITEM, 32, PAGE, LAYERS)
    kw = {} if integrity is None else {"integrity": integrity}
    hpool = HostPool(dpool, layout, 32, profile=profile, **kw)
    rng = np.random.default_rng(3)
    for c in range(2):
        for s in range(LAYERS):
            dpool.write_buffer(c, s, rng.integers(0, 256, 32 * ITEM, dtype=np.uint8).tobytes())
    return dpool, hpool


@pytest.mark.parametrize("executor", EXECUTORS)
def test_defaults_and_opt_out(executor):
    assert integrity_pools(executor=executor)[1].integrity
    assert not integrity_pools(profile="sglang", executor=executor)[1].integrity
    assert integrity_pools(profile="sglang", integrity=True, executor=executor)[1].integrity
    assert not integrity_pools(integrity=False, executor=executor)[1].integrity
    assert integrity_pools(integrity=False, executor=executor)[1].integrity_stats() is None


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_damaged_item_fails_its_load_and_the_rest_lands(executor):
    dpool, hpool = integrity_pools(executor=executor)
    hi = np.arange(8, 16, dtype=np.int64)
    di = np.arange(0, 8, dtype=np.int64)
    hpool.backup_from_device_all_layer(dpool, hi, di)
    # page_first: token t, layer l at (t * LAYERS + l) * ITEM; damage token 10, layer 1, V.
    off = (10 * LAYERS + 1) * ITEM + 5
    byte = np.asarray(hpool.read_buffer(1))[off]
    hpool.inject_host_corruption(1, off, bytes([byte ^ 0x40]))
    back = np.arange(16, 24, dtype=np.int64)
    with pytest.raises(IntegrityError, match="host item 10 of layer 1") as e:
        hpool.load_to_device_per_layer(dpool, hi, back, 1)
        # cuda's plain calls return once enqueued: the next synchronize raises.
        hpool.synchronize()
    assert isinstance(e.value, RuntimeError)
    assert [(layer, comp, h, d) for layer, comp, h, d, _, _ in e.value.items] == [(1, 1, 10, 18)]
    # Every item landed, the damaged one as read.
    host_v = np.asarray(hpool.read_buffer(1)).reshape(-1, LAYERS, ITEM)[:, 1]
    dev_v = np.asarray(dpool.read_buffer(1, 1)).reshape(32, ITEM)
    assert (dev_v[16:24] == host_v[8:16]).all()
    stats = hpool.integrity_stats()
    assert stats["recorded"] == 8 * LAYERS * 2 and stats["mismatched"] == 1 and stats["verified"] == 15


@pytest.mark.parametrize("executor", EXECUTORS)
def test_pages_carry_their_checksums(executor):
    dpool, hpool = integrity_pools(executor=executor)
    hi = np.arange(0, 8, dtype=np.int64)
    hpool.backup_from_device_all_layer(dpool, hi, hi)
    page, sums = hpool.get_data_page(4), hpool.page_checksums(4)
    assert len(sums) == 2 * LAYERS * PAGE and all(s is not None for s in sums)
    _, other = integrity_pools(executor=executor)
    other.set_from_flat_data_page_checked(12, page, sums)
    assert other.page_checksums(12) == sums
    bad = np.array(page, copy=True)
    bad[7] ^= 1
    with pytest.raises(IntegrityError):
        other.set_from_flat_data_page_checked(16, bad, sums)
    # Written in place by something else: recomputed once known good, or forgotten.
    other.forget_page_checksums([12])
    assert all(s is None for s in other.page_checksums(12))
    other.recompute_page_checksums([12])
    assert other.page_checksums(12) == sums


@pytest.mark.parametrize("executor", EXECUTORS)
def test_unverifiable_writes_are_never_reported_as_corrupt(executor):
    dpool, hpool = integrity_pools(layout="layer_first", executor=executor)
    hi = np.arange(8, 16, dtype=np.int64)
    hpool.backup_from_device_all_layer(dpool, hi, hi)
    hpool.backup_from_device_all_layer(dpool, hi, hi, io_backend="direct")
    hpool.write_buffer(0, np.asarray(hpool.read_buffer(0)).tobytes())
    hpool.load_to_device_per_layer(dpool, hi, hi, 0)
    assert hpool.integrity_stats()["unverified"] == 16


def test_the_error_class_is_exported():
    assert hicache_io.IntegrityError is IntegrityError
    assert issubclass(IntegrityError, RuntimeError)
