"""hicache-io host pools through a real Mooncake Store (L3), started here on loopback: round trips
of every pool kind and contiguous-page layout on the cpu and wgpu executors (back up, put, wipe,
get, load: the device bytes come back), a second process reading what this one wrote, and the
faults: a partial batch, an object evicted between exists and get, a full store, the master
killed, a pool unregistered or dropped while registered.

Needs ``pip install mooncake-transfer-engine-non-cuda`` and Debian's ``libibverbs1 libnl-3-200
libnl-route-3-200``; skips without them unless ``HICACHE_REQUIRE_MOONCAKE=1`` (CI sets it)."""

import gc
import os
import re
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest

from common import P, build, executors, io_for, make_store, mooncake_problem, page_meta, tokens  # noqa: E402

if mooncake_problem() is not None:
    pytest.skip(mooncake_problem(), allow_module_level=True)

import hicache_io  # noqa: E402
from hicache_io.storage import HiCacheStorageConfig, LocalMaster, MooncakeStore, MooncakeStoreConfig, StorageError  # noqa: E402


def Master(lease_ms=200):
    """A master of the test's own on free loopback ports; short leases, so objects can be removed."""
    return LocalMaster(lease_ms=lease_ms)


# (kind, layout, head_num, bytes per token, layers, shard, drafts)
POOLS = [
    ("mha", "page_first", 1, 256, 3, None, 0),
    ("mha", "page_first_direct", 1, 256, 3, None, 0),
    ("mha", "page_head", 2, 256, 3, None, 0),
    ("mha", "page_first_direct_hg", 4, 256, 3, None, 0),
    ("mha", "page_unified", 2, 256, 3, None, 0),
    ("mla", "page_unified", 1, 576, 3, None, 0),
    ("mha", "page_first", 1, 128, 4, (1, 3), 0),
    ("mla", "page_first", 1, 576, 3, None, 0),
    ("mla", "page_first_direct", 1, 576, 3, None, 1),
    ("dsa", "page_first", 1, 132, 4, (2, 4), 1),
    ("dsa", "page_first_direct", 1, 132, 4, None, 0),
]

@pytest.mark.parametrize("executor", executors())
@pytest.mark.parametrize("pool", POOLS, ids=lambda p: f"{p[0]}-{p[1]}-{'shard' if p[5] else 'all'}-d{p[6]}")
def test_round_trip_through_the_store(store, executor, pool):
    kind, layout, heads, bpt, layers, shard, drafts = pool
    device, dev, host = build(executor, kind, layout, heads, bpt, layers, shard, drafts)
    dev_tokens, host_tokens = tokens([3, 0, 7, 9]), tokens([1, 2, 5, 11])
    host.backup_from_device_all_layer(dev, host_tokens, dev_tokens, io_for(layout))
    before = [host.read_buffer(c) for c in range(host.components)]
    keys = [f"{uuid.uuid4().hex}" for _ in range(4)]
    store.register_mem_pool_host(host)
    try:
        assert store.batch_set_v1(keys, host_tokens) == [True] * 4
        assert store.batch_exists(keys) == 4
        assert store.batch_set_v1(keys, host_tokens) == [True] * 4  # already there: written
        for c in range(host.components):
            host.write_buffer(c, np.zeros(host.buffer_bytes, np.uint8))
        # Read back into other host pages (the load's slots), then load into a fresh device pool.
        read_tokens = tokens([4, 6, 8, 10])
        assert store.batch_get_v1(keys, read_tokens) == [True] * 4
        own_names = "_hio-" in store.object_keys(keys[0])[0]
    finally:
        store.unregister_mem_pool_host()
    for c in range(host.components):
        got, want = host.read_buffer(c), before[c]
        for src_page, dst_page in zip([1, 2, 5, 11], [4, 6, 8, 10]):
            idx_src = page_meta(host, src_page)[c]
            idx_dst = page_meta(host, dst_page)[c]
            assert np.array_equal(got[idx_dst[1] : idx_dst[1] + idx_dst[2]], want[idx_src[1] : idx_src[1] + idx_src[2]])
    # Load every layer into a fresh (zeroed) device pool on the same executor.
    fresh = hicache_io.DevicePool(device, kind, bpt, dev.slots, P, layers, layer_shard=shard, drafts=drafts)
    layer_num, start, end, nd, _ = host.layer_map
    for layer in list(range(start, end)) + [layer_num + k for k in range(nd)]:
        load = host.load_draft_to_device if layer >= layer_num else host.load_to_device_per_layer
        load(fresh, read_tokens, dev_tokens, layer, io_for(layout))
    if host.integrity:
        # Pages under hicache-io's own names were verified against their trailers, then their
        # items' checksums recorded, so the loads verified every item; sglang-named objects carry
        # no trailer, so their pages load as unverified. Nothing is ever reported corrupt.
        # wgpu's and cuda's direct copies (buffer-to-buffer, DMA) compute no checksums: their
        # direct loads read every item unverified.
        verifying = own_names and (executor == "cpu" or io_for(layout) == "kernel")
        stats = host.integrity_stats()
        assert stats["mismatched"] == 0 and (stats["verified"] > 0) == verifying and (stats["unverified"] > 0) != verifying, stats
    # Device slots the load wrote hold the original device bytes.
    dev_units = dev_tokens if kind != "dsa" else dev_tokens[::P] // P
    for c in range(2 if kind == "mha" else 1):
        for b in range(fresh.buffer_count):
            got, orig = fresh.read_buffer(c, b), dev.read_buffer(c, b)
            ib = fresh.item_bytes
            for u in dev_units:
                assert np.array_equal(got[u * ib : (u + 1) * ib], orig[u * ib : (u + 1) * ib]), (c, b, u)


