"""sglang 0.5.23's storage v2 with hicache-io's Mooncake store, against a real ``mooncake_master``
on loopback: hybrid host pool groups built from sglang's own pool classes — KV + Mamba states
(``MambaPoolHost``), KV + DSA indexer (``DSAIndexerPoolHost``) + a draft pool — registered as
sglang's controller registers them, then ``batch_set_v2`` / ``batch_exists_v2`` (both hit
policies) / ``batch_get_v2`` with sglang's ``PoolTransfer`` objects. Every byte is compared; a
damaged object fails its page; ``BLOCK_GROUPS`` and unknown pools are refused.

Skips without Mooncake unless HICACHE_REQUIRE_MOONCAKE=1."""

from ._env import require_mooncake, require_sglang

require_sglang()
require_mooncake()

import uuid  # noqa: E402

import numpy as np  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from . import cpu_shims  # noqa: E402
from . import sgl_pools as sp  # noqa: E402
from .harness import check_equal, fill_random, snapshot  # noqa: E402
from .test_storage import dynamic_extra_config, storage_at, storage_config  # noqa: E402


def mamba_host(layers=2, slots=9):
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, 4, 16),
        conv=(torch.zeros(layers, slots, 3, 16, dtype=torch.bfloat16), torch.zeros(layers, slots, 2, 8, dtype=torch.bfloat16)),
    )
    return MambaPoolHost(info, 2.0, 0, device_capacity=slots - 1, layout="page_first", pin_memory=True)


