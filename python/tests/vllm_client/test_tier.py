"""``HicacheTier`` as vLLM's tiering manager drives a secondary tier: chunks of the primary
tier's view stored and loaded back byte for byte through the local directory and a Mooncake
master of the test's own; a damaged object fails its key (the others land), is removed, and
answers miss afterwards; namespaces of other parallel shapes do not meet; vLLM's own factory
builds the tier from its config."""

import time
from unittest.mock import MagicMock

import numpy as np
import pytest
from common import held_at

try:
    from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext, make_offload_key
    from vllm.v1.kv_offload.config import OffloadingCacheConfig, OffloadingConfig, OffloadingModelConfig, OffloadingParallelConfig
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from hicache_io.vllm import HicacheTier
except ImportError:  # skipped by conftest
    pass

ROW = 3000  # not a multiple of anything: spans must not assume alignment
CHUNKS = 12


def spec(tp_size=1, rank=0, agnostic=False, model="test/model"):
    s = MagicMock()
    s.config = OffloadingConfig(
        groups=(),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="engine",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=tp_size,
            tp_size=tp_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=agnostic,
        ),
    )
    s.blocks_per_chunk = 2
    s.region_row_stride = 0  # vLLM's own layout (a spec without HicacheOffloadingSpec's rows)
    return s


def key(n: int) -> "OffloadKey":
    return make_offload_key(n.to_bytes(8, "big"), n % 2)


def job(job_id, keys, chunks):
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.asarray(chunks, dtype=np.int32), is_promotion=False, req_context=ReqContext(req_id="r"))


def drain(tier):
    tier.drain_jobs()
    return {r.job_id: r for r in tier.get_finished_jobs()}


def lookups(tier, keys):
    ctx = ReqContext(req_id="r")
    for k in keys:
        tier.lookup(k, ctx)
    tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
    deadline = time.monotonic() + 5
    while True:
        got = [tier.lookup(k, ctx) for k in keys]
        if LookupResult.RETRY not in got or time.monotonic() > deadline:
            return got
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
        time.sleep(0.01)


def make_tier(view, kind, tmp_path, master=None, s=None, **kw):
    s = s or spec()
    if kind == "local":
        return HicacheTier(s, memoryview(view), "hicache", store="local", path=str(tmp_path / "l3"), **kw)
    return HicacheTier(
        s, memoryview(view), "hicache", store="mooncake", master_server_address=master.address, global_segment_size=16 << 20, local_buffer_size=4 << 20, protocol="tcp", metadata_server="P2PHANDSHAKE", local_hostname="127.0.0.1", **kw
    )


@pytest.fixture(params=["local", "mooncake"])
def kind(request):
    if request.param == "mooncake":
        request.getfixturevalue("master")
    return request.param


def test_chunks_round_trip_byte_for_byte(kind, tmp_path, request):
    master = request.getfixturevalue("master") if kind == "mooncake" else None
    rng = np.random.default_rng(1)
    view = rng.integers(0, 256, (CHUNKS, ROW), dtype=np.uint8)
    tier = make_tier(view, kind, tmp_path, master)
    try:
        keys = [key(n) for n in range(5)]
        tier.submit_store(job(1, keys, [7, 0, 3, 11, 5]))
        assert drain(tier)[1].success
        want = view[[7, 0, 3, 11, 5]].copy()
        view[:] = 0
        assert lookups(tier, keys + [key(99)]) == [LookupResult.HIT] * 5 + [LookupResult.MISS]
        tier.submit_load(job(2, keys, [1, 2, 4, 6, 8]))
        r = drain(tier)[2]
        assert r.success and r.successful_keys is None
        assert np.array_equal(view[[1, 2, 4, 6, 8]], want)
        assert tier.stats["verified"] == 5 and tier.stats["corrupt"] == 0
        assert not tier.has_pending_work()
    finally:
        tier.shutdown()


