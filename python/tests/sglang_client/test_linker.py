"""hicache-io's direct L3 linker under sglang 0.5.23's own ``UnifiedRadixCache``: the tree is built
by sglang's factory from the ``dynamic`` linker configuration, offloads what it inserts, and
restores evicted prefixes through ``lookup`` / ``load`` / the layer-wise copy, every byte
compared with what was computed. A damaged object fails only its request's load, before any
byte reaches the device (sglang computes that request); another process reads what this one
stored; another namespace never reads it; Mooncake Store works as the local directory does."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from ._env import sglang_problem

if sglang_problem() is not None:
    pytest.skip(sglang_problem(), allow_module_level=True)

from common import child_env, held_at  # noqa: E402

import torch  # noqa: E402

from .harness import as_bytes  # noqa: E402
from .linker_tree import LinkedTree  # noqa: E402

TOKENS = list(range(100, 112))  # three pages of sgl_pools.P = 4 tokens
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# (kind, pool shape): small pages (the local store packs them) and 96 KiB MHA pages (files).
SHAPES = {"mha": ("mha", {}), "mla": ("mla", {}), "mha-files": ("mha", {"layers": 6, "head_num": 8, "head_dim": 128})}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_factory_builds_the_linker_and_the_tree_restores_every_byte(local, shape):
    from hicache_io.l3 import local as local_store
    from hicache_io.sglang_linker import HicacheLinker

    kind, pool = SHAPES[shape]
    tree = local(kind=kind, **pool)
    assert (tree.linker.pages.obj_bytes > local_store._native.PACK_OBJECT_MAX) == (shape == "mha-files")
    assert type(tree.linker) is HicacheLinker
    assert tree.dev.layer_transfer_counter is tree.linker.layer_done_counter
    slots = tree.compute(TOKENS)
    computed = tree.rows(slots)
    assert tree.linker.stats["stored"] == 3
    tree.evict(slots)
    n, restored, aborted = tree.restore("r1", TOKENS)
    assert (n, aborted) == (len(TOKENS), [])
    assert np.array_equal(tree.rows(restored), computed)
    assert tree.linker.stats["verified"] == 3
    # The request inserts what it loaded: the tree offloads it again, and nothing is rewritten.
    tree.compute(TOKENS, seed=1)
    assert tree.linker.stats["stored"] == 3


def test_damaged_object_fails_only_its_request_and_no_byte_lands(local):
    tree = local()
    slots = tree.compute(TOKENS)
    computed = tree.rows(slots)
    tree.evict(slots)
    _flip(tree.linker.client, tree.linker.object_keys(_hashes(TOKENS))[2])
    n, restored, aborted = tree.restore("r1", TOKENS)
    assert (n, restored, aborted) == (0, None, [])  # load refused: sglang computes the request
    assert tree.linker.stats["corrupt"] == 1
    # The damaged page is gone; the pages before it still restore exactly.
    n, restored, aborted = tree.restore("r2", TOKENS)
    assert (n, aborted) == (8, [])
    assert np.array_equal(tree.rows(restored), computed[:, :8])


def _flip(client, key: str, byte: int = 100) -> None:
    """Flips a bit of byte ``byte`` of object ``key`` where the local store holds it."""
    path, at = held_at(client, key)
    with open(path, "r+b") as f:
        f.seek(at + byte)
        b = f.read(1)
        f.seek(at + byte)
        f.write(bytes([b[0] ^ 0x40]))


def _hashes(tokens):
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(tokens, None, page_size=4)


def test_another_process_restores_what_this_one_stored(local, tmp_path):
    tree = local()
    slots = tree.compute(TOKENS)
    np.save(tmp_path / "expected.npy", tree.rows(slots))
    out = subprocess.run(
        [sys.executable, "-m", "sglang_client.linker_tree", str(tmp_path / "l3"), ",".join(map(str, TOKENS)), str(tmp_path / "expected.npy")],
        cwd=HERE,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.stdout.strip().endswith("EQUAL"), out.stdout + out.stderr


def test_another_namespace_or_shape_never_reads_the_pages(local):
    tree = local()
    slots = tree.compute(TOKENS)
    other = local(extra={"namespace": "another-deployment"})
    assert other.restore("r1", TOKENS)[0] == 0
    # Pages of the same size that mean something else: twice the layers of half the heads.
    other_shape = local(layers=6, head_num=1)
    assert other_shape.linker.pages.obj_bytes == tree.linker.pages.obj_bytes
    assert other_shape.restore("r2", TOKENS)[0] == 0
    tree.evict(slots)
    assert tree.restore("r3", TOKENS)[0] == len(TOKENS)


@pytest.mark.parametrize("kind", ["mha", "swa"])
def test_mooncake_store_round_trip(master, kind):
    from .linker_tree import WINDOW

    extra = {"store": "mooncake", "master_server_address": master.address, "protocol": "tcp", "metadata_server": "P2PHANDSHAKE", "local_hostname": "127.0.0.1", "global_segment_size": 16 << 20, "local_buffer_size": 4 << 20, "namespace": f"mc-linker-{kind}"}
    tree = LinkedTree(extra, kind=kind, layers=4)
    try:
        slots = tree.compute(TOKENS)
        computed, window = tree.rows(slots), tree.swa_rows(slots) if kind == "swa" else None
        tree.evict(slots)
        n, restored, aborted = tree.restore("r1", TOKENS)
        assert (n, aborted) == (len(TOKENS), [])
        assert np.array_equal(tree.rows(restored), computed)
        assert window is None or np.array_equal(tree.swa_rows(restored[-WINDOW:]), window[:, -WINDOW:])
    finally:
        tree.close()


def test_refused_calls_move_no_byte(local):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    tree = local()
    slots = tree.compute(TOKENS)
    keys = _hashes(TOKENS)
    before = [b.clone() for b in tree.buffers]
    lk = tree.linker
    for idx in (slots[:-1], slots + 10_000, slots - 10_000):  # a slot short, past the pool, negative
        assert lk.load("r", [PoolTransfer(name=PoolName.KV, device_indices=idx, keys=keys)]) is False
        assert lk.offload([PoolTransfer(name=PoolName.KV, device_indices=idx, keys=keys)]) is False
    assert lk.start_layer_wise_loading() == -1 and lk.num_completed_offloads() == 0
    assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(before, tree.buffers))
    assert lk.stats["stored"] == 3


def test_keys_name_the_model_and_staging_is_given_back(local):
    import types

    from hicache_io.linker_objects import _key_tail

    tree = local()
    args = dict(model_path="m", served_model_name="llm", revision=None, quantization=None, json_model_override_args="{}", kv_cache_dtype="auto")
    tails = {_key_tail(tree.linker.pages, types.SimpleNamespace(**{**args, **change}), "tp0_cp0_pp0", 1) for change in ({}, {"model_path": "other"}, {"revision": "v2"}, {"quantization": "fp8"})}
    assert len(tails) == 4  # two models served under one name never share pages
    slots = tree.compute(TOKENS)
    tree.evict(slots)
    assert tree.restore("r1", TOKENS)[0] == len(TOKENS)
    assert tree.linker._staged_bytes == 0  # given back by the time the batch finished
    # A load cancelled before its batch starts gives its staging back too, and moves nothing.
    lk = tree.linker
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    assert lk.load("r2", [PoolTransfer(name=PoolName.KV, device_indices=slots, keys=_hashes(TOKENS))])
    assert lk._staged_bytes > 0 and lk.cancel_queued_load("r2") and lk._staged_bytes == 0
    assert lk.start_layer_wise_loading() == -1
    # Staging buffers are registered once and reused: another load registers nothing new.
    regions = dict(lk.client._regions)
    assert lk.load("r3", [PoolTransfer(name=PoolName.KV, device_indices=slots, keys=_hashes(TOKENS))]) and lk.cancel_queued_load("r3")
    assert lk.client._regions == regions


def test_pools_the_objects_cannot_hold_are_refused():
    import types

    from hicache_io.sglang_linker import LinkerPages

    from . import sgl_pools as sp

    for pool in (sp.dsa_device(), types.SimpleNamespace(k_buffer=[], v_buffer=[])):
        with pytest.raises(ValueError, match="plain MHA and MLA"):
            LinkerPages(pool, sp.P)


def _two_ranks(tmp_path, mode: str) -> list:
    """Runs ``linker_tree``'s two ranks (``--rank`` or ``--unified``), processes in a gloo group,
    on the store in ``tmp_path / "l3"``; their output files."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outs = [str(tmp_path / f"rank{r}.out") for r in (0, 1)]
    cmd = lambda r: [sys.executable, "-m", "sglang_client.linker_tree", mode, str(r), str(port), str(tmp_path / "l3"), outs[r]]  # noqa: E731
    procs = [subprocess.Popen(cmd(r), cwd=HERE, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return outs


def test_two_ranks_agree_on_a_load_one_of_them_refuses(tmp_path):
    """Two tensor-parallel ranks (processes, a gloo group): each restores its own heads' pages;
    when rank 1's page is damaged, both refuse the load, so that both run the same batch."""
    import json

    got = [json.loads(open(o).read()) for o in _two_ranks(tmp_path, "--rank")]
    assert [g["first"] for g in got] == [[len(TOKENS), True]] * 2
    assert [g["second"] for g in got] == [0, 0]  # rank 0's pages were intact: it refused with rank 1


def test_unified_keys_share_pages_between_tp_shapes(local, tmp_path):
    """Unified keys name the model's heads, not the rank: two tp ranks (two of four kv heads
    each, processes) each restore their heads of a prefix that one rank of all four heads
    stored, and that rank restores a prefix the two stored, assembled from both ranks'
    objects, byte for byte; without one rank's object of a page, the prefix stops before it."""
    from . import sgl_pools as sp
    from .linker_tree import UNIFIED_A, UNIFIED_B

    one = local(extra={"key_scheme": "unified", "kv_heads": 4}, head_num=4)
    slots = one.compute(UNIFIED_A)
    a = one.rows(slots)
    one.evict(slots)
    outs = _two_ranks(tmp_path, "--unified")
    half = a.shape[-1] // 2
    for r, out in enumerate(outs):
        assert np.array_equal(np.load(out + ".a.npy"), a[..., r * half : (r + 1) * half])
    n, got, aborted = one.restore("b", UNIFIED_B)
    assert (n, aborted) == (len(UNIFIED_B), [])
    assert np.array_equal(one.rows(got), np.concatenate([np.load(o + ".b.npy") for o in outs], axis=-1))
    keys = one.linker.object_keys(_hashes(UNIFIED_B))
    assert [k[-3:] for k in keys[:4]] == ["_H0", "_H1", "_H2", "_H3"]
    one.linker.client.remove(keys[2 * 4 + 3])  # rank 1's second head of the third page
    assert local(extra={"key_scheme": "unified", "kv_heads": 4}, head_num=4).restore("b2", UNIFIED_B)[0] == 2 * sp.P


def test_unified_keys_head_groups_and_refusals(local):
    """Groups of two heads: a page of four heads is two objects, restored byte for byte; a
    reader of groups of one asks for other keys (misses). Unified keys refuse a pool whose
    heads are not the model's kv heads over the tp ranks, or a group that does not divide them."""
    two = local(extra={"key_scheme": "unified", "kv_heads": 4, "head_group": 2}, head_num=4)
    slots = two.compute(TOKENS)
    computed = two.rows(slots)
    two.evict(slots)
    assert [k[-3:] for k in two.linker.object_keys(["h"])] == ["_H0", "_H1"]
    assert local(extra={"key_scheme": "unified", "kv_heads": 4}, head_num=4).restore("g1", TOKENS)[0] == 0
    n, got, aborted = two.restore("g2", TOKENS)
    assert (n, aborted) == (len(TOKENS), []) and np.array_equal(two.rows(got), computed)
    for extra, match in (({"key_scheme": "unified"}, "need kv_heads"), ({"key_scheme": "unified", "kv_heads": 8}, "split over the 1 tp rank"), ({"key_scheme": "unified", "kv_heads": 4, "head_group": 3}, "does not divide"), ({"key_scheme": "tp"}, "key_scheme must be")):
        with pytest.raises(Exception, match=match):
            local(extra=extra, head_num=4)


def test_sliding_window_model_restores_its_full_pages_and_the_window(local):
    """A sliding-window model (sglang's SWAKVPool: full-attention and window layers in two
    pools): both pools' pages are stored, each under keys of its own; a restore brings every
    full layer's rows back and the window layers' rows of the window's last page, byte for
    byte, each layer reported in the model's order."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from .linker_tree import WINDOW

    tree = local(kind="swa", layers=4)
    assert set(tree.linker.pools) == {PoolName.KV, PoolName.SWA}
    assert [sorted(tree.linker.objects[p].local) for p in (PoolName.KV, PoolName.SWA)] == [[0, 2], [1, 3]]
    slots = tree.compute(TOKENS)
    full, window = tree.rows(slots), tree.swa_rows(slots)
    assert tree.linker.stats["stored"] == 2 * len(TOKENS) // 4  # every page of both pools
    tree.evict(slots)
    counter, reported = tree.linker.layer_done_counter, []
    complete = counter.complete
    counter.complete = lambda index, layer: (reported.append(layer), complete(index, layer))
    n, got, aborted = tree.restore("r", TOKENS)
    assert (n, aborted) == (len(TOKENS), []) and reported == [0, 1, 2, 3]
    assert np.array_equal(tree.rows(got), full) and np.array_equal(tree.swa_rows(got[-WINDOW:]), window[:, -WINDOW:])
    assert tree.linker.stats["loaded"] == len(TOKENS) // 4 + WINDOW // 4
    keys = [tree.linker.objects[p].keys(_hashes(TOKENS)[:1])[0] for p in (PoolName.KV, PoolName.SWA)]
    assert "-full-" in keys[0] and "-swa-" in keys[1]


def test_sliding_window_lookups_have_gaps_and_a_damaged_window_fails_the_load(local):
    """Where a page's window object is gone, the prefixes ending on that page do not restore,
    but longer ones whose windows are whole do (sglang takes the longest): the lookup answers
    with a gap. A damaged window object fails the load (sglang computes the request)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    from .linker_tree import WINDOW

    tree = local(kind="swa", layers=4)
    slots = tree.compute(TOKENS)
    full, window = tree.rows(slots), tree.swa_rows(slots)
    hashes = _hashes(TOKENS)
    swa_keys = tree.linker.objects[PoolName.SWA].keys(hashes)
    tree.linker.client.remove(swa_keys[1])
    ask = lambda w: tree.linker.lookup("q", [PoolTransfer(name=PoolName.KV, keys=hashes), PoolTransfer(name=PoolName.SWA, keys=hashes[-w:])])  # noqa: E731
    assert (ask(1), ask(2)) == ([1, 3], [1])  # a window of two pages needs pages p-2 and p-1
    fresh = local(kind="swa", layers=4)
    n, got, aborted = fresh.restore("a", TOKENS)
    assert (n, aborted) == (len(TOKENS), []) and np.array_equal(fresh.rows(got), full)
    assert np.array_equal(fresh.swa_rows(got[-WINDOW:]), window[:, -WINDOW:])
    tree.linker.client.remove(swa_keys[2])
    fresh = local(kind="swa", layers=4)
    n, got, aborted = fresh.restore("b", TOKENS)
    assert (n, aborted) == (4, []) and np.array_equal(fresh.rows(got), full[:, :4]) and np.array_equal(fresh.swa_rows(got), window[:, :4])
    _flip(tree.linker.client, swa_keys[0])
    fresh = local(kind="swa", layers=4)
    before = [as_bytes(b).clone() for b in fresh.buffers + fresh.swa_buffers]
    assert fresh.restore("c", TOKENS) == (0, None, []) and fresh.linker.stats["corrupt"] == 1
    assert all(torch.equal(as_bytes(b), was) for b, was in zip(fresh.buffers + fresh.swa_buffers, before))


def test_sliding_window_refused_calls_move_no_byte_and_staging_counts_the_window(local):
    """A call whose window transfer does not fit (slots outside its pool, the padding slot,
    pages that are not the KV pages' last, no KV pages) is refused whole, before any byte moves,
    nothing staged; a prefix whose full pages and window do not fit the staging memory together
    is not offered."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    tree = local(kind="swa", layers=4)
    slots = tree.compute(TOKENS)
    hashes, lk = _hashes(TOKENS), tree.linker
    at = tree.alloc.translate_loc_from_full_to_swa(slots)
    bad = {"outside": (hashes[-1:], torch.full((4,), 10_000)), "padding": (hashes[-1:], torch.zeros(4, dtype=torch.int64)), "not last": (hashes[:1], at[:4]), "longer": (hashes + hashes[:1], torch.cat([at, at[:4]]))}
    before = [as_bytes(b).clone() for b in tree.buffers + tree.swa_buffers]
    for name, (keys, window) in bad.items():
        call = [PoolTransfer(name=PoolName.KV, device_indices=slots, keys=hashes), PoolTransfer(name=PoolName.SWA, device_indices=window, keys=keys)]
        assert lk.load(name, call) is False and lk.offload(call) is False, name
    assert lk.load("swa only", [PoolTransfer(name=PoolName.SWA, device_indices=at[-4:], keys=hashes[-1:])]) is False
    assert lk._staged_bytes == 0 and lk.start_layer_wise_loading() == -1 and lk.num_completed_offloads() == 0
    assert all(torch.equal(as_bytes(b), was) for b, was in zip(tree.buffers + tree.swa_buffers, before))
    kv_page, window_page = lk.objects[PoolName.KV].pages.page_bytes, lk.objects[PoolName.SWA].pages.page_bytes
    small = local(kind="swa", layers=4, extra={"staging_bytes": 3 * kv_page + window_page - 1})
    assert small.linker.lookup("q", [PoolTransfer(name=PoolName.KV, keys=hashes), PoolTransfer(name=PoolName.SWA, keys=hashes[-1:])]) == [1, 2]


@pytest.mark.parametrize("kind", ["mha", "swa"])
def test_sglangs_rust_tree_core_and_unified_keys_round_trip_too(local, kind):
    """sglang's rust tree core (a server's default; the others here run its python core) builds
    its transfers natively: pages round-trip the same, with unified keys too, a sliding-window
    model's both pools, and no staging memory left counted."""
    from .linker_tree import WINDOW

    tree = local(kind=kind, layers=4, core="rust", extra={"key_scheme": "unified", "kv_heads": 2})
    assert type(tree.cache.tree_core).__name__ == "RustUnifiedTreeCore"
    slots = tree.compute(TOKENS)
    full, window = tree.rows(slots), tree.swa_rows(slots) if kind == "swa" else None
    tree.evict(slots)
    n, got, aborted = tree.restore("r", TOKENS)
    assert (n, aborted) == (len(TOKENS), []) and np.array_equal(tree.rows(got), full)
    assert window is None or np.array_equal(tree.swa_rows(got[-WINDOW:]), window[:, -WINDOW:])
    assert tree.linker._staged_bytes == 0
    keys = tree.linker.object_keys(["h"])
    assert [k[-3:] for k in keys] == ["_H0", "_H1"] and all(f"-mha-u{'-full' if kind == 'swa' else ''}-" in k for k in keys)
