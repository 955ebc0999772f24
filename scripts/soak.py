#!/usr/bin/env python3
"""Soak: one pool pair driven the way a serving engine drives it, for a given time, every byte
checked; fails on a wrong byte or on resource growth past the bounds below.

    python scripts/soak.py [--seconds 600] [--executor cpu|wgpu] [--dir DIR] [--json out.json]

Threads (each claims the pages it works on; pages are the unit of ownership, as in an engine):
- ``arrive``: new KV arrives in free host pages (``set_from_flat_data_page``, bytes from a seed);
- ``scheduler``: loads a host page into a free device page layer by layer
  (``load_to_device_per_layer``, one call a layer, as an engine overlaps them with compute);
- ``backup``: backs a device page up into a free host page (``backup_from_device_all_layer``)
  and checks every byte of it (``get_data_page``) against the seed it was loaded from: a load
  or a backup that moved a wrong byte fails here; then the device page is freed;
- ``l3-put``: puts host pages to the L3 tier (``LocalStore``, a directory of the run's own);
- ``prefetch``: gets pages stored earlier back into free host pages and checks every byte
  (a miss is allowed: the store is bounded, least recently used pages go; a wrong byte is not);
- host pages are evicted (made free) when none is free, as an engine's radix cache does.

It reports throughput per thread and, after a warm-up and at the end, the process's resident
memory, open file descriptors and threads. Bounds: resident memory may grow by at most
``--rss-growth-mib`` (64 MiB by default), descriptors by 8 beyond those the local store's packs may
hold open (``_native.PACK_DESCRIPTORS``, and the writer's own pack), threads by 2."""

import argparse
import collections
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time

sys.modules.setdefault("sglang", None)  # the store without sglang's base class: no torch import

import numpy as np  # noqa: E402

import hicache_io  # noqa: E402
from hicache_io.storage import LocalStore  # noqa: E402

P = 8  # tokens a page


def proc_stats():
    rss = threads = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return {"rss_mib": round(rss / 2**20, 1), "fds": len(os.listdir("/proc/self/fd")), "threads": threads}


