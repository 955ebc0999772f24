"""The local store's packs (objects of up to ``_native.PACK_OBJECT_MAX`` bytes, appended to one
file per writer, ``python/src/local_pack.rs``): clients with indexes of their own (as processes
have) see each other's puts, removals and evictions; a torn or garbage tail reads as misses
before it and nothing of it; a damaged record is a counted miss for every client and scrub
names it; the capacity holds, the least recently used packs going first; objects of the older
format (a file per object) are still read. Every hit compared with what was put, byte for byte."""

import os

import numpy as np
import pytest

from common import pack_records
from hicache_io import _native
from hicache_io.l3.local import DAMAGED, OBJECT_NOT_FOUND, LocalDiskClient, scan, scrub, stats

SIZE = 8448 + 16  # a DSA indexer page and its trailer


@pytest.fixture
def mem():
    """Registered source and destination memory of 64 objects."""
    src = np.random.default_rng(5).integers(0, 256, 64 * SIZE, dtype=np.uint8)
    return src, np.zeros_like(src)


def client(directory, mem, **kw):
    c = LocalDiskClient(str(directory), **kw)
    for a in mem:
        c.register_buffer(a.ctypes.data, a.nbytes)
    return c


def put(c, mem, keys, first=0):
    src = mem[0]
    return c.batch_put_from(keys, [src.ctypes.data + (first + j) * SIZE for j in range(len(keys))], [SIZE] * len(keys))


def got(c, mem, keys, first=0):
    """Per key: the get's answer, and whether the bytes landed are the source's."""
    src, dst = mem
    dst[:] = 0
    rc = c.batch_get_into(keys, [dst.ctypes.data + j * SIZE for j in range(len(keys))], [SIZE] * len(keys))
    same = [bool(np.array_equal(dst[j * SIZE : (j + 1) * SIZE], src[(first + j) * SIZE : (first + j + 1) * SIZE])) for j in range(len(keys))]
    return rc, same


def packs(directory):
    return sorted(os.path.join(directory, "packs", n) for n in os.listdir(os.path.join(directory, "packs")))


def test_clients_see_each_others_puts_removals_and_evictions(tmp_path, mem):
    d = tmp_path / "l3"
    a, b = client(d, mem), client(d, mem)
    keys = [f"k{j}" for j in range(8)]
    assert b.batch_is_exist(keys) == [0] * 8  # b's index is built before a writes
    assert put(a, mem, keys) == [0] * 8
    assert b.batch_is_exist(keys) == [1] * 8 and got(b, mem, keys) == ([SIZE] * 8, [True] * 8)
    assert b.remove("k3") == 0
    assert a.batch_is_exist(["k3"]) == [0] and got(a, mem, ["k3"])[0] == [OBJECT_NOT_FOUND]
    # Put again with other bytes: the later record wins in every index.
    assert put(a, mem, ["k3"], first=20) == [0]
    assert got(b, mem, ["k3"], first=20) == ([SIZE], [True])
    before = [os.path.getsize(p) for p in packs(d)]
    assert put(b, mem, keys) == [0] * 8  # all held: kept, nothing appended
    assert [os.path.getsize(p) for p in packs(d)] == before, "a put of held keys wrote"
    # The packs go (as the capacity's eviction removes them): every index drops their objects.
    for p in packs(d):
        os.unlink(p)
    a.packs.changed()
    assert b.batch_is_exist(keys) == [0] * 8 and got(b, mem, keys[:1])[0] == [OBJECT_NOT_FOUND]
    assert put(a, mem, keys[:2]) == [0, 0] and got(b, mem, keys[:2]) == ([SIZE] * 2, [True] * 2)


