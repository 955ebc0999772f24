"""L3 storage: host-pool pages to and from Mooncake Store (:class:`MooncakeStore`) or a local
directory (:class:`LocalStore`, no server), as sglang's HiCache L3 tier moves them.

Both are :class:`hicache_io.l3.store.PageStore` (sglang's ``HiCacheStorage``, v1 and v2, every key
scheme, the integrity trailers, ``last_error`` and ``integrity_stats()``) with their transport
picked: Mooncake Store's client, or files in one directory
(:class:`hicache_io.l3.local.LocalDiskClient`). sglang's ``dynamic`` storage backend constructs
either as ``Store(storage_config, kwargs)``.
"""

from typing import Any, Dict, Optional

from .l3.config import STORAGE_BATCH_SIZE, HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo, MooncakeStoreConfig, StoreSettings
from .l3.config import size_of as _size
from .l3.errors import INTEGRITY, LOCAL_STORE, MOONCAKE_ERRORS, MOONCAKE_STORE, REFUSED, SHORT_READ, StorageError
from .l3.master import LocalMaster
from .l3.mooncake_client import open_client
from .l3.store import PageStore
from .l3.unified import KEY_SCHEMES

__all__ = ["MooncakeStore", "LocalStore", "PageStore", "MooncakeStoreConfig", "StorageError", "LocalMaster", "SHORT_READ", "REFUSED", "INTEGRITY", "HiCacheStorage", "HiCacheStorageConfig", "HiCacheStorageExtraInfo", "STORAGE_BATCH_SIZE", "MOONCAKE_ERRORS"]


class MooncakeStore(PageStore):
    """sglang's HiCache L3 storage over Mooncake Store, for hicache-io host pools (see
    :class:`hicache_io.l3.store.PageStore`). ``MooncakeStore(storage_config, kwargs)`` is how
    sglang's ``dynamic`` backend constructs it; ``store=`` takes an already set-up
    ``MooncakeDistributedStore``."""

    def __init__(self, storage_config: Optional[Any] = None, kwargs: Optional[Dict[str, Any]] = None, *, config: Optional[MooncakeStoreConfig] = None, store: Any = None, raise_errors: bool = False, integrity: Optional[bool] = None):
        storage_config = storage_config if storage_config is not None else HiCacheStorageConfig()
        settings = StoreSettings.read(storage_config, kwargs, integrity, KEY_SCHEMES)
        config = config if config is not None else MooncakeStoreConfig.load(settings.extra)
        client = store if store is not None else open_client(config, storage_config)
        super().__init__(storage_config, settings, client, MOONCAKE_STORE, config, raise_errors)


class LocalStore(PageStore):
    """The embedded L3 tier: :class:`PageStore`'s pipelines, key schemes and trailers over
    files in one local directory (:mod:`hicache_io.l3.local`), shared by every process of the
    machine; no server. ``LocalStore(storage_config, kwargs)`` is how sglang's ``dynamic``
    backend constructs it (with ``"interface_v1": 1``). Configured by
    ``extra_config["hicache_io_local_dir"]`` (default ``$XDG_CACHE_HOME/hicache-io/l3``),
    ``["hicache_io_local_capacity_bytes"]`` (default 8 GiB; least recently used objects are
    removed past it) and ``["hicache_io_local_fsync"]`` (default off: objects survive a process
    that dies, not a power loss)."""

    def __init__(self, storage_config: Optional[Any] = None, kwargs: Optional[Dict[str, Any]] = None, *, raise_errors: bool = False, integrity: Optional[bool] = None, directory: Optional[str] = None, capacity_bytes: Optional[int] = None):
        from .l3.local import LocalDiskClient

        storage_config = storage_config if storage_config is not None else HiCacheStorageConfig()
        settings = StoreSettings.read(storage_config, kwargs, integrity, KEY_SCHEMES)
        extra = settings.extra
        capacity = capacity_bytes if capacity_bytes is not None else extra.get("hicache_io_local_capacity_bytes")
        fsync = extra.get("hicache_io_local_fsync", False)
        client = LocalDiskClient(
            directory or extra.get("hicache_io_local_dir"),
            _size(capacity) if capacity is not None else None,
            fsync=str(fsync).strip().lower() not in ("", "0", "false", "no", "off") if isinstance(fsync, str) else bool(fsync),
            # Objects that carry hicache-io's trailer are checked by the store; with its checksums
            # off nothing else would, so the client checks them too (their CRC, or their trailer
            # where the footer records no CRC).
            crc_trailered=not settings.integrity,
            writes=str(extra.get("hicache_io_local_writes", "cached")),
            reads=str(extra.get("hicache_io_local_reads", "auto")),
        )
        super().__init__(storage_config, settings, client, LOCAL_STORE, MooncakeStoreConfig(), raise_errors)
