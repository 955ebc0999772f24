"""The one place that calls an L3 client: Mooncake Store's ``MooncakeDistributedStore``, or the
local store's :class:`hicache_io.l3.local.LocalDiskClient`, which answers the same calls with the
same codes.

:class:`Transport` owns every client call the stores make: registration, the batch puts and gets
(one span an object, or several), existence, the plain single-object forms. It checks that a batch
call answered once per object (else :class:`StorageError` ``REFUSED``, naming the counts) and owns
the retry rule: an object stored in the other form (with or without its 16-byte trailer) is
refused by a get whose buffers add up to another size (``-600`` for one span, ``-800`` for several),
and is read again in the other form.

It also keeps the store's :class:`Health` from the answers: objects that failed because the
master could not be reached (``RPC_FAIL``), outages (from the first call that could not reach it
to the next that could; the start and the end are logged as warnings), and objects that failed
with an I/O error of the local disk (``-errno``).
"""

import logging
import threading
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .batches import exist_once
from .errors import REFUSED, SHORT_READ, StorageError, is_io_errno
from .mooncake_client import register_all

logger = logging.getLogger(__name__)

#: What Mooncake answers for an object whose call could not reach the master.
UNREACHABLE = -900

#: What a get answers when the object has another total size than its buffers: one span, several.
OTHER_SIZE = {False: -600, True: -800}


class Spans(NamedTuple):
    """Where a batch's objects lie: per object an address and a size (``multi`` false), or lists
    of them (``multi`` true); ``trailer``: whether the spans end in the object's 16-byte trailer."""

    ptrs: List[Any]
    sizes: List[Any]
    multi: bool
    trailer: bool

    def pick(self, js: Sequence[int]) -> "Spans":
        return Spans([self.ptrs[j] for j in js], [self.sizes[j] for j in js], self.multi, self.trailer)


class Health:
    """What a store's answers said of the store itself, across calls and threads: ``counts``
    (``unreachable``: object answers that failed because the master could not be reached;
    ``outages``: times it became unreachable; ``io_errors``: object answers that failed with an
    I/O error of the local store's disk, a full disk or a failing read) and, during an outage,
    since when (``down_since``). ``local``: the store is the local store (its negative answers
    other than its own codes are errno values)."""

    def __init__(self, name: str, local: bool = False):
        self.name, self.local = name, local
        self.counts: Dict[str, int] = {"unreachable": 0, "outages": 0, "io_errors": 0}
        self.down_since: Optional[float] = None
        self._back_at = float("-inf")
        self._lock = threading.Lock()

    def heard(self, answers: np.ndarray, started: float) -> None:
        """Takes the answers (one per object: bytes, ``0``/``1`` or a code) of a call that
        started at ``started`` (``time.monotonic()``). A call that started before the store
        answered again may still fail for the outage it began in: it counts, but opens none."""
        if not len(answers):
            return
        down = int(np.count_nonzero(answers == UNREACHABLE))
        io = sum(is_io_errno(int(c)) for c in answers[answers < 0]) if self.local else 0
        said = None
        with self._lock:
            self.counts["unreachable"] += down
            self.counts["io_errors"] += io
            if down and self.down_since is None and started >= self._back_at:
                self.down_since = time.monotonic()
                self.counts["outages"] += 1
                said = f"hicache-io L3: {self.name} is unreachable: its gets are misses and its puts fail until it answers again"
            elif not down and self.down_since is not None:
                self._back_at = time.monotonic()
                said = f"hicache-io L3: {self.name} answers again, after {self._back_at - self.down_since:.1f} s"
                self.down_since = None
        if said:
            logger.warning("%s", said)


