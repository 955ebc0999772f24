"""L3 storage: host-pool pages to and from Mooncake Store (:class:`MooncakeStore`) or a local
directory (:class:`LocalStore`, no server), as sglang's HiCache L3 tier moves them.

:class:`MooncakeStore` implements sglang's ``HiCacheStorage`` interface (it subclasses sglang's
class when sglang is importable, so ``--hicache-storage-backend dynamic`` loads it unchanged) over
a Mooncake Store client: ``register_mem_pool_host(pool)``, ``batch_exists``, ``batch_set_v1`` /
``batch_get_v1`` (zero-copy, page ``i`` read from or written to host slots
``host_indices[i * P : (i + 1) * P]``) and the plain ``get`` / ``set`` / ``exists`` forms; and
sglang's storage v2 for hybrid host pool groups (Mamba states, the DSA indexer, drafts, …), whose
keys and objects :mod:`hicache_io.storage_v2` describes.

Zero copy: the pool's buffers are registered with the store once; puts and gets then go straight
from and to page spans (``batch_put_from`` / ``batch_get_into``). That holds for host pools in this
process's memory (the cpu executor, and cuda's pinned host pools). wgpu keeps host pools in its
own buffers, mapped only between submissions: there pages pass through one registered staging
buffer of ``STORAGE_BATCH_SIZE`` pages (one copy per page each way).

Keys and namespaces (which object names a page, and how a page written under another meaning
reads as a miss): :mod:`hicache_io.l3.keys`. Integrity (the trailer each of hicache-io's own
objects ends in, checked at every get): :mod:`hicache_io.l3.trailer`. ``integrity_stats()`` counts
verified, unverified and corrupt objects (``get_stats()`` is sglang's metrics hook and returns
``None``).

Return conventions are sglang's: ``batch_set_v1`` / ``batch_get_v1`` give one bool per page (an
object that already exists counts as written), ``batch_exists`` the number of leading pages whose
objects all exist. A failure is also kept as :attr:`MooncakeStore.last_error`, a
:class:`StorageError` naming Mooncake's error code; ``raise_errors=True`` raises it instead. A
page whose get fails may have been partly written in its host slots (they are the prefetch's
targets, which the caller does not use for a failed page); no other slot is touched.

The store keeps the registered pool alive until :meth:`MooncakeStore.unregister_mem_pool_host` or
:meth:`MooncakeStore.close`, which wait for a page call in progress (one lock), so the pool's memory
cannot be freed while Mooncake may still write to it. Memory it registered with Mooncake (the pool,
its staging and trailer buffers) is released only when the Mooncake client has closed: unregistering
a buffer does not wait for Mooncake's transfers, and a batch call that fails or times out can return
while its other transfers still write into their buffers; freed and mapped again (as a thread's
stack, say), that memory would take those late bytes. A store dropped without :meth:`close`
closes its client before its buffers go. Calls must not overlap transfers of the same
pool (sglang's controller orders them); each waits for the pool's queued transfers first. Bad
arguments (host indices outside the pool or not on page starts, a count that is not ``P`` per key)
fail every page of the call before anything moves, with ``last_error`` set, rather than raise into
sglang's storage threads.
"""

import hashlib
import json
import logging
import threading
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .l3.batches import CallScope, exist_once, in_rounds, one_call
from .l3.config import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo, MooncakeStoreConfig, StoreSettings
from .l3.config import size_of as _size
from .l3.errors import INTEGRITY, MOONCAKE_ERRORS, REFUSED, SHORT_READ, StorageError
from .l3.keys import claim_namespace, namespace_key, namespace_of, page_object_keys, shard_descriptor
from .l3.layouts import PoolLayout as _Layout
from .l3.layouts import SglangLayout as _SglangLayout  # noqa: F401 (the name it had)
from .l3.layouts import check_inside as _check_inside  # noqa: F401 (the name it had)
from .l3.layouts import host_list as _host_list
from .l3.layouts import sglang_indices as _sglang_indices  # noqa: F401 (the name it had)
from .l3.master import LocalMaster
from .l3.mooncake_client import open_client, register_all
from .l3.objects import get_object, set_object
from .l3.trailer import OLD_TRAILER_MAGICS, TRAILER_MAGIC, seal, verify
from .l3.trailer import name_tag as _name_tag  # noqa: F401 (the name it had)
from .l3.trailer import name_tags as _name_tags
from .storage_unified import KEY_SCHEMES, UnifiedKeys
from .storage_v2 import PoolsV2

logger = logging.getLogger(__name__)

__all__ = ["MooncakeStore", "LocalStore", "MooncakeStoreConfig", "StorageError", "LocalMaster", "SHORT_READ", "REFUSED", "INTEGRITY", "TRAILER_MAGIC", "HiCacheStorage", "HiCacheStorageConfig", "HiCacheStorageExtraInfo", "STORAGE_BATCH_SIZE", "MOONCAKE_ERRORS"]

