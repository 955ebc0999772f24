"""``HicacheOffloadingSpec``: vLLM's CPU offloading spec with hicache-io doing the moves."""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingMetricMetadata, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from .worker import HicacheOffloadingWorker


class HicacheOffloadingSpec(OffloadingSpec):
    """vLLM's CPU offloading, configured as vLLM's ``CPUOffloadingSpec`` is:
    ``cpu_bytes_to_use`` (all workers together, required), ``eviction_policy`` (``lru`` or
    ``arc``), ``cache_policy_module_path``, ``store_threshold``, ``max_tracker_size``.

    The scheduler side is vLLM's own ``CPUOffloadingManager`` (chunk ids, eviction, events);
    the worker side is :class:`HicacheOffloadingWorker`, which keeps each worker's chunks in
    hicache-io host rows on the executor of the KV tensors. Unlike vLLM's CPU spec it runs on
    CPU tensors too, and verifies every chunk it loads.
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        # The same manager, so the same metrics.
        return CPUOffloadingSpec.build_metric_definitions(extra_config)

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return CPUOffloadingInfo.config_info_keys()

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        cpu_bytes_to_use = self.extra_config.get("cpu_bytes_to_use")
        if not cpu_bytes_to_use:
            raise ValueError("cpu_bytes_to_use must be specified in kv_connector_extra_config")
        if int(cpu_bytes_to_use) <= 0:
            raise ValueError(f"cpu_bytes_to_use must be positive, got {cpu_bytes_to_use}")
        if config.canonical_layout:
            # The canonical layout scatters a page through per-rank fragment runs; this worker
            # keeps each worker's own pages (vLLM's default layout).
            raise ValueError("HicacheOffloadingSpec keeps each worker's own pages: canonical_layout is not supported")
        self.num_chunks = 0
        self.kv_bytes_per_chunk = 0
        world_size = config.parallel.world_size
        if config.worker_kv_bytes_per_block > 0 and world_size > 0:
            # As vLLM's CPU spec counts it: every worker keeps its own copy of each chunk (no
            # replicated layout: `replicated_layout` stays False, so every rank stores), in rows
            # of its own (no shared mmap region, so no rounding of chunks to its alignment).
            self.kv_bytes_per_chunk = config.worker_kv_bytes_per_block * world_size * self.blocks_per_chunk
            self.num_chunks = int(cpu_bytes_to_use) // self.kv_bytes_per_chunk
        self.cpu_info = CPUOffloadingInfo.from_config(config, self.num_chunks, self.kv_bytes_per_chunk)
        self.eviction_policy: str = self.extra_config.get("eviction_policy", "lru")
        self.cache_policy_module_path: str | None = self.extra_config.get("cache_policy_module_path")
        self._manager: OffloadingManager | None = None
        self._worker: HicacheOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = CPUOffloadingManager(
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
                info=self.cpu_info,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = HicacheOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker
