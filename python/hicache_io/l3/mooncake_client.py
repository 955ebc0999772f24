"""Loading Mooncake Store's Python client without breaking the process's other libraries.

Mooncake's wheel links its client (``mooncake/store.so``) against a zstd of its own
(``libzstd-<hash>.so.1.5.5``) and against the system's libcurl, which needs the system's
``libzstd.so.1``. When the client is the first to load the system's zstd, that library's own
calls between its functions are bound (at load time: it is linked with ``BIND_NOW``) in the
client's lookup scope, where Mooncake's zstd comes first: the system's ``ZSTD_compress`` then
calls Mooncake's ``ZSTD_compressCCtx``, whose context is larger than the one it was given. Any
later user of the system's zstd in this process corrupts its stack; Mesa's Vulkan drivers do,
when they write a compiled shader to their disk cache (seen as ``*** stack smashing detected
***`` in lavapipe's cache thread, the first time a wgpu shader is compiled on a machine).

The cure is to load the system's zstd first, on its own, where it binds to itself, and to keep it
loaded: the client's load then finds it there. :func:`store_module` does that before importing the
client; every import of Mooncake in hicache-io goes through it. (A process that imported
``mooncake.store`` before hicache-io cannot be cured here.)"""

import ctypes
import ctypes.util
import logging
import sys
from types import ModuleType
from typing import Any, List, Optional, Sequence

logger = logging.getLogger(__name__)

# The system's zstd, loaded once and never unloaded (ctypes does not close its libraries).
_system_zstd: Optional[Any] = None


def pin_system_zstd() -> bool:
    """Loads the system's ``libzstd`` in a scope of its own, once; whether it is loaded."""
    global _system_zstd
    if _system_zstd is not None:
        return True
    if not sys.platform.startswith("linux"):
        return False
    for name in ("libzstd.so.1", ctypes.util.find_library("zstd")):
        if not name:
            continue
        try:
            _system_zstd = ctypes.CDLL(name)
            return True
        except OSError:
            continue
    logger.debug("no system libzstd to load before Mooncake's client")
    return False


def store_module() -> ModuleType:
    """``mooncake.store``, imported after :func:`pin_system_zstd` (raises ``ImportError`` where
    Mooncake is not installed)."""
    if "mooncake.store" not in sys.modules:
        pin_system_zstd()
    import mooncake.store

    return mooncake.store


def open_client(config: Any, storage_config: Any) -> Any:
    """A ``MooncakeDistributedStore`` set up from ``config`` (a ``MooncakeStoreConfig``), its
    global segment shared by the ranks of ``storage_config`` (raises ``StorageError``)."""
    from .errors import StorageError

    if not config.master_server_address:
        raise ValueError("Mooncake Store needs master_server_address (extra_config, SGLANG_HICACHE_MOONCAKE_CONFIG_PATH or MOONCAKE_MASTER)")
    client = store_module().MooncakeDistributedStore()
    ranks = max(1, getattr(storage_config, "tp_size", 1) * getattr(storage_config, "pp_size", 1))
    c = config
    rc = client.setup(c.local_hostname, c.metadata_server, c.global_segment_size // ranks, c.local_buffer_size, c.protocol, c.device_name, c.master_server_address)
    if rc != 0:
        raise StorageError("setup", rc)
    return client


def register_all(client: Any, regions: Sequence[Any]) -> List[int]:
    """Registers every ``(address, bytes)`` region with the client, or none (raises); the
    addresses registered."""
    done: List[int] = []
    try:
        for addr, nbytes in regions:
            rc = client.register_buffer(addr, nbytes)
            if rc != 0:
                raise RuntimeError(f"Failed to register buffer to Mooncake Store, error code: {rc}")
            done.append(addr)
    except BaseException:
        for a in done:
            client.unregister_buffer(a)
        raise
    return done