#: Pages per storage call in sglang's controller (and the staging buffer's size in pages).
STORAGE_BATCH_SIZE = 128

#: Checksummed objects up to this size move through a staging buffer with their trailer as one
#: span (Mooncake's single-buffer calls; its two-buffer calls cost a quarter or more of the
#: throughput at page sizes): the copy costs a tenth of an 8448-byte object's round trip.
SEALED_MAX_OBJECT = 64 << 10




class MooncakeStore(PoolsV2, UnifiedKeys, HiCacheStorage):
    """sglang's HiCache L3 storage over Mooncake Store, for hicache-io host pools (see the module
    docstring). ``MooncakeStore(storage_config, kwargs)`` is how sglang's ``dynamic`` backend
    constructs it; ``store=`` takes an already set-up ``MooncakeDistributedStore``."""

    def __init__(self, storage_config: Optional[Any] = None, kwargs: Optional[Dict[str, Any]] = None, *, config: Optional[MooncakeStoreConfig] = None, store: Any = None, raise_errors: bool = False, integrity: Optional[bool] = None):
        self.storage_config = storage_config if storage_config is not None else HiCacheStorageConfig()
        st = StoreSettings.read(self.storage_config, kwargs, integrity, KEY_SCHEMES)
        self._extra = extra = st.extra
        self.config = config if config is not None else MooncakeStoreConfig.load(extra)
        self.raise_errors = raise_errors
        #: The last failure of the most recent call to finish (``None`` when it had none).
        self.last_error: Optional[StorageError] = None
        self._calls = CallScope()
        self.key_prefix, self.mha_suffix, self.mla_suffix, self.integrity = st.key_prefix, st.mha_suffix, st.mla_suffix, st.integrity
        self._sglang_keys, self._namespace_record, self._unified = st.sglang_keys_any_layout, st.namespace_record, st.unified
        self._lock = threading.RLock()
        self._layout: Any = None
        self._descriptor: Optional[str] = None
        #: The registered pool's namespace (see the module docstring), ``None`` before.
        self.namespace: Optional[Dict[str, Any]] = None
        # Whether the sglang-named objects under this prefix belong to another namespace.
        self._foreign = False
        # Topology-free keys (hicache_io.storage_unified): the registered pool's share of the grid.
        self._grid: Any = None
        self._trailers: Optional[np.ndarray] = None
        self.stats = {"verified": 0, "unverified": 0, "corrupt": 0, "damaged_puts": 0, "foreign": 0, "incompatible": 0}
        self.mem_pool_host: Any = None
        # What owned memory registered with the client (pools, staging and trailer buffers) after
        # it was unregistered: kept until the client has closed (see the module docstring). It
        # grows with each re-registration until close(), by design: a pool re-registered is rare,
        # and a buffer Mooncake may still write must not be freed.
        self._retired: List[Any] = []
        self._v2_init()
        self._registered: List[int] = []
        self._staging: Optional[np.ndarray] = None
        # Checksummed objects of at most SEALED_MAX_OBJECT bytes move through a staging buffer
        # (`_sealed`: object j and its trailer at byte j * `_seal_stride`, the trailers viewed
        # as `_seal_t`) as one span each, with Mooncake's single-buffer calls.
        self._sealed: Optional[np.ndarray] = None
        self._seal_t: Optional[np.ndarray] = None
        self._seal_stride = 0
        self.store = store if store is not None else open_client(self.config, self.storage_config)

    # ---- the pool ------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Registers the pool's buffers with the store (once; zero-copy from then on) and keeps
        the pool alive until unregistered. Takes a hicache-io ``HostPool`` or one of sglang's
        plain KV host pools (MHA, MLA). ``layer_first`` pools are refused: their page is one span
        per layer, not one object."""
        with self._lock:
            if self.mem_pool_host is not None:
                raise RuntimeError("a host pool is already registered with this store; unregister it first")
            if self._unified:
                return self._register_unified(mem_pool_host)
            layout = mem_pool_host.layout
            ours = hasattr(mem_pool_host, "host_span")
            mla = mem_pool_host.kind != "mha" if ours else bool(getattr(self.storage_config, "is_mla_model", False))
            if layout == "layer_first":
                if not mla:
                    raise ValueError("Mooncake layer_first multi-buffer is only supported for MLA host KV pool. Use page_first/page_first_direct for MHA.")
                raise ValueError("hicache-io's Mooncake store moves pages that are one span per component; layer_first pages are one span per layer (use page_first or page_first_direct)")
            lay = _Layout(mem_pool_host) if ours else _SglangLayout(mem_pool_host, mla)
            lay.synchronize()
            regions = [r for r in lay.regions if r[1] > 0]
            staging = None
            if not lay.zero_copy:
                staging = np.zeros(STORAGE_BATCH_SIZE * lay.comps * lay.obj_bytes, np.uint8)
                regions = [(staging.ctypes.data, staging.nbytes)]
            namespace = self._namespace_of(mem_pool_host, lay)
            record = json.dumps(namespace, sort_keys=True).encode()
            digest = hashlib.blake2b(record, digest_size=6).hexdigest()
            descriptor = self._shard_descriptor(mem_pool_host) if ours else None
            if descriptor is not None:
                descriptor += f"-n{digest}"
            # Checksum trailers for hicache-io's own objects (read back whatever ``integrity`` says,
            # so a store with checksums off still reads objects that carry them); sglang-named
            # objects keep sglang's shape, its readers expecting the page's bytes exactly.
            trailers = np.zeros((STORAGE_BATCH_SIZE * lay.comps, 2), "<u8") if ours and descriptor is not None else None
            if trailers is not None:
                regions = regions + [(trailers.ctypes.data, trailers.nbytes)]
            sealed, stride = None, 0
            if trailers is not None and lay.zero_copy and lay.obj_bytes <= SEALED_MAX_OBJECT and hasattr(mem_pool_host, "_stage_put"):
                stride = -(-(lay.obj_bytes + 16) // 64) * 64
                sealed = np.zeros(STORAGE_BATCH_SIZE * lay.comps * stride, np.uint8)
                regions = regions + [(sealed.ctypes.data, sealed.nbytes)]
            done = self._register_all(regions)
            self._sealed, self._seal_stride = sealed, stride
            self._seal_t = sealed.reshape(-1, stride)[:, lay.obj_bytes : lay.obj_bytes + 16].view("<u8") if sealed is not None else None
            self._registered, self._staging, self._layout, self.mem_pool_host = done, staging, lay, mem_pool_host
            self._descriptor, self._trailers = descriptor, trailers
            self.namespace, self._foreign = namespace, False
            if descriptor is None and self._namespace_record:
                self._foreign = not self._claim_namespace(record)

    def _register_all(self, regions: Sequence[Any]) -> List[int]:
        return register_all(self.store, regions)

    def _namespace_of(self, pool: Any, lay: Any) -> Dict[str, Any]:
        """What the registered pool's page bytes mean (:func:`hicache_io.l3.keys.namespace_of`)."""
        return namespace_of(pool, lay, self.storage_config, self._extra)

    def _shard_descriptor(self, pool: Any) -> Optional[str]:
        return shard_descriptor(pool, self._sglang_keys)

    def _claim_namespace(self, record: bytes) -> bool:
        """Whether the sglang-named objects under this prefix and rank belong to the namespace
        ``record`` (:func:`hicache_io.l3.keys.claim_namespace`)."""
        prefix = f"{self.key_prefix}_" if self.key_prefix else ""
        rank = self.mha_suffix if self._layout.kind == "mha" else self.mla_suffix
        return claim_namespace(self.store, namespace_key(prefix, rank), record)

    def unregister_mem_pool_host(self) -> None:
        """Unregisters the pool's memory and lets the pool go (waits for a call in progress)."""
        with self._lock:
            self._v2_unregister()
            for addr in self._registered:
                self.store.unregister_buffer(addr)
            if self._registered:
                self._retired += [self.mem_pool_host, self._layout, self._grid, self._staging, self._sealed, self._trailers]
            self._registered, self._staging, self.mem_pool_host = [], None, None
            self._sealed, self._seal_t, self._seal_stride = None, None, 0
            self._layout, self._descriptor, self._trailers, self._grid = None, None, None, None
            self.namespace, self._foreign = None, False

    def _pool(self) -> Any:
        if self.mem_pool_host is None:
            raise RuntimeError("no host pool is registered with this store (call register_mem_pool_host first)")
        return self.mem_pool_host

    # ---- keys ----------------------------------------------------------------------------

    def object_keys(self, key: str) -> List[str]:
        """The store keys of page ``key``'s objects, K before V."""
        with self._lock:
            return self._object_keys([key])

    def _object_keys(self, keys: Sequence[str]) -> List[str]:
        """Every object key of ``keys``' pages, page by page, K before V."""
        self._pool()
        lay = self._layout
        prefix = f"{self.key_prefix}_" if self.key_prefix else ""
        if self._grid is not None:
            return self._grid.keys(prefix, keys)
        rank = self.mha_suffix if lay.kind == "mha" else self.mla_suffix
        return page_object_keys(keys, prefix, rank, self._descriptor, lay.kind, lay.comps)

    def _fail(self, err: StorageError) -> None:
        self._calls.error = err
        self.last_error = err
        logger.debug("%s", err)
        if self.raise_errors:
            raise err

    # ---- zero-copy pages (sglang's v1 interface) -------------------------------------------

    def _checked(self, what: str, keys: List[str], host_indices: Any) -> Optional[Any]:
        """The host indices as values, checked against the keys and the pool before any byte
        moves (``None``, with ``last_error`` set, when refused)."""
        self._pool()
        lay = self._layout
        try:
            idx = _host_list(host_indices)
            if len(idx) != len(keys) * lay.page:
                raise ValueError(f"{len(keys)} pages need {len(keys) * lay.page} host indices, got {len(idx)}")
            if len(idx):
                lay.validate(idx)
            return idx
        except Exception as e:  # noqa: BLE001 - turned into sglang's per-page False
            self._fail(StorageError(what, REFUSED, keys, detail=str(e)))
            return None

    def _page_lists(self, keys: List[str], idx: Any) -> "tuple[List[str], List[int], int]":
        lay = self._layout
        obj_keys = self._object_keys(keys)
        lay.synchronize()
        if lay.zero_copy:
            ptrs = [p for page in lay.spans(idx) for p in page]
        else:
            base = self._staging.ctypes.data
            ptrs = [base + j * lay.obj_bytes for j in range(len(obj_keys))]
        return obj_keys, ptrs, lay.obj_bytes

    def _batches(self, keys: List[str], idx: Any):
        p = self._layout.page
        for at in range(0, len(keys), STORAGE_BATCH_SIZE):
            yield keys[at : at + STORAGE_BATCH_SIZE], idx[at * p : (at + STORAGE_BATCH_SIZE) * p]

    def _paged(self, what: str, keys: Sequence[str], host_indices: Any, per_batch: Any) -> List[bool]:
        """One page call: arguments checked once, then ``per_batch`` over sglang's batches."""
        keys = list(keys)
        with self._lock:
            idx = self._checked(what, keys, host_indices)
            if idx is None:
                return [False] * len(keys)
            if self._foreign:
                self.stats["foreign"] += len(keys)
                return [False] * len(keys)
            if self._grid is not None and self._grid.missing:
                self.stats["incompatible"] += len(keys)
                return [False] * len(keys)

            def run(ks: List[str], hi: Any) -> List[bool]:
                out: List[bool] = []
                for bks, bhi in self._batches(ks, hi):
                    out += per_batch(bks, bhi)
                return out

            return in_rounds(keys, idx, self._layout.page, run)

    def _pages_ok(self, ok: List[bool], pages: int) -> List[bool]:
        """Per page: every one of its objects ``ok``."""
        c = self._layout.comps
        if c == 1:
            return [bool(x) for x in ok[:pages]]
        return np.asarray(ok[: pages * c], dtype=bool).reshape(pages, c).all(axis=1).tolist()

    @one_call
    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Writes page ``i`` (host slots ``host_indices[i * P : (i + 1) * P]``) under ``keys[i]``;
        objects that exist already are left as they are and count as written."""
        return self._paged("batch_set_v1", keys, host_indices, self._set_batch_unified if self._unified else self._set_batch)

    def _set_batch(self, keys: List[str], idx: Any) -> List[bool]:
        lay = self._layout
        if self._sealed is not None and self.integrity:
            # Through the staging buffer: no object addresses in the pool needed (the staging
            # pass waits for the pool's transfers itself).
            obj_keys = self._object_keys(keys)
            return self._guarded_set(keys, obj_keys, lambda ok: self._put_sealed(keys, idx, obj_keys, list(range(len(obj_keys))), lay.obj_bytes, ok))
        obj_keys, ptrs, size = self._page_lists(keys, idx)

        def put(ok: List[bool]) -> None:
            if lay.zero_copy:
                # Mooncake answers a put of an existing object with success and moves nothing, so
                # the existence query sglang's backend makes first (one more round trip) is skipped.
                todo = list(range(len(obj_keys)))
            else:
                # Here the query saves the staging copy of pages already stored.
                exist = self.store.batch_is_exist(obj_keys)
                if len(exist) != len(obj_keys):
                    raise StorageError("batch_is_exist", REFUSED, keys, detail=f"{len(exist)} answers for {len(obj_keys)} objects")
                todo = [j for j, e in enumerate(exist) if e != 1]
                for j, e in enumerate(exist):
                    ok[j] = e == 1
                lay.stage_out(self._staging, sorted({j // lay.comps for j in todo}), idx)
            sums = None
            if todo and self.integrity and getattr(self.mem_pool_host, "integrity", False):
                if self._trailers is not None and lay.zero_copy and hasattr(self.mem_pool_host, "put_checksums"):
                    # The objects' checksums and the pages' item checks in one read of the pages.
                    sums, intact = self.mem_pool_host.put_checksums(idx)
                    todo = self._drop_damaged(keys, idx, todo, lay.comps, intact)
                else:
                    todo = self._drop_damaged(keys, idx, todo, lay.comps)
            if todo and self._trailers is not None and self.integrity:
                sums = np.asarray(sums, dtype="<u8") if sums is not None else self._sums(obj_keys, idx, lay.zero_copy)
                base = self._fill_trailers(obj_keys, sums, todo)
                rcs = self.store.batch_put_from_multi_buffers(
                    [obj_keys[j] for j in todo], [[ptrs[j], base + 16 * n] for n, j in enumerate(todo)], [[size, 16]] * len(todo)
                )
            else:
                rcs = self.store.batch_put_from([obj_keys[j] for j in todo], [ptrs[j] for j in todo], [size] * len(todo)) if todo else []
            self._put_results("batch_put_from", keys, obj_keys, todo, rcs, ok)

        return self._guarded_set(keys, obj_keys, put)

    def _put_sealed(self, keys: List[str], idx: Any, obj_keys: List[str], todo: List[int], size: int, ok: List[bool]) -> None:
        """Puts objects ``todo`` with their trailers through the staging buffer: one read of the
        pages copies them there and checksums them (and checks them against the item checksums
        their backup recorded), then each object and its trailer go as one span."""
        S, stride, t = self._sealed, self._seal_stride, self._seal_t
        base = S.ctypes.data
        sums, intact = self.mem_pool_host._stage_put(idx, base, S.nbytes, stride)
        sums = np.asarray(sums, dtype="<u8")
        if getattr(self.mem_pool_host, "integrity", False) and not all(intact):
            todo = self._drop_damaged(keys, idx, todo, self._layout.comps, intact)
        rcs: Sequence[int] = []
        if todo:
            pick = np.asarray(todo, dtype=np.intp)
            t[pick, 0] = TRAILER_MAGIC
            t[pick, 1] = sums[pick] ^ _name_tags(obj_keys)[pick]
            rcs = self.store.batch_put_from([obj_keys[j] for j in todo], [base + stride * j for j in todo], [size + 16] * len(todo))
        self._put_results("batch_put_from", keys, obj_keys, todo, rcs, ok)

    def _guarded_set(self, keys: List[str], obj_keys: List[str], put: Any) -> List[bool]:
        """Per page of a set batch: ``put(ok)`` marks the objects it wrote; a failure that escapes
        it (Mooncake's, or a checksum pass) fails every page of the batch."""
        ok = [False] * len(obj_keys)
        try:
            put(ok)
        except StorageError as e:
            ok = [False] * len(obj_keys)
            self._fail(e)
        except Exception as e:  # noqa: BLE001 - a checksum pass that failed: no page is written
            ok = [False] * len(obj_keys)
            self._fail(StorageError("batch_set_v1", REFUSED, keys, detail=str(e)))
        return self._pages_ok(ok, len(keys))

    def _drop_damaged(self, keys: List[str], idx: Any, todo: List[int], per: int, intact: Optional[List[bool]] = None) -> List[int]:
        """``todo`` (object numbers, ``per`` a page) without the objects of pages whose host bytes
        no longer match the item checksums their backup recorded (``intact``, per page, where the
        caller has it): a fault in host memory must not reach storage under a trailer of its own.
        Those pages read as not written."""
        if intact is None:
            intact = self.mem_pool_host.pages_intact(idx)
        damaged = sorted({j // per for j in todo if not intact[j // per]})
        if damaged:
            self.stats["damaged_puts"] += len(damaged)
            logger.error("hicache-io L3: %d page(s) not put, their host bytes fail their checksums: %s", len(damaged), [keys[i] for i in damaged])
        return [j for j in todo if intact[j // per]]

    def _fill_trailers(self, obj_keys: List[str], sums: np.ndarray, todo: List[int]) -> int:
        return seal(self._trailers, obj_keys, sums, todo)

    def _put_results(self, what: str, keys: List[str], obj_keys: List[str], todo: List[int], rcs: Sequence[int], ok: List[bool]) -> None:
        """Marks the objects ``todo`` written where Mooncake answered 0; keeps the first failure."""
        if len(rcs) != len(todo):
            raise StorageError(what, REFUSED, keys, detail=f"{len(rcs)} answers for {len(todo)} objects")
        bad = []
        for j, rc in zip(todo, rcs):
            ok[j] = rc == 0
            if rc != 0:
                bad.append((obj_keys[j], rc))
        if bad:
            self._fail(StorageError(what, bad[0][1], [k for k, _ in bad]))

    def _sums(self, obj_keys: List[str], idx: Any, in_pool: bool) -> np.ndarray:
        """The checksum of each object of the batch: from the pool pages (zero copy), or from
        the staging buffer where the bytes that move are (wgpu)."""
        if in_pool:
            return np.asarray(self.mem_pool_host.object_checksums(idx), dtype="<u8")
        from . import _native

        n = self._layout.obj_bytes
        return np.asarray([_native.checksum(self._staging[j * n : (j + 1) * n]) for j in range(len(obj_keys))], dtype="<u8")

    @one_call
    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Reads page ``keys[i]`` into host slots ``host_indices[i * P : (i + 1) * P]``; a page is
        ``True`` only when every object of it was read whole."""
        return self._paged("batch_get_v1", keys, host_indices, self._get_batch_unified if self._unified else self._get_batch)

    def _get_batch(self, keys: List[str], idx: Any) -> List[bool]:
        lay = self._layout
        try:
            return self._get_batch_into(keys, idx)
        except BaseException:
            # A get that raised (``raise_errors=True``, or Mooncake itself) may have written any
            # of these pages in place: the pool's item checksums of all of them are forgotten.
            if lay.zero_copy and hasattr(lay, "landed"):
                lay.landed(idx, [False] * len(keys))
            raise

    def _get_batch_into(self, keys: List[str], idx: Any) -> List[bool]:
        if self._sealed is not None and self.integrity:
            return self._get_sealed(keys, idx)
        lay = self._layout
        obj_keys, ptrs, size = self._page_lists(keys, idx)
        t = self._trailers
        n_obj = len(obj_keys)
        tb = t.ctypes.data if t is not None else 0
        two = lambda js: self.store.batch_get_into_multi_buffers(  # noqa: E731
            [obj_keys[j] for j in js], [[ptrs[j], tb + 16 * j] for j in js], [[size, 16]] * len(js)
        )
        one = lambda js: self.store.batch_get_into([obj_keys[j] for j in js], [ptrs[j] for j in js], [size] * len(js))  # noqa: E731
        everything = list(range(n_obj))
        if t is not None:
            t[:n_obj] = 0
        # The form this store writes first; the other for objects written the other way (Mooncake
        # refuses a buffer of another total size: -800 for two buffers, -600 for one).
        if t is None:
            got, forms = one(everything), None
        elif self.integrity:
            got, forms = two(everything), (-800, one, size)
        else:
            got, forms = one(everything), (-600, two, size + 16)
        if len(got) != n_obj:
            self._fail(StorageError("batch_get_into", REFUSED, keys, detail=f"{len(got)} answers for {n_obj} objects"))
            if lay.zero_copy and hasattr(lay, "landed"):
                lay.landed(idx, [False] * len(keys))
            return [False] * len(keys)
        whole = size + 16 if t is not None and self.integrity else size
        ok = [n == whole for n in got]
        unverified = [False] * n_obj
        if forms is not None:
            code, other, other_whole = forms
            retry = [j for j, n in enumerate(got) if n == code]
            again = other(retry) if retry else []
            for j, n in zip(retry, again if len(again) == len(retry) else []):
                if n == other_whole:
                    got[j], ok[j] = n, True
                    # Read without its trailer (checksums on) or with it (checksums off).
                    unverified[j] = self.integrity
        bad = [(obj_keys[j], got[j]) for j in range(len(obj_keys)) if not ok[j]]
        if bad:
            code = bad[0][1] if bad[0][1] < 0 else SHORT_READ
            self._fail(StorageError("batch_get_into", code, [k for k, _ in bad]))
        settled = False
        if t is not None and self.integrity:
            try:
                if lay.zero_copy and hasattr(lay, "landed") and hasattr(self.mem_pool_host, "landed_checksums"):
                    # The objects' checksums and the pool's item checksums of the pages that
                    # landed, in one read: a page whose objects were all read whole with this
                    # format's trailer and match it is recorded, every other page forgotten.
                    expected = t[:n_obj, 1] ^ _name_tags(obj_keys)
                    eligible = [ok[j] and not unverified[j] and int(t[j, 0]) == TRAILER_MAGIC for j in range(n_obj)]
                    sums = np.asarray(self.mem_pool_host.landed_checksums(idx, expected.tolist(), eligible), dtype="<u8")
                    settled = True
                else:
                    sums = self._sums(obj_keys, idx, lay.zero_copy)
                self._verify(obj_keys, sums, ok, unverified)
            except Exception as e:  # noqa: BLE001 - a checksum pass that failed: trust no page
                ok = [False] * len(obj_keys)
                self._fail(StorageError("batch_get_v1", INTEGRITY, keys, detail=f"could not verify: {e}"))
        pages = self._pages_ok(ok, len(keys))
        per = lay.comps
        sound = [ok[j] and not unverified[j] and t is not None and self.integrity for j in range(n_obj)]
        trusted = [all(sound[i * per : (i + 1) * per]) for i in range(len(keys))]
        if not lay.zero_copy:
            lay.stage_in(self._staging, pages, idx, trusted)
        elif hasattr(lay, "landed") and not settled:
            lay.landed(idx, [p and v for p, v in zip(pages, trusted)])
        return pages

    def _get_sealed(self, keys: List[str], idx: Any) -> List[bool]:
        """Reads each object and its trailer as one span into the staging buffer, then one pass
        copies the objects read whole into the pool, checksums them and settles the pool's item
        checksums (recorded for pages that verify, forgotten for the others). Objects stored
        without a trailer (by a store with checksums off) are read into the pool as unverified.
        Per-object bookkeeping in numpy (a Python loop per object cost a fifth of the call)."""
        lay, S, stride, t = self._layout, self._sealed, self._seal_stride, self._seal_t
        obj_keys = self._object_keys(keys)
        size = lay.obj_bytes
        lay.synchronize()
        base, n = S.ctypes.data, len(obj_keys)
        t[:n] = 0
        got = self.store.batch_get_into(obj_keys, (base + stride * np.arange(n, dtype=np.int64)).tolist(), [size + 16] * n)
        if len(got) != n:
            self._fail(StorageError("batch_get_into", REFUSED, keys, detail=f"{len(got)} answers for {n} objects"))
            lay.landed(idx, [False] * len(keys))
            return [False] * len(keys)
        got = np.asarray(got, dtype=np.int64)
        # An object stored without a trailer (by a store with checksums off) lands whole, with
        # its own size: unverified. Both land in the staging buffer.
        write = (got == size + 16) | (got == size)
        ok = write.copy()
        unverified = got == size
        # Were Mooncake to refuse a buffer of another size (-600, as it does before a copy into
        # one of its own): read such objects into the pool, unverified.
        retry = np.flatnonzero(got == -600).tolist()
        if retry:
            ptrs = [p for page in lay.spans(idx) for p in page]
            again = self.store.batch_get_into([obj_keys[j] for j in retry], [ptrs[j] for j in retry], [size] * len(retry))
            for j, g in zip(retry, again if len(again) == len(retry) else []):
                if g == size:
                    ok[j] = unverified[j] = True
        if not ok.all():
            bad = np.flatnonzero(~ok)
            first = int(got[bad[0]])
            self._fail(StorageError("batch_get_into", first if first < 0 else SHORT_READ, [obj_keys[j] for j in bad]))
        try:
            tags = _name_tags(obj_keys)
            magic = t[:n, 0]
            eligible = write & ~unverified & (magic == TRAILER_MAGIC)
            sums = np.asarray(
                self.mem_pool_host._land_staged(idx, base, S.nbytes, stride, (t[:n, 1] ^ tags).tolist(), eligible.tolist(), write.tolist()),
                dtype="<u8",
            )
            good = (magic == TRAILER_MAGIC) & (t[:n, 1] == (sums ^ tags))
            unverified |= np.isin(magic, np.asarray(OLD_TRAILER_MAGICS, dtype=np.uint64))
            corrupt = ok & ~unverified & ~good
            self.stats["unverified"] += int((ok & unverified).sum())
            self.stats["verified"] += int((ok & ~unverified & good).sum())
            if corrupt.any():
                self.stats["corrupt"] += int(corrupt.sum())
                ok &= ~corrupt
                self._fail(StorageError("batch_get_v1", INTEGRITY, [obj_keys[j] for j in np.flatnonzero(corrupt)]))
        except Exception as e:  # noqa: BLE001 - a pass that failed: trust no page
            ok[:] = False
            self._fail(StorageError("batch_get_v1", INTEGRITY, keys, detail=f"could not verify: {e}"))
            lay.landed(idx, [False] * len(keys))
        return ok.reshape(len(keys), lay.comps).all(axis=1).tolist()

    def _verify(self, obj_keys: List[str], sums: np.ndarray, ok: List[bool], unverified: List[bool]) -> None:
        corrupt = verify(self._trailers, obj_keys, sums, ok, unverified, self.stats)
        if corrupt:
            self._fail(StorageError("batch_get_v1", INTEGRITY, corrupt))

    @one_call
    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """The number of leading pages whose objects all exist (sglang's convention)."""
        keys = list(keys)
        if not keys:
            return 0
        with self._lock:
            self._pool()
            if self._foreign or (self._grid is not None and self._grid.missing):
                return 0
            per = self._layout.comps
            obj_keys = self._object_keys(keys)
            res = exist_once(obj_keys, self.store.batch_is_exist)
            for j in range(len(obj_keys)):
                e = res[j]
                if e != 1:
                    if e < 0:
                        self._fail(StorageError("batch_is_exist", e, [obj_keys[j]]))
                    return j // per
            return len(keys)

    # ---- the plain forms: raw keys, as sglang's Mooncake backend names them -----------------

    @one_call
    def exists(self, key: str) -> bool:
        """Whether object ``key`` exists (a raw key; pages are asked with :meth:`batch_exists`)."""
        return self.store.is_exist(key) == 1

    @one_call
    def get(self, key: str, target_location: Optional[int] = None, target_sizes: Optional[int] = None) -> Any:
        """Object ``key`` into ``target_location`` (``target_sizes`` bytes of registered memory;
        returns whether it was read whole), or as a ``numpy.uint8`` array (``None`` when missing)."""
        value, err = get_object(self.store, key, target_location, target_sizes)
        if err is not None:
            self._fail(err)
        return value

    @one_call
    def batch_get(self, keys: List[str], target_locations: Optional[List[int]] = None, target_sizes: Optional[List[int]] = None) -> Any:
        if target_locations is None:
            return [self.get(k) for k in keys]
        return [self.get(k, loc, size) for k, loc, size in zip(keys, target_locations, target_sizes)]

    @one_call
    def set(self, key: str, value: Any = None, target_location: Optional[int] = None, target_sizes: Optional[int] = None) -> bool:
        """Object ``key`` from ``value`` (bytes or a host array) or from ``target_sizes`` bytes at
        ``target_location`` (registered memory); an existing object is kept."""
        err = set_object(self.store, key, value, target_location, target_sizes)
        if err is not None:
            self._fail(err)
        return err is None

    @one_call
    def batch_set(self, keys: List[str], values: Optional[List[Any]] = None, target_locations: Optional[List[int]] = None, target_sizes: Optional[List[int]] = None) -> bool:
        if values is not None:
            return all(self.set(k, v) for k, v in zip(keys, values))
        return all(self.set(k, None, loc, size) for k, loc, size in zip(keys, target_locations, target_sizes))

    def clear(self) -> None:
        """Removes every object from the store (all clients' objects, as sglang's Mooncake backend does)."""
        self.store.remove_all()

    def get_stats(self) -> Any:
        """sglang's storage metrics hook: ``None`` (no ``StorageMetrics``); the integrity counts are
        :meth:`integrity_stats`."""
        return None

    def integrity_stats(self) -> Dict[str, int]:
        """Objects of hicache-io's own (shard-named) pages read so far: ``verified`` (checksum
        matched), ``unverified`` (no trailer), ``corrupt`` (refused). sglang-named objects carry no
        checksum and are not counted. ``damaged_puts``: pages not put because their bytes in the
        host pool failed the item checksums their backup recorded (any naming). ``foreign``:
        sglang-named pages read or written as misses because the prefix's sidecar record names
        another namespace. ``incompatible``: pages read or written as misses under the unified key
        scheme because this rank's kv heads cannot be cut into the grid's groups."""
        return dict(self.stats)

    def close(self) -> None:
        """Unregisters the pool and closes the client (waits for a call in progress)."""
        with self._lock:
            if self.store is None:
                return
            self.unregister_mem_pool_host()
            self.store.close()
            self.store = None
            self._retired.clear()

    def __del__(self) -> None:
        # The client closes (its transfer threads stop) before the buffers it may still write to
        # are freed with this object's attributes. A client passed in as ``store=`` is closed
        # too (its buffers are ours): a finalizer may then wait on Mooncake's own timeouts.
        if getattr(self, "store", None) is not None and hasattr(self, "_retired"):
            try:
                self.close()
            except Exception:  # noqa: BLE001 - nothing to report to in a finalizer
                pass


class LocalStore(MooncakeStore):
    """The embedded L3 tier: :class:`MooncakeStore`'s pipelines, key schemes and trailers over
    files in one local directory (:mod:`hicache_io.l3.local`), shared by every process of the
    machine; no server. ``LocalStore(storage_config, kwargs)`` is how sglang's ``dynamic``
    backend constructs it (with ``"interface_v1": 1``). Configured by
    ``extra_config["hicache_io_local_dir"]`` (default ``$XDG_CACHE_HOME/hicache-io/l3``),
    ``["hicache_io_local_capacity_bytes"]`` (default 8 GiB; least recently used objects are
    removed past it) and ``["hicache_io_local_fsync"]`` (default off: objects survive a process
    that dies, not a power loss)."""

    def __init__(self, storage_config: Optional[Any] = None, kwargs: Optional[Dict[str, Any]] = None, *, raise_errors: bool = False, integrity: Optional[bool] = None, directory: Optional[str] = None, capacity_bytes: Optional[int] = None):
        from .l3.local import LocalDiskClient

        extra = dict(getattr(storage_config, "extra_config", None) or {})
        extra.update(kwargs or {})
        capacity = capacity_bytes if capacity_bytes is not None else extra.get("hicache_io_local_capacity_bytes")
        fsync = extra.get("hicache_io_local_fsync", False)
        client = LocalDiskClient(
            directory or extra.get("hicache_io_local_dir"),
            _size(capacity) if capacity is not None else None,
            fsync=str(fsync).strip().lower() not in ("", "0", "false", "no", "off") if isinstance(fsync, str) else bool(fsync),
        )
        super().__init__(storage_config, kwargs, config=MooncakeStoreConfig(), store=client, raise_errors=raise_errors, integrity=integrity)
        client.crc_trailered = not self.integrity  # nothing else checks trailered objects then

    def _fail(self, err: StorageError) -> None:
        super()._fail(err.of("local L3 store"))