def test_keys_follow_sglang_for_sglang_shaped_pools(store):
    _, dev, host = build("cpu", "mha", "page_first", 1, 256, 3, None, 0)
    store.register_mem_pool_host(host)
    try:
        prefix = store.key_prefix
        assert store.object_keys("abc") == [f"{prefix}_abc_0_k", f"{prefix}_abc_0_v"]
    finally:
        store.unregister_mem_pool_host()
    _, dev, host = build("cpu", "mla", "page_first", 1, 576, 3, None, 0)
    store.register_mem_pool_host(host)
    try:
        assert store.object_keys("abc") == [f"{store.key_prefix}_abc__k"]
    finally:
        store.unregister_mem_pool_host()
    _, dev, host = build("cpu", "dsa", "page_first", 1, 132, 4, (2, 4), 1)
    store.register_mem_pool_host(host)
    try:
        (k,) = store.object_keys("abc")
        assert re.fullmatch(re.escape(f"{store.key_prefix}_abc__hio-dsa-pf-i1056-L2-4+d1") + r"-n[0-9a-f]{12}_k", k), k
    finally:
        store.unregister_mem_pool_host()


def test_a_second_process_reads_what_this_one_wrote(master, store, tmp_path):
    _, dev, host = build("cpu", "dsa", "page_first", 1, 132, 4, (2, 4), 1)
    host_tokens = tokens([1, 2, 3])
    host.backup_from_device_all_layer(dev, host_tokens, tokens([0, 5, 7]), "kernel")
    keys = [uuid.uuid4().hex for _ in range(3)]
    store.register_mem_pool_host(host)
    try:
        assert store.batch_set_v1(keys, host_tokens) == [True] * 3
        want = np.concatenate([host.get_data_page(int(t)) for t in host_tokens[::P]])
        np.save(tmp_path / "want.npy", want)
        reader = textwrap.dedent(
            f"""
            import numpy as np, hicache_io
            from hicache_io.storage import HiCacheStorageConfig, MooncakeStore
            cfg = HiCacheStorageConfig(model_name={store.storage_config.model_name!r}, extra_config={{"master_server_address": {master.address!r}, "global_segment_size": 16 << 20, "local_buffer_size": 4 << 20}})
            s = MooncakeStore(cfg, {{}})
            dev = hicache_io.DevicePool(hicache_io.Device("cpu"), "dsa", 132, 12, {P}, 4, layer_shard=(2, 4), drafts=1)
            host = hicache_io.HostPool(dev, "page_first", {16 * P}, profile="extended")
            s.register_mem_pool_host(host)
            toks = np.concatenate([np.arange(p * {P}, (p + 1) * {P}) for p in (9, 10, 11)])
            assert s.batch_exists({keys!r}) == 3
            assert s.batch_get_v1({keys!r}, toks) == [True] * 3, s.last_error
            got = np.concatenate([host.get_data_page(int(t)) for t in toks[::{P}]])
            assert np.array_equal(got, np.load({str(tmp_path / 'want.npy')!r}))
            s.close()
            print("read", len(got))
            """
        )
        out = subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "read" in out.stdout
    finally:
        store.unregister_mem_pool_host()


