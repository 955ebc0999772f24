"""Integrity of L3 objects through a real Mooncake Store on loopback: every object of
hicache-io's own pages carries a checksum trailer bound to its key, checked at every get (changed
bytes, swapped and replayed objects fail their page); a page damaged in host memory after its
backup is not put; the one-read native passes (object checksums with the pages' item checks at
put, verification with the pool's item checksums at get, head-group shares) equal the separate
ones; stores with checksums on and off read each other; the staging pass refuses a short buffer.

Skips without Mooncake unless ``HICACHE_REQUIRE_MOONCAKE=1`` (CI sets it)."""

import uuid

import numpy as np
import pytest

from common import P, build, executors, make_store, mooncake_problem, page_meta, tokens  # noqa: E402

if mooncake_problem() is not None:
    pytest.skip(mooncake_problem(), allow_module_level=True)


def _dsa_store_pages(store, pages=(1, 2), executor="cpu"):
    _, dev, host = build(executor, "dsa", "page_first", 1, 132, 4, (2, 4), 1)
    host.backup_from_device_all_layer(dev, tokens(pages), tokens([5, 6][: len(pages)]), "kernel")
    return host


def test_pages_carry_checksums_and_corruption_is_caught(store):
    """hicache-io's own objects end in a 16-byte trailer: the page's checksum bound to its key.
    A page read back whole is verified; bytes changed in the store, or a page stored under another
    key (swapped, replayed), fail their page; objects without a trailer read as unverified."""
    from hicache_io import _native
    from hicache_io.l3.trailer import OLD_TRAILER_MAGICS, TRAILER_MAGIC
    from hicache_io.l3.trailer import name_tag as _name_tag
    from hicache_io.storage import INTEGRITY

    host = _dsa_store_pages(store)
    store.register_mem_pool_host(host)
    try:
        keys = [uuid.uuid4().hex for _ in range(2)]
        before = dict(store.stats)
        assert store.batch_set_v1(keys, tokens([1, 2])) == [True, True]
        assert store.batch_get_v1(keys, tokens([8, 9])) == [True, True]
        assert store.stats["verified"] == before["verified"] + 2
        (ka,) = store.object_keys(keys[0])
        page = host.get_data_page(1 * P)
        raw = store.store
        buf = np.zeros(page.size + 16, np.uint8)
        raw.register_buffer(buf.ctypes.data, buf.nbytes)
        try:
            trailer = np.array([TRAILER_MAGIC, _native.checksum(page) ^ _name_tag(ka)], "<u8").view(np.uint8)
            # 1. One bit flipped in the stored bytes (the trailer still that of the original);
            # 2. page A's object, trailer and all, replayed under another page's key.
            flipped, replayed = uuid.uuid4().hex, uuid.uuid4().hex
            for page_key, flip in ((flipped, True), (replayed, False)):
                (k,) = store.object_keys(page_key)
                # The flipped object's trailer is right for its own key: only its bytes are wrong.
                own = np.array([TRAILER_MAGIC, _native.checksum(page) ^ _name_tag(k)], "<u8").view(np.uint8)
                buf[: page.size], buf[page.size :] = page, own if flip else trailer
                if flip:
                    buf[100] ^= 0x10
                assert raw.batch_put_from_multi_buffers([k], [[buf.ctypes.data, buf.ctypes.data + page.size]], [[page.size, 16]]) == [0]
            # The untouched original verifies; the two do not.
            assert store.batch_get_v1([keys[0]], tokens([10])) == [True]
            for page_key in (flipped, replayed):
                corrupt = store.stats["corrupt"]
                assert store.batch_get_v1([page_key], tokens([10])) == [False]
                assert store.last_error.code == INTEGRITY and store.stats["corrupt"] == corrupt + 1
            # 3. An object written without a trailer (an older build): read, but unverified.
            plain_page = uuid.uuid4().hex
            (plain_key,) = store.object_keys(plain_page)
            buf[: page.size] = page
            assert raw.batch_put_from([plain_key], [buf.ctypes.data], [page.size]) == [0]
            unverified = store.stats["unverified"]
            assert store.batch_get_v1([plain_page], tokens([11])) == [True]
            assert store.stats["unverified"] == unverified + 1
            assert np.array_equal(host.get_data_page(11 * P), page)
            # 4. An object of an earlier trailer format (another key stream; here any sum): read,
            # unverified, never corrupt.
            for magic in OLD_TRAILER_MAGICS:
                older = uuid.uuid4().hex
                (older_key,) = store.object_keys(older)
                buf[: page.size] = page
                buf[page.size :] = np.array([magic, 12345], "<u8").view(np.uint8)
                assert raw.batch_put_from_multi_buffers([older_key], [[buf.ctypes.data, buf.ctypes.data + page.size]], [[page.size, 16]]) == [0]
                unverified, corrupt = store.stats["unverified"], store.stats["corrupt"]
                assert store.batch_get_v1([older], tokens([12])) == [True]
                assert (store.stats["unverified"], store.stats["corrupt"]) == (unverified + 1, corrupt)
                assert np.array_equal(host.get_data_page(12 * P), page)
        finally:
            raw.unregister_buffer(buf.ctypes.data)
    finally:
        store.unregister_mem_pool_host()


