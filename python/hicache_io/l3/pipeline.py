"""The one put pipeline and the one get pipeline of every L3 page call: v1 pages under any key
scheme, the unified scheme's shares and storage v2's pools, over any transport.

A batch is the page keys, their objects' keys (``per`` a page) and a placement
(:mod:`hicache_io.l3.placements`) that says where the objects' bytes lie. ``calls``
(:class:`StoreCalls`) is what the pipelines use of the calling store: its transport, where a
failure goes (kept and logged, raised with ``raise_errors``) and its integrity counts.

Put: ask which objects exist (where the placement asks first) → stage and checksum → drop the
objects of pages whose host bytes fail their recorded item checksums → seal the trailers → one
transport put → per page, whether every object is written (an existing object counts as
written). Get: one transport get (the other form for objects written the other way) → objects
read whole → land and checksum (settling the pool's item checksums) → verify the trailers → per
page, whether every object was read whole and, where checked, verified. A placement that
``seals`` (small checksummed objects staged with their trailers) writes the trailers in its
staging pass and checks them in its landing pass: the same steps, taken inside those calls.

A call of several batches runs them in order. Where they are large enough (:func:`overlaps`),
their checksum passes overlap the transport on the store's second thread (:class:`Overlap`):
a put stages and sums batch ``k + 1`` while batch ``k`` is sent, a get lands and sums batch ``k``
while batch ``k + 1`` is read. Each half that may run there (:func:`_ready`, :func:`_land`)
touches no count and reports nothing; the calling thread reports every failure, in the
batches' order, so ``last_error`` and the counts are those of one batch after the other.
"""

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .errors import DAMAGED, INTEGRITY, REFUSED, SHORT_READ, StorageError
from .placements import Placement
from .trailer import TRAILER_BYTES, counted, name_tags, seal, sealed_rows, verify
from .transport import Transport

logger = logging.getLogger(__name__)


#: A call's batches overlap (:class:`Overlap`) where its first holds at least this many bytes
#: of objects. Measured on Mooncake over loopback, 2 cores: batches of 8448-byte DSA pages (1 MiB)
#: were 2-8% slower overlapped, the hand-off costing more than it hid; batches of 32 KiB
#: head-group objects (4 MiB) got 1.06-1.26x faster gets and puts of 0.97-1.07x.
OVERLAP_MIN_BYTES = 2 << 20


def overlaps(batches: Sequence["Batch"]) -> bool:
    """Whether a call's batches are worth overlapping: more than one, large enough, and placed
    where a put need not ask the store first (that question would run on the other thread)."""
    if len(batches) < 2 or batches[0].place.asks_first:
        return False
    return int(np.sum(batches[0].place.sizes)) >= OVERLAP_MIN_BYTES


class StoreCalls(NamedTuple):
    """What a store lends its pipelines: its transport, where a failure goes, its counts."""

    io: Transport
    fail: Callable[[StorageError], None]
    stats: Dict[str, int]


def pages_ok(ok: np.ndarray, per: int) -> np.ndarray:
    """Per page: every one of its ``per`` objects ``ok``."""
    return ok.reshape(-1, per).all(axis=1) if len(ok) else np.zeros(0, bool)


class Batch(NamedTuple):
    """One batch of a call: its page keys, their objects' keys and where the objects lie."""

    keys: List[str]
    obj_keys: List[str]
    place: Placement


def put_pages(calls: StoreCalls, what: str, keys: List[str], obj_keys: List[str], place: Placement, config: Optional[Callable[[int], Any]] = None) -> List[bool]:
    """Writes the batch's objects (see the module docstring); one bool per page. ``config(n)``:
    the transport's put config for ``n`` objects, where the caller has one. A failure
    that escapes the pipeline (the store's, or a checksum pass) fails every page of the batch."""
    b = Batch(keys, obj_keys, place)
    return _send(calls, what, b, _ready(calls, b), config)


class Ready(NamedTuple):
    """What a put found before anything is sent: objects already stored (``ok``), the objects
    to write (``todo``), their checksums and the pages' item checks; or what stopped it."""

    ok: np.ndarray
    todo: np.ndarray
    sums: Optional[np.ndarray] = None
    intact: Optional[np.ndarray] = None
    error: Optional[Exception] = None


