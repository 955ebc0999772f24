"""hicache-io's linker on a Mamba hybrid under sglang 0.5.23's own FULL + MAMBA tree: a node's
state is stored with its KV pages (under the node's last page), a restore brings both back (the
KV into the request's slots, the state into its Mamba slot, the forward waiting on every layer
in the model's order), a prefix restores only where a state was stored, and a damaged or
missing state fails the request before any byte lands."""

from __future__ import annotations

import numpy as np
import pytest

from ._env import sglang_problem

if sglang_problem() is not None:
    pytest.skip(sglang_problem(), allow_module_level=True)

from common import held_at  # noqa: E402

import torch  # noqa: E402

from .harness import as_bytes  # noqa: E402
from .linker_mamba import WINDOW, MambaTree, equal_states  # noqa: E402

TOKENS = list(range(100, 112))  # three pages of 4 tokens; nodes end at 8 and 12


@pytest.fixture
def tree(local):
    return lambda **kw: local(cls=MambaTree, **kw)


def _stored(t: MambaTree):
    """Two nodes computed (8 tokens, then 12), then evicted: the KV rows the tree held for the
    12 tokens, and the states at 8 and at 12 (``t.window_rows``: the window's last rows)."""
    s8, at8 = t.compute(TOKENS[:8])
    s12, at12 = t.compute(TOKENS, seed=1)
    rows = np.concatenate([t.rows(s8), t.rows(s12)[:, 8:]], axis=1)  # the tree kept the first node's
    t.window_rows = t.swa_rows(s12[-WINDOW:]) if t.swa_buffers else None
    t.evict(s12)
    return rows, at8, at12


def _state_key(t: MambaTree, tokens: list) -> str:
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang.srt.mem_cache.hicache_storage import PoolName

    return t.linker.objects[PoolName.MAMBA].keys(get_storage_hash_str(tokens, None, page_size=4)[-1:])[0]


@pytest.mark.parametrize("kind,state", [("mha", "small"), ("mla", "small"), ("mha", "large"), ("swa", "small")])
def test_state_and_pages_restore_every_byte(tree, kind, state):
    t = tree(kind=kind, state=state)
    assert t.rtp.layer_transfer_counter is t.linker.layer_done_counter  # Mamba layers wait too
    rows, _, at12 = _stored(t)
    assert t.linker.stats["stored"] == 3 + 2 + (3 if kind == "swa" else 0)  # pages, states, window pages
    done, landed = [], {}
    complete = t.linker.layer_done_counter.complete

    def completing(i, layer):  # what the forward may read once this layer is reported
        if layer in t.mamba:
            landed[layer] = [as_bytes(b[t.rtp.mamba_map[layer]]).clone().numpy() for b in t.states]
        done.append(layer)
        complete(i, layer)

    t.linker.layer_done_counter.complete = completing
    n, slots, got, aborted = t.restore("r1", TOKENS)
    assert (n, aborted) == (len(TOKENS), [])
    assert np.array_equal(t.rows(slots), rows) and equal_states(got, at12)
    assert t.window_rows is None or np.array_equal(t.swa_rows(slots[-WINDOW:]), t.window_rows)
    assert done == sorted(t.full + t.window + t.mamba)
    # Each Mamba layer's state had landed when the layer was reported.
    assert all(equal_states([s[t.slot : t.slot + 1] for s in landed[g]], [b[i] for b in at12]) for i, g in enumerate(t.mamba))
    assert t.linker._staged_bytes == 0


def test_prefix_restores_where_a_state_was_stored(tree):
    t = tree()
    rows, at8, _ = _stored(t)
    t.linker.client.remove(_state_key(t, TOKENS))  # the state at 12 gone: the node at 8 remains
    n, slots, got, aborted = t.restore("r1", TOKENS)
    assert (n, aborted) == (8, [])
    assert np.array_equal(t.rows(slots), rows[:, :8]) and equal_states(got, at8)


def test_damaged_state_fails_the_load_and_no_byte_lands(tree):
    t = tree()
    _stored(t)
    path, at = held_at(t.linker.client, _state_key(t, TOKENS))
    with open(path, "r+b") as f:
        f.seek(at + 5)
        b = f.read(1)
        f.seek(at + 5)
        f.write(bytes([b[0] ^ 1]))
    before = [as_bytes(b).clone() for b in t.buffers + t.states]
    assert t.restore("r1", TOKENS)[0] == 0
    assert all(torch.equal(a, as_bytes(b)) for a, b in zip(before, t.buffers + t.states))
    assert t.linker.stats["corrupt"] == 1
    assert t.restore("r2", TOKENS)[0] == 8  # the damaged state removed; the node at 8 restores


