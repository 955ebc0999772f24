#!/usr/bin/env python3
"""L3 throughput through Mooncake Store, next to Mooncake's own put/get of the same bytes, in one
run on a master this script starts on loopback.

For each object size, a host pool whose page is one object of that size:
  * 8448 B: a DSA indexer pool, 1 layer (DeepSeek V3.2's 132 B x 64-token page), page_first,
    with its checksum trailer (hicache-io's own objects) and without (``integrity=False``);
  * 1 MiB: an MLA pool, 4 layers x 8 tokens x 32 KiB, page_first (sglang's names, no trailer);
``hicache-io`` is ``MooncakeStore.batch_set_v1`` / ``batch_get_v1`` (zero-copy from and to the pool's
registered pages, 128 pages per call as sglang batches them); ``mooncake`` is
``MooncakeDistributedStore.batch_put_from`` / ``batch_get_into`` on a registered numpy buffer
holding the same pages, in batches of as many objects as the store's calls. For hicache-io's checksummed objects, ``+16 B`` is
Mooncake's own ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` of the same objects
with a 16-byte trailer buffer each: the shape those objects have, so the ratio to it is what
hicache-io adds. Fresh keys every round, median of the rounds.
Then head-group objects of the unified key scheme (hicache_io.l3.unified): a TP=2 rank of a
model with 8 kv heads, each page 8 objects of 32 KiB (one per kv head and component), moved in
place from a ``page_first_direct_hg`` pool (one span an object) and a ``page_unified`` one (one
span per layer) with Mooncake's scatter/gather calls, next to Mooncake's ``batch_put_from`` /
``batch_get_into`` of as many objects of that size from one registered buffer.
For each row also hicache-io's own time: the same calls on a client that moves nothing (keys,
staging and checksum passes, trailers, verdicts), and the ceiling that leaves, bare / (bare + own),
for calls of one batch: in a call of several batches of 2 MiB or more (the head-group rows), the
checksum passes run on the store's second thread beside the transport's calls. Then the same
head-group calls with that overlap and without it (one batch after the other), in one run.
Then a layer-sharded DSA indexer backup (layers 2..6 of 8 and one MTP draft layer, page_first,
what sglang refuses) into the host pool followed by ``batch_set_v1`` of its pages: the pipeline
an engine runs, end to end.

    python3 scripts/bench-l3.py [--rounds 5] [--json]

Needs the hicache_io package and ``mooncake-transfer-engine-non-cuda``.
"""
import argparse
import ctypes
import json
import sys
import time
import uuid

import numpy as np

import hicache_io
from hicache_io.storage import HiCacheStorageConfig, LocalMaster, MooncakeStore


#: The master's object lease: long enough for a cold batch of 1,024 objects (Mooncake fails a get
#: whose lease runs out mid-transfer, -707), short enough to empty the store between rounds.
LEASE_S = 0.5


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def clear(store):
    """Empties the store between rounds (objects can be removed once their lease has run out)."""
    time.sleep(LEASE_S + 0.05)
    store.clear()


def page_tokens(pages, p):
    return np.concatenate([np.arange(q * p, (q + 1) * p) for q in pages]).astype(np.int64)


def pool_for(kind, bytes_per_token, layers, page, pages, layout="page_first", groups=1):
    dev = hicache_io.DevicePool(hicache_io.Device("cpu"), kind, bytes_per_token, pages if kind == "dsa" else pages * page, page, layers)
    host = hicache_io.HostPool(dev, layout, pages * page, head_num=groups, profile="extended")
    return dev, host


