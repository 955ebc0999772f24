"""The local store's recycled files: where puts write with ``O_DIRECT``, eviction keeps evicted
objects' files of 1 MiB and more under ``free/`` and later puts write over them (the file system
allocates nothing). Every object still reads back exactly or misses: a file a reader holds is never
written over, a file being written over reads as a miss (never as damage), writers killed at random
points leave exact objects or misses, and the directory stays within its capacity."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from common import child_env

OBJ = (2 << 20) + 100  # a page-aligned head and a short tail, as the vLLM tier's chunks
CAP = 24 << 20  # about eleven objects: an eviction keeps about one file
WIDE = 64 << 20  # about thirty: an eviction keeps three files


def data(seed):
    return np.random.default_rng(seed).integers(0, 256, OBJ, dtype=np.uint8)


class Objects:
    """A store and page-aligned memory holding object ``k``'s bytes (drawn from seed ``k``)."""

    def __init__(self, directory, writes="direct", capacity=CAP):
        from hicache_io.l3.local import LocalDiskClient

        self.c = LocalDiskClient(str(directory), capacity_bytes=capacity, writes=writes)
        raw = np.zeros(OBJ + 8192, np.uint8)
        at = (-raw.ctypes.data) % 4096
        self.raw, self.src, self.dst = raw, raw[at : at + OBJ], np.zeros(OBJ, np.uint8)
        for a in (self.raw, self.dst):
            self.c.register_buffer(a.ctypes.data, a.nbytes)

    def put(self, k):
        self.src[:] = data(k)
        assert self.c.batch_put_from(([f"key-{k}"]), [self.src.ctypes.data], [OBJ]) == [0]

    def get(self, k):
        self.dst[:] = 0
        return self.c.batch_get_into([f"key-{k}"], [self.dst.ctypes.data], [OBJ])[0]

    def exact(self, k):
        return self.get(k) == OBJ and np.array_equal(self.dst, data(k))

    def free(self):
        return {os.stat(os.path.join(self.c.free, n)).st_ino: os.path.join(self.c.free, n) for n in os.listdir(self.c.free)}


def top_up(s, k, want=2):
    """Puts objects ``k``, ``k + 1``, ... until ``want`` free files are there; the next key. (Once
    few free files are left a put makes more ahead of need, so how many there are after a given
    put varies.)"""
    for _ in range(20):
        if len(s.free()) >= want:
            return k
        s.put(k)
        k += 1
    raise AssertionError(f"fewer than {want} free files after 20 more puts")


@pytest.mark.parametrize("writes", ["direct", "cached"])
def test_puts_at_capacity_write_over_evicted_files(tmp_path, writes):
    """At capacity, direct puts take free files (the evicted objects' inodes come back as new
    objects'); cached puts keep none. Every object kept reads back exactly, the directory stays
    within its capacity and its counter matches a count anew."""
    from hicache_io.l3.local import stats

    s = Objects(tmp_path / "l3", writes, WIDE)
    try:
        for k in range(40):
            s.put(k)
            assert stats(s.c.directory)["disk_bytes"] <= WIDE
        if writes == "cached":
            assert s.free() == {} and stats(s.c.directory)["free_bytes"] == 0
            return
        k = top_up(s, 40)
        free = s.free()
        # Each free file held open (unlocked; its inode cannot go to another file meanwhile):
        # what a put writes over it shows there.
        watch = [os.open(p, os.O_RDONLY) for p in free.values()]
        new = range(k, k + len(free))
        for k in new:
            s.put(k)
        heads = {data(k)[:4096].tobytes() for k in new}
        reused = [w for w in watch if os.pread(w, 4096, 0) in heads]
        for w in watch:
            os.close(w)
        assert len(reused) == len(free), f"{len(reused)} of {len(free)} free files written over"
        st = stats(s.c.directory)
        # (Free files again: the put that took the last one made more.)
        assert st["disk_bytes"] <= WIDE and st["objects"] >= 25, st
        kept = [k for k in range(new.stop) if s.get(k) == OBJ]
        assert all(s.exact(k) for k in kept) and set(new) <= set(kept)
        used = int.from_bytes(open(s.c.lock_path, "rb").read(8), "little")
        assert used == s.c.resync(), "the counter lost track of the recycled files"
    finally:
        s.c.close()


