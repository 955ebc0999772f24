"""The embedded L3 store (``hicache_io.storage.LocalStore``, files in one directory, no server):
writers killed with SIGKILL at random points leave only exact pages or misses; a byte flipped on
disk reads as a miss and ``python -m hicache_io.l3 scrub`` removes it; the capacity holds with two
writer processes, the least recently used pages going first; a second process (another rank, or
the server restarted) reads what the first wrote. Repeated keys and every key scheme on this
transport: ``test_l3_batches.py``."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from common import P, child_env, held_at, tokens

HERE = os.path.dirname(os.path.abspath(__file__))

# One script for writers and readers (a process each): pools whose page ``i`` holds bytes drawn
# from seed ``i``, so a reader knows what every key must hold.
SCRIPT = textwrap.dedent(
    """
    import os, sys, json
    sys.modules["sglang"] = None  # the store without sglang's base class: no torch import (seconds)
    import numpy as np
    import hicache_io
    from hicache_io.storage import LocalStore

    KINDS = {"dsa": ("dsa", 132, 4), "mha": ("mha", 4096, 3)}

    def pool(kind):
        k, bpt, layers = KINDS[kind]
        dev = hicache_io.DevicePool(hicache_io.Device("cpu"), k, bpt, 16 if k == "dsa" else 16 * 8, 8, layers)
        return hicache_io.HostPool(dev, "page_first", 16 * 8, profile="extended")

    def page_bytes(host, seed):
        n = len(host.get_dummy_flat_data_page())
        return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)

    def write(host, store, start, count, batch):
        for first in range(start, start + count, batch):
            seeds = list(range(first, min(first + batch, start + count)))
            for slot, seed in enumerate(seeds):
                host.set_from_flat_data_page(slot * 8, page_bytes(host, seed))
            toks = np.arange(len(seeds) * 8)
            assert store.batch_set_v1([f"key-{s}" for s in seeds], toks) == [True] * len(seeds), store.last_error
            if first == start:
                print("ready", flush=True)  # one batch is in: a kill from now on lands among the puts

    def read(host, store, seeds):
        hits, wrong = 0, []
        for seed in seeds:
            host.set_from_flat_data_page(15 * 8, np.zeros(len(host.get_dummy_flat_data_page()), np.uint8))
            if store.batch_get_v1([f"key-{seed}"], np.arange(15 * 8, 16 * 8)) == [True]:
                hits += 1
                if not np.array_equal(host.get_data_page(15 * 8), page_bytes(host, seed)):
                    wrong.append(seed)
        return hits, wrong

    role, kind, directory = sys.argv[1], sys.argv[2], sys.argv[3]
    capacity = int(sys.argv[4]) if len(sys.argv) > 4 else None
    host = pool(kind)
    store = LocalStore(kwargs={"hicache_io_local_dir": directory, **({"hicache_io_local_capacity_bytes": capacity} if capacity else {})})
    store.register_mem_pool_host(host)
    if role == "write":
        start, count = int(sys.argv[5]), int(sys.argv[6])
        write(host, store, start, count, 4)
        print(json.dumps({"written": count}))
    else:
        hits, wrong = read(host, store, range(int(sys.argv[5]), int(sys.argv[6])))
        print(json.dumps({"hits": hits, "wrong": wrong, "stats": store.integrity_stats()}))
    store.close()
    """
)


def run(tmp_path, *args, timeout=300):
    script = tmp_path / "l3_script.py"
    script.write_text(SCRIPT)
    env = child_env()
    return [sys.executable, str(script), *map(str, args)], env


def call(tmp_path, *args):
    cmd, env = run(tmp_path, *args)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["dsa", "mha"])  # hicache-io's names with trailers; sglang's names, without
def test_writers_killed_at_random_points_leave_exact_pages_or_misses(tmp_path, kind):
    directory = tmp_path / "l3"
    rng = np.random.default_rng(56)
    for round_ in range(3):
        cmd, env = run(tmp_path, "write", kind, directory, 0, round_ * 400, 400)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(float(rng.uniform(0.02, 0.4)))  # into the puts
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    got = call(tmp_path, "read", kind, directory, 0, 0, 1200)
    assert got["wrong"] == [], f"hits with wrong bytes: {got['wrong'][:10]}"
    assert got["hits"] > 0, "no writer got as far as one page: the test tried nothing"
    assert got["stats"]["corrupt"] == 0


def test_flipped_objects_read_as_counted_misses_and_scrub_removes_them(tmp_path):
    """sglang-named objects (no trailer: the file's CRC is their only check): three flipped ones
    are damaged to scrub, and three more found by reads are misses counted as corrupt."""
    directory = tmp_path / "l3"
    call(tmp_path, "write", "mha", directory, 0, 0, 8)
    # K and V of 8 pages (and the namespace record of sglang-named pages, a small object).
    files = sorted(str(p) for p in (directory / "objects").rglob("*") if p.is_file() and p.stat().st_size > 4096)
    assert len(files) == 16
    def flip(path):
        with open(path, "r+b") as f:  # a byte of the object's body
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0x10]))

    for j in (3, 5, 7):
        flip(files[j])
    out = subprocess.run([sys.executable, "-m", "hicache_io.l3", "scrub", str(directory)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"checked": 17, "intact": 14, "damaged": 3, "removed": 3}
    stats = json.loads(subprocess.run([sys.executable, "-m", "hicache_io.l3", "stats", str(directory)], capture_output=True, text=True, timeout=120).stdout)
    assert stats["objects"] == 14
    # Three more flips, found by reads: their pages are misses (their objects go), counted as
    # corrupt; the rest exact.
    for j in (9, 11, 13):
        flip(files[j])
    got = call(tmp_path, "read", "mha", directory, 0, 0, 8)
    assert got["stats"]["corrupt"] == 3 and got["wrong"] == []
    assert 2 <= got["hits"] <= 5, got  # the pages of the six objects (three or more pages) miss
    assert not any(os.path.exists(files[j]) for j in (9, 11, 13))


def test_the_capacity_holds_with_two_writer_processes(tmp_path):
    directory = tmp_path / "l3"
    capacity = 4 << 20  # about 20 pages of 2 × 96 KiB objects
    cmds = [run(tmp_path, "write", "mha", directory, capacity, start, 60) for start in (0, 1000)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for cmd, env in cmds]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-3000:]
    from hicache_io.l3.local import stats

    s = stats(str(directory))
    assert 0 < s["disk_bytes"] <= capacity, s
    # The least recently used pages went first: the writers' first pages are gone, their last
    # ones (those of the writer that finished last, at least) are there, exact.
    for first, last in ((0, 5), (1000, 1005)):
        assert call(tmp_path, "read", "mha", directory, capacity, first, last)["hits"] == 0
    late = [call(tmp_path, "read", "mha", directory, capacity, first, last) for first, last in ((55, 60), (1055, 1060))]
    assert sum(r["hits"] for r in late) >= 5 and all(r["wrong"] == [] for r in late), late


def test_a_second_process_reads_what_the_first_wrote(tmp_path):
    directory = tmp_path / "l3"
    call(tmp_path, "write", "dsa", directory, 0, 0, 12)
    got = call(tmp_path, "read", "dsa", directory, 0, 0, 12)
    assert got == {"hits": 12, "wrong": [], "stats": {**got["stats"], "verified": 12, "corrupt": 0}}


def test_in_process_round_trip_and_the_default_directory(tmp_path, monkeypatch):
    from hicache_io.l3.local import default_directory
    from hicache_io.storage import LocalStore

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_directory() == str(tmp_path / "cache" / "hicache-io" / "l3")
    import hicache_io

    dev = hicache_io.DevicePool(hicache_io.Device("cpu"), "mla", 576, 64, P, 3)
    host = hicache_io.HostPool(dev, "page_first", 64, profile="extended")
    rng = np.random.default_rng(1)
    dev.write_buffer(0, 0, rng.integers(0, 256, dev.slots * dev.item_bytes, dtype=np.uint8))
    host.backup_from_device_all_layer(dev, tokens([1, 2]), tokens([3, 4]), "kernel")
    s = LocalStore()
    try:
        s.register_mem_pool_host(host)
        assert s.batch_set_v1(["a", "b"], tokens([1, 2])) == [True, True]
        want = [host.get_data_page(p * P) for p in (1, 2)]
        assert s.batch_get_v1(["b", "a", "c"], tokens([5, 6, 7])) == [True, True, False]
        assert np.array_equal(host.get_data_page(5 * P), want[1]) and np.array_equal(host.get_data_page(6 * P), want[0])
        assert "local L3 store" in str(s.last_error)
    finally:
        s.close()
    assert os.path.isdir(tmp_path / "cache" / "hicache-io" / "l3" / "objects")


def test_the_client_moves_objects_of_many_spans_and_removes_damaged_ones(tmp_path):
    """Objects scattered over more buffers than one system call takes (Linux's IOV_MAX, 1024), a
    put of an existing key that keeps the first object, and a damaged object that goes at its
    first read."""
    from hicache_io.l3.local import DAMAGED, LocalDiskClient

    c = LocalDiskClient(str(tmp_path / "l3"), capacity_bytes=64 << 20)
    try:
        n = 1024 + 77
        src = np.random.default_rng(3).integers(0, 256, n * 8, dtype=np.uint8)
        dst = np.zeros_like(src)
        for a in (src, dst):
            c.register_buffer(a.ctypes.data, a.nbytes)
        spans = lambda a: [a.ctypes.data + 8 * i for i in range(n)]  # noqa: E731
        assert c.batch_put_from_multi_buffers(["k"], [spans(src)], [[8] * n]) == [0]
        assert c.batch_get_into_multi_buffers(["k"], [spans(dst)], [[8] * n]) == [n * 8]
        assert np.array_equal(src, dst)
        assert c.put("k", b"other bytes") == 0 and c.get("k") == src.tobytes()  # the first stays
        path, at = held_at(c, "k")
        with open(path, "r+b") as f:
            f.seek(at + 5)
            f.write(b"\xff")
        assert c.batch_get_into_multi_buffers(["k"], [spans(dst)], [[8] * n]) == [DAMAGED]
        assert c.batch_is_exist(["k"]) == [0]  # gone: the page can be stored again
    finally:
        c.close()


def test_the_client_moves_bytes_of_registered_memory_only(tmp_path):
    """A span outside the registered regions (or running past one's end) is refused for its object
    before any byte moves: no file is written, no byte of the target changes; the other objects of
    the batch move."""
    from hicache_io.l3.local import INVALID_PARAMS, LocalDiskClient

    c = LocalDiskClient(str(tmp_path / "l3"), capacity_bytes=64 << 20)
    try:
        reg = np.arange(4096, dtype=np.uint8)
        first = reg[:1000].copy()
        other = np.full(4096, 7, np.uint8)
        c.register_buffer(reg.ctypes.data, reg.nbytes)
        base = reg.ctypes.data
        assert c.batch_put_from(["in", "out", "past"], [base, other.ctypes.data, base + 4000], [1000, 1000, 200]) == [0, INVALID_PARAMS, INVALID_PARAMS]
        assert c.batch_is_exist(["in", "out", "past"]) == [1, 0, 0]
        before = other.copy()
        assert c.batch_get_into(["in"], [other.ctypes.data], [1000]) == [INVALID_PARAMS]
        assert np.array_equal(other, before)
        assert c.batch_get_into_multi_buffers(["in"], [[base + 2000, base + 3000]], [[500, 500]]) == [1000]
        # numpy integers are sizes too
        assert c.batch_put_from(["np"], [np.int64(base)], [np.int64(64)]) == [0] and c.batch_is_exist(["np"]) == [1]
        assert np.array_equal(reg[2000:2500], first[:500]) and np.array_equal(reg[3000:3500], first[500:])
    finally:
        c.close()


@pytest.mark.parametrize("writes", ["direct", "cached", "buffered"])
@pytest.mark.parametrize("head, spans", [((1 << 20) + 37, [63]), (1 << 20, []), ((1 << 20) + 4096, [16, 5000])])
def test_large_page_aligned_objects_are_written_and_read_back_exactly(tmp_path, head, spans, writes):
    """Objects of 1 MiB and more whose first span starts on a page, under each write rule (``direct``:
    to disk with ``O_DIRECT``, the span's whole pages straight from memory, then the rest
    buffered; ``cached``: buffered, writeback started):
    every byte reads back, the file holds exactly the object, key and footer, and a flipped byte
    still makes it a miss."""
    from hicache_io import _native
    from hicache_io.l3.local import DAMAGED, LocalDiskClient, scrub

    c = LocalDiskClient(str(tmp_path / "l3"), capacity_bytes=64 << 20, writes=writes)
    try:
        sizes = [head] + spans
        total = sum(sizes)
        raw = np.zeros(total + 8192, np.uint8)
        base = (-raw.ctypes.data) % 4096
        src = raw[base : base + total]
        src[:] = np.random.default_rng(total).integers(0, 256, total, dtype=np.uint8)
        dst = np.zeros(total, np.uint8)
        for a in (raw, dst):
            c.register_buffer(a.ctypes.data, a.nbytes)
        starts = np.cumsum([0] + sizes[:-1])
        assert c.batch_put_from_multi_buffers(["big"], [[src.ctypes.data + int(s) for s in starts]], [sizes]) == [0]
        assert os.path.getsize(c.path("big")) == total + len("big") + _native.LOCAL_FOOTER_BYTES
        assert c.batch_get_into(["big"], [dst.ctypes.data], [total]) == [total]
        assert np.array_equal(src, dst)
        assert scrub(c.directory)["removed"] == 0
        with open(c.path("big"), "r+b") as f:
            f.seek(total - 1)
            b = f.read(1)
            f.seek(total - 1)
            f.write(bytes([b[0] ^ 1]))
        assert c.batch_get_into(["big"], [dst.ctypes.data], [total]) == [DAMAGED]
    finally:
        c.close()


def test_a_store_never_read_back_warns_once_and_counts_it(tmp_path, caplog):
    """Keys that never match (sglang without its page-hash extension): puts, lookups that find
    nothing, and after SILENT_AFTER put calls one warning, counted as ``never_read``; a store
    whose pages are found stays quiet."""
    import logging

    import hicache_io
    from hicache_io.l3.watch import SILENT_AFTER
    from hicache_io.storage import LocalStore

    dev = hicache_io.DevicePool(hicache_io.Device("cpu"), "dsa", 132, 16, 8, 2)
    host = hicache_io.HostPool(dev, "page_first", 16 * 8, profile="extended")
    quiet = LocalStore(kwargs={"hicache_io_local_dir": str(tmp_path / "read")})
    silent = LocalStore(kwargs={"hicache_io_local_dir": str(tmp_path / "unread")})
    try:
        for store in (quiet, silent):
            store.register_mem_pool_host(host)
        with caplog.at_level(logging.WARNING, logger="hicache_io.storage"):
            for i in range(SILENT_AFTER + 5):
                for store in (quiet, silent):
                    assert store.batch_set_v1([f"written-{i}"], tokens([0])) == [True]
                assert quiet.batch_exists([f"written-{i}"]) == 1
                assert silent.batch_exists([f"asked-{i}"]) == 0  # another key each time
        warned = [r for r in caplog.records if "never reads back" in r.getMessage()]
        assert len(warned) == 1 and str(tmp_path / "unread") in warned[0].getMessage()
        assert "page-hash extension" in warned[0].getMessage()
        stats = silent.integrity_stats()
        assert stats["never_read"] == 1 and stats["hits"] == 0 and stats["put_batches"] == SILENT_AFTER + 5
        assert stats["lookups"] == SILENT_AFTER + 5
        assert quiet.integrity_stats()["never_read"] == 0 and quiet.integrity_stats()["hits"] == SILENT_AFTER + 5
    finally:
        quiet.close()
        silent.close()


def test_a_store_dropped_without_close_closes_at_once(tmp_path):
    """No reference cycle keeps a dropped store (and its client, its registered pool) alive until
    a garbage collection: with the collector off, the store goes at ``del`` and closes its client."""
    import gc
    import weakref

    from hicache_io.storage import HiCacheStorageConfig, LocalStore

    closed = []
    s = LocalStore(HiCacheStorageConfig(model_name="m"), {}, directory=str(tmp_path / "l3"))
    s.store.close = lambda: closed.append(True)
    gone = weakref.ref(s)
    gc.disable()
    try:
        del s
        assert gone() is None and closed == [True]
    finally:
        gc.enable()


def test_an_object_the_put_evicts_to_make_room_is_written_again(tmp_path):
    """A put of [a, d] where ``a`` exists and is the least recently used: the room made for ``d``
    removes ``a``, so ``a`` is written again rather than answered "kept" and lost."""
    from hicache_io.l3.local import LocalDiskClient, stats

    directory = str(tmp_path / "l3")
    LocalDiskClient(directory).close()
    base = stats(directory)["disk_bytes"]  # the folders and the lock file
    size, per = 256 << 10, (256 << 10) + 4096  # an object, and its file on disk
    c = LocalDiskClient(directory, capacity_bytes=base + 3 * per + per // 2)
    src = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    c.register_buffer(src.ctypes.data, src.nbytes)
    for t, key in enumerate("abc"):
        assert c.batch_put_from([key], [src.ctypes.data], [size]) == [0]
        os.utime(c.path(key), (1000 + t, 1000 + t))  # a is the least recently used
    assert c.batch_put_from(["a", "d"], [src.ctypes.data] * 2, [size] * 2) == [0, 0]
    assert c.batch_is_exist(["a", "b", "c", "d"]) == [1, 0, 1, 1]
    assert c.get("a") == src.tobytes()
    assert stats(directory)["disk_bytes"] <= c.capacity


def test_a_write_rule_the_store_does_not_know_is_refused(tmp_path):
    from hicache_io.storage import HiCacheStorageConfig, LocalStore

    with pytest.raises(ValueError, match="hicache_io_local_writes 'fast'"):
        LocalStore(HiCacheStorageConfig(model_name="m"), {"hicache_io_local_writes": "fast"}, directory=str(tmp_path / "l3"))


def _in_page_cache(path: str, nbytes: int):
    """Whether the page cache holds every page of the first ``nbytes`` of ``path`` (``mincore``
    over a mapping never touched: it reads nothing, and starts no readahead); ``None`` where that
    cannot be told: a file system that refuses ``O_DIRECT`` (the store reads it buffered), or a
    kernel that will not answer."""
    import ctypes

    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, nbytes, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        pages = (ctypes.c_ubyte * -(-nbytes // os.sysconf("SC_PAGESIZE")))()
        try:
            if libc.mincore(addr, nbytes, pages) != 0:
                return None
        finally:
            libc.munmap(addr, nbytes)
        return all(p & 1 for p in pages)
    finally:
        os.close(fd)


def _drop(path: str) -> None:
    """Writes ``path`` back and drops it from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("reads", ["auto", "buffered"])
@pytest.mark.parametrize("shift", [0, 8])
def test_large_objects_out_of_the_page_cache_read_back_exactly(tmp_path, reads, shift):
    """A large object the page cache does not hold (written ``direct``, its pages dropped) reads
    back exactly into page-aligned spans (``auto``: its whole pages with ``O_DIRECT``, the rest
    and the footer through an aligned buffer) and into unaligned ones (buffered); a flipped byte
    in its last span is still damaged, read so by a client that never read it (a restart)."""
    from hicache_io.l3.local import DAMAGED, LocalDiskClient

    c = LocalDiskClient(str(tmp_path / "l3"), capacity_bytes=64 << 20, writes="direct", reads=reads)
    sizes = [(1 << 20) + 4096 + 37, 63, 5000]
    total = sum(sizes)
    raw = np.zeros(2 * total + 4 * 4096, np.uint8)
    base = (-raw.ctypes.data) % 4096
    src = raw[base : base + total]
    src[:] = np.random.default_rng(9).integers(0, 256, total, dtype=np.uint8)
    at = base + -(-total // 4096) * 4096 + shift
    dst = raw[at : at + total]
    c.register_buffer(raw.ctypes.data, raw.nbytes)
    starts = np.cumsum([0] + sizes[:-1])
    spans = lambda a: [a.ctypes.data + int(s) for s in starts]  # noqa: E731

    try:
        assert c.batch_put_from_multi_buffers(["big"], [spans(src)], [sizes]) == [0]
        _drop(c.path("big"))
        assert c.batch_get_into_multi_buffers(["big"], [spans(dst)], [sizes]) == [total]
        assert np.array_equal(src, dst)
        # ``auto`` saw the object out of the page cache and read it past it into aligned spans;
        # buffered reads fill the cache.
        assert _in_page_cache(c.path("big"), 1 << 20) in (None, reads == "buffered" or shift != 0)
        with open(c.path("big"), "r+b") as f:
            f.seek(total - 2)
            b = f.read(1)
            f.seek(total - 2)
            f.write(bytes([b[0] ^ 1]))
        _drop(c.path("big"))
        again = LocalDiskClient(str(tmp_path / "l3"), capacity_bytes=64 << 20, writes="direct", reads=reads)
        again.register_buffer(raw.ctypes.data, raw.nbytes)
        try:
            assert again.batch_get_into_multi_buffers(["big"], [spans(dst)], [sizes]) == [DAMAGED]
        finally:
            again.close()
    finally:
        c.close()


@pytest.mark.parametrize("cut", [0, 37, 4096 + 5])
def test_large_object_cut_short_reads_cold_as_a_miss(tmp_path, cut):
    """A large object out of the page cache read with ``O_DIRECT`` into one span larger than it
    (``batch_get_into``; its pages and its tail in one read): whole, its bytes exactly, left
    uncached; cut short by ``cut`` bytes before the get (its footer gone, or the end of its
    pages), a miss (``DAMAGED``), never data. (A file cut during the read, the read's own short
    branches, is not reached from here.)"""
    from hicache_io.l3.local import DAMAGED, LocalDiskClient

    c = LocalDiskClient(str(tmp_path / "l3"), capacity_bytes=64 << 20, writes="direct", reads="auto")
    n = (1 << 20) + 4096 + 100
    raw = np.zeros(3 * n, np.uint8)
    base = (-raw.ctypes.data) % 4096
    at = base + -(-n // 4096) * 4096  # both spans start on a page
    src, dst = raw[base : base + n], raw[at : at + n + 4096]
    src[:] = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
    c.register_buffer(raw.ctypes.data, raw.nbytes)
    try:
        assert c.batch_put_from(["big"], [src.ctypes.data], [n]) == [0]
        p = c.path("big")
        if cut:
            os.truncate(p, os.path.getsize(p) - cut)
        _drop(p)
        got = c.batch_get_into(["big"], [dst.ctypes.data], [dst.nbytes])
        assert got == ([DAMAGED] if cut else [n])
        assert cut or (np.array_equal(dst[:n], src) and _in_page_cache(p, 1 << 20) in (None, False))
    finally:
        c.close()


def test_a_large_object_read_again_is_read_through_the_page_cache(tmp_path):
    """``auto``: a large object out of the page cache is read past it (``O_DIRECT``) the first
    time a client reads it, and left uncached; read again, through the cache, which then holds it
    (an object read twice is worth keeping in memory); read again from there. A client opened
    anew (a restarted server) reads it past the cache once more; ``buffered`` never does. Every
    read is exact."""
    from hicache_io.l3.local import LocalDiskClient

    n = 2 << 20
    raw = np.zeros(3 * n + 4096, np.uint8)
    base = (-raw.ctypes.data) % 4096
    src, dst = raw[base : base + n], raw[base + n : base + 2 * n]
    src[:] = np.random.default_rng(4).integers(0, 256, n, dtype=np.uint8)

    def client(reads):
        c = LocalDiskClient(str(tmp_path / "l3"), capacity_bytes=64 << 20, writes="direct", reads=reads)
        c.register_buffer(raw.ctypes.data, raw.nbytes)
        return c

    def read(c):
        dst[:] = 0
        assert c.batch_get_into(["big"], [dst.ctypes.data], [n]) == [n]
        assert np.array_equal(dst, src)
        return _in_page_cache(c.path("big"), n)

    c = client("auto")
    try:
        assert c.batch_put_from(["big"], [src.ctypes.data], [n]) == [0]
        _drop(c.path("big"))
        if _in_page_cache(c.path("big"), n) is not False:
            pytest.skip("this file system cannot tell what the page cache holds, refuses O_DIRECT, or keeps the pages")
        assert read(c) is False  # first read: past the cache
        assert read(c) is True  # the second: through it
        assert read(c) is True  # from it
        _drop(c.path("big"))
        assert read(c) is True  # known to this client: cached again
    finally:
        c.close()
    for reads, cached in (("auto", False), ("buffered", True)):
        _drop(c.path("big"))
        again = client(reads)
        try:
            assert read(again) is cached, reads
        finally:
            again.close()


def test_an_object_that_ends_in_a_trailer_is_verified_by_it_not_by_a_crc(tmp_path):
    """An object that ends in hicache-io's trailer records no CRC in its footer (flags 1, CRC 0):
    its bytes are hashed once, for the trailer. A flipped byte of its body still reads (the
    caller's trailer check fails it) where the caller checks trailers, and is damaged where it
    does not (``crc_trailered``: the store's checksums off; the trailer checked in place, however
    the spans split the object and its trailer) and to the scrub; a flipped byte of its trailer's
    magic is damaged to every reader. An object of the format before the flag (its CRC recorded)
    has its CRC checked as before. A footer of flags this build does not know is a miss, and its
    file is left."""
    import zlib

    from hicache_io import _native
    from hicache_io.l3.local import DAMAGED, OBJECT_NOT_FOUND, LocalDiskClient
    from hicache_io.l3.trailer import TRAILER_MAGIC, name_tag

    n = 2 << 20
    raw = np.zeros(4 * (n + 16), np.uint8)
    src, dst = raw[: n + 16], raw[2 * (n + 16) : 3 * (n + 16)]

    def sealed(key, seed):
        src[:n] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
        src[n:].view(np.uint64)[:] = [TRAILER_MAGIC, _native.checksum(src[:n], _native.STORAGE_SEED) ^ name_tag(key)]

    def client(crc_trailered=False):
        c = LocalDiskClient(str(tmp_path / "l3"), capacity_bytes=64 << 20, crc_trailered=crc_trailered)
        c.register_buffer(raw.ctypes.data, raw.nbytes)
        return c

    def footer(key):
        with open(c.path(key), "rb") as f:
            f.seek(-32, os.SEEK_END)
            return f.read()

    def write_at(key, at, data):
        with open(c.path(key), "r+b") as f:
            f.seek(at, os.SEEK_END if at < 0 else os.SEEK_SET)
            f.write(data)

    def flip(key, at):
        with open(c.path(key), "rb") as f:
            f.seek(at)
            b = f.read(1)
        write_at(key, at, bytes([b[0] ^ 1]))

    def get(cl, key, sizes=(n + 16,)):
        dst[:] = 0
        starts = np.cumsum((0,) + sizes[:-1])
        return cl.batch_get_into_multi_buffers([key], [[dst.ctypes.data + int(a) for a in starts]], [list(sizes)])[0]

    # Spans that split the body off a word's boundary, and the trailer itself.
    splits = ((n + 16,), (1000003, n - 1000003, 16), (n + 5, 11))
    c, strict = client(), client(crc_trailered=True)
    try:
        for key, seed in (("body", 1), ("magic", 2), ("old", 3), ("later", 4)):
            sealed(key, seed)
            assert c.batch_put_from([key], [src.ctypes.data], [n + 16]) == [0]
            f = footer(key)
            assert f[20:24] == bytes(4) and f[24] == 1 and f[25:] == bytes(7), f
            for sizes in splits:
                assert get(c, key, sizes) == n + 16 and np.array_equal(dst, src), sizes
                assert get(strict, key, sizes) == n + 16 and np.array_equal(dst, src), sizes
            assert _native.local_intact(c.objects, c.path(key))
        flip("body", 5)
        assert get(c, "body") == n + 16 and not np.array_equal(dst, src)  # for the caller's check
        assert not _native.local_intact(c.objects, c.path("body"))
        assert get(strict, "body", splits[1]) == DAMAGED
        flip("magic", n + 3)
        assert get(c, "magic", splits[2]) == DAMAGED and get(strict, "magic") == OBJECT_NOT_FOUND
        # "old" and "later" hold the last object sealed ("later"'s bytes) in src no more: reseal.
        sealed("old", 3)
        # The format before the flag: flags 0 and the CRC recorded, checked where the caller
        # checks no trailers: a wrong CRC over intact bytes is damaged there, read elsewhere.
        write_at("old", -12, zlib.crc32(src.tobytes()).to_bytes(4, "little") + bytes(8))
        assert get(c, "old") == n + 16 and get(strict, "old") == n + 16 and np.array_equal(dst, src)
        assert _native.local_intact(c.objects, c.path("old"))
        write_at("old", -12, (zlib.crc32(src.tobytes()) ^ 1).to_bytes(4, "little"))
        assert get(c, "old") == n + 16 and np.array_equal(dst, src)
        assert not _native.local_intact(c.objects, c.path("old"))
        assert get(strict, "old") == DAMAGED
        # Flags (or padding) of a later format: a miss, the file kept, left by the scrub.
        for tail in (bytes([2]) + bytes(7), bytes([1, 0, 0, 9]) + bytes(4), bytes([1]) + bytes(7)):
            crc = b"\x01\x00\x00\x00" if tail == bytes([1]) + bytes(7) else bytes(4)  # flags 1 with a CRC
            write_at("later", -12, crc + tail)
            assert get(c, "later") == OBJECT_NOT_FOUND and get(strict, "later") == OBJECT_NOT_FOUND
            assert os.path.exists(c.path("later")) and _native.local_intact(c.objects, c.path("later"))
    finally:
        c.close()
        strict.close()


def test_a_trailered_object_written_and_read_past_the_page_cache(tmp_path):
    """The vLLM tier's shape: a chunk and its 16-byte trailer as two spans, written with
    ``O_DIRECT`` (no CRC recorded), dropped from the page cache, read back with ``O_DIRECT``
    (``auto``, a client that never read it) exactly, by a reader that checks no trailers too; a
    flipped byte of the chunk is damaged to that reader."""
    from hicache_io import _native
    from hicache_io.l3.local import DAMAGED, LocalDiskClient
    from hicache_io.l3.trailer import TRAILER_MAGIC, name_tag

    n = 2 << 20
    raw = np.zeros(2 * n + 3 * 4096, np.uint8)
    base = (-raw.ctypes.data) % 4096
    src, dst = raw[base : base + n], raw[base + n : base + 2 * n]  # page-aligned chunks
    tsrc, tdst = raw[base + 2 * n : base + 2 * n + 16], raw[base + 2 * n + 16 : base + 2 * n + 32]
    src[:] = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
    tsrc.view(np.uint64)[:] = [TRAILER_MAGIC, _native.checksum(src, _native.STORAGE_SEED) ^ name_tag("chunk")]

    def client(crc_trailered):
        c = LocalDiskClient(str(tmp_path / "l3"), capacity_bytes=64 << 20, writes="direct", reads="auto", crc_trailered=crc_trailered)
        c.register_buffer(raw.ctypes.data, raw.nbytes)
        return c

    def get(c):
        dst[:] = 0
        tdst[:] = 0
        return c.batch_get_into_multi_buffers(["chunk"], [[dst.ctypes.data, tdst.ctypes.data]], [[n, 16]])[0]

    w = client(False)
    try:
        assert w.batch_put_from_multi_buffers(["chunk"], [[src.ctypes.data, tsrc.ctypes.data]], [[n, 16]]) == [0]
        p = w.path("chunk")
    finally:
        w.close()
    _drop(p)
    if _in_page_cache(p, n) is not False:
        pytest.skip("this file system cannot tell what the page cache holds, refuses O_DIRECT, or keeps the pages")
    for crc_trailered in (False, True):
        c = client(crc_trailered)
        try:
            assert get(c) == n + 16 and np.array_equal(dst, src) and np.array_equal(tdst, tsrc)
            assert _in_page_cache(p, n) is False  # read past the cache
        finally:
            c.close()
    with open(p, "r+b") as f:
        f.seek(n // 2)
        b = f.read(1)
        f.seek(n // 2)
        f.write(bytes([b[0] ^ 1]))
    _drop(p)
    c = client(True)
    try:
        assert get(c) == DAMAGED
    finally:
        c.close()
