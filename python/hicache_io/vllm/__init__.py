"""vLLM's KV offloading on hicache-io: an offloading spec, its worker, a secondary tier and a
connector that turns a damaged chunk into a recompute.

Written for vLLM 0.33.0 and 0.34.0, whose offloading APIs differ (0.34's worker is handed device
pointers, and reports failed loads itself): importing this module with any other vLLM version
raises ``ImportError`` naming the version found.

- :class:`HicacheOffloadingSpec` -- vLLM's CPU offloading (its own ``CPUOffloadingManager``:
  LRU/ARC, events, store threshold) with the chunks kept in hicache-io host rows and every store
  and load a hicache-io call: on the cpu executor for vLLM on CPU (which vLLM's own CPU spec
  refuses), on the cuda executor for CUDA tensors. Each row's checksum is recorded inside the
  store copy and verified inside the load copy: a damaged chunk fails its load, never lands as
  KV. Configure it as vLLM's CPU spec::

      kv_transfer_config = {
          "kv_connector": "OffloadingConnector",
          "kv_role": "kv_both",
          "kv_connector_extra_config": {
              "spec_name": "HicacheOffloadingSpec",
              "spec_module_path": "hicache_io.vllm",
              "cpu_bytes_to_use": 8 << 30,
              "eviction_policy": "lru",
              "block_size": 64,
          },
      }

- :class:`HicacheOffloadingConnector` -- vLLM's ``OffloadingConnector`` that reports a failed
  load's blocks through ``get_block_ids_with_load_errors`` and drops the damaged chunk from the
  index (vLLM 0.33's connector asserts that every transfer succeeded; 0.34's recomputes the
  whole request and keeps the chunk); with ``kv_load_failure_policy: "recompute"`` the scheduler
  recomputes from the first damaged block. Use ``"kv_connector": "HicacheOffloadingConnector",
  "kv_connector_module_path": "hicache_io.vllm"``.
- :class:`HicacheTier` -- a secondary tier (``secondary_tiers: [{"type": "HicacheTier",
  "module_path": "hicache_io.vllm", ...}]``) that moves chunks between vLLM's CPU tier and
  hicache-io's L3 stores (a local directory, or Mooncake Store), sealed with checksums; in
  ``HicacheOffloadingSpec``'s own ``secondary_tiers`` (CPU tensors) or under vLLM's
  ``TieringOffloadingSpec``.
"""

from __future__ import annotations

#: The vLLM releases this module serves (their offloading APIs differ; see ``_versions``).
VLLM_VERSIONS = ("0.33.0", "0.34.0")

try:
    import vllm as _vllm
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"hicache_io.vllm needs vLLM {' or '.join(VLLM_VERSIONS)} (pip install --no-deps vllm=={VLLM_VERSIONS[-1]}): {e}") from e

if getattr(_vllm, "__version__", None) not in VLLM_VERSIONS:
    raise ImportError(
        f"hicache_io.vllm is written for vLLM {' and '.join(VLLM_VERSIONS)}'s offloading APIs, found vLLM "
        f"{getattr(_vllm, '__version__', '?')}: its spec, worker and tier interfaces change between releases"
    )

#: The vLLM release found (one of :data:`VLLM_VERSIONS`).
VLLM_VERSION: str = _vllm.__version__

from .connector import HicacheOffloadingConnector  # noqa: E402
from .spec import HicacheOffloadingManager, HicacheOffloadingSpec  # noqa: E402
from .tier import HicacheTier  # noqa: E402
from .worker import HicacheOffloadingWorker  # noqa: E402

__all__ = ["HicacheOffloadingConnector", "HicacheOffloadingManager", "HicacheOffloadingSpec", "HicacheOffloadingWorker", "HicacheTier", "VLLM_VERSION", "VLLM_VERSIONS"]
