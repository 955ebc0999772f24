"""sglang 0.5.23's HybridCacheController + L2TransferEngine on hicache-io: a write (D2H backup
through the controller's write path) and a load (H2D, layer by layer, with the per-layer events
the forward pass waits on), every byte checked; plus concurrent backups and loads on disjoint
slots from four threads."""

from ._env import require_sglang

require_sglang()

import threading  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from . import cpu_shims  # noqa: E402
from . import sgl_pools as sp  # noqa: E402
from .harness import Spy, check_equal, expected_target, fill_random, move_indices_like_controller, page_tokens, snapshot  # noqa: E402

PATHS = {"cuda": dict(cuda=True, device_kernels=True), "cpu": dict(cuda=False, device_kernels=False)}

# (kind, layout, io, path) -> (write route, load route)
ROUTES = {
    ("mha", "layer_first", "kernel", "cuda"): ("jit_transfer_hicache_all_layer", "jit_transfer_hicache_one_layer"),
    ("mha", "page_first", "kernel", "cuda"): ("jit_transfer_hicache_all_layer_staged_lf_pf", "jit_transfer_hicache_one_layer"),
    ("mha", "page_head", "kernel", "cuda"): ("transfer_kv_all_layer_lf_ph", "transfer_kv_per_layer_ph_lf"),
    ("mha", "layer_first", "direct", "cuda"): ("transfer_kv_direct", "transfer_kv_direct"),
    ("mha", "page_first_direct", "direct", "cuda"): ("transfer_kv_all_layer_direct_lf_pf", "transfer_kv_per_layer_direct_pf_lf"),
    ("mla", "layer_first", "kernel", "cuda"): ("jit_transfer_hicache_all_layer_mla", "jit_transfer_hicache_one_layer_mla"),
    ("mla", "page_first", "kernel", "cuda"): ("jit_transfer_hicache_all_layer_mla_staged_lf_pf", "jit_transfer_hicache_one_layer_mla"),
    ("mla", "layer_first", "direct", "cuda"): ("transfer_kv_direct", "transfer_kv_direct"),
    ("mla", "page_first_direct", "direct", "cuda"): ("transfer_kv_all_layer_direct_lf_pf", "transfer_kv_per_layer_direct_pf_lf"),
    ("mha", "layer_first", "kernel", "cpu"): ("transfer_kv_all_layer", "transfer_kv_per_layer"),
    ("mha", "page_first", "kernel", "cpu"): ("transfer_kv_all_layer_lf_pf", "transfer_kv_per_layer_pf_lf"),
    ("mla", "layer_first", "kernel", "cpu"): ("transfer_kv_all_layer_mla", "transfer_kv_per_layer_mla"),
    ("mla", "page_first", "kernel", "cpu"): ("transfer_kv_all_layer_mla_lf_pf", "transfer_kv_per_layer_mla_pf_lf"),
}


def _id(key):
    kind, layout, io, path = key
    return f"{kind}{'+draft' if kind == 'mla' else ''}-{layout}-{io}-{path}"


@pytest.mark.parametrize("key", list(ROUTES), ids=_id)
def test_write_then_load(key):
    kind, layout, io, path = key
    g = sp.gen(sp.seed_of(*key))
    with cpu_shims.sglang_paths(**PATHS[path]), cpu_shims.memory_config(hicache_mem_layout=layout, hicache_io_backend=io):
        dev, drafts, allocator, group, ctrl = sp.build_controller_stack(kind, layout, io)
    host = group.anchor_entry.host_pool
    assert host.layout == layout and host.layer_num == (4 if kind == "mla" else 3)
    dev_bufs, dev_row, host_row, comps = sp.controller_views(kind, layout, host)
    fill_random(dev_bufs, g)
    fill_random([host.kv_buffer], g)
    d0, h0 = snapshot(dev_bufs), snapshot([host.kv_buffer])

    # ---- write (D2H): allocator -> controller.write -> start_writing -> L2TransferEngine
    dev_idx = allocator.alloc(4 * sp.P)
    with Spy() as spy:
        host_idx = ctrl.write(dev_idx, node_id=7)
        assert host_idx is not None and host_idx.device.type == "cpu" and host_idx.dtype == torch.int64
        ack = ctrl.ack_write_queue.pop()
    assert ack.node_ids == [7] and ack.finish_event.query() and ack.num_tokens == len(dev_idx)
    write_targets, write_calls = spy.targets(), spy.take()
    exp = h0[0].clone()
    exp_t, src_t = [exp.view(host.kv_buffer.dtype)], [b.view(t.dtype) for b, t in zip(d0, dev_bufs)]
    for h, d in zip(host_idx.tolist(), dev_idx.tolist()):
        for l in range(host.layer_num):  # the packed draft layer included
            for c in comps:
                host_row(exp_t, c, l, h).copy_(dev_row(src_t, c, l, d))
    check_equal(f"{_id(key)} write host", host.kv_buffer, exp)

    # ---- load (H2D), per-layer events
    fill_random(dev_bufs, g)
    d1 = snapshot(dev_bufs)
    hnow = [snapshot([host.kv_buffer])[0].view(host.kv_buffer.dtype)]
    new_dev_idx = ctrl.load(host_idx, node_id=8)
    assert new_dev_idx is not None
    counter = ctrl.layer_done_counter
    with Spy() as spy:
        producer = ctrl.start_loading()
    load_targets, load_calls = spy.targets(), spy.take()
    lle = counter.events[producer]
    records = [e.record_count for e in lle.load_events]
    assert lle.start_event.record_count >= 1
    # one event per transfer layer (the target layers; the packed draft layer rides with the last)
    assert records == [1] * ctrl.transfer_layer_id_max and ctrl.transfer_layer_id_max == dev.layer_num, records
    counter.set_consumer(producer)
    for l in range(ctrl.transfer_layer_id_max):
        counter.wait_until(l)
    ack = ctrl.ack_load_queue.pop()
    assert ack.node_ids == [8] and ack.finish_event.query()
    exp = [b.clone() for b in d1]
    exp_t = [e.view(t.dtype) for e, t in zip(exp, dev_bufs)]
    for h, d in zip(host_idx.tolist(), new_dev_idx.tolist()):
        for l in range(host.layer_num):
            for c in comps:
                dev_row(exp_t, c, l, d).copy_(host_row(hnow, c, l, h))
    for i, (a, e) in enumerate(zip(dev_bufs, exp)):
        check_equal(f"{_id(key)} load dev[{i}]", a, e)

    assert (write_calls, load_calls) == ([ROUTES[key][0]], [ROUTES[key][1]]), (write_calls, load_calls)
    for bound, target in {**write_targets, **load_targets}.items():
        assert target == expected_target(bound)


