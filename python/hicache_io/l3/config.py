"""How an L3 store is configured: sglang's storage interface and config (standalone where sglang
is absent), and how to reach Mooncake Store."""

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

#: Pages per storage call in sglang's controller (and the store's staging buffers' size in pages).
STORAGE_BATCH_SIZE = 128

try:  # sglang present: be one of its backends (its dynamic loader checks the base class)
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # type: ignore
except ImportError:  # sglang absent: the same interface, standalone

    class HiCacheStorage:  # type: ignore[no-redef]
        """sglang's L3 storage interface (``hicache_storage.py``), for use without sglang."""

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            self.mem_pool_host = mem_pool_host

        def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
            for i, key in enumerate(keys):
                if not self.exists(key):
                    return i
            return len(keys)

        def clear(self) -> None:
            return None

        def get_stats(self) -> Any:
            return None


@dataclass
class HiCacheStorageConfig:
    """The fields of sglang's ``HiCacheStorageConfig`` that this backend reads, with defaults (one
    rank); sglang passes its own config object, read through the same attribute names."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = True
    model_name: Optional[str] = None
    dp_rank: int = 0
    dp_size: int = 1
    tp_lcm_size: Optional[int] = None
    should_split_heads: bool = False
    extra_config: Optional[dict] = None


@dataclass
class HiCacheStorageExtraInfo:
    prefix_keys: Optional[List[str]] = None
    extra_info: Optional[dict] = None


def size_of(value: Any) -> int:
    """An int, or a string with a ``kb``/``mb``/``gb`` suffix (Mooncake's config style)."""
    if isinstance(value, int):
        return value
    text = str(value).strip().lower()
    for suffix, scale in (("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10), ("b", 1)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(text)


@dataclass
class MooncakeStoreConfig:
    """How to reach the store, as sglang's Mooncake backend takes it. Defaults work on one
    machine over TCP on loopback; ``master_server_address`` is required (``MOONCAKE_MASTER``)."""

    master_server_address: str = ""
    local_hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    global_segment_size: int = 256 << 20
    local_buffer_size: int = 16 << 20
    protocol: str = "tcp"
    device_name: str = ""
    extra: Dict[str, Any] = field(default_factory=dict)

    _KEYS = ("master_server_address", "local_hostname", "metadata_server", "global_segment_size", "local_buffer_size", "protocol", "device_name")
    _ENV = {
        "master_server_address": "MOONCAKE_MASTER",
        "local_hostname": "MOONCAKE_LOCAL_HOSTNAME",
        "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
        "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
        "local_buffer_size": "MOONCAKE_LOCAL_BUFFER_SIZE",
        "protocol": "MOONCAKE_PROTOCOL",
        "device_name": "MOONCAKE_DEVICE",
    }

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "MooncakeStoreConfig":
        if d.get("client_server_address") is not None:
            raise ValueError("client_server_address (Mooncake's standalone client process) is not supported by hicache-io's store; give master_server_address")
        known = {k: d[k] for k in cls._KEYS if d.get(k) is not None}
        for k in ("global_segment_size", "local_buffer_size"):
            if k in known:
                known[k] = size_of(known[k])
        return cls(**known, extra={k: v for k, v in d.items() if k not in cls._KEYS})

    @classmethod
    def from_file(cls, path: str) -> "MooncakeStoreConfig":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_env(cls) -> "MooncakeStoreConfig":
        return cls.from_dict({k: os.environ[v] for k, v in cls._ENV.items() if v in os.environ})

    @classmethod
    def load(cls, extra_config: Optional[Dict[str, Any]] = None) -> "MooncakeStoreConfig":
        """sglang's order: the storage config's ``extra_config`` when it names a server, else the
        JSON file at ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``, else the environment."""
        if extra_config and (extra_config.get("master_server_address") is not None or extra_config.get("client_server_address") is not None):
            return cls.from_dict(extra_config)
        path = os.environ.get("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH")
        if path:
            return cls.from_file(path)
        return cls.from_env()


@dataclass
class StoreSettings:
    """What a store's configuration says (sglang's storage config and its ``extra_config``, with
    the constructor's ``kwargs`` over it), checked once."""

    extra: Dict[str, Any]
    #: ``{extra_backend_tag}_{model}``: the first part of every key.
    key_prefix: str
    #: The rank part of sglang's MHA keys (``tp_rank[_pp_rank]``) and MLA keys (``[pp_rank]``).
    mha_suffix: str
    mla_suffix: str
    #: sglang's keys name no layout: page_first only, unless the deployment says every rank uses
    #: one layout (then page_first_direct and page_head pages take sglang's names too).
    sglang_keys_any_layout: bool
    namespace_record: bool
    integrity: bool
    #: ``hicache_io_key_scheme = "unified"``: topology-free keys.
    unified: bool

    @classmethod
    def read(cls, storage_config: Any, kwargs: Optional[Dict[str, Any]], integrity: Optional[bool], key_schemes: Sequence[str]) -> "StoreSettings":
        sc = storage_config
        extra = dict(getattr(sc, "extra_config", None) or {})
        extra.update(kwargs or {})
        if getattr(sc, "should_split_heads", False):
            raise ValueError("hicache-io's Mooncake store does not split heads across ranks (tp_lcm_size > tp_size); use page_first_direct_hg pages instead")
        if extra.get("module_path") and not extra.get("interface_v1"):
            raise ValueError('hicache_io.storage.MooncakeStore serves sglang\'s zero-copy interface: add "interface_v1": 1 to the dynamic backend\'s extra config')
        scheme = str(extra.get("hicache_io_key_scheme", key_schemes[0]))
        if scheme not in key_schemes:
            raise ValueError(f"hicache_io_key_scheme {scheme!r}: expected one of {', '.join(key_schemes)}")
        tp_rank, pp_rank, pp_size = getattr(sc, "tp_rank", 0), getattr(sc, "pp_rank", 0), getattr(sc, "pp_size", 1)
        model, tag = getattr(sc, "model_name", None), extra.get("extra_backend_tag")
        parts = [str(tag) if tag is not None else None, model.replace("/", "-") if model else None]
        return cls(
            extra=extra,
            key_prefix="_".join(p for p in parts if p),
            mha_suffix=f"{tp_rank}_{pp_rank}" if pp_size > 1 else f"{tp_rank}",
            mla_suffix=f"{pp_rank}" if pp_size > 1 else "",
            sglang_keys_any_layout=bool(extra.get("hicache_io_sglang_keys_any_layout", False)),
            namespace_record=bool(extra.get("hicache_io_namespace_record", True)),
            integrity=bool(extra.get("hicache_io_integrity", True)) if integrity is None else integrity,
            unified=scheme == "unified",
        )
