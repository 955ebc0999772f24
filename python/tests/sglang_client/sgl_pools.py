"""Builders for sglang 0.5.23's own device pools (on "cpu") and host pools, and the round
trips that drive them (backup_from_device_all_layer, then load_to_device_per_layer per layer)
checked by harness.roundtrip. Everything here is sglang's classes with sglang's constructor
arguments (what its assembler passes); the layout formulas for the reference are ours.
"""

from __future__ import annotations

import zlib

import torch

from . import cpu_shims
from .harness import random_device_pages, roundtrip

P = 4  # MHA / MLA page size
PD = 64  # DSA / DeepSeek-V4: sglang needs 64-token physical pages


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def seed_of(*parts) -> int:
    """A stable seed from a case's parameters (str hashes vary per process)."""
    return zlib.crc32(repr(parts).encode()) % 100_000


# ---------------------------------------------------------------------------------- MHA


def mha_device(layer_num=3, head_num=2, head_dim=64, dtype=torch.bfloat16, size=64):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size=size, page_size=P, dtype=dtype, head_num=head_num, head_dim=head_dim, layer_num=layer_num, device="cpu", enable_memory_saver=False)


def mha_host(dev, layout, drafts=()):
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost, get_mha_host_pool_cls

    info = dev.get_device_pool_infos()[0].buffer_info
    assert get_mha_host_pool_cls(info) is MHATokenToKVPoolHost
    return MHATokenToKVPoolHost(
        info, 2.0, 0, P, layout,  # buffer_info, host_to_device_ratio, host_size (GB), page_size, layout
        pin_memory=True, device="cpu", allocator_type="default",
        device_capacity_tokens=dev.size, start_layer=dev.start_layer, end_layer=dev.end_layer,
        draft_buffer_infos=tuple(d.get_device_pool_infos()[0].buffer_info for d in drafts),
        write_back_staging=dev.hicache_write_back_staging,
    )


