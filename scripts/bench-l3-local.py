#!/usr/bin/env python3
"""The local-disk L3 store side by side, in one run, on the same pages in fresh folders of one
directory (``--dir``, default a temporary folder):

  * ``hicache-io local``: ``LocalStore.batch_set_v1`` / ``batch_get_v1`` (files written from and
    read into the pool's pages, 128 pages a call as sglang batches them), with checksums (the
    trailer; hicache-io's own objects) and without (``integrity=False``);
  * ``sglang file``: sglang 0.5.23's own ``HiCacheFile`` (its ``file`` backend) setting and getting
    the same pages as torch tensors, as sglang's controller hands them over (without the page
    copies the controller adds around it);
  * ``plain``: the same bytes written to one file and read back with plain sequential calls: the
    directory's ceiling.

Pages: DSA indexer pages of 8448 B (132 B x 64 tokens, one layer; hicache-io's own names) and MLA
pages of 1 MiB (4 layers x 8 tokens x 32 KiB, page_first; sglang's names). Median of ``--rounds``.
Gets are timed twice: warm (what a put just left in the page cache) and cold (every file of the
folder written back and dropped from the page cache first, ``posix_fadvise(DONTNEED)``: what a
restarted server reads from the disk).
Then the checksum passes of a call of several batches beside the store's file calls (as shipped)
and one batch after the other (``serial``), alternating: 256 head-group pages of the unified keys
(8 objects of 32 KiB a page, 18 batches) put and got (warm) in one call each.

    python3 scripts/bench-l3-local.py [--rounds 5] [--dir DIR] [--json]
"""
import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np

import hicache_io
from hicache_io.storage import STORAGE_BATCH_SIZE, HiCacheStorageConfig, LocalStore

CASES = [
    # (name, kind, bytes per token, layers, page size, pages)
    ("DSA 8448 B", "dsa", 132, 1, 64, 4096),
    ("MLA 1 MiB", "mla", 32768, 4, 8, 128),
]


def drop_cache(path):
    """Writes back and drops from the page cache every file under ``path`` (a file or a folder)."""
    os.sync()
    files = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _d, fs in os.walk(path) for f in fs]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def median(xs):
    return sorted(xs)[len(xs) // 2]


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def pools(kind, bpt, layers, page, pages):
    slots = pages if kind == "dsa" else pages * page
    dev = hicache_io.DevicePool(hicache_io.Device("cpu"), kind, bpt, slots, page, layers)
    rng = np.random.default_rng(7)
    for b in range(dev.buffer_count):
        dev.write_buffer(0, b, rng.integers(0, 256, dev.slots * dev.item_bytes, dtype=np.uint8))
    host = hicache_io.HostPool(dev, "page_first", 2 * pages * page, profile="extended")
    toks = np.arange(pages * page, dtype=np.int64)
    host.backup_from_device_all_layer(dev, toks, toks, "kernel")
    return host, toks


def local_rounds(root, host, toks, page, pages, integrity, rounds, writes="cached"):
    puts, gets, colds = [], [], []
    back = toks + pages * page
    for r in range(rounds):
        d = os.path.join(root, f"local-{integrity}-{writes}-{r}")
        s = LocalStore(HiCacheStorageConfig(model_name="bench"), {"hicache_io_local_writes": writes}, directory=d, capacity_bytes=1 << 40, integrity=integrity)
        s.register_mem_pool_host(host)
        keys = [f"p{i}" for i in range(pages)]
        n = STORAGE_BATCH_SIZE

        def put():
            for a in range(0, pages, n):
                assert all(s.batch_set_v1(keys[a : a + n], toks[a * page : (a + n) * page]))

        def get():
            for a in range(0, pages, n):
                assert all(s.batch_get_v1(keys[a : a + n], back[a * page : (a + n) * page]))

        puts.append(timed(put))
        gets.append(timed(get))
        drop_cache(d)
        colds.append(timed(get))
        s.close()
        shutil.rmtree(d)
    return median(puts), median(gets), median(colds)


def sglang_file_rounds(root, host, toks, page, pages, rounds):
    try:
        import torch
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig as SglangConfig
    except ImportError as e:
        return None, f"sglang not importable ({e})"
    values = [torch.from_numpy(np.asarray(host.get_data_page(int(t)))) for t in toks[::page]]
    targets = [torch.empty_like(v) for v in values]
    puts, gets, colds = [], [], []
    for r in range(rounds):
        d = os.path.join(root, f"sglang-{r}")
        os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = d
        cfg = SglangConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=True, model_name="bench")
        f = HiCacheFile(cfg)
        keys = [f"p{i}" for i in range(pages)]
        n = STORAGE_BATCH_SIZE

        def put():
            for a in range(0, pages, n):
                assert f.batch_set(keys[a : a + n], values[a : a + n])

        def get():
            for a in range(0, pages, n):
                assert all(x is not None for x in f.batch_get(keys[a : a + n], targets[a : a + n]))

        puts.append(timed(put))
        gets.append(timed(get))
        drop_cache(d)
        colds.append(timed(get))
        shutil.rmtree(d)
    assert all(torch.equal(a, b) for a, b in zip(values, targets))
    return (median(puts), median(gets), median(colds)), None