# --------------------------------------------------------------------------------- concurrency

CONCURRENT = [
    pytest.param("mha", "page_first", "kernel", dict(cuda=True, device_kernels=False), id="mha-pf-kernel-cuda_unstaged"),
    pytest.param("mha", "layer_first", "kernel", dict(cuda=True, device_kernels=True), id="mha-lf-kernel-cuda"),
    pytest.param("mla", "page_first_direct", "direct", dict(cuda=True, device_kernels=True), id="mla+draft-pfd-direct"),
    pytest.param("mla", "page_first", "kernel", dict(cuda=False, device_kernels=False), id="mla+draft-pf-kernel-cpu"),
]


@pytest.mark.parametrize("kind,layout,io,paths", CONCURRENT)
def test_concurrent_backups_and_loads(kind, layout, io, paths):
    """Four threads on one host pool, as the controller's write and load streams overlap: two
    back up disjoint device pages into disjoint host pages while two load other host pages,
    layer by layer, into other device pages; 6 rounds. The staged write-back is left out: its
    staging buffer is one per pool (sglang serializes backups on one stream)."""
    g = sp.gen(sp.seed_of(kind, layout, io))
    with cpu_shims.sglang_paths(**paths):
        if kind == "mha":
            dev = sp.mha_device(size=256)
            drafts = ()
            host = sp.mha_host(dev, layout)
        else:
            dev = sp.mla_device(size=256)
            drafts = (sp.mla_device(layer_num=1, size=256),)
            host = sp.mla_host(dev, layout, drafts)
    assert not host.can_use_write_back_jit
    dev_bufs, dev_row, host_row, comps = sp.controller_views(kind, layout, host)
    L = host.layer_num
    n_dev_pages = dev.size // sp.P
    plan = [(l, l, False, dev) for l in range(dev.layer_num)] + [(dev.layer_num + i, dev.layer_num + i, True, dp) for i, dp in enumerate(drafts)]

    for rnd in range(6):
        fill_random(dev_bufs, g)
        fill_random([host.kv_buffer], g)
        d0, h0 = snapshot(dev_bufs), snapshot([host.kv_buffer])
        dpages = (torch.randperm(n_dev_pages - 1, generator=g)[:16] + 1).view(4, 4)  # 4 jobs x 4 pages
        host_idx = host.alloc(16 * sp.P)
        hpages = host_idx.view(-1, sp.P)[torch.randperm(16, generator=g)].view(4, 4 * sp.P)
        jobs = []
        for j in range(4):
            h = hpages[j].contiguous()
            d = page_tokens(dpages[j].tolist(), sp.P)
            jobs.append(move_indices_like_controller(io, host, h, d, for_write=(j < 2)))
        errors = []
        barrier = threading.Barrier(4)

        def work(j):
            try:
                h, d = jobs[j]
                barrier.wait()
                if j < 2:
                    for _ in range(3):
                        host.backup_from_device_all_layer(dev, h, d, io)
                else:
                    for host_layer, layer_id, is_draft, dp in plan:
                        host.load_to_device_per_layer(dp, h, d, layer_id, io, is_draft=is_draft)
            except BaseException as e:  # noqa: BLE001
                errors.append((j, e))

        threads = [threading.Thread(target=work, args=(j,)) for j in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors

        eh = h0[0].clone()
        eh_t = [eh.view(host.kv_buffer.dtype)]
        ed = [b.clone() for b in d0]
        ed_t = [e.view(t.dtype) for e, t in zip(ed, dev_bufs)]
        src_d = [b.view(t.dtype) for b, t in zip(d0, dev_bufs)]
        src_h = [h0[0].view(host.kv_buffer.dtype)]
        for j, (h, d) in enumerate(jobs):
            for hh, dd in zip(h.tolist(), d.tolist()):
                for l in range(L):
                    for c in comps:
                        if j < 2:
                            host_row(eh_t, c, l, hh).copy_(dev_row(src_d, c, l, dd))
                        else:
                            dev_row(ed_t, c, l, dd).copy_(host_row(src_h, c, l, hh))
        check_equal(f"round {rnd} host", host.kv_buffer, eh)
        for i, (a, e) in enumerate(zip(dev_bufs, ed)):
            check_equal(f"round {rnd} dev[{i}]", a, e)
        host.free(host_idx)