def test_a_partial_batch_and_an_evicted_object(store):
    _, dev, host = build("cpu", "mha", "page_first_direct", 1, 256, 3, None, 0)
    host.backup_from_device_all_layer(dev, tokens([0, 1, 2]), tokens([4, 5, 6]), "direct")
    keys = [uuid.uuid4().hex for _ in range(3)]
    store.register_mem_pool_host(host)
    try:
        assert store.batch_set_v1([keys[0], keys[2]], tokens([0, 2])) == [True, True]
        # Page 1 missing: sglang's convention, leading hits only.
        assert store.batch_exists(keys) == 1
        pattern = [np.full(host.buffer_bytes, 7, np.uint8) for _ in range(host.components)]
        for c in range(host.components):
            host.write_buffer(c, pattern[c])
        assert store.batch_get_v1(keys, tokens([8, 9, 10])) == [True, False, True]
        assert isinstance(store.last_error, StorageError) and store.last_error.code == -704
        assert keys[1] in store.last_error.keys[0]
        # The missing page's slots are untouched; only the hit pages moved.
        meta = page_meta(host, 9)
        for comp, off, n in meta:
            assert (host.read_buffer(comp)[off : off + n] == 7).all()
        untouched = page_meta(host, 12)
        for comp, off, n in untouched:
            assert (host.read_buffer(comp)[off : off + n] == 7).all()
        # Evicted between exists and get (the lease has run out, so the object can be removed).
        assert store.batch_exists([keys[2]]) == 1
        time.sleep(0.3)
        for k in store.object_keys(keys[2]):
            assert store.store.remove(k) == 0
        assert store.batch_get_v1([keys[0], keys[2]], tokens([8, 10])) == [True, False]
        assert store.last_error.code == -704
    finally:
        store.unregister_mem_pool_host()


def test_a_full_store_fails_the_pages_that_do_not_fit():
    # A master of its own: the store's capacity is every client's segment together.
    m = Master()
    small = make_store(m, segment=16 << 20)  # Mooncake's smallest segment
    try:
        _, dev, host = build("cpu", "mla", "page_first", 1, 32768, 4, None, 0, pages=24, host_pages=24)  # 1 MiB pages
        host.backup_from_device_all_layer(dev, tokens(range(24)), tokens(range(24)), "kernel")
        small.register_mem_pool_host(host)
        keys = [uuid.uuid4().hex for _ in range(24)]
        res = small.batch_set_v1(keys, tokens(range(24)))
        assert res[0] and not all(res), "16 MiB holds some, not all, of 24 pages of 1 MiB"
        assert small.last_error.code == -200
        small.raise_errors = True
        with pytest.raises(StorageError, match="NO_AVAILABLE_HANDLE"):
            small.batch_set_v1([uuid.uuid4().hex for _ in range(24)], tokens(range(24)))
    finally:
        small.close()
        m.stop()