@pytest.mark.parametrize("executor", executors())
def test_a_page_damaged_in_host_memory_is_not_put(store, executor):
    """The item checksums a backup recorded inside its copy guard the put too: a page whose host
    bytes changed after the backup is refused (not written, counted as ``damaged_puts``), the
    other pages of the batch are stored, and nothing damaged reaches storage under a trailer of
    its own."""
    host = _dsa_store_pages(store, executor=executor)
    store.register_mem_pool_host(host)
    try:
        keys = [uuid.uuid4().hex for _ in range(2)]
        assert host.pages_intact(tokens([1, 2])) == [True, True]
        # A whole batch of two pages first: the damaged batch below, of as many pages in the
        # same buffers, must not be sent as a whole one.
        before = [uuid.uuid4().hex for _ in range(2)]
        assert store.batch_set_v1(before, tokens([1, 2])) == [True, True]
        page2 = host.get_data_page(2 * P)
        # One byte of page 1, as a fault in host memory would change it.
        off = host.get_page_buffer_meta(tokens([1]))[0][1] + 7
        byte = np.asarray(host.read_buffer(0))[off]
        host.inject_host_corruption(0, off, bytes([byte ^ 0x08]))
        assert host.pages_intact(tokens([1, 2])) == [False, True]
        damaged = store.stats["damaged_puts"]
        assert store.batch_set_v1(keys, tokens([1, 2])) == [False, True]
        assert store.stats["damaged_puts"] == damaged + 1
        assert store.batch_exists(keys) == 0  # the leading pages that exist: none
        assert store.batch_exists(keys[1:]) == 1
        assert store.batch_get_v1(keys[:1], tokens([8])) == [False]
        assert store.batch_get_v1(keys[1:], tokens([9])) == [True]
        assert np.array_equal(host.get_data_page(9 * P), page2)
    finally:
        store.unregister_mem_pool_host()