class Transport:
    """An L3 client's calls, checked (see the module docstring); ``health`` keeps what their
    answers say of the store (a new one when not given)."""

    def __init__(self, client: Any, health: Optional[Health] = None):
        self.client = client
        self.health = health if health is not None else Health("the store")

    # ---- memory --------------------------------------------------------------------------

    def register(self, regions: Sequence[Any]) -> List[int]:
        """Registers every ``(address, bytes)`` region, or none (raises); the addresses registered."""
        return register_all(self.client, regions)

    def unregister(self, addrs: Sequence[int]) -> None:
        for addr in addrs:
            self.client.unregister_buffer(addr)

    # ---- page objects --------------------------------------------------------------------

    def put(self, page_keys: Sequence[str], obj_keys: List[str], spans: Spans, config: Any = None) -> Tuple[np.ndarray, str]:
        """Writes each object from its spans; Mooncake's return code per object (0: written, or
        kept as it was) and the call's name."""
        if not obj_keys:
            return np.zeros(0, np.int64), "batch_put_from"
        what = "batch_put_from_multi_buffers" if spans.multi else "batch_put_from"
        call = getattr(self.client, what)
        args = (obj_keys, spans.ptrs, spans.sizes)
        started = time.monotonic()
        rcs = call(*args, config) if config is not None else call(*args)
        return self._counted(what, page_keys, rcs, len(obj_keys), started), what

    def get(self, page_keys: Sequence[str], obj_keys: List[str], forms: Sequence[Any]) -> Tuple[np.ndarray, np.ndarray, np.ndarray, str]:
        """Reads each object into ``forms[0]`` (:class:`Spans`); an object refused there for its
        size is read into ``forms[1]()`` (a function giving the other form) where there is one.
        Per object: the bytes read (or a negative code), the form it was read into and whether
        that form ends in a trailer; and the name of the first call."""
        first = forms[0]
        what = "batch_get_into_multi_buffers" if first.multi else "batch_get_into"
        got = self._get(what, page_keys, obj_keys, first)
        form = np.zeros(len(obj_keys), np.int8)
        trailer = np.full(len(obj_keys), first.trailer)
        if len(forms) > 1:
            retry = np.flatnonzero(got == OTHER_SIZE[first.multi])
            if len(retry):
                other = forms[1]()
                again_what = "batch_get_into_multi_buffers" if other.multi else "batch_get_into"
                got[retry] = self._get(again_what, page_keys, [obj_keys[j] for j in retry], other.pick(retry))
                form[retry], trailer[retry] = 1, other.trailer
        return got, form, trailer, what

    def _get(self, what: str, page_keys: Sequence[str], obj_keys: List[str], spans: Spans) -> np.ndarray:
        if not obj_keys:
            return np.zeros(0, np.int64)
        started = time.monotonic()
        return self._counted(what, page_keys, getattr(self.client, what)(obj_keys, spans.ptrs, spans.sizes), len(obj_keys), started)

    def exists(self, obj_keys: Sequence[str]) -> np.ndarray:
        """Per object: 1 stored, 0 not, a negative code (``-1`` for every object when the store
        answered another number of objects); each distinct key asked once."""
        started = time.monotonic()
        found = np.asarray(exist_once(obj_keys, self.client.batch_is_exist), dtype=np.int64)
        self.health.heard(found, started)
        return found

    def _counted(self, what: str, page_keys: Sequence[str], answers: Sequence[int], n: int, started: float) -> np.ndarray:
        if len(answers) != n:
            raise StorageError(what, REFUSED, page_keys, detail=f"{len(answers)} answers for {n} objects")
        out = np.asarray(answers, dtype=np.int64)
        self.health.heard(out, started)
        return out

    # ---- single objects by raw key (sglang's plain get / set / exists) -------------------

    def exists_one(self, key: str) -> bool:
        return self.client.is_exist(key) == 1

    def get_object(self, key: str, target_location: Optional[int], target_sizes: Optional[int]) -> Tuple[Any, Optional[StorageError]]:
        """Object ``key`` into ``target_location`` (``target_sizes`` bytes of registered memory:
        whether it was read whole), or as a ``numpy.uint8`` array (``None`` when missing); and
        the failure, if any."""
        if target_location is None:
            data = self.client.get(key)
            return (np.frombuffer(data, np.uint8).copy() if data else None), None
        started = time.monotonic()
        n = self.client.batch_get_into([key], [target_location], [target_sizes])[0]
        self.health.heard(np.array([n], np.int64), started)
        if n != target_sizes:
            return False, StorageError("get", n if n < 0 else SHORT_READ, [key])
        return True, None

    def set_object(self, key: str, value: Any, target_location: Optional[int], target_sizes: Optional[int]) -> Optional[StorageError]:
        """Writes object ``key`` from ``value`` (bytes or a host array) or from ``target_sizes``
        bytes at ``target_location`` unless it exists (an existing object is kept); the
        failure, if any."""
        started = time.monotonic()
        if self.client.is_exist(key) == 1:
            return None
        if value is not None:
            data = bytes(value) if isinstance(value, (bytes, bytearray)) else np.ascontiguousarray(value).view(np.uint8).tobytes()
            rc = self.client.put(key, data)
        else:
            rc = self.client.batch_put_from([key], [target_location], [target_sizes])[0]
        self.health.heard(np.array([rc], np.int64), started)
        return StorageError("put", rc, [key]) if rc != 0 else None


def open_transport(store: str, options: Dict[str, Any], *, threads: int = 4, writes: str = "cached", reads: str = "auto", storage_config: Any = None) -> Transport:
    """A :class:`Transport` on a new client: ``store="local"`` (a :class:`LocalDiskClient`;
    ``options``: ``path``, ``capacity_bytes`` (a number, or a size such as ``"200gb"``), ``fsync``, and ``writes`` / ``reads`` overriding
    the defaults given; another option raises ``TypeError``) or ``"mooncake"`` (``options``: a
    ``MooncakeStoreConfig``'s fields; others are kept as its extra settings)."""
    options = dict(options)
    if store == "local":
        from .config import size_of
        from .errors import LOCAL_STORE
        from .local import LocalDiskClient

        known = {"path", "capacity_bytes", "fsync", "writes", "reads"}
        if set(options) - known:
            raise TypeError(f"unknown options for the local store: {sorted(set(options) - known)}")
        capacity = options.get("capacity_bytes")
        client = LocalDiskClient(options.get("path"), capacity_bytes=None if capacity is None else size_of(capacity), threads=threads, fsync=bool(options.get("fsync", False)), writes=options.get("writes", writes), reads=options.get("reads", reads))
        return Transport(client, Health(LOCAL_STORE, local=True))
    if store == "mooncake":
        from .config import MooncakeStoreConfig
        from .errors import MOONCAKE_STORE
        from .mooncake_client import open_client

        return Transport(open_client(MooncakeStoreConfig.from_dict(options), storage_config), Health(MOONCAKE_STORE))
    raise ValueError(f"store must be 'local' or 'mooncake', got {store!r}")