def test_the_master_killed_mid_session():
    m = Master()
    s = make_store(m)
    host = None
    try:
        _, dev, host = build("cpu", "mha", "page_first", 1, 256, 3, None, 0)
        host.backup_from_device_all_layer(dev, tokens([0, 1]), tokens([2, 3]), "kernel")
        s.register_mem_pool_host(host)
        keys = [uuid.uuid4().hex for _ in range(2)]
        assert s.batch_set_v1(keys, tokens([0, 1])) == [True, True]
        before = [host.read_buffer(c) for c in range(2)]
        m.stop()
        assert s.batch_get_v1(keys, tokens([4, 5])) == [False, False]
        assert s.last_error.code == -900 and "master is unreachable" in str(s.last_error)
        assert s.batch_exists(keys) == 0
        for c in range(2):
            assert np.array_equal(host.read_buffer(c), before[c]), "a failed get wrote the host pool"
    finally:
        m.stop()
        # A master back on the same port answers the close's calls at once; with none there the
        # close waits out Mooncake's own RPC timeouts (about 10 s).
        try:
            again = LocalMaster(port=m.port, lease_ms=200)
        except Exception:  # noqa: BLE001 - the port taken meanwhile: the close waits, no more
            again = None
        try:
            s.close()
        finally:
            if again is not None:
                again.stop()


def test_pools_cannot_vanish_while_registered(store):
    _, dev, host = build("cpu", "mla", "page_first", 1, 576, 3, None, 0)
    host.backup_from_device_all_layer(dev, tokens([0]), tokens([1]), "kernel")
    refs = sys.getrefcount(host)
    store.register_mem_pool_host(host)
    assert sys.getrefcount(host) > refs, "the store must hold the pool while registered"
    try:
        with pytest.raises(RuntimeError, match="already registered"):
            store.register_mem_pool_host(build("cpu", "mla", "page_first", 1, 576, 3, None, 0)[2])
        key = uuid.uuid4().hex
        want = host.get_data_page(0)
        del host, dev
        gc.collect()
        # The store holds the pool: its memory is still there for Mooncake to read and write.
        assert store.batch_set_v1([key], tokens([0])) == [True]
        assert store.batch_get_v1([key], tokens([3])) == [True]
        assert np.array_equal(store.mem_pool_host.get_data_page(3 * P), want)
    finally:
        store.unregister_mem_pool_host()
    with pytest.raises(RuntimeError, match="no host pool is registered"):
        store.batch_get_v1([key], tokens([3]))


class _ClosingClient:
    """A Mooncake client that records how often ``watched`` is referenced when it closes."""

    def __init__(self, inner, watched):
        self.inner, self.watched, self.refs_at_close = inner, watched, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def close(self):
        self.refs_at_close = sys.getrefcount(self.watched)
        return self.inner.close()


def test_registered_memory_is_released_only_after_the_client_closes(master):
    """Mooncake's unregister_buffer does not wait for its transfers, and a failed batch call can
    return while others still write: a pool (and the store's staging buffers) stays referenced
    after it is unregistered, until the client has closed; a store dropped without close()
    closes its client first, then lets the pool go."""
    _, dev, host = build("cpu", "mha", "page_first_direct", 1, 256, 3, None, 0)  # own names: checksummed, staged
    host.backup_from_device_all_layer(dev, tokens([0]), tokens([1]), "direct")
    for dropped in (False, True):
        s = make_store(master)
        s.store = client = _ClosingClient(s.store, host)
        # Refcounts are compared with each other only, so that the test holds whatever an
        # interpreter counts for the call itself: here the test's and the client's.
        base = sys.getrefcount(host)
        s.register_mem_pool_host(host)
        sealed = s.registered.sealed
        assert sealed is not None
        key = uuid.uuid4().hex
        assert s.batch_set_v1([key], tokens([0])) == [True]
        s.unregister_mem_pool_host()
        assert s.mem_pool_host is None
        assert sys.getrefcount(host) > base, "an unregistered pool must outlive the client"
        kept = sys.getrefcount(sealed)
        if dropped:
            del s
            gc.collect()
        else:
            s.close()
        assert client.refs_at_close is not None and client.refs_at_close > base, "the client closed after the pool was let go"
        assert sys.getrefcount(sealed) < kept, "an unregistered staging buffer must outlive the client, and only it"
        assert sys.getrefcount(host) == base, "the pool is let go once the client has closed"
        client.watched = None
        del client, sealed


def test_layer_first_is_refused_with_sglangs_message(store):
    _, _, host = build("cpu", "mha", "layer_first", 1, 256, 3, None, 0)
    with pytest.raises(ValueError, match="Mooncake layer_first multi-buffer is only supported for MLA host KV pool"):
        store.register_mem_pool_host(host)


