"""``HicacheOffloadingConnector``: vLLM's offloading connector that survives a damaged chunk."""

from __future__ import annotations

import threading
from typing import Optional, Sequence

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from .worker import HicacheOffloadingWorker


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
    stops the engine instead (never wrong KV, but no recompute). Load this one with
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
