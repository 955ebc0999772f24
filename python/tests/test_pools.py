"""The pools from Python on cpu and wgpu (lavapipe in CI): every host layout against a numpy
model of its shape, sglang's errors with its exception class and nothing moved, the seed
(a layer-sharded DSA indexer backup into page_first), and ``matrix`` / ``check`` as data."""

import os

import numpy as np
import pytest

import hicache_io
from hicache_io import Device, DevicePool, HostPool

SEED_MESSAGE = "Layer-sharded DSA indexer HiCache backup with page_first layout is not supported without a per-layer LF->PF kernel."


def device(name):
    try:
        return Device(name)
    except RuntimeError as e:
        required = os.environ.get("CI") or os.environ.get("HICACHE_REQUIRE_WGPU")
        if name == "wgpu" and required:
            raise
        pytest.skip(f"{name}: {e}")


EXECUTORS = ["cpu", "wgpu"]
ITEM, PAGE, LAYERS, HEADS = 64, 4, 3, 2


def host_view(buf, layout, size, item=ITEM, layers=LAYERS, page=PAGE, heads=HEADS):
    """The host buffer as ``[token][layer][item]`` bytes, whatever its layout."""
    b = np.asarray(buf, np.uint8)
    pages = size // page
    if layout == "layer_first":
        return b.reshape(layers, size, item).transpose(1, 0, 2)
    if layout == "page_first":
        return b.reshape(size, layers, item)
    if layout == "page_first_direct":
        return b.reshape(pages, layers, page, item).transpose(0, 2, 1, 3).reshape(size, layers, item)
    if layout == "page_head":
        d = item // heads
        return b.reshape(pages, heads, page, layers, d).transpose(0, 2, 3, 1, 4).reshape(size, layers, item)
    raise AssertionError(layout)


def filled_pools(dev, layout, profile="extended", kind="mha"):
    dpool = DevicePool(dev, kind, ITEM, 64, PAGE, LAYERS)
    hpool = HostPool(dpool, layout, 60, head_num=HEADS if layout == "page_head" else 1, profile=profile)
    rng = np.random.default_rng(9)
    comps = 2 if kind == "mha" else 1
    layers = [[rng.integers(0, 256, 64 * ITEM, dtype=np.uint8) for _ in range(LAYERS)] for _ in range(comps)]
    for c in range(comps):
        for s in range(LAYERS):
            dpool.write_buffer(c, s, layers[c][s].tobytes())
    return dpool, hpool, layers


IO = {"layer_first": "kernel", "page_first": "kernel", "page_first_direct": "direct", "page_head": "kernel"}


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("layout", list(IO))
def test_backup_then_load_every_layout(executor, layout):
    dev = device(executor)
    dpool, hpool, layers = filled_pools(dev, layout)
    di = np.arange(8, 16, dtype=np.int64)
    hi = np.arange(20, 28, dtype=np.int64)
    hpool.backup_from_device_all_layer(dpool, hi, di, IO[layout])
    for c in range(2):
        view = host_view(hpool.read_buffer(c), layout, hpool.size)
        for s in range(LAYERS):
            want = layers[c][s].reshape(64, ITEM)[di]
            np.testing.assert_array_equal(view[hi, s], want)
    # Load layer 1 into other device slots.
    back = np.arange(40, 48, dtype=np.int64)
    hpool.load_to_device_per_layer(dpool, hi, back, 1, IO[layout])
    got = dpool.read_buffer(0, 1).reshape(64, ITEM)
    np.testing.assert_array_equal(got[back], layers[0][1].reshape(64, ITEM)[di])


