"""``HicacheOffloadingConnector``: vLLM's offloading connector that survives a damaged chunk."""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional, Sequence

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from .worker import HicacheOffloadingWorker

log = logging.getLogger(__name__)


class HicacheOffloadingConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` with one change on the worker side: a load whose chunks
    fail their checksums completes (the request is not left waiting) and is reported as a load
    failure, which vLLM's scheduler recomputes under ``kv_load_failure_policy: "recompute"``
    (and fails the request under ``"fail"``):

    - one KV cache group: the damaged blocks, by :meth:`get_block_ids_with_load_errors` (the
      scheduler keeps the valid prefix and recomputes from the first damaged block);
    - several groups (block ids are not unique across them): the request, as a failed receive
      (recomputed from its start). A synchronous load there cannot be reported by request: the
      step that ran on it raises, before its output reaches the scheduler.

    vLLM 0.33's own connector asserts that every transfer succeeded: with it, a damaged chunk
    stops the engine instead (never wrong KV, but no recompute). vLLM 0.34's reports the load
    failed and recomputes the whole request, keeping the chunk: every later request over it
    fails and is recomputed whole again. With this connector, on both, the valid prefix is kept
    (one group) and the chunk leaves the index. Load this one with
    ``"kv_connector": "HicacheOffloadingConnector", "kv_connector_module_path":
    "hicache_io.vllm"``; the spec is chosen as for vLLM's connector (``spec_name``,
    ``spec_module_path``) and must be :class:`HicacheOffloadingSpec` for failed loads to be
    caught.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._failed_lock = threading.Lock()
        self._failed_blocks: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._failed_sync = False
        self._one_group = len(self._kv_cache_config.kv_cache_groups) == 1
        # Scheduler side: each request's last planned load (see _PlannedLoad), until it finishes.
        self._loads: dict[str, _PlannedLoad] = {}

    # ---- scheduler side: damaged chunks leave the manager's index --------------------------

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> Any:
        """vLLM's; then, for a load it just planned, what is needed to trace a failed device
        block back to its chunk (worked out only if one fails)."""
        sched = self.connector_scheduler
        before = set(sched._current_batch_load_jobs)
        result = super().update_state_after_alloc(request, blocks, num_external_tokens)
        for job_id in set(sched._current_batch_load_jobs) - before:
            job = sched._current_batch_load_jobs[job_id]
            state = sched._req_status[job.req_id]
            self._loads[job.req_id] = _PlannedLoad(job.dst_spec, list(state.load_key_ranges), set(sched._jobs[job_id].keys))
        return result

    def update_connector_output(self, connector_output: Any) -> None:
        """vLLM's, and first: the chunks behind a failed load leave the manager's index
        (:meth:`HicacheOffloadingManager.discard`), so the recomputed request stores a good copy
        instead of loading the damaged one again (vLLM's manager keeps it, and with
        ``kv_load_failure_policy: "recompute"`` every retry hits it and fails the same way,
        forever)."""
        damaged = self._damaged_keys(connector_output) if self._loads else []
        super().update_connector_output(connector_output)
        if not damaged:
            return
        manager = self.connector_scheduler.manager
        discard = getattr(manager, "discard", None)
        if discard is None:
            log.warning("hicache-io: the offloading manager (%s) cannot forget damaged chunks: use HicacheOffloadingSpec", type(manager).__name__)
            return
        with manager.lock:
            gone = discard(damaged)
        log.warning("hicache-io offloading: %d damaged chunk(s) leave the index (%d now, the rest when their loads end)", len(damaged), gone)

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        self._loads.pop(request.request_id, None)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        # What vLLM's scheduler calls for a connector that serves several groups (this one).
        self._loads.pop(request.request_id, None)
        return super().request_finished_all_groups(request, block_ids)

    def _damaged_keys(self, output: Any) -> list:
        """The keys of the chunks whose loads failed: by device block with one group (vLLM
        reports blocks), every key a load brought for a failed receive (vLLM reports the
        request). Only unfinished requests are looked at (a finished one's block ids may belong
        to another by now; a preempted one's too, until its next load replaces its entry: then a
        healthy chunk may go with the damaged one, which costs a recompute, never wrong KV)."""
        invalid = set(getattr(output, "invalid_block_ids", None) or ())
        failed = set(getattr(output, "failed_recving", None) or ())
        if not invalid and not failed:
            return []
        groups = self.connector_scheduler.config.kv_group_configs
        keys: list = []
        for req_id, load in self._loads.items():
            if req_id in failed:
                keys.extend(load.keys)
            elif invalid and self._one_group:
                keys.extend(load.keys_of_blocks(invalid, groups[0]))
        return list(dict.fromkeys(keys))

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        super().register_kv_caches(kv_caches)
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        if isinstance(worker, HicacheOffloadingWorker):
            worker.on_load_failure = self._load_failed

    def _load_failed(self, job_id: int, block_ids: Sequence[int]) -> None:
        # Runs before the job is reported finished, while vLLM's worker still maps the job to
        # its request (None: a synchronous load).
        req: Optional[str] = self.connector_worker._load_jobs.get(job_id) if self.connector_worker is not None else None
        with self._failed_lock:
            self._failed_blocks.update(int(b) for b in block_ids)
            if req is not None:
                self._failed_reqs.add(req)
            else:
                self._failed_sync = True

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        if not self._one_group:
            with self._failed_lock:
                failed = self._failed_reqs & results.finished_recving
                self._failed_reqs -= failed
            results.failed_recving |= failed
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._failed_lock:
            blocks, self._failed_blocks = self._failed_blocks, set()
            sync, self._failed_sync = self._failed_sync, False
            if self._one_group:
                self._failed_reqs.clear()
        if self._one_group:
            return blocks
        if sync:
            raise RuntimeError(
                "hicache-io: a synchronous KV load failed its checksums in a model with several KV cache groups, "
                "which vLLM can only recompute by block id within one group; stopping rather than computing on damaged KV"
            )
        return set()


class _PlannedLoad:
    """One planned load of a request: its device blocks (``dst``: per group ``group_sizes[g]``
    blocks from block index ``block_indices[g]``), the token range each loaded key covers
    (``ranges``: vLLM's ``load_key_ranges``, ``(start, end, key)``, every group's) and the keys."""

    __slots__ = ("dst", "ranges", "keys")

    def __init__(self, dst: Any, ranges: list, keys: set):
        self.dst, self.ranges, self.keys = dst, ranges, keys

    def keys_of_blocks(self, invalid: set, group: Any) -> list:
        """The keys loaded into the blocks of ``invalid`` (group 0: the only one vLLM reports
        block ids for)."""
        from vllm.v1.kv_offload.base import get_offload_group_idx

        size, first = int(self.dst.group_sizes[0]), int(self.dst.block_indices[0])
        ranges = [(lo, hi, k) for lo, hi, k in self.ranges if get_offload_group_idx(k) == group.group_idx]
        out = []
        for p, block in enumerate(self.dst.block_ids[:size]):
            if int(block) not in invalid:
                continue
            start = (first + p) * group.tokens_per_block
            out.extend(k for lo, hi, k in ranges if lo <= start < hi)
        return out