@pytest.mark.parametrize("capacity", [WIDE, 4 * WIDE])
def test_free_files_are_made_before_the_last_is_taken(tmp_path, capacity):
    """Once puts write over free files, the put that leaves few of them (none, here, or under
    half of what an eviction makes, in the wider store) makes more before it returns, while the
    others could still take the ones left: after every put some are left, so no put waits for
    an eviction. The directory stays within its capacity and its counter holds."""
    from hicache_io.l3.local import stats

    s = Objects(tmp_path / "l3", capacity=capacity)
    try:
        k = 0
        while not s.free():  # to the capacity, and its first eviction
            s.put(k)
            k += 1
            assert k < 200
        for k in range(k, k + 60):
            s.put(k)
            assert s.free(), f"no free file left after put {k}"
            assert stats(s.c.directory)["disk_bytes"] <= capacity
        assert s.exact(k)
        used = int.from_bytes(open(s.c.lock_path, "rb").read(8), "little")
        assert used == s.c.resync()
    finally:
        s.c.close()


def test_an_eviction_soon_after_a_count_takes_the_next_least_recently_used(tmp_path, monkeypatch):
    """Evictions that make free files soon after a count of the directory take the next least
    recently used objects of that count without counting it again; an object used since that
    count is passed by (it is no longer among the least recently used) and stays. The directory
    stays within its capacity and its counter holds."""
    import hicache_io.l3.local_evict as ev
    from hicache_io.l3.local import stats

    counts = []
    real = ev.scan
    monkeypatch.setattr(ev, "scan", lambda d: counts.append(d) or real(d))
    s = Objects(tmp_path / "l3", capacity=WIDE)
    try:
        k = 0
        while not s.free():  # to the capacity, and its first eviction (a count)
            s.put(k)
            k += 1
            assert k < 200
        assert counts, "the first eviction counted the directory"
        first = len(counts)
        alive = [j for j in range(k) if os.path.exists(s.c.path(f"key-{j}"))]
        later = time.time() + 5  # used after the count
        os.utime(s.c.path(f"key-{alive[0]}"), (later, later))
        for k in range(k, k + 40):
            s.put(k)
            assert stats(s.c.directory)["disk_bytes"] <= WIDE
            if not os.path.exists(s.c.path(f"key-{alive[1]}")):
                break
        else:
            raise AssertionError("no eviction after the first")
        assert len(counts) == first, "an eviction soon after a count counted the directory again"
        assert s.exact(alive[0])
        used = int.from_bytes(open(s.c.lock_path, "rb").read(8), "little")
        assert used == s.c.resync()
    finally:
        s.c.close()


def test_a_file_a_reader_holds_is_not_written_over(tmp_path):
    """A get that opened an object's file before eviction moved it holds a shared lock: puts pass
    that file by, and its bytes stay the evicted object's."""
    s = Objects(tmp_path / "l3", capacity=WIDE)
    try:
        for k in range(40):
            s.put(k)
        first = top_up(s, 40)
        held = []
        for ino, p in s.free().items():
            f = open(p, "rb")
            fcntl.flock(f, fcntl.LOCK_SH)
            held.append((ino, f, f.read()))
        new = range(first, first + len(held))
        for k in new:
            s.put(k)
        inodes = {os.stat(s.c.path(f"key-{k}")).st_ino for k in new}
        assert not inodes & {ino for ino, _f, _b in held}, "a put wrote over a file a reader holds"
        for _ino, f, before in held:
            f.seek(0)
            assert f.read() == before
            f.close()
        assert all(s.exact(k) for k in new)
    finally:
        s.c.close()