def test_config_from_extra_config_file_and_env(tmp_path, monkeypatch):
    c = MooncakeStoreConfig.load({"master_server_address": "127.0.0.1:1", "global_segment_size": "1gb", "protocol": "tcp"})
    assert (c.master_server_address, c.global_segment_size, c.protocol) == ("127.0.0.1:1", 1 << 30, "tcp")
    path = tmp_path / "mooncake.json"
    path.write_text('{"master_server_address": "127.0.0.1:2", "local_buffer_size": 1048576}')
    monkeypatch.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(path))
    assert MooncakeStoreConfig.load({}).master_server_address == "127.0.0.1:2"
    monkeypatch.delenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH")
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:3")
    assert MooncakeStoreConfig.load(None).master_server_address == "127.0.0.1:3"


class _Tensor:
    """The part of a torch tensor sglang's pool hands the store: a data pointer and a size."""

    def __init__(self, a):
        self.a = a

    def data_ptr(self):
        return self.a.ctypes.data

    def numel(self):
        return self.a.size

    def element_size(self):
        return self.a.itemsize


class FakeSglangMhaPool:
    """sglang's MHA host pool as its Mooncake backend sees it (page_first: ``kv_buffer`` of shape
    ``(2, size, L, H, D)``; ``get_page_buffer_meta`` per sglang's formula: K at
    ``base + i * L * H * D * itemsize``, V one component further, ``L * P * H * D * itemsize``
    bytes each, K and V interleaved per page)."""

    layout = "page_first"

    def __init__(self, size, layers, item_bytes, page_size):
        self.page_size, self.layers, self.item = page_size, layers, item_bytes
        self.buf = np.zeros((2, size, layers, item_bytes), np.uint8)
        self.kv_buffer = _Tensor(self.buf)

    def get_page_buffer_meta(self, indices):
        # As sglang's pools: a tensor of host indices, read through tolist() (a list fails here
        # as it fails there).
        indices = indices.tolist()
        base, v_offset = self.buf.ctypes.data, self.buf[0].nbytes
        ptrs, sizes = [], []
        for i in range(0, len(indices), self.page_size):
            k = base + int(indices[i]) * self.layers * self.item
            ptrs += [k, k + v_offset]
            sizes += [self.layers * self.page_size * self.item] * 2
        return ptrs, sizes


def test_sglang_pools_and_hicache_io_pools_share_objects(clients):
    """A hicache-io MHA page_first pool writes; an sglang-shaped pool of the same model reads the
    same keys (sglang's own names), and gets the same bytes."""
    writer = make_store(clients.master, lender=clients)
    reader = clients.store(writer.storage_config)
    try:
        _, dev, host = build("cpu", "mha", "page_first", 1, 256, 3, None, 0)
        host.backup_from_device_all_layer(dev, tokens([2, 3]), tokens([5, 6]), "kernel")
        writer.register_mem_pool_host(host)
        keys = [uuid.uuid4().hex for _ in range(2)]
        assert writer.batch_set_v1(keys, tokens([2, 3])) == [True, True]
        fake = FakeSglangMhaPool(17 * P, 3, 256, P)
        reader.register_mem_pool_host(fake)
        assert reader.object_keys(keys[0]) == writer.object_keys(keys[0])
        assert reader.batch_get_v1(keys, tokens([7, 9])) == [True, True]
        k, v = host.read_buffer(0).reshape(-1, 3, 256), host.read_buffer(1).reshape(-1, 3, 256)
        np.testing.assert_array_equal(fake.buf[0][tokens([7, 9])], k[tokens([2, 3])])
        np.testing.assert_array_equal(fake.buf[1][tokens([7, 9])], v[tokens([2, 3])])
    finally:
        clients.give_back(reader)
        clients.give_back(writer)