def test_refused_state_transfers_move_no_byte(tree):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    t = tree()
    t.compute(TOKENS[:8])
    slots, _ = t.compute(TOKENS, seed=1)  # states stored at pages 2 and 3
    keys = get_storage_hash_str(TOKENS, None, page_size=4)
    kv, lk = PoolTransfer(name=PoolName.KV, device_indices=slots, keys=keys), t.linker
    before = [as_bytes(b).clone() for b in t.buffers + t.states]
    state = lambda idx, k=keys[-1:]: PoolTransfer(name=PoolName.MAMBA, device_indices=torch.tensor(idx), keys=k)  # noqa: E731
    for transfers in ([kv], [kv, state([0])], [kv, state([9])], [kv, state([1, 2], keys[1:])], [kv, state([1], keys[1:2])]):
        assert lk.load("r", transfers) is False  # no state, the padding slot, past the pool, two, not the last page's
    assert lk.offload([kv, state([0])]) is False
    assert lk.start_layer_wise_loading() == -1 and lk._staged_bytes == 0
    assert all(torch.equal(a, as_bytes(b)) for a, b in zip(before, t.buffers + t.states))


def test_state_pools_the_objects_cannot_hold_are_refused(tree):
    import types

    from hicache_io.linker_objects import StatePages

    t = tree()
    virtual = {"translate_mamba_indices": lambda self, ids: ids + 1}  # as unified memory's pool
    for change, methods, what in (({"mamba_ckpt_pool": object()}, {}, "int8 Mamba checkpoint"), ({"short_conv_pool": types.SimpleNamespace(enabled=True)}, {}, "short-conv"), ({}, virtual, "virtual Mamba slot ids")):
        fake = type("Pool", (type(t.rtp),), methods)
        pool = fake.__new__(fake)
        pool.__dict__.update({**t.rtp.__dict__, **change})
        with pytest.raises(ValueError, match=what):
            StatePages(pool)
    with pytest.raises(ValueError, match="HybridReqToTokenPool"):
        StatePages(types.SimpleNamespace())
    # A hybrid pool holding more than attention pages (Qwen4-Exp's indexer keys) is not plain.
    from hicache_io.linker_objects import LinkerPages, device_pools

    qsa = type("QSATokenToKVPool", (type(t.dev),), {})
    pool = qsa.__new__(qsa)
    pool.__dict__.update(t.dev.__dict__)
    (_, kv), = device_pools(pool)
    with pytest.raises(ValueError, match="plain MHA and MLA"):
        LinkerPages(kv, 4)


@pytest.mark.parametrize("where", ["rust-core", "mooncake"])
def test_rust_tree_core_and_mooncake_round_trip(request, tree, where):
    """sglang's rust tree core (a server's default) builds the state's transfers natively;
    Mooncake Store (on a master the test starts) holds the state as the local store does."""
    if where == "mooncake":
        master = request.getfixturevalue("master")
        extra = {"store": "mooncake", "master_server_address": master.address, "protocol": "tcp", "metadata_server": "P2PHANDSHAKE", "local_hostname": "127.0.0.1", "global_segment_size": 16 << 20, "local_buffer_size": 4 << 20, "namespace": "mc-linker-mamba"}
        t = tree(extra=extra)
    else:
        t = tree(core="rust")
    rows, _, at12 = _stored(t)
    n, slots, got, aborted = t.restore("r1", TOKENS)
    assert (n, aborted) == (len(TOKENS), [])
    assert np.array_equal(t.rows(slots), rows) and equal_states(got, at12)


def test_large_state_rows_move_in_pieces(tree):
    """A GPU's copy op moves an item per warp: rows over 64 KiB move as equal pieces."""
    from hicache_io.linker_objects import _pieces
    from sglang.srt.mem_cache.hicache_storage import PoolName

    assert [_pieces(n) for n in (2 << 20, 128 << 10, 48 << 10, 352, 16 * 65537)] == [32, 2, 1, 1, 1]
    t = tree(state="large")
    assert t.linker.objects[PoolName.MAMBA].pages.pieces == [2, 2, 1, 1]  # temporal of two layers, conv