def test_what_is_not_a_free_file_of_the_store_is_never_written_over(tmp_path):
    """In ``free/``, a symbolic link, a file with a second name, a FIFO, a sparse file and a
    file under 1 MiB (read without a lock) are passed by, and ``free/`` itself made a link to
    another folder is not followed: what each names keeps its bytes, and puts neither hang nor
    fail."""
    s = Objects(tmp_path / "l3", capacity=WIDE)
    try:
        for k in range(40):
            s.put(k)
        k = top_up(s, 40)
        free = list(s.free().values())
        size = os.path.getsize(free[0])
        for p in free:
            os.unlink(p)
        outside = tmp_path / "outside"
        outside.mkdir()
        target = outside / f"{size}-target"
        target.write_bytes(bytes(size))
        os.symlink(target, os.path.join(s.c.free, f"{size}-symlink"))
        linked = tmp_path / "second-name"
        linked.write_bytes(bytes(size))
        os.link(linked, os.path.join(s.c.free, f"{size}-linked"))
        os.mkfifo(os.path.join(s.c.free, f"{size}-fifo"))
        with open(os.path.join(s.c.free, f"{size}-sparse"), "wb") as f:
            f.truncate(size)
        with open(os.path.join(s.c.free, f"{size}-small"), "wb") as f:
            f.write(bytes((1 << 20) - 4096))
        # Held open (their names may go: free files make room for new ones), to look at after.
        sparse, small = (os.open(os.path.join(s.c.free, f"{size}-{n}"), os.O_RDONLY) for n in ("sparse", "small"))
        for j in range(k, k + 3):
            s.put(j)
        os.rename(s.c.free, tmp_path / "free-was")
        os.symlink(outside, s.c.free)  # free/ a link to another folder
        for j in range(k + 3, k + 6):
            s.put(j)
        assert not any(target.read_bytes()) and not any(linked.read_bytes())
        assert os.fstat(sparse).st_blocks == 0 and not any(os.pread(small, 1 << 20, 0))
        os.close(sparse)
        os.close(small)
        assert all(s.exact(j) for j in range(k, k + 6))
    finally:
        s.c.close()


def test_files_under_1_mib_are_never_written_over(tmp_path):
    """Files under 1 MiB are read without a lock, so a free file of 1 MiB - 100 bytes is passed by
    even by a put of a 1 MiB file (as many blocks), which takes a free file of 1 MiB."""
    from hicache_io import _native
    from hicache_io.l3.local import LocalDiskClient

    c = LocalDiskClient(str(tmp_path / "l3"), capacity_bytes=WIDE, writes="direct")
    try:
        held = {}
        for size in ((1 << 20) - 100, 1 << 20):
            p = os.path.join(c.free, f"{size}-planted")
            with open(p, "wb") as f:
                f.write(bytes(size))
            held[size] = os.open(p, os.O_RDONLY)
        n = (1 << 20) - len("key-b0") - _native.LOCAL_FOOTER_BYTES  # a file of exactly 1 MiB
        raw = np.zeros(n + 8192, np.uint8)
        src = raw[(-raw.ctypes.data) % 4096 :][:n]
        src[:] = 7
        c.register_buffer(raw.ctypes.data, raw.nbytes)
        assert c.batch_put_from(["key-b0", "key-b1"], [src.ctypes.data] * 2, [n] * 2) == [0, 0]
        assert os.pread(held[1 << 20], 4096, 0) == bytes([7]) * 4096, "the 1 MiB free file was not taken"
        assert not any(os.pread(held[(1 << 20) - 100], 1 << 20, 0)), "a file under 1 MiB was written over"
        for fd in held.values():
            os.close(fd)
    finally:
        c.close()


def test_batches_write_over_free_files_left_long_ago(tmp_path):
    """Free files last used long ago (older than a stalled writer's temporary file) are written
    over by a batch that also needs room for new files: every put lands, the counter holds."""
    from hicache_io.l3.local_evict import STALE_TMP_SECONDS

    s = Objects(tmp_path / "l3", capacity=WIDE)
    try:
        for k in range(40):
            s.put(k)
        first = top_up(s, 40)
        free = s.free()
        old = time.time() - 2 * STALE_TMP_SECONDS
        for p in free.values():
            os.utime(p, (old, old))
        keys = list(range(first, first + len(free) + 3))
        rows = np.stack([data(k) for k in keys])
        raw = np.zeros(rows.nbytes + 4096, np.uint8)
        at = (-raw.ctypes.data) % 4096
        mem = raw[at : at + rows.nbytes].reshape(rows.shape)
        mem[:] = rows
        s.c.register_buffer(raw.ctypes.data, raw.nbytes)
        got = s.c.batch_put_from([f"key-{k}" for k in keys], [mem[j].ctypes.data for j in range(len(keys))], [OBJ] * len(keys))
        assert got == [0] * len(keys)
        assert all(s.exact(k) for k in keys)
        used = int.from_bytes(open(s.c.lock_path, "rb").read(8), "little")
        assert used == s.c.resync()
    finally:
        s.c.close()


