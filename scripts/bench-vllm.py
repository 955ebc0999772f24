#!/usr/bin/env python3
"""vLLM's offloading on hicache-io against what vLLM does without it, on the same blocks, one run:

- worker: ``HicacheOffloadingWorker`` (hicache-io's cpu executor, every row checksummed in the
  copy) against a worker doing the same moves with torch ``index_copy_`` / ``index_select``
  (what a CPU offloading worker writes in torch; vLLM's own handler needs CUDA), GB/s of stores
  and loads over the engine's canonical KV tensors;
- tier: ``HicacheTier`` (local directory, trailers checked on every load) against vLLM's own
  ``fs`` tier (no verification), GB/s of stores and loads of whole chunks of the primary view;
  stores into an unbounded tier (every store a new file, as ``fs`` always writes them) and into a
  tier at its capacity (``--full-chunks``: every store evicts, and writes over an evicted chunk's
  file; ``fs`` has no capacity: its row is its stores of new files again); loads warm (what the page cache holds after the first loads) and cold (every file of both tiers
  written back and dropped from the page cache before each load, each tier opened anew over its
  files: a load after a restart). Beside
  them, plain ``O_DIRECT`` files: writes (new files, or over a ring of as many files as the tier
  at capacity holds) and reads (from the disk, warm or cold) of one file a chunk by as many
  threads, from Python, with no key, footer or checksum: the disk's ceiling for the store rows and
  the cold loads (left out where the file system refuses ``O_DIRECT``).

    python scripts/bench-vllm.py [--layers 32] [--page 32768] [--blocks 4096] [--batch 256]
        [--chunk-mib 2] [--chunks 256] [--dir /tmp] [--seconds 3] [--json out.json]

Needs vLLM 0.33.0 importable (``VLLM_TARGET_DEVICE=cpu``) and hicache_io installed. Ratios are
of one run: medians of repeated timings of both sides, interleaved."""

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from unittest.mock import MagicMock

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from importlib import import_module  # noqa: E402

# Every file under a folder written back and dropped from the page cache: what a load after a
# restart reads.
drop_cache = import_module("bench-l3-local").drop_cache


def timed(fn, seconds):
    """Median seconds of ``fn()`` over repeats filling about ``seconds``."""
    fn()
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired(fns, seconds):
    """Median seconds of each of ``fns`` (name: function), in rounds that run them in turn, the
    order reversed every other round, about ``seconds`` each in all (three rounds at least). Run
    one after the other for their whole time, the second met whatever the first left the disk
    (most likely, writes below this VM are absorbed and flushed by its host): `fs`, second each
    time, stored new files at 1.9-3.1 GB/s across four runs within an hour."""
    for fn in fns.values():
        fn()
    names = list(fns)
    times = {name: [] for name in names}
    end = time.perf_counter() + seconds * len(names)
    rounds = 0
    while time.perf_counter() < end or rounds < 3:
        for name in names if rounds % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return {name: statistics.median(t) for name, t in times.items()}


