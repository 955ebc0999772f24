"""One L3 cache for every tensor-parallel shape (``hicache_io_key_scheme = "unified"``), through a
real Mooncake master on loopback: ranks of one TP size write pages that ranks of another read
byte-exact, each rank in its own process (``examples/python/unified_l3.py``), MHA and MLA, host
layouts differing between writer and reader; a reader whose heads cannot be cut into the stored
groups, or that asks for another group size, gets misses; every object's trailer is verified and
a replaced object fails its page; pipeline-parallel layer ranges; refusals before anything moves.

Skips without Mooncake unless ``HICACHE_REQUIRE_MOONCAKE=1`` (CI sets it)."""

import importlib.util
import os
import pathlib
import time
import uuid

import numpy as np
import pytest

from common import executors, mooncake_problem, page_bytes  # noqa: E402

if mooncake_problem() is not None:
    pytest.skip(mooncake_problem(), allow_module_level=True)

import hicache_io  # noqa: E402
from hicache_io.storage import INTEGRITY, HiCacheStorageConfig  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "python" / "unified_l3.py"
_spec = importlib.util.spec_from_file_location("unified_l3", EXAMPLE)
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)


@pytest.fixture
def model():
    """A model name of the test's own: its objects are apart from every other test's."""
    return f"unified/{uuid.uuid4().hex[:8]}"


def run(master, model, kind, tp, r, action, pages, layout, groups=1, head_group=2):
    """A rank in a process of its own, on ``master`` (a ``LocalMaster``, or ``"local:DIR"``: the
    local-disk store)."""
    where = master if isinstance(master, str) else master.address
    return ex.Rank(where, kind, tp, r, action, pages, layout, groups, head_group, model=model)


def read(*args, **kw):
    r = run(*args, **kw)
    r.stop()
    return r.result


@pytest.mark.parametrize("transport", ["mooncake", "local"])
def test_mha_pages_cross_tensor_parallel_shapes(transport, model, request, tmp_path):
    master = request.getfixturevalue("master") if transport == "mooncake" else f"local:{tmp_path / 'l3'}"
    writers = []
    try:
        # TP=2 rank 0 holds heads 0..3 of 8 (page_unified, two head groups in its host pool).
        w = run(master, model, "mha", 2, 0, "write", [0, 1, 2], "page_unified", groups=2)
        writers.append(w)
        assert w.result["written"] == [True] * 3
        keys = w.result["keys"]
        assert len(keys) == 4 and all("_L0-4_H" in k for k in keys)
        assert sorted(k.rsplit("_", 2)[1] for k in keys) == ["H0", "H0", "H1", "H1"]  # groups 0, 1: heads 0..3
        assert all(f"_{n}_" not in k.split("page0_")[1] for k in keys for n in ("0", "2"))  # no rank, no tp size

        # TP=4 rank 1 holds heads 2..3: group 1 of rank 0's pages, read byte-exact (another layout).
        r = read(master, model, "mha", 4, 1, "read", [0, 1, 2], "page_first_direct_hg")
        assert r["exists"] == 3 and r["hits"] == [True] * 3 and r["exact"] == [True] * 3
        assert r["objects"]["verified"] == 3 * 2 and r["objects"]["corrupt"] == 0
        # Its loads verified every item: the store recorded the checksums of the bytes that landed.
        assert r["host_items"]["verified"] > 0 and r["host_items"]["mismatched"] == 0 and r["host_items"]["unverified"] == 0

        # TP=1 needs every head: groups 2 and 3 are missing until TP=2 rank 1 writes them.
        assert read(master, model, "mha", 1, 0, "read", [0], "page_first")["hits"] == [False]
        writers.append(run(master, model, "mha", 2, 1, "write", [0], "page_head", groups=4))
        r = read(master, model, "mha", 1, 0, "read", [0], "page_first")
        assert r["hits"] == [True] and r["exact"] == [True] and r["objects"]["verified"] == 8

        # The other way round: TP=4 ranks 0 and 1 write, TP=2 rank 0 reads.
        writers += [run(master, model, "mha", 4, t, "write", [5], "page_first_direct_hg", groups=2) for t in (0, 1)]
        r = read(master, model, "mha", 2, 0, "read", [5], "page_first")
        assert r["hits"] == [True] and r["exact"] == [True]
    finally:
        for w in writers:
            w.stop()