def group_store(at, kv, sidecars, *, is_mla):
    """A store from sglang's factory (``dynamic``), the pools registered in the controller's order:
    the anchor, every entry through v2 (KV included), then ``on_host_pools_registered``."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    cfg = storage_config(kv, is_mla=is_mla, extra=dynamic_extra_config(*at), model=f"sglang-client/v2-{uuid.uuid4().hex[:8]}")
    store = StorageBackendFactory.create_backend("dynamic", cfg, kv)
    store.register_mem_pool_host(kv)
    store.register_mem_host_pool_v2(kv, PoolName.KV)
    for name, pool in sidecars.items():
        store.register_mem_host_pool_v2(pool, name)
    store.on_host_pools_registered()
    return store


def objects(pool, idx):
    """The bytes of each page object ``pool.get_page_buffer_meta(idx)`` names."""
    import ctypes

    ptrs, sizes = pool.get_page_buffer_meta(idx)
    return [bytes((ctypes.c_uint8 * int(n)).from_address(int(p))) for p, n in zip(ptrs, sizes)]


def mamba_slots(host, slots):
    return [t[slots] for t in (host.temporal_buffer, *host.conv_buffer)]


@pytest.mark.parametrize("transport", ["mooncake", "local"])
def test_kv_and_mamba_states_round_trip(transport, request, tmp_path):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolHitPolicy, PoolName, PoolTransfer

    from hicache_io import _native
    from hicache_io.l3.trailer import TRAILER_MAGIC
    from hicache_io.l3.trailer import name_tag as _name_tag
    from hicache_io.storage import INTEGRITY

    g = sp.gen(sp.seed_of("v2", "mamba"))
    with cpu_shims.sglang_paths(cuda=True):
        kv = sp.mha_host(sp.mha_device(), "page_first")
    mamba = mamba_host()
    store = group_store(storage_at(transport, request, tmp_path), kv, {PoolName.MAMBA: mamba}, is_mla=False)
    try:
        fill_random([kv.kv_buffer, mamba.temporal_buffer, *mamba.conv_buffer], g)
        kv_before = snapshot([kv.kv_buffer])[0]
        m_before = snapshot([mamba.temporal_buffer, *mamba.conv_buffer])
        P = kv.page_size
        keys = [uuid.uuid4().hex for _ in range(3)]
        kv_idx = kv.alloc(3 * P)
        slots = torch.tensor([5, 2, 7], dtype=torch.int64)
        mt = lambda ks, s, policy=PoolHitPolicy.ALL_PAGES: PoolTransfer(name=PoolName.MAMBA, host_indices=s, keys=ks, hit_policy=policy)  # noqa: E731

        assert store.batch_exists_v2(keys, [mt(keys, slots)]).kv_hit_pages == 0
        assert store.batch_set_v1(keys, kv_idx) == [True] * 3, store.last_error
        r = store.batch_exists_v2(keys, [mt(keys, slots)])
        assert (r.kv_hit_pages, r.restorable_prefix_pages) == (0, []), "KV pages without their Mamba states were restorable"
        info = HiCacheStorageExtraInfo(extra_info={"session_id": "session-1"})
        assert store.batch_set_v2([mt(keys, slots)], info) == {"mamba": [True] * 3}, store.last_error
        r = store.batch_exists_v2(keys, [mt(keys, slots)])
        assert (r.kv_hit_pages, r.extra_pool_hit_pages, r.restorable_prefix_pages) == (3, {PoolName.KV: 3, PoolName.MAMBA: 3}, [1, 2, 3])
        assert store.batch_set_v2([mt(keys, slots)]) == {"mamba": [True] * 3}  # already there: written

        # Trailing pages: a chain whose Mamba state exists only for its last page.
        chain = [uuid.uuid4().hex for _ in range(3)]
        assert store.batch_set_v1(chain, kv.alloc(3 * P)) == [True] * 3
        assert store.batch_set_v2([mt(chain[2:], slots[:1])]) == {"mamba": [True]}
        r = store.batch_exists_v2(chain, [mt(chain[2:], slots[:1], PoolHitPolicy.TRAILING_PAGES)])
        assert (r.kv_hit_pages, r.restorable_prefix_pages) == (3, [3])
        assert store.batch_exists_v2(chain, [mt(chain, slots, PoolHitPolicy.ALL_PAGES)]).kv_hit_pages == 0
        with pytest.raises(ValueError, match="block_groups"):
            store.batch_exists_v2(chain, [mt(chain, slots, PoolHitPolicy.BLOCK_GROUPS)])

        # Wipe, read back in place: the KV pages through v1, the states through v2.
        kv.kv_buffer[:, kv_idx] = 0
        for t in (mamba.temporal_buffer, *mamba.conv_buffer):
            t[slots] = 0
        got = store.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=kv_idx, keys=keys), mt(keys, slots)])
        assert got == {"kv": [True] * 3, "mamba": [True] * 3}, store.last_error
        check_equal("v2 KV", kv.kv_buffer, kv_before)
        for n, (a, b) in enumerate(zip(snapshot([mamba.temporal_buffer, *mamba.conv_buffer]), m_before)):
            check_equal(f"v2 mamba state {n}", a, b)

        # Into other slots, in another order: only those slots change.
        other = torch.tensor([1, 8, 3], dtype=torch.int64)
        assert store.batch_get_v2([mt([keys[2], keys[0], keys[1]], other)]) == {"mamba": [True] * 3}
        for now, then in zip(mamba_slots(mamba, other), [t[torch.tensor([7, 5, 2])] for t in m_before]):
            assert torch.equal(now.view(torch.uint8), then.view(torch.uint8))

        # Damaged objects fail their page (and only it): page 1's objects replayed under another
        # page's keys (their trailers bind them to their own keys), and one with a bit flipped.
        replayed, flipped = uuid.uuid4().hex, uuid.uuid4().hex
        for src, dst in zip(store.v2_object_keys("mamba", [keys[1]]), store.v2_object_keys("mamba", [replayed])):
            assert store.store.put(dst, bytes(store.store.get(src))) == 0
        for n, (src, dst) in enumerate(zip(store.v2_object_keys("mamba", [keys[1]]), store.v2_object_keys("mamba", [flipped]))):
            body = bytearray(store.store.get(src))[:-16]
            trailer = np.array([TRAILER_MAGIC, _native.checksum(np.frombuffer(bytes(body), np.uint8)) ^ _name_tag(dst)], "<u8").tobytes()
            if n == 0:
                body[3] ^= 0x10  # the trailer is right for the key: only the bytes are wrong
            assert store.store.put(dst, bytes(body) + trailer) == 0
        per = 1 + len(mamba.conv_buffer)
        corrupt = store.stats["corrupt"]
        assert store.batch_get_v2([mt([keys[0], replayed, flipped], slots)]) == {"mamba": [True, False, False]}
        assert store.stats["corrupt"] == corrupt + per + 1 and store.last_error.code == INTEGRITY
        assert store.batch_get_v2([mt(["absent"], slots[:1])]) == {"mamba": [False]}
        with pytest.raises(ValueError, match="Unregistered"):
            store.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=slots, keys=keys)])
        # Bad indices: refused before any byte moves.
        image = snapshot([mamba.temporal_buffer])[0]
        assert store.batch_get_v2([mt(keys, torch.tensor([0, 1, 10_000]))]) == {"mamba": [False] * 3}
        check_equal("refused get", mamba.temporal_buffer, image)
        # Keys: the pool, this rank and the namespace in every name; none of sglang's.
        name = store.v2_object_keys("mamba", [keys[1]])[0]
        assert "_0_hio2-mamba-n" in name and name.startswith(store.key_prefix)
    finally:
        store.close()


@pytest.mark.parametrize("transport", ["mooncake", "local"])
def test_kv_indexer_and_draft_round_trip(transport, request, tmp_path):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl

    g = sp.gen(sp.seed_of("v2", "dsa"))
    with cpu_shims.sglang_paths(cuda=True):
        dev = sp.dsa_device()
        kv = sp.mla_host(dev, "page_first", page_size=sp.PD)
        indexer = DSAIndexerPoolHost(decl=make_dsa_indexer_pool_decl(dev), anchor_host=kv, packed_draft_device_pools=(), pin_memory=True, device="cpu", allocator_type="default")
        draft = sp.mla_host(sp.dsa_device(layer_num=1), "page_first", page_size=sp.PD)
    store = group_store(storage_at(transport, request, tmp_path), kv, {PoolName.INDEXER: indexer, PoolName.DRAFT: draft}, is_mla=True)
    try:
        bufs = [kv.kv_buffer, *indexer.get_hybrid_pool_buffer(), draft.kv_buffer]
        fill_random(bufs, g)
        before = snapshot(bufs)
        P = kv.page_size
        keys = [uuid.uuid4().hex for _ in range(2)]
        idx = kv.alloc(2 * P)
        transfers = [PoolTransfer(name=n, host_indices=idx, keys=keys) for n in (PoolName.INDEXER, PoolName.DRAFT)]
        assert store.batch_set_v1(keys, idx) == [True] * 2, store.last_error
        assert store.batch_set_v2(transfers) == {"indexer": [True] * 2, "draft": [True] * 2}, store.last_error
        assert store.batch_exists_v2(keys, transfers).kv_hit_pages == 2
        pages = {name: objects(pool, idx) for name, pool in (("kv", kv), ("indexer", indexer), ("draft", draft))}
        for b in bufs:
            b.zero_()
        got = store.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=idx, keys=keys), *transfers])
        assert got == {"kv": [True] * 2, "indexer": [True] * 2, "draft": [True] * 2}, store.last_error
        for name, pool in (("kv", kv), ("indexer", indexer), ("draft", draft)):
            assert objects(pool, idx) == pages[name], f"{name}: the pages read back differ"
        moved = sum(len(o) for v in pages.values() for o in v)
        assert sum(int(torch.count_nonzero(b.view(torch.uint8))) for b in bufs) <= moved, "bytes outside the pages changed"
        del before
        # An MLA model's indexer and MLA draft are rank-replicated: their names carry no rank.
        assert all("_h__hio2-" in store.v2_object_keys(n, ["h"])[0] for n in ("indexer", "draft"))
    finally:
        store.close()
