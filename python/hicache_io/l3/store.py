"""The L3 page store: host-pool pages to and from an L3 transport (Mooncake Store's client, or the
local directory's :class:`hicache_io.l3.local.LocalDiskClient`), as sglang's HiCache L3 tier moves
them. :class:`hicache_io.storage.MooncakeStore` and :class:`hicache_io.storage.LocalStore` are
:class:`PageStore` with their transport picked.

:class:`PageStore` implements sglang's ``HiCacheStorage`` interface (it subclasses sglang's
class when sglang is importable, so ``--hicache-storage-backend dynamic`` loads it unchanged): ``register_mem_pool_host(pool)``, ``batch_exists``, ``batch_set_v1`` /
``batch_get_v1`` (zero-copy, page ``i`` read from or written to host slots
``host_indices[i * P : (i + 1) * P]``) and the plain ``get`` / ``set`` / ``exists`` forms; and
sglang's storage v2 for hybrid host pool groups (Mamba states, the DSA indexer, drafts, …), whose
keys and objects :mod:`hicache_io.l3.sidecars` describes (the store owns them by composition).

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
objects all exist. A failure is also kept as :attr:`PageStore.last_error`, a
:class:`StorageError` naming the transport's error code; ``raise_errors=True`` raises it instead. A
page whose get fails may have been partly written in its host slots (they are the prefetch's
targets, which the caller does not use for a failed page); no other slot is touched.

The store keeps the registered pool alive until :meth:`PageStore.unregister_mem_pool_host` or
:meth:`PageStore.close`, which wait for a page call in progress (one lock), so the pool's memory
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
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .batches import CallScope, distinct_pages, in_rounds, one_call
from .config import STORAGE_BATCH_SIZE, HiCacheStorage, HiCacheStorageConfig, StoreSettings
from .errors import LOCAL_STORE, REFUSED, StorageError
from .keys import GridKeys, KeyScheme, RankKeys, claim_namespace, namespace_key, namespace_of, shard_descriptor
from .layouts import PoolLayout, SglangLayout, host_list
from .pipeline import Batch, Overlap, StoreCalls, counted_exists, get_batches, overlaps, put_batches
from .placements import Placement, PoolPages, SealedPages, SharePages, StagedPages, sealing
from .sidecars import SidecarPools, pool_name, transfer_result
from .transport import Health, Spans, Transport
from .unified import KEY_SCHEMES, UnifiedGrid
from .watch import ReadBack

logger = logging.getLogger(__name__)

#: A staging buffer for sealed objects (:func:`hicache_io.l3.placements.sealing`): the buffer,
#: its trailers as ``[n][2]`` u64 rows, the stride of an object and its trailer, pages a batch.
Sealing = Tuple[np.ndarray, np.ndarray, int, int]


def _weakly(method: Any) -> Any:
    """``method`` (a bound method) through a weak reference to its object: a no-op once the
    object is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