def test_readers_whose_groups_do_not_line_up_get_misses(master, model):
    w = run(master, model, "mha", 2, 0, "write", [0, 1], "page_first_direct_hg", groups=2)
    try:
        # One kv head a rank: groups of 2 cannot be cut from it.
        r = read(master, model, "mha", 8, 1, "read", [0, 1], "page_first")
        assert r["hits"] == [False, False] and r["exists"] == 0 and r["objects"]["incompatible"] == 2
        assert r["objects_per_page"] == 0
        # Groups of 1 name other objects (another digest): misses, never bytes of another grid.
        r = read(master, model, "mha", 4, 1, "read", [0, 1], "page_first", head_group=1)
        assert r["hits"] == [False, False] and r["exists"] == 0 and r["objects"]["incompatible"] == 0
        assert r["keys"][0].split("_")[2] != w.result["keys"][0].split("_")[2]
        # The same grid still reads.
        assert read(master, model, "mha", 4, 1, "read", [0, 1], "page_first")["exact"] == [True, True]
    finally:
        w.stop()


def test_mla_pages_are_one_copy_for_every_rank(master, model):
    w = run(master, model, "mla", 2, 0, "write", [0, 1], "page_unified")
    try:
        assert w.result["keys"] == [f"{model.replace('/', '-')}_page0_{w.result['keys'][0].split('_')[2]}_L0-4_k"]
        for tp, r in ((4, 3), (1, 0)):
            got = read(master, model, "mla", tp, r, "read", [0, 1], "page_first")
            assert got["hits"] == [True, True] and got["exact"] == [True, True] and got["objects"]["verified"] == 2
    finally:
        w.stop()


# ---- in one process: integrity, layer ranges, refusals ---------------------------------------


def store_for(clients, model, tp=1, rank=0, kv_heads=4, **extra):
    """A unified-scheme store of TP rank ``rank`` of ``tp`` on a client lent by ``clients``."""
    cfg = {
        "master_server_address": clients.master.address,
        "global_segment_size": 64 << 20,
        "local_buffer_size": 4 << 20,
        "protocol": "tcp",
        "metadata_server": "P2PHANDSHAKE",
        "local_hostname": "127.0.0.1",
        "hicache_io_key_scheme": "unified",
        **({} if kv_heads is None else {"hicache_io_kv_heads": kv_heads}),
        **extra,
    }
    return clients.store(HiCacheStorageConfig(tp_rank=rank, tp_size=tp, model_name=model, extra_config=cfg))


def layer_bytes(seed, comp, layer, n):
    """Device layer ``layer``'s bytes (model numbering), the same in every pool of ``seed``."""
    return np.random.default_rng([seed, comp, layer]).integers(0, 256, n, dtype=np.uint8)


def backed_up_pools(executor="cpu", layout="page_unified", groups=2, shard=None, drafts=0, layers=4, item=4 * 32, seed=0):
    """``(device pool, host pool)``: an MHA device pool of 16 slots (4 a page) whose layer bytes
    are :func:`layer_bytes` of ``seed``, every slot backed up into a host pool in ``layout``."""
    dev = hicache_io.DevicePool(hicache_io.Device(executor), "mha", item, 16, 4, layers, layer_shard=shard, drafts=drafts)
    first = shard[0] if shard else 0
    for c in range(2):
        for b in range(dev.buffer_count):
            dev.write_buffer(c, b, layer_bytes(seed, c, first + b, dev.slots * dev.item_bytes))
    host = hicache_io.HostPool(dev, layout, 16, head_num=groups, profile="extended")
    host.backup_from_device_all_layer(dev, np.arange(16), np.arange(16), "kernel")
    return dev, host


def test_a_replaced_object_fails_its_page(clients, model):
    dev, host = backed_up_pools()
    s = store_for(clients, model)
    try:
        s.register_mem_pool_host(host)
        keys = ["a", "b"]
        assert s.batch_set_v1(keys, np.arange(8)) == [True, True]
        victim = s.object_keys("b")[3]
        size = len(s.get(victim))
        deadline = time.time() + 10
        while s.store.remove(victim) != 0:  # -706 while the put's lease lasts
            assert time.time() < deadline
            time.sleep(0.05)
        assert s.store.put(victim, bytes(size)) == 0  # same size, other bytes, no valid trailer
        before = host.read_buffer(0)
        assert s.batch_get_v1(keys, np.arange(8, 16)) == [True, False]
        assert s.last_error.code == INTEGRITY and s.integrity_stats()["corrupt"] == 1
        after = host.read_buffer(0)
        # Page "a" landed in slots 8..11 as it was in slots 0..3: the same bytes where page 0 and
        # page 2 of the page_unified buffer lie.
        page = host.get_page_buffer_meta(list(range(4)))[0][2]
        assert np.array_equal(after[2 * page : 3 * page], before[:page])
    finally:
        clients.give_back(s)


