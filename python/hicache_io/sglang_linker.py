"""``HicacheLinker``: sglang's direct L3 (its ``UnifiedCacheLinker``) on hicache-io's stores.

sglang 0.5.23 can link its ``UnifiedRadixCache`` straight to an external KV store, with no host
tier between: pages go from the device pool to the store when the tree writes them through, and
come back into slots of the request that matched them. This linker does that on hicache-io's L3
transports (the local directory, the default, no server; or Mooncake Store) and moves the device
bytes with hicache-io's ops (the cpu executor for pools in host memory, the cuda executor for CUDA
pools, on the linker's own stream)::

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "HicacheLinker",
        "linker_module_path": "hicache_io.sglang_linker",
        "linker_extra_config": {"store": "local", "path": "/var/cache/hicache-io"}}'

``linker_extra_config``: ``store`` (``"local"`` or ``"mooncake"``); the local store's ``path``,
``capacity_bytes``, ``fsync``; Mooncake's ``master_server_address``, ``metadata_server``,
``protocol``, ``global_segment_size``, ``local_buffer_size``, ``local_hostname``,
``device_name``; and ``namespace`` (a name of the deployment's own, part of every key),
``staging_bytes`` (host memory for pages in flight, default 256 MiB: a load that does not fit is
refused, and sglang computes its pages), ``threads`` (the local store's I/O threads) and
``key_scheme``: ``"rank"`` (the default) or ``"unified"`` with ``kv_heads`` (the model's kv head
count) and ``head_group`` (heads an object holds, default 1): an MHA page is then one object a
group of the model's heads, keyed ``..._H{group}`` with no tp rank or size, so that
deployments of any tp size read each other's pages.

Objects. A page of the KV pool is one object (with unified keys, one a head group): the page's
K rows of every layer, then its V rows (MLA: its one buffer's rows), then hicache-io's 16-byte
integrity trailer, its checksum bound to the key. Keys are ``{namespace}/{page
hash}_{ranks}_hio-link-{kind}-i{item bytes}-L{first}-{end}-P{page size}-n{digest}[_H{group}]``
(``ranks``: ``tp{t}_cp{c}_pp{p}``, without the tp rank for MLA and for unified keys; ``kind``:
``mha`` or ``mla``, then ``-u`` for unified keys, then ``-full`` or ``-swa`` for a
sliding-window model's two pools): the digest covers the model, the KV dtype, the pool's shape,
role and layers and the head split, so a page written by another model or shape is another key. MHA ranks hold different heads and
store their own objects; MLA pages are the same on every rank, so only rank 0 writes them and
every rank reads them.

What is checked. ``load`` reads the request's objects and verifies every one against its trailer
before it answers: a page missing, torn, damaged or stored under another key makes ``load``
answer ``False``, so sglang computes that request's pages (it never sees wrong KV, and no other
request is touched); the damaged object is removed. The layer-wise copy into the device slots
(``start_layer_wise_loading``) then only moves verified bytes; it fails the batch
(``finish_layer_wise_loading`` ``False``) only if a device copy raises. ``lookup`` answers the
runs of pages whose objects exist (every one up to the first missing page; with a sliding
window, those whose window pages exist too). Offloads wait for ``record_offload_ready``'s events,
then write only the pages the store does not hold.

Only plain MHA and MLA pools (token rows in the ``nhd`` layout, nothing else) are stored: a pool
with scales (FP4, MXFP8), a DSA indexer or Mamba state is refused when the linker is built. A
sliding-window model (``SWAKVPool``) is two such pools: its full-attention layers' pages are
sglang's ``KV`` pool, its window layers' its ``SWA`` pool, each stored under keys of its own; a
restore reads the window's last pages only, and ``lookup`` answers every prefix whose full pages
and window pages exist (with gaps where a window page is missing).
The verdict of ``load`` is agreed by every rank of the attention's tp and cp groups (the minimum),
since sglang runs the same batch on all of them.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import queue
import threading
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter, UnifiedCacheLinker

from . import _native, kvcacheio
from .l3.errors import DAMAGED
from .l3.trailer import TRAILER_BYTES, matches, seal
from .l3.transport import OTHER_SIZE, Spans, open_transport

logger = logging.getLogger(__name__)

#: Version of what a linker page object holds, part of every key's digest.
LINKER_FORMAT = 1
#: The KV pools whose pages are their token rows and nothing else (with the ``nhd`` layout): FP4,
#: MXFP8 and DSA pools hold scales or indexer buffers besides, which these objects do not carry.
PLAIN_POOLS = ("MHATokenToKVPool", "MLATokenToKVPool")
#: Host memory for pages in flight when ``staging_bytes`` is not given.
DEFAULT_STAGING_BYTES = 256 << 20


class LinkerPages:
    """A device KV pool's pages as objects: ``rows`` are the pool's layer buffers as rows of
    ``item`` bytes (``[slots × groups][item]``, uint8 views: K layers then V layers, or MLA's one
    buffer a layer), slot ``s``'s head group ``h`` at row ``s × groups + h``. A page is ``groups``
    objects (one, unless ``head_group`` cuts an MHA rank's heads into groups of that many heads).
    Object ``j`` of a staging buffer starts at byte ``j × stride``: buffer ``b``'s rows of the
    object at ``(b × P + t) × item``, the trailer after them."""

    def __init__(self, kv: Any, page: int, head_group: Optional[int] = None):
        plain = type(kv).__name__ in PLAIN_POOLS and getattr(kv, "kv_cache_layout", "nhd") == "nhd"
        extra = [a for a in ("k_scale_buffer", "v_scale_buffer", "kv_scale_buffer", "index_k_with_scale_buffer") if getattr(kv, a, None) is not None]
        if not plain or extra:
            what = f"layout {getattr(kv, 'kv_cache_layout', None)}" if type(kv).__name__ in PLAIN_POOLS and not extra else f"buffers {extra}" if extra else "pool"
            raise ValueError(f"hicache-io's linker stores plain MHA and MLA KV pools (token rows, no scales); got {type(kv).__name__} ({what})")
        if getattr(kv, "k_buffer", None) is not None and getattr(kv, "v_buffer", None) is not None:
            self.kind, layers = "mha", list(kv.k_buffer) + list(kv.v_buffer)
        elif getattr(kv, "kv_buffer", None) is not None:
            self.kind, layers = "mla", list(kv.kv_buffer)
        else:
            raise ValueError(f"hicache-io's linker takes MHA (k_buffer, v_buffer) or MLA (kv_buffer) KV pools, got {type(kv).__name__}")
        rows = [_rows(t, i) for i, t in enumerate(layers)]
        items = {r.shape[1] for r in rows}
        if len(items) != 1:
            raise ValueError(f"the pool's layers have rows of different sizes: {sorted(items)}")
        self.heads = int(getattr(kv, "head_num", 1)) if self.kind == "mha" else 1
        self.groups = _groups_of(self.heads, head_group) if self.kind == "mha" else 1
        self.item, self.page = items.pop() // self.groups, int(page)
        self.rows = [r.reshape(-1, self.item) for r in rows]
        self.layers = len(self.rows) // (2 if self.kind == "mha" else 1)
        self.start = int(getattr(kv, "start_layer", 0) or 0)
        self.slots = min(r.shape[0] for r in rows)
        self.dtype = str(getattr(kv, "dtype", rows[0].dtype)).replace("torch.", "")
        self.device = rows[0].device
        self.obj_bytes = len(self.rows) * self.page * self.item
        # The trailer in whole rows after the object: the staging buffer is rows of `item` bytes.
        self.stride = self.obj_bytes + -(-TRAILER_BYTES // self.item) * self.item
        #: Staging bytes of one page (its objects).
        self.page_bytes = self.groups * self.stride

    def check(self, device_indices: Any, n_pages: int) -> torch.Tensor:
        """``device_indices`` as an int64 tensor on the pool's device; raises unless there are
        ``P`` of them a page and each names a slot of the pool."""
        idx = torch.as_tensor(device_indices).reshape(-1).to(torch.int64)
        if idx.numel() != n_pages * self.page:
            raise ValueError(f"{n_pages} pages need {n_pages * self.page} device indices, got {idx.numel()}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.slots):
            raise IndexError(f"device indices outside the pool's {self.slots} slots")
        return idx.to(self.device)

    def object_rows(self, idx: torch.Tensor, objects: Optional[np.ndarray] = None) -> torch.Tensor:
        """The pool rows of objects ``objects`` (default: every object of ``idx``'s pages; object
        ``j`` is page ``j // groups``'s head group ``j % groups``), ``P`` a object, in order. On
        the host: :meth:`move` takes them to the device on the stream of its copies."""
        idx = idx.cpu()
        if objects is None:
            objects = np.arange(idx.numel() // self.page * self.groups)
        j = torch.as_tensor(objects, dtype=torch.int64)
        t = torch.arange(self.page, dtype=torch.int64)
        slots = idx[((j // self.groups)[:, None] * self.page + t[None, :]).reshape(-1)]
        return (slots.view(len(j), self.page) * self.groups + (j % self.groups)[:, None]).reshape(-1)

    def staged_rows(self, n_objects: int) -> torch.Tensor:
        """Per token of ``n_objects`` staged objects, its row of buffer 0 in the staging buffer
        seen as rows of ``item`` bytes (buffer ``b``: plus ``b × P``)."""
        per = self.stride // self.item
        t = torch.arange(self.page, dtype=torch.int64)
        return (torch.arange(n_objects, dtype=torch.int64)[:, None] * per + t[None, :]).reshape(-1)

    def staging(self, nbytes: int) -> torch.Tensor:
        """A staging buffer of ``nbytes`` (pinned when the pool is on a GPU). Not zeroed: only
        the bytes of objects read whole, or written from the pool, are ever used."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    def move(self, staged: torch.Tensor, rows: torch.Tensor, buffers: Sequence[int], out: bool) -> None:
        """Copies buffers ``buffers`` of the objects whose pool rows are ``rows`` (see
        :meth:`object_rows`) to the staging buffer (``out``) or from it, through hicache-io's ops."""
        n = rows.numel() // self.page
        rows = rows.to(self.device)  # on the caller's stream: the copies' own
        base = self.staged_rows(n).to(staged.device)
        view = staged[: n * self.stride].view(-1, self.item)
        for b in buffers:
            at = (base + b * self.page).to(rows.device) if rows.device.type == "cuda" else base + b * self.page
            if out:
                kvcacheio.transfer_kv_per_layer_mla(self.rows[b], view, rows, at, self.item)
            else:
                kvcacheio.transfer_kv_per_layer_mla(view, self.rows[b], at, rows, self.item)

    def layer_buffers(self, layer: int) -> List[int]:
        return [layer, self.layers + layer] if self.kind == "mha" else [layer]


def _groups_of(heads: int, head_group: Optional[int]) -> int:
    """How many objects an MHA page of ``heads`` heads is cut into: one, or one a group of
    ``head_group`` heads (which must divide them)."""
    if head_group is None:
        return 1
    if head_group < 1 or heads % head_group:
        raise ValueError(f"head_group {head_group} does not divide this rank's {heads} kv heads")
    return heads // head_group


def _rows(t: torch.Tensor, i: int) -> torch.Tensor:
    if t.dim() < 1 or not t.is_contiguous():
        raise ValueError(f"layer buffer {i} is not a contiguous tensor of rows")
    return t.view(t.shape[0], -1).view(torch.uint8)


class StagingBuffers:
    """Host buffers for pages in flight, registered with the store once and reused: a new
    registration (and, for a GPU's pool, new pinned memory) costs more than reading a few pages.
    Sizes are powers of two from 1 MiB; at most ``keep`` bytes of them stay while unused."""

    def __init__(self, pages: LinkerPages, io: Any, keep: int):
        self.pages, self.io, self.keep = pages, io, keep
        self._free: Dict[int, List[Tuple[torch.Tensor, List[int]]]] = {}
        self._kept = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Tuple[torch.Tensor, List[int]]:
        """A registered buffer of at least ``nbytes`` and its registration (raises where memory
        or the registration fails)."""
        size = max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            if free:
                self._kept -= size
                return free.pop()
        buf = self.pages.staging(size)
        mem = buf.numpy()
        return buf, self.io.register([(mem.ctypes.data, mem.nbytes)])

    def give(self, held: Tuple[torch.Tensor, List[int]]) -> None:
        size = held[0].numel()
        with self._lock:
            if self._kept + size <= self.keep:
                self._free.setdefault(size, []).append(held)
                self._kept += size
                return
        self.io.unregister(held[1])

    def close(self) -> None:
        with self._lock:
            held = [h for free in self._free.values() for h in free]
            self._free, self._kept = {}, 0
        for h in held:
            self.io.unregister(h[1])


class Staged:
    """One request's objects read and verified (``held``: a buffer of :class:`StagingBuffers`,
    ``nbytes`` of it counted), waiting for the layer-wise copy: ``parts`` are, per pool, its
    objects, the pool rows they land in and where in the buffer they start."""

    def __init__(self, rid: str, parts: List[Tuple["PoolObjects", torch.Tensor, int]], held: Tuple[torch.Tensor, List[int]], nbytes: int):
        self.rid, self.parts, self.held, self.nbytes = rid, parts, held, nbytes
        self.buf = held[0]


class PoolObjects:
    """One device pool of the linker as store objects: its pages (:class:`LinkerPages`), the
    keys of its objects, whether this rank writes them, and which of the layer counter's layers
    it holds (``local``: counter layer -> the pool's own layer)."""

    def __init__(self, pages: LinkerPages, prefix: str, tail: str, group_names: List[str], writes: bool, layer_ids: Sequence[int]):
        self.pages, self.prefix, self.tail, self.group_names, self.writes = pages, prefix, tail, group_names, writes
        self.local = {int(g): i for i, g in enumerate(layer_ids)}

    def keys(self, page_keys: Sequence[str]) -> List[str]:
        """The objects of pages ``page_keys``, page by page (``groups`` a page)."""
        return [f"{self.prefix}{k}{self.tail}{g}" for k in page_keys for g in self.group_names]


class HicacheLinker(UnifiedCacheLinker):
    """sglang's ``UnifiedCacheLinker`` on hicache-io's L3 stores (see the module docstring)."""

    def __init__(self, server_args: Any, params: Any, *, components: Any, extra_config: Optional[Dict[str, Any]] = None, forward_stream: Any = None):
        cfg = dict(extra_config or {})
        if ComponentType.MAMBA in set(components or ()):
            raise ValueError("hicache-io's linker stores KV pages only; a model with Mamba state cannot use it")
        self.forward_stream = forward_stream
        kv = params.token_to_kv_pool_allocator.get_kvcache()
        self.pools = dict(_device_pools(kv))
        self.objects = _pool_objects(self.pools, kv, server_args, params, cfg)
        self.pages = self.objects[PoolName.KV].pages
        self._groups = _groups(params)
        self.layer_done_counter = LayerWiseLoadCounter(1 + max(g for o in self.objects.values() for g in o.local))
        store = cfg.pop("store", "local")
        self.staging_bytes = int(cfg.pop("staging_bytes", DEFAULT_STAGING_BYTES))
        threads = int(cfg.pop("threads", 4))
        self._io = open_transport(store, cfg, threads=threads, storage_config=_ranks(server_args))
        self.client = self._io.client
        self._staging = StagingBuffers(self.pages, self._io, self.staging_bytes)
        self.stats = {"stored": 0, "store_failed": 0, "loaded": 0, "verified": 0, "corrupt": 0, "missing": 0}
        self._lock = threading.Lock()
        self._queued: Dict[str, Staged] = {}
        self._staged_bytes = 0
        self._done: Deque[bool] = collections.deque()
        self._offloads: "queue.Queue[Optional[Tuple[Any, List[Tuple[PoolObjects, torch.Tensor, List[str]]]]]]" = queue.Queue()
        self._loads: "queue.Queue[Optional[Tuple[int, List[Staged]]]]" = queue.Queue()
        # Each thread copies on a stream of its own (loads never wait behind offloads).
        cuda = self.pages.device.type == "cuda"
        self._load_stream = torch.cuda.Stream(self.pages.device) if cuda else None
        self._offload_stream = torch.cuda.Stream(self.pages.device) if cuda else None
        self._closed = False
        self._threads = [threading.Thread(target=self._serve, args=(q, f), name=f"hicache-io-linker-{n}", daemon=True) for n, q, f in (("offload", self._offloads, self._offload), ("load", self._loads, self._land))]
        for t in self._threads:
            t.start()

    def _parts(self, transfers: List[PoolTransfer], what: str) -> Optional[List[Tuple[PoolObjects, torch.Tensor, List[str]]]]:
        """Per transfer of a pool this linker stores (KV first), its objects, its device indices
        and its page keys; ``None`` (logged) where indices do not fit their pages or pool, the
        KV transfer is missing, or the window's pages are not the KV pages' last: the call is
        refused before any byte moves, never raised."""
        parts = []
        for t in sorted((t for t in transfers if t.name in self.objects and t.keys), key=lambda t: t.name != PoolName.KV):
            try:
                parts.append((self.objects[t.name], self.objects[t.name].pages.check(t.device_indices, len(t.keys)), list(t.keys)))
                _check_window(t, parts[0][2])
            except (ValueError, IndexError, TypeError, RuntimeError) as e:
                logger.error("hicache-io linker: %s of %d %s page(s) refused: %s", what, len(t.keys), t.name, e)
                return None
        if not parts or parts[0][0] is not self.objects[PoolName.KV]:
            if parts:
                logger.error("hicache-io linker: %s refused: no KV pages with the window's", what)
            return None
        return parts

    def object_keys(self, page_keys: Sequence[str]) -> List[str]:
        """The KV pool's objects of pages ``page_keys``, page by page."""
        return self.objects[PoolName.KV].keys(page_keys)

    # ---- lookup and loads --------------------------------------------------------------------

    def lookup(self, rid: str, transfers: List[PoolTransfer]) -> List[int]:
        """Every page count ``p`` whose pages restore: the KV objects of pages ``[0, p)``, and
        with a sliding window (an SWA transfer of ``w`` keys) the SWA objects of the ``w`` pages
        before ``p``; within the staging memory. The answer may have gaps: the tree takes the
        longest count every rank offers."""
        kv, swa = _kv(transfers), next((t for t in transfers if t.name == PoolName.SWA), None)
        if kv is None or not kv.keys:
            return []
        full = self.objects[PoolName.KV]
        keys = kv.keys[: self.staging_bytes // full.pages.page_bytes]
        try:
            run = int(np.argmin(np.append(self._present(full, keys), False)))
            if swa is None or not swa.keys or PoolName.SWA not in self.objects:
                return list(range(1, run + 1))
            window = self.objects[PoolName.SWA]
            missing = np.concatenate([[0], np.cumsum(~self._present(window, keys[:run]))])
        except Exception:  # noqa: BLE001 - a store that cannot answer has nothing to offer
            logger.exception("hicache-io linker: lookup failed")
            return []
        p = np.arange(1, run + 1)
        w = np.minimum(len(swa.keys), p)
        ok = (missing[p] == missing[p - w]) & (p * full.pages.page_bytes + w * window.pages.page_bytes <= self.staging_bytes)
        return p[ok].tolist()

    def _present(self, objects: PoolObjects, page_keys: Sequence[str]) -> np.ndarray:
        """Per page, whether every object of it exists."""
        if not len(page_keys):
            return np.zeros(0, dtype=bool)
        found = np.asarray(self._io.exists(objects.keys(page_keys)))
        return (found.reshape(len(page_keys), objects.pages.groups) == 1).all(axis=1)

    def load(self, rid: str, transfers: List[PoolTransfer]) -> bool:
        """Reads and verifies the request's pages now (see the module docstring); ``False``
        (sglang computes the pages) when any is missing or fails its checks, or when they do not
        fit the staging memory left. The verdict is the same on every rank: sglang takes it
        without a reduction of its own, and ranks that differ would run different batches."""
        staged = None if self._closed else self._stage(rid, transfers)
        try:
            agreed = self._agree(staged is not None)
        except BaseException:
            if staged is not None:
                self._release(staged)
            raise
        if staged is not None and agreed:
            with self._lock:
                self._queued[rid] = staged
            return True
        if staged is not None:
            self._release(staged)
        return False

    def _stage(self, rid: str, transfers: List[PoolTransfer]) -> Optional["Staged"]:
        parts = self._parts(transfers, "load")
        if parts is None:
            return None
        sizes = [len(keys) * o.pages.page_bytes for o, _, keys in parts]
        nbytes = sum(sizes)
        with self._lock:
            if rid in self._queued:
                logger.error("hicache-io linker: request %s already has a load queued; refused", rid)
                return None
            if self._staged_bytes + nbytes > self.staging_bytes:
                logger.warning("hicache-io linker: %d page(s) of request %s do not fit the staging memory left; computed instead", len(parts[0][2]), rid)
                return None
            self._staged_bytes += nbytes
        staged = None
        try:
            offsets = np.cumsum([0] + sizes[:-1]).tolist()
            staged = Staged(rid, [(o, o.pages.object_rows(idx), at) for (o, idx, _), at in zip(parts, offsets)], self._staging.take(nbytes), nbytes)
            objects = [(key, at + j * o.pages.stride, o.pages.obj_bytes) for (o, _, keys), at in zip(parts, offsets) for j, key in enumerate(o.keys(keys))]
            if self._read(objects, staged.buf):
                return staged
        except Exception:  # noqa: BLE001 - a failed read is a refused load, never a crash
            logger.exception("hicache-io linker: load of request %s failed", rid)
        if staged is None:
            with self._lock:
                self._staged_bytes -= nbytes
        else:
            self._release(staged)
        return None

    def _release(self, staged: Staged) -> None:
        """Gives ``staged``'s buffer back and uncounts its bytes."""
        self._staging.give(staged.held)
        with self._lock:
            self._staged_bytes -= staged.nbytes

    def _agree(self, ok: bool) -> bool:
        """``ok`` on every rank of the attention's tp and cp groups (the tree's own groups)."""
        verdict = torch.tensor([int(ok)], dtype=torch.int)
        for group in self._groups:
            torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MIN, group=group)
        return bool(verdict.item())

    def _read(self, objects: List[Tuple[str, int, int]], buf: torch.Tensor) -> bool:
        """Reads ``objects`` (key, offset in ``buf``, size without the trailer) into ``buf`` and
        verifies them; True when every one is whole and intact. Damaged objects are removed."""
        keys = [k for k, _, _ in objects]
        at, size = np.array([a for _, a, _ in objects], dtype=np.int64), np.array([n for _, _, n in objects], dtype=np.int64)
        mem = buf.numpy()
        got, _, _, _ = self._io.get(keys, keys, [Spans((mem.ctypes.data + at).tolist(), (size + TRAILER_BYTES).tolist(), False, True)])
        whole = got == size + TRAILER_BYTES
        trailers = np.stack([mem[a + n : a + n + TRAILER_BYTES] for a, n in zip(at, size)]).view(np.uint64)
        sums = np.array([_native.checksum(mem[a : a + n], _native.STORAGE_SEED) if w else 0 for a, n, w in zip(at, size, whole)], dtype=np.uint64)
        good = whole & matches(trailers, sums, keys)
        bad = (whole & ~good) | np.isin(got, (OTHER_SIZE[False], DAMAGED))
        for j in np.flatnonzero(bad):
            if got[j] != DAMAGED:  # the local store removed a damaged object itself
                self.client.remove(keys[j])
            logger.warning("hicache-io linker: page object %s failed its checks (%d); removed", keys[j], int(got[j]))
        with self._lock:
            self.stats["loaded"] += len(keys)
            self.stats["verified"] += int(good.sum())
            self.stats["corrupt"] += int(bad.sum())
            self.stats["missing"] += int((~good & ~bad).sum())
        return bool(good.all())

    def start_layer_wise_loading(self) -> int:
        with self._lock:
            batch, self._queued = list(self._queued.values()), {}
        if not batch:
            return -1
        index = self.layer_done_counter.update_producer()
        self._loads.put((index, batch))
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.layer_done_counter.finish(counter_index)

    def cancel_queued_load(self, rid: str) -> bool:
        with self._lock:
            staged = self._queued.pop(rid, None)
        if staged is not None:
            self._release(staged)
        return staged is not None

    @staticmethod
    def _serve(work: "queue.Queue[Any]", run: Any) -> None:
        """A worker thread: ``run(*item)`` for each item of ``work`` until ``None``."""
        while True:
            item = work.get()
            try:
                if item is None:
                    return
                run(*item)
            finally:
                work.task_done()

    def _land(self, index: int, batch: List[Staged]) -> None:
        """Copies the batch's pages into their device slots layer by layer (the counter's
        layers: with SWA, the model's, each from the pool that holds it), each layer reported
        once its copies finished; a failure fails every layer not yet reported. The staging
        memory is free again before the last layer is reported (sglang may load right after)."""
        held, last = list(batch), self.layer_done_counter.num_layers - 1
        try:
            with self._on(self._load_stream):
                for layer in range(last + 1):
                    for s in batch:
                        for o, rows, at in s.parts:
                            if layer in o.local:
                                o.pages.move(s.buf[at:], rows, o.pages.layer_buffers(o.local[layer]), out=False)
                    self._finished()
                    if layer == last:
                        for s in held:
                            self._release(s)
                        held = []
                    self.layer_done_counter.complete(index, layer)
        except BaseException as e:  # noqa: BLE001 - reported to the scheduler through finish()
            logger.exception("hicache-io linker: layer-wise load %d failed", index)
            self.layer_done_counter.fail(index, e)
        finally:
            for s in held:
                self._release(s)

    def _on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if stream is not None else _nothing()

    def _finished(self) -> None:
        """Waits for the copies enqueued on this thread's stream; raises what they raised (the
        cuda executor reports a failed copy at the next synchronize)."""
        if self.pages.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
            kvcacheio.synchronize(self.pages.device.index)

    # ---- offloads ------------------------------------------------------------------------------

    def offload(self, transfers: List[PoolTransfer], session_id: Optional[str] = None) -> bool:
        """Queues the pages of the KV transfer (and of the SWA transfer, where the tree still
        holds the node's window) to be written once the forward's events fired."""
        parts = None if self._closed else self._parts(transfers, "offload")
        if parts is None:
            return False
        parts = [p for p in parts if p[0].writes]  # MLA pages are rank 0's to write
        if not parts:
            with self._lock:
                self._done.append(True)
            return True
        self._offloads.put((self.record_offload_ready(), parts))
        return True

    def _offload(self, events: Any, parts: List[Tuple[PoolObjects, torch.Tensor, List[str]]]) -> None:
        try:
            for ev in events:
                ev.synchronize()
            ok = all([self._store(o, idx, keys) for o, idx, keys in parts])
        except Exception:  # noqa: BLE001 - a failed offload is reported, never raised
            logger.exception("hicache-io linker: offload failed")
            ok = False
        with self._lock:
            self._done.append(ok)

    def _store(self, objects: PoolObjects, idx: torch.Tensor, page_keys: List[str]) -> bool:
        """Writes the pool's objects the store does not hold, in batches that fit the staging
        memory."""
        try:
            keys = objects.keys(page_keys)
            todo = np.flatnonzero(self._io.exists(keys) != 1)
            per = max(1, min(len(todo), self.staging_bytes // 4 // objects.pages.stride))
            ok = True
            for at in range(0, len(todo), per):
                ok &= self._put(objects, [keys[j] for j in todo[at : at + per]], idx, todo[at : at + per])
            return ok
        except Exception:
            logger.exception("hicache-io linker: offload of %d page(s) failed", len(page_keys))
            with self._lock:
                self.stats["store_failed"] += len(page_keys)
            return False

    def _put(self, objects: PoolObjects, keys: List[str], idx: torch.Tensor, which: np.ndarray) -> bool:
        """Writes objects ``which`` of the offload (device slots ``idx``) under ``keys``."""
        held = self._staging.take(len(keys) * objects.pages.stride)
        try:
            return self._seal_and_put(objects.pages, keys, objects.pages.object_rows(idx, which), held[0])
        finally:
            self._staging.give(held)

    def _seal_and_put(self, pages: LinkerPages, keys: List[str], rows: torch.Tensor, buf: torch.Tensor) -> bool:
        n, stride, size = len(keys), pages.stride, pages.obj_bytes
        with self._on(self._offload_stream):  # the rows reach the device on the copies' stream
            pages.move(buf, rows, range(len(pages.rows)), out=True)
            self._finished()
        mem = buf.numpy()
        objs = mem[: n * stride].reshape(n, stride)
        sums = np.array([_native.checksum(objs[j, :size], _native.STORAGE_SEED) for j in range(n)], dtype=np.uint64)
        trailers = np.zeros((n, 2), dtype=np.uint64)
        seal(trailers, np.arange(n), sums, keys)
        objs[:, size : size + TRAILER_BYTES] = trailers.view(np.uint8).reshape(n, TRAILER_BYTES)
        rcs, _ = self._io.put(keys, keys, Spans([mem.ctypes.data + j * stride for j in range(n)], [size + TRAILER_BYTES] * n, False, True))
        with self._lock:
            self.stats["stored"] += int((rcs == 0).sum())
            self.stats["store_failed"] += int((rcs != 0).sum())
        if (rcs != 0).any():
            logger.warning("hicache-io linker: %d of %d page(s) not stored (codes %s)", int((rcs != 0).sum()), n, sorted(set(rcs.tolist())))
        return bool((rcs == 0).all())

    def num_completed_offloads(self) -> int:
        with self._lock:
            return len(self._done)

    def pop_completed_offload(self) -> bool:
        with self._lock:
            return self._done.popleft()

    # ---- lifecycle -----------------------------------------------------------------------------

    def reset(self) -> None:
        """Waits for the offloads and loads in flight, then forgets queued loads, results not
        consumed and the layer counter."""
        self._offloads.join()
        self._loads.join()
        with self._lock:
            queued, self._queued = list(self._queued.values()), {}
            self._done.clear()
        for s in queued:
            self._release(s)
        self.layer_done_counter.reset()

    def close(self) -> None:
        if self._closed:
            return
        self.reset()
        self._closed = True
        self._offloads.put(None)
        self._loads.put(None)
        for t in self._threads:
            t.join()
        self._staging.close()
        self.client.close()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _kv(transfers: Sequence[PoolTransfer]) -> Optional[PoolTransfer]:
    return next((t for t in transfers if t.name == PoolName.KV), None)


def _device_pools(kv: Any) -> List[Tuple[Any, Any]]:
    """The pools whose pages the linker stores: the KV pool, or a sliding-window model's two
    (its full-attention layers' pool as KV, its window layers' as SWA)."""
    if getattr(kv, "full_kv_pool", None) is not None and getattr(kv, "swa_kv_pool", None) is not None:
        return [(PoolName.KV, kv.full_kv_pool), (PoolName.SWA, kv.swa_kv_pool)]
    return [(PoolName.KV, kv)]


def _check_window(t: PoolTransfer, kv_keys: List[str]) -> None:
    """Raises unless the window transfer ``t`` names the KV transfer's last pages (sglang's
    only shape) and no padding slot (slot 0, what a window slot never mapped translates to)."""
    if t.name != PoolName.SWA:
        return
    if len(t.keys) > len(kv_keys) or list(t.keys) != kv_keys[len(kv_keys) - len(t.keys) :]:
        raise ValueError("the window's pages are not the last of the KV pages")
    if bool((torch.as_tensor(t.device_indices) == 0).any()):
        raise ValueError("the window's slots include the padding slot 0")


def _layer_ids(kv: Any, name: Any, pool: Any, n: int) -> List[int]:
    """The layer counter's layers of ``pool``'s layers, in order: the pool's own for a plain
    pool; the model's for a sliding-window model's pools (the forward waits on the model's)."""
    mapping = getattr(kv, "layers_mapping", None)
    if pool is kv:
        return list(range(n))
    if not mapping:
        raise ValueError(f"{type(kv).__name__} has two pools but no layers_mapping: which model layer each holds is unknown")
    ids = sorted((local, g) for g, (local, is_swa) in mapping.items() if bool(is_swa) == (name == PoolName.SWA))
    return [g for _, g in ids]


def _pool_objects(pools: Dict[Any, Any], kv: Any, server_args: Any, params: Any, cfg: Dict[str, Any]) -> Dict[Any, "PoolObjects"]:
    """Each pool's :class:`PoolObjects`, from the configuration's ``key_scheme``,
    ``head_group``, ``kv_heads`` and ``namespace`` (taken out of ``cfg``)."""
    tp, tp_size, others = _rank(params)
    scheme = cfg.pop("key_scheme", "rank")
    if scheme not in ("rank", "unified"):
        raise ValueError(f"key_scheme must be 'rank' or 'unified', got {scheme!r}")
    head_group, kv_heads = int(cfg.pop("head_group", 1)), cfg.pop("kv_heads", None)
    prefix = f"{cfg.pop('namespace', 'hicache-io')}/"
    out = {}
    for name, pool in pools.items():
        unified = scheme == "unified" and getattr(pool, "k_buffer", None) is not None
        pages = LinkerPages(pool, params.page_size, head_group if unified else None)
        if unified:
            _check_heads(pages, kv_heads, tp_size)
        layer_ids = _layer_ids(kv, name, pool, pages.layers)
        if len(layer_ids) != pages.layers:
            raise ValueError(f"the {name} pool has {pages.layers} layers, the model maps {len(layer_ids)} to it")
        role = None if pool is kv else ("swa" if name == PoolName.SWA else "full", layer_ids)
        rank = f"tp{tp}_{others}" if pages.kind == "mha" and not unified else others
        tail = _key_tail(pages, server_args, rank, tp_size, pages.heads * tp_size if unified else None, role)
        # Unified keys name the model's head groups this rank holds, never the rank.
        groups = [f"_H{tp * pages.groups + h}" for h in range(pages.groups)] if unified else [""]
        # MLA pages are the same on every tp rank: rank 0 writes them, every rank reads them.
        out[name] = PoolObjects(pages, prefix, tail, groups, pages.kind == "mha" or tp == 0, layer_ids)
    return out


def _check_heads(pages: LinkerPages, kv_heads: Any, tp_size: int) -> None:
    """Unified keys name the model's heads: this rank's ``heads`` must be its share of
    ``kv_heads`` (sglang replicates heads where there are more ranks than heads)."""
    if kv_heads is None:
        raise ValueError("unified keys need kv_heads, the model's kv head count")
    if int(kv_heads) != pages.heads * tp_size:
        raise ValueError(f"unified keys need the model's kv_heads={kv_heads} split over the {tp_size} tp rank(s); this rank holds {pages.heads} (heads replicated over ranks cannot be named)")


def _groups(params: Any) -> List[Any]:
    """The groups whose ranks must agree on a load: the attention's cp and tp groups of more than
    one rank (else the tp group), as the tree reduces its lookups."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return []
    size = lambda g: torch.distributed.get_world_size(group=g)  # noqa: E731
    out = [g for g in (getattr(params, "attn_cp_cache_group", None), getattr(params, "attn_tp_cache_group", None)) if g is not None and size(g) > 1]
    tp = getattr(params, "tp_cache_group", None)
    return out or ([tp] if tp is not None and size(tp) > 1 else [])


def _group_rank(group: Any) -> Tuple[int, int]:
    if group is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


def _rank(params: Any) -> Tuple[int, int, str]:
    """This worker's tp rank, the tp size and its name among the other ranks (cp and pp)."""
    tp, tp_size = _group_rank(getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None))
    return tp, tp_size, f"cp{getattr(params, 'attn_cp_rank', 0)}_pp{getattr(params, 'pp_rank', 0)}"


def _ranks(server_args: Any) -> Any:
    """What the Mooncake client needs of the deployment: its tp and pp sizes."""
    return type("Ranks", (), {"tp_size": getattr(server_args, "tp_size", 1) or 1, "pp_size": getattr(server_args, "pp_size", 1) or 1})()


def _key_tail(pages: LinkerPages, server_args: Any, rank: str, tp_size: int, kv_heads: Optional[int] = None, role: Optional[Tuple[str, List[int]]] = None) -> str:
    """The key's part after the page hash: the rank (MHA only) and what the page's bytes mean.
    Unified keys (``kv_heads``, the model's kv heads, given) leave the tp rank and size out: an
    object is a group of the model's heads, whichever ranks held them. A sliding-window model's
    pools (``role``: ``"full"`` or ``"swa"`` and the model's layers the pool holds) are named
    apart."""
    record = {
        "format": LINKER_FORMAT,
        # Two models served under one name must not share pages: the path, revision, weight
        # quantization and overrides too.
        "model": [getattr(server_args, a, None) for a in ("model_path", "served_model_name", "revision", "quantization", "json_model_override_args", "kv_cache_dtype")],
        "kv_dtype": pages.dtype,
        "kind": pages.kind,
        "item": pages.item,
        "layers": [pages.start, pages.start + pages.layers],
        "page_size": pages.page,
        "tp_size": tp_size if pages.kind == "mha" and kv_heads is None else None,
    }
    if kv_heads is not None:
        record["unified"] = [kv_heads, pages.heads // pages.groups]
    if role is not None:
        record["pool"] = [role[0], list(role[1])]
    digest = hashlib.blake2b(json.dumps(record, sort_keys=True).encode(), digest_size=6).hexdigest()
    kind = pages.kind + ("-u" if kv_heads is not None else "") + (f"-{role[0]}" if role is not None else "")
    return f"_{rank}_hio-link-{kind}-i{pages.item}-L{pages.start}-{pages.start + pages.layers}-P{pages.page}-n{digest}"
