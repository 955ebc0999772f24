"""L3 batches against a dictionary model of the store, on both transports (a real Mooncake master
on loopback, and the local-disk store in a folder of the test's own): random batches of sets, gets and exists with repeated, missing and present keys, on every key
scheme (sglang's names, hicache-io's shard names through both checksummed paths, unified
head-group keys, v2 component keys) and on cpu and wgpu host pools. Every slot of every get is
compared byte for byte: a hit holds the bytes its key was first written with, a miss leaves the
slot as it was. ``last_error`` describes the call just made.

The model's rules, which the store documents:
- a set writes a key that is not stored yet; an object stored already is kept and counts as
  written, so a key named twice in one set keeps its first occurrence's bytes (every occurrence
  reports ``True`` once that one is written);
- a get fills every slot that names a stored key, however often the key is named;
- exists counts the leading keys that are stored (a repeated stored key counts each time)."""

import uuid
import zlib

import numpy as np
import pytest

from common import P, build, executors, io_for, make_store, page_bytes, page_meta, tokens

SENTINEL = 0x5A
HOST_PAGES = 16
DEVICE_PAGES = 12

# (name, kind, layout, heads, bytes per token, layers, extra config)
SCHEMES = [
    ("sglang-names", "mha", "page_first", 1, 256, 3, {}),
    ("shard-names-sealed", "mha", "page_first_direct", 1, 256, 3, {}),
    ("shard-names-two-buffers", "mla", "page_first_direct", 1, 4096, 3, {}),  # 96 KiB objects
    ("shard-names-dsa", "dsa", "page_first", 1, 132, 4, {}),
    ("unified", "mha", "page_unified", 2, 128, 4, {"hicache_io_key_scheme": "unified", "hicache_io_kv_heads": 4}),
]


TRANSPORTS = ["mooncake", "local"]


def cases():
    for transport in TRANSPORTS:
        for name, *pool in SCHEMES:
            # Unified keys move pages in place: pools in the executor's own buffers are refused.
            for executor in executors(addressable=name == "unified"):
                yield pytest.param(transport, executor, pool, id=f"{transport}-{name}-{executor}")


def open_store(transport, request, tmp_path, extra=None):
    """A store of its own on ``transport`` (on Mooncake, over a client the module's ``clients``
    lend: give it back with :func:`close_store`)."""
    if transport == "local":
        from hicache_io.storage import LocalStore

        return LocalStore(kwargs=dict(extra or {}), directory=str(tmp_path / "l3"))
    clients = request.getfixturevalue("clients")
    return make_store(clients.master, extra=extra, lender=clients)


def close_store(s, transport, request):
    if transport == "local":
        s.close()
    else:
        request.getfixturevalue("clients").give_back(s)


def draw_batch(rng, universe, n_max=6):
    """Keys drawn with repeats (``universe``'s last two are never set) and distinct host pages."""
    n = int(rng.integers(1, n_max + 1))
    keys = [universe[i] for i in rng.integers(0, len(universe), n)]
    pages = [int(p) for p in rng.choice(HOST_PAGES, n, replace=False)]
    return keys, pages


def fill_pages(host, dev, pages, rng):
    """Backs up random device pages into host ``pages`` (item checksums recorded as a backup
    does); returns each page's bytes."""
    src = [int(p) for p in rng.choice(DEVICE_PAGES, len(pages), replace=False)]
    host.backup_from_device_all_layer(dev, tokens(pages), tokens(src), io_for(host.layout))
    bufs = [host.read_buffer(c) for c in range(host.components)]
    return [page_bytes(host, p, bufs) for p in pages]


def blank_pages(host, pages):
    """Sets every byte of host ``pages``' objects to ``SENTINEL``."""
    bufs = [np.array(host.read_buffer(c)) for c in range(host.components)]
    for p in pages:
        for c, off, n in page_meta(host, p):
            bufs[c][off : off + n] = SENTINEL
    for c, b in enumerate(bufs):
        host.write_buffer(c, b)


def check_slots(host, keys, pages, got, model, what):
    """Every slot: a hit holds its key's stored bytes, a miss is untouched."""
    assert got == [k in model for k in keys], f"{what}: {list(zip(keys, got))}"
    bufs = [host.read_buffer(c) for c in range(host.components)]
    for k, p, hit in zip(keys, pages, got):
        now = page_bytes(host, p, bufs)
        # Compared without pytest's diff of the bytes: the message says what failed.
        if hit and now != model[k]:
            pytest.fail(f"{what}: slot of page {p} reported a hit for {k} but holds other bytes")
        if not hit and set(now) != {SENTINEL}:
            pytest.fail(f"{what}: page {p} changed although {k} missed")


