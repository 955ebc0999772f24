"""The embedded L3 transport: page objects as files in one directory, shared by every process of
a machine (the tensor-parallel ranks of a server; the server after a restart), no server needed.

It answers the calls of Mooncake Store's client that hicache-io's store makes (``batch_put_from``,
``batch_get_into``, their multi-buffer forms, ``batch_is_exist``, ``get``, ``put``, ``remove``, …),
with Mooncake's return conventions, so the store's pipelines, key schemes and trailers are the
same over both transports (:class:`hicache_io.storage.LocalStore`).

Files. Object ``key`` is ``objects/<h[:2]>/<h>`` under the directory (``h``: SHA-256 of the key):
the object's bytes, the key, and a 32-byte footer (``HIOLOC01``, the object's length, the key's
length, the CRC-32 of the object's bytes). A put writes a temporary file (``tmp/``) and links it
into place: an object is visible only when complete, and a writer killed at any instant leaves a
temporary file (removed later) or nothing. Objects are never changed once published; a put of an
existing key keeps the object (as Mooncake does), even when two writers race.

Reads. A get reads the object's bytes straight into the caller's memory (``preadv``, no Python
copy; the GIL is released during the system calls), then checks the footer: a file too short,
of another key or length, is a miss; an object that carries hicache-io's trailer is verified by
the store against it; any other object against the footer's CRC (so a torn or flipped object
without a trailer is a miss too), and a damaged object is removed. A get marks its file used (its
modification time, at most every ``TOUCH_SECONDS``): the eviction order is least recently used.

Capacity. The directory's size on disk (objects, temporary files, folders, the lock file) is kept
under ``capacity_bytes``, whatever the number of processes: every put counts its new files'
bytes first, in a counter all of them share (in the lock file, under its lock); when they would
not fit, the putting process counts the directory anew and removes the least recently used
objects until the directory and the new bytes fit in nine tenths of the capacity.
Removal is safe while other processes read (an open file stays readable; a file removed before it
was opened is a miss). Buffered I/O (no ``O_DIRECT``: objects end in unaligned footers).

Durability: objects survive a process that dies (they are in the page cache); ``fsync=True``
also makes them survive a machine that loses power, at the cost of a flush per object."""

import errno
import fcntl
import hashlib
import itertools
import logging
import os
import socket
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .trailer import TRAILER_MAGIC

logger = logging.getLogger(__name__)

FOOTER = struct.Struct("<8sQII8x")
FOOTER_MAGIC = b"HIOLOC01"
#: Mooncake's codes, as the store reads them.
OBJECT_NOT_FOUND = -704
INVALID_PARAMS = -600
BUFFER_MISMATCH = -800
#: Default capacity: fits a laptop's disk.
DEFAULT_CAPACITY = 8 << 30
#: A get marks an object used (for the eviction order) when its last mark is older than this.
TOUCH_SECONDS = 30.0
#: Objects of at least this many bytes (on average) move on the I/O threads.
PARALLEL_BYTES = 64 << 10
#: This host in temporary files' names (a pid means something on its own host only).
_HOST = (socket.gethostname() or "host").replace("-", "_")
#: Buffers one ``preadv`` / ``pwritev`` takes at most.
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024
#: Temporary files of writers that died are removed after this long (seconds).
STALE_TMP_SECONDS = 600.0