def test_an_existing_object_is_kept_and_counts_as_written(store):
    _, dev, host = build("cpu", "mla", "page_first", 1, 576, 3, None, 0)
    host.backup_from_device_all_layer(dev, tokens([0]), tokens([1]), "kernel")
    store.register_mem_pool_host(host)
    try:
        key = uuid.uuid4().hex
        first = host.get_data_page(0)
        assert store.batch_set_v1([key], tokens([0])) == [True]
        host.write_buffer(0, np.full(host.buffer_bytes, 9, np.uint8))
        assert store.batch_set_v1([key], tokens([0])) == [True]  # sglang: existing objects succeed
        assert store.batch_get_v1([key], tokens([2])) == [True]
        assert np.array_equal(host.get_data_page(2 * P), first), "the second put replaced the object"
    finally:
        store.unregister_mem_pool_host()


def test_keys_name_layouts_ranks_and_items(master):
    cfg = HiCacheStorageConfig(tp_rank=1, tp_size=2, pp_rank=0, pp_size=2, model_name="m", extra_config={"master_server_address": master.address, "global_segment_size": 64 << 20})  # 16 MiB per rank
    s = MooncakeStore(cfg, {})
    try:
        _, _, host = build("cpu", "mha", "page_first", 1, 256, 3, None, 0)
        s.register_mem_pool_host(host)
        assert s.object_keys("h") == ["m_h_1_0_k", "m_h_1_0_v"]
        s.unregister_mem_pool_host()
        # page_first_direct orders a page's bytes otherwise: not sglang's (layout-blind) name.
        _, _, host = build("cpu", "mha", "page_first_direct", 1, 256, 3, None, 0)
        s.register_mem_pool_host(host)
        k, v = s.object_keys("h")
        assert re.fullmatch(r"m_h_1_0_hio-mha-pfd-i256-L0-3-n[0-9a-f]{12}_k", k), k
        assert v == k[:-1] + "v"
        s.unregister_mem_pool_host()
    finally:
        s.close()
    with pytest.raises(ValueError, match="does not split heads"):
        MooncakeStore(HiCacheStorageConfig(should_split_heads=True, extra_config={"master_server_address": master.address}), {})
    with pytest.raises(ValueError, match="interface_v1"):
        MooncakeStore(HiCacheStorageConfig(extra_config={"master_server_address": master.address, "module_path": "hicache_io.storage"}), {})


@pytest.mark.parametrize("executor", executors())
def test_more_than_one_batch_and_the_last_page(store, executor):
    pages = 150  # two of sglang's 128-page batches; the wgpu path stages each
    _, dev, host = build(executor, "mla", "page_first", 1, 64, 2, None, 0, pages=pages + 1, host_pages=2 * pages)
    host_pages = list(range(1, pages)) + [2 * pages]  # the pool's last page among them
    host.backup_from_device_all_layer(dev, tokens(host_pages), tokens(range(pages)), "kernel")
    want = [host.get_data_page(p * P) for p in host_pages]
    keys = [uuid.uuid4().hex for _ in range(pages)]
    store.register_mem_pool_host(host)
    try:
        assert store.batch_set_v1(keys, tokens(host_pages)) == [True] * pages
        back = list(range(pages + 1, 2 * pages + 1))
        back[-1] = 0
        assert store.batch_get_v1(keys, tokens(back)) == [True] * pages
        for w, p in zip(want, back):
            assert np.array_equal(host.get_data_page(p * P), w)
    finally:
        store.unregister_mem_pool_host()


def test_bad_arguments_fail_every_page_and_move_nothing(store):
    _, dev, host = build("cpu", "mha", "page_first", 1, 256, 3, None, 0)
    host.backup_from_device_all_layer(dev, tokens([0, 1]), tokens([2, 3]), "kernel")
    keys = [uuid.uuid4().hex for _ in range(2)]
    store.register_mem_pool_host(host)
    try:
        assert store.batch_set_v1(keys, tokens([0, 1])) == [True, True]
        before = [host.read_buffer(c) for c in range(2)]
        for bad in (tokens([4])[:-1], np.concatenate([tokens([4]), tokens([5])[1:], [5 * P - 1]]), tokens([4, 99]), -tokens([4, 5]) - 1):
            assert store.batch_get_v1(keys, bad) == [False, False]
            assert store.last_error.code == hicache_io.storage.REFUSED, store.last_error
        for c in range(2):
            assert np.array_equal(host.read_buffer(c), before[c])
        store.raise_errors = True
        with pytest.raises(StorageError, match="host indices"):
            store.batch_get_v1(keys, tokens([4]))
    finally:
        store.raise_errors = False
        store.unregister_mem_pool_host()


