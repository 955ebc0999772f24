"""The embedded L3 transport: page objects as files in one directory, shared by every process of
a machine (the tensor-parallel ranks of a server; the server after a restart), no server needed.

It answers the calls of Mooncake Store's client that hicache-io's store makes (``batch_put_from``,
``batch_get_into``, their multi-buffer forms, ``batch_is_exist``, ``get``, ``put``, ``remove``, …),
with Mooncake's return conventions, so the store's pipelines, key schemes and trailers are the
same over both transports (:class:`hicache_io.storage.LocalStore`).

Packs. An object of up to ``_native.PACK_OBJECT_MAX`` bytes (64 KiB: a DSA page, a sidecar) is a
record appended to this process's pack, ``packs/<host>-<time>-<pid>-<n>-<nonce>.pack``: a batch's puts are
one write, a get of objects written together one read (a new file costs this project's file
systems about 0.3 ms whatever its size). Each process indexes the packs itself, following a counter
all of them map (``packs.counter``); the format, its crash safety and its checks live in native
code only (:class:`hicache_io._native.LocalPacks`, ``python/src/local_pack.rs``). A pack is one unit of the
eviction order below.

Files. Larger objects (and small ones a directory written before packs holds) are files: object
``key`` is ``objects/<h[:2]>/<h>`` under the directory (``h``: SHA-256 of the key):
the object's bytes, the key, and a footer (``_native.LOCAL_FOOTER_BYTES`` bytes: a magic, the
object's length, the key's length, the CRC-32 of the object's bytes, flags; an object that ends in
hicache-io's trailer records no CRC, its trailer verifies it; read, written and checked in native
code only, ``python/src/local_io.rs``). A put writes a temporary file (``tmp/``) and links it
into place: an object is visible only when complete, and a writer killed at any instant leaves a
temporary file (removed later) or nothing. Objects are never changed once published; a put of an
existing key keeps the object (as Mooncake does), even when two writers race for a file. (Two
writers racing to pack one key both append it; the record numbered later is the key's, and either
holds the key's own bytes.)

Byte path. Objects move between the caller's registered memory and files in native code
(:func:`hicache_io._native.local_get` / ``local_put``): one ``preadv`` / ``pwritev`` an object, no
Python copy, the GIL released for the whole batch, and objects of 64 KiB and more spread over
``threads`` threads. Every span is checked to lie in registered memory before any byte moves.

Reads. A get reads the object's bytes straight into the caller's memory, then checks the
footer: a file too short, of another key or length, is a miss; an object that carries hicache-io's trailer is verified by
the store against it; any other object against the footer's CRC (so a torn or flipped object
without a trailer is a miss too), or, where the footer records none, against its trailer, here;
a damaged object is removed. A get marks its file used (its
modification time, at most every ``TOUCH_SECONDS``): the eviction order is least recently used.

Capacity. The directory's size on disk (objects, temporary files, folders, the lock file) is kept
under ``capacity_bytes``, whatever the number of processes: every put counts its new files'
bytes first, in a counter all of them share (in the lock file, under its lock); when they would
not fit, the putting process counts the directory anew and removes the least recently used
objects until the directory and the new bytes fit in nine tenths of the capacity.
Removal is safe while other processes read (an open file stays readable; a file removed before it
was opened is a miss). Reads follow ``reads`` (:data:`READ_RULES`): by default an object the page
cache holds is read from it (shared by the processes of the machine); a large one it does not hold
from the disk with ``O_DIRECT`` the first time this client reads it, through the page cache the next
(an object read again stays cached).
Writes follow ``writes`` (:data:`WRITE_RULES`): ``cached`` (``LocalStore``'s default) leaves a
page just stored in the page cache, so it is read back from memory, and starts each file's
writeback at once; ``direct`` (the vLLM tier's default) writes objects of 1 MiB and more with
``O_DIRECT``, which holds the disk's speed under sustained stores (buffered writes of new files ran
at a fifth to a tenth of it on this project's machines) but leaves nothing cached.

Recycling. Where puts write with ``O_DIRECT`` (``writes="direct"``), eviction keeps the files of
the objects it evicts beyond the room the put needs (1 MiB and more) under ``free/``, and later
puts of objects of as many 4 KiB blocks write over them instead of creating files: an ``O_DIRECT``
write over a file's existing blocks ran at 1.6–1.8× a write of a new file on this project's
machines (the file system allocates nothing). Free files count in the directory's size, and go
first where a put needs room for new bytes; a put that leaves few of them makes more before it
returns (:meth:`LocalDiskClient._refill`), so that other puts do not wait for an eviction once
they are gone. A reader holds a shared lock on a file of 1 MiB and
more while it reads it and checks its object's path still names it; a put claims a free file
only under an exclusive lock, without waiting: a get reads an evicted object whole or misses,
never a file half written over.

Durability: objects survive a process that dies (they are in the page cache); ``fsync=True``
also makes them survive a machine that loses power, at the cost of a flush per object."""

