"""Where the objects of one batch of pages lie, and how their checksums are taken: the part of
the put and get pipelines (:mod:`hicache_io.l3.pipeline`) that differs between pools.

A placement is built for one batch (page ``i`` starts at host index ``idx[i * P]``, ``per``
objects a page, object ``j`` of the batch is object ``j % per`` of page ``j // per``). It gives:

* ``sizes``: each object's bytes without its trailer; ``trailers``: the ``[n][2]`` u64 rows the
  trailers are sealed into and read into (row ``j`` for object ``j``), ``None`` where the objects
  carry none (sglang-named objects);
* ``writes_trailers`` / ``verifies``: whether puts seal a trailer and gets check it;
  ``asks_first``: whether a put asks which objects exist before it stages or sums;
* ``put_spans(todo, trailer)`` and ``get_forms()`` (the form this store writes first, then a
  function giving the other, for objects written the other way);
* ``put_sums(obj_keys)``: the objects' checksums where trailers are written, and per page whether
  its host bytes still match the item checksums their backup recorded (``None``: not checked);
  ``seals``: whether that call also wrote each object's trailer (bound to its key in
  ``obj_keys``), so the put seals none itself;
* ``land(expected, eligible, written)``: after a get, the checksums of the bytes that landed, and
  whether the pool's item checksums were settled in the same pass; ``settle(pages, trusted)``
  otherwise (recorded for trusted pages, forgotten for the others; staged bytes copied in). A
  placement that ``seals`` lands with ``land_sealed(obj_keys, whole, with_trailer, written)``
  instead: the checksums and each object's verdict from its trailer, in one native call.

The kinds: :class:`PoolPages` (a host pool's page objects in place: hicache-io's and sglang's),
:class:`StagedPages` (through a staging buffer: pools in executor buffers), :class:`SealedPages`
(small checksummed objects of either, each with its trailer as one span of a staging buffer),
:class:`SharePages` (the unified key scheme's page shares) and :class:`SidecarPages` (storage
v2's pools).
"""

import ctypes
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .config import STORAGE_BATCH_SIZE
from .trailer import TRAILER_BYTES
from .transport import Spans

Sums = Tuple[Optional[np.ndarray], Optional[np.ndarray]]

#: Checksummed objects up to this size move through a staging buffer with their trailer as one
#: span (Mooncake's single-buffer calls; its two-buffer calls cost a quarter or more of the
#: throughput at page sizes): the copy costs a tenth of an 8448-byte object's round trip.
SEALED_MAX_OBJECT = 64 << 10
#: The sealed objects' staging buffer holds at most this many bytes: pages whose objects would
#: not fit 128 to a batch move in batches of as many as fit. Measured here on 2,048 objects of
#: 32 KiB: the store's own time is the same for 4 to 16 MiB and higher for 2 MiB (more batches),
#: and Mooncake's throughput is the same for 128 to 1,024 objects a call.
SEALED_MAX_BYTES = 4 << 20


