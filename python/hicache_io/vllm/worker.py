"""``HicacheOffloadingWorker``: vLLM's offloading worker as hicache-io calls on a block tier."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec, CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker, TransferResult

from .. import _native
from ._versions import DevicePointers

log = logging.getLogger(__name__)

#: Called with ``(job_id, block_ids)`` for a load whose chunks failed their checksums (the
#: engine's blocks that must be recomputed); the job then completes as a success. Without it,
#: such a job completes with ``success=False``.
LoadFailureSink = Callable[[int, Sequence[int]], None]


@dataclass
class _Rows:
    """One group's part of a transfer: engine blocks, host rows, and the tensors it touches."""

    tensors: list[int]
    blocks: np.ndarray
    rows: np.ndarray


@dataclass
class RegionRows:
    """Where a worker keeps its rows when secondary tiers read them: vLLM's ``SharedOffloadRegion``
    of ``chunks`` rows of ``world_size × B`` host rows each, ``row_stride`` bytes apart; this
    worker's (``rank``) are rows ``c × world_size × B + rank × B + i``, its tensors' bytes packed
    from 0 and one 8-byte checksum per tensor at ``sums_at`` (the checksum plus one; 0: none)."""

    region: Any
    rank: int
    world_size: int
    row_stride: int
    sums_at: int


def chunk_rows(group_size: int, block_index: int, chunks: np.ndarray, blocks_per_chunk: int, chunk_rows: int = 0, first: int = 0) -> np.ndarray:
    """Host rows of ``group_size`` logically consecutive blocks, the first at logical index
    ``block_index``, held by ``chunks`` (chunk ``c`` holds rows ``c × R + first .. c × R + first
    + B - 1``, ``R`` = ``chunk_rows``, by default ``B``). The first chunk may hold earlier
    blocks (skipped) and the last one later ones (unused)."""
    per = chunk_rows or blocks_per_chunk
    skip = block_index % blocks_per_chunk
    rows = (chunks.astype(np.int64)[:, None] * per + first + np.arange(blocks_per_chunk, dtype=np.int64)[None, :]).ravel()
    return rows[skip : skip + group_size]


def blocks_view(x: torch.Tensor, page: int, j: int) -> torch.Tensor:
    """KV tensor ``j`` as int8 ``blocks × page`` bytes: a contiguous tensor, or a 2-D byte tensor
    whose blocks lie ``stride(0)`` bytes apart, further than ``page`` (a view of blocks packed
    with other views', as vLLM gives for packed layouts); the bytes between its blocks are not
    its own and are never touched."""
    if x.is_contiguous():
        return x.view(torch.int8).view(-1, page)
    if x.dim() == 2 and x.element_size() == 1 and x.shape[1] == page and x.stride(1) == 1 and x.stride(0) > page:
        return x.view(torch.int8)
    raise ValueError(
        f"KV tensor {j}: expected contiguous blocks of {page} bytes, or a 2-D byte tensor of {page}-byte blocks "
        f"(strides (S, 1)), got shape {tuple(x.shape)} with strides {x.stride()} of {x.dtype}"
    )