def plain_rounds(root, host, toks, page, rounds):
    data = np.concatenate([np.asarray(host.get_data_page(int(t))) for t in toks[::page]])
    out = np.empty_like(data)
    puts, gets, colds = [], [], []
    for r in range(rounds):
        p = os.path.join(root, f"plain-{r}.bin")

        def put():
            with open(p, "wb") as f:
                f.write(memoryview(data))

        def get():
            with open(p, "rb", buffering=0) as f:
                f.readinto(memoryview(out))

        puts.append(timed(put))
        gets.append(timed(get))
        drop_cache(p)
        colds.append(timed(get))
        os.unlink(p)
    assert np.array_equal(data, out)
    return median(puts), median(gets), median(colds), data.nbytes


def overlap_rounds(root, rounds):
    """Median seconds of a put and a warm get of 256 head-group pages in one call each, the
    batches' checksum passes overlapping the file calls and not: ``{True: (put, get), False: ...}``."""
    from hicache_io.l3 import pipeline

    dev = hicache_io.DevicePool(hicache_io.Device("cpu"), "mha", 4 * 256, 256 * 16, 16, 8)
    rng = np.random.default_rng(3)
    for b in range(dev.buffer_count):
        dev.write_buffer(0, b, rng.integers(0, 256, dev.slots * dev.item_bytes, dtype=np.uint8))
    host = hicache_io.HostPool(dev, "page_first_direct_hg", 256 * 16, head_num=4, profile="extended")
    toks = np.arange(256 * 16, dtype=np.int64)
    host.backup_from_device_all_layer(dev, toks, toks, "kernel")
    extra = {"hicache_io_key_scheme": "unified", "hicache_io_kv_heads": 8, "hicache_io_head_group": 1}
    cfg = HiCacheStorageConfig(model_name="bench", tp_rank=0, tp_size=2, extra_config=extra)
    shipped, times = pipeline.OVERLAP_MIN_BYTES, {True: ([], []), False: ([], [])}
    s = LocalStore(cfg, {}, directory=os.path.join(root, "overlap"), capacity_bytes=1 << 40)
    s.register_mem_pool_host(host)
    try:
        for r in range(rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                pipeline.OVERLAP_MIN_BYTES = shipped if on else 1 << 62
                keys = [f"r{r}-{on}-{i}" for i in range(256)]
                ok = []
                times[on][0].append(timed(lambda: ok.extend(s.batch_set_v1(keys, toks))))
                times[on][1].append(timed(lambda: ok.extend(s.batch_get_v1(keys, toks))))
                assert all(ok), s.last_error
                s.clear()
    finally:
        pipeline.OVERLAP_MIN_BYTES = shipped
        s.close()
    return {on: (median(p), median(g)) for on, (p, g) in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--writes", default="cached", help="LocalStore's hicache_io_local_writes, a comma list: each also gets a row of its own (cached, direct, buffered)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="hicache-io-bench-l3-", dir=args.dir)
    rows = []
    try:
        for name, kind, bpt, layers, page, pages in CASES:
            host, toks = pools(kind, bpt, layers, page, pages)
            *plain, nbytes = plain_rounds(root, host, toks, page, args.rounds)
            gb = nbytes / 1e9
            row = {"pages": name, "bytes": nbytes, "plain": [gb / t for t in plain]}
            writes = args.writes.split(",")
            for integrity in (True, False):
                times = local_rounds(root, host, toks, page, pages, integrity, args.rounds, writes[0])
                row["local" + ("" if integrity else " unchecked")] = [gb / t for t in times]
            for w in writes[1:]:
                times = local_rounds(root, host, toks, page, pages, True, args.rounds, w)
                row[f"local {w}"] = [gb / t for t in times]
            file_times, why = sglang_file_rounds(root, host, toks, page, pages, args.rounds)
            row["sglang file"] = [gb / t for t in file_times] if file_times else why
            rows.append(row)
        overlap = overlap_rounds(root, args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps({"rows": rows, "overlap": {"put_s": overlap[True][0], "get_s": overlap[True][1], "put_serial_s": overlap[False][0], "get_serial_s": overlap[False][1]}}, indent=2))
        return
    print(f"{'pages':<12} {'path':<22} {'put GB/s':>9} {'get GB/s':>9} {'cold get':>9} {'put x file':>11} {'get x file':>11} {'cold x file':>12} {'get x plain':>12}")
    for r in rows:
        f = r["sglang file"] if isinstance(r["sglang file"], list) else None
        for path in [k for k in r if k.startswith("local")] + ["sglang file", "plain"]:
            v = r[path]
            if not isinstance(v, list):
                print(f"{r['pages']:<12} {path:<22} {v}")
                continue
            fmt = lambda x: f"{x:.2f}" if isinstance(x, float) else x  # noqa: E731
            vs_file = [fmt(v[i] / f[i]) for i in range(3)] if f else ["-"] * 3
            print(f"{r['pages']:<12} {path:<22} {v[0]:>9.2f} {v[1]:>9.2f} {v[2]:>9.2f} {vs_file[0]:>11} {vs_file[1]:>11} {vs_file[2]:>12} {v[1] / r['plain'][1]:>12.2f}")
    (put, get), (put1, get1) = overlap[True], overlap[False]
    print()
    print(f"{'2048 head-group objects, one call':<34} {'put ms':>7} {'serial':>7} {'ratio':>6} {'get ms':>7} {'serial':>7} {'ratio':>6}")
    print(f"{'checksummed, unified keys':<34} {put * 1e3:>7.2f} {put1 * 1e3:>7.2f} {put1 / put:>6.2f} {get * 1e3:>7.2f} {get1 * 1e3:>7.2f} {get1 / get:>6.2f}")


if __name__ == "__main__":
    main()