def sealing(obj_bytes: int, per: int) -> Optional[Tuple[np.ndarray, np.ndarray, int, int]]:
    """The staging buffer for checksummed objects of ``obj_bytes`` bytes, ``per`` a page, each
    with its trailer as one span: ``(buffer, its trailers as [n][2] u64 rows, stride, pages a
    batch)``; ``None`` where they are too large to stage."""
    stride = -(-(obj_bytes + TRAILER_BYTES) // 64) * 64
    fit = min(STORAGE_BATCH_SIZE, SEALED_MAX_BYTES // (max(1, per) * stride))
    if obj_bytes > SEALED_MAX_OBJECT or fit < 1:
        return None
    sealed = np.zeros(fit * per * stride, np.uint8)
    return sealed, sealed.reshape(-1, stride)[:, obj_bytes : obj_bytes + TRAILER_BYTES].view("<u8"), stride, fit


def _u64(values: Any) -> np.ndarray:
    return np.asarray(values, dtype="<u8")


class Placement:
    """The shared part (see the module docstring)."""

    per = 1
    asks_first = False
    trailers: Optional[np.ndarray] = None
    writes_trailers = False
    verifies = False
    seals = False

    def __init__(self, idx: Any, page: int, n_pages: int):
        self.idx, self.page, self.n_pages = idx, page, n_pages

    @property
    def n(self) -> int:
        return self.n_pages * self.per

    def firsts(self) -> List[int]:
        return [int(self.idx[i * self.page]) for i in range(self.n_pages)]

    def sync(self) -> None:
        pass

    def stage_out(self, todo: np.ndarray) -> None:
        pass

    def put_sums(self, obj_keys: Sequence[str]) -> Sums:
        return None, None

    def land(self, expected: np.ndarray, eligible: np.ndarray, written: np.ndarray) -> Tuple[Optional[np.ndarray], bool]:
        return None, False

    def settle(self, pages: np.ndarray, trusted: np.ndarray) -> None:
        pass

    def forget(self) -> None:
        """After a get that failed as a whole: every page it may have written is untrusted."""
        none = np.zeros(self.n_pages, bool)
        self.settle(none, none)

    def _trailer_addrs(self, js: Sequence[int]) -> List[int]:
        tb = self.trailers.ctypes.data
        return [tb + TRAILER_BYTES * int(j) for j in js]


class PoolPages(Placement):
    """A host pool's page objects in place (``lay``: a ``PoolLayout`` or ``SglangLayout``, one
    span per object); trailers in ``trailers`` where the objects carry them."""

    def __init__(self, lay: Any, idx: Any, n_pages: int, trailers: Optional[np.ndarray], integrity: bool, shares: Any = None, per: Optional[int] = None):
        super().__init__(idx, lay.page, n_pages)
        # ``shares``: the objects are these shares of each page (the native sums' ``shares``).
        self.lay, self.pool, self.shares, self.per = lay, lay.pool, shares, per if per is not None else lay.comps
        self.sizes = np.full(self.n, lay.obj_bytes, np.int64)
        self.trailers = trailers
        self.writes_trailers = self.verifies = trailers is not None and integrity
        # Pages whose host bytes no longer match their item checksums are not put (a fault in
        # host memory must not reach storage under a trailer of its own).
        self.check = integrity and bool(getattr(self.pool, "integrity", False))
        self._ptrs: Optional[List[int]] = None

    def sync(self) -> None:
        self.lay.synchronize()

    def ptrs(self) -> List[int]:
        if self._ptrs is None:
            self._ptrs = self.lay.addrs(self.idx)
        return self._ptrs

    def put_sums(self, obj_keys: Sequence[str]) -> Sums:
        sums = intact = None
        if self.check:
            if self.writes_trailers and hasattr(self.pool, "put_object_sums"):
                # The objects' checksums and the pages' item checks in one read of the pages.
                sums, intact = self.pool.put_object_sums(self.idx, self.shares)
            else:
                intact = self.pool.pages_intact(self.idx)
        if self.writes_trailers and sums is None:
            sums = self._sums()
        return (None if sums is None else _u64(sums)), (None if intact is None else np.asarray(intact, bool))

    def _sums(self) -> Any:
        return self.pool.object_sums(self.idx, self.shares)

    def put_spans(self, todo: np.ndarray, trailer: bool) -> Spans:
        ptrs, size = self.ptrs(), int(self.sizes[0]) if self.n else 0
        if trailer:
            return Spans([[ptrs[j], t] for j, t in zip(todo, self._trailer_addrs(todo))], [[size, TRAILER_BYTES]] * len(todo), True, True)
        return Spans(ptrs if len(todo) == len(ptrs) else [ptrs[j] for j in todo], [size] * len(todo), False, False)

    def get_forms(self) -> List[Spans]:
        everything = np.arange(self.n)
        plain = self.put_spans(everything, False)
        if self.trailers is None:
            return [plain]
        with_sum = lambda: self.put_spans(everything, True)  # noqa: E731
        return [with_sum(), lambda: plain] if self.verifies else [plain, with_sum]

    def land(self, expected: np.ndarray, eligible: np.ndarray, written: np.ndarray) -> Tuple[Optional[np.ndarray], bool]:
        if self.lay.zero_copy and hasattr(self.lay, "landed") and hasattr(self.pool, "landed_object_sums"):
            # The objects' checksums and the pool's item checksums of the pages that landed, in
            # one read: a page whose objects were all read whole with this format's trailer and
            # match it is recorded, every other page forgotten.
            return _u64(self.pool.landed_object_sums(self.idx, expected.tolist(), eligible.tolist(), self.shares)), True
        return _u64(self._sums()), False

    def settle(self, pages: np.ndarray, trusted: np.ndarray) -> None:
        if hasattr(self.lay, "landed"):
            self.lay.landed(self.idx, (pages & trusted).tolist())


class StagedPages(PoolPages):
    """A hicache-io pool whose pages have no host address (wgpu): object ``j`` passes through
    ``staging`` at byte ``j`` × the object's bytes, copied out before a put and in after a get."""

    asks_first = True  # the existence query saves the staging copy of pages already stored

    def __init__(self, lay: Any, idx: Any, n_pages: int, trailers: Optional[np.ndarray], integrity: bool, staging: np.ndarray):
        super().__init__(lay, idx, n_pages, trailers, integrity)
        self.staging = staging
        base, size = staging.ctypes.data, lay.obj_bytes
        self._ptrs = [base + j * size for j in range(self.n)]

    def stage_out(self, todo: np.ndarray) -> None:
        self.lay.stage_out(self.staging, sorted({int(j) // self.per for j in todo}), self.idx)

    def put_sums(self, obj_keys: Sequence[str]) -> Sums:
        intact = np.asarray(self.pool.pages_intact(self.idx), bool) if self.check else None
        return (self._sums() if self.writes_trailers else None), intact

    def _sums(self) -> np.ndarray:
        from .. import _native

        n = self.lay.obj_bytes
        return _u64([_native.checksum(self.staging[j * n : (j + 1) * n]) for j in range(self.n)])

    def land(self, expected: np.ndarray, eligible: np.ndarray, written: np.ndarray) -> Tuple[Optional[np.ndarray], bool]:
        return self._sums(), False

    def settle(self, pages: np.ndarray, trusted: np.ndarray) -> None:
        self.lay.stage_in(self.staging, pages.tolist(), self.idx, trusted.tolist())


class SealedPages(Placement):
    """Small checksummed objects of a hicache-io pool in this process's memory, each with its
    trailer as one span of a staging buffer (Mooncake's single-buffer calls; its multi-buffer
    calls cost a quarter or more of the throughput at page sizes): object ``j`` and its trailer
    at byte ``j × stride`` of ``sealed`` (the trailers viewed as ``seal_t``; :func:`sealing`).
    ``inner``: the in-place placement of the same batch (:class:`PoolPages`, or
    :class:`SharePages` of objects of one size), whose objects these are; objects stored without
    a trailer are read through it. ``whole``: the spans of whole batches in ``sealed`` by their
    objects' count, kept by the registration. One read of the pages stages and checksums them for
    a put (gathering a share's spans); one pass copies the objects read whole into the pool
    (scattering them), checksums them and settles the pool's item checksums after a get."""

    writes_trailers = verifies = seals = True

    def __init__(self, inner: PoolPages, sealed: np.ndarray, seal_t: np.ndarray, stride: int, whole: Dict[int, Spans]):
        super().__init__(inner.idx, inner.page, inner.n_pages)
        self.inner, self.pool, self.shares, self.per, self.sizes = inner, inner.pool, inner.shares, inner.per, inner.sizes
        self.sealed, self.trailers, self.stride = sealed, seal_t, stride
        self.check = bool(getattr(self.pool, "integrity", False))
        # The spans of a whole batch by its objects' count, shared by the batches of one buffer
        # (their objects are all of one size): two lists a batch a direction, made once.
        self.whole = whole
        # Where each object's trailer lies in its slot: after the object (all of one size).
        self.at = int(self.sizes[0]) if len(self.sizes) else 0

    def sync(self) -> None:
        self.inner.sync()

    def put_sums(self, obj_keys: Sequence[str]) -> Sums:
        S = self.sealed
        sums, intact = self.pool._stage_put(self.idx, S.ctypes.data, S.nbytes, self.stride, self.shares, seal=(self.at, list(obj_keys)))
        return sums, (np.asarray(intact, bool) if self.check else None)

    def put_spans(self, todo: np.ndarray, trailer: bool) -> Spans:
        whole = len(todo) == self.n
        spans = self.whole.get(self.n) if whole else None
        if spans is None:
            at = self.sealed.ctypes.data + self.stride * np.asarray(todo, dtype=np.int64)
            # Tuples: shared by every batch of this size, so no client may change them.
            spans = Spans(tuple(at.tolist()), tuple((self.sizes[todo] + TRAILER_BYTES).tolist()), False, True)
            if whole:
                self.whole[self.n] = spans
        return spans

    def get_forms(self) -> List[Spans]:
        # Objects stored without a trailer (by a store with checksums off) land in the staging
        # buffer whole too, with their own size; were Mooncake to refuse a buffer of another
        # size, they are read into the pool in place (unverified).
        everything = np.arange(self.n)
        return [self.put_spans(everything, True), lambda: self.inner.put_spans(everything, False)]

    def land(self, expected: np.ndarray, eligible: np.ndarray, written: np.ndarray) -> Tuple[Optional[np.ndarray], bool]:
        raise TypeError("sealed objects land with land_sealed (their trailers are checked in the landing)")

    def land_sealed(self, obj_keys: Sequence[str], whole: np.ndarray, with_trailer: np.ndarray, written: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        S = self.sealed
        return self.pool._land_sealed(self.idx, S.ctypes.data, S.nbytes, self.stride, self.at, list(obj_keys), whole.tolist(), with_trailer.tolist(), written.tolist(), self.shares)

    def settle(self, pages: np.ndarray, trusted: np.ndarray) -> None:
        self.inner.settle(pages, trusted)


class SharePages(PoolPages):
    """The unified key scheme's objects (``grid``: a ``UnifiedGrid``): each a share of a page,
    several spans of the pool's memory, moved in place with the multi-buffer calls; summed and
    settled as :class:`PoolPages` are, per share."""

    def __init__(self, lay: Any, grid: Any, idx: Any, n_pages: int, trailers: np.ndarray, integrity: bool):
        super().__init__(lay, idx, n_pages, trailers, integrity, shares=grid.shares, per=len(grid.suffixes))
        self.grid = grid
        self.sizes = np.asarray([grid.object_bytes[j % self.per] for j in range(self.n)], np.int64)
        self._bufs: Optional[Tuple[List[List[int]], List[List[int]]]] = None

    def bufs(self) -> Tuple[List[List[int]], List[List[int]]]:
        if self._bufs is None:
            self._bufs = self.grid.buffers([f // self.page for f in self.firsts()])
        return self._bufs

    def put_spans(self, todo: np.ndarray, trailer: bool) -> Spans:
        ptrs, sizes = self.bufs()
        if trailer:
            return Spans([ptrs[j] + [t] for j, t in zip(todo, self._trailer_addrs(todo))], [sizes[j] + [TRAILER_BYTES] for j in todo], True, True)
        return Spans([ptrs[j] for j in todo], [sizes[j] for j in todo], True, False)


class SidecarPages(Placement):
    """A storage-v2 pool's page objects in place (``side``: a registered sidecar pool); every
    object carries a trailer, whatever the store's ``integrity``."""

    asks_first = True
    writes_trailers = verifies = True

    def __init__(self, side: Any, idx: List[int], n_pages: int, trailers: np.ndarray):
        super().__init__(idx, side.page, n_pages)
        self.side, self.per, self.trailers = side, side.per_page, trailers
        ptrs, sizes = side.meta(idx)
        if len(ptrs) != self.n:
            raise ValueError(f"{len(ptrs)} page objects for {self.n} keys (pages of unequal objects)")
        self.ptrs, self.sizes = ptrs, np.asarray(sizes, np.int64)

    def sync(self) -> None:
        if self.side.ours:
            self.side.pool.synchronize()  # its queued transfers land before the bytes are read or written

    def _sums(self) -> np.ndarray:
        from .. import _native

        out = np.empty(self.n, "<u8")
        for j, (p, s) in enumerate(zip(self.ptrs, self.sizes)):
            out[j] = _native.checksum(np.frombuffer((ctypes.c_uint8 * int(s)).from_address(p), np.uint8))
        return out

    def put_sums(self, obj_keys: Sequence[str]) -> Sums:
        if self.side.ours:
            # The objects' checksums and (as for KV pages) the pages' item checks in one read.
            sums, intact = self.side.pool.put_object_sums(self.idx)
            return _u64(sums), np.asarray(intact, bool)
        return self._sums(), None

    def put_spans(self, todo: np.ndarray, trailer: bool) -> Spans:
        return Spans([[self.ptrs[j], t] for j, t in zip(todo, self._trailer_addrs(todo))], [[int(self.sizes[j]), TRAILER_BYTES] for j in todo], True, True)

    def get_forms(self) -> List[Spans]:
        return [self.put_spans(np.arange(self.n), True)]

    def land(self, expected: np.ndarray, eligible: np.ndarray, written: np.ndarray) -> Tuple[Optional[np.ndarray], bool]:
        if self.side.ours:
            return _u64(self.side.pool.landed_object_sums(self.idx, expected.tolist(), eligible.tolist())), True
        return self._sums(), False

    def settle(self, pages: np.ndarray, trusted: np.ndarray) -> None:
        pool = self.side.pool
        if not self.side.ours or not getattr(pool, "integrity", False):
            return
        # The get wrote the pool's memory in place: its item checksums follow the bytes of each
        # verified page and are forgotten for every other page it was asked for.
        firsts = self.firsts()
        good = [f for f, t in zip(firsts, pages & trusted) if t]
        stale = [f for f, t in zip(firsts, pages & trusted) if not t]
        if good:
            pool.recompute_page_checksums(good)
        if stale:
            pool.forget_page_checksums(stale)