class Registered:
    """The pool a store registered: its page objects (``layout``), their key scheme, the
    client addresses registered for it, and the buffers its batches move through (``staging``
    for pools in executor buffers; per slot, ``trailers`` for checksummed objects and the sealed
    objects' staging) and, under the unified keys, its share of the grid. Two slots let one
    batch be staged or landed while the client moves the next (:mod:`hicache_io.l3.pipeline`)."""

    def __init__(self, pool: Any, layout: Any, keys: KeyScheme, addrs: List[int], namespace: Dict[str, Any], *, staging: Optional[np.ndarray] = None, trailers: Optional[List[np.ndarray]] = None, sealed: Optional[List[Sealing]] = None, grid: Optional[UnifiedGrid] = None):
        self.pool, self.layout, self.keys, self.addrs, self.namespace = pool, layout, keys, addrs, namespace
        self.staging, self.grid = staging, grid
        self.trailer_slots: List[Optional[np.ndarray]] = list(trailers) if trailers else [None]
        #: Whether the sglang-named objects under this prefix belong to another namespace.
        self.foreign = False
        self.seal(sealed)

    @property
    def trailers(self) -> Optional[np.ndarray]:
        return self.trailer_slots[0]

    def seal(self, sealed: Optional[List[Sealing]]) -> None:
        """Moves checksummed objects through ``sealed`` (one per slot; ``None``: in place)."""
        self.seal_slots: List[Sealing] = list(sealed) if sealed else []
        # Per slot, the spans of a whole batch of ``n`` sealed objects (the same for every batch
        # of that size: a slot's buffer and stride are fixed), made once.
        self.whole_spans: List[Dict[int, Spans]] = [{} for _ in self.seal_slots]
        first = self.seal_slots[0] if self.seal_slots else (None, None, 0, STORAGE_BATCH_SIZE)
        self.sealed, self.seal_t, self.seal_stride, self.seal_pages = first

    @property
    def slots(self) -> int:
        """Batches whose buffers can be in use at once (1: one batch at a time)."""
        return len(self.trailer_slots)

    def memory(self) -> List[Any]:
        """What owns memory the client may still write to."""
        return [self.pool, self.layout, self.grid, self.staging, self.seal_slots, self.trailer_slots]

    def misses(self) -> Optional[str]:
        """The count every page of a call adds to when this pool reads and writes misses only:
        ``foreign`` or ``incompatible`` (a rank outside the unified grid's groups); else ``None``."""
        if self.foreign:
            return "foreign"
        if self.grid is not None and self.grid.missing:
            return "incompatible"
        return None

    def pages_a_batch(self, integrity: bool) -> int:
        """Pages a batch of a call with checksums ``integrity``: sglang's 128, or as many as the
        sealed objects' staging buffer holds."""
        return self.seal_pages if self.sealed is not None and integrity else STORAGE_BATCH_SIZE

    def placement(self, idx: Any, n_pages: int, integrity: bool, slot: int = 0) -> Placement:
        """Where a batch's objects lie (:mod:`hicache_io.l3.placements`), for a call with
        checksums ``integrity``, in buffer slot ``slot``."""
        lay, trailers = self.layout, self.trailer_slots[slot]
        if self.grid is not None:
            place: PoolPages = SharePages(lay, self.grid, idx, n_pages, trailers, integrity)
        elif not lay.zero_copy:
            return StagedPages(lay, idx, n_pages, trailers, integrity, self.staging)
        else:
            place = PoolPages(lay, idx, n_pages, trailers, integrity)
        if self.sealed is not None and integrity:
            sealed, seal_t, stride, _ = self.seal_slots[slot]
            return SealedPages(place, sealed, seal_t, stride, self.whole_spans[slot])
        return place


def buffer_slots(trailer_rows: int, seal: Optional[Tuple[int, int]], slots: int) -> Tuple[List[np.ndarray], List[Sealing], List[Tuple[int, int]]]:
    """``slots`` sets of a batch's buffers: trailers of ``trailer_rows`` rows and, where ``seal``
    (an object's bytes, objects a page) can be sealed, a sealed objects' staging buffer; and the
    regions they take."""
    trailers = [np.zeros((trailer_rows, 2), "<u8") for _ in range(slots)]
    sealed = [s for s in (sealing(*seal) for _ in range(slots if seal else 0)) if s is not None]
    regions = [(t.ctypes.data, t.nbytes) for t in trailers] + [(s[0].ctypes.data, s[0].nbytes) for s in sealed]
    return trailers, sealed, regions