import errno
import fcntl
import itertools
import logging
import os
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import _native
from .errors import BUFFER_MISMATCH, DAMAGED, INVALID_PARAMS, OBJECT_NOT_FOUND  # noqa: F401 (Mooncake's codes, as the store reads them)
from .local_evict import HOST as _HOST
from .local_evict import Eviction, any_file, scan, unlink

logger = logging.getLogger(__name__)

#: How puts write their files. ``cached``: buffered, each file's writeback started as it is
#: written (pages just stored stay in the page cache, dirty pages stay few). ``direct``: objects
#: of 1 MiB and more whose first span starts on a page with ``O_DIRECT`` (the disk's speed however
#: much writeback the kernel has pending; nothing left cached), others buffered. ``buffered``:
#: the kernel's writeback alone.
WRITE_RULES = {
    "cached": {"direct": False, "start_writeback": True},
    "direct": {"direct": True, "start_writeback": False},
    "buffered": {"direct": False, "start_writeback": False},
}
#: How gets read files. ``auto``: from the page cache where it holds the object; else an object of
#: 1 MiB and more that this client has not read so lately (a table of 65,536 hashes: about two
#: thirds of the last 65,536 it read so) with
#: ``O_DIRECT`` (the disk's speed: cold buffered reads ran at half of it on this project's
#: machines), which leaves it uncached, and one it has through the page cache, which keeps it for
#: the reads after: the first read after a restart runs at the disk's speed, an object read again
#: comes from memory. ``buffered``: always through the page cache (a cold read leaves the object
#: cached for the next reader: ranks that read the same rank-replicated objects, MLA's, may
#: prefer it).
READ_RULES = {"auto": True, "buffered": False}
#: Default capacity: fits a laptop's disk.
DEFAULT_CAPACITY = 8 << 30
#: A get marks an object used (for the eviction order) when its last mark is older than this.
TOUCH_SECONDS = 30.0


