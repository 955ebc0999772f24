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
window, those whose window pages exist too; with Mamba state, those with a state at their end).
Offloads wait for ``record_offload_ready``'s events, then write only the pages the store does not
hold.

Only plain MHA and MLA pools (token rows in the ``nhd`` layout, nothing else) are stored: a pool
with scales (FP4, MXFP8) or a DSA indexer is refused when the linker is built. A sliding-window
model (``SWAKVPool``) is two such pools: its full-attention layers' pages are sglang's ``KV``
pool, its window layers' its ``SWA`` pool, each stored under keys of its own; a restore reads the
window's last pages only, and ``lookup`` answers every prefix whose full pages and window pages
exist (with gaps where a window page is missing). A Mamba hybrid's state (sglang's ``MAMBA``
pool: one Mamba slot's temporal and conv rows of every Mamba layer) is one object keyed by the KV
page it ends at and the tp rank; a load of KV pages without their state is refused, and the
linker's layer counter gates the Mamba layers too (sglang registers it on the KV pool only).
The verdict of ``load`` is agreed by every rank of the attention's tp and cp groups (the minimum),
since sglang runs the same batch on all of them.
"""

from __future__ import annotations

import collections
import contextlib
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
from .linker_objects import LinkerPages, PoolObjects, StagingBuffers, device_pools, pool_objects

logger = logging.getLogger(__name__)

#: Host memory for pages in flight when ``staging_bytes`` is not given.
DEFAULT_STAGING_BYTES = 256 << 20


class Staged:
    """One request's objects read and verified (``held``: a buffer of :class:`StagingBuffers`,
    ``nbytes`` of it counted), waiting for the layer-wise copy: ``parts`` are, per pool, its
    objects, the pool rows they land in and where in the buffer they start."""

    def __init__(self, rid: str, parts: List[Tuple["PoolObjects", torch.Tensor, int]], held: Tuple[torch.Tensor, List[int]], nbytes: int):
        self.rid, self.parts, self.held, self.nbytes = rid, parts, held, nbytes

    @property
    def buf(self) -> torch.Tensor:
        return self.held[0]


class HicacheLinker(UnifiedCacheLinker):
    """sglang's ``UnifiedCacheLinker`` on hicache-io's L3 stores (see the module docstring)."""

    def __init__(self, server_args: Any, params: Any, *, components: Any, extra_config: Optional[Dict[str, Any]] = None, forward_stream: Any = None):
        cfg = dict(extra_config or {})
        states = ComponentType.MAMBA in set(components or ())
        if states and getattr(params, "mtp_draft_mamba_pools", ()):
            raise ValueError("hicache-io's linker stores the target model's Mamba state; a draft model's own Mamba pools are not stored")
        self.forward_stream = forward_stream
        kv = params.token_to_kv_pool_allocator.get_kvcache()
        self.pools = dict(device_pools(kv))
        self.objects = pool_objects(self.pools, kv, server_args, params, cfg, states=states)
        self.pages = self.objects[PoolName.KV].pages
        self._groups = _groups(params)
        self.layer_done_counter = LayerWiseLoadCounter(1 + max(g for o in self.objects.values() for g in o.local))
        if states:  # sglang registers the counter on the KV pool only; Mamba layers read this pool
            params.req_to_token_pool.register_layer_transfer_counter(self.layer_done_counter)
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
                _check_shape(t, parts[0][2])
            except (ValueError, IndexError, TypeError, RuntimeError) as e:
                logger.error("hicache-io linker: %s of %d %s page(s) refused: %s", what, len(t.keys), t.name, e)
                return None
        if not parts or parts[0][0] is not self.objects[PoolName.KV]:
            if parts:
                logger.error("hicache-io linker: %s refused: no KV pages with the window's or the state", what)
            return None
        if what == "load" and PoolName.MAMBA in self.objects and all(o is not self.objects[PoolName.MAMBA] for o, _, _ in parts):
            # KV without the state it ends at would run the model from a stale state.
            logger.error("hicache-io linker: load refused: KV pages without their Mamba state")
            return None
        return parts

    def object_keys(self, page_keys: Sequence[str]) -> List[str]:
        """The KV pool's objects of pages ``page_keys``, page by page."""
        return self.objects[PoolName.KV].keys(page_keys)

    # ---- lookup and loads --------------------------------------------------------------------

    def lookup(self, rid: str, transfers: List[PoolTransfer]) -> List[int]:
        """Every page count ``p`` whose pages restore: the KV objects of pages ``[0, p)``; with
        a sliding window (an SWA transfer of ``w`` keys) the SWA objects of the ``w`` pages
        before ``p``; with Mamba state (a MAMBA transfer) the state stored at page ``p``'s end;
        within the staging memory. The answer may have gaps: the tree takes the longest count
        every rank offers."""
        kv = _transfer(transfers, PoolName.KV)
        if kv is None or not kv.keys:
            return []
        full = self.objects[PoolName.KV]
        keys = kv.keys[: self.staging_bytes // full.pages.page_bytes]
        try:
            run = int(np.argmin(np.append(self._present(full, keys), False)))
            p = np.arange(1, run + 1)
            ok, need = np.ones(run, dtype=bool), p * full.pages.page_bytes
            for name, t in ((n, _transfer(transfers, n)) for n in (PoolName.SWA, PoolName.MAMBA)):
                if t is None or not t.keys or name not in self.objects:
                    continue
                o = self.objects[name]
                present = self._present(o, keys[:run])
                if name == PoolName.SWA:
                    missing, w = np.concatenate([[0], np.cumsum(~present)]), np.minimum(len(t.keys), p)
                    ok &= missing[p] == missing[p - w]
                    need = need + w * o.pages.page_bytes
                else:  # a state exists only where a node ended: stored under its last page
                    ok &= present
                    need = need + o.pages.page_bytes
        except Exception:  # noqa: BLE001 - a store that cannot answer has nothing to offer
            logger.exception("hicache-io linker: lookup failed")
            return []
        return p[ok & (need <= self.staging_bytes)].tolist()

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
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

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


def _transfer(transfers: Sequence[PoolTransfer], name: Any) -> Optional[PoolTransfer]:
    return next((t for t in transfers if t.name == name), None)


def _check_shape(t: PoolTransfer, kv_keys: List[str]) -> None:
    """Raises unless a window transfer ``t`` names the KV transfer's last pages (sglang's only
    shape) and no padding slot (slot 0, what a window slot never mapped translates to), and a
    Mamba transfer names the KV transfer's last page (the state is the one at its end)."""
    if t.name == PoolName.MAMBA and list(t.keys) != kv_keys[-1:]:
        raise ValueError("the Mamba state's key is not the KV pages' last")
    if t.name != PoolName.SWA:
        return
    if len(t.keys) > len(kv_keys) or list(t.keys) != kv_keys[len(kv_keys) - len(t.keys) :]:
        raise ValueError("the window's pages are not the last of the KV pages")
    if bool((torch.as_tensor(t.device_indices) == 0).any()):
        raise ValueError("the window's slots include the padding slot 0")


def _groups(params: Any) -> List[Any]:
    """The groups whose ranks must agree on a load: the attention's cp and tp groups of more than
    one rank (else the tp group), as the tree reduces its lookups."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return []
    size = lambda g: torch.distributed.get_world_size(group=g)  # noqa: E731
    out = [g for g in (getattr(params, "attn_cp_cache_group", None), getattr(params, "attn_tp_cache_group", None)) if g is not None and size(g) > 1]
    tp = getattr(params, "tp_cache_group", None)
    return out or ([tp] if tp is not None and size(tp) > 1 else [])


def _ranks(server_args: Any) -> Any:
    """What the Mooncake client needs of the deployment: its tp and pp sizes."""
    return type("Ranks", (), {"tp_size": getattr(server_args, "tp_size", 1) or 1, "pp_size": getattr(server_args, "pp_size", 1) or 1})()