class NullClient:
    """A Mooncake client that moves nothing but each object's last 16 bytes (its trailer, where it
    has one: kept at put, written back at get) and answers every object as written or read whole:
    the same store calls on it time hicache-io's own work (keys, staging and checksum passes,
    trailers, verdicts), the part of a row that is not Mooncake's. ``spent``: its own seconds, taken
    out of the timings."""

    def __init__(self):
        self.tails, self.spent = {}, 0.0

    def register_buffer(self, addr, nbytes):
        return 0

    def unregister_buffer(self, addr):
        return 0

    def _move(self, keys, ptrs, sizes, put):
        t = time.perf_counter()
        for k, p, n in zip(keys, ptrs, sizes):
            p, n = (p[-1], n[-1]) if isinstance(p, list) else (p, n)
            if n < 16:  # no trailer there: nothing to keep
                continue
            if put:
                self.tails[k] = ctypes.string_at(p + n - 16, 16)
            else:
                ctypes.memmove(p + n - 16, self.tails[k], 16)
        answers = [0] * len(keys) if put else [sum(n) if isinstance(n, list) else n for n in sizes]
        self.spent += time.perf_counter() - t
        return answers

    def batch_put_from(self, keys, ptrs, sizes, *config):
        return self._move(keys, ptrs, sizes, True)

    batch_put_from_multi_buffers = batch_put_from

    def batch_get_into(self, keys, ptrs, sizes):
        return self._move(keys, ptrs, sizes, False)

    batch_get_into_multi_buffers = batch_get_into

    def batch_is_exist(self, keys):
        return [0] * len(keys)

    def get(self, key):
        return None

    def put(self, key, value, *config):
        return 0

    def close(self):
        pass


def own_time(store, host, toks, page, pages, rounds):
    """hicache-io's own time for a row's put and get (median of ``rounds``): the store's calls on a
    :class:`NullClient`, one batch of pages a call, each get right after its put (so the bytes and trailers it checks are the ones that put left where it reads them)."""
    client = NullClient()
    null = MooncakeStore(store.storage_config, {}, store=client, integrity=store.integrity)
    null.register_mem_pool_host(host)
    puts, gets = [], []

    def own(fn):
        before = client.spent
        return timed(fn) - (client.spent - before)

    try:
        for _ in range(rounds):
            p = g = 0.0
            step = null.registered.pages_a_batch(null.integrity)  # one batch a call (sealed objects' batches may hold fewer than 128 pages)
            for a in range(0, pages, step):
                keys = [uuid.uuid4().hex for _ in range(min(step, pages - a))]
                idx = toks[a * page : (a + len(keys)) * page]
                p += own(lambda: null.batch_set_v1(keys, idx))
                ok = []
                g += own(lambda: ok.extend(null.batch_get_v1(keys, idx)))
                assert all(ok), null.last_error
            client.tails.clear()
            puts.append(p)
            gets.append(g)
    finally:
        null.unregister_mem_pool_host()
        null.close()
    return median(puts), median(gets)