def test_a_file_being_written_over_reads_as_a_miss_not_damage(tmp_path):
    """While a put holds a file to write over it (an exclusive lock), a get of the object it held
    misses and leaves it alone (not damaged: not removed, not counted); then reads it exactly."""
    from hicache_io.l3.errors import OBJECT_NOT_FOUND

    s = Objects(tmp_path / "l3", capacity=1 << 30)
    try:
        s.put(7)
        with open(s.c.path("key-7"), "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            assert s.get(7) == OBJECT_NOT_FOUND
            assert os.path.exists(s.c.path("key-7"))
        assert s.exact(7)
    finally:
        s.c.close()


WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[3])
    from test_local_recycle import Objects
    s = Objects(sys.argv[1])
    first = int(sys.argv[2])
    s.put(first)
    print("ready", flush=True)
    for k in range(first + 1, first + 400):
        s.put(k)
    """
)

# Puts (``w``) or gets (``r``) of random keys among 40 for ``seconds``, in a process of its own;
# prints hits, wrong hits, damaged answers and failed puts.
RACER = textwrap.dedent(
    """
    import sys, time, json
    import numpy as np
    sys.path.insert(0, sys.argv[4])
    from test_local_recycle import OBJ, Objects, data
    from hicache_io.l3.errors import DAMAGED
    s = Objects(sys.argv[1])
    role, rng = sys.argv[2], np.random.default_rng(int(sys.argv[3]))
    out = {"hits": 0, "wrong": 0, "damaged": 0, "failed": 0}
    end = time.time() + 3
    while time.time() < end:
        k = int(rng.integers(0, 40))
        if role == "w":
            s.src[:] = data(k)
            out["failed"] += s.c.batch_put_from([f"key-{k}"], [s.src.ctypes.data], [OBJ]) != [0]
        else:
            got = s.get(k)
            out["hits"] += got == OBJ
            out["wrong"] += got == OBJ and not np.array_equal(s.dst, data(k))
            out["damaged"] += got == DAMAGED
    s.c.close()
    print(json.dumps(out))
    """
)


def test_readers_and_writers_of_several_processes_at_capacity_read_exact_objects(tmp_path):
    """Two processes putting and two getting keys among 40 objects of 2 MiB in a 24 MiB store
    (every put evicts, and writes over evicted objects' files) for 3 s: every hit is exact, no
    healthy object reads as damaged, no put fails, and the directory stays within its capacity."""
    from hicache_io.l3.local import scrub, stats

    directory = tmp_path / "l3"
    Objects(directory).c.close()
    here = os.path.dirname(os.path.abspath(__file__))
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(directory), role, str(i), here], env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i, role in enumerate("wwrr")]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
        outs.append(json.loads(out.decode().strip().splitlines()[-1]))
    assert sum(o["hits"] for o in outs) > 20, outs  # the readers met objects
    assert not any(o["wrong"] or o["damaged"] or o["failed"] for o in outs), outs
    assert stats(str(directory))["disk_bytes"] <= CAP
    assert scrub(str(directory))["damaged"] == 0


def test_writers_killed_while_writing_over_free_files_leave_exact_objects_or_misses(tmp_path):
    from hicache_io.l3.local import scrub, stats

    directory = tmp_path / "l3"
    rng = np.random.default_rng(68)
    for round_ in range(4):
        cmd = [sys.executable, "-c", WRITER, str(directory), str(round_ * 400), os.path.dirname(os.path.abspath(__file__))]
        proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(float(rng.uniform(0.05, 0.3)))  # into the puts, which write over free files
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    s = Objects(directory)
    try:
        hits = [k for k in range(1600) if s.get(k) == OBJ]
        assert hits, "no writer got as far as one object: the test tried nothing"
        assert all(s.exact(k) for k in hits)
        assert stats(str(directory))["disk_bytes"] <= CAP
        assert scrub(str(directory))["damaged"] == 0
    finally:
        s.c.close()
