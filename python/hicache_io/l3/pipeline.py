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
page, whether every object was read whole and, where checked, verified.
"""

import logging
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from .errors import DAMAGED, INTEGRITY, REFUSED, SHORT_READ, StorageError
from .placements import Placement
from .trailer import TRAILER_BYTES, name_tags, seal, sealed_rows, verify
from .transport import Transport

logger = logging.getLogger(__name__)


class StoreCalls(NamedTuple):
    """What a store lends its pipelines: its transport, where a failure goes, its counts."""

    io: Transport
    fail: Callable[[StorageError], None]
    stats: Dict[str, int]


def pages_ok(ok: np.ndarray, per: int) -> np.ndarray:
    """Per page: every one of its ``per`` objects ``ok``."""
    return ok.reshape(-1, per).all(axis=1) if len(ok) else np.zeros(0, bool)


def put_pages(calls: StoreCalls, what: str, keys: List[str], obj_keys: List[str], place: Placement, config: Optional[Callable[[int], Any]] = None) -> List[bool]:
    """Writes the batch's objects (see the module docstring); one bool per page. ``config(n)``:
    the transport's put config for ``n`` objects, where the caller has one. A failure
    that escapes the pipeline (the store's, or a checksum pass) fails every page of the batch."""
    ok = np.zeros(len(obj_keys), bool)
    try:
        place.sync()
        todo = np.arange(len(obj_keys))
        if place.asks_first:
            ok = calls.io.exists(obj_keys) == 1
            todo = np.flatnonzero(~ok)
        if len(todo):
            place.stage_out(todo)
            sums, intact = place.put_sums()
            if intact is not None:
                todo = _without_damaged(calls, keys, todo, place.per, intact)
        if len(todo):
            trailer = place.writes_trailers
            picked = obj_keys if len(todo) == len(obj_keys) else [obj_keys[j] for j in todo]
            if trailer:
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
    try:
        return _get(calls, what, keys, obj_keys, place).tolist()
    except BaseException:
        place.forget()
        raise


def _get(calls: StoreCalls, what: str, keys: List[str], obj_keys: List[str], place: Placement) -> np.ndarray:
    n, t = len(obj_keys), place.trailers
    if t is not None:
        t[:n] = 0
    place.sync()
    try:
        got, form, trailer, call = calls.io.get(keys, obj_keys, place.get_forms())
    except StorageError as e:
        calls.fail(e)
        place.forget()
        return np.zeros(len(keys), bool)
    # Read whole: the object's own bytes, or those and the trailer where the form has one.
    sizes = place.sizes
    has_trailer = trailer & (got == sizes + TRAILER_BYTES)
    ok = (got == sizes) | has_trailer
    if not ok.all():
        bad = np.flatnonzero(~ok)
        first = int(got[bad[0]])
        # Found damaged by the transport (the local store's CRC): a miss, counted as a trailer
        # mismatch is.
        calls.stats["corrupt"] += int(np.count_nonzero(got == DAMAGED))
        calls.fail(StorageError(call, first if first < 0 else SHORT_READ, [obj_keys[j] for j in bad]))
    unverified = ~has_trailer
    settled = False
    if place.verifies:
        try:
            tags = name_tags(obj_keys)
            expected = t[:n, 1] ^ tags
            eligible = ok & has_trailer & sealed_rows(t[:n])
            sums, settled = place.land(expected, eligible, ok & (form == 0))
            corrupt = verify(t, sums, tags, ok, unverified, calls.stats)
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
    if not settled:
        place.settle(pages, trusted)
    return pages


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