def _namespaced(clients, model, dtype, **extra):
    cfg = HiCacheStorageConfig(model_name=model, extra_config={"master_server_address": clients.master.address, "global_segment_size": 32 << 20, "local_buffer_size": 4 << 20, "protocol": "tcp", "metadata_server": "P2PHANDSHAKE", "local_hostname": "127.0.0.1", "hicache_io_kv_dtype": dtype, **extra})
    return clients.store(cfg)


@pytest.mark.parametrize("layout", ["page_first_direct", "page_first"], ids=["own-names", "sglang-names"])
def test_a_page_of_another_namespace_reads_as_a_miss(clients, layout):
    """Two deployments of one model name whose KV dtypes differ: a page one writes reads as a
    miss in the other (nothing lands in its pool), and as data in a third of the first's
    namespace. hicache-io's own names carry the namespace; sglang's names are guarded by the
    prefix's sidecar record, and the other namespace writes none of them."""
    model = f"ns/{uuid.uuid4().hex[:8]}"
    a, b, c = _namespaced(clients, model, "bfloat16"), _namespaced(clients, model, "float8_e4m3fn"), _namespaced(clients, model, "bfloat16")
    try:
        _, dev, host = build("cpu", "mha", layout, 1, 256, 3, None, 0)
        host.backup_from_device_all_layer(dev, tokens([0, 1]), tokens([2, 3]), io_for(layout))
        a.register_mem_pool_host(host)
        keys = [uuid.uuid4().hex for _ in range(2)]
        assert a.batch_set_v1(keys, tokens([0, 1])) == [True, True]
        for reader, same in ((b, False), (c, True)):
            _, _, other = build("cpu", "mha", layout, 1, 256, 3, None, 0, seed=7)
            reader.register_mem_pool_host(other)
            assert reader.namespace["kv_dtype"] == ("bfloat16" if same else "float8_e4m3fn")
            before = other.read_buffer(0).copy()
            assert reader.batch_exists(keys) == (2 if same else 0)
            assert reader.batch_get_v1(keys, tokens([4, 5])) == [same, same]
            if same:
                for p, q in ((0, 4), (1, 5)):
                    np.testing.assert_array_equal(other.get_data_page(q * P), host.get_data_page(p * P))
            else:
                np.testing.assert_array_equal(other.read_buffer(0), before)
                if layout == "page_first":
                    # The other namespace writes none of the prefix's sglang-named objects.
                    assert reader.batch_set_v1([uuid.uuid4().hex], tokens([6])) == [False]
                    assert reader.integrity_stats()["foreign"] >= 2
    finally:
        for s in (a, b, c):
            clients.give_back(s)