def default_directory() -> str:
    """``$XDG_CACHE_HOME/hicache-io/l3`` (``~/.cache/hicache-io/l3``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hicache-io", "l3")


def _view(addr: int, size: int) -> memoryview:
    """``size`` bytes of this process's memory at ``addr`` (the caller's registered buffer)."""
    import ctypes

    return memoryview((ctypes.c_ubyte * size).from_address(addr)).cast("B")


def _footer_of(obj_len: int, key: bytes, crc: int) -> bytes:
    return key + FOOTER.pack(FOOTER_MAGIC, obj_len, len(key), crc)


class LocalDiskClient:
    """Mooncake Store's client calls over a directory (see the module docstring)."""

    def __init__(self, directory: Optional[str] = None, capacity_bytes: Optional[int] = None, threads: int = 4, fsync: bool = False, crc_trailered: bool = False):
        self.directory = os.path.abspath(directory or default_directory())
        self.capacity = int(capacity_bytes) if capacity_bytes is not None else DEFAULT_CAPACITY
        if self.capacity <= 0:
            raise ValueError(f"hicache_io_local_capacity_bytes must be positive, got {self.capacity}")
        self.fsync = fsync
        # Objects that carry hicache-io's trailer are verified by the store against it; with the
        # store's checksums off nothing would, so their CRC is checked here too.
        self.crc_trailered = crc_trailered
        self.objects = os.path.join(self.directory, "objects")
        self.tmp = os.path.join(self.directory, "tmp")
        os.makedirs(self.tmp, exist_ok=True)
        for i in range(256):  # every object's folder, once
            os.makedirs(os.path.join(self.objects, f"{i:02x}"), exist_ok=True)
        self.lock_path = os.path.join(self.directory, "lock")
        with open(self.lock_path, "ab"):
            pass
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="hicache-io-l3-local")
        self._seq = itertools.count()  # next() is atomic: temporary names unique per thread
        self._regions: Dict[int, Tuple[int, memoryview]] = {}
        self.resync()

    # ---- paths and sizes ---------------------------------------------------------------------

    def path(self, key: str) -> str:
        h = hashlib.sha256(key.encode()).hexdigest()
        return f"{self.objects}/{h[:2]}/{h}"

    @staticmethod
    def _unlink(p: str) -> bool:
        try:
            os.unlink(p)
            return True
        except FileNotFoundError:
            return False

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

    def _reserve(self, nbytes: int) -> None:
        """Counts ``nbytes`` about to be written; past the capacity, first removes the least
        recently used objects until the directory (counted anew) and these bytes fit in nine
        tenths of it."""

        def reserve(used: int) -> int:
            if used + nbytes <= self.capacity:
                return used + nbytes
            # What is on disk decides what goes; the counter (which also holds the reservations of
            # writers whose files are not complete yet) loses what was removed.
            total, objs = scan(self.directory)
            goal = self.capacity * 9 // 10
            freed = 0
            for _mtime, size, p in sorted(objs):
                if max(total, used) - freed + nbytes <= goal:
                    break
                if self._unlink(p):
                    freed += size
            return max(total, used) - freed + nbytes

        self._counted(reserve)

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

    # ---- one object --------------------------------------------------------------------------

    def _put_one(self, key: str, parts: Sequence[memoryview]) -> int:
        final = self.path(key)
        if os.path.exists(final):
            return 0  # an object is kept (as Mooncake keeps it)
        tmp = os.path.join(self.tmp, f"{os.getpid()}-{_HOST}-{threading.get_ident()}-{next(self._seq)}")
        try:
            crc, n = 0, 0
            for part in parts:
                crc = zlib.crc32(part, crc)
                n += part.nbytes
            data = list(parts) + [_footer_of(n, key.encode(), crc)]
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, data)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            # Published whole, or not at all; a link never replaces an object another writer
            # published meanwhile (the first one stays, as Mooncake keeps it).
            os.link(tmp, final)
        except FileExistsError:
            return 0
        except OSError as e:
            logger.warning("hicache-io L3 (local): put of %s failed: %s", key, e)
            return -(e.errno or 1)
        finally:
            self._unlink(tmp)
        return _file_bytes(key, parts)

    def _get_one(self, key: str, views: Sequence[memoryview], exact: bool) -> int:
        """Reads ``key``'s object into ``views`` (``exact``: their sizes must add up to the
        object's; else one view at least as large) with its key and footer, in one read. Returns
        the bytes read, or a code."""
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except FileNotFoundError:
            return OBJECT_NOT_FOUND
        except OSError as e:
            return -(e.errno or 1)
        try:
            st = os.fstat(fd)
            kb = key.encode()
            n = st.st_size - len(kb) - FOOTER.size
            room = sum(v.nbytes for v in views)
            if n < 0:
                return OBJECT_NOT_FOUND
            if (exact and room != n) or (not exact and room < n):
                return BUFFER_MISMATCH if exact else INVALID_PARAMS
            targets = list(views) if exact else [views[0][:n]]
            tail = bytearray(len(kb) + FOOTER.size)
            if _read_all(fd, targets + [memoryview(tail)]) != st.st_size:
                return OBJECT_NOT_FOUND  # truncated meanwhile
            ok, crc = _footer_holds(bytes(tail), kb, n)
            if not ok:
                return self._damaged(key, st, "its footer does not hold")
            if self.crc_trailered or not _carries_trailer(targets):
                got = 0
                for t in targets:
                    got = zlib.crc32(t, got)
                if got != crc:
                    return self._damaged(key, st, "it fails its CRC")
            if time.time() - st.st_mtime > TOUCH_SECONDS:
                try:
                    os.utime(fd)  # last use, for the eviction order
                except OSError:
                    pass  # another user's file: its order stays
            return n
        except OSError as e:
            return -(e.errno or 1)
        finally:
            os.close(fd)

    def _damaged(self, key: str, st: os.stat_result, why: str) -> int:
        """A miss for a damaged object, which goes (so that the page can be stored again)."""
        logger.warning("hicache-io L3 (local): object %s is damaged (%s): a miss, removed", key, why)
        if self._unlink(self.path(key)):
            self._adjust(-(st.st_blocks * 512))
        return OBJECT_NOT_FOUND

    # ---- Mooncake's client calls -------------------------------------------------------------

    def _map(self, fn: Any, items: Sequence[Any]) -> List[int]:
        """``fn`` over the batch: on the I/O threads where objects are large enough for their
        system calls to overlap; small ones in turn (dispatching them costs more than it saves)."""
        large = sum(sum(v.nbytes for v in it[1]) for it in items) >= PARALLEL_BYTES * len(items)
        if len(items) <= 2 or not large:
            return [fn(*it) for it in items]
        return list(self._pool.map(lambda it: fn(*it), items))

    def batch_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], config: Any = None) -> List[int]:
        return self.batch_put_from_multi_buffers(keys, [[p] for p in ptrs], [[s] for s in sizes], config)

    def batch_put_from_multi_buffers(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], config: Any = None) -> List[int]:
        items = [(k, [self._view(int(p), int(s)) for p, s in zip(ps, ss)]) for k, ps, ss in zip(keys, ptrs, sizes)]
        return self._put_all(items)

    def _put_all(self, items: List[Tuple[str, List[memoryview]]]) -> List[int]:
        """Puts ``(key, parts)``: the new objects' bytes counted first (the directory never holds
        more than its capacity), what was not written uncounted after."""
        try:
            new = [(k, parts) for k, parts in items if not os.path.exists(self.path(k))]
            need = sum(_file_bytes(k, parts) for k, parts in new)
            if need > self.capacity:
                return [-errno.ENOSPC] * len(items)  # more than the whole directory may hold
            if need:
                self._reserve(need)
            written = self._map(self._put_one, items)
            self._adjust(sum(w for w in written if w > 0) - need)
        except OSError as e:  # the lock or the directory itself failed: every put fails
            logger.warning("hicache-io L3 (local): puts failed: %s", e)
            return [-(e.errno or errno.EIO)] * len(items)
        return [0 if w >= 0 else w for w in written]

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> List[int]:
        items = [(k, [self._view(int(p), int(s))], False) for k, p, s in zip(keys, ptrs, sizes)]
        return self._map(self._get_one, items)

    def batch_get_into_multi_buffers(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> List[int]:
        items = [(k, [self._view(int(p), int(s)) for p, s in zip(ps, ss)], True) for k, ps, ss in zip(keys, ptrs, sizes)]
        return self._map(self._get_one, items)

    def batch_is_exist(self, keys: Sequence[str]) -> List[int]:
        return [1 if os.path.exists(self.path(k)) else 0 for k in keys]

    def is_exist(self, key: str) -> int:
        return self.batch_is_exist([key])[0]

    def get(self, key: str) -> bytes:
        try:
            n = os.stat(self.path(key)).st_size - len(key.encode()) - FOOTER.size
        except OSError:
            return b""
        buf = bytearray(max(n, 0))
        return bytes(buf) if n >= 0 and self._get_one(key, [memoryview(buf)], True) == n else b""

    def put(self, key: str, value: bytes, config: Any = None) -> int:
        return self._put_all([(key, [memoryview(bytes(value))])])[0]

    def remove(self, key: str) -> int:
        p = self.path(key)
        try:
            size = os.stat(p).st_blocks * 512
        except FileNotFoundError:
            return OBJECT_NOT_FOUND
        if not self._unlink(p):
            return OBJECT_NOT_FOUND
        self._adjust(-size)
        return 0

    def remove_all(self) -> int:
        n = sum(self._unlink(p) for _m, _s, p in scan(self.directory)[1])
        self.resync()
        return n

    def register_buffer(self, addr: int, nbytes: int) -> int:
        # Files are read and written from any of this process's memory; a registered region is
        # viewed once, and objects inside it sliced from that view.
        self._regions[int(addr)] = (int(nbytes), _view(int(addr), int(nbytes)))
        return 0

    def unregister_buffer(self, addr: int) -> int:
        self._regions.pop(int(addr), None)
        return 0

    def _view(self, addr: int, size: int) -> memoryview:
        for base, (nbytes, view) in self._regions.items():
            if base <= addr and addr + size <= base + nbytes:
                return view[addr - base : addr - base + size]
        return _view(addr, size)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _footer_holds(tail: bytes, kb: bytes, n: int) -> Tuple[bool, int]:
    """Whether ``tail`` (the file's key and footer) names key ``kb`` and an object of ``n``
    bytes; and the footer's CRC."""
    if n < 0 or len(tail) != len(kb) + FOOTER.size or tail[: len(kb)] != kb:
        return False, 0
    magic, length, klen, crc = FOOTER.unpack(tail[len(kb) :])
    return magic == FOOTER_MAGIC and length == n and klen == len(kb), crc


def _file_bytes(key: str, parts: Sequence[memoryview]) -> int:
    """What object ``key`` of ``parts`` takes on disk."""
    return _on_disk(sum(p.nbytes for p in parts) + FOOTER.size + len(key.encode()))


def _on_disk(nbytes: int) -> int:
    """What a file of ``nbytes`` takes on disk: whole 4 KiB blocks."""
    return -(-nbytes // 4096) * 4096


def _writer_gone(name: str) -> bool:
    """Whether the process that named temporary file ``name`` (``pid-host-thread-n``) has ended:
    a process of this host (and pid namespace) that no longer runs. Others' files go by age."""
    parts = name.split("-")
    if len(parts) < 4 or "-".join(parts[1:-2]) != _HOST:
        return False
    try:
        os.kill(int(parts[0]), 0)
    except (ValueError, ProcessLookupError):
        return True
    except PermissionError:
        return False
    return False


def scan(directory: str) -> Tuple[int, List[Tuple[float, int, str]]]:
    """A directory's bytes on disk (files, folders, the lock) and its objects as ``(last use,
    bytes, path)``. Removes temporary files of writers that have ended or stalled."""
    tmp = os.path.join(directory, "tmp")
    lock = os.path.join(directory, "lock")
    total, objs = 0, []
    for root, _dirs, files in os.walk(directory):
        try:
            total += os.stat(root).st_blocks * 512
        except FileNotFoundError:
            continue
        for name in files:
            p = os.path.join(root, name)
            try:
                st = os.stat(p)
            except FileNotFoundError:
                continue  # removed meanwhile
            if root == tmp and (_writer_gone(name) or time.time() - st.st_mtime > STALE_TMP_SECONDS):
                LocalDiskClient._unlink(p)
                continue
            size = st.st_blocks * 512 or _on_disk(st.st_size)
            total += size
            if root != tmp and p != lock:
                objs.append((st.st_mtime, size, p))
    return total, objs


def _carries_trailer(targets: Sequence[memoryview]) -> bool:
    """Whether the object read ends in hicache-io's integrity trailer (which the store checks)."""
    last = targets[-1]
    if last.nbytes < 16:
        return False
    return int.from_bytes(last[last.nbytes - 16 : last.nbytes - 8], "little") == TRAILER_MAGIC


def _vectored(call: Any, fd: int, views: List[memoryview]) -> int:
    """``call(fd, buffers, offset)`` (``os.preadv`` or ``os.pwritev``) from offset 0 until every
    view is done or a call moves nothing (the end of the file), at most ``IOV_MAX`` buffers a
    call; the bytes moved."""
    offset, first = 0, 0
    views = [v if v.format == "B" else v.cast("B") for v in views]
    while first < len(views):
        n = call(fd, views[first : first + IOV_MAX], offset)
        if n <= 0:
            break
        offset += n
        while first < len(views) and n >= views[first].nbytes:
            n -= views[first].nbytes
            first += 1
        if n:
            views[first] = views[first][n:]
    return offset


def _write_all(fd: int, parts: List[Any]) -> None:
    """Writes every byte of ``parts`` from offset 0 (a write may be partial)."""
    views = [memoryview(p) for p in parts]
    if _vectored(os.pwritev, fd, views) != sum(v.nbytes for v in views):
        raise OSError(errno.EIO, "no progress writing")


def _read_all(fd: int, views: List[memoryview]) -> int:
    """Fills ``views`` from offset 0 until full or the end of the file; the bytes read."""
    return _vectored(os.preadv, fd, list(views))


def stats(directory: str) -> Dict[str, int]:
    """Objects, their bytes on disk, and the whole directory's bytes on disk."""
    total, objs = scan(directory)
    return {"objects": len(objs), "object_bytes": sum(s for _m, s, _p in objs), "disk_bytes": total}


def scrub(directory: str) -> Dict[str, int]:
    """Reads every object; removes those whose file is torn, whose footer does not hold, or whose
    bytes fail their CRC or their hicache-io trailer. Counts ``checked``, ``intact``, ``removed``."""
    out = {"checked": 0, "intact": 0, "removed": 0}
    objects = os.path.join(directory, "objects")
    for root, _dirs, files in os.walk(objects):
        for name in files:
            p = os.path.join(root, name)
            out["checked"] += 1
            if _file_intact(p):
                out["intact"] += 1
            elif LocalDiskClient._unlink(p):
                out["removed"] += 1
    if out["removed"] and os.path.exists(os.path.join(directory, "lock")):
        client = LocalDiskClient(directory)  # counts the directory anew
        client.close()
    return out


def _file_intact(p: str) -> bool:
    """Whether object file ``p`` holds what its footer says (its key, whose path it is, its length
    and CRC), and a hicache-io trailer that matches, where the object carries one."""
    import numpy as np

    from .. import _native
    from .trailer import name_tag

    try:
        with open(p, "rb") as f:
            data = f.read()
    except OSError:
        return False
    if len(data) < FOOTER.size:
        return False
    klen = FOOTER.unpack(data[-FOOTER.size :])[2]
    n = len(data) - klen - FOOTER.size
    key = data[n : n + klen] if n >= 0 else b""
    ok, crc = _footer_holds(data[n:] if n >= 0 else b"", key, n)
    obj = memoryview(data)[: max(n, 0)]
    if not ok or hashlib.sha256(key).hexdigest() != os.path.basename(p) or zlib.crc32(obj) != crc:
        return False
    if _carries_trailer([obj]):
        body = np.frombuffer(obj[: n - 16], np.uint8)
        return (_native.checksum(body) ^ name_tag(key.decode())) == int.from_bytes(obj[n - 8 :], "little")
    return True
