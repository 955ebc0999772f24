"""vLLM 0.33.0's own factories build hicache-io's offloading spec (with vLLM's manager) and its
secondary tier, from the names a deployment configures. Run with vLLM 0.33.0 installed:
``VLLM_TARGET_DEVICE=cpu python examples/python/vllm_factories.py``."""

import tempfile
import numpy as np
from vllm.v1.kv_offload.config import OffloadingCacheConfig, OffloadingConfig, OffloadingModelConfig, OffloadingParallelConfig
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
config = OffloadingConfig(
    groups=(), worker_kv_bytes_per_block=1 << 20, enable_kv_cache_events=False, engine_id="demo",
    extra_config={"spec_name": "HicacheOffloadingSpec", "spec_module_path": "hicache_io.vllm", "cpu_bytes_to_use": 64 << 20},
    model=OffloadingModelConfig(name="demo/model", dtype="bfloat16"),
    cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
    parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
                                      data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=False))
spec = OffloadingSpecFactory.create_spec(config)
view = memoryview(np.zeros((spec.num_chunks, 1 << 20), np.uint8))
with tempfile.TemporaryDirectory() as path:  # the tier's objects go with it
    tier = SecondaryTierFactory.create_secondary_tier({"type": "HicacheTier", "module_path": "hicache_io.vllm", "path": path}, view, spec)
    print(type(spec).__name__, spec.num_chunks, "chunks;", type(spec.get_manager()).__name__, "|", type(tier).__name__, tier.client.directory)
    tier.shutdown()
