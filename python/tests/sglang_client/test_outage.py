"""sglang 0.5.23's HybridCacheController (its backup thread, its prefetch thread and its prefetch
IO thread, sglang's own code) with hicache-io's MooncakeStore as the L3 backend, through an outage
of the Mooncake master: a ``mooncake_master`` of the test's own on loopback is killed mid-session
and restarted on the same port, the controller and the store left as they are.

What the caller (sglang's scheduler) sees:

- before: write -> write_storage -> backup thread -> pages stored; a prefetch of them hits and
  restores the exact bytes;
- master down: a write_storage is acked with no token completed (each Mooncake call fails with
  RPC_FAIL at once or after its ~4.3 s RPC timeout; the bound here is 60 s) and the backup thread
  lives on (sglang warns "Write page to storage: 2 pages failed."); a prefetch of the pages stored
  before is a miss at the hit query, and one that skips the query (``assume_stored``) fetches
  nothing and leaves the host pool alone; no exception reaches sglang's threads, nothing is
  logged as an error; L1 <-> L2 (write D2H, load H2D layer by layer) moves exact bytes all along;
  ``integrity_stats()`` counts ``unreachable`` objects (more with each call) and one outage, and
  one WARNING says the store is unreachable;
- master back (empty: its metadata was in memory): the same store reconnects by itself; a
  write_storage polled until it completes (bound 60 s; measured ~2 s), then a prefetch of those
  pages restores exact bytes, the pages stored before the outage read as misses (never as other
  bytes), and a WARNING says the store answers again (a second short outage while the client
  remounts its segment is allowed for).

The prefetch is driven for real: ``ctrl.prefetch`` -> the prefetch thread's hit query ->
``prefetch_hit_queue``; the test then does the scheduler's part (UnifiedRadixCache's drain: a hit
below the threshold is revoked, else ``allocate_storage_hit`` and ``prefetch_buffer``) -> the IO
thread's page gets -> PrefetchAcks on ``ack_prefetch_queue`` up to ``completed_req``. One stand-in:
the hit query's page keys come from sglang's native hash, a C++ extension it compiles on first use
(with ninja, absent here); the test puts a Python port of its page chain (sha256 over the previous
page's digest and the page's token ids as little-endian u32) in its place.

Skips without Mooncake unless HICACHE_REQUIRE_MOONCAKE=1."""

from ._env import require_mooncake, require_sglang

require_sglang()
require_mooncake()

import hashlib  # noqa: E402
import logging  # noqa: E402
import queue  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402

import numpy as np  # noqa: E402

from . import cpu_shims  # noqa: E402
from . import sgl_pools as sp  # noqa: E402
from .harness import check_equal, fill_random, snapshot  # noqa: E402
from .test_storage import dynamic_extra_config  # noqa: E402

N = 2  # pages per operation
DOWN_BOUND_S = 60  # an operation while the master is down is acked within this (one RPC timeout is ~4.3 s)
RECONNECT_BOUND_S = 60  # a backup completes again within this after the restart (measured: ~1-5 s)
TRANSPORT_LOG = "hicache_io.l3.transport"


def take(q, timeout, what):
    """The next item of sglang queue ``q``, or a failure naming what did not come."""
    try:
        return q.get(timeout=max(timeout, 0.1))
    except queue.Empty:
        raise AssertionError(f"{what}: nothing within {timeout:.0f} s") from None


def transport_warnings(caplog):
    """What hicache-io's L3 transport logged at WARNING or above (the outage's start and end)."""
    return [r.getMessage() for r in caplog.records if r.name.startswith(TRANSPORT_LOG) and r.levelno >= logging.WARNING]


def page_hashes(token_ids, prior_hash=None, page_size=None):
    """sglang's ``get_storage_hash_str`` for plain token ids below 2**32 and no namespace, in
    Python (its native module's page chain, hash_binding.cpp): per page, sha256 of the previous
    page's digest and the page's ids as little-endian u32, as hex."""
    prior = bytes.fromhex(prior_hash) if prior_hash else b""
    out = []
    for at in range(0, len(token_ids), page_size):
        prior = hashlib.sha256(prior + np.asarray(token_ids[at : at + page_size], "<u4").tobytes()).digest()
        out.append(prior.hex())
    return out


def span(base):
    """N pages of token ids and the storage keys of their pages (what the prefetch's hit query
    computes from the tokens)."""
    tokens = list(range(base, base + N * sp.P))
    return tokens, page_hashes(tokens, None, page_size=sp.P)


class Stack:
    """sglang's controller stack (MHA, page_first, kernel io) and the torch reference of its
    host and device bytes."""

    def __init__(self, seed):
        with cpu_shims.sglang_paths(cuda=True), cpu_shims.memory_config(hicache_mem_layout="page_first", hicache_io_backend="kernel"):
            self.dev, _, self.allocator, self.group, self.ctrl = sp.build_controller_stack("mha", "page_first", "kernel")
        self.host = self.group.anchor_entry.host_pool
        self.dev_bufs, self.dev_row, self.host_row, self.comps = sp.controller_views("mha", "page_first", self.host)
        self.g = sp.gen(seed)

    def host_image(self):
        return snapshot([self.host.kv_buffer])[0]

    def write(self, node_id):
        """Fresh random device pages backed up to new host pages by ctrl.write (D2H); the whole
        host pool checked byte for byte. The host indices."""
        fill_random(self.dev_bufs, self.g)
        d0, h0 = snapshot(self.dev_bufs), self.host_image()
        dev_idx = self.allocator.alloc(N * sp.P)
        host_idx = self.ctrl.write(dev_idx, node_id=node_id)
        assert host_idx is not None
        ack = self.ctrl.ack_write_queue.pop()
        assert ack.node_ids == [node_id] and ack.finish_event.query()
        exp = h0.clone()
        exp_t, src_t = [exp.view(self.host.kv_buffer.dtype)], [b.view(t.dtype) for b, t in zip(d0, self.dev_bufs)]
        for h, d in zip(host_idx.tolist(), dev_idx.tolist()):
            for layer in range(self.host.layer_num):
                for c in self.comps:
                    self.host_row(exp_t, c, layer, h).copy_(self.dev_row(src_t, c, layer, d))
        check_equal(f"write (D2H) node {node_id}", self.host.kv_buffer, exp)
        self.allocator.free(dev_idx)
        return host_idx

    def load(self, host_idx, node_id):
        """ctrl.load + start_loading (H2D, layer by layer, waiting on the per-layer events as the
        forward pass does) into fresh device pages; every device buffer checked byte for byte."""
        fill_random(self.dev_bufs, self.g)
        d1 = snapshot(self.dev_bufs)
        hnow = [self.host_image().view(self.host.kv_buffer.dtype)]
        dev_idx = self.ctrl.load(host_idx, node_id=node_id)
        assert dev_idx is not None
        producer = self.ctrl.start_loading()
        counter = self.ctrl.layer_done_counter
        counter.set_consumer(producer)
        for layer in range(self.ctrl.transfer_layer_id_max):
            counter.wait_until(layer)
        ack = self.ctrl.ack_load_queue.pop()
        assert ack.node_ids == [node_id] and ack.finish_event.query()
        exp = [b.clone() for b in d1]
        exp_t = [e.view(t.dtype) for e, t in zip(exp, self.dev_bufs)]
        for h, d in zip(host_idx.tolist(), dev_idx.tolist()):
            for layer in range(self.host.layer_num):
                for c in self.comps:
                    self.dev_row(exp_t, c, layer, d).copy_(self.host_row(hnow, c, layer, h))
        for i, (a, e) in enumerate(zip(self.dev_bufs, exp)):
            check_equal(f"load (H2D) node {node_id} dev[{i}]", a, e)
        self.allocator.free(dev_idx)

    def expect_copied(self, before, dst, src):
        """``before`` with host pages ``src`` copied to ``dst`` (token slot lists)."""
        exp = before.clone()
        exp_t, src_t = [exp.view(self.host.kv_buffer.dtype)], [before.view(self.host.kv_buffer.dtype)]
        for h_dst, h_src in zip(dst.tolist(), src.tolist()):
            for layer in range(self.host.layer_num):
                for c in self.comps:
                    self.host_row(exp_t, c, layer, h_dst).copy_(self.host_row(src_t, c, layer, h_src))
        return exp

    def backup(self, host_idx, tokens, keys, timeout):
        """write_storage -> sglang's backup thread -> the store: the acked operation."""
        op_id = self.ctrl.write_storage(host_idx, token_ids=tokens, hash_value=keys)
        op = take(self.ctrl.ack_backup_queue, timeout, "the backup thread's ack")
        assert op.id == op_id
        return op

    def prefetch(self, tokens, timeout, assume_stored=False):
        """One prefetch through sglang's threads, the scheduler's part done here (see the module
        docstring): ``(hit tokens, completed tokens, host indices or None when revoked)``."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        ctrl = self.ctrl
        deadline = time.monotonic() + timeout
        op = ctrl.prefetch(CacheRequestHandle(rid=f"outage-{uuid.uuid4().hex[:8]}", attempt_id=0), tokens, assume_stored=assume_stored)
        assert take(ctrl.prefetch_hit_queue, deadline - time.monotonic(), "the prefetch thread's hit query") is op
        hit = op.storage_hit_count
        if hit < ctrl.prefetch_threshold:
            return hit, 0, None  # the scheduler revokes it: nothing is read
        host_idx, alloc_len = ctrl.allocate_storage_hit(op, hit, allow_partial=True, min_tokens=ctrl.prefetch_threshold, evict_host=lambda n: 0)
        assert host_idx is not None and alloc_len == hit
        op.host_indices = host_idx
        ctrl.prefetch_buffer.put(op)
        completed = 0
        while True:
            ack = take(ctrl.ack_prefetch_queue, deadline - time.monotonic(), "the prefetch IO thread's acks")
            assert ack.operation is op
            if ack.completed_tokens is not None:
                completed = max(completed, ack.completed_tokens)
            if ack.completed_req:
                return hit, completed, host_idx

    def threads_alive(self):
        c = self.ctrl
        return {t: getattr(c, t).is_alive() for t in ("backup_thread", "prefetch_thread", "prefetch_io_aux_thread", "prefetch_sync_thread")}


def stored_before_the_outage(s, be):
    """Before: a span written, backed up, and a prefetch of it hits with exact bytes. Its
    ``(tokens, keys, host indices)``."""
    tok_a, keys_a = span(1000)
    h_a = s.write(node_id=1)
    assert s.backup(h_a, tok_a, keys_a, 20).completed_tokens == N * sp.P
    assert be.batch_exists(keys_a) == N
    before = s.host_image()
    hit, completed, idx = s.prefetch(tok_a, 20)
    assert (hit, completed) == (N * sp.P, N * sp.P)
    check_equal("prefetch before the outage", s.host.kv_buffer, s.expect_copied(before, idx, h_a))
    assert be.integrity_stats()["outages"] == 0
    return tok_a, keys_a, h_a


def with_the_master_down(s, be, caplog, tok_a, h_a):
    """The master just stopped: a backup is acked with nothing completed, prefetches of the span
    stored before fetch nothing, L1 <-> L2 moves exact bytes, one outage counted and logged."""
    stats = [be.integrity_stats()["unreachable"]]

    # the backup thread: acked with nothing completed, and alive
    tok_b, keys_b = span(2000)
    h_b = s.write(node_id=2)  # L1 -> L2 keeps working
    t0 = time.monotonic()
    op = s.backup(h_b, tok_b, keys_b, DOWN_BOUND_S)
    assert op.completed_tokens == 0, f"{op.completed_tokens} tokens backed up with the master down"
    assert all(s.threads_alive().values()), s.threads_alive()
    stats.append(be.integrity_stats()["unreachable"])

    # a prefetch of the pages stored before: a miss at the hit query (the scheduler revokes it)
    image = s.host_image()
    assert s.prefetch(tok_a, DOWN_BOUND_S) == (0, 0, None)
    stats.append(be.integrity_stats()["unreachable"])
    # and one that skips the query (a span proven stored): its gets fetch nothing, touch nothing
    hit, completed, idx = s.prefetch(tok_a, DOWN_BOUND_S, assume_stored=True)
    assert (hit, completed) == (N * sp.P, 0)
    check_equal("host pool after a prefetch with the master down", s.host.kv_buffer, image)
    s.ctrl.mem_pool_host.free(idx)  # what the scheduler's ack drain releases
    stats.append(be.integrity_stats()["unreachable"])
    assert stats == sorted(set(stats)), f"each call with the master down counts its objects unreachable: {stats}"
    assert time.monotonic() - t0 < DOWN_BOUND_S, "the three L3 calls with the master down took too long together"
    sglang_said = [r.getMessage() for r in caplog.records if r.name.startswith("sglang.")]
    assert "Write page to storage: 2 pages failed." in sglang_said, sglang_said  # the backup failed the ordinary way

    # L2 -> L1 keeps working, for pages stored before and pages whose backup failed
    s.load(h_a, node_id=3)
    s.load(h_b, node_id=4)
    counts = be.integrity_stats()
    assert counts["outages"] == 1 and counts["unreachable"] > 0, counts
    logged = transport_warnings(caplog)
    assert len(logged) == 1 and logged[0].startswith("hicache-io L3: Mooncake Store is unreachable"), logged
    assert all(s.threads_alive().values()), s.threads_alive()


def after_the_restart(s, be, caplog, tok_a, keys_a):
    """The master just restarted on the same port, empty: the same store backs up and prefetches
    exact bytes again, the span stored before the outage reads as misses, the return is logged."""
    t1 = time.monotonic()
    tok_c, keys_c = span(3000)
    h_c = s.write(node_id=5)
    attempts = 0
    while True:
        attempts += 1
        op = s.backup(h_c, tok_c, keys_c, DOWN_BOUND_S)
        if op.completed_tokens == N * sp.P:
            break
        # until the client has mounted its segment on the new master, puts fail (NO_AVAILABLE_HANDLE, measured ~1.5 s)
        assert op.completed_tokens == 0 and time.monotonic() - t1 < RECONNECT_BOUND_S, f"no complete backup {time.monotonic() - t1:.1f} s after the restart ({attempts} tries)"
        time.sleep(0.5)
    assert be.batch_exists(keys_c) == N
    before = s.host_image()
    hit, completed, idx = s.prefetch(tok_c, 20)
    assert (hit, completed) == (N * sp.P, N * sp.P)
    check_equal("prefetch after the restart", s.host.kv_buffer, s.expect_copied(before, idx, h_c))

    # what was stored before the outage is gone with the old master's metadata: misses, no bytes
    assert be.batch_exists(keys_a) == 0
    assert s.prefetch(tok_a, 20) == (0, 0, None)
    image = s.host_image()
    hit, completed, idx = s.prefetch(tok_a, 20, assume_stored=True)
    assert (hit, completed) == (N * sp.P, 0)
    check_equal("host pool after a prefetch of pages the old master held", s.host.kv_buffer, image)
    s.ctrl.mem_pool_host.free(idx)

    # While the client remounts its segment a call may still meet the old connection (-900)
    # after one that reached the new master: a second, short outage, counted and logged.
    counts = be.integrity_stats()
    assert counts["outages"] in (1, 2), counts
    logged = transport_warnings(caplog)
    assert len(logged) == 2 * counts["outages"] and logged[-1].startswith("hicache-io L3: Mooncake Store answers again"), logged


def test_controller_through_a_master_outage(caplog, monkeypatch):
    from sglang.srt.mem_cache.hybrid_cache import hybrid_cache_controller

    from hicache_io.storage import LocalMaster, MooncakeStore

    monkeypatch.setattr(hybrid_cache_controller, "get_storage_hash_str", page_hashes)  # the hit query's keys (see the module docstring)
    caplog.set_level(logging.WARNING)
    thread_errors = []
    monkeypatch.setattr(threading, "excepthook", lambda args: thread_errors.append(args))  # an exception escaping any thread
    s = Stack(sp.seed_of("outage", "mha", "page_first"))
    ctrl = s.ctrl
    masters = [LocalMaster(lease_ms=200)]
    port = masters[0].port
    try:
        # a threshold of N pages: the scheduler's part fetches every hit of N pages
        ctrl.attach_storage_backend(storage_backend="dynamic", prefetch_threshold=N * sp.P, model_name=f"sglang-client/outage-{uuid.uuid4().hex[:8]}", storage_backend_extra_config=dynamic_extra_config(masters[0]), host_pools=s.group.entries)
        be = ctrl.storage_backend
        assert type(be) is MooncakeStore and ctrl.page_get_func == ctrl._page_get_zero_copy

        # ---- before: backed up, and a prefetch of it hits with exact bytes
        tok_a, keys_a, h_a = stored_before_the_outage(s, be)

        # ---- master down
        masters[0].stop()
        with_the_master_down(s, be, caplog, tok_a, h_a)

        # ---- master back on the same port, empty; same controller, same store
        masters.append(LocalMaster(port=port, lease_ms=200))
        after_the_restart(s, be, caplog, tok_a, keys_a)

        # sglang logged the failures as warnings of its own, never an exception from its threads
        assert [r for r in caplog.records if r.levelno >= logging.ERROR] == [] and thread_errors == []
        assert all(s.threads_alive().values()), s.threads_alive()
    finally:
        ctrl.detach_storage_backend()  # stops the storage threads, closes the store (master back: no timeouts)
        for m in masters:
            m.stop()
    assert ctrl.storage_backend is None
