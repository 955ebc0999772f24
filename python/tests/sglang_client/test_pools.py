"""sglang 0.5.23's own host pools over its own CPU device pools, moving bytes through
hicache-io: backup_from_device_all_layer, then load_to_device_per_layer layer by layer, with the
controller's index conventions; every byte of every buffer checked against the torch reference
after the backup and after each layer, and the functions sglang called recorded.

Paths: ``cuda_staged`` = sglang's CUDA code paths with the staged write-back capability (what a
GPU box runs: JIT names, staged page_first backup), ``cuda_unstaged`` = CUDA paths without the
capability, ``cpu`` = sglang's CPU paths (``_is_cuda`` False: the AOT ``sgl_kernel.kvcacheio``
ops)."""

from ._env import require_sglang

require_sglang()

import pytest  # noqa: E402
import torch  # noqa: E402

from . import cpu_shims  # noqa: E402
from . import sgl_pools as sp  # noqa: E402
from .harness import Spy, expected_target  # noqa: E402

PATHS = {"cuda_staged": dict(cuda=True, device_kernels=True), "cuda_unstaged": dict(cuda=True, device_kernels=False), "cpu": dict(cuda=False, device_kernels=False)}

JIT_ALL, JIT_ONE = "jit_transfer_hicache_all_layer", "jit_transfer_hicache_one_layer"
JIT_STAGED = "jit_transfer_hicache_all_layer_staged_lf_pf"
JIT_ALL_MLA, JIT_ONE_MLA = "jit_transfer_hicache_all_layer_mla", "jit_transfer_hicache_one_layer_mla"
JIT_STAGED_MLA = "jit_transfer_hicache_all_layer_mla_staged_lf_pf"
DIRECT = "transfer_kv_direct"
PFD_BACKUP, PFD_LOAD = "transfer_kv_all_layer_direct_lf_pf", "transfer_kv_per_layer_direct_pf_lf"


def case(*values, id):
    return pytest.param(*values, id=id)


def _check_route(res, backup, load):
    assert res["backup_calls"] == [backup], f"backup went through {res['backup_calls']}, expected {backup}"
    assert res["load_calls"] == [load], f"loads went through {res['load_calls']}, expected {load}"
    for bound, target in res["targets"].items():
        assert target == expected_target(bound), f"sglang's {bound} is hicache-io's {target}"


# --------------------------------------------------------------------------------- MHA

MHA_CASES = [
    # layout, io, path, backup route, load route
    case("layer_first", "kernel", "cuda_staged", JIT_ALL, JIT_ONE, id="lf-kernel-cuda"),
    case("page_first", "kernel", "cuda_staged", JIT_STAGED, JIT_ONE, id="pf-kernel-cuda_staged"),
    case("page_first", "kernel", "cuda_unstaged", "transfer_kv_all_layer_lf_pf", JIT_ONE, id="pf-kernel-cuda_unstaged"),
    case("page_head", "kernel", "cuda_staged", "transfer_kv_all_layer_lf_ph", "transfer_kv_per_layer_ph_lf", id="ph-kernel-cuda"),
    case("layer_first", "direct", "cuda_staged", DIRECT, DIRECT, id="lf-direct-cuda"),
    case("page_first_direct", "direct", "cuda_staged", PFD_BACKUP, PFD_LOAD, id="pfd-direct-cuda"),
    case("layer_first", "kernel", "cpu", "transfer_kv_all_layer", "transfer_kv_per_layer", id="lf-kernel-cpu"),
    case("page_first", "kernel", "cpu", "transfer_kv_all_layer_lf_pf", "transfer_kv_per_layer_pf_lf", id="pf-kernel-cpu"),
    case("page_head", "kernel", "cpu", "transfer_kv_all_layer_lf_ph", "transfer_kv_per_layer_ph_lf", id="ph-kernel-cpu"),
    case("layer_first", "direct", "cpu", DIRECT, DIRECT, id="lf-direct-cpu"),
    case("page_first_direct", "direct", "cpu", PFD_BACKUP, PFD_LOAD, id="pfd-direct-cpu"),
]


