"""sglang's storage v2 for :class:`hicache_io.storage.MooncakeStore`: every pool of a hybrid host
pool group (KV, DSA indexer, MTP drafts, Mamba states, SWA, the DeepSeek-V4 regions, …) backed up
and prefetched with the KV pages.

sglang 0.5.23's controller registers each pool of its ``HostPoolGroup`` with
``register_mem_host_pool_v2(pool, name)`` (the KV anchor too, after ``register_mem_pool_host``),
calls ``on_host_pools_registered()`` once, then moves sidecar pages with ``batch_set_v2`` /
``batch_get_v2`` (``PoolTransfer``: a pool name, host token indices, one key per page) and asks
``batch_exists_v2`` for the KV prefix every pool can serve. A pool's page is what its own
``get_page_buffer_meta`` names (Mamba: the temporal state then each conv state of one slot; the
indexer and the DeepSeek-V4 regions: one block), read and written in place (zero copy: the pool's
buffers are registered with Mooncake when the pool is).

Keys. Object ``j`` of page ``page_hash`` of pool ``name``::

    {prefix}_{page_hash}_{rank}_hio2-{name}-n{digest}_{j}

``rank`` is the tp rank (and pp rank) for pools whose ranks hold different bytes (Mamba states, MHA
drafts and SWA pools, everything of an MHA model) and empty for the rank-replicated pools of MLA
models; ``digest`` binds the pool's namespace (model, pool name and class, layout, page size, dtype,
the byte size of each object, the head split, the format version), so pools, ranks, models and
shapes cannot collide, and a page written under another namespace reads as a miss. Every object
ends in the 16-byte integrity trailer of hicache-io's v1 objects (the checksum of the bytes, bound
to the key); a get whose bytes fail it fails its page.

``PoolTransfer`` names the KV pool: its pages take the v1 path (``batch_get_v1`` / ``batch_set_v1``).
Hit policies: ``ALL_PAGES`` (every page of the prefix) and ``TRAILING_PAGES`` (the last
``len(transfer.keys)`` pages of a prefix); ``BLOCK_GROUPS`` is refused with ``ValueError``. A logical
KV anchor (a host pool group whose KV entry owns no buffer) is not supported: its registration is
refused.
"""

import hashlib
import json
import logging
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .l3.batches import in_rounds, one_call
from .l3.config import STORAGE_BATCH_SIZE
from .l3.errors import REFUSED, StorageError
from .l3.keys import SidecarKeys
from .l3.layouts import check_inside as _check_inside
from .l3.layouts import host_list as _host_list
from .l3.pipeline import get_pages, put_pages
from .l3.placements import SidecarPages

logger = logging.getLogger(__name__)

#: Key format of v2 objects (part of the namespace digest).
V2_FORMAT = 1


def _pool_name(name: Any) -> str:
    """sglang's ``PoolName`` (a str enum) or a plain string, as its value."""
    return str(getattr(name, "value", name))


class _SidecarPool:
    """One registered pool's page objects (sglang's pools: torch tensors; hicache-io's
    ``HostPool``: its host spans)."""

    def __init__(self, pool: Any, name: str):
        self.pool, self.name = pool, name
        self.ours = hasattr(pool, "host_span")
        self.page = int(getattr(pool, "page_size", 1) or 1)
        if self.ours:
            spans = [pool.host_span(c) for c in range(pool.components)]
            if any(s is None for s in spans):
                raise ValueError(f"pool {name!r}: storage v2 moves pages in place; this executor keeps host pools in its own buffers (wgpu)")
            self.bases = [s[0] for s in spans]
            self.regions = [s for s in spans if s[1] > 0]
        else:
            bufs = getattr(pool, "get_hybrid_pool_buffer", None)
            tensors = list(bufs()) if bufs is not None else [getattr(pool, "kv_buffer", None)]
            tensors = [t for t in tensors if t is not None and t.numel() > 0]
            if not tensors:
                raise ValueError(f"pool {name!r} owns no host buffer (a logical anchor): not supported by hicache-io's Mooncake store")
            self.regions = [(int(t.data_ptr()), int(t.numel() * t.element_size())) for t in tensors]
        ptrs, sizes = self.meta(list(range(self.page)))
        self.sizes = [int(s) for s in sizes]
        self.per_page = len(self.sizes)
        if self.per_page == 0 or min(self.sizes) <= 0:
            raise ValueError(f"pool {name!r}: pages of objects {self.sizes}; storage v2 needs one or more non-empty objects a page")

    def meta(self, idx: List[int]) -> "tuple[List[int], List[int]]":
        """Addresses and sizes of the objects of the pages starting at ``idx[i * P]``, checked to
        lie inside the pool's buffers (sglang's pools compute them without checks)."""
        if self.ours:
            m = self.pool.get_page_buffer_meta(idx)
            ptrs, sizes = [self.bases[c] + off for c, off, _ in m], [n for _, _, n in m]
        else:
            import torch

            ptrs, sizes = self.pool.get_page_buffer_meta(torch.tensor(idx, dtype=torch.int64))
            ptrs, sizes = [int(p) for p in ptrs], [int(s) for s in sizes]

        _check_inside(self.regions, ptrs, sizes, f"pool {self.name!r}'s buffers")
        return ptrs, sizes

    def namespace(self, storage_config: Any, extra: Dict[str, Any]) -> Dict[str, Any]:
        dtype = getattr(self.pool, "dtype", None)
        return {
            "format": V2_FORMAT,
            "model": getattr(storage_config, "model_name", None),
            "pool": self.name,
            "class": type(self.pool).__name__,
            "layout": getattr(self.pool, "layout", None),
            "page_size": self.page,
            "dtype": None if dtype is None else str(dtype).replace("torch.", ""),
            "object_bytes": self.sizes,
            "tp_size": getattr(storage_config, "tp_size", 1),
            "namespace": extra.get("hicache_io_namespace"),
        }

    def rank_specific(self, storage_config: Any) -> bool:
        """Whether ranks hold different bytes in this pool (sglang's ``mha_suffix`` pools)."""
        mha_shaped = self.name in ("mamba",) or hasattr(self.pool, "v_buffer") or getattr(self.pool, "kind", None) == "mha"
        return mha_shaped or not bool(getattr(storage_config, "is_mla_model", False))