def bench_worker(args, out):
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from hicache_io.vllm import HicacheOffloadingWorker

    L, page, nb, batch = args.layers, args.page, args.blocks, args.batch
    # K and V of each layer, as vLLM splits FlashAttention's layout: 2 L tensors of page/2.
    half = page // 2
    tensors = [torch.randint(-128, 127, (nb, half), dtype=torch.int8) for _ in range(2 * L)]
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(t, half) for t in tensors], [[CanonicalKVCacheRef(j, half) for j in range(2 * L)]])
    chunks = nb
    worker = HicacheOffloadingWorker(caches, 1, chunks)
    rng = np.random.default_rng(0)
    blocks = [int(b) for b in rng.choice(nb, batch, replace=False)]
    rows = [int(c) for c in rng.choice(chunks, batch, replace=False)]
    job = iter(range(1, 1 << 30))

    def ours(store):
        j = next(job)
        if store:
            worker.submit_store(j, GPULoadStoreSpec(blocks, [batch], [0]), CPULoadStoreSpec(rows))
        else:
            worker.submit_load(j, CPULoadStoreSpec(rows), GPULoadStoreSpec(blocks, [batch], [0]))
        worker.wait({j})
        worker.get_finished()

    host = [torch.zeros((chunks, half), dtype=torch.int8) for _ in range(2 * L)]
    bi, ri = torch.tensor(blocks), torch.tensor(rows)
    # The gather goes through one staging buffer, allocated once (a fresh tensor per layer
    # would page-fault its way in and halve torch's figure).
    stage = torch.empty((batch, half), dtype=torch.int8)

    def torch_worker(store):
        for t, h in zip(tensors, host):
            if store:
                h.index_copy_(0, ri, torch.index_select(t, 0, bi, out=stage))
            else:
                t.index_copy_(0, bi, torch.index_select(h, 0, ri, out=stage))

    nbytes = batch * page * L
    for store in (True, False):
        a = timed(lambda: ours(store), args.seconds)
        b = timed(lambda: torch_worker(store), args.seconds)
        row = {"bench": "worker", "op": "store" if store else "load", "bytes": nbytes, "hicache_gbps": nbytes / a / 1e9, "torch_gbps": nbytes / b / 1e9, "ratio": b / a}
        out.append(row)
        print(f"worker {row['op']:5}: hicache-io {row['hicache_gbps']:6.2f} GB/s (checksummed) | torch index_copy_ {row['torch_gbps']:6.2f} GB/s | {row['ratio']:.2f}x", flush=True)
    worker.shutdown()


def tier_spec():
    from vllm.v1.kv_offload.config import OffloadingCacheConfig, OffloadingConfig, OffloadingModelConfig, OffloadingParallelConfig

    s = MagicMock()
    s.config = OffloadingConfig(
        groups=(),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="bench",
        model=OffloadingModelConfig(name="bench/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=False
        ),
    )
    s.blocks_per_chunk = 1
    s.kv_events_config = MagicMock(enable_kv_cache_events=False)
    return s


def cold_loads(run, tiers, n, gen, root, seconds):
    """Median seconds of each tier's load of ``n`` chunks from the disk, as a restarted server
    loads them: every tier stores its chunks first, then the loads alternate between the tiers,
    each by a tier opened anew over the same files (``tiers``: name: (the tier, a function that
    opens another over its files, or None where nothing is kept between loads)), every file
    dropped from the page cache before each (a file just written may still be held below this
    machine, by the disk or its host: neither tier reads what it wrote last)."""
    from vllm.v1.kv_offload.base import make_offload_key

    keys = {name: [make_offload_key(next(gen).to_bytes(8, "big"), 0) for _ in range(n)] for name in tiers}
    for name, (tier, _reopen) in tiers.items():
        run(tier, keys[name], False)
    times = {name: [] for name in tiers}
    end = time.perf_counter() + 2 * seconds
    while time.perf_counter() < end or min(len(t) for t in times.values()) < 3:
        for name, (tier, reopen) in tiers.items():
            fresh = reopen() if reopen else tier
            try:
                drop_cache(root)
                t0 = time.perf_counter()
                run(fresh, keys[name], True)
                times[name].append(time.perf_counter() - t0)
            finally:
                if reopen:
                    fresh.shutdown()
    return {("load cold", name): statistics.median(t) for name, t in times.items()}