@pytest.mark.parametrize("executor", EXECUTORS)
def test_sglang_errors_move_nothing(executor):
    dev = device(executor)
    dpool, hpool, _ = filled_pools(dev, "page_first", profile="sglang")
    before = hpool.read_buffer(0)
    idx = np.arange(4, dtype=np.int64)
    with pytest.raises(ValueError, match="^Unsupported layout: page_first$"):
        hpool.backup_from_device_all_layer(dpool, idx, idx, "direct")
    with pytest.raises(RuntimeError, match="^Source and destination indices must have the same length$"):
        hpool.backup_from_device_all_layer(dpool, idx, idx[:3], "kernel")
    with pytest.raises(IndexError):
        hpool.backup_from_device_all_layer(dpool, idx + 100, idx, "kernel")
    with pytest.raises(ValueError, match="^Unsupported IO backend: auto$"):
        hpool.backup_from_device_all_layer(dpool, idx, idx, "auto")
    np.testing.assert_array_equal(hpool.read_buffer(0), before)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_the_seed_layer_sharded_dsa_page_first_backup(executor):
    dev = device(executor)
    page = 4
    item = 132 * page  # DeepSeek V3.2's indexer: 132 B per token per layer, one page per item

    def dsa_shard_pools(profile):
        d = DevicePool(dev, "dsa", 132, 8, page, 4, layer_shard=(2, 4))
        return d, HostPool(d, "page_first", 32, profile=profile)

    tokens_dev = np.arange(8, 16, dtype=np.int64)   # device pages 2, 3
    tokens_host = np.arange(20, 28, dtype=np.int64)  # host pages 5, 6
    d, h = dsa_shard_pools("sglang")
    with pytest.raises(ValueError) as e:
        h.backup_from_device_all_layer(d, tokens_host, tokens_dev, "kernel")
    assert str(e.value) == SEED_MESSAGE
    d, h = dsa_shard_pools("extended")
    rng = np.random.default_rng(1)
    data = [rng.integers(0, 256, 8 * item, dtype=np.uint8) for _ in range(2)]
    for s in range(2):
        d.write_buffer(0, s, data[s].tobytes())
    h.backup_from_device_all_layer(d, tokens_host, tokens_dev, "kernel")
    view = h.read_buffer(0).reshape(-1, 2, item)
    for s in range(2):
        np.testing.assert_array_equal(view[5:7, s], data[s].reshape(8, item)[2:4])


def test_executors_agree_byte_for_byte():
    wgpu = device("wgpu")
    out = []
    for dev in (Device("cpu"), wgpu):
        dpool, hpool, _ = filled_pools(dev, "page_head")
        hpool.backup_from_device_all_layer(dpool, np.arange(4, 12), np.arange(30, 38), "kernel")
        hpool.backup_from_device_per_layer(dpool, np.arange(12, 16), np.arange(0, 4), 2)
        out.append((hpool.read_buffer(0), hpool.read_buffer(1)))
    for a, b in zip(out[0], out[1]):
        np.testing.assert_array_equal(a, b)


def test_storage_helpers_round_trip():
    dpool, hpool, _ = filled_pools(Device("cpu"), "page_first")
    hpool.backup_from_device_all_layer(dpool, np.arange(8, 12), np.arange(0, 4))
    page = hpool.get_data_page(8)
    assert len(page) == len(hpool.get_dummy_flat_data_page())
    hpool.set_from_flat_data_page(16, page)
    np.testing.assert_array_equal(hpool.get_data_page(16), page)
    meta = hpool.get_page_buffer_meta(np.arange(16, 20))
    assert [m[0] for m in meta] == [0, 1]


def test_matrix_and_check_as_data():
    cells = hicache_io.matrix(profile="sglang", pools=["dsa"], dsa_page_size=64)
    assert any(SEED_MESSAGE == c["outcome"].get("Err") for c in cells)
    rows = hicache_io.check("cpu", rounds=1)
    assert rows and all(r["tally"]["matched"] == r["tally"]["cases"] == 1 for r in rows)
    with pytest.raises(ValueError, match="unknown"):
        Device("tpu")


def test_pool_buffers_take_arrays_and_bytes():
    dpool = DevicePool(Device("cpu"), "mla", 16, 8, 1, 1)
    data = np.arange(128, dtype=np.uint8)
    dpool.write_buffer(0, 0, data)
    got = dpool.read_buffer(0, 0)
    assert got.dtype == np.uint8 and got.flags.writeable
    np.testing.assert_array_equal(got, data)
    dpool.write_buffer(0, 0, bytes(128))
    assert not dpool.read_buffer(0, 0).any()
    with pytest.raises(ValueError, match="expected 128 bytes"):
        dpool.write_buffer(0, 0, bytes(127))


