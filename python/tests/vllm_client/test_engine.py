"""vLLM 0.33.0's own scheduler and offloading connector (scheduler and worker roles) on CPU
tensors, with ``HicacheOffloadingSpec`` loaded by vLLM's factory from ``spec_module_path``.

A tiny engine: the "forward pass" writes each computed token's KV into the request's blocks
(bytes determined by the token prefix), so every block can be checked against what its tokens
must hold. Requests with a shared prefix are stored, the device blocks overwritten and the GPU
prefix cache reset, then a request with the same prefix is served from the offloaded chunks:
every byte of its prefix blocks is compared. A damaged chunk fails its load, and the scheduler
recomputes the request (``kv_load_failure_policy: recompute``) through
``HicacheOffloadingConnector``; vLLM's own connector stops on it instead on 0.33 (never wrong
KV), and on 0.34 recomputes every request that meets it, whole."""

import dataclasses
import hashlib
import json
import time

import numpy as np
import pytest

try:
    import torch
    from vllm import SamplingParams
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.forward_context import ForwardContext
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from hicache_io.vllm import VLLM_VERSION, HicacheOffloadingConnector, HicacheOffloadingSpec, HicacheOffloadingWorker

    MRO_FIELDS = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
except ImportError:  # skipped by conftest
    pass

BLOCK = 16
HEADS, HEAD = 2, 8
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
EOS = 2


