"""``HicacheOffloadingWorker`` against an oracle of vLLM's chunk semantics, byte for byte: every
group, ``blocks_per_chunk`` ≥ 1 with partial first and last chunks, split K/V tensors, padded
pages, a cross-layer tensor, strided views of one buffer; damaged chunks fail their loads; bad
specs move nothing. The same
with the rows in vLLM's shared region (as with secondary tiers), another rank's rows and the
gaps untouched, and checksums travelling with the rows."""

import mmap
import uuid
from types import SimpleNamespace

import numpy as np
import pytest

try:
    import torch
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    from hicache_io.vllm import HicacheOffloadingWorker
    from hicache_io.vllm.spec import region_layout
    from hicache_io.vllm.worker import RegionRows
except ImportError:  # skipped by conftest
    pass


def make_caches(rng, num_blocks, pages, refs_per_group, packed=0):
    """Tensors of ``pages[j]`` bytes per block; ``refs_per_group[g]`` = [(tensor, page bytes)].
    ``packed``: the tensors are strided views of one buffer of ``packed``-byte blocks, side by
    side from byte 0 (the rest of each block another view's); the buffer is ``make_caches.buffer``."""
    if packed:
        buffer = torch.from_numpy(rng.integers(-128, 128, (num_blocks, packed), dtype=np.int8))
        at = np.cumsum([0] + list(pages))
        tensors = [buffer[:, at[j] : at[j] + p] for j, p in enumerate(pages)]
        make_caches.buffer = buffer
    else:
        tensors = [torch.from_numpy(rng.integers(-128, 128, (num_blocks, p), dtype=np.int8)) for p in pages]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, p) for t, p in zip(tensors, pages)],
        group_data_refs=[[CanonicalKVCacheRef(j, pb) for j, pb in refs] for refs in refs_per_group],
    )
    return tensors, caches


