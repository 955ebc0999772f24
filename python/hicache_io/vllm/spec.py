"""``HicacheOffloadingSpec``: vLLM's CPU offloading spec with hicache-io doing the moves."""

from __future__ import annotations

import logging
import math
import mmap
from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingMetricMetadata, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager

from .worker import HicacheOffloadingWorker, RegionRows

log = logging.getLogger(__name__)


class _Discarding:
    """What a CPU manager of vLLM's needs to forget chunks whose loads failed their checksums
    (mixed into vLLM's ``CPUOffloadingManager`` and its tiering primary)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
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
        super().reset_cache()  # type: ignore[misc]
        self._doomed.clear()


class HicacheOffloadingManager(_Discarding, CPUOffloadingManager):
    """vLLM's ``CPUOffloadingManager`` that can forget chunks whose loads failed their checksums.

    vLLM's manager keeps a chunk in its index after a failed load, so every later lookup hits it
    and every load of it fails again: with ``kv_load_failure_policy: "recompute"`` the scheduler
    reschedules the request, which hits the same chunk, forever. :meth:`discard` takes such
    chunks out (at once when no load holds them, else when the last one completes), so the next
    request recomputes the tokens and stores a good copy.
    """


class HicachePrimaryTier(_Discarding, CPUPrimaryTierOffloadingManager):
    """vLLM's tiering primary (the CPU tier over the shared region) that can forget damaged
    chunks as :class:`HicacheOffloadingManager` does; a secondary tier's good copy then serves
    the next request."""


class HicacheTieringManager(TieringOffloadingManager):
    """vLLM's ``TieringOffloadingManager`` whose primary tier can forget damaged chunks
    (:meth:`discard`, under :attr:`lock` as every call of the manager)."""

    def discard(self, keys: Any) -> int:
        return self.primary_tier.discard(keys)  # type: ignore[attr-defined]


def region_layout(config: OffloadingConfig, blocks_per_chunk: int) -> tuple[int, int]:
    """``(sums_at, row_stride)`` of the rows of the shared region the worker keeps chunks in when
    secondary tiers are configured: a row is one block of one worker, its tensors' data bytes
    packed from 0, then at ``sums_at`` one 8-byte checksum per tensor (room for two per layer:
    K and V may be tensors of their own), the row padded so a chunk (``world_size ×
    blocks_per_chunk`` rows) is whole pages, as the region needs. The scheduler and every worker
    compute it from the same config."""
    layers = sum(len(g.layer_names) for g in config.groups)
    sums_at = -(-config.worker_kv_bytes_per_block // 8) * 8
    rows = config.parallel.world_size * blocks_per_chunk
    align = math.lcm(8, mmap.PAGESIZE // math.gcd(rows, mmap.PAGESIZE))
    row = sums_at + 16 * max(layers, 1)
    return sums_at, -(-row // align) * align


class HicacheOffloadingSpec(OffloadingSpec):
    """vLLM's CPU offloading, configured as vLLM's ``CPUOffloadingSpec`` is:
    ``cpu_bytes_to_use`` (all workers together, required), ``eviction_policy`` (``lru`` or
    ``arc``), ``cache_policy_module_path``, ``store_threshold``, ``max_tracker_size``; and, as
    vLLM's ``TieringOffloadingSpec``, ``secondary_tiers`` (with ``tier_poll_interval_s`` and
    ``backpressure``), e.g. ``[{"type": "HicacheTier", "module_path": "hicache_io.vllm",
    "store": "local", "path": ...}]``.

    The scheduler side is vLLM's own ``CPUOffloadingManager`` (chunk ids, eviction, events),
    as :class:`HicacheOffloadingManager`, which can also forget a chunk whose load failed;
    the worker side is :class:`HicacheOffloadingWorker`, which keeps each worker's chunks in
    hicache-io host rows on the executor of the KV tensors. Unlike vLLM's CPU spec it runs on
    CPU tensors too, and verifies every chunk it loads.

    With ``secondary_tiers`` the scheduler side is vLLM's ``TieringOffloadingManager`` over
    :class:`HicachePrimaryTier`, and the worker keeps its rows in vLLM's shared region
    (``/dev/shm``, mapped by the scheduler and every worker), each row carrying its tensors'
    checksums (:func:`region_layout`): the secondary tiers copy chunks with their checksums, and
    a chunk promoted from one is verified when the worker loads it, as a stored one is.
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        # The same managers, so the same metrics.
        if "secondary_tiers" in extra_config:
            from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

            return TieringOffloadingSpec.build_metric_definitions(extra_config)
        return CPUOffloadingSpec.build_metric_definitions(extra_config)

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        if "secondary_tiers" in extra_config:
            from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

            return TieringOffloadingSpec.config_info_keys(extra_config)
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
        self.secondary_tier_configs: list[dict[str, Any]] | None = None
        if "secondary_tiers" in self.extra_config:
            tiers = self.extra_config["secondary_tiers"]
            if not isinstance(tiers, list) or not all(isinstance(t, dict) for t in tiers):
                raise ValueError("secondary_tiers must be a list of tier configurations")
            if int(self.extra_config.get("store_threshold", 0)) >= 2:
                raise ValueError("store_threshold is not supported with secondary_tiers")
            self.secondary_tier_configs = [_with_backpressure(dict(t), self.extra_config.get("backpressure")) for t in tiers]
        self.num_chunks = 0
        self.kv_bytes_per_chunk = 0
        self.region_sums_at = self.region_row_stride = 0
        world_size = config.parallel.world_size
        if config.worker_kv_bytes_per_block > 0 and world_size > 0:
            if self.secondary_tier_configs is None:
                # As vLLM's CPU spec counts it: every worker keeps its own copy of each chunk
                # (no replicated layout: `replicated_layout` stays False, so every rank stores),
                # in rows of its own (no shared region, so no rounding of chunks to its pages).
                self.kv_bytes_per_chunk = config.worker_kv_bytes_per_block * world_size * self.blocks_per_chunk
            else:
                self.region_sums_at, self.region_row_stride = region_layout(config, self.blocks_per_chunk)
                self.kv_bytes_per_chunk = self.region_row_stride * world_size * self.blocks_per_chunk
            self.num_chunks = int(cpu_bytes_to_use) // self.kv_bytes_per_chunk
        self.cpu_info = CPUOffloadingInfo.from_config(config, self.num_chunks, self.kv_bytes_per_chunk)
        self.eviction_policy: str = self.extra_config.get("eviction_policy", "lru")
        self.cache_policy_module_path: str | None = self.extra_config.get("cache_policy_module_path")
        self._engine_id = config.engine_id
        self._manager: OffloadingManager | None = None
        self._worker: HicacheOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            if self.secondary_tier_configs is not None:
                self._manager = self._tiering_manager()
            else:
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

    def _region(self, rank: int | None) -> Any:
        """vLLM's shared region of this engine (``/dev/shm/vllm_offload_<engine id>.mmap``), the
        scheduler's mapping (``rank=None``) or a worker's. The first to open the file creates it,
        the others map the same file. No barrier: with one, the creating worker unlinks the path
        once the workers mapped it, before the scheduler (built after the workers registered
        their KV caches) maps it, and the scheduler would make a region of its own that the
        workers never see. :meth:`_tiering_manager` unlinks it instead."""
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

        if self.num_chunks <= 0:
            raise ValueError(f"cpu_bytes_to_use {self.extra_config.get('cpu_bytes_to_use')} holds no chunk of {self.kv_bytes_per_chunk} bytes")
        return SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.region_row_stride * self.blocks_per_chunk,
        )

    def _tiering_manager(self) -> OffloadingManager:
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
        from vllm.v1.kv_offload.tiering.manager import DEFAULT_TIER_POLL_INTERVAL_S

        region = self._region(None)
        if not region._creator:
            # The workers made and mapped it (their KV caches are registered before the
            # scheduler is built): nobody else opens the path, so the memory goes with the
            # last process that maps it, however it ends. (vLLM's own unlink: every segment file.)
            region._unlink()
        primary = None
        tiers: list[Any] = []
        try:
            primary = HicachePrimaryTier(
                num_chunks=self.num_chunks,
                mmap_region=region,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                info=self.cpu_info,
            )
            view = primary.get_kv_memoryview()
            for cfg in self.secondary_tier_configs or []:
                tiers.append(SecondaryTierFactory.create_secondary_tier(cfg, view, self))
            poll = float(self.extra_config.get("tier_poll_interval_s", DEFAULT_TIER_POLL_INTERVAL_S))
            manager = HicacheTieringManager(primary_tier=primary, secondary_tiers=tiers, tier_poll_interval_s=poll)
        except Exception:
            for tier in reversed(tiers):
                try:
                    tier.shutdown()
                except Exception:
                    log.exception("hicache-io: shutting down a secondary tier after a failed start")
            if primary is not None:
                primary.shutdown()
            else:
                region.cleanup()
            raise
        log.info("hicache-io: tiering over %d chunks of %d bytes, %d secondary tier(s)", self.num_chunks, self.kv_bytes_per_chunk, len(tiers))
        return manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            if self.secondary_tier_configs is None:
                self._worker = HicacheOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
            else:
                region = self._region(self.config.parallel.rank)
                rows = RegionRows(
                    region=region,
                    rank=self.config.parallel.rank,
                    world_size=self.config.parallel.world_size,
                    row_stride=self.region_row_stride,
                    sums_at=self.region_sums_at,
                )
                try:
                    self._worker = HicacheOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, region=rows)
                except Exception:
                    region.cleanup()
                    raise
        return self._worker


def _with_backpressure(tier: dict[str, Any], defaults: Any) -> dict[str, Any]:
    """A tier's ``backpressure``, field by field: its own over the top-level ``backpressure``
    (as vLLM's tiering spec merges them); absent when neither says anything."""
    merged: dict[str, Any] = {}
    for source in (defaults, tier.get("backpressure")):
        if source:
            merged.update(source)
    if merged or "backpressure" in tier:
        tier["backpressure"] = merged
    return tier