@pytest.mark.parametrize("layout,io,path,backup,load", MHA_CASES)
def test_mha(layout, io, path, backup, load):
    with cpu_shims.sglang_paths(**PATHS[path]):
        res = sp.run_mha(layout, io, seed=sp.seed_of(layout, io, path))
    assert res["can_use_jit"] is PATHS[path]["cuda"]
    assert res["staged"] is (backup == JIT_STAGED)
    _check_route(res, backup, load)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_mha_packed_mtp_draft(dtype):
    """One packed MTP draft layer after the target layers (loaded with is_draft=True)."""
    with cpu_shims.sglang_paths(cuda=True, device_kernels=True):
        res = sp.run_mha("page_first", "kernel", drafts=1, dtype=dtype, seed=7)
    assert res["host_layers"] == 4
    _check_route(res, JIT_STAGED, JIT_ONE)


@pytest.mark.parametrize("layout,path,backup,load", [
    case("page_first", "cuda_staged", JIT_STAGED, JIT_ONE, id="pf-kernel-cuda_staged"),
    case("layer_first", "cpu", "transfer_kv_all_layer", "transfer_kv_per_layer", id="lf-kernel-cpu"),
])
def test_mha_fp8(layout, path, backup, load):
    """torch.float8_e4m3fn: sglang's MHATokenToKVPool accepts it on CPU and stores it as uint8
    (store_dtype); the host pool follows. One byte per element, 128-byte rows."""
    with cpu_shims.sglang_paths(**PATHS[path]):
        res = sp.run_mha(layout, "kernel", dtype=torch.float8_e4m3fn, seed=11)
    assert res["dev"].dtype == torch.float8_e4m3fn and res["dev"].store_dtype == torch.uint8
    assert res["host"].kv_buffer.dtype == torch.uint8
    _check_route(res, backup, load)


# --------------------------------------------------------------------------------- MLA + draft

MLA_CASES = [
    case("layer_first", "kernel", "cuda_staged", JIT_ALL_MLA, JIT_ONE_MLA, id="lf-kernel-cuda"),
    case("page_first", "kernel", "cuda_staged", JIT_STAGED_MLA, JIT_ONE_MLA, id="pf-kernel-cuda_staged"),
    case("page_first", "kernel", "cuda_unstaged", "transfer_kv_all_layer_mla_lf_pf", JIT_ONE_MLA, id="pf-kernel-cuda_unstaged"),
    case("layer_first", "direct", "cuda_staged", DIRECT, DIRECT, id="lf-direct-cuda"),
    case("page_first_direct", "direct", "cuda_staged", PFD_BACKUP, PFD_LOAD, id="pfd-direct-cuda"),
    case("layer_first", "kernel", "cpu", "transfer_kv_all_layer_mla", "transfer_kv_per_layer_mla", id="lf-kernel-cpu"),
    case("page_first", "kernel", "cpu", "transfer_kv_all_layer_mla_lf_pf", "transfer_kv_per_layer_mla_pf_lf", id="pf-kernel-cpu"),
    case("layer_first", "direct", "cpu", DIRECT, DIRECT, id="lf-direct-cpu"),
    case("page_first_direct", "direct", "cpu", PFD_BACKUP, PFD_LOAD, id="pfd-direct-cpu"),
]


@pytest.mark.parametrize("layout,io,path,backup,load", MLA_CASES)
def test_mla_with_packed_draft(layout, io, path, backup, load):
    with cpu_shims.sglang_paths(**PATHS[path]):
        res = sp.run_mla(layout, io, drafts=1, seed=sp.seed_of(layout, io, path))
    assert res["host_layers"] == 4  # 3 target layers + the packed draft layer
    assert res["can_use_jit"] is PATHS[path]["cuda"]
    assert res["staged"] is (backup == JIT_STAGED_MLA)
    _check_route(res, backup, load)