class PlainFiles:
    """The disk's ceiling for a tier's pattern: one file a chunk, written and read with
    ``O_DIRECT`` by ``threads`` threads from Python, no key, footer or checksum: what neither tier
    can beat where it reads or writes the disk. Stores write new files, or, with ``overwrite``
    files, over the next of that many files in turn (as a tier at its capacity writes over
    evicted chunks' files: over the same few files again, a disk or its host may absorb them)."""

    def __init__(self, folder, view, threads, overwrite=0):
        assert overwrite == 0 or overwrite >= len(view), "a ring smaller than a store would write a file twice at once"
        self.folder, self.view = folder, view
        os.makedirs(folder, exist_ok=True)
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads))
        self.names = iter(range(1 << 40))
        self.ring = [os.path.join(folder, f"{next(self.names)}") for _ in range(overwrite)]
        self.files, self.at = [], 0
        for _ in range(0, len(self.ring), len(view)):  # the ring's files exist before it is timed
            self.store()

    def _write(self, path, c):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            assert os.pwrite(fd, memoryview(self.view[c]), 0) == self.view.shape[1]
        finally:
            os.close(fd)

    def _read(self, path, c):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            assert os.preadv(fd, [memoryview(self.view[c])], 0) == self.view.shape[1]
        finally:
            os.close(fd)

    def store(self):
        n = len(self.view)
        if self.ring:
            self.files = [self.ring[(self.at + i) % len(self.ring)] for i in range(n)]
            self.at += n
        else:  # new files each time, as a tier's stores of new keys
            self.files = [os.path.join(self.folder, f"{next(self.names)}") for _ in range(n)]
        list(self.pool.map(self._write, self.files, range(n)))

    def load(self):
        list(self.pool.map(self._read, self.files, range(len(self.view))))