def _ready(calls: StoreCalls, b: Batch) -> Ready:
    """A put's first half: existence, staging and checksums (and, where the placement seals,
    the trailers). Touches no count and reports no failure (the caller's thread does, in
    :func:`_send`), so it may run on the overlap thread."""
    place = b.place
    ok, todo = np.zeros(len(b.obj_keys), bool), np.arange(len(b.obj_keys))
    try:
        place.sync()
        if place.asks_first:
            ok = calls.io.exists(b.obj_keys) == 1
            todo = np.flatnonzero(~ok)
        if not len(todo):
            return Ready(ok, todo)
        place.stage_out(todo)
        sums, intact = place.put_sums(b.obj_keys)
        return Ready(ok, todo, sums, intact)
    except Exception as e:  # noqa: BLE001 - reported by _send, in the caller's thread
        return Ready(ok, todo, error=e)


def _send(calls: StoreCalls, what: str, b: Batch, ready: Ready, config: Optional[Callable[[int], Any]] = None) -> List[bool]:
    """A put's second half: the objects of damaged pages dropped, trailers sealed (where the
    staging pass did not), one transport put, the verdicts."""
    keys, obj_keys, place = b
    ok, todo, sums = ready.ok.copy(), ready.todo, ready.sums
    try:
        if ready.error is not None:
            raise ready.error
        if len(todo) and ready.intact is not None:
            todo = _without_damaged(calls, keys, todo, place.per, ready.intact)
        if len(todo):
            trailer = place.writes_trailers
            picked = obj_keys if len(todo) == len(obj_keys) else [obj_keys[j] for j in todo]
            if trailer and not place.seals:
                seal(place.trailers, todo, np.asarray(sums)[todo], picked)
            rcs, call = calls.io.put(keys, picked, place.put_spans(todo, trailer), config(len(picked)) if config else None)
            ok[todo] = rcs == 0
            bad = np.flatnonzero(rcs != 0)
            if len(bad):
                calls.fail(StorageError(call, int(rcs[bad[0]]), [picked[j] for j in bad]))
    except StorageError as e:
        ok[:] = False
        calls.fail(e)
    except Exception as e:  # noqa: BLE001 - a checksum pass that failed: no page is written
        ok[:] = False
        calls.fail(StorageError(what, REFUSED, keys, detail=str(e)))
    return pages_ok(ok, place.per).tolist()


