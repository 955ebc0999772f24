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
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .l3.batches import CallScope, in_rounds, one_call
from .l3.config import STORAGE_BATCH_SIZE, HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo, MooncakeStoreConfig, StoreSettings
from .l3.config import size_of as _size
from .l3.errors import INTEGRITY, LOCAL_STORE, MOONCAKE_ERRORS, MOONCAKE_STORE, REFUSED, SHORT_READ, StorageError
from .l3.keys import GridKeys, RankKeys, claim_namespace, namespace_key, namespace_of, shard_descriptor
from .l3.layouts import PoolLayout as _Layout
from .l3.layouts import SglangLayout as _SglangLayout  # noqa: F401 (the name it had)
from .l3.layouts import check_inside as _check_inside  # noqa: F401 (the name it had)
from .l3.layouts import host_list as _host_list
from .l3.layouts import sglang_indices as _sglang_indices  # noqa: F401 (the name it had)
from .l3.master import LocalMaster
from .l3.mooncake_client import open_client
from .l3.pipeline import counted_exists, get_pages, put_pages
from .l3.placements import SEALED_MAX_OBJECT, Placement, PoolPages, SealedPages, SharePages, StagedPages, sealing  # noqa: F401 (importable from here)
from .l3.trailer import OLD_TRAILER_MAGICS, TRAILER_MAGIC  # noqa: F401 (importable from here)
from .l3.trailer import name_tag as _name_tag  # noqa: F401 (the name it had)
from .l3.transport import Health, Transport
from .l3.watch import ReadBack
from .storage_unified import KEY_SCHEMES, UnifiedKeys
from .storage_v2 import PoolsV2

logger = logging.getLogger(__name__)

__all__ = ["MooncakeStore", "LocalStore", "MooncakeStoreConfig", "StorageError", "LocalMaster", "SHORT_READ", "REFUSED", "INTEGRITY", "TRAILER_MAGIC", "HiCacheStorage", "HiCacheStorageConfig", "HiCacheStorageExtraInfo", "STORAGE_BATCH_SIZE", "MOONCAKE_ERRORS"]