@pytest.mark.parametrize("executor", executors())
@pytest.mark.parametrize("kind,layout,heads", [("dsa", "page_first", 1), ("mha", "page_first", 1), ("mha", "page_head", 2), ("mla", "page_first_direct", 1)])
def test_put_object_sums_are_object_sums_and_pages_intact_in_one_read(executor, kind, layout, heads):
    """What a put needs (each object's checksum, each page's item check) from one read of the
    pages: equal to the two separate calls, on pages whose objects are one item (DSA, one layer)
    and many (MHA over layers and tokens, split heads), before and after a byte of one page is
    damaged in host memory, and under another seed."""
    bpt = {"dsa": 132, "mha": 64, "mla": 96}[kind]
    _, dev, host = build(executor, kind, layout, heads, bpt, 1 if kind == "dsa" else 3, None, 0)
    pages = [1, 2, 3]
    dev_pages = [5, 6, 7]
    host.backup_from_device_all_layer(dev, tokens(pages), tokens(dev_pages), "direct" if layout == "page_first_direct" else "kernel")
    idx = tokens(pages)

    def both(seed=None):
        kw = {} if seed is None else {"seed": seed}
        sums, intact = host.put_object_sums(idx, **kw)
        assert list(sums) == list(host.object_sums(idx, **kw))
        assert intact == host.pages_intact(idx)
        return intact

    assert both() == [True, True, True]
    assert both(7) == [True, True, True]
    off = page_meta(host, 2)[-1][1] + 5
    comp = page_meta(host, 2)[-1][0]
    byte = np.asarray(host.read_buffer(comp))[off]
    host.inject_host_corruption(comp, off, bytes([byte ^ 0x10]))
    # Only cpu's direct copies sum (wgpu's and cuda's leave their items' checksums unknown):
    # such pages have no item checksums to fail.
    known = any(c is not None for c in host.page_checksums(2 * P))
    assert known or (executor != "cpu" and layout == "page_first_direct")
    assert both() == [True, not known, True]
    assert both(7) == [True, not known, True]


@pytest.mark.parametrize("executor", executors())
@pytest.mark.parametrize("kind,layout,heads", [("dsa", "page_first", 1), ("mha", "page_first", 1), ("mha", "page_head", 2)])
def test_landed_object_sums_verify_and_settle_pages_in_one_read(executor, kind, layout, heads):
    """After a zero-copy get: each object's checksum (equal to ``object_sums``) and, in the
    same read, the pool's item checksums: recorded (as the backup recorded them) for a page whose
    objects are all eligible and match, forgotten for a page with one object that does not match
    or is not eligible."""
    bpt = {"dsa": 132, "mha": 64}[kind]
    _, dev, host = build(executor, kind, layout, heads, bpt, 1 if kind == "dsa" else 3, None, 0)
    pages = [1, 2, 3]
    host.backup_from_device_all_layer(dev, tokens(pages), tokens([5, 6, 7]), "kernel")
    idx = tokens(pages)
    recorded = [host.page_checksums(q * P) for q in pages]
    assert all(c is not None for r in recorded for c in r)
    sums = list(host.object_sums(idx))
    per = len(sums) // len(pages)
    host.forget_page_checksums([q * P for q in pages])
    expected = list(sums)
    expected[per] ^= 1  # page 2's first object does not match
    eligible = [True] * len(sums)
    eligible[2 * per] = False  # page 3's first object was not read whole
    assert list(host.landed_object_sums(idx, expected, eligible)) == sums
    assert host.page_checksums(1 * P) == recorded[0]
    assert all(c is None for c in host.page_checksums(2 * P) + host.page_checksums(3 * P))
    assert list(host.landed_object_sums(idx, sums, [True] * len(sums))) == sums
    assert [host.page_checksums(q * P) for q in pages] == recorded
    with pytest.raises(ValueError):
        host.landed_object_sums(idx, sums[:-1], [True] * len(sums))


