"""A Mamba hybrid's ``UnifiedRadixCache`` (sglang's FULL + MAMBA tree) built by sglang's factory
with hicache-io's linker: attention layers 0 and 3 in a ``HybridLinearKVPool`` (MHA, or MLA as in
Kimi-Linear), Mamba layers 1 and 2 in a ``HybridReqToTokenPool``'s ``MambaPool``; or (``swa``,
a FULL + SWA + MAMBA tree) full attention at 0 and 3, a sliding window at 1 and 4 (an
``SWAKVPool``), Mamba at 2 and 5. A node's state
is inserted with its KV, as the scheduler inserts it; a restore lands the KV in the request's
slots and the state in the request's own Mamba slot, and the forward waits on both layer by
layer."""

from __future__ import annotations

from array import array

import numpy as np
import torch

from . import sgl_pools as sp
from .harness import as_bytes
from .linker_tree import WINDOW, LinkedTree, factory_tree, linker_settings

#: Per attention pool, the model's layers: full attention, the window's, Mamba.
LAYERS = {"mha": ([0, 3], [], [1, 2]), "mla": ([0, 3], [], [1, 2]), "swa": ([0, 3], [1, 4], [2, 5])}
#: State shapes (temporal: heads, head dim, state size; conv: dim, kernel − 1): ``small``
#: states are packed by the local store, ``large`` ones (over 64 KiB) are files of their own, a
#: temporal row of 128 KiB moved in two pieces.
STATES = {"small": ((2, 4, 4), (8, 3)), "large": ((4, 64, 128), (256, 3))}


def _pools(kind: str, state: str, size: int, **ckpt):
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

    (h, d, n), conv = STATES[state]
    full, window, mamba = LAYERS[kind]
    shape = Mamba2StateShape(conv=[conv], temporal=(h, d, n), intermediate_size=conv[0], conv_dim=conv[0], ssm_state_size=n, num_heads=h, head_dim=d, state_size=n, conv_kernel=conv[1] + 1)
    rtp = HybridReqToTokenPool(size=4, mamba_size=8, mamba_spec_state_size=4, max_context_len=256, device="cpu", enable_memory_saver=False, cache_params=Mamba2CacheParams(shape=shape, layers=mamba), mamba_layer_ids=mamba, enable_mamba_extra_buffer=True, enable_overlap_schedule=False)
    if kind == "swa":
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        kv = SWAKVPool(size=size, size_swa=size, page_size=sp.P, dtype=torch.bfloat16, head_num=2, head_dim=64, swa_attention_layer_ids=window, full_attention_layer_ids=full, device="cpu", enable_memory_saver=False)
        return rtp, kv, SWATokenToKVPoolAllocator(size, size, sp.P, torch.bfloat16, "cpu", kv, need_sort=False)
    mla = dict(use_mla=True, kv_lora_rank=96, qk_rope_head_dim=32) if kind == "mla" else {}
    kv = HybridLinearKVPool(size=size, dtype=torch.bfloat16, page_size=sp.P, head_num=2, head_dim=64, full_attention_layer_ids=full, device="cpu", mamba_pool=rtp.mamba_pool, **mla)
    return rtp, kv, PagedTokenToKVPoolAllocator(size=size, page_size=sp.P, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False)


class MambaTree(LinkedTree):
    """:class:`LinkedTree`'s steps on a Mamba hybrid (``kind``: its attention pools, a key of
    :data:`LAYERS`; ``state``: a key of :data:`STATES`)."""

    def __init__(self, extra: dict, kind: str = "mha", state: str = "small", size: int = 64, core: str = "python"):
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.runtime_context import get_server_args

        get_server_args()._mamba_cache_chunk_size = sp.P  # else read from a model's config
        with linker_settings(extra):
            self.rtp, self.dev, self.alloc = _pools(kind, state, size)
            window = dict(sliding_window_size=WINDOW) if kind == "swa" else {}
            params = CacheInitParams(disable=False, req_to_token_pool=self.rtp, token_to_kv_pool_allocator=self.alloc, page_size=sp.P, tree_core_backend=core, enable_mamba_extra_buffer=True, **window)
            self.cache = factory_tree(params, kind == "swa", ssm=True)
        self.linker = self.cache.linker.cache_linker
        full = self.dev.full_kv_pool
        self.buffers = list(full.kv_buffer) if kind == "mla" else list(full.k_buffer) + list(full.v_buffer)
        self.swa_buffers = list(self.dev.swa_kv_pool.k_buffer) + list(self.dev.swa_kv_pool.v_buffer) if kind == "swa" else []
        self.full, self.window, self.mamba = LAYERS[kind]
        cache = self.rtp.mamba_pool.mamba_cache
        self.states = [cache.temporal, *cache.conv]

    def state(self, slot) -> list:
        """The state in Mamba slot ``slot``: per state buffer, every layer's bytes."""
        at = torch.as_tensor(slot).reshape(1)
        return [as_bytes(b[:, at]).clone().numpy() for b in self.states]

    def compute(self, tokens: list, seed: int = 0):
        """KV and a state "computed" for ``tokens`` (random bytes), inserted with the state as
        the node's; returns ``(KV slots, the state's bytes)``."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        slots, ms = self._alloc(len(tokens)), self.rtp.mamba_allocator.alloc(1)
        g = sp.gen(seed)
        for b, at, dim in [(b, rows, 0) for b, rows in self._buffer_rows(slots)] + [(b, ms, 1) for b in self.states]:
            rows = as_bytes(b).index_select(dim, at)
            as_bytes(b).index_copy_(dim, at, torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=g))
        state = self.state(ms)
        result = self.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots.clone(), mamba_value=ms.clone()))
        if result.mamba_exist:  # the tree kept its own state: this slot stays the caller's
            self.rtp.mamba_allocator.free(ms)
        self.settle()
        return slots, state

    def evict(self, slots: torch.Tensor) -> None:
        """Every device copy gone: KV rows and every state zeroed."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.cache.evict(EvictParams(num_tokens=self.dev.size, mamba_num=8))
        for b in self.buffers + self.swa_buffers + self.states:
            as_bytes(b)[...] = 0

    def restore(self, rid: str, tokens: list):
        """As :meth:`LinkedTree.restore`, the forward waiting on the attention layers and the
        Mamba layers in the model's order; returns ``(tokens restored, KV slots or None, its
        state or None, aborted rids)``."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid, "", array("q", list(tokens) + [7]), SamplingParams(max_new_tokens=1))
        req.init_next_round_input(self.cache)
        if not self.cache.linker.has_hit(rid):
            return 0, None, None, []
        n, req.last_node = self.cache.init_load_back(InitLoadBackParams(best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req))
        if n == 0:
            return 0, None, None, []
        slots = self.cache.linker.private_load_indices[rid].clone()
        self.linker.layer_done_counter.set_consumer(self.cache.ready_to_load_host_cache())
        #: The request's Mamba slot.
        self.slot = int(req.kv.mamba_pool_idx.view(-1)[0])
        for layer in sorted(self.full + self.window + self.mamba):
            self.rtp.mamba2_layer_cache(layer) if layer in self.mamba else self.dev.get_key_buffer(layer)
        aborted = [r.rid for r in self.cache.finish_external_linker_loads([req])]
        return n, slots, self.state(req.kv.mamba_pool_idx), aborted


def equal_states(a: list, b: list) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