def _without_damaged(calls: StoreCalls, keys: List[str], todo: np.ndarray, per: int, intact: np.ndarray) -> np.ndarray:
    """``todo`` without the objects of pages whose host bytes no longer match the item checksums
    their backup recorded: a fault in host memory must not reach storage under a trailer of its
    own. Those pages read as not written."""
    keep = intact[todo // per]
    if keep.all():
        return todo
    damaged = sorted({int(j) // per for j in todo[~keep]})
    calls.stats["damaged_puts"] += len(damaged)
    logger.error("hicache-io L3: %d page(s) not put, their host bytes fail their checksums: %s", len(damaged), [keys[i] for i in damaged])
    return todo[keep]


def get_pages(calls: StoreCalls, what: str, keys: List[str], obj_keys: List[str], place: Placement) -> List[bool]:
    """Reads the batch's objects (see the module docstring); one bool per page. A page whose get
    fails may have been written in part; the pool's item checksums of every page not verified
    are forgotten, also when the get raises."""
    b = Batch(keys, obj_keys, place)
    try:
        f = _reported(calls, _fetch(calls, b))
        return _finish(calls, what, b, f, _land(b, f)).tolist()
    except BaseException:
        place.forget()
        raise


def _reported(calls: StoreCalls, f: "Fetched") -> "Fetched":
    """Reports a get's transport failures and damaged objects now; the same answers without them."""
    calls.stats["corrupt"] += f.damaged
    for e in f.errors:
        calls.fail(e)
    return f._replace(errors=[], damaged=0)


class Fetched(NamedTuple):
    """What a get's transport call answered: per object, read whole (``ok``), without a trailer
    (``unverified``) and the form it was read into; or the pages' verdicts where it failed."""

    ok: np.ndarray
    unverified: np.ndarray
    has_trailer: np.ndarray
    form: np.ndarray
    #: Its failures and the objects the transport found damaged, reported by the calling
    #: thread (:func:`_reported`) in the batches' order, whatever ran in between.
    errors: List[StorageError]
    damaged: int = 0
    failed: Optional[np.ndarray] = None


class Landed(NamedTuple):
    """The checksums of the bytes that landed, the objects' key tags and whether the pool's item
    checksums were settled in the same pass; where the landing checked the trailers itself (a
    placement that ``seals``), each object's verdict instead of the tags; or what stopped it."""

    sums: Optional[np.ndarray] = None
    tags: Optional[np.ndarray] = None
    settled: bool = False
    error: Optional[Exception] = None
    verdicts: Optional[np.ndarray] = None


def _fetch(calls: StoreCalls, b: Batch) -> Fetched:
    """A get's first half: one transport get (the other form for objects written the other
    way), the objects read whole."""
    obj_keys, place = b.obj_keys, b.place
    n, t = len(obj_keys), place.trailers
    if t is not None:
        t[:n] = 0
    place.sync()
    try:
        got, form, trailer, call = calls.io.get(b.keys, obj_keys, place.get_forms())
    except StorageError as e:
        place.forget()
        nothing = np.zeros(n, bool)
        return Fetched(nothing, nothing, nothing, np.zeros(n, np.int8), [e], failed=np.zeros(len(b.keys), bool))
    # Read whole: the object's own bytes, or those and the trailer where the form has one.
    sizes = place.sizes
    has_trailer = trailer & (got == sizes + TRAILER_BYTES)
    ok = (got == sizes) | has_trailer
    errors, damaged = [], 0
    if not ok.all():
        bad = np.flatnonzero(~ok)
        first = int(got[bad[0]])
        # Found damaged by the transport (the local store's CRC): a miss, counted as a trailer
        # mismatch is.
        damaged = int(np.count_nonzero(got == DAMAGED))
        errors.append(StorageError(call, first if first < 0 else SHORT_READ, [obj_keys[j] for j in bad]))
    return Fetched(ok, ~has_trailer, has_trailer, form, errors, damaged)


def _land(b: Batch, f: Fetched) -> Landed:
    """A get's checksum pass: the bytes that landed summed (and, where the placement does it in
    the same pass, copied into the pool and its item checksums settled; where it seals, each
    object's verdict from its trailer taken there too). Touches no count and
    reports no failure, so it may run on the overlap thread."""
    place, n = b.place, len(b.obj_keys)
    if f.failed is not None or not place.verifies:
        return Landed()
    try:
        # Objects read whole into the placement's own form (the other form lands in place).
        written = f.ok & (f.form == 0)
        if place.seals:
            sums, verdicts = place.land_sealed(b.obj_keys, f.ok, f.has_trailer, written)
            return Landed(sums, settled=True, verdicts=verdicts)
        t = place.trailers
        tags = name_tags(b.obj_keys)
        eligible = f.ok & f.has_trailer & sealed_rows(t[:n])
        sums, settled = place.land(t[:n, 1] ^ tags, eligible, written)
        return Landed(sums, tags, settled)
    except Exception as e:  # noqa: BLE001 - reported by _finish, in the caller's thread
        return Landed(error=e)


def _finish(calls: StoreCalls, what: str, b: Batch, f: Fetched, landed: Landed) -> np.ndarray:
    """A get's second half: the trailers verified (or the landing's verdicts counted), the pages'
    verdicts, the pool's item checksums settled where the checksum pass did not."""
    keys, obj_keys, place = b
    f = _reported(calls, f)
    if f.failed is not None:
        return f.failed
    ok, unverified = f.ok.copy(), f.unverified.copy()
    if place.verifies:
        try:
            if landed.error is not None:
                raise landed.error
            if landed.verdicts is not None:
                corrupt = counted(landed.verdicts, ok, unverified, calls.stats)
            else:
                corrupt = verify(place.trailers, landed.sums, landed.tags, ok, unverified, calls.stats)
            if corrupt.any():
                calls.fail(StorageError(what, INTEGRITY, [obj_keys[j] for j in np.flatnonzero(corrupt)]))
        except StorageError:
            raise
        except Exception as e:  # noqa: BLE001 - a checksum pass that failed: trust no page
            calls.fail(StorageError(what, INTEGRITY, keys, detail=f"could not verify: {e}"))
            place.forget()
            return np.zeros(len(keys), bool)
    pages = pages_ok(ok, place.per)
    trusted = pages & pages_ok(~unverified, place.per) & place.verifies
    if not landed.settled:
        place.settle(pages, trusted)
    return pages


def put_batches(calls: StoreCalls, what: str, batches: Sequence[Batch], overlap: Optional["Overlap"]) -> List[bool]:
    """:func:`put_pages` of each batch, in order; with ``overlap``, each batch is staged and
    summed on its thread while the batch before it is sent (the batches' placements must use
    buffers of their own, two in turn)."""
    if overlap is None or len(batches) < 2:
        return [v for b in batches for v in put_pages(calls, what, *b)]
    out: List[bool] = []
    pending: Optional[Future] = overlap.submit(_ready, calls, batches[0])
    try:
        for k, b in enumerate(batches):
            ready = pending.result()
            pending = overlap.submit(_ready, calls, batches[k + 1]) if k + 1 < len(batches) else None
            out += _send(calls, what, b, ready)
    finally:
        if pending is not None:
            wait([pending])  # no staging pass outlives the call
    return out


def get_batches(calls: StoreCalls, what: str, batches: Sequence[Batch], overlap: Optional["Overlap"]) -> List[bool]:
    """:func:`get_pages` of each batch, in order; with ``overlap``, each batch is landed and
    summed on its thread while the transport reads the next (the batches' placements must use
    buffers of their own, two in turn, and pages of their own). Failures are reported in the
    batches' order; when the call raises, the item checksums of every page it may have written
    and not answered are forgotten."""
    if overlap is None or len(batches) < 2:
        return [v for b in batches for v in get_pages(calls, what, *b)]
    out: List[bool] = []
    landing: Optional[Tuple[Batch, Fetched, Future]] = None
    answered = started = 0

    def answer() -> None:
        nonlocal answered
        b, f, landed = landing  # type: ignore[misc]
        out.extend(_finish(calls, what, b, f, landed.result()).tolist())
        answered += 1

    try:
        for b in batches:
            started += 1
            try:
                f = _fetch(calls, b)
            except BaseException:
                if landing is not None and answered < started - 1:
                    answer()  # the batch before is reported first, as one after the other
                raise
            if landing is not None:
                answer()
            landing = (b, f, overlap.submit(_land, b, f))
        answer()
        return out
    except BaseException:
        if landing is not None:
            wait([landing[2]])  # no checksum pass outlives the call
        for b in batches[answered:started]:
            b.place.forget()
        raise


class Overlap:
    """A store's second thread, started on first use (and again in a forked child, where the
    parent's threads do not run): a batch's staging or checksum pass runs there while the
    calling thread waits on the transport for the batch beside it. Both passes release the GIL
    (native code)."""

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pid = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """``fn(*args)`` on the thread; run here, done, where no thread can start any more (the
        interpreter shutting down)."""
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool, self._pid = ThreadPoolExecutor(1, thread_name_prefix="hicache-io-l3"), os.getpid()
            try:
                return self._pool.submit(fn, *args)
            except RuntimeError:
                pass
        done: Future = Future()
        done.set_result(fn(*args))
        return done

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True)


def counted_exists(calls: StoreCalls, obj_keys: Sequence[str], per: int) -> Optional[int]:
    """The number of leading pages whose objects all exist; a store error on the way is kept
    (``calls.fail``) and ends the count there."""
    res = calls.io.exists(obj_keys)
    missing = np.flatnonzero(res != 1)
    if not len(missing):
        return len(obj_keys) // per
    j = int(missing[0])
    if res[j] < 0:
        calls.fail(StorageError("batch_is_exist", int(res[j]), [obj_keys[j]]))
    return j // per