@pytest.mark.parametrize("executor", EXECUTORS)
def test_pools_shared_by_threads(executor):
    """sglang's cache controller drives one pool pair from several threads: per-layer loads on
    one, all-layer and per-layer backups on others, storage page reads on another. Each thread
    owns its slots, so the end state is known whatever the interleaving; every byte is checked,
    and a page read mid-backup is either all old or all new bytes, never torn."""
    import threading

    dev = device(executor)
    slots, rounds = 64, 1000
    dpool = DevicePool(dev, "mha", ITEM, slots, PAGE, LAYERS)
    hpool = HostPool(dpool, "page_first", slots - PAGE, profile="extended")
    rng = np.random.default_rng(21)
    dev0 = [[rng.integers(0, 256, slots * ITEM, dtype=np.uint8) for _ in range(LAYERS)] for _ in range(2)]
    for c in range(2):
        for s in range(LAYERS):
            dpool.write_buffer(c, s, dev0[c][s].tobytes())
    host0 = [rng.integers(0, 256, hpool.buffer_bytes, dtype=np.uint8) for _ in range(2)]
    for c in range(2):
        hpool.write_buffer(c, host0[c].tobytes())
    r = lambda a, b: np.arange(a, b, dtype=np.int64)  # noqa: E731
    loads_h, loads_d = r(0, 16), r(0, 16)  # host 0..15 → device 0..15 (layer by layer)
    backup_d, backup_h = r(32, 48), r(32, 48)  # device 32..47 → host 32..47 (all layers)
    layer_d, layer_h = r(16, 32), r(16, 32)  # device 16..31 → host 16..31 (one layer a call)
    errors = []

    def page_of(buf_k, buf_v, start):
        view = lambda b: b.reshape(hpool.size, LAYERS, ITEM)[start:start + PAGE]  # noqa: E731
        return np.concatenate([view(buf_k).reshape(-1), view(buf_v).reshape(-1)])

    def dev_page(start):
        k = np.stack([dev0[0][layer].reshape(slots, ITEM)[start:start + PAGE] for layer in range(LAYERS)], 1)
        v = np.stack([dev0[1][layer].reshape(slots, ITEM)[start:start + PAGE] for layer in range(LAYERS)], 1)
        return np.concatenate([k.reshape(-1), v.reshape(-1)])

    def run(body):
        def go():
            try:
                for i in range(rounds):
                    body(i)
            except Exception as e:  # noqa: BLE001 - reported by the main thread
                errors.append(repr(e))
        return threading.Thread(target=go)

    def loads(i):
        hpool.load_to_device_per_layer(dpool, loads_h, loads_d, i % LAYERS, IO["page_first"])

    def backups(i):
        hpool.backup_from_device_all_layer(dpool, backup_h, backup_d, "kernel")

    def layer_backups(i):
        hpool.backup_from_device_per_layer(dpool, layer_h, layer_d, i % LAYERS, "kernel")

    def reads(i):
        start = int(backup_h[(i * PAGE) % len(backup_h)])
        got = np.asarray(hpool.get_data_page(start), np.uint8)
        old, new = page_of(host0[0], host0[1], start), dev_page(start)
        if not (np.array_equal(got, old) or np.array_equal(got, new)):
            raise AssertionError(f"page {start} read torn")
        start = int(loads_h[(i * PAGE) % len(loads_h)])
        if not np.array_equal(np.asarray(hpool.get_data_page(start), np.uint8), page_of(host0[0], host0[1], start)):
            raise AssertionError(f"page {start} changed")

    threads = [run(f) for f in (loads, backups, layer_backups, reads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hpool.synchronize()
    assert not errors, errors[:3]
    for c in range(2):
        host = host_view(hpool.read_buffer(c), "page_first", hpool.size)
        want = host_view(host0[c], "page_first", hpool.size).copy()
        for layer in range(LAYERS):
            d = dev0[c][layer].reshape(slots, ITEM)
            want[backup_h, layer] = d[backup_d]
            want[layer_h, layer] = d[layer_d]
        assert np.array_equal(host, want), f"host component {c}"
        for layer in range(LAYERS):
            got = np.asarray(dpool.read_buffer(c, layer), np.uint8).reshape(slots, ITEM)
            want = dev0[c][layer].reshape(slots, ITEM).copy()
            want[loads_d] = host_view(host0[c], "page_first", hpool.size)[loads_h, layer]
            assert np.array_equal(got, want), f"device component {c} layer {layer}"


@pytest.mark.parametrize("executor", EXECUTORS)
def test_shared_pools_wait_only_for_the_pages_they_share(executor):
    """While host page 0 is held as a load reads it, a backup into host page 2 and a load from
    page 0 run at once; a backup into page 0 waits for the hold, then lands. (Under one lock
    per pool, every one of them waited.)"""
    import threading

    dev = device(executor)
    dpool = DevicePool(dev, "mha", ITEM, 32, PAGE, LAYERS)
    hpool = HostPool(dpool, "page_first", 16, profile="extended")
    for c in range(2):
        for s in range(LAYERS):
            dpool.write_buffer(c, s, bytes([1 + c + s]) * (32 * ITEM))
    r = lambda a, b: np.arange(a, b, dtype=np.int64)  # noqa: E731
    page0, page2 = r(0, PAGE), r(2 * PAGE, 3 * PAGE)

    def started(body):
        t = threading.Thread(target=body)
        t.start()
        return t

    def while_held():
        free = [
            started(lambda: hpool.backup_from_device_all_layer(dpool, page2, r(8, 12), "kernel")),
            started(lambda: hpool.load_to_device_per_layer(dpool, page0, r(20, 24), 1, "kernel")),
        ]
        for t in free:
            t.join(timeout=20)
            assert not t.is_alive(), "a call on other pages (or reading the held one) waited for the hold"
        blocked = started(lambda: hpool.backup_from_device_all_layer(dpool, page0, r(4, 8), "kernel"))
        blocked.join(timeout=0.3)
        assert blocked.is_alive(), "a backup into the held page did not wait"
        return blocked

    blocked = hpool._while_held(page0, False, while_held)
    blocked.join(timeout=20)
    assert not blocked.is_alive()
    host = host_view(hpool.read_buffer(1), "page_first", hpool.size)
    assert (host[0:4, 2] == 2 + 2).all() and (host[8:12, 0] == 2).all()


@pytest.mark.skipif("wgpu" not in EXECUTORS, reason="no wgpu adapter here")
def test_a_lost_device_raises_device_lost_and_a_new_one_works():
    """A wgpu device lost under its pools (destroyed here, as a driver reset would): every call
    on it and its pools raises DeviceLostError, a RuntimeError, again and again; a new Device on
    the same adapter moves the right bytes."""
    from hicache_io import DeviceLostError

    def pair(dev):
        dpool = DevicePool(dev, "mla", ITEM, 32, PAGE, LAYERS)
        for s in range(LAYERS):
            dpool.write_buffer(0, s, np.full(32 * ITEM, s + 1, np.uint8).tobytes())
        return dpool, HostPool(dpool, "layer_first", 32, profile="extended")

    idx = np.arange(0, 8, dtype=np.int64)
    lost = Device("wgpu")
    dpool, hpool = pair(lost)
    hpool.backup_from_device_all_layer(dpool, idx, idx)
    lost._lose()
    for _ in range(2):
        with pytest.raises(DeviceLostError, match="device lost"):
            hpool.backup_from_device_all_layer(dpool, idx, idx)
        with pytest.raises(DeviceLostError):
            hpool.load_to_device_per_layer(dpool, idx, idx, 1)
        with pytest.raises(DeviceLostError):
            dpool.read_buffer(0, 0)
        with pytest.raises(RuntimeError):
            DevicePool(lost, "mla", ITEM, 32, PAGE, LAYERS)
    dpool, hpool = pair(Device("wgpu"))
    hpool.backup_from_device_all_layer(dpool, idx, idx)
    host = np.asarray(hpool.read_buffer(0), np.uint8).reshape(LAYERS, -1, ITEM)
    for s in range(LAYERS):
        assert (host[s, :8] == s + 1).all() and not host[s, 8:].any(), f"layer {s}"