class Pages:
    """Page states under one lock: ``None`` free, ``("busy", ...)`` claimed, else the seed held."""

    def __init__(self, n, first=0):
        self.state = {i: None for i in range(first, first + n)}
        self.lock = threading.Lock()

    def claim(self, want, rng):
        """A page whose state satisfies ``want`` (free: ``None``; held: ``"held"``), marked busy;
        ``(page, seed)`` or ``None``."""
        with self.lock:
            cands = [p for p, s in self.state.items() if (s is None if want is None else isinstance(s, int))]
            if not cands:
                return None
            p = rng.choice(cands)
            seed = self.state[p]
            self.state[p] = ("busy",)
            return p, seed

    def release(self, p, seed):
        with self.lock:
            self.state[p] = seed

    def evict_one(self, rng):
        with self.lock:
            held = [p for p, s in self.state.items() if isinstance(s, int)]
            if held:
                self.state[rng.choice(held)] = None
            return bool(held)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--executor", default="cpu", choices=["cpu", "wgpu"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--bytes-per-token", type=int, default=576)
    ap.add_argument("--host-pages", type=int, default=96)
    ap.add_argument("--device-pages", type=int, default=32)
    ap.add_argument("--l3-capacity-mib", type=int, default=64)
    ap.add_argument("--rss-growth-mib", type=float, default=64)
    ap.add_argument("--warmup", type=float, default=None, help="seconds before the first resource reading (default: a tenth of the run, at most 30)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json")
    args = ap.parse_args()

    device = hicache_io.Device(args.executor)
    dev = hicache_io.DevicePool(device, "mla", args.bytes_per_token, (args.device_pages + 1) * P, P, args.layers)
    host = hicache_io.HostPool(dev, "page_first", args.host_pages * P, profile="extended")
    page_len = len(host.get_dummy_flat_data_page())
    root = tempfile.mkdtemp(prefix="hicache-io-soak-", dir=args.dir)
    store = LocalStore(kwargs={"hicache_io_local_dir": root, "hicache_io_local_capacity_bytes": args.l3_capacity_mib << 20})
    store.register_mem_pool_host(host)

    hosts, devs = Pages(args.host_pages), Pages(args.device_pages, first=1)
    # The most recent keys put (older ones are mostly evicted by the store's capacity); bounded,
    # so that the script's own memory stays flat.
    stored, stored_lock = collections.deque(maxlen=4096), threading.Lock()
    seeds = iter(range(1, 1 << 62))
    seeds_lock = threading.Lock()
    stop = threading.Event()
    failures, counts = [], {k: 0 for k in ("arrive", "load_layers", "backup", "l3_put", "prefetch_hit", "prefetch_miss", "evict")}
    counts_lock = threading.Lock()

    def content(seed):
        return np.random.default_rng(seed).integers(0, 256, page_len, dtype=np.uint8)

    def count(k, n=1):
        with counts_lock:
            counts[k] += n

    def toks(page, first=0):
        return np.arange((page + first) * P, (page + first + 1) * P, dtype=np.int64)

    def fail(msg):
        failures.append(msg)
        stop.set()

    def free_host(rng):
        got = hosts.claim(None, rng)
        if got is None and hosts.evict_one(rng):
            count("evict")
        return got

    def arrive(rng):
        got = free_host(rng)
        if got is None:
            return
        h, _ = got
        with seeds_lock:
            seed = next(seeds)
        host.set_from_flat_data_page(h * P, content(seed))
        hosts.release(h, seed)
        count("arrive")

    def claim_both(pages, first, second):
        """``first()`` (a claim on ``pages``) then ``second()``, each ``(page, seed)`` or ``None``:
        both, or ``None`` with the first released."""
        a = first()
        if a is None:
            return None
        b = second()
        if b is None:
            pages.release(*a)
            return None
        return a, b

    def scheduler(rng):
        got = claim_both(hosts, lambda: hosts.claim("held", rng), lambda: devs.claim(None, rng))
        if got is None:
            return
        (h, seed), (dp, _) = got
        for layer in range(args.layers):
            host.load_to_device_per_layer(dev, toks(h), toks(dp), layer)
            count("load_layers")
        hosts.release(h, seed)
        devs.release(dp, seed)

    def backup(rng):
        got = claim_both(devs, lambda: devs.claim("held", rng), lambda: free_host(rng))
        if got is None:
            return
        (dp, seed), (h, _) = got
        host.backup_from_device_all_layer(dev, toks(h), toks(dp))
        if not np.array_equal(host.get_data_page(h * P), content(seed)):
            fail(f"backup of device page {dp} (seed {seed}) into host page {h}: wrong bytes")
        hosts.release(h, seed)
        devs.release(dp, None)
        count("backup")

    def l3_put(rng):
        got = hosts.claim("held", rng)
        if got is None:
            return
        h, seed = got
        ok = store.batch_set_v1([f"soak-{seed}"], toks(h))
        hosts.release(h, seed)
        if ok == [True]:
            with stored_lock:
                stored.append(seed)
            count("l3_put")

    def prefetch(rng):
        with stored_lock:
            if not stored:
                return
            seed = rng.choice(stored)
        got = free_host(rng)
        if got is None:
            return
        h, _ = got
        if store.batch_get_v1([f"soak-{seed}"], toks(h)) == [True]:
            if not np.array_equal(host.get_data_page(h * P), content(seed)):
                fail(f"prefetch of seed {seed} into host page {h}: wrong bytes")
            hosts.release(h, seed)
            count("prefetch_hit")
        else:
            hosts.release(h, None)
            count("prefetch_miss")

    def loop(name, fn, seed):
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                fn(rng)
        except Exception as e:  # noqa: BLE001 - any error ends the run as a failure
            fail(f"{name}: {type(e).__name__}: {e}")

    workers = [threading.Thread(target=loop, args=(n, f, i), name=n) for i, (n, f) in enumerate(
        [("arrive", arrive), ("scheduler", scheduler), ("backup", backup), ("l3-put", l3_put), ("prefetch", prefetch)])]
    t0 = time.monotonic()
    for w in workers:
        w.start()
    warmup = args.warmup if args.warmup is not None else min(30.0, args.seconds / 10)
    stop.wait(warmup)
    first = proc_stats()
    print(f"soak on {device.name} ({args.seconds:.0f} s): after {warmup:.0f} s warm-up {first}", flush=True)
    next_report = time.monotonic() + 60
    while not stop.is_set() and time.monotonic() - t0 < args.seconds:
        stop.wait(1.0)
        if time.monotonic() >= next_report:
            next_report += 60
            with counts_lock:
                print(f"  {time.monotonic() - t0:5.0f} s {dict(counts)} {proc_stats()}", flush=True)
    stop.set()
    for w in workers:
        w.join()
    elapsed = time.monotonic() - t0
    last = proc_stats()
    store.close()
    shutil.rmtree(root, ignore_errors=True)
    page_bytes = page_len
    report = {
        "executor": device.name,
        "seconds": round(elapsed, 1),
        "counts": counts,
        "per_second": {k: round(v / elapsed, 1) for k, v in counts.items()},
        "mb_per_second": {
            "loads": round(counts["load_layers"] * page_bytes / args.layers / elapsed / 1e6, 1),
            "backups": round(counts["backup"] * page_bytes / elapsed / 1e6, 1),
            "l3": round((counts["l3_put"] + counts["prefetch_hit"]) * page_bytes / elapsed / 1e6, 1),
        },
        "start": first,
        "end": last,
        "failures": failures,
    }
    growth = {"rss_mib": last["rss_mib"] - first["rss_mib"], "fds": last["fds"] - first["fds"], "threads": last["threads"] - first["threads"]}
    report["growth"] = growth
    if growth["rss_mib"] > args.rss_growth_mib:
        failures.append(f"resident memory grew {growth['rss_mib']:.1f} MiB (bound {args.rss_growth_mib})")
    # The local store's packs hold a bounded number of descriptors open (the least recently used
    # closed past it, plus the writer's own pack's): a leak grows past that.
    fd_bound = 8 + hicache_io._native.PACK_DESCRIPTORS + 1
    if growth["fds"] > fd_bound:
        failures.append(f"open descriptors grew by {growth['fds']} (bound {fd_bound})")
    if growth["threads"] > 2:
        failures.append(f"threads grew by {growth['threads']}")
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if failures:
        print("SOAK FAILED: " + "; ".join(failures[:5]))
        sys.exit(1)
    print("soak passed: no wrong byte, growth within bounds")


if __name__ == "__main__":
    main()