def test_a_damaged_chunk_fails_its_key_is_removed_and_misses_afterwards(tmp_path):
    rng = np.random.default_rng(2)
    view = rng.integers(0, 256, (CHUNKS, ROW), dtype=np.uint8)
    tier = make_tier(view, "local", tmp_path)
    try:
        keys = [key(n) for n in range(3)]
        tier.submit_store(job(1, keys, [0, 1, 2]))
        assert drain(tier)[1].success
        want = view[[0, 2]].copy()
        # A bit flips in the middle of the second object on disk.
        path, at = held_at(tier.client, tier.object_key(keys[1]))
        with open(path, "r+b") as f:
            f.seek(at + ROW // 2)
            b = f.read(1)
            f.seek(at + ROW // 2)
            f.write(bytes([b[0] ^ 0x10]))
        view[:] = 0
        # vLLM looked the keys up first (verdicts cached: hits).
        assert lookups(tier, keys) == [LookupResult.HIT] * 3
        tier.submit_load(job(2, keys, [5, 6, 7]))
        r = drain(tier)[2]
        assert not r.success and set(r.successful_keys) == {keys[0], keys[2]}
        # The failed key's cached verdict is a miss now, without a new probe (vLLM would
        # otherwise promote it again, and fail again).
        assert tier.lookup(keys[1], ReqContext(req_id="r")) == LookupResult.MISS
        assert tier.lookup(keys[0], ReqContext(req_id="r")) == LookupResult.HIT
        assert np.array_equal(view[[5, 7]], want)
        assert tier.stats["corrupt"] == 1
        # Removed, and a miss from now on (vLLM recomputes it instead of promoting it again).
        assert tier._io.exists([tier.object_key(keys[1])])[0] == 0
        assert lookups(tier, [keys[1]]) == [LookupResult.MISS]
        # A chunk stored under another key fails too (the trailer binds the key).
        tier.submit_store(job(3, [key(50)], [3]))
        assert drain(tier)[3].success
        data = tier.client.get(tier.object_key(key(50)))
        tier.client.put(tier.object_key(key(51)), data[: ROW + 16])
        tier.submit_load(job(4, [key(51)], [9]))
        assert not drain(tier)[4].success
        # An object of another size fails too, and goes (a store could not replace it).
        tier.client.put(tier.object_key(key(52)), data[: ROW // 2])
        tier.submit_load(job(5, [key(52)], [9]))
        assert not drain(tier)[5].success
        assert tier._io.exists([tier.object_key(key(52))])[0] == 0
    finally:
        tier.shutdown()


def test_namespaces_of_other_parallel_shapes_do_not_meet(tmp_path):
    view = np.random.default_rng(3).integers(0, 256, (CHUNKS, ROW), dtype=np.uint8)
    a = make_tier(view, "local", tmp_path, s=spec(tp_size=2, rank=0))
    b = make_tier(view, "local", tmp_path, s=spec(tp_size=4, rank=0))
    c = make_tier(view, "local", tmp_path, s=spec(tp_size=2, rank=1))
    # vLLM certifies these pages parallelism-agnostic: every shape shares them.
    d = make_tier(view, "local", tmp_path, s=spec(tp_size=2, rank=0, agnostic=True))
    e = make_tier(view, "local", tmp_path, s=spec(tp_size=8, rank=5, agnostic=True))
    try:
        k = [key(7)]
        a.submit_store(job(1, k, [0]))
        d.submit_store(job(1, k, [0]))
        assert drain(a)[1].success and drain(d)[1].success
        assert lookups(a, k) == [LookupResult.HIT]
        assert lookups(b, k) == [LookupResult.MISS]
        assert lookups(c, k) == [LookupResult.MISS]
        assert lookups(e, k) == [LookupResult.HIT]
    finally:
        for t in (a, b, c, d, e):
            t.shutdown()


def test_bad_jobs_are_refused(tmp_path):
    view = np.zeros((CHUNKS, ROW), dtype=np.uint8)
    tier = make_tier(view, "local", tmp_path)
    try:
        with pytest.raises(IndexError):
            tier.submit_store(job(1, [key(1)], [CHUNKS]))
        with pytest.raises(ValueError):
            tier.submit_store(job(2, [key(1), key(2)], [3]))
        with pytest.raises(ValueError):
            tier.submit_load(job(3, [key(1), key(2)], [3, 3]))
        assert drain(tier) == {}
    finally:
        tier.shutdown()
    with pytest.raises(ValueError):
        HicacheTier(spec(), memoryview(view), "hicache", store="s3", path=str(tmp_path))


def test_vllm_factory_builds_the_tier(tmp_path):
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    view = np.zeros((CHUNKS, ROW), dtype=np.int8)
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "HicacheTier", "module_path": "hicache_io.vllm", "store": "local", "path": str(tmp_path / "f"), "capacity_bytes": 1 << 20}, memoryview(view), spec()
    )
    try:
        assert isinstance(tier, HicacheTier) and tier.client.capacity == 1 << 20
    finally:
        tier.shutdown()


def tiered_config(tmp_path, engine_id, **extra):
    from vllm.v1.kv_offload.config import OffloadingGroupConfig

    s = spec()
    tiers = [{"type": "HicacheTier", "module_path": "hicache_io.vllm", "store": "local", "path": str(tmp_path / "l3")}]
    fields = {f: getattr(s.config, f) for f in ("enable_kv_cache_events", "model", "cache", "parallel")}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=2 * 1000,
        extra_config={"cpu_bytes_to_use": 1 << 20, "secondary_tiers": tiers, **extra},
        engine_id=engine_id,
        **fields,
    )


def test_spec_with_secondary_tiers_shares_one_region_between_worker_and_scheduler(tmp_path):
    """As in an engine: the worker registers its KV caches first, then the scheduler's manager
    is built. Both map the same region (rows the worker stores are the rows the tier reads), and
    its path is gone once both mapped it (nothing left in /dev/shm, whatever ends the engine)."""
    import os
    import uuid

    import torch
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from hicache_io.vllm import HicacheOffloadingSpec
    from hicache_io.vllm.spec import HicacheTieringManager

    engine_id = f"hicache-io-test-{uuid.uuid4().hex}"
    s = HicacheOffloadingSpec(tiered_config(tmp_path, engine_id))
    assert s.region_sums_at == 2000 and s.kv_bytes_per_chunk % 4096 == 0 and s.kv_bytes_per_chunk == 2 * s.region_row_stride
    tensors = [torch.randint(-128, 127, (8, 1000), dtype=torch.int8) for _ in range(2)]
    caches = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(t, 1000) for t in tensors], group_data_refs=[[CanonicalKVCacheRef(0, 1000), CanonicalKVCacheRef(1, 1000)]])
    worker = s.get_worker(caches)
    manager = s.get_manager()
    try:
        assert isinstance(manager, HicacheTieringManager) and len(manager.secondary_tiers) == 1
        # Chunks of these rows never meet vLLM's layout's under one key, whatever their size.
        assert manager.secondary_tiers[0]._prefix == f"{s.kv_bytes_per_chunk}B-rows{s.region_row_stride}/"
        assert not os.path.exists(f"/dev/shm/vllm_offload_{engine_id}.mmap"), "the region's path outlives its mappings"
        assert worker.submit_store(1, GPULoadStoreSpec([5, 6], [2], [0]), CPULoadStoreSpec([3]))
        worker.wait({1})
        assert [r.success for r in worker.get_finished()] == [True]
        row = np.frombuffer(manager.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(s.num_chunks, -1)[3]
        for i, blk in enumerate((5, 6)):
            at = i * s.region_row_stride
            assert np.array_equal(row[at : at + 1000], tensors[0][blk].numpy().view(np.uint8))
            assert np.array_equal(row[at + 1000 : at + 2000], tensors[1][blk].numpy().view(np.uint8))
    finally:
        worker.shutdown()
        manager.shutdown()


@pytest.mark.parametrize("extra, message", [({"secondary_tiers": {"type": "HicacheTier"}}, "must be a list"), ({"store_threshold": 2}, "store_threshold")])
def test_spec_with_secondary_tiers_refuses_bad_configs(tmp_path, extra, message):
    from hicache_io.vllm import HicacheOffloadingSpec

    with pytest.raises(ValueError, match=message):
        HicacheOffloadingSpec(tiered_config(tmp_path, "unused", **extra))
