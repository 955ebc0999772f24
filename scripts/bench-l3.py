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
holding the same pages, in the same batches. Fresh keys every round, median of the rounds.
Then a layer-sharded DSA indexer backup (layers 2..6 of 8 and one MTP draft layer, page_first,
what sglang refuses) into the host pool followed by ``batch_set_v1`` of its pages: the pipeline
an engine runs, end to end.

    python3 scripts/bench-l3.py [--rounds 5] [--json]

Needs the hicache_io package and ``mooncake-transfer-engine-non-cuda``.
"""
import argparse
import json
import sys
import time
import uuid

import numpy as np

import hicache_io
from hicache_io.storage import STORAGE_BATCH_SIZE, HiCacheStorageConfig, LocalMaster, MooncakeStore


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def clear(store):
    """Empties the store between rounds (objects can be removed once their lease has run out)."""
    time.sleep(0.15)
    store.clear()


def page_tokens(pages, p):
    return np.concatenate([np.arange(q * p, (q + 1) * p) for q in pages]).astype(np.int64)


def pool_for(kind, bytes_per_token, layers, page, pages):
    dev = hicache_io.DevicePool(hicache_io.Device("cpu"), kind, bytes_per_token, pages if kind == "dsa" else pages * page, page, layers)
    host = hicache_io.HostPool(dev, "page_first", pages * page, profile="extended")
    return dev, host


def object_case(store, name, kind, bytes_per_token, layers, page, pages, rounds, integrity=True):
    store.integrity = integrity
    dev, host = pool_for(kind, bytes_per_token, layers, page, pages)
    rng = np.random.default_rng(1)
    for c in range(host.components):
        host.write_buffer(c, rng.integers(0, 256, host.buffer_bytes, dtype=np.uint8))
    toks = page_tokens(range(pages), page)
    store.register_mem_pool_host(host)
    obj = store._layout.obj_bytes
    total = pages * obj
    ours_put, ours_get, mc_put, mc_get = [], [], [], []
    try:
        # The same bytes in a buffer registered for Mooncake's own calls.
        raw = np.ascontiguousarray(host.read_buffer(0)[: total])
        assert store.store.register_buffer(raw.ctypes.data, raw.nbytes) == 0
        out = np.zeros_like(raw)
        assert store.store.register_buffer(out.ctypes.data, out.nbytes) == 0
        for r in range(rounds):
            keys = [uuid.uuid4().hex for _ in range(pages)]
            mkeys = [uuid.uuid4().hex for _ in range(pages)]
            results = {}

            def ours():
                ours_put.append(timed(lambda: results.update(put=store.batch_set_v1(keys, toks))))
                ours_get.append(timed(lambda: results.update(get=store.batch_get_v1(keys, toks))))
                assert all(results["put"]) and all(results["get"]), store.last_error
                clear(store)

            def put():
                for a in range(0, pages, STORAGE_BATCH_SIZE):
                    n = min(STORAGE_BATCH_SIZE, pages - a)
                    rcs = store.store.batch_put_from(mkeys[a : a + n], [raw.ctypes.data + (a + j) * obj for j in range(n)], [obj] * n)
                    assert all(rc == 0 for rc in rcs), rcs[:4]

            def get():
                for a in range(0, pages, STORAGE_BATCH_SIZE):
                    n = min(STORAGE_BATCH_SIZE, pages - a)
                    got = store.store.batch_get_into(mkeys[a : a + n], [out.ctypes.data + (a + j) * obj for j in range(n)], [obj] * n)
                    assert all(g == obj for g in got), got[:4]

            def theirs():
                out.fill(0)
                mc_put.append(timed(put))
                mc_get.append(timed(get))
                assert np.array_equal(out, raw), "Mooncake's own get returned other bytes"
                clear(store)

            # Alternate who goes first, so neither always meets a freshly emptied store.
            for step in (ours, theirs) if r % 2 == 0 else (theirs, ours):
                step()
        store.store.unregister_buffer(raw.ctypes.data)
        store.store.unregister_buffer(out.ctypes.data)
    finally:
        store.unregister_mem_pool_host()
    gbs = lambda ts: total / median(ts) / 1e9  # noqa: E731
    store.integrity = True
    return {
        "case": name, "object_bytes": obj, "pages": pages, "integrity": integrity,
        "put_gbs": gbs(ours_put), "get_gbs": gbs(ours_get),
        "mooncake_put_gbs": gbs(mc_put), "mooncake_get_gbs": gbs(mc_get),
    }


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
    obj = store._layout.obj_bytes
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
    with LocalMaster(lease_ms=100) as master:
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
    if args.json:
        print(json.dumps({"objects": rows, "pipeline": pipe}, indent=2))
        return
    print(f"{'object':<24} {'bytes':>8} {'pages':>6} {'put GB/s':>9} {'mooncake':>9} {'ratio':>6} {'get GB/s':>9} {'mooncake':>9} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['case']:<24} {r['object_bytes']:>8} {r['pages']:>6} {r['put_gbs']:>9.2f} {r['mooncake_put_gbs']:>9.2f} {r['put_gbs'] / r['mooncake_put_gbs']:>6.2f}"
            f" {r['get_gbs']:>9.2f} {r['mooncake_get_gbs']:>9.2f} {r['get_gbs'] / r['mooncake_get_gbs']:>6.2f}"
        )
    print(
        f"{pipe['case']}: {pipe['pages']} pages of {pipe['object_bytes']} B; backup {pipe['backup_gbs']:.2f} GB/s, "
        f"put {pipe['put_gbs']:.2f} GB/s, backup then put {pipe['pipeline_gbs']:.2f} GB/s"
    )


if __name__ == "__main__":
    sys.exit(main())