def object_case(store, name, kind, bytes_per_token, layers, page, pages, rounds, integrity=True, layout="page_first", groups=1):
    store.integrity = integrity
    dev, host = pool_for(kind, bytes_per_token, layers, page, pages, layout, groups)
    rng = np.random.default_rng(1)
    for c in range(host.components):
        host.write_buffer(c, rng.integers(0, 256, host.buffer_bytes, dtype=np.uint8))
    toks = page_tokens(range(pages), page)
    store.register_mem_pool_host(host)
    reg = store.registered
    grid = reg.grid  # the unified scheme's objects (head groups), else one object a page
    trailer = integrity and reg.trailers is not None  # hicache-io's own objects, checksummed
    obj = grid.object_bytes[0] if grid else reg.layout.obj_bytes
    per_page = len(grid.suffixes) if grid else 1
    total = pages * per_page * obj
    batch = reg.pages_a_batch(integrity) * per_page  # the store's calls' objects (fewer pages where sealed objects are large)
    ours_put, ours_get, mc_put, mc_get, tr_put, tr_get = [], [], [], [], [], []
    try:
        # As many bytes, in objects of the same size, in a buffer registered for Mooncake's own calls.
        raw = rng.integers(0, 256, total, dtype=np.uint8)
        assert store.store.register_buffer(raw.ctypes.data, raw.nbytes) == 0
        out = np.zeros_like(raw)
        assert store.store.register_buffer(out.ctypes.data, out.nbytes) == 0
        # 16-byte trailers beside each object, for Mooncake's own two-buffer calls (the shape of a
        # checksummed object).
        trailers = np.zeros(16 * (batch + 1), dtype=np.uint8)
        assert store.store.register_buffer(trailers.ctypes.data, trailers.nbytes) == 0
        for r in range(rounds):
            keys = [uuid.uuid4().hex for _ in range(pages)]
            mkeys = [uuid.uuid4().hex for _ in range(pages * per_page)]
            results = {}

            def ours():
                ours_put.append(timed(lambda: results.update(put=store.batch_set_v1(keys, toks))))
                ours_get.append(timed(lambda: results.update(get=store.batch_get_v1(keys, toks))))
                assert all(results["put"]) and all(results["get"]), store.last_error
                clear(store)

            def put():
                for a in range(0, len(mkeys), batch):
                    n = min(batch, len(mkeys) - a)
                    rcs = store.store.batch_put_from(mkeys[a : a + n], [raw.ctypes.data + (a + j) * obj for j in range(n)], [obj] * n)
                    assert all(rc == 0 for rc in rcs), rcs[:4]

            def get():
                for a in range(0, len(mkeys), batch):
                    n = min(batch, len(mkeys) - a)
                    got = store.store.batch_get_into(mkeys[a : a + n], [out.ctypes.data + (a + j) * obj for j in range(n)], [obj] * n)
                    assert all(g == obj for g in got), got[:4]

            tkeys = [uuid.uuid4().hex for _ in range(pages * per_page)]

            def put2():
                for a in range(0, len(tkeys), batch):
                    n = min(batch, len(tkeys) - a)
                    bufs = [[raw.ctypes.data + (a + j) * obj, trailers.ctypes.data + 16 * j] for j in range(n)]
                    rcs = store.store.batch_put_from_multi_buffers(tkeys[a : a + n], bufs, [[obj, 16]] * n)
                    assert all(rc == 0 for rc in rcs), rcs[:4]

            def get2():
                for a in range(0, len(tkeys), batch):
                    n = min(batch, len(tkeys) - a)
                    bufs = [[out.ctypes.data + (a + j) * obj, trailers.ctypes.data + 16 * j] for j in range(n)]
                    got = store.store.batch_get_into_multi_buffers(tkeys[a : a + n], bufs, [[obj, 16]] * n)
                    assert all(g == obj + 16 for g in got), got[:4]

            def theirs():
                out.fill(0)
                mc_put.append(timed(put))
                mc_get.append(timed(get))
                assert np.array_equal(out, raw), "Mooncake's own get returned other bytes"
                if trailer:
                    out.fill(0)
                    tr_put.append(timed(put2))
                    tr_get.append(timed(get2))
                    assert np.array_equal(out, raw), "Mooncake's own get returned other bytes"
                clear(store)

            # Alternate who goes first, so neither always meets a freshly emptied store.
            for step in (ours, theirs) if r % 2 == 0 else (theirs, ours):
                step()
        store.store.unregister_buffer(raw.ctypes.data)
        store.store.unregister_buffer(out.ctypes.data)
        store.store.unregister_buffer(trailers.ctypes.data)
    finally:
        store.unregister_mem_pool_host()
    own_put, own_get = own_time(store, host, toks, page, pages, rounds)
    gbs = lambda ts: total / median(ts) / 1e9  # noqa: E731
    store.integrity = True
    return {
        # Seconds: hicache-io's own work (on a client that moves nothing) and Mooncake's bare calls.
        "own_put_s": own_put, "own_get_s": own_get, "mooncake_put_s": median(mc_put), "mooncake_get_s": median(mc_get),
        "put_s": median(ours_put), "get_s": median(ours_get),
        "case": name, "object_bytes": obj, "pages": pages, "objects_per_page": per_page, "integrity": integrity,
        "put_gbs": gbs(ours_put), "get_gbs": gbs(ours_get),
        "mooncake_put_gbs": gbs(mc_put), "mooncake_get_gbs": gbs(mc_get),
        # Mooncake's own calls on the same objects with a 16-byte trailer buffer each.
        "mooncake_trailer_put_gbs": gbs(tr_put) if tr_put else None, "mooncake_trailer_get_gbs": gbs(tr_get) if tr_get else None,
    }


