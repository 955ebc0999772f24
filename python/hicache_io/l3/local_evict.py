"""The local store's directory bookkeeping: its count (:func:`scan`), its temporary files'
writers, and eviction (:class:`Eviction`): the least recently used objects removed, or, where
puts write with ``O_DIRECT``, their files turned into free files that later puts write over.

Counting the directory anew (a ``statx`` per file, two ``getdents`` per folder: about 1,100
system calls and 7 ms for 512 objects) is what an eviction cost most. An eviction that only makes
free files ahead of need, within the capacity, soon after a count, takes the next least recently
used objects of that count instead, each checked unchanged (not used, not written again since)
with one ``stat``; a count is at most :data:`LISTED_SECONDS` old, and one that runs out is made
anew. At capacity, where a put waits, every eviction counts the directory anew.
"""

import os
import socket
import time
import uuid
from typing import Any, Callable, List, Optional, Tuple

from .. import _native

#: This host in temporary files' names (a pid means something on its own host only).
HOST = (socket.gethostname() or "host").replace("-", "_")
#: Temporary files of writers that died are removed after this long (seconds).
STALE_TMP_SECONDS = 600.0
#: How long an eviction that makes free files may take its objects from the last count of the
#: directory (seconds).
LISTED_SECONDS = 10.0


def unlink(p: str) -> bool:
    try:
        os.unlink(p)
        return True
    except FileNotFoundError:
        return False


class Folder:
    """Folder ``path`` held open, never through a link (``free/``: a link put there must not make
    the store move or remove files of another folder)."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self) -> int:
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        return self.fd

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)


def any_file(folder: str) -> bool:
    """Whether ``folder`` holds anything (one directory entry read)."""
    try:
        with os.scandir(folder) as it:
            return next(it, None) is not None
    except OSError:
        return False


def writer_gone(name: str) -> bool:
    """Whether the process that named temporary file ``name`` (``pid-host-thread-n``) has ended:
    a process of this host (and pid namespace) that no longer runs. Others' files go by age."""
    parts = name.split("-")
    if len(parts) < 4 or "-".join(parts[1:-2]) != HOST:
        return False
    try:
        os.kill(int(parts[0]), 0)
    except (ValueError, ProcessLookupError):
        return True
    except PermissionError:
        return False
    return False


def scan(directory: str) -> Tuple[int, List[Tuple[float, int, str]]]:
    """A directory's bytes on disk (files, folders, the lock) and its files that eviction may
    remove (objects, packs, free files) as ``(last use, bytes, path)``. Removes temporary files
    of writers that have ended or stalled."""
    tmp = os.path.join(directory, "tmp") + os.sep
    keep = (os.path.join(directory, "lock"), os.path.join(directory, "packs.counter"))
    total, objs = _native.local_walk(directory)
    out = []
    now = time.time()
    for p, mtime, size in objs:
        if p.startswith(tmp):
            if os.sep not in p[len(tmp) :] and (writer_gone(p[len(tmp) :]) or now - mtime > STALE_TMP_SECONDS):
                unlink(p)
                continue
        elif p not in keep:
            out.append((mtime, size, p))
        total += size
    return total, out


