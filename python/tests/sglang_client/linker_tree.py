"""sglang's ``UnifiedRadixCache`` built by sglang's own factory with hicache-io's linker
(``hicache_io.sglang_linker.HicacheLinker``, loaded by the ``dynamic`` linker backend), and the
scheduler's steps around it: a request's KV computed and inserted (the tree offloads it), the
device copy evicted, a later request matching the prefix (lookup, load into its own slots, the
layer-wise copy the forward waits on, the verdict after the forward).

Run as a script (``python -m sglang_client.linker_tree DIR TOKENS EXPECTED``), it is another
process restoring pages a test stored: it prints ``EQUAL`` when the bytes restored are those of
``EXPECTED`` (a ``.npy`` of every buffer's rows). ``python -m sglang_client.linker_tree --rank R
PORT DIR OUT`` is rank ``R`` of two tensor-parallel ranks (a gloo group on ``PORT``): see
:func:`rank_main`; ``--unified R PORT DIR OUT`` is such a rank with unified keys: see
:func:`unified_main`."""

from __future__ import annotations

import os
import sys
import time
import types
from array import array

import numpy as np
import torch

from . import cpu_shims
from . import sgl_pools as sp
from .harness import as_bytes


def ninja_on_path() -> None:
    """sglang hashes pages with a C++ extension it builds on first use: ninja must be on PATH
    (the venv's own)."""
    here = os.path.dirname(sys.executable)
    if here not in os.environ["PATH"].split(os.pathsep):
        os.environ["PATH"] = here + os.pathsep + os.environ["PATH"]


def linker_settings(extra: dict):
    """sglang's memory settings (a context, ``cpu_shims.memory_config``) that link the trees
    built inside to hicache-io's linker, with ``extra`` as its ``linker_extra_config``."""
    ninja_on_path()
    cfg = {"linker": "HicacheLinker", "linker_module_path": "hicache_io.sglang_linker", "linker_extra_config": extra}
    return cpu_shims.memory_config(enable_hierarchical_cache=False, enable_unified_cache_external_linker=True, unified_cache_external_linker_backend="dynamic", unified_cache_external_linker_config=cfg)


def factory_tree(params, swa: bool, ssm: bool = False):
    """sglang's factory's tree for ``params`` (``swa``: a sliding-window model; ``ssm``: a Mamba
    hybrid), on a CPU worker."""
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
    from sglang.srt.runtime_context import get_server_args

    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(forward_stream=torch.cpu.Stream()), register_hicache_layer_transfer_counter=lambda counter: None)
    return create_tree_cache(TreeCacheBuildContext(get_server_args(), params, swa, ssm, False, False, worker, None, 1, 0, None))


#: Tokens of the sliding window of ``LinkedTree(kind="swa")``: one page.
WINDOW = sp.P