def test_a_get_that_raises_forgets_the_pages_it_wrote(clients, model):
    """raise_errors=True: a get whose object fails its trailer raises; the pages it may have written
    in place lose their item checksums (their loads read unverified, not corrupt)."""
    dev, host = backed_up_pools()
    s = store_for(clients, model)
    s.raise_errors = True
    try:
        s.register_mem_pool_host(host)
        assert s.batch_set_v1(["a", "b"], np.arange(8)) == [True, True]
        victim = s.object_keys("b")[0]
        size = len(s.get(victim))
        deadline = time.time() + 10
        while s.store.remove(victim) != 0:
            assert time.time() < deadline
            time.sleep(0.05)
        assert s.store.put(victim, bytes(size)) == 0
        with pytest.raises(Exception):
            s.batch_get_v1(["a", "b"], np.arange(8, 16))
        for layer in range(4):
            host.load_to_device_per_layer(dev, np.arange(8, 16), np.arange(8), layer, "kernel")
        host.synchronize()
        stats = host.integrity_stats()
        assert stats["mismatched"] == 0 and stats["unverified"] > 0, stats
    finally:
        clients.give_back(s)


def page_images(host, pages):
    """Host pages ``pages``' bytes, one ``bytes`` a page (its objects one after another; the
    pools here hold 4 tokens a page)."""
    return [page_bytes(host, q, page_size=4) for q in pages]


class Calls:
    """A client whose batch calls are named in ``calls`` as they are made; the call ``refuse``
    answers -600 (an object of another size than its buffer) for every object, moving nothing."""

    def __init__(self, client, calls, refuse=None):
        self._client, self._calls, self._refuse = client, calls, refuse

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if name.startswith("batch_") and callable(attr):
            self._calls.append(name)
            if name == self._refuse:
                return lambda keys, *rest: [-600] * len(keys)
        return attr


def test_sealed_objects_are_the_objects_moved_in_place(clients, model):
    """A store seals its objects (a share gathered with its trailer into one span of its staging
    buffer); a store of a release that moved them in place with the multi-buffer calls
    (``registered.seal(None)``) wrote and reads the same objects: each side reads the other's verified and
    exact, and objects stored without a trailer read as unverified."""
    _, a = backed_up_pools()
    _, b = backed_up_pools()
    sealed, in_place = store_for(clients, model), store_for(clients, model)
    try:
        sealed.register_mem_pool_host(a)
        in_place.register_mem_pool_host(b)
        assert sealed.registered.sealed is not None and sealed.registered.seal_pages == 128
        in_place.registered.seal(None)
        per = len(sealed.object_keys("x"))
        assert sealed.batch_set_v1(["s0", "s1"], np.arange(8)) == [True, True]
        assert in_place.batch_get_v1(["s0", "s1"], np.arange(8, 16)) == [True, True]
        assert in_place.integrity_stats()["verified"] == 2 * per
        assert page_images(b, [2, 3]) == page_images(a, [0, 1])
        assert in_place.batch_set_v1(["m0"], np.arange(4)) == [True]
        assert sealed.batch_get_v1(["m0"], np.arange(12, 16)) == [True]
        assert sealed.integrity_stats()["verified"] == per and sealed.integrity_stats()["corrupt"] == 0
        assert page_images(a, [3]) == page_images(b, [0])
        # Without a trailer: Mooncake reads the object whole into the larger staged span; it lands
        # from there, unverified, and the page's item checksums are forgotten (its loads read as
        # unverified).
        in_place.integrity = False
        assert in_place.batch_set_v1(["n0", "n1"], np.arange(4, 12)) == [True, True]
        client, calls = sealed.store, []
        sealed.store = Calls(client, calls)
        assert sealed.batch_get_v1(["n0"], np.arange(8, 12)) == [True]
        assert calls == ["batch_get_into"], calls
        assert sealed.integrity_stats()["unverified"] == per
        assert page_images(a, [2]) == page_images(b, [1])
        assert all(x is None for x in a.page_checksums(8))
        # A client that refuses a buffer of another size (-600) gets the other form: the object
        # read into the pool in place with the scatter/gather call.
        calls.clear()
        sealed.store = Calls(client, calls, refuse="batch_get_into")
        assert sealed.batch_get_v1(["n1"], np.arange(4, 8)) == [True]
        assert calls == ["batch_get_into", "batch_get_into_multi_buffers"], calls
        assert sealed.integrity_stats()["unverified"] == 2 * per
        assert page_images(a, [1]) == page_images(b, [2])
        sealed.store = client
    finally:
        clients.give_back(sealed)
        clients.give_back(in_place)