class HicacheOffloadingWorker(OffloadingWorker):
    """Moves KV blocks between vLLM's canonical KV tensors and hicache-io host rows
    (:class:`hicache_io.BlockTier`), one row per block, ``blocks_per_chunk`` rows per chunk.

    Every transfer is checked in full before a byte moves (groups, counts, chunk and block ids,
    duplicate destinations). Each row's checksum is recorded inside the store copy and verified
    inside the load copy; a load that reads a damaged row completes with ``success=False`` (or,
    with a :data:`LoadFailureSink`, reports the blocks to recompute).

    On CPU tensors transfers run in submission order on one thread of the worker (expedited
    loads go first), releasing the GIL. On CUDA tensors they are enqueued on the worker's own
    stream: a store after the compute stream's work so far (the KV it reads is written), a load
    likewise; completion is tracked with events (the host waits only in ``wait``).
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int, region: Optional[RegionRows] = None):
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be at least 1, got {blocks_per_chunk}")
        if num_chunks < 0:
            raise ValueError(f"num_chunks must not be negative, got {num_chunks}")
        self.blocks_per_chunk = blocks_per_chunk
        self.num_chunks = num_chunks
        tensors: list[torch.Tensor] = []
        for j, t in enumerate(kv_caches.tensors):
            if t.page_size_bytes <= 0:
                raise ValueError(f"KV tensor {j}: page size {t.page_size_bytes}")
            tensors.append(blocks_view(t.tensor, t.page_size_bytes, j))
        if not tensors:
            raise ValueError("no KV tensors to offload")
        if len({t.shape[0] for t in tensors}) != 1:
            raise ValueError(f"KV tensors of different block counts: {sorted({t.shape[0] for t in tensors})}")
        devices = {x.device for x in tensors}
        if len(devices) != 1:
            raise ValueError(f"KV tensors on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop()
        # The bytes of a block that hold data: the widest page any layer reads from the tensor
        # (a layer's page may be padded to the tensor's).
        row_bytes = [0] * len(tensors)
        self._groups: list[list[int]] = []
        # Per group, its data refs as (tensor, page bytes), in vLLM's order (0.34's pointers).
        self._refs = [[(int(r.tensor_idx), int(r.page_size_bytes)) for r in refs] for refs in kv_caches.group_data_refs]
        # Where vLLM 0.34 puts a tensor's block `b`: `data_ptr + b × stride(0)` of the canonical
        # tensor as it is (its stride in elements, whatever the dtype): pointers are mapped back
        # by the same rule, so each names the block vLLM meant.
        self._pointer_rule = [(int(t.tensor.data_ptr()), int(t.tensor.stride(0)), int(t.tensor.shape[0])) for t in kv_caches.tensors]
        for g, refs in enumerate(kv_caches.group_data_refs):
            used = []
            for ref in refs:
                if not 0 <= ref.tensor_idx < len(tensors):
                    raise ValueError(f"group {g}: tensor index {ref.tensor_idx} of {len(tensors)}")
                page = tensors[ref.tensor_idx].shape[1]
                if not 0 < ref.page_size_bytes <= page:
                    raise ValueError(f"group {g}: page of {ref.page_size_bytes} bytes in a tensor of {page}-byte blocks")
                row_bytes[ref.tensor_idx] = max(row_bytes[ref.tensor_idx], ref.page_size_bytes)
                if ref.tensor_idx not in used:
                    used.append(ref.tensor_idx)
            self._groups.append(used)
        self._tensors = tensors
        for j, t in enumerate(tensors):
            if row_bytes[j] == 0:
                row_bytes[j] = t.shape[1]
        self.row_bytes = row_bytes
        self._stream = None
        stream_handle = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)
            stream_handle = self._stream.cuda_stream
        elif self.device.type != "cpu":
            raise ValueError(f"KV tensors on {self.device}: hicache-io moves CPU and CUDA tensors")
        self.region = region
        self._chunk_rows, self._first_row = blocks_per_chunk, 0
        self._sums: Optional[np.ndarray] = None
        if region is None:
            host_rows = num_chunks * blocks_per_chunk
            self.tier = _native.BlockTier(tensors, row_bytes, host_rows, stream=stream_handle) if host_rows else None
        else:
            host_rows = self._region_tier(region, tensors, row_bytes, num_chunks)
        self.on_load_failure: Optional[LoadFailureSink] = None
        self._lock = threading.Lock()
        self._finished: list[TransferResult] = []
        self._done: dict[int, threading.Event] = {}
        # CUDA: (job_id, store, start event, end event, bytes, failed blocks, blocks) in
        # submission order; blocks the executor reported damaged, not yet claimed by a load.
        self._inflight: deque = deque()
        self._bad_blocks: set[int] = set()
        # CPU: jobs for the copy thread.
        self._queue: deque = deque()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread = None
        if self._stream is None:
            self._thread = threading.Thread(target=self._run_queue, name="hicache-io-offload", daemon=True)
            self._thread.start()
        log.info(
            "hicache-io offloading worker: %d tensors on %s, %d chunks of %d blocks (%s host bytes)",
            len(tensors),
            self.device,
            num_chunks,
            blocks_per_chunk,
            sum(row_bytes) * num_chunks * blocks_per_chunk,
        )

    def _region_tier(self, region: RegionRows, tensors: list[torch.Tensor], row_bytes: list[int], num_chunks: int) -> int:
        """The tier over the shared region's rows (see :class:`RegionRows`); answers its rows."""
        if self._stream is not None:
            # The region would have to be registered with the driver, and its checksums written
            # once each store's stream work ran: not built yet.
            raise ValueError("secondary_tiers with CUDA KV tensors: not supported by HicacheOffloadingSpec yet (use vLLM's TieringOffloadingSpec)")
        if not 0 <= region.rank < region.world_size:
            raise ValueError(f"worker rank {region.rank} of {region.world_size}")
        if region.sums_at % 8 or region.row_stride % 8:
            raise ValueError(f"region rows: checksums at {region.sums_at}, rows {region.row_stride} bytes apart (8-byte aligned needed)")
        offsets = [int(x) for x in np.cumsum([0] + row_bytes[:-1])]
        data, sums_end = sum(row_bytes), region.sums_at + 8 * len(tensors)
        if data > region.sums_at or sums_end > region.row_stride:
            raise ValueError(
                f"{len(tensors)} tensors of {data} data bytes a block do not fit the region's {region.row_stride}-byte rows "
                f"(data before byte {region.sums_at}, then 8 bytes of checksum per tensor)"
            )
        B = self.blocks_per_chunk
        self._chunk_rows, self._first_row = region.world_size * B, region.rank * B
        host_rows = num_chunks * region.world_size * B
        base = region.region.base_tensor  # its size against the rows: checked by the tier
        self.tier = _native.BlockTier(tensors, row_bytes, host_rows, host=base, host_row_stride=region.row_stride, host_offsets=offsets)
        buf = base.numpy()
        self._sums = np.ndarray((host_rows, len(tensors)), dtype=np.uint64, buffer=buf, offset=region.sums_at, strides=(region.row_stride, 8))
        return host_rows

    def _seal(self, p: _Rows) -> None:
        """Region rows: writes the checksums the store recorded beside the rows, for whoever
        reads them next (a secondary tier copies them with the rows)."""
        if self._sums is None:
            return
        for j in p.tensors:
            sums = self.tier.row_checksums(j, p.rows)
            self._sums[p.rows, j] = np.array([0 if x is None else (x + 1) & 0xFFFF_FFFF_FFFF_FFFF for x in sums], dtype=np.uint64)

    def _unseal(self, p: _Rows) -> tuple[np.ndarray, list[int]]:
        """Region rows: takes the checksums beside the rows (written by a store here or carried
        in with a promoted chunk) for the load to verify the rows against inside its copy.
        Answers the rows to load and the blocks of rows that carry none (never sealed here:
        written by something else), which are skipped and fail."""
        if self._sums is None:
            return p.rows, []
        sums = self._sums[p.rows][:, p.tensors]
        missing = (sums == 0).any(axis=1)
        for k, j in enumerate(p.tensors):
            self.tier.set_row_checksums(j, p.rows, [None if x == 0 else int(x) - 1 for x in sums[:, k].tolist()])
        if not missing.any():
            return p.rows, []
        rows = p.rows.copy()
        rows[missing] = -1  # a negative row skips its pair: the block keeps its bytes
        return rows, [int(b) for b in p.blocks[missing]]

    # ---- planning: every check before a byte moves ---------------------------------------

    def _blocks_of_pointers(self, dp: "DevicePointers") -> tuple[np.ndarray, list[int], list[int]]:
        """vLLM 0.34's device side, ``(block ids, group sizes, block indices)``: each pointer
        mapped back to a block of its data ref's tensor. Refused unless the counts add up, every
        pointer is the start of a block inside its tensor, every size is its ref's page, and the
        refs of a group name the same blocks (vLLM resolves pointers without a bounds check: a
        worker that trusted them would let one bad block id write anywhere in the process)."""
        counts, per_group, starts = list(dp.group_block_counts), list(dp.group_data_ref_counts), list(dp.block_indices)
        if not (len(counts) == len(per_group) == len(starts) == len(self._refs)):
            raise ValueError(f"device pointers for {len(counts)} groups ({len(per_group)} ref counts, {len(starts)} block indices); the KV caches have {len(self._refs)}")
        ptrs, sizes = np.asarray(dp.ptrs), np.asarray(dp.sizes)
        if ptrs.ndim != 1 or sizes.shape != ptrs.shape or ptrs.dtype.kind not in "ui" or sizes.dtype.kind not in "ui":
            raise ValueError(f"device pointers: {ptrs.shape} {ptrs.dtype} pointers and {sizes.shape} {sizes.dtype} sizes (1-D integers, as many of each)")
        ptrs, sizes = ptrs.astype(np.uint64, copy=False), sizes.astype(np.uint64, copy=False)
        want = 0
        for g, (n, k) in enumerate(zip(counts, per_group)):
            if n < 0 or k != len(self._refs[g]) or (n and not k):
                raise ValueError(f"group {g}: {n} blocks of {k} data refs; it has {len(self._refs[g])} refs")
            want += n * k
        if want != len(ptrs):
            raise ValueError(f"{len(ptrs)} device pointers; the groups' counts make {want}")
        out: list[np.ndarray] = []
        at = 0
        for g, n in enumerate(counts):
            if n == 0:
                continue
            group_blocks = None
            for k, (t, page) in enumerate(self._refs[g]):
                seg, size = ptrs[at : at + n], sizes[at : at + n]
                at += n
                base, stride, blocks = (np.uint64(x) for x in self._pointer_rule[t])
                if stride == 0:
                    raise ValueError(f"KV tensor {t}: a block stride of 0 maps no pointer to a block")
                if (size != page).any():
                    raise ValueError(f"group {g}, ref {k}: a copy of {int(size[size != page][0])} bytes; the ref's page is {page}")
                bad = seg < base
                delta = np.where(bad, np.uint64(0), seg - base)
                bad |= delta % stride != 0
                bad |= delta // stride >= blocks
                if bad.any():
                    p = int(seg[bad][0])
                    raise IndexError(f"group {g}, ref {k}: pointer {p:#x} is not the start of one of the {int(blocks)} blocks of KV tensor {t} (at {int(base):#x}, {int(stride)} elements apart)")
                found = (delta // stride).astype(np.int64)
                if group_blocks is None:
                    group_blocks = found
                elif not np.array_equal(found, group_blocks):
                    raise ValueError(f"group {g}: its data refs' pointers name different blocks")
            out.append(group_blocks)
        block_ids = np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
        return block_ids, counts, starts

    def _plan(self, gpu: object, chunks: LoadStoreSpec) -> list[_Rows]:
        if DevicePointers is not None and isinstance(gpu, DevicePointers):
            block_ids, sizes, starts = self._blocks_of_pointers(gpu)
        elif isinstance(gpu, GPULoadStoreSpec):
            block_ids, sizes, starts = np.asarray(gpu.block_ids, dtype=np.int64), list(gpu.group_sizes), list(gpu.block_indices)
        else:
            raise TypeError(f"expected the engine's blocks (GPULoadStoreSpec or DevicePointers), got {type(gpu).__name__}")
        if not isinstance(chunks, BlockIDsLoadStoreSpec):
            raise TypeError(f"expected chunk ids (CPULoadStoreSpec), got {type(chunks).__name__}")
        if self.tier is None:
            raise ValueError("this worker holds no chunks (cpu_bytes_to_use is below one chunk)")
        chunk_ids = np.asarray(chunks.block_ids, dtype=np.int64)
        if block_ids.ndim != 1 or chunk_ids.ndim != 1:
            raise ValueError("block and chunk ids must be 1-D")
        if len(sizes) != len(self._groups) or len(starts) != len(self._groups):
            raise ValueError(f"{len(sizes)} group sizes and {len(starts)} block indices for {len(self._groups)} KV groups")
        if len(chunk_ids) and (chunk_ids.min() < 0 or chunk_ids.max() >= self.num_chunks):
            bad = int(chunk_ids[(chunk_ids < 0) | (chunk_ids >= self.num_chunks)][0])
            raise IndexError(f"chunk id {bad} is out of range (the tier holds {self.num_chunks} chunks)")
        if len(np.unique(chunk_ids)) != len(chunk_ids):
            raise ValueError("a chunk is named twice in one transfer")
        # Checked here, not only by the tier's own calls: those run after submission returned.
        blocks = self._tensors[0].shape[0]
        if len(block_ids) and (block_ids.min() < 0 or block_ids.max() >= blocks):
            bad = int(block_ids[(block_ids < 0) | (block_ids >= blocks)][0])
            raise IndexError(f"block id {bad} is out of range (the KV tensors hold {blocks} blocks)")
        if len(np.unique(block_ids)) != len(block_ids):
            raise ValueError("a block is named twice in one transfer")
        out: list[_Rows] = []
        b_off = c_off = 0
        B = self.blocks_per_chunk
        for g, (size, start) in enumerate(zip(sizes, starts)):
            if size < 0 or start < 0:
                raise ValueError(f"group {g}: {size} blocks from logical block {start}")
            if size == 0:
                continue
            n_chunks = -(-(size + start % B) // B)
            if b_off + size > len(block_ids) or c_off + n_chunks > len(chunk_ids):
                raise ValueError(
                    f"group {g}: {size} blocks from logical block {start} need {n_chunks} chunks; "
                    f"the specs hold {len(block_ids) - b_off} blocks and {len(chunk_ids) - c_off} chunks from here"
                )
            rows = chunk_rows(size, start, chunk_ids[c_off : c_off + n_chunks], B, self._chunk_rows, self._first_row)
            out.append(_Rows(self._groups[g], block_ids[b_off : b_off + size], rows))
            b_off, c_off = b_off + size, c_off + n_chunks
        if b_off != len(block_ids) or c_off != len(chunk_ids):
            raise ValueError(f"the groups use {b_off} of {len(block_ids)} blocks and {c_off} of {len(chunk_ids)} chunks")
        return out

    def _bytes(self, parts: list[_Rows]) -> int:
        return sum(len(p.blocks) * sum(self.row_bytes[j] for j in p.tensors) for p in parts)

    # ---- the moves ------------------------------------------------------------------------

    def _move(self, store: bool, parts: list[_Rows]) -> list[int]:
        """Runs the parts; answers the engine blocks whose rows failed their checksums."""
        failed: list[int] = []
        for p in parts:
            tensors = [self._tensors[j] for j in p.tensors]
            try:
                if store:
                    self.tier.store(p.tensors, tensors, p.blocks, p.rows)
                    self._seal(p)
                else:
                    rows, unsealed = self._unseal(p)
                    if unsealed:
                        failed.extend(unsealed)
                        log.warning("hicache-io offloading: %d rows carry no checksum (not stored by this worker); their blocks are recomputed", len(unsealed))
                    self.tier.load(p.tensors, tensors, rows, p.blocks)
            except _native.IntegrityError as e:
                failed.extend(sorted({int(item[3]) for item in e.items}))
                log.warning("hicache-io offloading: %d blocks failed their checksums on load (%s)", len(e.items), e)
        return failed

    def _submit(self, job_id: int, store: bool, gpu: object, chunks: LoadStoreSpec, expedited: bool = False) -> bool:
        parts = self._plan(gpu, chunks)
        nbytes = self._bytes(parts)
        with self._wake:
            if self._closed:
                raise RuntimeError("the offloading worker is shut down")
            self._done[job_id] = threading.Event()
            if self._stream is None:
                job = (job_id, store, parts, nbytes)
                if expedited:
                    # Ahead of regular jobs, behind earlier expedited ones.
                    at = next((i for i, queued in enumerate(self._queue) if not queued[4]), len(self._queue))
                    self._queue.insert(at, job + (True,))
                else:
                    self._queue.append(job + (False,))
                self._wake.notify()
                return True
        return self._submit_cuda(job_id, store, parts, nbytes)

    def _complete(self, job_id: int, store: bool, failed: list[int], nbytes: int, seconds: float, error: bool = False) -> None:
        """Reports a job: a store succeeded unless the executor failed; a load unless some of
        its blocks cannot be trusted, which a sink (when set) takes for recompute instead."""
        ok = not error if store else not failed
        if not store and failed and self.on_load_failure is not None:
            try:
                self.on_load_failure(job_id, failed)
                ok = True
            except Exception:
                log.exception("hicache-io offloading: the load failure sink failed on job %d", job_id)
        with self._lock:
            self._finished.append(TransferResult(job_id=job_id, success=ok, transfer_size=nbytes, transfer_time=seconds))
            done = self._done.pop(job_id, None)
        if done is not None:
            done.set()

    def _run_queue(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return
                job_id, store, parts, nbytes, _ = self._queue.popleft()
            t0 = time.perf_counter()
            error = False
            try:
                failed = self._move(store, parts)
            except Exception:
                # Every check passed before submission: the executor failed. A load's blocks
                # cannot be trusted; a store's chunks are not written.
                log.exception("hicache-io offloading: job %d failed", job_id)
                failed, error = [int(b) for p in parts for b in p.blocks], True
            self._complete(job_id, store, failed, nbytes, time.perf_counter() - t0, error)

    def _submit_cuda(self, job_id: int, store: bool, parts: list[_Rows], nbytes: int) -> bool:
        stream = self._stream
        # Stores read KV the compute stream writes; loads write blocks it may still zero.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            failed = self._move(store, parts)
            end.record(stream)
        blocks = set() if store else {int(b) for p in parts for b in p.blocks}
        with self._lock:
            self._inflight.append((job_id, store, start, end, nbytes, failed, blocks))
        return True

    def _finished_cuda(self) -> None:
        """Completes the CUDA jobs whose events passed, in order. A load's rows are verified on
        the device; the executor reports mismatches once they ran, each naming its block: a
        block reported is claimed by the completed load that wrote it (or kept for a later one)."""
        done = []
        with self._lock:
            while self._inflight and self._inflight[0][3].query():
                done.append(self._inflight.popleft())
        if not done:
            return
        error = False
        if any(not job[1] for job in done):
            try:
                self.tier.integrity_reports()
            except _native.IntegrityError as e:
                self._bad_blocks.update(int(item[3]) for item in e.items)
            except Exception:
                # The executor failed (a lost device): no load of these can be trusted.
                log.exception("hicache-io offloading: the executor failed")
                error = True
        for job_id, store, start, end, nbytes, failed, blocks in done:
            if not store and (error or self._bad_blocks & blocks):
                hit = blocks if error else self._bad_blocks & blocks
                self._bad_blocks -= hit
                failed = sorted(set(failed) | hit)
            self._complete(job_id, store, failed, nbytes, start.elapsed_time(end) * 1e-3, error)

    # ---- vLLM's interface -----------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: object, dst_spec: LoadStoreSpec) -> bool:
        """The engine's blocks (``src_spec``: a ``GPULoadStoreSpec`` on vLLM 0.33, ``DevicePointers``
        on 0.34) into chunks ``dst_spec``."""
        return self._submit(job_id, True, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: object, expedited: bool = False) -> bool:
        """Chunks ``src_spec`` into the engine's blocks (``dst_spec``, as ``submit_store``'s)."""
        return self._submit(job_id, False, dst_spec, src_spec, expedited)

    def get_finished(self) -> list[TransferResult]:
        if self._stream is not None:
            self._finished_cuda()
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        for job_id in job_ids:
            with self._lock:
                done = self._done.get(job_id)
                cuda = [job[3] for job in self._inflight if job[0] == job_id]
            for end in cuda:
                end.synchronize()
            if done is not None and not cuda:
                done.wait()

    def shutdown(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
        if self._stream is not None:
            self._stream.synchronize()
        if self.region is not None:
            # The tier and the checksum view hold the mapping: let go of them first.
            self.tier, self._sums = None, None
            self.region.region.cleanup()