@pytest.mark.parametrize("layout,heads,bpt", [("page_unified", 2, 64), ("page_first", 1, 64), ("page_first", 1, 12)])
def test_share_sums_are_the_checksums_of_the_gathered_shares(layout, heads, bpt):
    """A page share's checksum (summed where its spans lie when they are whole words, gathered
    first otherwise) is the checksum of the share's bytes gathered in order."""
    from hicache_io import _native

    _, dev, host = build("cpu", "mha", layout, heads, bpt, 3, None, 0)
    host.backup_from_device_all_layer(dev, tokens([1, 2]), tokens([5, 6]), "kernel")
    half = bpt // 2
    shares = [(0, 0, 3, 0, half), (1, 1, 3, half, bpt), (0, 2, 3, 0, bpt)]
    got = list(host.object_sums(tokens([1, 2]), shares))
    want = []
    for page in (1, 2):
        for comp, l0, l1, b0, b1 in shares:
            spans, shift = host.page_share_spans(comp, (l0, l1), (b0, b1))
            data = b"".join(bytes(np.asarray(host.read_buffer(buf))[off + page * shift : off + page * shift + n]) for buf, off, n in spans)
            want.append(_native.checksum(np.frombuffer(data, np.uint8)))
    assert got == want
    # In one read with the pages' item checks (before and after a byte of page 2 is damaged)...
    idx = tokens([1, 2])
    sums, intact = host.put_object_sums(idx, shares)
    assert list(sums) == want and intact == host.pages_intact(idx) == [True, True]
    recorded = [host.page_checksums(q * P) for q in (1, 2)]
    off = page_meta(host, 2)[0][1] + 3
    byte = np.asarray(host.read_buffer(0))[off]
    host.inject_host_corruption(0, off, bytes([byte ^ 0x20]))
    sums, intact = host.put_object_sums(idx, shares)
    assert intact == host.pages_intact(idx) == [True, False]
    assert list(sums) == list(host.object_sums(idx, shares))
    host.inject_host_corruption(0, off, bytes([byte]))
    # ... and after a get: page 1 trusted (recorded as its backup did), page 2 not (forgotten).
    expected = list(want)
    expected[len(shares)] ^= 1
    assert list(host.landed_object_sums(idx, expected, [True] * len(want), shares)) == want
    assert host.page_checksums(1 * P) == recorded[0]
    assert all(c is None for c in host.page_checksums(2 * P))
    assert list(host.landed_object_sums(idx, want, [True] * len(want), shares)) == want
    assert [host.page_checksums(q * P) for q in (1, 2)] == recorded


def test_integrity_can_be_turned_off(clients):
    s = make_store(clients.master, integrity=False, lender=clients)
    try:
        host = _dsa_store_pages(s)
        s.register_mem_pool_host(host)
        key = uuid.uuid4().hex
        assert s.batch_set_v1([key], tokens([1])) == [True]
        (obj,) = s.object_keys(key)
        assert s.store.get_size(obj) == host.get_data_page(P).size  # no trailer
        assert s.batch_get_v1([key], tokens([3])) == [True]
        assert s.integrity_stats() == {"verified": 0, "unverified": 0, "corrupt": 0, "damaged_puts": 0, "foreign": 0, "incompatible": 0, "unreachable": 0, "outages": 0, "io_errors": 0, "put_batches": 1, "lookups": 1, "hits": 1, "never_read": 0}
        assert s.get_stats() is None  # sglang's metrics hook
    finally:
        clients.give_back(s)


@pytest.mark.parametrize("executor", executors())
def test_stores_with_and_without_checksums_read_each_other(store, clients, executor):
    """Checksums off still reads objects that carry a trailer; checksums on reads trailer-less
    objects as unverified (zero copy on cpu, through the staging buffer on wgpu)."""
    plain = clients.store(store.storage_config, integrity=False)
    try:
        a, b = _dsa_store_pages(store, executor=executor), _dsa_store_pages(plain, executor=executor)
        assert a.integrity and b.integrity
        store.register_mem_pool_host(a)
        plain.register_mem_pool_host(b)
        with_sum, without = uuid.uuid4().hex, uuid.uuid4().hex
        assert store.batch_set_v1([with_sum], tokens([1])) == [True]
        assert plain.batch_set_v1([without], tokens([1])) == [True]
        assert plain.batch_get_v1([with_sum], tokens([7])) == [True]
        assert np.array_equal(b.get_data_page(7 * P), a.get_data_page(1 * P))
        unverified = store.integrity_stats()["unverified"]
        assert store.batch_get_v1([without], tokens([7])) == [True]
        assert store.integrity_stats()["unverified"] == unverified + 1
        # The host pools' own item checksums: a verified get records the landed page's (equal to
        # the page it came from); an unverified one forgets them, so loads read it as unverified.
        assert all(x is None for x in a.page_checksums(7 * P)) and all(x is None for x in b.page_checksums(7 * P))
        assert store.batch_get_v1([with_sum], tokens([9])) == [True]
        assert a.page_checksums(9 * P) == a.page_checksums(1 * P) and None not in a.page_checksums(9 * P)
    finally:
        store.unregister_mem_pool_host()
        clients.give_back(plain)