MHA_HOST_ROW = {
    "layer_first": lambda b, c, l, h: b[0][c][l][h],
    "page_first": lambda b, c, l, h: b[0][c][h][l],
    "page_first_direct": lambda b, c, l, h: b[0][c][h // P][l][h % P],
    "page_head": lambda b, c, l, h: b[0][c][h // P][:, h % P, l, :],
}


def run_mha(layout, io_backend, *, drafts=0, dtype=torch.bfloat16, head_num=2, head_dim=64, size=64, n_pages=5, seed=0):
    g = gen(seed)
    dev = mha_device(dtype=dtype, head_num=head_num, head_dim=head_dim, size=size)
    draft_pools = [mha_device(layer_num=1, dtype=dtype, head_num=head_num, head_dim=head_dim) for _ in range(drafts)]
    host = mha_host(dev, layout, draft_pools)
    nk = len(host.device_k_buffers)
    plan = [(l, l, False, dev) for l in range(dev.layer_num)]
    plan += [(dev.layer_num + i, dev.layer_num + i, True, dp) for i, dp in enumerate(draft_pools)]
    res = roundtrip(
        name=f"mha/{layout}/{io_backend}", host=host, host_bufs=[host.kv_buffer], host_row=MHA_HOST_ROW[layout],
        dev_bufs=[*host.device_k_buffers, *host.device_v_buffers], dev_row=lambda b, c, l, d: b[c * nk + l][d], comps=(0, 1),
        n_host_layers=host.layer_num, page_rows=False, page_size=P,
        dev_pages=random_device_pages(dev.size // P + 1, n_pages, g), io_backend=io_backend,
        backup=lambda h, d: host.backup_from_device_all_layer(dev, h, d, io_backend),
        load=lambda h, d, lid, dr, dp: host.load_to_device_per_layer(dp, h, d, lid, io_backend, is_draft=dr),
        load_plan=plan, gen=g)
    res.update(host=host, dev=dev, can_use_jit=host.can_use_jit, staged=host.can_use_write_back_jit, host_layers=host.layer_num)
    return res


# ---------------------------------------------------------------------------------- MLA


def mla_device(layer_num=3, kv_lora_rank=96, rope=32, dtype=torch.bfloat16, size=64):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(size=size, page_size=P, dtype=dtype, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope, layer_num=layer_num, device="cpu", enable_memory_saver=False)


def mla_host(dev, layout, drafts=(), page_size=P):
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    sharded = dev.layer_shard_enabled
    return MLATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
        pin_memory=True, device="cpu", allocator_type="default",
        override_kv_cache_dim=dev.kv_cache_dim,  # what build_kv_host_pool passes
        draft_buffer_infos=tuple(d.get_device_pool_infos()[0].buffer_info for d in drafts),
        device_capacity_tokens=dev.size, start_layer=dev.start_layer, end_layer=dev.end_layer,
        layer_shard_enabled=sharded,
        target_layer_num=(-(-dev.layer_num // dev.layer_shard_size) if sharded else dev.layer_num),
    )


def mla_host_row(layout, page_size):
    return {
        "layer_first": lambda b, c, l, h: b[0][l][h],
        "page_first": lambda b, c, l, h: b[0][h][l],
        "page_first_direct": lambda b, c, l, h: b[0][h // page_size][l][h % page_size],
    }[layout]


def _mla_roundtrip(name, dev, host, draft_pools, io_backend, page_size, n_pages, seed):
    g = gen(seed)
    info = dev.get_device_pool_infos()[0].buffer_info
    plan = [(i, lid, False, dev) for i, lid in enumerate(info.layer_indices)]
    plan += [(len(info.layer_indices) + i, dev.layer_num + i, True, dp) for i, dp in enumerate(draft_pools)]
    res = roundtrip(
        name=name, host=host, host_bufs=[host.kv_buffer], host_row=mla_host_row(host.layout, page_size),
        dev_bufs=list(host.device_kv_buffers), dev_row=lambda b, c, l, d: b[l][d], comps=(0,),
        n_host_layers=host.layer_num, page_rows=False, page_size=page_size,
        dev_pages=random_device_pages(dev.size // page_size + 1, n_pages, g), io_backend=io_backend,
        backup=lambda h, d: host.backup_from_device_all_layer(dev, h, d, io_backend),
        load=lambda h, d, lid, dr, dp: host.load_to_device_per_layer(dp, h, d, lid, io_backend, is_draft=dr),
        load_plan=plan, gen=g)
    res.update(host=host, dev=dev, can_use_jit=host.can_use_jit, staged=host.can_use_write_back_jit, host_layers=host.layer_num)
    return res


def run_mla(layout, io_backend, *, drafts=1, size=64, n_pages=5, kv_lora_rank=96, rope=32, dtype=torch.bfloat16, seed=0):
    dims = dict(kv_lora_rank=kv_lora_rank, rope=rope, dtype=dtype, size=size)
    dev = mla_device(**dims)
    draft_pools = [mla_device(layer_num=1, **dims) for _ in range(drafts)]
    host = mla_host(dev, layout, draft_pools)
    return _mla_roundtrip(f"mla/{layout}/{io_backend}", dev, host, draft_pools, io_backend, P, n_pages, seed)


# ---------------------------------------------------------------------------------- DSA


def dsa_device(layer_num=4, shard=None, skip_topk=None, size=PD * 6):
    kw = dict(size=size, page_size=PD, kv_lora_rank=96, dtype=torch.bfloat16, qk_rope_head_dim=32, layer_num=layer_num, device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=128, skip_topk_layers=skip_topk)
    if shard is None:
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

        return DSATokenToKVPool(**kw)
    from sglang.srt.mem_cache.dsa_cache_layer_split import LayerSplitDSATokenToKVPool

    rank, size_ = shard
    with cpu_shims.no_attn_cp_group():
        return LayerSplitDSATokenToKVPool(**kw, layer_shard_rank=rank, layer_shard_size=size_)


def run_mla_sharded(layout, io_backend, *, seed=0):
    dev = dsa_device(shard=(1, 2))  # owns layers [2, 4) of 4
    draft = dsa_device(layer_num=1)
    host = mla_host(dev, layout, (draft,), page_size=PD)
    return _mla_roundtrip(f"mla-sharded/{layout}/{io_backend}", dev, host, [draft], io_backend, PD, 2, seed)


def dsa_indexer_host(dev, layout, drafts=()):
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl

    anchor = mla_host(dev, layout, tuple(drafts), page_size=PD)  # the indexer follows the KV anchor's layout
    return DSAIndexerPoolHost(decl=make_dsa_indexer_pool_decl(dev), anchor_host=anchor, packed_draft_device_pools=tuple(drafts), pin_memory=True, device="cpu", allocator_type="default")


def run_dsa(layout, io_backend, *, shard=None, seed=0):
    g = gen(seed)
    skip = [False, True, False, False] if shard is None else None  # layer 1 shares top-k: no indexer rows
    dev = dsa_device(shard=shard, skip_topk=skip)
    draft = dsa_device(layer_num=1)
    host = dsa_indexer_host(dev, layout, (draft,))
    live = host._live_target_layers
    plan = [(i, lid, False, dev) for i, lid in enumerate(live)]
    plan += [(len(live), dev.layer_num, True, draft)]  # DSA reads the draft pool's own buffer
    row = (lambda b, c, l, p: b[0][l][p]) if layout == "layer_first" else (lambda b, c, l, p: b[0][p][l][0])
    res = roundtrip(
        name=f"dsa/{layout}/{io_backend}{'/sharded' if shard else ''}", host=host,
        host_bufs=[host.index_k_with_scale_buffer], host_row=row,
        dev_bufs=host.packed_device_index_buffers, dev_row=lambda b, c, l, p: b[l][p], comps=(0,),
        n_host_layers=host.layer_num, page_rows=True, page_size=PD,
        dev_pages=random_device_pages(max(b.shape[0] for b in dev.index_k_with_scale_buffer) - 1, 2, g), io_backend=io_backend,
        backup=lambda h, d: host.backup_from_device_all_layer(dev, h, d, io_backend),
        load=lambda h, d, lid, dr, dp: host.load_to_device_per_layer(dp, h, d, lid, io_backend, is_draft=dr),
        load_plan=plan, gen=g)
    res.update(host=host, dev=dev, staged=host.can_use_write_back_jit, live=live, host_layers=host.layer_num)
    return res


# ---------------------------------------------------------------------------------- DeepSeek-V4


def dsv4_device(layer_num=2, size=PD * 6):
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4SingleKVPool

    return DeepSeekV4SingleKVPool(size=size, page_size=PD, dtype=torch.float8_e4m3fn, qk_nope_head_dim=448, qk_rope_head_dim=64, layer_num=layer_num, device="cpu", enable_memory_saver=False)


def dsv4_host(dev, layout, page_aligned_only=False):
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

    return DeepSeekV4PagedHostPool(pool_name="deepseek_v4_c4", device_buffers=list(dev.kv_buffer), item_bytes=dev.bytes_per_page_padded, num_host_pages=12, slot_page_size=PD, layout=layout, device="cpu", pin_memory=True, allocator_type="default", page_aligned_only=page_aligned_only)


def run_dsv4(layout, io_backend, *, seed=0):
    g = gen(seed)
    dev = dsv4_device()
    host = dsv4_host(dev, layout)
    bufs = host.kv_buffer if isinstance(host.kv_buffer, list) else [host.kv_buffer]
    row = {"layer_first": lambda b, c, l, p: b[l][p], "page_first": lambda b, c, l, p: b[0][p][l], "page_first_direct": lambda b, c, l, p: b[0][p][l][0]}[layout]
    res = roundtrip(
        name=f"dsv4/{layout}/{io_backend}", host=host, host_bufs=bufs, host_row=row,
        dev_bufs=host.device_buffers, dev_row=lambda b, c, l, p: b[l][p], comps=(0,),
        n_host_layers=host.layer_num, page_rows=True, page_size=PD,
        dev_pages=random_device_pages(dev.kv_buffer[0].shape[0], 2, g), io_backend=io_backend,
        backup=lambda h, d: host.backup_from_device_all_layer(dev, h, d, io_backend),
        load=lambda h, d, lid, dr, dp: host.load_to_device_per_layer(dp, h, d, lid, io_backend, is_draft=dr),
        load_plan=[(l, l, False, dev) for l in range(host.layer_num)], gen=g)
    res.update(host=host, dev=dev, staged=host.can_use_write_back_jit, host_layers=host.layer_num)
    return res


# ---------------------------------------------------------------------------------- controller


def build_controller_stack(kind: str, layout: str, io_backend: str):
    """sglang's own stack as the scheduler builds it: a CPU device pool, its
    PagedTokenToKVPoolAllocator, the host pool group from sglang's assembler
    (build_kv_only_group: reads layout / io backend from the published config) and a
    HybridCacheController with the L2TransferEngine. Call inside cpu_shims.memory_config(...)."""
    import threading

    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_only_group
    from sglang.srt.runtime_context import get_memory

    assert get_memory().hicache_mem_layout == layout and get_memory().hicache_io_backend == io_backend
    dev = mha_device() if kind == "mha" else mla_device()
    drafts = (mla_device(layer_num=1),) if kind == "mla" else ()
    allocator = PagedTokenToKVPoolAllocator(size=dev.size, page_size=P, dtype=dev.dtype, device="cpu", kvcache=dev, need_sort=False)
    group = build_kv_only_group(page_size=P, kv_pool=dev, full_layer_mapping={i: i for i in range(dev.layer_num)}, use_mla=(kind == "mla"), mtp_draft_device_pools=drafts)
    ctrl = HybridCacheController(
        allocator, group, P, None,  # tp_group=None: no storage collectives
        load_cache_event=threading.Event(), write_policy="write_through", io_backend=io_backend,
        storage_backend=None, transfer_layer_id_max=dev.layer_num)
    return dev, drafts, allocator, group, ctrl


def controller_views(kind: str, layout: str, host):
    """(device buffers, dev_row, host_row, components) for the reference."""
    if kind == "mha":
        nk = len(host.device_k_buffers)
        return [*host.device_k_buffers, *host.device_v_buffers], (lambda b, c, l, d: b[c * nk + l][d]), MHA_HOST_ROW[layout], (0, 1)
    return list(host.device_kv_buffers), (lambda b, c, l, d: b[l][d]), mla_host_row(layout, P), (0,)