def overlap_case(store, name, layout, rounds):
    """A head-group pool's put and get of 2,048 objects in one call each, with the checksum passes
    overlapping the transport (as shipped) and without (every batch overlap-sized refused), the
    two alternating; median seconds of each."""
    from hicache_io.l3 import pipeline

    dev, host = pool_for("mha", 4 * 256, 8, 16, 256, layout, 4)
    rng = np.random.default_rng(3)
    for c in range(host.components):
        host.write_buffer(c, rng.integers(0, 256, host.buffer_bytes, dtype=np.uint8))
    toks = page_tokens(range(256), 16)
    shipped, times = pipeline.OVERLAP_MIN_BYTES, {True: ([], []), False: ([], [])}
    store.register_mem_pool_host(host)
    try:
        for r in range(rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                pipeline.OVERLAP_MIN_BYTES = shipped if on else 1 << 62
                keys = [uuid.uuid4().hex for _ in range(256)]
                ok = []
                times[on][0].append(timed(lambda: ok.extend(store.batch_set_v1(keys, toks))))
                times[on][1].append(timed(lambda: ok.extend(store.batch_get_v1(keys, toks))))
                assert all(ok), store.last_error
                clear(store)
    finally:
        pipeline.OVERLAP_MIN_BYTES = shipped
        store.unregister_mem_pool_host()
    return {"case": name, "put_s": median(times[True][0]), "put_off_s": median(times[False][0]), "get_s": median(times[True][1]), "get_off_s": median(times[False][1])}


def sharded_pipeline(store, rounds):
    """Layer-sharded DSA indexer backup (page_first) then L3 put of the same pages."""
    page, pages = 64, 512
    dev = hicache_io.DevicePool(hicache_io.Device("cpu"), "dsa", 132, pages, page, 8, layer_shard=(2, 6), drafts=1)
    rng = np.random.default_rng(2)
    for b in range(dev.buffer_count):
        dev.write_buffer(0, b, rng.integers(0, 256, dev.slots * dev.item_bytes, dtype=np.uint8))
    host = hicache_io.HostPool(dev, "page_first", pages * page, profile="extended")
    toks = page_tokens(range(pages), page)
    store.register_mem_pool_host(host)
    obj = store.registered.layout.obj_bytes
    backup, put = [], []
    try:
        for _ in range(rounds):
            keys = [uuid.uuid4().hex for _ in range(pages)]
            backup.append(timed(lambda: host.backup_from_device_all_layer(dev, toks, toks, "kernel")))
            ok = []
            put.append(timed(lambda: ok.extend(store.batch_set_v1(keys, toks))))
            assert all(ok), store.last_error
            clear(store)
    finally:
        store.unregister_mem_pool_host()
    total = pages * obj
    return {
        "case": "sharded dsa backup -> L3", "object_bytes": obj, "pages": pages,
        "backup_gbs": total / median(backup) / 1e9, "put_gbs": total / median(put) / 1e9,
        "pipeline_gbs": total / (median(backup) + median(put)) / 1e9,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with LocalMaster(lease_ms=int(LEASE_S * 1000)) as master:
        cfg = HiCacheStorageConfig(model_name="bench", extra_config={"master_server_address": master.address, "global_segment_size": 1 << 30, "local_buffer_size": 16 << 20})
        store = MooncakeStore(cfg, {})
        try:
            rows = [
                object_case(store, "dsa page, checksummed", "dsa", 132, 1, 64, 2048, args.rounds),
                object_case(store, "dsa page, no checksum", "dsa", 132, 1, 64, 2048, args.rounds, integrity=False),
                object_case(store, "mla page (sglang key)", "mla", 32768, 4, 8, 256, args.rounds),
            ]
            pipe = sharded_pipeline(store, args.rounds)
        finally:
            store.close()
        # Unified keys: a TP=2 rank 0 of a model with 8 kv heads of 256 B (head dim 128, bf16), 8
        # layers, 16-token pages; one object per (kv head, component): 32 KiB, 8 a page.
        extra = dict(cfg.extra_config, hicache_io_key_scheme="unified", hicache_io_kv_heads=8, hicache_io_head_group=1)
        store = MooncakeStore(HiCacheStorageConfig(model_name="bench", tp_rank=0, tp_size=2, extra_config=extra), {})
        try:
            for layout, spans, summed in (("page_first_direct_hg", "1 span", True), ("page_unified", "8 spans", True), ("page_first_direct_hg", "1 span, no sum", False)):
                rows.append(object_case(store, f"head group, {spans}", "mha", 4 * 256, 8, 16, 256, args.rounds, integrity=summed, layout=layout, groups=4))
            overlapped = [overlap_case(store, f"head group, {spans}", layout, args.rounds) for layout, spans in (("page_first_direct_hg", "1 span"), ("page_unified", "8 spans"))]
        finally:
            store.close()
    if args.json:
        print(json.dumps({"objects": rows, "pipeline": pipe, "overlap": overlapped}, indent=2))
        return
    # "+16 B": Mooncake's own two-buffer calls, each object with a 16-byte trailer buffer (the
    # shape of a checksummed object), and hicache-io's ratio to them.
    print(f"{'object':<26} {'bytes':>7} {'objects':>7} {'put GB/s':>9} {'mooncake':>9} {'ratio':>6} {'+16 B':>6} {'ratio':>6}"
          f" {'get GB/s':>9} {'mooncake':>9} {'ratio':>6} {'+16 B':>6} {'ratio':>6}")
    for r in rows:
        tp, tg = r["mooncake_trailer_put_gbs"], r["mooncake_trailer_get_gbs"]
        trail = lambda ours, t: f" {t:>6.2f} {ours / t:>6.2f}" if t else f" {'-':>6} {'-':>6}"  # noqa: E731
        print(
            f"{r['case']:<26} {r['object_bytes']:>7} {r['pages'] * r['objects_per_page']:>7} {r['put_gbs']:>9.2f} {r['mooncake_put_gbs']:>9.2f} {r['put_gbs'] / r['mooncake_put_gbs']:>6.2f}"
            + trail(r["put_gbs"], tp)
            + f" {r['get_gbs']:>9.2f} {r['mooncake_get_gbs']:>9.2f} {r['get_gbs'] / r['mooncake_get_gbs']:>6.2f}"
            + trail(r["get_gbs"], tg)
        )
    # Where a row's time goes: hicache-io's own work (the same calls on a client that moves
    # nothing) next to Mooncake's bare calls; "ceiling": the ratio were Mooncake to take exactly
    # its bare time inside hicache-io's calls, bare / (bare + own).
    print()
    print(f"{'object':<26} {'put ms':>7} {'own':>6} {'bare':>6} {'ceiling':>7} {'get ms':>7} {'own':>6} {'bare':>6} {'ceiling':>7}")
    for r in rows:
        cells = []
        for d in ("put", "get"):
            bare, own = r[f"mooncake_{d}_s"], r[f"own_{d}_s"]
            cells.append(f" {r[f'{d}_s'] * 1e3:>7.2f} {own * 1e3:>6.2f} {bare * 1e3:>6.2f} {bare / (bare + own):>7.2f}")
        print(f"{r['case']:<26}" + "".join(cells))
    # The checksum passes beside the transport's calls (shipped) and one batch after the other.
    print()
    print(f"{'2048 objects, one call':<26} {'put ms':>7} {'serial':>7} {'ratio':>6} {'get ms':>7} {'serial':>7} {'ratio':>6}")
    for o in overlapped:
        print(f"{o['case']:<26} {o['put_s'] * 1e3:>7.2f} {o['put_off_s'] * 1e3:>7.2f} {o['put_off_s'] / o['put_s']:>6.2f}"
              f" {o['get_s'] * 1e3:>7.2f} {o['get_off_s'] * 1e3:>7.2f} {o['get_off_s'] / o['get_s']:>6.2f}")
    print()
    print(
        f"{pipe['case']}: {pipe['pages']} pages of {pipe['object_bytes']} B; backup {pipe['backup_gbs']:.2f} GB/s, "
        f"put {pipe['put_gbs']:.2f} GB/s, backup then put {pipe['pipeline_gbs']:.2f} GB/s"
    )


if __name__ == "__main__":
    sys.exit(main())