@pytest.mark.parametrize("layout,io,path,backup,load", [MLA_CASES[1], MLA_CASES[4], MLA_CASES[6]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_mla_deepseek_dims_two_drafts(layout, io, path, backup, load, dtype):
    """DeepSeek's latent width (kv_lora_rank 512 + rope 64: 1152- or 576-byte rows) and two
    packed MTP draft layers."""
    with cpu_shims.sglang_paths(**PATHS[path]):
        res = sp.run_mla(layout, io, drafts=2, kv_lora_rank=512, rope=64, dtype=dtype, seed=sp.seed_of(layout, io, path, str(dtype)))
    assert res["host_layers"] == 5
    _check_route(res, backup, load)


@pytest.mark.parametrize("kind", ["mha", "mla+draft"])
def test_staged_write_back_beyond_staging_capacity(kind):
    """70 pages in one backup: more than sglang's staging buffer holds (64 pages,
    _WRITE_BACK_STAGING_PAGE_CHUNK), so sglang's own kernel would run in chunks."""
    with cpu_shims.sglang_paths(cuda=True, device_kernels=True):
        if kind == "mha":
            res = sp.run_mha("page_first", "kernel", size=320, n_pages=70, seed=70)
        else:
            res = sp.run_mla("page_first", "kernel", size=320, n_pages=70, seed=71)
    assert res["host"].staging_page_capacity == 64 and res["units"] == 70 * sp.P
    _check_route(res, JIT_STAGED if kind == "mha" else JIT_STAGED_MLA, JIT_ONE if kind == "mha" else JIT_ONE_MLA)


# --------------------------------------------------------------------------------- layer-sharded MLA

@pytest.mark.parametrize("layout,io,path,backup,load", [
    case("layer_first", "kernel", "cuda_staged", JIT_ONE_MLA, JIT_ONE_MLA, id="lf-kernel-cuda"),
    case("layer_first", "kernel", "cpu", "transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla", id="lf-kernel-cpu"),
    case("page_first", "kernel", "cuda_staged", JIT_ONE_MLA, JIT_ONE_MLA, id="pf-kernel-cuda"),
    case("layer_first", "direct", "cpu", DIRECT, DIRECT, id="lf-direct-cpu"),
])
def test_layer_sharded_mla(layout, io, path, backup, load):
    """LayerSplitDSATokenToKVPool rank 1 of 2 (layers 2..3 of 4) + one draft layer: sglang backs
    it up layer by layer (the one-layer copy), 64-token pages."""
    with cpu_shims.sglang_paths(**PATHS[path]):
        res = sp.run_mla_sharded(layout, io, seed=sp.seed_of(layout, io, path))
    assert res["host_layers"] == 3 and not res["staged"]
    _check_route(res, backup, load)


# --------------------------------------------------------------------------------- DSA indexer

DSA_CASES = [
    case("layer_first", "kernel", "cuda_staged", None, "transfer_kv_all_layer_mla", "transfer_kv_per_layer_mla", id="lf-kernel"),
    case("page_first", "kernel", "cuda_staged", None, JIT_STAGED_MLA, "transfer_kv_per_layer_mla_pf_lf", id="pf-kernel-cuda_staged"),
    case("page_first", "kernel", "cuda_unstaged", None, "transfer_kv_all_layer_mla_lf_pf", "transfer_kv_per_layer_mla_pf_lf", id="pf-kernel-cuda_unstaged"),
    case("page_first", "kernel", "cpu", None, "transfer_kv_all_layer_mla_lf_pf", "transfer_kv_per_layer_mla_pf_lf", id="pf-kernel-cpu"),
    case("layer_first", "direct", "cuda_staged", None, DIRECT, DIRECT, id="lf-direct"),
    case("page_first_direct", "direct", "cuda_staged", None, PFD_BACKUP, PFD_LOAD, id="pfd-direct"),
    case("layer_first", "kernel", "cuda_staged", (1, 2), "transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla", id="sharded-lf-kernel"),
    case("layer_first", "direct", "cuda_staged", (1, 2), DIRECT, DIRECT, id="sharded-lf-direct"),
]


@pytest.mark.parametrize("layout,io,path,shard,backup,load", DSA_CASES)
def test_dsa_indexer(layout, io, path, shard, backup, load):
    """DSAIndexerPoolHost (page rows of the top-k indexer) with a packed draft; unsharded pools
    have a skip-topk layer (layer 1) that holds no indexer rows."""
    with cpu_shims.sglang_paths(**PATHS[path]):
        res = sp.run_dsa(layout, io, shard=shard, seed=sp.seed_of(layout, io, path, shard))
    assert res["live"] == ([0, 2, 3] if shard is None else [2, 3])
    assert res["staged"] is (backup == JIT_STAGED_MLA)
    _check_route(res, backup, load)


# --------------------------------------------------------------------------------- DeepSeek-V4

@pytest.mark.parametrize("layout,io,path,backup,load", [
    case("layer_first", "kernel", "cuda_staged", "transfer_kv_all_layer_mla", "transfer_kv_per_layer_mla", id="lf-kernel"),
    case("page_first", "kernel", "cuda_staged", JIT_STAGED_MLA, "transfer_kv_per_layer_mla_pf_lf", id="pf-kernel-cuda_staged"),
    case("page_first", "kernel", "cuda_unstaged", "transfer_kv_all_layer_mla_lf_pf", "transfer_kv_per_layer_mla_pf_lf", id="pf-kernel-cuda_unstaged"),
    case("layer_first", "direct", "cuda_staged", DIRECT, DIRECT, id="lf-direct"),
    case("page_first_direct", "direct", "cuda_staged", PFD_BACKUP, PFD_LOAD, id="pfd-direct"),
])
def test_deepseek_v4_paged(layout, io, path, backup, load):
    """DeepSeekV4PagedHostPool over DeepSeekV4SingleKVPool (fp8 C4 rows, 37440-byte pages),
    whole 64-token pages."""
    with cpu_shims.sglang_paths(**PATHS[path]):
        res = sp.run_dsv4(layout, io, seed=sp.seed_of(layout, io, path))
    assert res["host"].item_bytes == 37440
    assert res["staged"] is (backup == JIT_STAGED_MLA)
    _check_route(res, backup, load)


def _c4_token(buf, t):
    """Token ``t`` of a C4 layer buffer (uint8 rows of 37440-byte pages) as its 576-byte value
    and 8-byte scale: sglang's page layout, [value_0..value_63][scale_0..scale_63][pad]."""
    flat = buf.reshape(-1)
    page, slot = divmod(int(t), 64)
    base = page * 37440
    return torch.cat([flat[base + slot * 576: base + (slot + 1) * 576], flat[base + 36864 + slot * 8: base + 36864 + (slot + 1) * 8]])


@pytest.mark.parametrize("n", [1, 5, 70])
def test_deepseek_v4_token_granular(n):
    """Token counts that are not a multiple of 64 (HiSparse's one token per request, sglang's
    unaligned branches) go through transfer_cache_dsv4_mla: a backup of every layer, then a
    load of each layer back into other device tokens, byte-compared token by token, and every
    other byte unchanged."""
    g = torch.Generator().manual_seed(n)
    with cpu_shims.sglang_paths(cuda=True):
        dev = sp.dsv4_device()
        host = sp.dsv4_host(dev, "layer_first")
    dev_bufs = [b.view(torch.uint8) for b in host.device_buffers]
    for b in dev_bufs:
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    for b in host.kv_buffer:
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    dev_tokens = dev_bufs[0].numel() // 37440 * 64
    host_tokens = host.kv_buffer[0].numel() // 37440 * 64
    d = torch.randperm(dev_tokens, generator=g)[:n]
    h = torch.randperm(host_tokens, generator=g)[:n]
    host_before = [b.clone() for b in host.kv_buffer]
    with Spy() as spy:
        host.backup_from_device_all_layer(dev, h, d, "kernel")
    assert spy.take() == ["transfer_cache_dsv4_mla"]
    for layer, (hb, db, before) in enumerate(zip(host.kv_buffer, dev_bufs, host_before)):
        want = before.clone()
        for ht, dt in zip(h.tolist(), d.tolist()):
            page, slot = divmod(ht, 64)
            flat = want.reshape(-1)
            tok = _c4_token(db, dt)
            flat[page * 37440 + slot * 576: page * 37440 + (slot + 1) * 576] = tok[:576]
            flat[page * 37440 + 36864 + slot * 8: page * 37440 + 36864 + (slot + 1) * 8] = tok[576:]
        assert torch.equal(hb, want), f"layer {layer}"
    # Load each layer's tokens back into other device tokens.
    d2 = torch.randperm(dev_tokens, generator=g)[:n]
    dev_before = [b.clone() for b in dev_bufs]
    for layer in range(host.layer_num):
        with Spy() as spy:
            host.load_to_device_per_layer(dev, h, d2, layer, "kernel")
        assert spy.take() == ["transfer_cache_dsv4_mla"]
    for layer, (db, before) in enumerate(zip(dev_bufs, dev_before)):
        want = before.clone()
        flat = want.reshape(-1)
        for ht, dt in zip(h.tolist(), d2.tolist()):
            page, slot = divmod(dt, 64)
            tok = _c4_token(host.kv_buffer[layer], ht)
            flat[page * 37440 + slot * 576: page * 37440 + (slot + 1) * 576] = tok[:576]
            flat[page * 37440 + 36864 + slot * 8: page * 37440 + 36864 + (slot + 1) * 8] = tok[576:]
        assert torch.equal(db, want), f"layer {layer}"
        # And what went out came back: the device tokens hold what they held before the backup.
        for dt, dt2 in zip(d.tolist(), d2.tolist()):
            assert torch.equal(_c4_token(db, dt2), _c4_token(before, dt)), f"layer {layer}: token {dt} -> host -> {dt2}"


def test_deepseek_v4_token_copy_refuses_before_moving():
    """Given the layers as arrays (not sglang's trusted address tables), a token past a layer's
    pages or a destination token written twice is refused before any byte moves (sglang's
    kernel reads indices as 32 bits and writes wherever they point)."""
    from hicache_io import kvcacheio

    with cpu_shims.sglang_paths(cuda=True):
        dev = sp.dsv4_device()
        host = sp.dsv4_host(dev, "layer_first")
    src = [b.view(torch.uint8) for b in host.device_buffers]
    host_tokens = host.kv_buffer[0].numel() // 37440 * 64
    before = [b.clone() for b in host.kv_buffer]
    with pytest.raises(IndexError, match="out of range"):
        kvcacheio.transfer_cache_dsv4_mla(src, list(host.kv_buffer), torch.tensor([1, 2]), torch.tensor([3, host_tokens]))
    with pytest.raises(ValueError, match="written twice"):
        kvcacheio.transfer_cache_dsv4_mla(src, list(host.kv_buffer), torch.tensor([1, 2]), torch.tensor([5, 5]))
    with pytest.raises(ValueError, match="block_size"):
        kvcacheio.transfer_cache_dsv4_mla(src, list(host.kv_buffer), torch.tensor([1]), torch.tensor([5]), block_size=48)
    assert all(torch.equal(a, b) for a, b in zip(host.kv_buffer, before))


# --------------------------------------------------------------------------------- what sglang refuses

# --------------------------------------------------------------------------------- Mamba

MAMBA_CASES = [
    case("page_first", "kernel", "transfer_kv_mamba_lf_pf", "transfer_kv_mamba_pf_lf", id="pf-kernel"),
    case("page_first_direct", "kernel", "transfer_kv_mamba_lf_pf", "transfer_kv_mamba_pf_lf", id="pfd-kernel"),
    case("page_first", "direct", PFD_BACKUP, PFD_LOAD, id="pf-direct"),
    case("page_first_direct", "direct", PFD_BACKUP, PFD_LOAD, id="pfd-direct"),
]


@pytest.mark.parametrize("layout,io,backup,load", MAMBA_CASES)
def test_mamba_pool_host(layout, io, backup, load):
    """sglang's MambaPoolHost (a temporal state and two conv states per layer and slot, slot
    indices): backup_from_device_all_layer, then load_to_device_per_layer layer by layer into
    wiped device states; every byte checked, and the functions sglang called are hicache-io's
    (kernel io: the Mamba JIT names, which sglang has no fallback for)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    g = sp.gen(sp.seed_of("mamba", layout, io))
    layers, slots = 3, 17
    temporal = torch.randn(layers, slots, 4, 16, generator=g)
    conv = tuple(torch.randn(layers, slots, *shape, generator=g).to(torch.bfloat16) for shape in ((3, 16), (2, 8)))
    states = (temporal, *conv)
    with cpu_shims.sglang_paths(cuda=True):
        host = MambaPoolHost(MambaStateBufferInfo(temporal=temporal, conv=conv), 2.0, 0, device_capacity=slots - 1, layout=layout, pin_memory=True)
        host_bufs = (host.temporal_buffer, *host.conv_buffer)
        hi, di = torch.tensor([9, 2, 30, 5], dtype=torch.int64), torch.tensor([3, 16, 0, 7], dtype=torch.int64)
        with Spy() as spy:
            host.backup_from_device_all_layer(None, hi, di, io)
            assert spy.take() == [backup]
            for n, (h, d) in enumerate(zip(host_bufs, states)):
                assert torch.equal(h[hi, :, 0].view(torch.uint8), d[:, di].transpose(0, 1).view(torch.uint8)), f"backup, state {n}"
            saved = [d.clone() for d in states]
            for d in states:
                d[:, di] = 0
            for layer in range(layers):
                host.load_to_device_per_layer(None, hi, di, layer, io)
                for n, (d, s) in enumerate(zip(states, saved)):
                    want = s.clone()
                    want[layer + 1 :, di] = 0
                    assert torch.equal(d.view(torch.uint8), want.view(torch.uint8)), f"load of layer {layer}, state {n}"
            assert spy.take() == [load]
            for bound, target in spy.targets().items():
                assert target == expected_target(bound), f"sglang's {bound} is hicache-io's {target}"


# --------------------------------------------------------------------------------- MXFP8


def test_mha_mxfp8_scales():
    """sglang's MXFP8 KV pool (FP8 payload, UE8M0 scales interleaved per 128-token page) and its
    MHATokenToKVPoolMXFP8Host: the scale pages move as whole page rows (page_size=1) beside the
    payload. Backup, wipe, load layer by layer: payload and scales byte-exact, only the moved pages
    touched, every function sglang called hicache-io's."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolMXFP8
    from sglang.srt.mem_cache.pool_host.mha_mxfp8 import MHATokenToKVPoolMXFP8Host

    g = sp.gen(sp.seed_of("mxfp8"))
    P = 128
    with cpu_shims.sglang_paths(cuda=True):
        dev = MHATokenToKVPoolMXFP8(size=4 * P, page_size=P, dtype=torch.float8_e4m3fn, head_num=2, head_dim=64, layer_num=2, device="cpu", enable_memory_saver=False)
        assert dev.mxfp8_sf_interleaved
        host = MHATokenToKVPoolMXFP8Host(
            dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, P, "page_first", pin_memory=True, device="cpu", allocator_type="default",
            device_capacity_tokens=dev.size, start_layer=dev.start_layer, end_layer=dev.end_layer, write_back_staging=dev.hicache_write_back_staging,
        )
        payload, scales = [*dev.k_buffer, *dev.v_buffer], [*dev.k_scale_buffer, *dev.v_scale_buffer]
        for t in payload + scales:
            b = t.view(torch.uint8)
            b.copy_(torch.randint(0, 120, b.shape, generator=g, dtype=torch.uint8))
        before = [t.view(torch.uint8).clone() for t in payload + scales]
        hi, di = host.alloc(2 * P), torch.arange(P, 3 * P, dtype=torch.int64)  # device pages 1, 2
        dp, hp = di[::P] // P, hi[::P] // P
        with Spy() as spy:
            host.backup_from_device_all_layer(dev, hi, di, "kernel")
            backup_calls = spy.take()
            for side, rows in (("k", dev.k_scale_buffer), ("v", dev.v_scale_buffer)):
                host_rows = getattr(host, f"{side}_scale_host")
                for layer, t in enumerate(rows):
                    want = t.view(torch.uint8).reshape(t.shape[0], -1)[dp]
                    assert torch.equal(host_rows[hp, layer].view(torch.uint8), want), f"{side} scales of layer {layer} after the backup"
            for t in payload + scales:
                t.view(torch.uint8).zero_()
            for layer in range(2):
                host.load_to_device_per_layer(dev, hi, di, layer, "kernel")
            load_calls = spy.take()
            targets = spy.targets()
        for n, (t, b) in enumerate(zip(payload + scales, before)):
            now, want = t.view(torch.uint8), torch.zeros_like(b)
            if n < len(payload):
                want[di] = b[di]
            else:
                want[dp] = b[dp]
            assert torch.equal(now, want), f"buffer {n} after the loads"
    assert backup_calls and load_calls, (backup_calls, load_calls)
    assert any("mla" in c for c in backup_calls + load_calls), "the scale pages did not move as MLA-style page rows"
    for bound, target in targets.items():
        assert target == expected_target(bound), f"sglang's {bound} is hicache-io's {target}"


def _one_backup(host, dev, io, n_tokens, page):
    h = host.alloc(n_tokens)
    host.backup_from_device_all_layer(dev, h, torch.arange(page, page + n_tokens, dtype=torch.int64), io)


def _mha(layout, io):
    dev = sp.mha_device()
    _one_backup(sp.mha_host(dev, layout), dev, io, 2 * sp.P, sp.P)


def _mla_sharded(layout, io):
    dev = sp.dsa_device(shard=(1, 2))
    _one_backup(sp.mla_host(dev, layout, page_size=sp.PD), dev, io, sp.PD, sp.PD)


def _dsa_sharded(layout, io):
    dev = sp.dsa_device(shard=(1, 2))
    _one_backup(sp.dsa_indexer_host(dev, layout), dev, io, sp.PD, sp.PD)


def _dsv4_unaligned_on_aligned_only():
    dev = sp.dsv4_device()
    host = sp.dsv4_host(dev, "layer_first", page_aligned_only=True)
    host.backup_from_device_all_layer(dev, torch.tensor([1, 2]), torch.tensor([65, 66]), "kernel")


REJECTED = [
    case(lambda: _mha("page_first_direct", "kernel"), "cuda_staged", ValueError, "Unsupported layout: page_first_direct", id="mha-pfd-kernel"),
    case(lambda: _mha("page_first", "direct"), "cuda_staged", ValueError, "Unsupported layout: page_first", id="mha-pf-direct"),
    case(lambda: sp.mla_host(sp.mla_device(), "page_head"), "cuda_staged", ValueError, "Unsupported layout: page_head", id="mla-page_head"),
    case(lambda: _mla_sharded("page_first", "kernel"), "cpu", ValueError, "requires the JIT one-layer kernel", id="mla-sharded-pf-kernel-cpu"),
    case(lambda: _mla_sharded("page_first_direct", "direct"), "cuda_staged", ValueError, "only supports layer_first", id="mla-sharded-pfd-direct"),
    case(lambda: _dsa_sharded("page_first", "kernel"), "cuda_staged", ValueError, "per-layer LF->PF kernel", id="dsa-sharded-pf-kernel"),
    case(lambda: _dsa_sharded("page_first_direct", "direct"), "cuda_staged", ValueError, "only supports layer_first", id="dsa-sharded-pfd-direct"),
    case(_dsv4_unaligned_on_aligned_only, "cuda_staged", ValueError, "expects page-aligned indices", id="dsv4-unaligned-on-page_aligned_only"),
]


@pytest.mark.parametrize("fn,path,exc,message", REJECTED)
def test_sglang_rejects(fn, path, exc, message):
    """Combinations sglang 0.5.23 itself refuses (the same on a GPU): its own exception and
    message, and no hicache-io function was reached."""
    with cpu_shims.sglang_paths(**PATHS[path]), Spy() as spy:
        with pytest.raises(exc) as info:
            fn()
    assert message in str(info.value)
    assert spy.take() == []