def _result(kv_hit_pages: int, extra: Dict[str, int], restorable: List[int]) -> Any:
    try:
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        return PoolTransferResult(kv_hit_pages, extra, restorable)
    except ImportError:
        from types import SimpleNamespace

        return SimpleNamespace(kv_hit_pages=kv_hit_pages, extra_pool_hit_pages=extra, restorable_prefix_pages=restorable)


class PoolsV2:
    """The v2 half of :class:`hicache_io.storage.MooncakeStore` (a mixin: it uses the store's
    lock, Mooncake client, key prefix, rank suffixes and failure reporting)."""

    def _v2_init(self) -> None:
        self.registered_pools: Dict[str, Any] = {}
        self._sidecars: Dict[str, _SidecarPool] = {}
        self._sidecar_keys: Dict[str, SidecarKeys] = {}
        self._v2_regions: List[int] = []
        self._v2_trailers: Optional[np.ndarray] = None

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Registers a pool of the host pool group under sglang's ``PoolName`` (the KV anchor
        must be the pool ``register_mem_pool_host`` took)."""

        name = _pool_name(host_pool_name)
        with self._lock:
            if name == "kv":
                if host_pool is not self._pool():
                    raise ValueError("the KV pool of storage v2 must be the pool register_mem_pool_host registered")
                self.registered_pools[name] = host_pool
                return
            if name in self._sidecars:
                raise RuntimeError(f"a {name!r} pool is already registered with this store")
            side = _SidecarPool(host_pool, name)
            trailers = self._v2_trailers
            if trailers is None or len(trailers) < STORAGE_BATCH_SIZE * side.per_page:
                trailers = np.zeros((STORAGE_BATCH_SIZE * side.per_page, 2), "<u8")
            regions = side.regions + ([(trailers.ctypes.data, trailers.nbytes)] if trailers is not self._v2_trailers else [])
            done = self._register_all(regions)
            if trailers is not self._v2_trailers and self._v2_trailers is not None:
                self._io.unregister([self._v2_trailers.ctypes.data])
                self._v2_regions.remove(self._v2_trailers.ctypes.data)
                self._retired.append(self._v2_trailers)
            self._v2_trailers = trailers
            self._v2_regions += done
            record = json.dumps(side.namespace(self.storage_config, self._extra), sort_keys=True).encode()
            rank = self.mha_suffix if side.rank_specific(self.storage_config) else self.mla_suffix
            prefix = f"{self.key_prefix}_" if self.key_prefix else ""
            self._sidecar_keys[name] = SidecarKeys(prefix, rank, name, hashlib.blake2b(record, digest_size=6).hexdigest(), side.per_page)
            self._sidecars[name] = side
            self.registered_pools[name] = host_pool

    def on_host_pools_registered(self) -> None:
        """Called once every pool of the group is registered: the KV anchor must be among them."""
        with self._lock:
            if self.registered_pools and "kv" not in self.registered_pools:
                raise ValueError("storage v2: the host pool group registered no KV pool")

    def _v2_unregister(self) -> None:
        self._io.unregister(self._v2_regions)
        if self._v2_regions:
            self._retired += [self._v2_trailers, *self._sidecars.values()]
        self._v2_init()

    def _side(self, name: str) -> _SidecarPool:
        side = self._sidecars.get(name)
        if side is None:
            raise ValueError(f"Unregistered Mooncake hybrid pool: {name}")
        return side

    def _v2_keys(self, name: str, keys: Sequence[str]) -> List[str]:
        self._side(name)
        return self._sidecar_keys[name].keys(keys)

    # ---- exists ----------------------------------------------------------------------------

    @one_call
    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[Any]] = None, extra_info: Any = None) -> Any:
        """The KV prefix (pages) every pool of ``pool_transfers`` can serve, with each pool's hits
        and every restorable prefix length (sglang's ``PoolTransferResult``)."""
        keys = list(keys)
        kv_pages = self.batch_exists(keys, extra_info)
        hits: Dict[str, int] = {"kv": kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        with self._lock:
            for t in pool_transfers or []:
                if not restorable:
                    break
                name = _pool_name(t.name)
                policy = _pool_name(getattr(t, "hit_policy", "all_pages"))
                if policy not in ("all_pages", "trailing_pages"):
                    raise ValueError(f"hicache-io's Mooncake store serves the all_pages and trailing_pages hit policies, not {policy}")
                if name == "kv":
                    exists = [True] * kv_pages
                else:
                    per = self._side(name).per_page
                    obj = self._v2_keys(name, keys[:kv_pages])
                    res = self._io.exists(obj)
                    exists = [all(r == 1 for r in res[i * per : (i + 1) * per]) for i in range(kv_pages)]
                if policy == "all_pages":
                    boundary = exists.index(False) if False in exists else kv_pages
                    ok = set(range(1, boundary + 1))
                else:
                    window = max(1, len(t.keys) if getattr(t, "keys", None) else 1)
                    ok = {n for n in range(1, kv_pages + 1) if all(exists[max(0, n - window) : n])}
                    boundary = max(ok, default=0)
                if boundary:
                    hits[name] = boundary
                restorable = [n for n in restorable if n in ok]
        return _result(restorable[-1] if restorable else 0, hits, restorable)

    # ---- get / set -------------------------------------------------------------------------

    @one_call
    def batch_set_v2(self, transfers: List[Any], extra_info: Any = None) -> Dict[str, List[bool]]:
        """Writes each transfer's pages (one key per page) from its pool; per pool, one bool per
        key (an object that exists already counts as written)."""
        inner = getattr(extra_info, "extra_info", None) or {}
        return self._v2_io(transfers, put=True, session_id=inner.get("session_id"))

    @one_call
    def batch_get_v2(self, transfers: List[Any], extra_info: Any = None) -> Dict[str, List[bool]]:
        """Reads each transfer's pages into its pool; per pool, one bool per key (``True`` only
        for a page whose every object was read whole and verified)."""
        return self._v2_io(transfers, put=False, session_id=None)

    def _v2_io(self, transfers: List[Any], put: bool, session_id: Optional[str]) -> Dict[str, List[bool]]:

        out: Dict[str, List[bool]] = {}
        for t in transfers:
            name, keys = _pool_name(t.name), list(t.keys or [])
            if name == "kv":
                io = self.batch_set_v1 if put else self.batch_get_v1
                out[name] = io(keys, t.host_indices)
                continue
            with self._lock:
                side = self._side(name)
                try:
                    idx = _host_list(t.host_indices).tolist()
                    if len(idx) != len(keys) * side.page:
                        raise ValueError(f"{len(keys)} pages need {len(keys) * side.page} host indices, got {len(idx)}")
                    if idx:
                        side.meta(idx)
                except Exception as e:  # noqa: BLE001 - sglang's per-page False
                    self._fail(StorageError("batch_set_v2" if put else "batch_get_v2", REFUSED, keys, detail=str(e)))
                    out[name] = [False] * len(keys)
                    continue
                if self._foreign:
                    self.stats["foreign"] += len(keys)
                    out[name] = [False] * len(keys)
                    continue

                def run(ks: List[str], hi: List[int]) -> List[bool]:
                    res: List[bool] = []
                    for at in range(0, len(ks), STORAGE_BATCH_SIZE):
                        part = ks[at : at + STORAGE_BATCH_SIZE]
                        res += self._v2_batch(name, side, part, hi[at * side.page : (at + len(part)) * side.page], put, session_id)
                    return res

                out[name] = in_rounds(keys, idx, side.page, run)
        return out

    def _v2_batch(self, name: str, side: _SidecarPool, keys: List[str], idx: List[int], put: bool, session_id: Optional[str]) -> List[bool]:
        what = "batch_set_v2" if put else "batch_get_v2"
        try:
            place = SidecarPages(side, idx, len(keys), self._v2_trailers)
        except ValueError as e:
            self._fail(StorageError(what, REFUSED, keys, detail=str(e)))
            return [False] * len(keys)
        obj = self._v2_keys(name, keys)
        if put:
            return put_pages(self, what, keys, obj, place, (lambda n: self._v2_config(session_id, n)) if session_id else None)
        return get_pages(self, what, keys, obj, place)

    def _v2_config(self, session_id: Optional[str], n: int) -> Any:
        """Mooncake's put config naming the writing session, where this Mooncake has the field
        (sglang's Mooncake backend publishes it on its KV events)."""
        if not session_id:
            return None
        try:
            from .l3.mooncake_client import store_module

            config = store_module().ReplicateConfig()
        except (ImportError, AttributeError):
            return None
        if not hasattr(config, "session_ids"):
            logger.debug("this Mooncake's ReplicateConfig has no session_ids: session %s not recorded", session_id)
            return None
        config.session_ids = [session_id] * n
        return config