class PageStore(HiCacheStorage):
    """sglang's HiCache L3 storage over one transport (see the module docstring): built by
    :class:`hicache_io.storage.MooncakeStore` and :class:`hicache_io.storage.LocalStore`, which
    pick the transport ``client`` and the ``name`` its failures and outages go by."""

    def __init__(self, storage_config: Any, settings: StoreSettings, client: Any, name: str, config: Any, raise_errors: bool):
        self.storage_config = storage_config if storage_config is not None else HiCacheStorageConfig()
        self._settings = st = settings
        self._name = name
        self.config = config
        self.raise_errors = raise_errors
        #: The last failure of the most recent call to finish (``None`` when it had none).
        self.last_error: Optional[StorageError] = None
        self._calls = CallScope()
        self.key_prefix, self.mha_suffix, self.mla_suffix, self.integrity = st.key_prefix, st.mha_suffix, st.mla_suffix, st.integrity
        self._lock = threading.RLock()
        self.stats = {"verified": 0, "unverified": 0, "corrupt": 0, "damaged_puts": 0, "foreign": 0, "incompatible": 0}
        self._health = Health(name, local=name == LOCAL_STORE)
        # Whether what is stored is ever read back (l3.watch: warns once when it is not).
        self._read_back = ReadBack(name, getattr(client, "directory", "") or "")
        self._io = Transport(client, self._health)
        # Failures reach the store through a weak reference: the store holds its pipelines' calls,
        # and a cycle back would keep a dropped store (and its client) alive until a collection.
        self._pages = StoreCalls(self._io, _weakly(self._fail), self.stats)
        self._reg: Optional[Registered] = None
        self._overlap = Overlap()
        # What owned memory registered with the client (pools, staging and trailer buffers) after
        # it was unregistered: kept until the client has closed (see the module docstring). It
        # grows with each re-registration until close(), by design: a pool re-registered is rare,
        # and a buffer the client may still write must not be freed.
        self._retired: List[Any] = []
        self._sidecars = SidecarPools(self._pages, self._retired.extend, self.storage_config, st.extra)
        #: sglang's storage v2: the pools registered by name (the KV anchor too).
        self.registered_pools: Dict[str, Any] = {}

    @property
    def store(self) -> Any:
        """The transport's raw client, as sglang's Mooncake backend names it (``None`` once closed);
        replacing it (a wrapper, in tests) replaces it for every call of the store."""
        return self._io.client

    @store.setter
    def store(self, client: Any) -> None:
        self._io.client = client

    # ---- the pool ------------------------------------------------------------------------

    @property
    def mem_pool_host(self) -> Any:
        """The registered host pool (``None`` before)."""
        return self._reg.pool if self._reg is not None else None

    @property
    def namespace(self) -> Optional[Dict[str, Any]]:
        """What the registered pool's page bytes mean (see the module docstring), ``None`` before."""
        return self._reg.namespace if self._reg is not None else None

    @property
    def registered(self) -> Optional[Registered]:
        """The registered pool's objects and buffers (``None`` before)."""
        return self._reg

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Registers the pool's buffers with the store (once; zero-copy from then on) and keeps
        the pool alive until unregistered. Takes a hicache-io ``HostPool`` or one of sglang's
        plain KV host pools (MHA, MLA). ``layer_first`` pools are refused: their page is one span
        per layer, not one object."""
        with self._lock:
            if self._reg is not None:
                raise RuntimeError("a host pool is already registered with this store; unregister it first")
            self._reg = self._register_unified(mem_pool_host) if self._settings.unified else self._register_rank(mem_pool_host)

    def _register_rank(self, pool: Any) -> Registered:
        """The pool under rank-suffixed keys: sglang's names, or a shard's (:mod:`hicache_io.l3.keys`)."""
        ours = hasattr(pool, "host_span")
        mla = pool.kind != "mha" if ours else bool(getattr(self.storage_config, "is_mla_model", False))
        if pool.layout == "layer_first":
            if not mla:
                raise ValueError("Mooncake layer_first multi-buffer is only supported for MLA host KV pool. Use page_first/page_first_direct for MHA.")
            raise ValueError("hicache-io's Mooncake store moves pages that are one span per component; layer_first pages are one span per layer (use page_first or page_first_direct)")
        lay = PoolLayout(pool) if ours else SglangLayout(pool, mla)
        lay.synchronize()
        regions = [r for r in lay.regions if r[1] > 0]
        staging = None
        if not lay.zero_copy:
            staging = np.zeros(STORAGE_BATCH_SIZE * lay.comps * lay.obj_bytes, np.uint8)
            regions = [(staging.ctypes.data, staging.nbytes)]
        namespace = namespace_of(pool, lay, self.storage_config, self._settings.extra)
        record = json.dumps(namespace, sort_keys=True).encode()
        descriptor = shard_descriptor(pool, self._settings.sglang_keys_any_layout) if ours else None
        if descriptor is not None:
            descriptor += f"-n{hashlib.blake2b(record, digest_size=6).hexdigest()}"
        # Checksum trailers for hicache-io's own objects (read back whatever ``integrity`` says,
        # so a store with checksums off still reads objects that carry them); sglang-named
        # objects keep sglang's shape, its readers expecting the page's bytes exactly.
        trailers: Optional[List[np.ndarray]] = None
        sealed: List[Sealing] = []
        if descriptor is not None:
            seal = (lay.obj_bytes, lay.comps) if lay.zero_copy and hasattr(pool, "_stage_put") else None
            trailers, sealed, more = buffer_slots(STORAGE_BATCH_SIZE * lay.comps, seal, 2 if staging is None else 1)
            regions = regions + more
        addrs = self._io.register(regions)
        rank = self.mha_suffix if lay.kind == "mha" else self.mla_suffix
        keys = RankKeys(self._prefix(), rank, descriptor, lay.kind, lay.comps)
        reg = Registered(pool, lay, keys, addrs, namespace, staging=staging, trailers=trailers, sealed=sealed)
        if descriptor is None and self._settings.namespace_record:
            try:
                reg.foreign = not claim_namespace(self.store, namespace_key(self._prefix(), rank), record)
            except BaseException:
                self._release(reg)
                raise
        return reg

    def _register_unified(self, pool: Any) -> Registered:
        """The pool under the unified keys (:mod:`hicache_io.l3.unified`)."""
        if not hasattr(pool, "host_span"):
            raise ValueError("unified keys need a hicache-io HostPool (sglang 0.5.23's host pools have no head-group layout)")
        grid = UnifiedGrid(pool, self.storage_config, self._settings.extra)
        lay = PoolLayout(pool, shares=max(1, len(grid.suffixes)))
        pool.synchronize()
        # Objects of one size, small enough, are sealed: gathered with their trailer into one
        # span of a staging buffer (the single-buffer calls), summed in the same pass.
        seal = (grid.object_bytes[0], len(grid.suffixes)) if len(set(grid.object_bytes)) == 1 and hasattr(pool, "_stage_put") else None
        trailers, sealed, more = buffer_slots(STORAGE_BATCH_SIZE * lay.comps, seal, 2)
        regions = list(grid.regions) + more
        addrs = self._io.register(regions)
        keys = GridKeys(self._prefix(), grid.digest, grid.suffixes)
        if grid.missing:
            logger.warning("hicache-io L3 (unified keys): %s; every page reads and writes as a miss", grid.missing)
        return Registered(pool, lay, keys, addrs, grid.namespace, trailers=trailers, sealed=sealed, grid=grid)

    def _prefix(self) -> str:
        return f"{self.key_prefix}_" if self.key_prefix else ""

    def unregister_mem_pool_host(self) -> None:
        """Unregisters the pool's memory and lets the pool go (waits for a call in progress)."""
        with self._lock:
            self._sidecars.unregister()
            self.registered_pools = {}
            reg, self._reg = self._reg, None
            if reg is not None:
                self._release(reg)

    def _release(self, reg: Registered) -> None:
        """Unregisters ``reg``'s memory; what owns it is kept until the client has closed (first:
        an unregistration that fails must not free memory the client may still write)."""
        if reg.addrs:
            self._retired += reg.memory()
        self._io.unregister(reg.addrs)

    def _registered(self) -> Registered:
        if self._reg is None:
            raise RuntimeError("no host pool is registered with this store (call register_mem_pool_host first)")
        return self._reg

    # ---- keys ----------------------------------------------------------------------------

    def object_keys(self, key: str) -> List[str]:
        """The store keys of page ``key``'s objects, K before V."""
        with self._lock:
            return self._registered().keys.keys([key])

    def v2_object_keys(self, pool: Any, keys: Sequence[str]) -> List[str]:
        """The store keys of the objects of storage v2 pool ``pool``'s pages ``keys``, page by page."""
        with self._lock:
            return self._sidecars.object_keys(pool_name(pool), keys)

    def _fail(self, err: StorageError) -> None:
        err = err.of(self._name)
        self._calls.error = err
        self.last_error = err
        logger.debug("%s", err)
        if self.raise_errors:
            raise err

    # ---- zero-copy pages (sglang's v1 interface) -------------------------------------------

    def _checked(self, reg: Registered, what: str, keys: List[str], host_indices: Any) -> Optional[Any]:
        """The host indices as values, checked against the keys and the pool before any byte
        moves (``None``, with ``last_error`` set, when refused)."""
        lay = reg.layout
        try:
            idx = host_list(host_indices)
            if len(idx) != len(keys) * lay.page:
                raise ValueError(f"{len(keys)} pages need {len(keys) * lay.page} host indices, got {len(idx)}")
            if len(idx):
                lay.validate(idx)
            return idx
        except Exception as e:  # noqa: BLE001 - turned into sglang's per-page False
            self._fail(StorageError(what, REFUSED, keys, detail=str(e)))
            return None

    def _paged(self, what: str, keys: Sequence[str], host_indices: Any, put: bool) -> List[bool]:
        """One page call: arguments checked once, then the pipeline over its batches,
        ``integrity`` read once (the batches' size and placement follow it)."""
        keys = list(keys)
        integrity = bool(self.integrity)
        with self._lock:
            reg = self._registered()
            idx = self._checked(reg, what, keys, host_indices)
            if idx is None:
                return [False] * len(keys)
            missed = reg.misses()
            if missed:
                self.stats[missed] += len(keys)
                return [False] * len(keys)
            p, b = reg.layout.page, reg.pages_a_batch(integrity)

            def run(ks: List[str], hi: Any) -> List[bool]:
                batches = []
                for k, at in enumerate(range(0, len(ks), b)):
                    bks = ks[at : at + b]
                    batches.append(Batch(bks, reg.keys.keys(bks), reg.placement(hi[at * p : (at + b) * p], len(bks), integrity, k % reg.slots)))
                # A get's batches overlap only where they write pages of their own; a store that
                # raises its failures moves one batch after the other (nothing read past the
                # batch that raised).
                overlap = self._overlap if reg.slots > 1 and not self.raise_errors and overlaps(batches) and (put or distinct_pages(hi, p)) else None
                return (put_batches if put else get_batches)(self._pages, what, batches, overlap)

            return in_rounds(keys, idx, p, run)

    @one_call
    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Writes page ``i`` (host slots ``host_indices[i * P : (i + 1) * P]``) under ``keys[i]``;
        objects that exist already are left as they are and count as written."""
        done = self._paged("batch_set_v1", keys, host_indices, put=True)
        self._read_back.put(sum(done))
        return done

    @one_call
    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Reads page ``keys[i]`` into host slots ``host_indices[i * P : (i + 1) * P]``; a page is
        ``True`` only when every object of it was read whole."""
        done = self._paged("batch_get_v1", keys, host_indices, put=False)
        self._read_back.looked_up(any(done))
        return done

    @one_call
    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """The number of leading pages whose objects all exist (sglang's convention)."""
        keys = list(keys)
        if not keys:
            return 0
        with self._lock:
            reg = self._registered()
            found = 0 if reg.misses() else counted_exists(self._pages, reg.keys.keys(keys), reg.layout.comps)
        self._read_back.looked_up(found > 0)
        return found

    # ---- sglang's storage v2: the pools of a hybrid host pool group --------------------------

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Registers a pool of the host pool group under sglang's ``PoolName`` (the KV anchor
        must be the pool ``register_mem_pool_host`` took)."""
        name = pool_name(host_pool_name)
        with self._lock:
            if name == "kv":
                if host_pool is not self._registered().pool:
                    raise ValueError("the KV pool of storage v2 must be the pool register_mem_pool_host registered")
            else:
                self._sidecars.register(host_pool, name, self._prefix(), self.mha_suffix, self.mla_suffix)
            self.registered_pools[name] = host_pool

    def on_host_pools_registered(self) -> None:
        """Called once every pool of the group is registered: the KV anchor must be among them."""
        with self._lock:
            if self.registered_pools and "kv" not in self.registered_pools:
                raise ValueError("storage v2: the host pool group registered no KV pool")

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
                name = pool_name(t.name)
                policy = pool_name(getattr(t, "hit_policy", "all_pages"))
                if policy not in ("all_pages", "trailing_pages"):
                    raise ValueError(f"hicache-io's Mooncake store serves the all_pages and trailing_pages hit policies, not {policy}")
                exists = [True] * kv_pages if name == "kv" else self._sidecars.exists(name, keys[:kv_pages])
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
        return transfer_result(restorable[-1] if restorable else 0, hits, restorable)

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
            name, keys = pool_name(t.name), list(t.keys or [])
            if name == "kv":  # the KV pool's pages take the v1 path
                out[name] = (self.batch_set_v1 if put else self.batch_get_v1)(keys, t.host_indices)
                continue
            with self._lock:
                idx = self._sidecars.checked(name, keys, t.host_indices, "batch_set_v2" if put else "batch_get_v2")
                if idx is None:
                    out[name] = [False] * len(keys)
                elif self._reg is not None and self._reg.foreign:
                    self.stats["foreign"] += len(keys)
                    out[name] = [False] * len(keys)
                else:
                    out[name] = self._sidecars.move(name, keys, idx, put, session_id)
        return out

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
        matched), ``unverified`` (no trailer), ``corrupt`` (refused: a trailer that does not match,
        or, on the local store, any object, sglang-named ones too, whose bytes fail its file's CRC;
        such a file is removed). sglang-named objects carry no trailer and are otherwise not
        counted. ``damaged_puts``: pages not put because their bytes in the
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
            try:
                self.unregister_mem_pool_host()
                self.store.close()
                self.store = None
                self._retired.clear()
            finally:
                self._overlap.close()

    def __del__(self) -> None:
        # The client closes (its transfer threads stop) before the buffers it may still write to
        # are freed with this object's attributes. A client passed in as ``store=`` is closed
        # too (its buffers are ours): a finalizer may then wait on Mooncake's own timeouts.
        if getattr(self, "store", None) is not None and hasattr(self, "_retired"):
            try:
                self.close()
            except Exception:  # noqa: BLE001 - nothing to report to in a finalizer
                pass