@pytest.mark.parametrize("tail", ["torn", "garbage"])
def test_a_torn_or_garbage_tail_reads_as_misses(tmp_path, mem, tail):
    """A writer killed part way through its last record leaves the pack cut inside it; a disk
    that returned garbage, random bytes after the last record. Neither is ever read as data."""
    d = tmp_path / "l3"
    keys = [f"k{j}" for j in range(6)]
    assert put(client(d, mem), mem, keys) == [0] * 6
    (p,) = packs(d)
    size = os.path.getsize(p)
    with open(p, "r+b") as f:
        if tail == "torn":
            f.truncate(size - SIZE // 2)  # the last record cut in its middle
        else:
            f.seek(size)
            f.write(np.random.default_rng(1).integers(0, 256, 3 * SIZE, dtype=np.uint8).tobytes())
    c = client(d, mem)
    rc, same = got(c, mem, keys)
    whole = 5 if tail == "torn" else 6
    assert rc == [SIZE] * whole + [OBJECT_NOT_FOUND] * (6 - whole) and same[:whole] == [True] * whole
    assert put(c, mem, keys) == [0] * 6 and got(client(d, mem), mem, keys) == ([SIZE] * 6, [True] * 6)


def test_a_damaged_record_is_a_miss_for_every_client_and_scrub_names_it(tmp_path, mem):
    d = tmp_path / "l3"
    a, b = client(d, mem), client(d, mem)
    keys = [f"k{j}" for j in range(6)]
    assert put(a, mem, keys) == [0] * 6
    (p,) = packs(d)
    data, at = bytearray(open(p, "rb").read()), pack_records(p)
    for k in ("k1", "k4"):  # a byte of each object's body
        data[at[k] + 100] ^= 0x10
    open(p, "wb").write(bytes(data))
    rc, same = got(b, mem, keys[:3])
    assert rc == [SIZE, DAMAGED, SIZE] and same[0] and same[2]
    assert a.batch_is_exist(["k1"]) == [0], "the damaged object stayed for another client"
    assert scrub(str(d)) == {"checked": 5, "intact": 4, "damaged": 1, "removed": 1}
    assert stats(str(d))["objects"] == 4 and got(a, mem, ["k4"])[0] == [OBJECT_NOT_FOUND]


def test_the_capacity_holds_and_the_least_recently_used_packs_go(tmp_path, mem):
    d = tmp_path / "l3"
    cap = 2 << 20
    c = client(d, mem, capacity_bytes=cap)
    for r in range(12):  # 12 × 64 objects of 8.5 KiB: 6.5 MiB through a 2 MiB directory
        assert put(c, mem, [f"r{r}-{j}" for j in range(64)]) == [0] * 64
        assert scan(str(d))[0] <= cap
    assert c.batch_is_exist([f"r0-{j}" for j in range(64)]) == [0] * 64  # the first went
    assert got(c, mem, [f"r11-{j}" for j in range(64)]) == ([SIZE] * 64, [True] * 64)
    assert c.resync() <= cap and stats(str(d))["disk_bytes"] <= cap


def test_objects_of_the_older_format_are_still_read(tmp_path, mem):
    """A directory written before packs holds small objects as files of their own."""
    d = tmp_path / "l3"
    old = client(d, mem)
    src = mem[0]
    assert old._put_files(["k0"], [src.ctypes.data], [SIZE]) == [0] and os.path.exists(old.path("k0"))
    c = client(d, mem)
    assert c.batch_is_exist(["k0", "k1"]) == [1, 0] and got(c, mem, ["k0"]) == ([SIZE], [True])
    assert c.get("k0") == src[:SIZE].tobytes()
    assert c.remove("k0") == 0 and c.batch_is_exist(["k0"]) == [0]


def test_objects_up_to_the_pack_limit_go_to_packs_larger_ones_to_files(tmp_path):
    c = LocalDiskClient(str(tmp_path / "l3"))
    big = b"x" * (_native.PACK_OBJECT_MAX + 1)
    assert c.put("small", b"y" * _native.PACK_OBJECT_MAX) == 0 and c.put("big", big) == 0
    assert not os.path.exists(c.path("small")) and os.path.exists(c.path("big"))
    assert c.get("small") == b"y" * _native.PACK_OBJECT_MAX and c.get("big") == big


@pytest.mark.parametrize("seal", ["intact", "damaged"])
def test_a_sealed_pack_is_indexed_from_its_list_of_records(tmp_path, mem, seal):
    """A closed pack ends in the list of its records; a process that meets it later reads that
    alone. Seen through a record whose header is damaged: found through the list, its get answers
    damaged; read record by record (a list that does not hold), the records before it are found
    and it and those after it are not."""
    d = tmp_path / "l3"
    keys = [f"k{j}" for j in range(6)]
    c = client(d, mem)
    assert put(c, mem, keys) == [0] * 6
    c.close()
    (p,) = packs(d)
    data, at = bytearray(open(p, "rb").read()), pack_records(p)
    data[at["k3"] - len("k3") - 32 + 9] ^= 0x01  # a byte of k3's sequence number
    if seal == "damaged":
        data[-20] ^= 0x01  # a byte of the list
    open(p, "wb").write(bytes(data))
    rc, same = got(client(d, mem), mem, keys)
    if seal == "intact":
        assert rc == [SIZE] * 3 + [DAMAGED] + [SIZE] * 2 and same[:3] + same[4:] == [True] * 5
    else:
        assert rc == [SIZE] * 3 + [OBJECT_NOT_FOUND] * 3 and same[:3] == [True] * 3


def test_a_forked_child_writes_a_pack_of_its_own(tmp_path, mem):
    """A child of fork() inherits its parent's client; were it to append to the parent's pack at
    the parent's offsets, each would overwrite the other's records."""
    d = tmp_path / "l3"
    c = client(d, mem)
    assert put(c, mem, ["p0", "p1"]) == [0, 0]
    pid = os.fork()
    if pid == 0:  # the child: its puts and its close (which seals its pack only), then out
        ok = put(c, mem, ["c0", "c1"], first=10) == [0, 0]
        c.close()
        os._exit(0 if ok else 1)
    assert put(c, mem, ["p2", "p3"], first=2) == [0, 0]
    assert os.waitpid(pid, 0)[1] == 0
    assert len(packs(d)) == 2
    fresh = client(d, mem)
    assert got(fresh, mem, ["p0", "p1", "p2", "p3"]) == ([SIZE] * 4, [True] * 4)
    assert got(fresh, mem, ["c0", "c1"], first=10) == ([SIZE] * 2, [True] * 2)


def test_the_shared_counter_file_is_written_whole(tmp_path):
    """A store into a mapped hole must allocate a block, and a full disk then kills the process
    (SIGBUS): the counter is made of written bytes."""
    d = tmp_path / "l3"
    LocalDiskClient(str(d))
    st = os.stat(d / "packs.counter")
    assert st.st_size == 4096 and st.st_blocks * 512 >= 4096


def test_packs_that_cannot_be_read_leave_files_readable(tmp_path, mem):
    d = tmp_path / "l3"
    c = client(d, mem)
    assert put(c, mem, ["small"]) == [0]
    assert c.put("big", b"z" * 200_000) == 0
    for p in packs(d):
        os.unlink(p)
    os.rmdir(d / "packs")  # the packs cannot even be listed now
    assert c.batch_is_exist(["big"]) == [1] and c.get("big") == b"z" * 200_000
    assert got(c, mem, ["small"])[0] == [OBJECT_NOT_FOUND]


def test_a_process_holds_a_bounded_number_of_pack_descriptors(tmp_path, mem):
    """Each pack read is opened; past ``PACK_DESCRIPTORS`` the least recently used are closed
    (and opened again when read), so a directory of many packs does not exhaust descriptors."""
    d = tmp_path / "l3"
    c = client(d, mem, capacity_bytes=64 << 20)  # 256 KiB packs: 30 of them below
    for r in range(30):
        assert put(c, mem, [f"r{r}-{j}" for j in range(32)]) == [0] * 32
    c.close()
    del c  # its descriptors go with it: those counted below are the reader's
    assert len(packs(d)) >= 30

    def pack_fds():
        fds = os.listdir("/proc/self/fd")
        return sum(1 for f in fds if os.path.realpath(f"/proc/self/fd/{f}").startswith(str(d / "packs")))

    reader = client(d, mem)
    for r in range(30):
        assert got(reader, mem, [f"r{r}-{j}" for j in range(32)]) == ([SIZE] * 32, [True] * 32)
        assert pack_fds() <= _native.PACK_DESCRIPTORS + 1
    assert got(reader, mem, ["r0-0"]) == ([SIZE], [True])  # a closed one opens again
