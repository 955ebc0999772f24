"""sglang's storage v2 for the L3 stores (:class:`hicache_io.l3.store.PageStore`): every pool of a hybrid host
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
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from .batches import in_rounds
from .config import STORAGE_BATCH_SIZE
from .errors import REFUSED, StorageError
from .keys import SidecarKeys
from .layouts import check_inside as _check_inside
from .layouts import host_list as _host_list
from .pipeline import StoreCalls, get_pages, put_pages
from .placements import SidecarPages

logger = logging.getLogger(__name__)

#: Key format of v2 objects (part of the namespace digest).
V2_FORMAT = 1


def pool_name(name: Any) -> str:
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


def transfer_result(kv_hit_pages: int, extra: Dict[str, int], restorable: List[int]) -> Any:
    try:
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        return PoolTransferResult(kv_hit_pages, extra, restorable)
    except ImportError:
        from types import SimpleNamespace

        return SimpleNamespace(kv_hit_pages=kv_hit_pages, extra_pool_hit_pages=extra, restorable_prefix_pages=restorable)


class SidecarPools:
    """The v2 pools a store registered beside its KV pool (not the KV pool itself): their objects'
    keys, the buffers registered for them, and their page calls. The store owns it and calls it
    under its own lock; ``calls`` is what the store lends its pipelines, ``retire`` keeps memory
    the client may still write until the client has closed."""

    def __init__(self, calls: StoreCalls, retire: Callable[[List[Any]], None], storage_config: Any, extra: Dict[str, Any]):
        self.calls, self.retire = calls, retire
        self.storage_config, self.extra = storage_config, extra
        self._pools: Dict[str, _SidecarPool] = {}
        self._keys: Dict[str, SidecarKeys] = {}
        self._regions: List[int] = []
        self._trailers: Optional[np.ndarray] = None

    def register(self, host_pool: Any, name: str, prefix: str, mha_suffix: str, mla_suffix: str) -> None:
        """Registers pool ``name``'s buffers with the client and names its objects: ``prefix``
        (``""`` or ending in ``_``) and the rank suffixes are the store's as the pool registers,
        as its KV pages' are."""
        if name in self._pools:
            raise RuntimeError(f"a {name!r} pool is already registered with this store")
        side = _SidecarPool(host_pool, name)
        trailers = self._trailers
        if trailers is None or len(trailers) < STORAGE_BATCH_SIZE * side.per_page:
            trailers = np.zeros((STORAGE_BATCH_SIZE * side.per_page, 2), "<u8")
        regions = side.regions + ([(trailers.ctypes.data, trailers.nbytes)] if trailers is not self._trailers else [])
        done = self.calls.io.register(regions)
        if trailers is not self._trailers and self._trailers is not None:
            self.calls.io.unregister([self._trailers.ctypes.data])
            self._regions.remove(self._trailers.ctypes.data)
            self.retire([self._trailers])
        self._trailers = trailers
        self._regions += done
        record = json.dumps(side.namespace(self.storage_config, self.extra), sort_keys=True).encode()
        rank = mha_suffix if side.rank_specific(self.storage_config) else mla_suffix
        self._keys[name] = SidecarKeys(prefix, rank, name, hashlib.blake2b(record, digest_size=6).hexdigest(), side.per_page)
        self._pools[name] = side

    def unregister(self) -> None:
        """Unregisters every pool's memory (kept until the client closes) and forgets the pools."""
        self.calls.io.unregister(self._regions)
        if self._regions:
            self.retire([self._trailers, *self._pools.values()])
        self._pools, self._keys, self._regions, self._trailers = {}, {}, [], None

    def side(self, name: str) -> _SidecarPool:
        side = self._pools.get(name)
        if side is None:
            raise ValueError(f"Unregistered Mooncake hybrid pool: {name}")
        return side

    def object_keys(self, name: str, keys: Sequence[str]) -> List[str]:
        """Every object key of pool ``name``'s pages ``keys``, page by page."""
        self.side(name)
        return self._keys[name].keys(keys)

    def exists(self, name: str, keys: Sequence[str]) -> List[bool]:
        """Per page of pool ``name``: whether every object of it is stored."""
        per = self.side(name).per_page
        res = self.calls.io.exists(self.object_keys(name, keys))
        return [all(r == 1 for r in res[i * per : (i + 1) * per]) for i in range(len(keys))]

    def checked(self, name: str, keys: List[str], host_indices: Any, what: str) -> Optional[List[int]]:
        """The host indices of pool ``name``'s pages, checked against the keys and the pool
        before any byte moves (``None``, the failure reported, when refused)."""
        side = self.side(name)
        try:
            idx = _host_list(host_indices).tolist()
            if len(idx) != len(keys) * side.page:
                raise ValueError(f"{len(keys)} pages need {len(keys) * side.page} host indices, got {len(idx)}")
            if idx:
                side.meta(idx)
            return idx
        except Exception as e:  # noqa: BLE001 - sglang's per-page False
            self.calls.fail(StorageError(what, REFUSED, keys, detail=str(e)))
            return None

    def move(self, name: str, keys: List[str], idx: List[int], put: bool, session_id: Optional[str]) -> List[bool]:
        """Writes (``put``) or reads pool ``name``'s pages ``keys`` at checked host indices
        ``idx``; one bool per page."""
        side = self.side(name)

        def run(ks: List[str], hi: List[int]) -> List[bool]:
            res: List[bool] = []
            for at in range(0, len(ks), STORAGE_BATCH_SIZE):
                part = ks[at : at + STORAGE_BATCH_SIZE]
                res += self._batch(name, side, part, hi[at * side.page : (at + len(part)) * side.page], put, session_id)
            return res

        return in_rounds(keys, idx, side.page, run)

    def _batch(self, name: str, side: _SidecarPool, keys: List[str], idx: List[int], put: bool, session_id: Optional[str]) -> List[bool]:
        what = "batch_set_v2" if put else "batch_get_v2"
        try:
            place = SidecarPages(side, idx, len(keys), self._trailers)
        except ValueError as e:
            self.calls.fail(StorageError(what, REFUSED, keys, detail=str(e)))
            return [False] * len(keys)
        obj = self.object_keys(name, keys)
        if put:
            return put_pages(self.calls, what, keys, obj, place, (lambda n: _put_config(session_id, n)) if session_id else None)
        return get_pages(self.calls, what, keys, obj, place)


def _put_config(session_id: Optional[str], n: int) -> Any:
    """Mooncake's put config naming the writing session, where this Mooncake has the field
    (sglang's Mooncake backend publishes it on its KV events)."""
    if not session_id:
        return None
    try:
        from .mooncake_client import store_module

        config = store_module().ReplicateConfig()
    except (ImportError, AttributeError):
        return None
    if not hasattr(config, "session_ids"):
        logger.debug("this Mooncake's ReplicateConfig has no session_ids: session %s not recorded", session_id)
        return None
    config.session_ids = [session_id] * n
    return config