def _swa_pool(layers: int, size: int, head_num: int = 2, head_dim: int = 64):
    """A sliding-window model's pool and allocator: even layers full attention, odd ones the
    window's."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    ids = list(range(layers))
    dev = SWAKVPool(size=size, size_swa=size, page_size=sp.P, dtype=torch.bfloat16, head_num=head_num, head_dim=head_dim, swa_attention_layer_ids=ids[1::2], full_attention_layer_ids=ids[0::2], device="cpu", enable_memory_saver=False)
    return dev, SWATokenToKVPoolAllocator(size, size, sp.P, torch.bfloat16, "cpu", dev, need_sort=False)


class LinkedTree:
    """A ``UnifiedRadixCache`` on an MHA or MLA device pool on the CPU (``P`` tokens a page;
    ``pool``: the pool's other shape arguments), or (``kind="swa"``) a sliding-window model's
    two MHA pools (a window of ``WINDOW`` tokens), linked to hicache-io's linker with ``extra``
    as its ``linker_extra_config``; ``core``: the tree's core, sglang's ``python`` or ``rust``
    (its default in a server)."""

    def __init__(self, extra: dict, kind: str = "mha", layers: int = 3, size: int = 64, group=None, core: str = "python", **pool):
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        with linker_settings(extra):
            if kind == "swa":
                self.dev, self.alloc = _swa_pool(layers, size, **pool)
            else:
                self.dev = sp.mha_device(layer_num=layers, size=size, **pool) if kind == "mha" else sp.mla_device(layer_num=layers, size=size, **pool)
                self.alloc = PagedTokenToKVPoolAllocator(size=self.dev.size, page_size=sp.P, dtype=self.dev.dtype, device="cpu", kvcache=self.dev, need_sort=False)
            window = dict(sliding_window_size=WINDOW) if kind == "swa" else {}
            params = CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(4, max(256, size), "cpu", False), token_to_kv_pool_allocator=self.alloc, page_size=sp.P, tree_core_backend=core, tp_cache_group=group, attn_tp_cache_group=group, **window)
            self.cache = factory_tree(params, kind == "swa")
        self.linker = self.cache.linker.cache_linker
        full = self.dev.full_kv_pool if kind == "swa" else self.dev
        self.buffers = list(full.k_buffer) + list(full.v_buffer) if kind != "mla" else list(full.kv_buffer)
        #: The window layers' buffers (``kind="swa"``), whose slots are the full slots translated.
        self.swa_buffers = list(self.dev.swa_kv_pool.k_buffer) + list(self.dev.swa_kv_pool.v_buffer) if kind == "swa" else []
        self.layers = layers

    def rows(self, slots: torch.Tensor) -> np.ndarray:
        """The bytes of rows ``slots`` of every buffer (``[buffers][slots][row bytes]``)."""
        return np.stack([as_bytes(b)[slots].reshape(len(slots), -1).numpy() for b in self.buffers])

    def swa_rows(self, slots: torch.Tensor) -> np.ndarray:
        """The window layers' rows of full slots ``slots`` (``[buffers][slots][row bytes]``)."""
        at = self.alloc.translate_loc_from_full_to_swa(slots)
        return np.stack([as_bytes(b)[at].reshape(len(slots), -1).numpy() for b in self.swa_buffers])

    def _buffer_rows(self, slots: torch.Tensor) -> list:
        """Per buffer, the rows of full slots ``slots`` (the window's buffers: translated)."""
        at = self.alloc.translate_loc_from_full_to_swa(slots) if self.swa_buffers else None
        return [(b, slots) for b in self.buffers] + [(b, at) for b in self.swa_buffers]

    def _alloc(self, n: int) -> torch.Tensor:
        """``n`` fresh slots (with a window: full slots, each mapped to a window slot)."""
        if not self.swa_buffers:
            return self.alloc.alloc(n)
        full, swa = self.alloc.full_attn_allocator.alloc(n), self.alloc.swa_attn_allocator.alloc(n)
        self.alloc.set_full_to_swa_mapping(full, swa)
        return full

    def compute(self, tokens: list, seed: int = 0) -> torch.Tensor:
        """KV of ``tokens`` "computed" (random rows) into fresh slots, inserted into the tree,
        which offloads it; returns once the tree has the linker's answer."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        slots = self._alloc(len(tokens))
        g = sp.gen(seed)
        for b, rows in self._buffer_rows(slots):
            as_bytes(b)[rows] = torch.randint(0, 256, as_bytes(b)[rows].shape, dtype=torch.uint8, generator=g)
        start = time.perf_counter()
        self.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots.clone()))
        self.settle()
        #: Seconds the insert took until every offload was answered (scripts/bench-linker.py).
        self.insert_seconds = time.perf_counter() - start
        return slots

    def settle(self, timeout: float = 30.0) -> None:
        """The scheduler's per-step event check until no offload is pending."""
        end = time.monotonic() + timeout
        while True:
            self.cache.check_hicache_events()
            if not self.cache.linker.pending_offloads:
                return
            if time.monotonic() > end:
                raise TimeoutError("offloads still pending")
            time.sleep(0.005)

    def evict(self, slots: torch.Tensor) -> None:
        """The device copy gone, its rows overwritten (a load that moves nothing must show)."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        held = self._buffer_rows(slots)  # before the eviction drops the window's mapping
        assert self.cache.evict(EvictParams(num_tokens=len(slots))).num_tokens_evicted >= len(slots)
        for b, rows in held:
            as_bytes(b)[rows] = 0

    def restore(self, rid: str, tokens: list):
        """A request for ``tokens`` plus one: the match, the load into its slots and the forward's
        layer-wise waits. Returns ``(tokens restored, its slots or None, aborted rids)``."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid, "", array("q", list(tokens) + [7]), SamplingParams(max_new_tokens=1))
        req.init_next_round_input(self.cache)
        if not self.cache.linker.has_hit(rid):
            return 0, None, []
        n, req.last_node = self.cache.init_load_back(InitLoadBackParams(best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req))
        if n == 0:
            return 0, None, []
        slots = self.cache.linker.private_load_indices[rid].clone()
        index = self.cache.ready_to_load_host_cache()
        self.linker.layer_done_counter.set_consumer(index)
        for layer in range(self.layers):  # the forward's attention reads, layer by layer
            self.dev.get_key_buffer(layer)
        return n, slots, [r.rid for r in self.cache.finish_external_linker_loads([req])]

    def close(self) -> None:
        self.cache.release_host_resources()


def main(directory: str, tokens: str, expected: str) -> None:
    import hicache_io.sglang

    hicache_io.sglang.install()
    cpu_shims.apply()
    tree = LinkedTree({"store": "local", "path": directory})
    n, slots, aborted = tree.restore("other-process", [int(t) for t in tokens.split(",")])
    ok = n and not aborted and np.array_equal(tree.rows(slots), np.load(expected))
    print("EQUAL" if ok else f"DIFFERENT (restored {n}, aborted {aborted})")
    tree.close()


def _gloo(rank: int, port: str):
    """This process as rank ``rank`` of two (gloo, on ``port``); their group."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    return torch.distributed.new_group([0, 1], backend="gloo")


def rank_main(rank: str, port: str, directory: str, out: str) -> None:
    """Rank ``rank`` of two: each stores its own heads' pages of one prefix and restores them
    (``first``: tokens restored, bytes equal); then rank 1 flips a byte of its last page and both
    restore again (``second``: tokens restored). Writes ``{"first": ..., "second": ...}`` to
    ``OUT``."""
    import json

    import hicache_io.sglang

    hicache_io.sglang.install()
    cpu_shims.apply()
    r = int(rank)
    group = _gloo(r, port)
    tree = LinkedTree({"store": "local", "path": directory}, group=group)
    toks = list(range(100, 112))
    slots = tree.compute(toks, seed=r)
    computed = tree.rows(slots)
    tree.evict(slots)
    torch.distributed.barrier(group)
    n, got, aborted = tree.restore("r1", toks)
    first = [n, bool(n) and not aborted and np.array_equal(tree.rows(got), computed)]
    if r == 1:
        from common import held_at
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        path, at = held_at(tree.linker.client, tree.linker.object_keys(get_storage_hash_str(toks, None, page_size=sp.P))[2])
        with open(path, "r+b") as f:
            f.seek(at + 50)
            b = f.read(1)
            f.seek(at + 50)
            f.write(bytes([b[0] ^ 1]))
    torch.distributed.barrier(group)
    second = tree.restore("r2", toks)[0]
    with open(out, "w") as f:
        json.dump({"first": first, "second": second}, f)
    tree.close()
    torch.distributed.destroy_process_group()


#: Prefixes of the unified keys' exchange: ``A`` stored by one rank of all heads, ``B`` by two.
UNIFIED_A, UNIFIED_B = list(range(200, 212)), list(range(300, 312))


def unified_main(rank: str, port: str, directory: str, out: str) -> None:
    """Rank ``rank`` of two tp ranks (two of a model's four kv heads each) with unified keys:
    restores its heads of prefix ``UNIFIED_A``, which a process holding all four heads stored
    (``OUT.a.npy``: the rows restored, empty where the restore fell short), then computes and
    stores its heads of ``UNIFIED_B`` (``OUT.b.npy``: the rows computed)."""
    import hicache_io.sglang

    hicache_io.sglang.install()
    cpu_shims.apply()
    r = int(rank)
    group = _gloo(r, port)
    tree = LinkedTree({"store": "local", "path": directory, "key_scheme": "unified", "kv_heads": 4}, group=group, head_num=2)
    n, got, aborted = tree.restore("a", UNIFIED_A)
    np.save(out + ".a.npy", tree.rows(got) if n == len(UNIFIED_A) and not aborted else np.zeros(0))
    np.save(out + ".b.npy", tree.rows(tree.compute(UNIFIED_B, seed=20 + r)))
    torch.distributed.barrier(group)
    tree.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        rank_main(*sys.argv[2:6])
    elif sys.argv[1] == "--unified":
        unified_main(*sys.argv[2:6])
    else:
        main(*sys.argv[1:4])