def test_a_staging_buffer_smaller_than_a_batch_moves_fewer_pages_a_batch(clients, model, monkeypatch):
    """Sealed objects whose 128 pages would not fit the staging buffer's bound move in batches of
    as many pages as fit: a call of 4 pages through batches of 3 puts and reads every page exact."""
    from hicache_io.l3 import placements

    # 3 pages of 8 objects (4 kv heads, K and V) of 512 B (stride 576), and a little more.
    monkeypatch.setattr(placements, "SEALED_MAX_BYTES", 3 * 8 * 576 + 100)
    _, a = backed_up_pools()
    _, b = backed_up_pools(seed=3)
    w, r = store_for(clients, model), store_for(clients, model)
    try:
        w.register_mem_pool_host(a)
        r.register_mem_pool_host(b)
        assert w.registered.seal_pages == 3 and w.registered.sealed.nbytes == 3 * 8 * 576
        keys = [f"p{i}" for i in range(4)]
        assert w.batch_set_v1(keys, np.arange(16)) == [True] * 4
        assert r.batch_get_v1(keys, np.arange(16)) == [True] * 4
        assert r.integrity_stats()["verified"] == 4 * 8
        assert page_images(b, range(4)) == page_images(a, range(4))
    finally:
        clients.give_back(w)
        clients.give_back(r)


def test_the_staging_pass_gathers_and_scatters_page_shares():
    """The pool's staging pass for shares: each share's bytes gathered to byte ``j · stride`` in
    the order its spans name, with the checksum of the in-place pass; landed into another pool,
    only the objects marked written, with the same sums; a stride or buffer too short refused
    with nothing written. A share of 6 bytes an item takes the gather-then-sum path."""
    _, a = backed_up_pools()
    idx = np.arange(4, 12)
    for shares in ([(0, 0, 4, 0, 64), (1, 1, 3, 64, 128)], [(1, 0, 4, 2, 8), (0, 2, 3, 10, 16)]):
        spans = [a.page_share_spans(*sh[:1], sh[1:3], sh[3:]) for sh in shares]
        size = max(sum(n for _, _, n in v) for v, _ in spans)
        stride = size + 16 + 3
        n = 2 * len(shares)
        buf = np.full(n * stride, 7, np.uint8)
        for nbytes, st in [(buf.nbytes - 1, stride), (buf.nbytes, size - 1)]:
            with pytest.raises(Exception):
                a._stage_put(idx, buf.ctypes.data, nbytes, st, shares)
            assert (buf == 7).all()
        sums, intact = a._stage_put(idx, buf.ctypes.data, buf.nbytes, stride, shares)
        assert intact == [True, True]
        assert list(sums) == list(a.object_sums(idx, shares))
        for j in range(n):
            page, (v, shift) = 1 + j // len(shares), spans[j % len(shares)]
            want = np.concatenate([a.read_buffer(c)[off + page * shift : off + page * shift + k] for c, off, k in v])
            assert np.array_equal(buf[j * stride : j * stride + len(want)], want), (shares, j)
            assert (buf[j * stride + len(want) : (j + 1) * stride] == 7).all()
        _, b = backed_up_pools(seed=5)
        before = [b.read_buffer(c) for c in range(b.components)]
        write = [True, False] * len(shares)
        for nbytes, st, w in [(buf.nbytes, stride, write[:-1]), (buf.nbytes - 1, stride, write), (buf.nbytes, size - 1, write)]:
            with pytest.raises(Exception):
                b._land_staged(idx, buf.ctypes.data, nbytes, st, list(sums), [True] * n, w, shares)
            assert all(np.array_equal(b.read_buffer(c), before[c]) for c in range(b.components))
        with pytest.raises(Exception):
            b._land_staged(idx, buf.ctypes.data, buf.nbytes, stride, list(sums), [True] * n, write, [])
        landed = b._land_staged(idx, buf.ctypes.data, buf.nbytes, stride, list(sums), [True] * n, write, shares)
        assert list(landed) == [int(x) if w else 0 for x, w in zip(sums, write)]
        now = b.object_sums(idx, shares)
        assert all(now[j] == sums[j] for j in range(0, n, 2)) and all(now[j] != sums[j] for j in range(1, n, 2))
        # A page some of whose objects were not written is not trusted: its item checksums are
        # forgotten. Landed whole and eligible, a page's are recorded; not eligible, forgotten.
        assert all(x is None for x in b.page_checksums(4)) and all(x is None for x in b.page_checksums(8))
        eligible = [True] * len(shares) + [False] * len(shares)
        b._land_staged(idx, buf.ctypes.data, buf.nbytes, stride, list(sums), eligible, [True] * n, shares)
        assert None not in b.page_checksums(4) and all(x is None for x in b.page_checksums(8))