def default_directory() -> str:
    """``$XDG_CACHE_HOME/hicache-io/l3`` (``~/.cache/hicache-io/l3``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hicache-io", "l3")


class LocalDiskClient:
    """Mooncake Store's client calls over a directory (see the module docstring)."""

    def __init__(self, directory: Optional[str] = None, capacity_bytes: Optional[int] = None, threads: int = 4, fsync: bool = False, crc_trailered: bool = False, writes: str = "cached", reads: str = "auto"):
        self.directory = os.path.abspath(directory or default_directory())
        self.capacity = int(capacity_bytes) if capacity_bytes is not None else DEFAULT_CAPACITY
        if self.capacity <= 0:
            raise ValueError(f"hicache_io_local_capacity_bytes must be positive, got {self.capacity}")
        self.fsync = fsync
        if writes not in WRITE_RULES:
            raise ValueError(f"hicache_io_local_writes {writes!r}: expected one of {', '.join(WRITE_RULES)}")
        #: How puts write files (:data:`WRITE_RULES`).
        self.writes = writes
        if reads not in READ_RULES:
            raise ValueError(f"hicache_io_local_reads {reads!r}: expected one of {', '.join(READ_RULES)}")
        #: How gets read files (:data:`READ_RULES`).
        self.reads = reads
        # ``auto``'s memory of the large objects read past the page cache (lock-free: a fork
        # copies it whole).
        self._history = _native.ReadHistory() if READ_RULES[reads] else None
        # Objects that carry hicache-io's trailer are verified by the store against it; with the
        # store's checksums off nothing would, so they are checked here too (their CRC, or their
        # trailer where the footer records no CRC).
        self.crc_trailered = crc_trailered
        self.objects = os.path.join(self.directory, "objects")
        self.tmp = os.path.join(self.directory, "tmp")
        #: Files of evicted objects that puts write over (see the module docstring).
        self.free = os.path.join(self.directory, "free")
        os.makedirs(self.tmp, exist_ok=True)
        os.makedirs(self.free, exist_ok=True)
        self._eviction = Eviction(self.directory, self.free, self.capacity)
        for i in range(256):  # every object's folder, once
            os.makedirs(os.path.join(self.objects, f"{i:02x}"), exist_ok=True)
        self.lock_path = os.path.join(self.directory, "lock")
        with open(self.lock_path, "ab") as f:
            if f.tell() == 0:
                f.write(bytes(8))  # the counter's room, so that the count below includes the file's block
        self.threads = max(1, threads)
        self._refilling = threading.Lock()  # the one thread making free files ahead of need
        self._seq = itertools.count()  # next() is atomic: temporary names unique per thread
        self._regions: Dict[int, int] = {}
        #: Objects of up to ``_native.PACK_OBJECT_MAX`` bytes, packed (see the module docstring).
        self.packs = self._packs()
        # A child of fork() gets packs of its own: the parent's pack, its index and its locks
        # (perhaps held by another thread at the fork) stay the parent's.
        me = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _reopened(me))
        self.resync()

    def _packs(self) -> Any:
        return _native.LocalPacks(self.directory, f"{_HOST}-{time.time_ns()}", pack_bytes(self.capacity))

    # ---- paths and sizes ---------------------------------------------------------------------

    def path(self, key: str) -> str:
        return self.paths([key])[0]

    def paths(self, keys: Sequence[str]) -> List[str]:
        """The files of objects ``keys``: ``objects/<h[:2]>/<h>``, ``h`` the SHA-256 of the key."""
        return _native.local_paths(self.objects, list(keys))

    def _counted(self, change: Any) -> None:
        """Runs ``change(used) -> used`` on the directory's usage counter (the lock file's first
        8 bytes), under the directory's lock: every process counts every other's files."""
        with open(self.lock_path, "r+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                raw = lock.read(8)
                used = int.from_bytes(raw, "little") if len(raw) == 8 else scan(self.directory)[0]
                lock.seek(0)
                lock.write(max(0, change(used)).to_bytes(8, "little"))
                lock.flush()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _reserve(self, nbytes: int, recycle: bool = False, again: bool = False) -> bool:
        """Counts ``nbytes`` about to be written; past the capacity, first removes free files,
        then the least recently used objects, until the directory (counted anew) and these bytes
        fit in nine tenths of it. With ``recycle``, once the new bytes fit in the capacity, free
        files stay and objects' files of ``_native.LOCAL_RECYCLE_MIN`` bytes and more become free
        files instead (puts write over them). With ``again``, where free files are there (another
        put's eviction made them meanwhile), False: nothing counted, the put claims them first."""
        waited = []

        def reserve(used: int) -> int:
            if used + nbytes <= self.capacity:
                return used + nbytes
            if recycle and again and any_file(self.free):
                waited.append(True)
                return used
            # Free files first, without counting the whole directory (a put of another size, or
            # one that wrote through the page cache, would otherwise count it every time).
            used = self._eviction.drop_free(used, nbytes)
            if used + nbytes <= self.capacity:
                return used + nbytes
            return self._eviction.evict(used, nbytes, recycle, self.packs.changed)

        self._counted(reserve)
        return not waited

    def _refill(self, file_bytes: int, left: int) -> None:
        """After a put that wrote over free files of ``file_bytes`` bytes (``left``: how many of
        that size its listing had left; other processes may have taken some since): if fewer
        than :meth:`_low_free`, makes more now (an eviction, as a put that found none would run
        it, while the other puts still claim the ones left), rather than every put stalling on
        the directory's lock once they are gone. One thread of the process at a time; the others
        go on. A failure is logged: the put itself is done."""
        low = self._low_free(file_bytes)
        if left >= low or not self._refilling.acquire(blocking=False):
            return

        def refill(used: int) -> int:
            # Counted again under the lock: another process (or a put's eviction) may have made
            # them meanwhile. None are made while the directory has room for new files, or where
            # an eviction would keep all there is (it stops at nine tenths of the capacity).
            if used + low * file_bytes <= self.capacity or used <= self.capacity * 9 // 10 or _native.local_free_left(self.free, file_bytes) >= low:
                return used
            return self._eviction.evict(used, 0, True, self.packs.changed)

        try:
            self._counted(refill)
        except OSError as e:
            logger.warning("hicache-io L3 (local): making free files failed: %s", e)
        finally:
            self._refilling.release()

    def _low_free(self, file_bytes: int) -> int:
        """Free files below which :meth:`_refill` makes more: enough for the puts that run while
        one eviction does (four per I/O thread), and at most half of what an eviction makes (a
        tenth of the capacity), so that one refill lifts the count above it."""
        per_eviction = self.capacity // 10 // max(1, file_bytes)
        return max(1, min(4 * self.threads, per_eviction // 2))

    def _reserve_new(self, need: int, recycle: bool = False, again: bool = False) -> Optional[bool]:
        """Counts ``need`` bytes of new objects before they are written (:meth:`_reserve`); False
        (nothing is written) when they exceed the whole directory's capacity; None where the put
        should claim the free files that appeared first (``again``, see :meth:`_reserve`)."""
        if need > self.capacity:
            return False
        if need and not self._reserve(need, recycle, again):
            return None
        return True

    def _adjust(self, delta: int) -> None:
        """Corrects the counter by ``delta`` bytes (reserved but not written: negative; written
        but not reserved, an object removed meanwhile and written again: positive)."""
        if delta:
            self._counted(lambda used: used + delta)

    def resync(self) -> int:
        """Counts the directory anew, under its lock (after files were changed by hand, or a writer
        died between its reservation and its file); its bytes on disk."""
        out: List[int] = []

        def count(_used: int) -> int:
            out.append(scan(self.directory)[0])
            return out[0]

        self._counted(count)
        return out[0]

    # ---- the byte path (hicache_io._native.local_get / local_put) ------------------------------

    def _regions_with(self, extra: Sequence[Tuple[int, int]] = ()) -> List[Tuple[int, int]]:
        return list(self._regions.items()) + list(extra)

    def _put(self, keys: Sequence[str], ptrs: Sequence[Any], sizes: Sequence[Any], extra: Sequence[Tuple[int, int]] = ()) -> List[int]:
        """Puts objects ``keys`` from their spans: small ones to packs, the others to files of
        their own (:meth:`_put_files`)."""
        keys, ptrs, sizes = list(keys), list(ptrs), list(sizes)
        small = [j for j, s in enumerate(sizes) if (sum(s) if isinstance(s, (list, tuple)) else int(s)) <= _native.PACK_OBJECT_MAX]
        if not small:
            return self._put_files(keys, ptrs, sizes, extra)
        out = [0] * len(keys)
        packed = set(small)
        big = [j for j in range(len(keys)) if j not in packed]
        for part, put in ((small, self._put_packs), (big, self._put_files)):
            if part:
                for j, w in zip(part, put([keys[j] for j in part], [ptrs[j] for j in part], [sizes[j] for j in part], extra)):
                    out[j] = w
        return out

    def _put_packs(self, keys: List[str], ptrs: List[Any], sizes: List[Any], extra: Sequence[Tuple[int, int]]) -> List[int]:
        """Puts small objects into this process's pack, their bytes counted first (as files')."""
        try:
            done = self.packs.put(self._regions_with(extra), keys, ptrs, sizes, self._reserve_new, self.fsync, self.writes != "buffered")
            if done is None:
                return [-errno.ENOSPC] * len(keys)
            need, written = done
            self._adjust(sum(w for w in written if w > 0) - need)
        except OSError as e:
            logger.warning("hicache-io L3 (local): puts failed: %s", e)
            return [-(e.errno or errno.EIO)] * len(keys)
        return self._written(keys, written)

    def _put_files(self, keys: List[str], ptrs: List[Any], sizes: List[Any], extra: Sequence[Tuple[int, int]] = ()) -> List[int]:
        """Puts objects ``keys`` from their spans to files: the new objects' bytes counted first
        (the directory never holds more than its capacity), what was not written uncounted after.
        The native put maps keys to files and checks which exist, once; it calls
        :meth:`_reserve_new` with the new objects' bytes before it writes any."""
        prefix = f"{self.tmp}/{os.getpid()}-{_HOST}-{threading.get_ident()}-"
        tmps = [prefix + str(next(self._seq)) for _ in keys]
        try:
            rule = WRITE_RULES[self.writes]
            recycle = rule["direct"]  # over a file's blocks, only O_DIRECT writes gained
            reserve = (lambda need, again: self._reserve_new(need, recycle, again))
            done = _native.local_put(self._regions_with(extra), self.objects, tmps, keys, list(ptrs), list(sizes), self.fsync, self.threads, reserve, free=self.free if recycle else None, **rule)
            if done is None:
                return [-errno.ENOSPC] * len(keys)  # more than the whole directory may hold
            need, written, (left, file_bytes) = done
            self._adjust(sum(w for w in written if w > 0) - need)
        except OSError as e:  # the lock or the directory itself failed: every put fails
            logger.warning("hicache-io L3 (local): puts failed: %s", e)
            return [-(e.errno or errno.EIO)] * len(keys)
        if left >= 0:  # it wrote over free files: are enough of that size left?
            self._refill(file_bytes, left)
        return self._written(keys, written)

    @staticmethod
    def _written(keys: List[str], written: List[int]) -> List[int]:
        failed = [(k, w) for k, w in zip(keys, written) if w < 0]
        if failed:
            logger.warning("hicache-io L3 (local): %d put(s) failed, the first %s with code %d", len(failed), failed[0][0], failed[0][1])
        return [0 if w >= 0 else w for w in written]

    def _get(self, keys: Sequence[str], ptrs: Sequence[Any], sizes: Sequence[Any], exact: bool, extra: Sequence[Tuple[int, int]] = ()) -> List[int]:
        """Reads objects ``keys`` into their spans (``exact``: their sizes must add up to the
        object's; else one span at least as large); per object the bytes read or a code. A
        damaged object is a miss, and goes (so that the page can be stored again)."""
        keys, ptrs, sizes = list(keys), list(ptrs), list(sizes)
        regions = self._regions_with(extra)
        try:
            got = self.packs.get(regions, keys, ptrs, sizes, exact, self.crc_trailered, TOUCH_SECONDS)
        except OSError as e:  # the packs cannot be looked at now: misses there, files still read
            logger.warning("hicache-io L3 (local): packs unreadable: %s", e)
            got = [OBJECT_NOT_FOUND] * len(keys)
        files = [j for j, g in enumerate(got) if g == OBJECT_NOT_FOUND]  # not in a pack: its own file, if any
        if files:
            sub = _native.local_get(regions, self.objects, [keys[j] for j in files], [ptrs[j] for j in files], [sizes[j] for j in files], exact, self.crc_trailered, TOUCH_SECONDS, self.threads, self._history)
            for j, g in zip(files, sub):
                got[j] = g
        for j, g in enumerate(got):
            if g == _native.LOCAL_DAMAGED:
                got[j] = self._damaged(keys[j], self.path(keys[j]))
        return got

    def _damaged(self, key: str, p: str) -> int:
        """Removes damaged object ``key`` (file ``p``): its answer is ``DAMAGED``, a miss the
        store counts as corrupt."""
        logger.warning("hicache-io L3 (local): object %s is damaged (its footer does not hold, or it fails its CRC or its trailer): a miss, removed", key)
        try:
            size = os.stat(p).st_blocks * 512
        except OSError:
            return DAMAGED
        if unlink(p):
            self._adjust(-size)
        return DAMAGED

    # ---- Mooncake's client calls -------------------------------------------------------------

    def batch_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], config: Any = None) -> List[int]:
        return self._put(keys, ptrs, sizes)

    def batch_put_from_multi_buffers(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], config: Any = None) -> List[int]:
        return self._put(keys, [list(p) for p in ptrs], [list(s) for s in sizes])

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> List[int]:
        return self._get(keys, ptrs, sizes, False)

    def batch_get_into_multi_buffers(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> List[int]:
        return self._get(keys, [list(p) for p in ptrs], [list(s) for s in sizes], True)

    def batch_is_exist(self, keys: Sequence[str]) -> List[int]:
        keys = list(keys)
        try:
            packed = self.packs.exists(keys)
        except OSError:
            packed = [False] * len(keys)
        out = [1 if p else 0 for p in packed]
        rest = [j for j, p in enumerate(packed) if not p]
        for j, p in zip(rest, self.paths([keys[j] for j in rest]) if rest else []):
            out[j] = 1 if os.path.exists(p) else 0
        return out

    def is_exist(self, key: str) -> int:
        return self.batch_is_exist([key])[0]

    def get(self, key: str) -> bytes:
        try:
            n = self.packs.size(key)
        except OSError:  # the packs cannot be looked at now: its file, if any
            n = None
        try:
            if n is None:
                n = os.stat(self.path(key)).st_size - len(key.encode()) - _native.LOCAL_FOOTER_BYTES
        except OSError:
            return b""
        if n < 0:
            return b""
        buf = np.empty(max(n, 1), np.uint8)
        addr = buf.ctypes.data
        return buf[:n].tobytes() if self._get([key], [addr], [n], True, [(addr, buf.nbytes)])[0] == n else b""

    def put(self, key: str, value: bytes, config: Any = None) -> int:
        buf = np.frombuffer(bytes(value) or b"\0", np.uint8)
        addr = buf.ctypes.data
        return self._put([key], [addr], [len(value)], [(addr, buf.nbytes)])[0]

    def remove(self, key: str) -> int:
        try:
            held, added = self.packs.remove([key])
        except OSError:
            held, added = [False], 0
        if added:
            self._adjust(added)
        p = self.path(key)  # an older file of the key too, else it would be read again
        try:
            size = os.stat(p).st_blocks * 512
        except FileNotFoundError:
            return 0 if held[0] else OBJECT_NOT_FOUND
        if not unlink(p):
            return 0 if held[0] else OBJECT_NOT_FOUND
        self._adjust(-size)
        return 0

    def remove_all(self) -> int:
        n = self.packs.clear()
        n += sum(unlink(p) for _m, _s, p in scan(self.directory)[1])
        self.resync()
        return n

    def register_buffer(self, addr: int, nbytes: int) -> int:
        # Files are read into and written from registered memory only (as Mooncake moves it):
        # every span of a call is checked to lie inside a registered region first.
        self._regions[int(addr)] = int(nbytes)
        return 0

    def unregister_buffer(self, addr: int) -> int:
        self._regions.pop(int(addr), None)
        return 0

    def close(self) -> None:
        # A pack this process will not append to again lists its records at its end, so that
        # a process that meets it later reads that list alone, not the whole pack.
        added = self.packs.seal()
        try:
            self._adjust(added)
        except OSError:
            pass  # the directory went first: nothing left to count


def _reopened(ref: Any) -> None:
    client = ref()
    if client is not None:
        client.packs = client._packs()
        client._refilling = threading.Lock()  # perhaps held by a thread of the parent's


def pack_bytes(capacity: int) -> int:
    """Where a writer closes its pack: a 256th of the capacity (a pack is the eviction's unit),
    between 256 KiB and 64 MiB."""
    return max(256 << 10, min(64 << 20, capacity // 256))


def _on_disk(nbytes: int) -> int:
    """What a file of ``nbytes`` takes on disk: whole 4 KiB blocks."""
    return -(-nbytes // 4096) * 4096


def stats(directory: str) -> Dict[str, int]:
    """Objects (files of their own, and those packs hold), their bytes on disk (files and
    packs), the free files' bytes (evicted objects' files that puts will write over), and the
    whole directory's bytes on disk."""
    total, objs = scan(directory)
    free = os.path.join(directory, "free") + os.sep
    held = [(s, p) for _m, s, p in objs if not p.startswith(free)]
    files = sum(1 for _s, p in held if not p.endswith(".pack"))
    packed = _reader(directory).count() if os.path.isdir(os.path.join(directory, "packs")) else 0
    return {"objects": files + packed, "object_bytes": sum(s for s, _p in held), "free_bytes": sum(s for _m, s, p in objs if p.startswith(free)), "disk_bytes": total}


def _reader(directory: str) -> Any:
    """The packs of ``directory``, to read (this process writes none through it)."""
    return _native.LocalPacks(directory, f"{os.getpid()}-{_HOST}-{time.time_ns()}-r", 256 << 10)


def scrub(directory: str) -> Dict[str, int]:
    """Reads every object; removes the damaged: those whose file is torn, whose footer does not
    hold, or whose bytes fail their CRC or their hicache-io trailer. Counts ``checked``,
    ``intact``, ``damaged`` and ``removed`` (the damaged files it removed; another process may
    have removed one first)."""
    out = {"checked": 0, "intact": 0, "damaged": 0, "removed": 0}
    objects = os.path.join(directory, "objects")
    for root, _dirs, files in os.walk(objects):
        for name in files:
            p = os.path.join(root, name)
            out["checked"] += 1
            # The file's own folder's parent as the objects folder: a file elsewhere than
            # objects/<h[:2]>/ is named by no key, so it is not intact.
            if _native.local_intact(os.path.dirname(os.path.dirname(p)), p):
                out["intact"] += 1
                continue
            out["damaged"] += 1
            if unlink(p):
                out["removed"] += 1
    if os.path.isdir(os.path.join(directory, "packs")):
        checked, damaged = _reader(directory).scrub()
        out["checked"] += checked
        out["intact"] += checked - damaged
        out["damaged"] += damaged
        out["removed"] += damaged
    if out["removed"] and os.path.exists(os.path.join(directory, "lock")):
        client = LocalDiskClient(directory)  # counts the directory anew
        client.close()
    return out