def test_the_staging_pass_refuses_a_short_buffer_before_writing():
    # The store's staging pass copies each object to byte j * stride of its buffer: a stride
    # shorter than an object, or a buffer shorter than the objects, is refused with nothing
    # written; a right-sized one holds each object's bytes and their checksums.
    device, dev, host = build("cpu", "dsa", "page_first", 1, 132, 4, None, 0)
    host.backup_from_device_all_layer(dev, tokens([1, 2]), tokens([3, 0]), "kernel")
    idx = tokens([1, 2])
    size = page_meta(host, 1)[0][2]
    objects = len(host.get_page_buffer_meta(idx))
    stride = size + 16
    buf = np.full(objects * stride, 7, np.uint8)
    for nbytes, s in [(buf.nbytes - 1, stride), (buf.nbytes, size - 4)]:
        with pytest.raises(Exception):
            host._stage_put(idx, buf.ctypes.data, nbytes, s)
        assert (buf == 7).all()
    sums, intact = host._stage_put(idx, buf.ctypes.data, buf.nbytes, stride)
    assert intact == [True, True]
    assert list(sums) == list(host.object_sums(idx))
    for j, (c, off, n) in enumerate(host.get_page_buffer_meta(idx)):
        assert np.array_equal(buf[j * stride : j * stride + n], host.read_buffer(c)[off : off + n])