@pytest.mark.parametrize("executor", executors(addressable=True))
def test_layer_ranges_let_pipeline_shapes_share(clients, model, executor):
    """Two pipeline stages (layers 0..1 and 2..3) write; one rank holding all four layers reads
    with the same ranges (cuda: pinned host pools, in place)."""
    stages = []
    try:
        for shard in ((0, 2), (2, 4)):
            dev, host = backed_up_pools(executor, shard=shard, seed=7)
            s = store_for(clients, model)
            s.register_mem_pool_host(host)
            assert s.batch_set_v1(["p"], np.arange(4)) == [True]
            assert s.object_keys("p")[0].endswith(f"_L{shard[0]}-{shard[1]}_H0_k")
            stages.append((s, dev, host))
        dev, host = backed_up_pools(executor, layout="page_first", groups=1, seed=99)
        s = store_for(clients, model, hicache_io_layer_ranges=[[0, 2], [2, 4]])
        try:
            s.register_mem_pool_host(host)
            assert s.batch_get_v1(["p"], np.arange(4, 8)) == [True]
            for layer in range(4):
                host.load_to_device_per_layer(dev, np.arange(4, 8), np.arange(4), layer, "kernel")
            for c in range(2):
                for layer in range(4):
                    assert np.array_equal(dev.read_buffer(c, layer)[: 4 * 128], layer_bytes(7, c, layer, 16 * 128)[: 4 * 128])
        finally:
            clients.give_back(s)
    finally:
        for s, _, _ in stages:
            clients.give_back(s)


@pytest.mark.parametrize(
    "extra, build, message",
    [
        ({"hicache_io_key_scheme": "rank"}, None, "hicache_io_key_scheme"),
        ({"kv_heads": None}, {}, "hicache_io_kv_heads"),
        ({"kv_heads": 3, "tp": 2}, {}, "cannot be split evenly"),
        ({"kv_heads": 3}, {}, "whole kv heads"),
        ({"hicache_io_layer_ranges": [[0, 3]]}, {}, "must tile"),
        ({"hicache_io_layer_ranges": [[0, 2], [3, 4]]}, {}, "must tile"),
        ({}, {"drafts": 1}, "draft"),
        ({"hicache_io_head_group": 0}, {}, "positive"),
    ],
)
def test_refusals(clients, model, extra, build, message):
    extra = dict(extra)
    tp = extra.pop("tp", 1)
    if build is None:
        with pytest.raises(ValueError, match=message):
            store_for(clients, model, tp=tp, **extra)
        return
    s = store_for(clients, model, tp=tp, **extra)
    try:
        dev, host = backed_up_pools(**build)
        with pytest.raises(ValueError, match=message):
            s.register_mem_pool_host(host)
        assert s.mem_pool_host is None and s.registered is None
    finally:
        clients.give_back(s)


def test_wgpu_pools_are_refused(clients, model):
    try:
        dev, host = backed_up_pools(executor="wgpu")
    except Exception:  # noqa: BLE001
        if os.environ.get("CI"):
            raise
        pytest.skip("no wgpu adapter")
    s = store_for(clients, model)
    try:
        with pytest.raises(ValueError, match="wgpu"):
            s.register_mem_pool_host(host)
    finally:
        clients.give_back(s)