def test_v2_sidecar_of_hicache_io_pools(clients):
    """storage v2 with hicache-io's own pools: an MLA KV anchor and a DSA indexer sidecar (both
    cpu, item checksums on). The sidecar's pages go out with trailers (a page damaged in host
    memory after its backup is not put), come back in place verified, and the pool's item
    checksums follow the bytes that landed: a load of them verifies, none reads as corrupt."""
    s = make_store(clients.master, lender=clients)
    try:
        _, kv_dev, kv = build("cpu", "mla", "page_first", 1, 64, 3, None, 0)
        _, ix_dev, ix = build("cpu", "dsa", "page_first", 1, 132, 4, None, 0, seed=1)
        kv.backup_from_device_all_layer(kv_dev, tokens([1, 2, 3]), tokens([4, 5, 6]), "kernel")
        ix.backup_from_device_all_layer(ix_dev, tokens([1, 2, 3]), tokens([4, 5, 6]), "kernel")
        s.register_mem_pool_host(kv)
        s.register_mem_host_pool_v2(kv, "kv")
        s.register_mem_host_pool_v2(ix, "indexer")
        s.on_host_pools_registered()
        keys = [uuid.uuid4().hex for _ in range(3)]
        T = lambda ks, idx: type("PoolTransfer", (), {"name": "indexer", "keys": ks, "host_indices": idx, "hit_policy": "all_pages"})()  # noqa: E731
        off = ix.get_page_buffer_meta(tokens([3]))[0][1] + 5
        byte = np.asarray(ix.read_buffer(0))[off]
        ix.inject_host_corruption(0, off, bytes([byte ^ 0x04]))
        damaged = s.stats["damaged_puts"]
        assert s.batch_set_v1(keys, tokens([1, 2, 3])) == [True] * 3
        assert s.batch_set_v2([T(keys, tokens([1, 2, 3]))]) == {"indexer": [True, True, False]}
        assert s.stats["damaged_puts"] == damaged + 1
        r = s.batch_exists_v2(keys, [T(keys, None)])
        assert (r.kv_hit_pages, r.restorable_prefix_pages) == (2, [1, 2])
        want = [ix.get_data_page(p * P) for p in (1, 2)]
        verified = s.stats["verified"]
        assert s.batch_get_v2([T(keys[:2], tokens([8, 9]))]) == {"indexer": [True, True]}
        assert s.stats["verified"] == verified + 2
        for page, w in zip((8, 9), want):
            assert np.array_equal(ix.get_data_page(page * P), w)
        assert ix.pages_intact(tokens([8, 9])) == [True, True]
        stats = ix.integrity_stats()
        ix.load_to_device_per_layer(ix_dev, tokens([8, 9]), tokens([10, 11]), 0, "kernel")  # verifies, raises on a mismatch
        assert ix.integrity_stats()["verified"] > stats["verified"] and ix.integrity_stats()["mismatched"] == stats["mismatched"]
        # A get that fails its check still wrote the page in place: the checksums a backup had
        # recorded for that page are forgotten (its load reads unverified, not corrupt).
        ix.backup_from_device_all_layer(ix_dev, tokens([10]), tokens([7]), "kernel")
        replayed = uuid.uuid4().hex
        for src, dst in zip(s.v2_object_keys("indexer", [keys[0]]), s.v2_object_keys("indexer", [replayed])):
            assert s.store.put(dst, bytes(s.store.get(src))) == 0
        corrupt = s.stats["corrupt"]
        assert s.batch_get_v2([T([replayed], tokens([10]))]) == {"indexer": [False]}
        assert s.stats["corrupt"] == corrupt + 1
        assert np.array_equal(ix.get_data_page(10 * P), ix.get_data_page(1 * P))  # the replayed bytes landed
        stats = ix.integrity_stats()
        ix.load_to_device_per_layer(ix_dev, tokens([10]), tokens([0]), 0, "kernel")
        assert ix.integrity_stats()["mismatched"] == stats["mismatched"]
    finally:
        clients.give_back(s)


def test_mooncake_loaded_first_leaves_the_vulkan_drivers_zstd_alone(tmp_path):
    """Mooncake's client, loaded before any Vulkan driver, must not bind the system's zstd to its
    own (hicache_io.l3.mooncake_client): Mesa's drivers compress compiled shaders with it into
    their disk cache, and the mixed binding smashed the stack of that cache's thread the first
    time a shader was compiled. A fresh cache directory makes every shader a first one."""
    if "wgpu" not in executors():
        pytest.skip("no wgpu adapter")
    script = textwrap.dedent(
        """
        import time
        from hicache_io.l3.mooncake_client import store_module
        store_module()  # before the Vulkan driver loads
        from common import build, tokens
        _, dev, host = build("wgpu", "mha", "page_first", 1, 256, 3, None, 0)
        host.backup_from_device_all_layer(dev, tokens([0, 1]), tokens([3, 5]), "kernel")
        host.synchronize()
        del host, dev
        time.sleep(1)  # the cache thread writes after the compile
        print("compiled")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "MESA_SHADER_CACHE_DISABLE"}
    env["MESA_SHADER_CACHE_DIR"] = str(tmp_path / "mesa")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "compiled" in out.stdout, f"rc {out.returncode}: {out.stderr[-2000:]}"
