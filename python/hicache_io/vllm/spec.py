"""``HicacheOffloadingSpec``: vLLM's CPU offloading spec with hicache-io doing the moves."""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingMetricMetadata, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from .worker import HicacheOffloadingWorker


class HicacheOffloadingManager(CPUOffloadingManager):
    """vLLM's ``CPUOffloadingManager`` that can forget chunks whose loads failed their checksums.

    vLLM's manager keeps a chunk in its index after a failed load, so every later lookup hits it
    and every load of it fails again: with ``kv_load_failure_policy: "recompute"`` the scheduler
    reschedules the request, which hits the same chunk, forever. :meth:`discard` takes such
    chunks out (at once when no load holds them, else when the last one completes), so the next
    request recomputes the tokens and stores a good copy.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._doomed: set = set()
        #: Chunks taken out of the index after failed loads (for stats and tests).
        self.discarded = 0

    def discard(self, keys: Any) -> int:
        """Removes ``keys`` from the index (a key not in it is skipped; one that a load still
        holds goes when that load completes); returns how many went now."""
        gone = []
        for key in keys:
            chunk = self._policy.get(key)
            if chunk is None or not chunk.is_ready:
                continue  # absent, or a store in flight: a new copy is on its way
            if chunk.ref_cnt > 0:
                self._doomed.add(key)
                continue
            self._remove_ready(key, chunk)
            gone.append(key)
        self._removed_event(gone)
        return len(gone)

    def _remove_ready(self, key: Any, chunk: Any) -> None:
        self._num_evictable_cache_chunks -= 1
        self._policy.remove(key)
        self._free_chunk(chunk)
        self.discarded += 1

    def _removed_event(self, keys: list) -> None:
        if keys and self.events is not None:
            from vllm.v1.kv_offload.base import OffloadingEvent

            self.events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=True))

    def complete_load(self, keys: Any, req_context: Any) -> None:
        super().complete_load(keys, req_context)
        # The doomed among these go now, unless another load still holds them (discard keeps those).
        doomed = [key for key in keys if key in self._doomed]
        if doomed:
            self._doomed.difference_update(doomed)
            self.discard(doomed)

    def reset_cache(self) -> None:
        super().reset_cache()
        self._doomed.clear()


class HicacheOffloadingSpec(OffloadingSpec):
    """vLLM's CPU offloading, configured as vLLM's ``CPUOffloadingSpec`` is:
    ``cpu_bytes_to_use`` (all workers together, required), ``eviction_policy`` (``lru`` or
    ``arc``), ``cache_policy_module_path``, ``store_threshold``, ``max_tracker_size``.

    The scheduler side is vLLM's own ``CPUOffloadingManager`` (chunk ids, eviction, events),
    as :class:`HicacheOffloadingManager`, which can also forget a chunk whose load failed;
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
            self._manager = HicacheOffloadingManager(
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