def leading(keys, *models):
    n = 0
    for k in keys:
        if not all(k in m for m in models):
            break
        n += 1
    return n


def put_first(model, keys, want):
    for k, w in zip(keys, want):
        model.setdefault(k, w)


@pytest.mark.parametrize("transport,executor,pool", list(cases()))
def test_random_batches_match_a_dictionary_model(transport, executor, pool, request, tmp_path):
    play_model(transport, executor, pool, request, tmp_path)


def play_model(transport, executor, pool, request, tmp_path):
    """The model's game on one store: a reproduction, then 30 random calls of up to 6 pages."""
    kind, layout, heads, bpt, layers, extra = pool
    rng = np.random.default_rng(zlib.crc32(f"{kind}-{layout}-{executor}".encode()))
    _, dev, host = build(executor, kind, layout, heads, bpt, layers, None, 0, pages=DEVICE_PAGES, host_pages=HOST_PAGES)
    s = open_store(transport, request, tmp_path, extra)
    universe = [f"{n}-{uuid.uuid4().hex[:8]}" for n in range(8)]
    model = {}
    try:
        s.register_mem_pool_host(host)
        # The reproduction first: a key asked twice in one get, its first slot never written.
        want = fill_pages(host, dev, [0, 1], rng)
        assert s.batch_set_v1(universe[:2], tokens([0, 1])) == [True, True], s.last_error
        put_first(model, universe[:2], want)
        blank_pages(host, [4, 5, 6])
        got = s.batch_get_v1([universe[0], universe[1], universe[0]], tokens([4, 5, 6]))
        check_slots(host, [universe[0], universe[1], universe[0]], [4, 5, 6], got, model, "repro")
        for step in range(30):
            op = rng.choice(["set", "get", "exists"], p=[0.4, 0.45, 0.15])
            keys, pages = draw_batch(rng, universe if op != "set" else universe[:6])
            what = f"step {step}: {op} {keys} pages {pages}"
            if op == "set":
                want = fill_pages(host, dev, pages, rng)
                assert s.batch_set_v1(keys, tokens(pages)) == [True] * len(keys), f"{what}: {s.last_error}"
                put_first(model, keys, want)
                assert s.last_error is None, what
            elif op == "get":
                blank_pages(host, pages)
                got = s.batch_get_v1(keys, tokens(pages))
                check_slots(host, keys, pages, got, model, what)
                assert (s.last_error is None) == all(got), f"{what}: last_error {s.last_error!r}"
            else:
                assert s.batch_exists(keys) == leading(keys, model), what
    finally:
        close_store(s, transport, request)


@pytest.fixture
def overlapped(monkeypatch):
    """Calls cut into batches of 2 pages, every batch overlapped with the next whatever its
    bytes; yields the overlap's hand-offs (``[function name]``) as they happen."""
    import hicache_io.l3.pipeline as pipeline
    import hicache_io.l3.placements as placements
    import hicache_io.l3.store as store

    monkeypatch.setattr(store, "STORAGE_BATCH_SIZE", 2)
    monkeypatch.setattr(placements, "STORAGE_BATCH_SIZE", 2)
    monkeypatch.setattr(pipeline, "OVERLAP_MIN_BYTES", 0)
    handed = []
    submit = pipeline.Overlap.submit
    monkeypatch.setattr(pipeline.Overlap, "submit", lambda self, fn, *a: handed.append(fn.__name__) or submit(self, fn, *a))
    yield handed


# The schemes whose batches overlap: checksummed objects, each batch with buffers of its own (sglang's
# names carry no trailer; wgpu's staged pools move one batch at a time).
OVERLAPPED = [p for p in SCHEMES if p[0] != "sglang-names"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("executor", executors(addressable=True))
@pytest.mark.parametrize("pool", [pytest.param(p[1:], id=p[0]) for p in OVERLAPPED])
def test_overlapped_batches_match_a_dictionary_model(transport, executor, pool, overlapped, request, tmp_path):
    """The same game with calls of several batches, each staged or landed on the store's second
    thread while the transport moves the batch beside it (pools in this process's memory: cpu's,
    and cuda's pinned ones)."""
    play_model(transport, executor, pool, request, tmp_path)
    assert "_ready" in overlapped and "_land" in overlapped, overlapped


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_random_v2_batches_match_a_dictionary_model(transport, request, tmp_path):
    """storage v2: an MLA KV anchor (v1 objects, sglang's names) and a DSA indexer sidecar (v2
    component keys), set and got together."""
    rng = np.random.default_rng(58)
    _, kv_dev, kv = build("cpu", "mla", "page_first", 1, 64, 3, None, 0, pages=DEVICE_PAGES, host_pages=HOST_PAGES)
    _, ix_dev, ix = build("cpu", "dsa", "page_first", 1, 132, 4, None, 0, pages=DEVICE_PAGES, host_pages=HOST_PAGES, seed=1)
    s = open_store(transport, request, tmp_path)
    T = lambda name, ks, idx: type("PoolTransfer", (), {"name": name, "keys": ks, "host_indices": idx, "hit_policy": "all_pages"})()  # noqa: E731
    universe = [f"{n}-{uuid.uuid4().hex[:8]}" for n in range(8)]
    kv_model, ix_model = {}, {}
    try:
        s.register_mem_pool_host(kv)
        s.register_mem_host_pool_v2(kv, "kv")
        s.register_mem_host_pool_v2(ix, "indexer")
        s.on_host_pools_registered()
        for step in range(30):
            op = rng.choice(["set", "get", "exists"], p=[0.4, 0.45, 0.15])
            keys, pages = draw_batch(rng, universe if op != "set" else universe[:6])
            what = f"step {step}: {op} {keys} pages {pages}"
            if op == "set":
                kv_want, ix_want = fill_pages(kv, kv_dev, pages, rng), fill_pages(ix, ix_dev, pages, rng)
                assert s.batch_set_v1(keys, tokens(pages)) == [True] * len(keys), f"{what}: {s.last_error}"
                assert s.batch_set_v2([T("indexer", keys, tokens(pages))]) == {"indexer": [True] * len(keys)}, f"{what}: {s.last_error}"
                assert s.last_error is None, what
                put_first(kv_model, keys, kv_want)
                put_first(ix_model, keys, ix_want)
            elif op == "get":
                blank_pages(kv, pages)
                blank_pages(ix, pages)
                got = s.batch_get_v2([T("kv", keys, tokens(pages)), T("indexer", keys, tokens(pages))])
                check_slots(kv, keys, pages, got["kv"], kv_model, f"{what} (kv)")
                check_slots(ix, keys, pages, got["indexer"], ix_model, f"{what} (indexer)")
                assert (s.last_error is None) == all(got["kv"] + got["indexer"]), f"{what}: last_error {s.last_error!r}"
            else:
                r = s.batch_exists_v2(keys, [T("indexer", keys, None)])
                assert r.kv_hit_pages == leading(keys, kv_model, ix_model), what
    finally:
        close_store(s, transport, request)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_failures_of_overlapped_batches_are_reported_in_batch_order(transport, overlapped, request, tmp_path):
    """Batch 1 holds a replayed page (its objects' trailers bound to another key: refused by the
    checksum pass, on the second thread) and batch 2 a missing one (refused by the transport's
    get, which runs before batch 1's verdicts): each page has its own verdict, the item checksums
    of the pages read whole are settled, and ``last_error`` is batch 2's failure, as when one
    batch runs after the other."""
    from hicache_io.storage import INTEGRITY

    kind, layout, heads, bpt, layers, extra = OVERLAPPED[0][1:]
    rng = np.random.default_rng(5)
    _, dev, host = build("cpu", kind, layout, heads, bpt, layers, None, 0, pages=DEVICE_PAGES, host_pages=HOST_PAGES)
    s = open_store(transport, request, tmp_path, extra)
    a, replayed, missing, b = (f"{n}-{uuid.uuid4().hex[:8]}" for n in "armb")
    try:
        s.register_mem_pool_host(host)
        want = fill_pages(host, dev, [0, 1], rng)
        assert s.batch_set_v1([a, b], tokens([0, 1])) == [True, True], s.last_error
        for src, dst in zip(s.object_keys(a), s.object_keys(replayed)):
            assert s.set(dst, s.get(src)), s.last_error
        blank_pages(host, [4, 5, 6, 7])
        corrupt = s.stats["corrupt"]
        got = s.batch_get_v1([a, replayed, missing, b], tokens([4, 5, 6, 7]))
        assert got == [True, False, False, True]
        assert s.stats["corrupt"] == corrupt + 2  # both of the replayed page's objects
        assert s.last_error.code != INTEGRITY and s.last_error.keys == s.object_keys(missing), s.last_error
        assert "_land" in overlapped, overlapped
        bufs = [host.read_buffer(c) for c in range(host.components)]
        assert [page_bytes(host, p, bufs) for p in (4, 7)] == want
        # Recorded from the bytes that landed for the verified pages, forgotten for the others.
        assert all(c is not None for p in (4, 7) for c in host.page_checksums(p * P))
        assert all(c is None for p in (5, 6) for c in host.page_checksums(p * P))
    finally:
        close_store(s, transport, request)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_store_that_raises_its_failures_reads_nothing_past_the_batch_that_failed(transport, overlapped, request, tmp_path):
    """With ``raise_errors``, batches run one after the other: a missing page in the first batch
    raises before the second is read, whose host pages stay as they were."""
    from hicache_io.storage import StorageError

    kind, layout, heads, bpt, layers, extra = OVERLAPPED[0][1:]
    _, dev, host = build("cpu", kind, layout, heads, bpt, layers, None, 0, pages=DEVICE_PAGES, host_pages=HOST_PAGES)
    s = open_store(transport, request, tmp_path, extra)
    a, missing, b, c = (f"{n}-{uuid.uuid4().hex[:8]}" for n in "amb" + "c")
    try:
        s.register_mem_pool_host(host)
        fill_pages(host, dev, [0, 1, 2], np.random.default_rng(6))
        assert s.batch_set_v1([a, b, c], tokens([0, 1, 2])) == [True] * 3, s.last_error
        blank_pages(host, [4, 5, 6, 7])
        s.raise_errors = True
        overlapped.clear()
        with pytest.raises(StorageError) as failed:
            s.batch_get_v1([a, missing, b, c], tokens([4, 5, 6, 7]))
        assert failed.value.keys == s.object_keys(missing)
        bufs = [host.read_buffer(c) for c in range(host.components)]
        assert all(set(page_bytes(host, p, bufs)) == {SENTINEL} for p in (6, 7))
        assert overlapped == []
    finally:
        s.raise_errors = False
        close_store(s, transport, request)


@pytest.mark.parametrize("at", [1, 2], ids=["a middle batch", "the last batch"])
def test_an_interrupted_overlapped_get_leaves_no_pass_running(at, overlapped, monkeypatch, request, tmp_path):
    """A get interrupted (KeyboardInterrupt in the calling thread) while it waits for batch
    ``at``'s checksum pass waits for that pass to end before it raises, and forgets the item
    checksums of the pages it read and did not answer; the batches before keep theirs."""
    import threading
    import time

    import hicache_io.l3.pipeline as pipeline

    kind, layout, heads, bpt, layers, extra = OVERLAPPED[0][1:]
    _, dev, host = build("cpu", kind, layout, heads, bpt, layers, None, 0, pages=DEVICE_PAGES, host_pages=HOST_PAGES)
    s = open_store("local", request, tmp_path, extra)
    keys = [f"{n}-{uuid.uuid4().hex[:8]}" for n in range(6)]
    finished, lands = [], []
    land, submit = pipeline._land, pipeline.Overlap.submit

    def slow_land(b, f):
        time.sleep(0.2)
        try:
            return land(b, f)
        finally:
            finished.append((threading.current_thread().name, time.monotonic()))

    def interrupting(self, fn, *a):
        fut = submit(self, fn, *a)
        if fn is slow_land:
            lands.append(fut)
            if len(lands) == at + 1:

                def result(*_):
                    raise KeyboardInterrupt

                fut.result = result  # the interrupt arrives while the caller waits on this pass
        return fut

    try:
        s.register_mem_pool_host(host)
        fill_pages(host, dev, list(range(6)), np.random.default_rng(7))
        assert s.batch_set_v1(keys, tokens(list(range(6)))) == [True] * 6, s.last_error
        monkeypatch.setattr(pipeline, "_land", slow_land)
        monkeypatch.setattr(pipeline.Overlap, "submit", interrupting)
        with pytest.raises(KeyboardInterrupt):
            s.batch_get_v1(keys, tokens(list(range(8, 14))))
        raised = time.monotonic()
        assert len(finished) == at + 1 and all(n.startswith("hicache-io-l3") and t <= raised for n, t in finished), (finished, raised)
        answered = [8 + q for q in range(2 * at)]
        assert all(c is not None for p in answered for c in host.page_checksums(p * P))
        assert all(c is None for p in range(8 + 2 * at, 14) for c in host.page_checksums(p * P))
    finally:
        close_store(s, "local", request)