def bench_tier(args, out):
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    from hicache_io.vllm import HicacheTier

    row = args.chunk_mib << 20
    n = args.chunks
    # The primary tier's memory, page-aligned rows (its fs tier uses O_DIRECT when it can). "shm"
    # as vLLM's own: a file of /dev/shm mapped shared; "heap": numpy's. O_DIRECT's speed depends
    # on it here, for every writer alike (docs/performance.md; why is not established).
    if args.memory == "shm":
        shm = tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        shm.truncate(n * row)
        view = np.frombuffer(mmap.mmap(shm.fileno(), n * row), dtype=np.uint8).reshape(n, row)
    else:
        raw = np.zeros(n * row + 4096, dtype=np.uint8)
        off = (-raw.ctypes.data) % 4096
        view = raw[off : off + n * row].reshape(n, row)
    view[:] = np.random.default_rng(1).integers(0, 256, view.shape, dtype=np.uint8)
    root = tempfile.mkdtemp(prefix="hicache-io-bench-vllm-", dir=args.dir)
    spec = tier_spec()
    # Unbounded as `fs` is: no eviction inside the timed stores.
    open_ours = lambda: HicacheTier(spec, memoryview(view), "hicache", store="local", path=os.path.join(root, "hicache"), capacity_bytes=1 << 40, threads=args.threads, writes=args.writes, reads=args.reads)  # noqa: E731
    ours = open_ours()
    # At its capacity: stores evict (and write over the evicted chunks' files).
    full = HicacheTier(spec, memoryview(view), "hicache", store="local", path=os.path.join(root, "full"), capacity_bytes=args.full_chunks * (row + 8192), threads=args.threads, writes=args.writes, reads=args.reads)
    # `--threads` threads each in all: fs's read and write groups each drain either queue when
    # their own is empty, so n_read + n_write threads serve every store and every load.
    open_fs = lambda: FileSystemTierManager(  # noqa: E731
        offloading_spec=spec,
        primary_kv_view=memoryview(view),
        tier_type="fs",
        root_dir=os.path.join(root, "fs"),
        n_read_threads=max(1, args.threads // 2),
        n_write_threads=max(1, args.threads - args.threads // 2),
    )
    fs = open_fs()
    try:
        disk = PlainFiles(os.path.join(root, "disk"), view, args.threads)
        disk_full = PlainFiles(os.path.join(root, "disk-over"), view, args.threads, overwrite=max(args.full_chunks, n))
    except OSError as e:  # a file system without O_DIRECT (tmpfs): no plain column
        print(f"plain O_DIRECT files left out: {e}", flush=True)
        disk = disk_full = None
    plain = (lambda phase: {} if disk is None else {"disk": disk_full if phase == "store full" else disk})
    ctx = ReqContext(req_id="bench")
    job = iter(range(1, 1 << 30))
    gen = iter(range(1, 1 << 40))

    def run(tier, keys, load):
        if isinstance(tier, PlainFiles):
            return tier.load() if load else tier.store()
        j = next(job)
        # One job a chunk, as vLLM submits them per request; all in flight at once.
        ids = []
        for k, c in zip(keys, range(n)):
            t = TransferJob(job_id=j, keys=[k], chunk_ids=np.array([c], dtype=np.int32), is_promotion=load, req_context=ctx)
            (tier.submit_load if load else tier.submit_store)(t)
            ids.append(j)
            j = next(job)
        tier.drain_jobs()
        done = list(tier.get_finished_jobs())
        assert len(done) == len(ids) and all(r.success for r in done), [r for r in done if not r.success][:3]

    nbytes = n * row
    results = {}
    for _ in range(args.full_chunks // n + 2):  # filled past its capacity before it is timed
        run(full, [make_offload_key(next(gen).to_bytes(8, "big"), 0) for _ in range(n)], False)
    for phase in ("store", "store full", "load", "load cold"):
        if phase == "load cold":
            restarted = {"hicache": (ours, open_ours), "fs": (fs, open_fs), **{k: (v, None) for k, v in plain(phase).items()}}
            results.update(cold_loads(run, restarted, n, gen, root, args.seconds))
        tiers = {"hicache": full if phase == "store full" else ours, "fs": fs, **plain(phase)}
        if phase.startswith("store"):
            # Fresh keys each time: a store of an existing key writes nothing.
            fns = {name: (lambda tier=tier: run(tier, [make_offload_key(next(gen).to_bytes(8, "big"), 0) for _ in range(n)], False)) for name, tier in tiers.items()}
        elif phase == "load":
            keys = {name: [make_offload_key(next(gen).to_bytes(8, "big"), 0) for _ in range(n)] for name in tiers}
            for name, tier in tiers.items():
                run(tier, keys[name], False)
            fns = {name: (lambda tier=tier, name=name: run(tier, keys[name], True)) for name, tier in tiers.items()}
        if phase != "load cold":
            results.update({(phase, name): t for name, t in paired(fns, args.seconds).items()})
        a, b = results[(phase, "hicache")], results[(phase, "fs")]
        r = {"bench": "tier", "op": phase, "bytes": nbytes, "hicache_gbps": nbytes / a / 1e9, "fs_gbps": nbytes / b / 1e9, "ratio": b / a}
        line = f"tier   {phase:10}: HicacheTier {r['hicache_gbps']:6.2f} GB/s (verified) | vLLM fs {r['fs_gbps']:6.2f} GB/s | {r['ratio']:.2f}x"
        if disk is not None:
            d = results[(phase, "disk")]
            r.update(disk_gbps=nbytes / d / 1e9, fs_of_disk=d / b, hicache_of_disk=d / a)
            line += f" | plain O_DIRECT files {r['disk_gbps']:6.2f} GB/s (fs {r['fs_of_disk']:.2f}x of it, HicacheTier {r['hicache_of_disk']:.2f}x)"
        out.append(r)
        print(line, flush=True)
    for tier in (ours, full, fs):
        tier.shutdown()
    for plain_files in (disk, disk_full):
        if plain_files is not None:
            plain_files.pool.shutdown()
    shutil.rmtree(root, ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--page", type=int, default=32768, help="bytes of one block of one layer (K and V)")
    p.add_argument("--blocks", type=int, default=1024)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--chunk-mib", type=int, default=2)
    p.add_argument("--chunks", type=int, default=128)
    p.add_argument("--threads", type=int, default=4, help="I/O threads of each tier in all (fs: half read-first, half write-first)")
    p.add_argument("--full-chunks", type=int, default=512, help="chunks the tier at capacity holds")
    p.add_argument("--dir", default=None)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--only", choices=["worker", "tier"])
    p.add_argument("--writes", default="direct", help="HicacheTier's local writes (direct, cached, buffered)")
    p.add_argument("--reads", default="auto", help="HicacheTier's local reads (auto, its default; buffered)")
    p.add_argument("--memory", choices=["shm", "heap"], default="shm", help="the primary tier's memory: a /dev/shm mapping as vLLM's (shm), or numpy's (heap)")
    p.add_argument("--json")
    args = p.parse_args()
    out = []
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}")
    if args.only in (None, "worker"):
        bench_worker(args, out)
    if args.only in (None, "tier"):
        bench_tier(args, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