class Eviction:
    """Eviction in the store at ``directory`` (free files under ``free``) of ``capacity`` bytes.
    Each call runs under the directory's lock (every process's and thread's evictions one at a
    time); its result is the usage counter's new value."""

    def __init__(self, directory: str, free: str, capacity: int):
        self.directory, self.free, self.capacity = directory, free, capacity
        #: The objects of the last count not evicted yet, the least recently used last, and when
        #: it was made (``time.monotonic()``).
        self._listed: Optional[Tuple[float, List[Tuple[float, int, str]]]] = None

    def evict(self, used: int, nbytes: int, recycle: bool, packs_changed: Callable[[], None]) -> int:
        """Removes the least recently used objects (with ``recycle``, turns large ones into free
        files) until the directory and ``nbytes`` more fit in nine tenths of the capacity, free
        files aside; the counter's new value (``used``: its value now), ``nbytes`` counted.
        ``packs_changed`` is called where a pack went (every process drops its objects)."""
        listed = self._listed
        if recycle and listed is not None and used + nbytes <= self.capacity and time.monotonic() - listed[0] < LISTED_SECONDS:
            return self._from_listing(used, nbytes, listed[1], packs_changed)
        return self._counted_anew(used, nbytes, recycle, packs_changed)

    def _counted_anew(self, used: int, nbytes: int, recycle: bool, packs_changed: Callable[[], None]) -> int:
        # What is on disk decides what goes; the counter (which also holds the reservations of
        # writers whose files are not complete yet) loses what was removed.
        total, objs = scan(self.directory)
        base, goal = max(total, used), self.capacity * 9 // 10
        freed, kept, packs = 0, 0, False
        free = self.free + os.sep
        order = sorted((not p.startswith(free), m, s, p) for m, s, p in objs)
        at = 0
        for at, (is_object, _mtime, size, p) in enumerate(order):
            if base - freed - kept + nbytes <= goal:
                break
            if recycle and base - freed + nbytes <= self.capacity and size >= _native.LOCAL_RECYCLE_MIN and (not is_object or self.recycle(p)):
                kept += size  # a free file kept, or an object's file made one
            elif unlink(p):
                freed += size
                packs = packs or p.endswith(".pack")
        else:
            at = len(order)
        if packs:
            packs_changed()
        # The next evictions' objects, the least recently used last (popped first).
        self._listed = (time.monotonic(), [(m, s, p) for is_object, m, s, p in reversed(order[at:]) if is_object]) if recycle else None
        return base - freed + nbytes

    def _from_listing(self, used: int, nbytes: int, objs: List[Tuple[float, int, str]], packs_changed: Callable[[], None]) -> int:
        """:meth:`evict` from the last count's objects (``used + nbytes`` within the capacity):
        each checked unchanged since, its file turned into a free one (or removed); the free files
        there now counted as kept."""
        goal = self.capacity * 9 // 10
        kept = sum(size for _p, _m, size in _native.local_walk(self.free)[1])
        freed, packs = 0, False
        while used - freed - kept + nbytes > goal and objs:
            mtime, size, p = objs.pop()
            try:
                now = os.stat(p).st_mtime
            except OSError:
                continue  # gone meanwhile (another process's eviction, a removal)
            if abs(now - mtime) > 1e-6:
                continue  # used, or written again, since the count: not the least recently used
            if size >= _native.LOCAL_RECYCLE_MIN and self.recycle(p):
                kept += size
            elif unlink(p):
                freed += size
                packs = packs or p.endswith(".pack")
        if packs:
            packs_changed()
        if used - freed - kept + nbytes > goal:  # the count ran out: counted anew
            return self._counted_anew(used - freed, nbytes, True, packs_changed)
        return used - freed + nbytes

    def recycle(self, p: str) -> bool:
        """Moves evicted object file ``p`` to the free files, named by its size; False where it
        went meanwhile (or is a pack)."""
        if p.endswith(".pack"):
            return False
        try:
            size = os.stat(p).st_size
            if size < _native.LOCAL_RECYCLE_MIN:  # read without a lock: never written over
                return False
            with Folder(self.free) as free:
                os.rename(p, f"{size}-{uuid.uuid4().hex}", dst_dir_fd=free)
            return True
        except OSError:
            return False

    def drop_free(self, used: int, nbytes: int) -> int:
        """Removes free files (the oldest first, listing ``free/`` alone) until ``nbytes`` more
        fit in the capacity; the counter's new value."""
        try:
            with Folder(self.free) as free:
                files = []
                with os.scandir(free) as it:
                    for e in it:
                        try:  # one claimed meanwhile is passed by
                            files.append((e.stat(follow_symlinks=False).st_mtime, e.name))
                        except OSError:
                            continue
                for _mtime, name in sorted(files):
                    if used + nbytes <= self.capacity:
                        break
                    try:
                        size = os.lstat(name, dir_fd=free).st_blocks * 512
                        os.unlink(name, dir_fd=free)
                    except OSError:
                        continue
                    used -= size
        except OSError:
            pass
        return used