def tiny_model(tmp_path):
    """A local model directory: vLLM reads its config offline."""
    d = tmp_path / "tiny-opt"
    d.mkdir(exist_ok=True)
    cfg = {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "hidden_size": 16,
        "word_embed_proj_dim": 16,
        "num_attention_heads": HEADS,
        "num_hidden_layers": len(LAYERS),
        "ffn_dim": 32,
        "max_position_embeddings": 2048,
        "vocab_size": 1000,
        "bos_token_id": 1,
        "eos_token_id": EOS,
        "pad_token_id": 0,
        "do_layer_norm_before": True,
        "torch_dtype": "float16",
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


class Engine:
    """A scheduler and a worker-side connector, stepped as vLLM's engine core steps them."""

    def __init__(self, tmp_path, connector="HicacheOffloadingConnector", blocks_per_chunk=1, num_blocks=48, chunks=24):
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16)
        page = spec.page_size_bytes
        extra = {
            "spec_name": "HicacheOffloadingSpec",
            "spec_module_path": "hicache_io.vllm",
            "cpu_bytes_to_use": page * len(LAYERS) * blocks_per_chunk * chunks,
            "offload_prompt_only": False,
        }
        if blocks_per_chunk > 1:
            extra["block_size"] = BLOCK * blocks_per_chunk
        module = "hicache_io.vllm" if connector != "OffloadingConnector" else None
        config = VllmConfig(
            model_config=ModelConfig(model=tiny_model(tmp_path), dtype="float16", seed=0, skip_tokenizer_init=True),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024, enable_chunked_prefill=True, is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector=connector, kv_connector_module_path=module, kv_role="kv_both", kv_connector_extra_config=extra, kv_load_failure_policy="recompute"
            ),
            device_config=DeviceConfig("cpu"),
        )
        config.cache_config.kv_cache_layout = "LBNHC"
        config.cache_config.num_gpu_blocks = num_blocks
        kv_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[KVCacheTensor(size=page * num_blocks, shared_by=[name]) for name in LAYERS]
            if "shared_by" in KVCacheTensor.__dataclass_fields__
            else [KVCacheTensor(size=page * num_blocks * len(LAYERS), layers=list(LAYERS), layer_stride=page * num_blocks, block_stride=page)],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        )
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_config, config)
        self.config = config
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(config),
            block_size=block_size,
            hash_block_size=hash_block_size,
        )
        cls = HicacheOffloadingConnector if connector == "HicacheOffloadingConnector" else OffloadingConnector
        self.worker = cls(config, KVConnectorRole.WORKER, kv_config)
        # vLLM's FlashAttention-style layer tensors: (blocks, K/V, block size, heads, head size).
        self.kv = {name: torch.zeros(num_blocks, 2, BLOCK, HEADS, HEAD, dtype=torch.float16) for name in LAYERS}
        with set_current_vllm_config(config):
            self.worker.register_kv_caches(self.kv)
        self.offload = self.worker.connector_worker.worker
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self.outputs = {}
        self.loaded_tokens = {}

    def add(self, req_id, tokens, max_tokens=2):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        self.scheduler.add_request(Request(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=params, pooling_params=None, block_hasher=self.hasher))

    @staticmethod
    def token_kv(tokens, upto):
        """KV bytes of each token ``0..upto-1`` of ``tokens``, per layer: (tokens, K/V, heads,
        head) float16 values derived from the token's prefix (so a block's bytes name its
        tokens)."""
        h = hashlib.sha256()
        out = []
        for t in tokens[:upto]:
            h.update(int(t).to_bytes(4, "little"))
            seed = int.from_bytes(h.digest()[:8], "little")
            out.append(np.random.default_rng(seed).standard_normal((len(LAYERS), 2, HEADS, HEAD)).astype(np.float16))
        return np.stack(out) if out else np.zeros((0, len(LAYERS), 2, HEADS, HEAD), np.float16)

    def blocks_of(self, req_id):
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def forward(self, out):
        """Writes the KV of every token this step computes."""
        new = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        new.update(dict(zip(cached.req_ids, cached.num_computed_tokens)))
        for req_id, n in out.num_scheduled_tokens.items():
            start = new[req_id]
            req = self.scheduler.requests[req_id]
            self.loaded_tokens.setdefault(req_id, start)
            tokens = list(req.all_token_ids)
            kv = self.token_kv(tokens, start + n)
            blocks = self.blocks_of(req_id)
            for p in range(start, start + n):
                for li, name in enumerate(LAYERS):
                    self.kv[name][blocks[p // BLOCK], :, p % BLOCK] = torch.from_numpy(kv[p, li])

    def step(self):
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(self.ctx)
        self.forward(out)
        self.worker.wait_for_save()
        results = self.worker.get_transfer_results(out.finished_req_ids)
        invalid = self.worker.get_block_ids_with_load_errors()
        worker_meta = self.worker.build_connector_worker_meta() or OffloadingWorkerMetadata()
        self.worker.clear_connector_metadata()
        running = [r.request_id for r in self.scheduler.running]
        sampled = []
        for req_id in running:
            req = self.scheduler.requests[req_id]
            done = out.num_scheduled_tokens.get(req_id, 0) and req.num_computed_tokens + out.num_scheduled_tokens[req_id] >= req.num_tokens
            sampled.append([7] if done else [])
        # vLLM 0.33's output also maps request ids to indices (0.34 derives it).
        by_index = {"req_id_to_index": {r: i for i, r in enumerate(running)}} if "req_id_to_index" in MRO_FIELDS else {}
        mro = ModelRunnerOutput(
            req_ids=running,
            **by_index,
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending,
                finished_recving=results.finished_recving,
                failed_recving=results.failed_recving,
                invalid_block_ids=invalid,
                kv_connector_worker_meta=worker_meta,
            ),
        )
        self.scheduler.update_from_output(out, mro)
        return invalid, results

    def run(self, seconds=30.0):
        """Steps until no request and no transfer is left; the load failures reported."""
        return self._steps(lambda: not self.scheduler.requests and not self.scheduler.connector.connector_scheduler._jobs and not self.scheduler.finished_req_ids, seconds)

    def until_output(self, req_id, seconds=30.0):
        """Steps until ``req_id`` has sampled a token (its blocks still held)."""
        return self._steps(lambda: req_id in self.scheduler.requests and self.scheduler.requests[req_id].num_output_tokens > 0, seconds)

    def _steps(self, done, seconds):
        # Transfers run on the worker's thread: a step of this engine takes microseconds, so
        # the loop is bounded by time, not steps.
        seen_invalid = set()
        deadline = time.monotonic() + seconds
        while not done():
            assert time.monotonic() < deadline, "the engine did not get there"
            invalid, _ = self.step()
            seen_invalid |= invalid
            time.sleep(0.001)
        return seen_invalid

    def check_blocks(self, req_id, tokens, upto):
        """Every byte of the request's first ``upto`` tokens' blocks is what those tokens hold."""
        kv = self.token_kv(tokens, upto)
        blocks = self.blocks_of(req_id)
        for p in range(upto):
            for li, name in enumerate(LAYERS):
                got = self.kv[name][blocks[p // BLOCK], :, p % BLOCK].numpy()
                assert np.array_equal(got, kv[p, li]), f"{req_id}: token {p}, layer {li}"

    def scramble(self, seed):
        g = torch.Generator().manual_seed(seed)
        for t in self.kv.values():
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(torch.float16))
        assert self.scheduler.reset_prefix_cache()


def prompt(seed, n):
    return [int(x) for x in np.random.default_rng(seed).integers(10, 900, n)]


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_shared_prefixes_are_stored_and_served_from_hicache_io(tmp_path, blocks_per_chunk):
    e = Engine(tmp_path, blocks_per_chunk=blocks_per_chunk)
    assert isinstance(e.worker.connector_worker.spec, HicacheOffloadingSpec)
    assert isinstance(e.offload, HicacheOffloadingWorker) and e.offload.tier.device == "cpu"
    shared = prompt(1, 5 * BLOCK)
    a = shared + prompt(2, BLOCK + 3)
    b = shared + prompt(3, 2 * BLOCK)
    e.add("a", a)
    e.add("b", b)
    assert e.run() == set()
    # Device blocks overwritten, GPU prefix cache gone: only the offloaded chunks remain.
    e.scramble(1)
    c = shared + prompt(4, BLOCK + 5)
    e.add("c", c, max_tokens=3)
    e.until_output("c")
    # The shared prefix came from the offloaded chunks (none of it computed here), and every
    # byte of it is what its tokens hold.
    assert e.loaded_tokens["c"] >= 4 * BLOCK, e.loaded_tokens
    e.check_blocks("c", c, len(c))
    e.run()
    e.worker.shutdown()


def test_a_damaged_chunk_is_recomputed_never_loaded(tmp_path):
    e = Engine(tmp_path)
    shared = prompt(5, 4 * BLOCK)
    a = shared + prompt(6, 3)
    e.add("a", a)
    assert e.run() == set()
    e.scramble(2)
    # Damage the host row of the third block of the prefix in one layer tensor (the chunks
    # the manager gave the prefix are the rows written first: find them by content).
    tier = e.offload.tier
    kv = e.token_kv(a, 3 * BLOCK)
    want = np.ascontiguousarray(np.stack([kv[p, 0] for p in range(2 * BLOCK, 3 * BLOCK)], axis=1)).view(np.uint8).ravel()
    rows = tier.read_rows(0).reshape(tier.host_rows, -1)
    hit = [r for r in range(tier.host_rows) if np.array_equal(rows[r], want)]
    assert len(hit) == 1, "the stored row of block 2"
    tier.inject_host_corruption(0, hit[0], 100, b"\x5a")
    c = shared + prompt(7, 2 * BLOCK)
    e.add("c", c, max_tokens=3)
    invalid = e.until_output("c")
    assert invalid, "the damaged chunk was reported"
    # Recomputed from the damaged block on: every byte right.
    e.check_blocks("c", c, len(c))
    e.run()
    # The damaged chunk left the manager's index (vLLM's manager keeps it, and every later
    # request over this prefix would hit it and fail again). c loaded the chunks before it, so
    # stores none of the prefix: the next request loads those, recomputes block 2 and stores it
    # fresh, and the one after it loads the whole prefix.
    for req_id, seed, loaded in (("d", 10, 2 * BLOCK), ("e", 11, 4 * BLOCK)):
        e.scramble(seed)
        tokens = shared + prompt(seed, BLOCK)
        e.add(req_id, tokens, max_tokens=3)
        assert e.until_output(req_id) == set(), f"{req_id}: the damaged chunk was loaded again"
        assert e.loaded_tokens[req_id] >= loaded, e.loaded_tokens
        e.check_blocks(req_id, tokens, len(tokens))
        e.run()
    assert e.scheduler.connector.connector_scheduler.manager.discarded == 1
    assert e.scheduler.connector._loads == {}, "finished requests' planned loads were kept"
    e.worker.shutdown()


def test_vllms_own_connector_on_a_damaged_chunk(tmp_path):
    """Under vLLM's own connector a damaged chunk never lands: 0.33 stops the engine (its worker
    asserts every transfer succeeded); 0.34 recomputes the whole request, and keeps the chunk, so
    the next request over it fails its load and is recomputed whole again (what
    ``HicacheOffloadingConnector`` avoids: the valid prefix kept, the chunk dropped)."""
    e = Engine(tmp_path, connector="OffloadingConnector")
    shared = prompt(8, 3 * BLOCK)
    e.add("a", shared + [11])
    assert e.run() == set()
    e.scramble(3)
    tier = e.offload.tier
    for r in range(tier.host_rows):
        tier.inject_host_corruption(0, r, 0, b"\x01")
    if VLLM_VERSION != "0.33.0":
        # Count the worker's failed loads as vLLM's connector collects them.
        failed = []
        collect = e.offload.get_finished

        def get_finished():
            out = collect()
            failed.extend(r.job_id for r in out if not r.success)
            return out

        e.offload.get_finished = get_finished
        for n, (req_id, tail) in enumerate((("c", [12, 13]), ("d", [14, 15])), start=1):
            e.scramble(4)  # nothing from the device's prefix cache: c's recompute left it there
            tokens = shared + tail
            e.add(req_id, tokens, max_tokens=3)
            e.until_output(req_id)
            # Its load failed (the damaged chunk is still in the index for d), and it was
            # recomputed whole: nothing of it came from the tier, every byte right.
            assert len(failed) == n, f"{req_id}: {len(failed)} failed loads so far"
            assert e.loaded_tokens[req_id] == 0, f"{req_id}: {e.loaded_tokens[req_id]} tokens from a failed load"
            e.check_blocks(req_id, tokens, len(tokens))
            e.run()
        e.worker.shutdown()
        return
    e.add("c", shared + [12, 13], max_tokens=1)
    with pytest.raises(AssertionError) as info:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            e.step()
            time.sleep(0.001)
    # vLLM's worker asserting the transfer's success, not another assertion on the way.
    last = info.traceback[-1]
    assert str(last.path).endswith("offloading/worker.py") and "success" in str(last.statement), last
    e.worker.shutdown()