class Oracle:
    """vLLM's semantics, written out: chunk ``c`` holds ``B`` sub-blocks; group ``g``'s ``n``
    blocks from logical block ``s`` use sub-blocks ``s mod B ..`` of its chunks; each ref copies
    its page's first ``page bytes``."""

    def __init__(self, pages, refs_per_group, num_chunks, B):
        self.B, self.refs = B, refs_per_group
        self.rows = [np.zeros((num_chunks * B, p), np.int8) for p in pages]

    def walk(self, gpu: "GPULoadStoreSpec", chunk_ids):
        b = c = 0
        for g, (n, s) in enumerate(zip(gpu.group_sizes, gpu.block_indices)):
            if n == 0:
                continue
            k = -(-(n + s % self.B) // self.B)
            subs = [int(ch) * self.B + j for ch in chunk_ids[c : c + k] for j in range(self.B)][s % self.B :][:n]
            for blk, row in zip(gpu.block_ids[b : b + n], subs):
                for t, pb in self.refs[g]:
                    yield t, int(blk), row, pb
            b, c = b + n, c + k

    def store(self, tensors, gpu, chunk_ids):
        for t, blk, row, pb in self.walk(gpu, chunk_ids):
            self.rows[t][row, :pb] = tensors[t].numpy()[blk, :pb]

    def load(self, tensors, gpu, chunk_ids):
        for t, blk, row, pb in self.walk(gpu, chunk_ids):
            tensors[t].numpy()[blk, :pb] = self.rows[t][row, :pb]


def finish(worker, job_ids):
    worker.wait(set(job_ids))
    got = {}
    for _ in range(200):
        for r in worker.get_finished():
            got[r.job_id] = r
        if set(job_ids) <= set(got):
            return got
    raise AssertionError(f"jobs {set(job_ids) - set(got)} never finished")


SHAPES = [
    # (pages, refs per group): one MLA-like tensor; split K/V of two layers; a padded page
    # (layers reading 96 of 128 bytes); two groups (hybrid); a cross-layer tensor.
    ([64], [[(0, 64)]]),
    ([32, 32, 32, 32], [[(0, 32), (1, 32), (2, 32), (3, 32)]]),
    ([128, 128], [[(0, 96), (1, 96)]]),
    ([48, 48, 80], [[(0, 48), (1, 48)], [(2, 80)]]),
    ([256], [[(0, 256)]]),
    # Strided views of one buffer of 256-byte blocks (vLLM's packed layouts): K 96 bytes at 0, V
    # 128 at 96 (112 read by the layer), 32 bytes after them that are no view's.
    ([96, 128], [[(0, 96), (1, 112)]], 256),
]


def region_rows(pages, B, num_chunks, rank=1, world_size=2, engine_id=None):
    """vLLM's shared region laid out by the spec's ``region_layout`` (a layer a tensor), rows
    for rank ``rank`` of ``world_size``."""
    config = SimpleNamespace(
        groups=[SimpleNamespace(layer_names=[f"l{j}" for j in range(len(pages))])],
        worker_kv_bytes_per_block=sum(pages),
        parallel=SimpleNamespace(world_size=world_size),
    )
    sums_at, row = region_layout(config, B)
    assert sums_at >= sum(pages) and sums_at % 8 == 0 and row >= sums_at + 8 * len(pages)
    assert (world_size * B * row) % mmap.PAGESIZE == 0, "a chunk is not whole pages"
    engine_id = engine_id or f"hicache-io-test-{uuid.uuid4().hex}"
    region = SharedOffloadRegion(engine_id, num_chunks, rank, world_size * B * row, B * row)
    return RegionRows(region=region, rank=rank, world_size=world_size, row_stride=row, sums_at=sums_at)


def own_rows(worker, t, num_chunks, B):
    """The worker's rows of tensor ``t`` (its own, or its rank's share of the region's), and
    the rest of the region's bytes (None without a region)."""
    rows = worker.tier.read_rows(t)
    if worker.region is None:
        return rows, None
    r = worker.region
    mine = rows.reshape(num_chunks, r.world_size, B, -1)[:, r.rank].ravel()
    whole = np.frombuffer(r.region.mmap_obj, dtype=np.uint8).reshape(num_chunks, r.world_size, B, r.row_stride)
    others = np.delete(whole, r.rank, axis=1)
    return mine, others


@pytest.mark.parametrize("where", ["own", "region"])
@pytest.mark.parametrize("B", [1, 2, 4])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_store_then_load_matches_the_oracle(shape, B, where):
    pages, refs, packed = (SHAPES[shape] + (0,))[:3]
    rng = np.random.default_rng(shape * 10 + B)
    num_blocks, num_chunks = 40, 12
    tensors, caches = make_caches(rng, num_blocks, pages, refs, packed)
    outside = make_caches.buffer[:, sum(pages) :].clone() if packed else None
    oracle = Oracle(pages, refs, num_chunks, B)
    region = region_rows(pages, B, num_chunks) if where == "region" else None
    worker = HicacheOffloadingWorker(caches, B, num_chunks, region=region)
    try:
        job = 0
        for round_ in range(6):
            # Each group: some blocks from a logical start (unaligned to B), into free chunks.
            sizes, starts, block_ids, chunk_ids = [], [], [], []
            free_blocks = list(rng.permutation(num_blocks))
            free_chunks = list(rng.permutation(num_chunks))
            for g in range(len(refs)):
                n = int(rng.integers(0, 7))
                s = int(rng.integers(0, 9))
                k = -(-(n + s % B) // B) if n else 0
                sizes.append(n)
                starts.append(s)
                block_ids += [int(free_blocks.pop()) for _ in range(n)]
                chunk_ids += [int(free_chunks.pop()) for _ in range(k)]
            gpu = GPULoadStoreSpec(block_ids, sizes, starts)
            job += 1
            assert worker.submit_store(job, gpu, CPULoadStoreSpec(chunk_ids))
            oracle.store(tensors, gpu, chunk_ids)
            assert finish(worker, [job])[job].success
            for t in range(len(pages)):
                # Rows the oracle never wrote are zero on both sides.
                want = oracle.rows[t][:, : worker.row_bytes[t]].astype(np.uint8).ravel()
                mine, others = own_rows(worker, t, num_chunks, B)
                assert np.array_equal(mine, want), f"round {round_}, tensor {t}"
                if others is not None:
                    assert not others.any(), "another rank's rows changed"
            # The engine overwrites the blocks; the load brings the stored bytes back (into
            # other blocks, too).
            for t in tensors:
                t.copy_(torch.from_numpy(rng.integers(-128, 128, tuple(t.shape), dtype=np.int8)))
            dest = GPULoadStoreSpec([int(b) for b in rng.permutation(block_ids)] if block_ids else [], sizes, starts)
            want = [t.clone() for t in tensors]
            oracle.load(want, dest, chunk_ids)
            job += 1
            assert worker.submit_load(job, CPULoadStoreSpec(chunk_ids), dest, expedited=bool(round_ % 2))
            assert finish(worker, [job])[job].success
            for t, w in zip(tensors, want):
                assert torch.equal(t, w)
            if packed:
                assert torch.equal(make_caches.buffer[:, sum(pages) :], outside), "bytes of no view changed"
    finally:
        worker.shutdown()


def stored(B=2, pages=(64, 64), packed=0):
    rng = np.random.default_rng(7)
    tensors, caches = make_caches(rng, 16, list(pages), [[(j, p) for j, p in enumerate(pages)]], packed)
    worker = HicacheOffloadingWorker(caches, B, 6)
    gpu = GPULoadStoreSpec([3, 4, 5, 6], [4], [0])
    worker.submit_store(1, gpu, CPULoadStoreSpec([2, 5]))
    assert finish(worker, [1])[1].success
    return tensors, worker


def test_a_damaged_chunk_fails_its_load_and_a_sink_gets_its_blocks():
    tensors, worker = stored()
    try:
        # Row 11 = chunk 5, sub-block 1: block 6's copy in tensor 1.
        worker.tier.inject_host_corruption(1, 11, 5, b"\x01")
        dest = GPULoadStoreSpec([8, 9, 10, 11], [4], [0])
        worker.submit_load(2, CPULoadStoreSpec([2, 5]), dest)
        r = finish(worker, [2])[2]
        assert not r.success
        seen = []
        worker.on_load_failure = lambda job, blocks: seen.append((job, list(blocks)))
        worker.submit_load(3, CPULoadStoreSpec([2, 5]), dest)
        assert finish(worker, [3])[3].success
        assert seen == [(3, [11])]
        # The intact rows landed.
        assert torch.equal(tensors[0][8:12], tensors[0][3:7]) and torch.equal(tensors[1][8:11], tensors[1][3:6])
    finally:
        worker.shutdown()


@pytest.mark.parametrize(
    "gpu_args, chunks, error",
    [
        (([3, 4, 5, 6], [4], [0]), [2], ValueError),  # too few chunks
        (([3, 4, 5, 6], [4], [0]), [2, 5, 1], ValueError),  # chunks left over
        (([3, 4, 5, 6], [4], [0]), [2, 6], IndexError),  # chunk out of range
        (([3, 4, 5, 6], [4], [0]), [2, 2], ValueError),  # a chunk twice
        (([3, 4, 5, 16], [4], [0]), [2, 5], IndexError),  # block out of range
        (([3, 4, 3, 6], [4], [0]), [2, 5], ValueError),  # a block twice
        (([3, 4, 5, 6], [2, 2], [0, 0]), [2, 5], ValueError),  # two groups for one
        (([3, 4, 5, 6], [4], [-1]), [2, 5], ValueError),  # a negative logical block
    ],
)
@pytest.mark.parametrize("packed", [0, 160], ids=["contiguous", "strided"])
def test_bad_specs_move_nothing(gpu_args, chunks, error, packed):
    tensors, worker = stored(packed=packed)
    try:
        refused_both_ways(worker, tensors, GPULoadStoreSpec(*gpu_args), CPULoadStoreSpec(chunks), error)
    finally:
        worker.shutdown()


def refused_both_ways(worker, tensors, device_side, chunks, error):
    """A store and a load of ``device_side`` and ``chunks`` both raise ``error``, no job is
    queued, and no byte of the host rows or the tensors changed."""
    before = [worker.tier.read_rows(t).copy() for t in range(len(tensors))]
    blocks = [t.clone() for t in tensors]
    with pytest.raises(error):
        worker.submit_store(9, device_side, chunks)
    with pytest.raises(error):
        worker.submit_load(10, chunks, device_side)
    worker.wait({9, 10})
    assert worker.get_finished() == []
    for t in range(len(tensors)):
        assert np.array_equal(worker.tier.read_rows(t), before[t])
    for t, b in zip(tensors, blocks):
        assert torch.equal(t, b)


def test_region_rows_carry_their_checksums_to_another_worker():
    """A chunk stored by one worker is verified by another over the same region (another
    process's mapping), also after its row was copied to another chunk with its checksums (as a
    secondary tier promotes one); a row copied without them, or damaged, fails its load."""
    pages, B, num_chunks = [64, 64], 2, 6
    rng = np.random.default_rng(3)
    tensors, caches = make_caches(rng, 16, pages, [[(0, 64), (1, 64)]])
    a_rows = region_rows(pages, B, num_chunks, rank=0, world_size=1)
    a = HicacheOffloadingWorker(caches, B, num_chunks, region=a_rows)
    engine_id = a_rows.region.mmap_path.split("vllm_offload_")[1][: -len(".mmap")]
    b = HicacheOffloadingWorker(caches, B, num_chunks, region=region_rows(pages, B, num_chunks, rank=0, world_size=1, engine_id=engine_id))
    try:
        assert a.submit_store(1, GPULoadStoreSpec([3, 4, 5, 6], [4], [0]), CPULoadStoreSpec([2, 5]))
        assert finish(a, [1])[1].success
        view = np.frombuffer(a_rows.region.mmap_obj, dtype=np.uint8).reshape(num_chunks, -1)
        dest = GPULoadStoreSpec([8, 9, 10, 11], [4], [0])
        assert b.submit_load(2, CPULoadStoreSpec([2, 5]), dest)
        assert finish(b, [2])[2].success
        assert torch.equal(tensors[0][8:12], tensors[0][3:7]) and torch.equal(tensors[1][8:12], tensors[1][3:7])
        # Promoted: chunk 5's row (data and checksums) copied to chunk 1, as a tier copies view[c].
        view[1] = view[5]
        assert b.submit_load(3, CPULoadStoreSpec([2, 1]), GPULoadStoreSpec([12, 13, 14, 15], [4], [0]))
        assert finish(b, [3])[3].success
        assert torch.equal(tensors[1][14:16], tensors[1][5:7])
        # Data without its checksums (or damaged data) is caught.
        view[0, : a_rows.sums_at] = view[5, : a_rows.sums_at]
        before = [t.clone() for t in tensors]
        assert b.submit_load(4, CPULoadStoreSpec([0]), GPULoadStoreSpec([12, 13], [2], [0]))
        assert not finish(b, [4])[4].success
        assert all(torch.equal(t, u) for t, u in zip(tensors, before)), "rows without checksums landed"
        view[5, 3] ^= 1
        assert b.submit_load(5, CPULoadStoreSpec([5]), GPULoadStoreSpec([12, 13], [2], [0]))
        assert not finish(b, [5])[5].success
    finally:
        view = None  # the mapping is let go of only when nothing views it
        a.shutdown()
        b.shutdown()


def test_region_too_small_for_the_tensors_is_refused():
    rng = np.random.default_rng(4)
    _, caches = make_caches(rng, 8, [64, 64], [[(0, 64), (1, 64)]])
    rows = region_rows([64], 1, 4, rank=0, world_size=1)  # laid out for one 64-byte tensor
    try:
        with pytest.raises(ValueError, match="do not fit"):
            HicacheOffloadingWorker(caches, 1, 4, region=rows)
    finally:
        rows.region.cleanup()


def pointers_of(worker, caches, gpu):
    """vLLM 0.34's device side for ``gpu``, as its connector resolves it."""
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    return resolve_device_pointers(GPULoadStoreSpec(np.asarray(gpu.block_ids, dtype=np.int64), gpu.group_sizes, gpu.block_indices), caches)


def tampered(dp, **changes):
    from vllm.v1.kv_offload.base import DevicePointers

    fields = dict(ptrs=dp.ptrs.copy(), sizes=dp.sizes.copy(), group_block_counts=dp.group_block_counts, group_data_ref_counts=dp.group_data_ref_counts, block_indices=dp.block_indices)
    for k, v in changes.items():
        fields[k] = v(fields[k]) if callable(v) else v
    return DevicePointers(**fields)


def _poke(i, delta):
    def f(a):
        a = a.copy()
        a[i] = np.uint64(int(a[i]) + delta)
        return a

    return f


@pytest.mark.parametrize(
    "change, error",
    [
        (lambda S: {"ptrs": _poke(3, 16 * S)}, IndexError),  # block 3 + 16: past the tensor (16 blocks)
        (lambda S: {"ptrs": _poke(0, -(1 << 20))}, IndexError),  # before the tensor
        (lambda S: {"ptrs": _poke(1, 8)}, IndexError),  # inside a block, not at its start
        (lambda S: {"ptrs": _poke(5, S)}, ValueError),  # tensor 1 names another block than tensor 0
        (lambda S: {"sizes": _poke(2, 1)}, ValueError),  # a size that is not the ref's page
        (lambda S: {"group_block_counts": (3,)}, ValueError),  # counts that do not add up
        (lambda S: {"group_data_ref_counts": (1,)}, ValueError),  # a ref count other than the group's
        (lambda S: {"group_block_counts": (4, 0)}, ValueError),  # two groups for one
        (lambda S: {"ptrs": lambda a: a[:-1], "sizes": lambda a: a[:-1]}, ValueError),  # a pointer short
    ],
    ids=["past", "before", "inside", "other-block", "size", "counts", "ref-count", "groups", "short"],
)
@pytest.mark.parametrize("packed", [0, 160], ids=["contiguous", "strided"])
def test_device_pointers_that_are_not_blocks_move_nothing(change, error, packed):
    """vLLM 0.34 hands the worker pointers (``base + block × stride``, unchecked): each must be
    the start of a block of its ref's tensor, of its ref's size, the refs of a group naming the
    same blocks, the counts adding up; anything else is refused before a byte moves."""
    from hicache_io.vllm._versions import DevicePointers

    if DevicePointers is None:
        pytest.skip("vLLM 0.33 hands the worker block ids, not pointers (test_bad_specs_move_nothing)")
    rng = np.random.default_rng(7)
    tensors, caches = make_caches(rng, 16, [64, 64], [[(0, 64), (1, 64)]], packed)
    worker = HicacheOffloadingWorker(caches, 2, 6)
    try:
        gpu = GPULoadStoreSpec([3, 4, 5, 6], [4], [0])
        assert worker.submit_store(1, pointers_of(worker, caches, gpu), CPULoadStoreSpec([2, 5]))
        assert finish(worker, [1])[1].success
        bad = tampered(pointers_of(worker, caches, GPULoadStoreSpec([8, 9, 10, 11], [4], [0])), **change(packed or 64))
        refused_both_ways(worker, tensors, bad, CPULoadStoreSpec([2, 5]), error)
        # The untampered pointers load the stored blocks.
        assert worker.submit_load(11, CPULoadStoreSpec([2, 5]), pointers_of(worker, caches, GPULoadStoreSpec([8, 9, 10, 11], [4], [0])))
        assert finish(worker, [11])[11].success
        assert torch.equal(tensors[0][8:12], tensors[0][3:7]) and torch.equal(tensors[1][8:12], tensors[1][3:7])
    finally:
        worker.shutdown()


def test_device_pointers_of_a_wider_dtype_name_vllms_blocks():
    """vLLM 0.34 places block ``b`` at ``data_ptr + b × stride(0)`` of the canonical tensor as
    it is, its stride counted in elements: a float16 tensor's pointers are mapped back by the
    same rule, each to the block vLLM meant (a byte stride would send block b to b / 2)."""
    from hicache_io.vllm._versions import DevicePointers

    if DevicePointers is None:
        pytest.skip("vLLM 0.33 hands the worker block ids, not pointers")
    tensors = [torch.randn(16, 32).to(torch.float16) for _ in range(2)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, 64) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(0, 64), CanonicalKVCacheRef(1, 64)]],
    )
    worker = HicacheOffloadingWorker(caches, 1, 8)
    try:
        assert worker.submit_store(1, pointers_of(worker, caches, GPULoadStoreSpec([3, 5], [2], [0])), CPULoadStoreSpec([0, 1]))
        assert finish(worker, [1])[1].success
        assert worker.submit_load(2, CPULoadStoreSpec([0, 1]), pointers_of(worker, caches, GPULoadStoreSpec([10, 12], [2], [0])))
        assert finish(worker, [2])[2].success
        for t in tensors:
            assert torch.equal(t[10], t[3]) and torch.equal(t[12], t[5])
    finally:
        worker.shutdown()