class MooncakeStore(PoolsV2, UnifiedKeys, HiCacheStorage):
    """sglang's HiCache L3 storage over Mooncake Store, for hicache-io host pools (see the module
    docstring). ``MooncakeStore(storage_config, kwargs)`` is how sglang's ``dynamic`` backend
    constructs it; ``store=`` takes an already set-up ``MooncakeDistributedStore``."""

    #: How failures and outages name this store.
    _store_name = MOONCAKE_STORE

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
        # The registered pool's key scheme (l3.keys), None before.
        self._keys: Any = None
        self._trailers: Optional[np.ndarray] = None
        self.stats = {"verified": 0, "unverified": 0, "corrupt": 0, "damaged_puts": 0, "foreign": 0, "incompatible": 0}
        self._health = Health(self._store_name, local=self._store_name == LOCAL_STORE)
        # Whether what is stored is ever read back (l3.watch: warns once when it is not).
        self._read_back = ReadBack(self._store_name, getattr(store, "directory", "") or "")
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
        # Pages a batch of sealed objects: sglang's 128, or fewer where the staging holds fewer.
        self._seal_pages = STORAGE_BATCH_SIZE
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
            sealed = sealing(lay.obj_bytes, lay.comps) if trailers is not None and lay.zero_copy and hasattr(mem_pool_host, "_stage_put") else None
            if sealed is not None:
                regions = regions + [(sealed[0].ctypes.data, sealed[0].nbytes)]
            done = self._register_all(regions)
            self._seal(sealed)
            self._registered, self._staging, self._layout, self.mem_pool_host = done, staging, lay, mem_pool_host
            self._descriptor, self._trailers = descriptor, trailers
            self._keys = self._key_scheme()
            self.namespace, self._foreign = namespace, False
            if descriptor is None and self._namespace_record:
                self._foreign = not self._claim_namespace(record)

    def _seal(self, sealing: Optional[Tuple[np.ndarray, np.ndarray, int, int]]) -> None:
        """Keeps the registered staging buffer of :func:`sealing` (or none)."""
        self._sealed, self._seal_t, self._seal_stride, self._seal_pages = sealing if sealing is not None else (None, None, 0, STORAGE_BATCH_SIZE)

    def _seals(self, integrity: bool) -> bool:
        """Whether a call with checksums ``integrity`` moves the objects sealed (:func:`sealing`)."""
        return self._sealed is not None and integrity

    def _pages_a_batch(self, integrity: bool) -> int:
        """Pages a batch of a call with checksums ``integrity``: sglang's 128, or as many as the
        sealed objects' staging buffer holds."""
        return self._seal_pages if self._seals(integrity) else STORAGE_BATCH_SIZE

    @property
    def _io(self) -> Transport:
        """The client's calls, checked (:mod:`hicache_io.l3.transport`); ``store`` stays the raw
        client, as sglang's Mooncake backend names it."""
        return Transport(self.store, self._health)

    def _register_all(self, regions: Sequence[Any]) -> List[int]:
        return self._io.register(regions)

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
            self._io.unregister(self._registered)
            if self._registered:
                self._retired += [self.mem_pool_host, self._layout, self._grid, self._staging, self._sealed, self._trailers]
            self._registered, self._staging, self.mem_pool_host = [], None, None
            self._seal(None)
            self._layout, self._descriptor, self._trailers, self._grid = None, None, None, None
            self._keys = None
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
        return self._keys.keys(keys)

    def _key_scheme(self) -> Any:
        """The registered pool's key scheme (:mod:`hicache_io.l3.keys`)."""
        prefix = f"{self.key_prefix}_" if self.key_prefix else ""
        if self._grid is not None:
            return GridKeys(prefix, self._grid.digest, self._grid.suffixes)
        lay = self._layout
        rank = self.mha_suffix if lay.kind == "mha" else self.mla_suffix
        return RankKeys(prefix, rank, self._descriptor, lay.kind, lay.comps)

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

    def _batches(self, keys: List[str], idx: Any, b: int):
        p = self._layout.page
        for at in range(0, len(keys), b):
            yield keys[at : at + b], idx[at * p : (at + b) * p]

    def _paged(self, what: str, keys: Sequence[str], host_indices: Any, per_batch: Any) -> List[bool]:
        """One page call: arguments checked once, then ``per_batch(keys, idx, integrity)`` over
        its batches, ``integrity`` read once (the batches' size and placement follow it)."""
        keys = list(keys)
        integrity = bool(self.integrity)
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
                for bks, bhi in self._batches(ks, hi, self._pages_a_batch(integrity)):
                    out += per_batch(bks, bhi, integrity)
                return out

            return in_rounds(keys, idx, self._layout.page, run)

    @one_call
    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Writes page ``i`` (host slots ``host_indices[i * P : (i + 1) * P]``) under ``keys[i]``;
        objects that exist already are left as they are and count as written."""
        done = self._paged("batch_set_v1", keys, host_indices, self._set_batch)
        self._read_back.put(sum(done))
        return done

    def _set_batch(self, keys: List[str], idx: Any, integrity: bool) -> List[bool]:
        return put_pages(self, "batch_set_v1", keys, self._object_keys(keys), self._placement(idx, len(keys), integrity))

    def _placement(self, idx: Any, n_pages: int, integrity: bool) -> Placement:
        """Where the registered pool's objects of a batch lie (:mod:`hicache_io.l3.placements`),
        for a call with checksums ``integrity``."""
        lay = self._layout
        if self._grid is not None:
            place: PoolPages = SharePages(lay, self._grid, idx, n_pages, self._trailers, integrity)
        elif not lay.zero_copy:
            return StagedPages(lay, idx, n_pages, self._trailers, integrity, self._staging)
        else:
            place = PoolPages(lay, idx, n_pages, self._trailers, integrity)
        if self._seals(integrity):
            return SealedPages(place, self._sealed, self._seal_t, self._seal_stride)
        return place

    @one_call
    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Reads page ``keys[i]`` into host slots ``host_indices[i * P : (i + 1) * P]``; a page is
        ``True`` only when every object of it was read whole."""
        done = self._paged("batch_get_v1", keys, host_indices, self._get_batch)
        self._read_back.looked_up(any(done))
        return done

    def _get_batch(self, keys: List[str], idx: Any, integrity: bool) -> List[bool]:
        return get_pages(self, "batch_get_v1", keys, self._object_keys(keys), self._placement(idx, len(keys), integrity))

    @one_call
    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """The number of leading pages whose objects all exist (sglang's convention)."""
        keys = list(keys)
        if not keys:
            return 0
        with self._lock:
            self._pool()
            if self._foreign or (self._grid is not None and self._grid.missing):
                found = 0
            else:
                found = counted_exists(self, self._object_keys(keys), self._layout.comps)
        self._read_back.looked_up(found > 0)
        return found

    # ---- the plain forms: raw keys, as sglang's Mooncake backend names them -----------------

    @one_call
    def exists(self, key: str) -> bool:
        """Whether object ``key`` exists (a raw key; pages are asked with :meth:`batch_exists`)."""
        return self._io.exists_one(key)

    @one_call
    def get(self, key: str, target_location: Optional[int] = None, target_sizes: Optional[int] = None) -> Any:
        """Object ``key`` into ``target_location`` (``target_sizes`` bytes of registered memory;
        returns whether it was read whole), or as a ``numpy.uint8`` array (``None`` when missing)."""
        value, err = self._io.get_object(key, target_location, target_sizes)
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
        err = self._io.set_object(key, value, target_location, target_sizes)
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
        scheme because this rank's kv heads cannot be cut into the grid's groups.

        And what the answers said of the store itself: ``unreachable`` (object answers that
        failed because the master could not be reached), ``outages`` (times it became
        unreachable; each start and end is logged as a warning), ``io_errors`` (the local store's
        object answers that failed with an I/O error of its disk: a full disk, a failing read;
        always 0 on Mooncake).

        And whether the engine reads back what it stores (:mod:`hicache_io.l3.watch`):
        ``put_batches`` (put calls that wrote pages), ``lookups`` (``batch_exists`` and page-read
        calls), ``hits`` (those that found a page), ``never_read`` (1 once that many put calls
        and no hit were warned about: keys that never match, such as sglang's without its
        page-hash extension)."""
        return {**self.stats, **self._health.counts, **self._read_back.counts}

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

    _store_name = LOCAL_STORE

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
        super()._fail(err.of(self._store_name))
