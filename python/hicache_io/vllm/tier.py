"""``HicacheTier``: a vLLM secondary tier on hicache-io's L3 transports, every chunk sealed with
a checksum bound to its key."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterable, Optional

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, Medium, OffloadKey, ReqContext, RequestOffloadingContext, ScheduleEndContext
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from .. import _native
from ..l3.errors import DAMAGED
from ..l3.trailer import TRAILER_BYTES, matches, seal
from ..l3.transport import OTHER_SIZE, Spans, open_transport

#: A load's answers that fail a chunk for good: damaged, or stored in another size.
_REFUSED = frozenset((*OTHER_SIZE.values(), DAMAGED))

log = logging.getLogger(__name__)


class _Lookups(AsyncLookupManager):
    """Existence checks off the scheduler thread (one batch a step), as vLLM's own tiers do."""

    def __init__(self, tier: "HicacheTier", tier_type: str):
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.stored(keys)


class HicacheTier(SecondaryTierManager):
    """Chunks of vLLM's CPU tier in hicache-io's L3 stores: ``store="local"`` (a directory shared
    by the processes of a machine, no server: ``path``, ``capacity_bytes``, ``fsync``, ``writes``
    and ``reads``: how files are written and read, :data:`hicache_io.l3.local.WRITE_RULES` and
    ``READ_RULES``; chunks are written ``direct`` and read ``auto`` by default: a chunk the page
    cache does not hold is read past it the first time the tier loads it (a restarted server's
    loads at the disk's speed), through it the next, so that a chunk loaded again is cached for the
    loads after; at capacity, direct writes go over the files of the chunks the store evicts,
    :mod:`hicache_io.l3.local`) or
    ``store="mooncake"`` (Mooncake Store: ``master_server_address``, ``metadata_server``,
    ``protocol``, ``global_segment_size``, ``local_buffer_size``, ``local_hostname``,
    ``device_name``).

    Each chunk is one object: the chunk's bytes (the primary tier's whole row) and a 16-byte
    trailer holding its checksum folded with its key's tag. A load verifies every chunk that
    lands against its trailer; a chunk that fails (damaged, torn, stored under another key, of
    another size) fails its key: the job reports the others in ``successful_keys``, the object is
    removed, and later lookups of the key answer miss until it is stored again, so vLLM
    recomputes it (never loads it twice).

    Keys are vLLM's own file names for the chunk (``FileMapper``: the model, the KV groups, the
    dtype and, unless vLLM certifies the layout parallelism-agnostic, the parallel sizes and the
    rank, hashed into a namespace), prefixed with the row size (and, under
    ``HicacheOffloadingSpec``'s ``secondary_tiers``, its row layout, the ranks always hashed in):
    tiers of one namespace share chunks across processes and restarts; chunks of different shapes
    or layouts never meet.
    """

    medium = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        locality: Any = None,
        store: str = "local",
        path: Optional[str] = None,
        capacity_bytes: Optional[int] = None,
        fsync: bool = False,
        threads: int = 4,
        writes: str = "direct",
        reads: str = "auto",
        namespace: str = "hicache-io",
        **mooncake: Any,
    ):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if locality is not None:
            self.locality = locality
        row = self.block_size_bytes
        flat = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 or primary_kv_view.format != "B" else primary_kv_view
        self._mem = np.frombuffer(flat, dtype=np.uint8)
        if row <= 0 or len(self._mem) % row:
            raise ValueError(f"the primary tier's view ({len(self._mem)} bytes) is not whole rows of {row} bytes")
        self._row = row
        self._chunks = len(self._mem) // row
        # One trailer per chunk slot: a slot belongs to one job at a time (vLLM pins it).
        self._trailers = np.zeros((max(self._chunks, 1), 2), dtype=np.uint64)
        local = {"path": path, "capacity_bytes": capacity_bytes, "fsync": fsync, "writes": writes, "reads": reads}
        if store == "local" and mooncake:
            raise TypeError(f"unknown options for the local store: {sorted(mooncake)}")
        self._io = open_transport(store, local if store == "local" else mooncake, threads=threads)
        self.client = self._io.client
        self._registered = self._io.register([(self._mem.ctypes.data, len(self._mem)), (self._trailers.ctypes.data, self._trailers.nbytes)])
        # HicacheOffloadingSpec's own rows (each worker's blocks with their checksums) are laid out
        # unlike vLLM's CPU tier's and hold one topology's ranks: their chunks carry the layout
        # in their keys and never meet another layout's or topology's, even of the same size.
        rows = getattr(offloading_spec, "region_row_stride", 0)
        self._mapper = FileMapper.from_offloading_spec(root_dir=namespace, offloading_spec=offloading_spec, blocks_per_file=offloading_spec.blocks_per_chunk, parallel_agnostic=not rows)
        self._prefix = f"{row}B-rows{rows}/" if rows else f"{row}B/"
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="hicache-io-tier")
        self._lock = threading.Lock()
        self._finished: list[JobResult] = []
        self._pending: Dict[int, threading.Event] = {}
        self._missed: list = []
        self._present: list = []
        self._lookups = _Lookups(self, tier_type)
        self.stats = {"stored": 0, "loaded": 0, "verified": 0, "corrupt": 0, "store_failed": 0, "missing": 0}

    def object_key(self, key: OffloadKey) -> str:
        return self._prefix + self._mapper.get_file_name(key)

    # ---- spans ----------------------------------------------------------------------------

    def _spans(self, chunk_ids: np.ndarray) -> Spans:
        base, tbase = self._mem.ctypes.data, self._trailers.ctypes.data
        ptrs = [[base + int(c) * self._row, tbase + int(c) * TRAILER_BYTES] for c in chunk_ids]
        return Spans(ptrs, [[self._row, TRAILER_BYTES]] * len(ptrs), True, True)

    def _sums(self, chunk_ids: np.ndarray) -> np.ndarray:
        return np.array([_native.checksum(self._mem[int(c) * self._row : (int(c) + 1) * self._row], _native.STORAGE_SEED) for c in chunk_ids], dtype=np.uint64)

    def _check(self, job: TransferJob) -> np.ndarray:
        # A job names a few chunks (vLLM's: one): checked as Python ints, numpy's calls on arrays
        # this small cost more than the checks.
        ids = [int(c) for c in job.chunk_ids]
        if len(ids) != len(job.keys):
            raise ValueError(f"job {job.job_id}: {len(job.keys)} keys for {len(ids)} chunks")
        if ids and (min(ids) < 0 or max(ids) >= self._chunks):
            raise IndexError(f"job {job.job_id}: chunk ids outside the primary tier's {self._chunks} chunks")
        if len(set(ids)) != len(ids):
            raise ValueError(f"job {job.job_id}: a chunk named twice")
        return np.array(ids, dtype=np.int64)

    def stored(self, keys: Iterable[OffloadKey]) -> list[bool]:
        """Whether each chunk's object is in the store (one existence call)."""
        return [bool(f == 1) for f in self._io.exists([self.object_key(k) for k in keys])]

    # ---- jobs -----------------------------------------------------------------------------

    def _finish(self, result: JobResult) -> None:
        with self._lock:
            self._finished.append(result)
            done = self._pending.pop(result.job_id, None)
        if done is not None:
            done.set()

    def _store(self, job: TransferJob, chunk_ids: np.ndarray, keys: list[str]) -> None:
        t0 = time.perf_counter()
        try:
            seal(self._trailers, chunk_ids, self._sums(chunk_ids), keys)
            rcs = self._io.put(keys, keys, self._spans(chunk_ids))[0].tolist()
            ok = not any(rcs)
            if not ok:
                log.warning("hicache-io tier: %d of %d chunks not stored (codes %s)", sum(rc != 0 for rc in rcs), len(keys), sorted(set(rcs)))
        except Exception:
            log.exception("hicache-io tier: store job %d failed", job.job_id)
            ok, rcs = False, [-1] * len(keys)
        stored = [k for k, rc in zip(job.keys, rcs) if rc == 0]
        with self._lock:
            self.stats["stored"] += len(stored)
            self.stats["store_failed"] += len(rcs) - len(stored)
            # Lookup verdicts belong to the scheduler thread: applied in get_finished_jobs.
            self._present.extend(stored)
        self._finish(JobResult(job_id=job.job_id, success=ok, transfer_time=time.perf_counter() - t0, transfer_bytes=len(keys) * self._row))

    def _load(self, job: TransferJob, chunk_ids: np.ndarray, keys: list[str]) -> None:
        t0 = time.perf_counter()
        all_keys = list(job.keys)
        good = bad = [False] * len(keys)
        try:
            self._trailers[chunk_ids] = 0
            got, _, _, _ = self._io.get(keys, keys, [self._spans(chunk_ids)])
            got = got.tolist()
            whole = [g == self._row + TRAILER_BYTES for g in got]
            if any(whole):
                good = (np.array(whole) & matches(self._trailers[chunk_ids], self._sums(chunk_ids), keys)).tolist()
            # Damaged, or stored in another size (refused by both transports as -600 / -800):
            # such an object would fail every later load, and a store keeps an existing object.
            bad = [(w and not ok) or g in _REFUSED for w, ok, g in zip(whole, good, got)]
            for j in (j for j, b in enumerate(bad) if b):
                if got[j] != DAMAGED:  # the local store removed a damaged file itself
                    self.client.remove(keys[j])
                log.warning("hicache-io tier: chunk %s failed its checks (%d); removed", keys[j], got[j])
        except Exception:
            log.exception("hicache-io tier: load job %d failed", job.job_id)
        failed = [k for k, ok in zip(all_keys, good) if not ok]
        with self._lock:
            self.stats["loaded"] += len(keys)
            self.stats["verified"] += len(keys) - len(failed)
            self.stats["corrupt"] += sum(bad)
            self.stats["missing"] += len(failed) - sum(bad)
            # Lookup verdicts belong to the scheduler thread: applied in get_finished_jobs.
            self._missed.extend(failed)
        ok = not failed
        successful = None if ok else (tuple(k for k, g in zip(all_keys, good) if g) or None)
        self._finish(JobResult(job_id=job.job_id, success=ok, successful_keys=successful, transfer_time=time.perf_counter() - t0, transfer_bytes=len(keys) * self._row))

    def _submit(self, job: TransferJob, work) -> None:
        chunk_ids = self._check(job)
        keys = [self.object_key(k) for k in job.keys]
        done = threading.Event()
        with self._lock:
            self._pending[job.job_id] = done

        def run() -> None:
            try:
                work(job, chunk_ids, keys)
            finally:
                # Whatever happened, the job is answered once (a failure if `work` did not).
                with self._lock:
                    unanswered = job.job_id in self._pending
                if unanswered:
                    self._finish(JobResult(job_id=job.job_id, success=False))

        try:
            self._pool.submit(run)
        except Exception:
            with self._lock:
                self._pending.pop(job.job_id, None)
            raise

    # ---- vLLM's interface -----------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._store)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._load)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            out, self._finished = self._finished, []
            missed, self._missed = self._missed, []
            present, self._present = self._present, []
        if missed:
            # Before vLLM sees the failures: a key that failed answers miss from now on.
            self._lookups.mark_miss(missed)
        if present and hasattr(self._lookups, "mark_present"):
            # vLLM 0.34: a lookup begun before the store must not answer "absent" for its keys.
            self._lookups.mark_present(present)
        return out

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        while True:
            with self._lock:
                waiting = list(self._pending.values())
            if not waiting:
                return
            for done in waiting:
                done.wait()

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._pool.shutdown(wait=True)
        try:
            self._io.unregister(self._registered)
        finally:
            self.client.close()