def test_the_staging_pass_seals_and_the_landing_checks_trailers_as_the_trailer_module_does():
    # The sealed objects' trailers are written by the staging pass and checked by the landing
    # (one native call each way): the same words as `trailer.seal`, the same verdicts as
    # `trailer.verify`, and refusals before any byte of the buffer or the pool is written.
    from hicache_io.l3 import trailer as T

    _, dev, host = build("cpu", "dsa", "page_first", 1, 132, 4, None, 0)
    host.backup_from_device_all_layer(dev, tokens([1, 2]), tokens([3, 0]), "kernel")
    idx, size = tokens([1, 2]), page_meta(host, 1)[0][2]
    n = len(host.get_page_buffer_meta(idx))
    stride = -(-(size + 16) // 64) * 64
    keys = [uuid.uuid4().hex for _ in range(n)]
    buf = np.full(n * stride, 7, np.uint8)
    rows = buf.reshape(n, stride)[:, size : size + 16].view("<u8")
    for nbytes, at, ks in [(buf.nbytes - 1, size, keys), (buf.nbytes, stride - 15, keys), (buf.nbytes, size, keys[:-1]), (buf.nbytes, size, keys + keys)]:
        with pytest.raises(ValueError):
            host._stage_put(idx, buf.ctypes.data, nbytes, stride, seal=(at, ks))
        assert (buf == 7).all()
    sums, intact = host._stage_put(idx, buf.ctypes.data, buf.nbytes, stride, seal=(size, keys))
    assert intact == [True] * 2 and list(sums) == list(host.object_sums(idx))
    want = np.zeros((n, 2), "<u8")
    T.seal(want, np.arange(n), sums, keys)
    assert np.array_equal(rows, want)

    # Landed into pages 3 and 0 of a second pool: verified where the trailer holds; each other
    # verdict as `verify` gives it.
    _, dev2, other = build("cpu", "dsa", "page_first", 1, 132, 4, None, 0)
    to = tokens([3, 0])
    before = [other.get_data_page(p * P).copy() for p in (3, 0)]
    yes, no = np.ones(n, bool), np.zeros(n, bool)
    for args in [(keys[:-1], yes, yes), (keys, yes[:-1], yes), (keys, yes, yes[:-1])]:
        with pytest.raises(ValueError):
            other._land_sealed(to, buf.ctypes.data, buf.nbytes, stride, size, *args, yes.tolist())
    with pytest.raises(ValueError):
        other._land_sealed(to, buf.ctypes.data, buf.nbytes - 1, stride, size, keys, yes, yes, yes.tolist())
    assert all(np.array_equal(other.get_data_page(p * P), b) for p, b in zip((3, 0), before))
    got, verdicts = other._land_sealed(to, buf.ctypes.data, buf.nbytes, stride, size, keys, yes.tolist(), yes.tolist(), yes.tolist())
    assert list(got) == list(sums) and list(verdicts) == [T.VERIFIED] * n
    assert np.array_equal(other.get_data_page(3 * P), host.get_data_page(1 * P))

    def verdicts_of(ks, whole, with_trailer):
        landed, v = other._land_sealed(to, buf.ctypes.data, buf.nbytes, stride, size, ks, whole.tolist(), with_trailer.tolist(), whole.tolist())
        ok, unverified, stats = whole.copy(), ~with_trailer, {"verified": 0, "unverified": 0, "corrupt": 0}
        expected = T.verify(rows, landed, T.name_tags(ks), ok, unverified, stats)
        ok2, unverified2, stats2 = whole.copy(), ~with_trailer, {"verified": 0, "unverified": 0, "corrupt": 0}
        assert list(T.counted(v, ok2, unverified2, stats2)) == list(expected), (list(v), stats)
        assert stats2 == stats and list(ok2) == list(ok) and list(unverified2 & ok2) == list(unverified & ok)
        return list(v)

    swapped = keys[::-1] if n > 1 else ["another key"]
    assert verdicts_of(swapped, yes, yes) == [T.CORRUPT] * n
    assert verdicts_of(keys, no, yes) == [T.NOT_READ] * n
    assert verdicts_of(keys, yes, no) == [T.UNVERIFIED] * n
    # One batch of every verdict: read whole and verified, not read, without a trailer, another key.
    mixed = np.array([True, False] * n)[:n]
    assert verdicts_of([keys[0]] + ["another key"] * (n - 1), yes, yes) == [T.VERIFIED] + [T.CORRUPT] * (n - 1)
    assert verdicts_of(keys, mixed, yes) == [T.VERIFIED if m else T.NOT_READ for m in mixed]
    assert verdicts_of(keys, yes, mixed) == [T.VERIFIED if m else T.UNVERIFIED for m in mixed]
    rows[0, 0] = T.OLD_TRAILER_MAGICS[0]
    assert verdicts_of(keys, yes, yes)[0] == T.UNVERIFIED
    rows[0, 0] = T.TRAILER_MAGIC
    buf[3] ^= 1
    assert verdicts_of(keys, yes, yes)[0] == T.CORRUPT

    # A pool whose page is several spans a buffer (layer_first: one a layer, K and V each): one
    # key a span, as `get_page_buffer_meta` cuts it.
    _, dev, lf = build("cpu", "mha", "layer_first", 2, 64, 3, None, 0)
    lf.backup_from_device_all_layer(dev, tokens([1]), tokens([2]), "kernel")
    meta = lf.get_page_buffer_meta(tokens([1]))
    assert len(meta) == 6
    span = max(m[2] for m in meta)
    st = -(-(span + 16) // 64) * 64
    lbuf = np.zeros(len(meta) * st, np.uint8)
    lkeys = [uuid.uuid4().hex for _ in meta]
    with pytest.raises(ValueError):
        lf._stage_put(tokens([1]), lbuf.ctypes.data, lbuf.nbytes, st, seal=(span, lkeys[:2]))
    lsums, _ = lf._stage_put(tokens([1]), lbuf.ctypes.data, lbuf.nbytes, st, seal=(span, lkeys))
    lwant = np.zeros((len(meta), 2), "<u8")
    T.seal(lwant, np.arange(len(meta)), lsums, lkeys)
    assert np.array_equal(lbuf.reshape(len(meta), st)[:, span : span + 16].view("<u8"), lwant)
