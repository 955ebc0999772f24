"""The torch reference and the call recorder.

Reference: checks compare WHOLE buffers as raw bytes. The expected image is the buffer's
bytes before the transfer with only the rows the transfer should write replaced, each row
taken from a torch view chosen by the layout's formula (``host_row`` / ``dev_row``), so a
stray write anywhere, or a write of the wrong bytes, fails. Nothing here calls hicache-io.

Recorder: :class:`Spy` wraps, for the duration, every function bound in sglang's pool
modules that is one of hicache-io's transfer functions, under the name sglang bound it
(``jit_transfer_hicache_one_layer``, ``transfer_kv_per_layer_pf_lf``), and records the
calls sglang makes; the wrapper calls through.
"""

from __future__ import annotations

import functools
import sys
import threading
import types

import torch

POOL_MODULES = (
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.pool_host.dsa",
    "sglang.srt.mem_cache.pool_host.mha_mxfp8",
    "sglang.srt.mem_cache.memory_pool_host",
    "sglang.srt.mem_cache.pool_host.mamba",
)


def hicache_io_transfer_functions() -> dict[int, str]:
    """id -> 'kvcacheio.<name>' / 'hicache.<name>' for hicache-io's transfer functions."""
    from hicache_io import hicache, kvcacheio

    out = {}
    for mod, tag in ((kvcacheio, "kvcacheio"), (hicache, "hicache")):
        for name in mod.__all__:
            fn = getattr(mod, name)
            if callable(fn) and name.startswith("transfer_"):
                out[id(fn)] = f"{tag}.{name}"
    return out


class Spy:
    """``with Spy() as spy: ...; spy.take()`` -> bound names sglang called, first-call order."""

    def __init__(self, modules=POOL_MODULES):
        self.modules = [sys.modules[m] for m in modules if m in sys.modules]
        self.calls: list[tuple[str, str]] = []  # (bound name, hicache-io function)
        self._saved: list[tuple[types.ModuleType, str, object]] = []
        self._lock = threading.Lock()

    def __enter__(self):
        known = hicache_io_transfer_functions()
        for mod in self.modules:
            for attr, value in list(vars(mod).items()):
                target = known.get(id(value))
                if target is None:
                    continue
                self._saved.append((mod, attr, value))
                setattr(mod, attr, self._wrap(attr, target, value))
        return self

    def _wrap(self, attr, target, fn):
        @functools.wraps(fn)
        def recorder(*args, **kwargs):
            with self._lock:
                self.calls.append((attr, target))
            return fn(*args, **kwargs)

        recorder.__spied__ = fn
        return recorder

    def __exit__(self, *exc):
        for mod, attr, value in reversed(self._saved):
            setattr(mod, attr, value)
        self._saved.clear()

    def take(self) -> list[str]:
        with self._lock:
            names = [n for n, _ in self.calls]
            self.calls.clear()
        out = []
        for n in names:
            if n not in out:
                out.append(n)
        return out

    def targets(self) -> dict[str, str]:
        with self._lock:
            return dict(self.calls)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def fill_random(tensors, gen: torch.Generator) -> None:
    for t in tensors:
        b = as_bytes(t)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))


def snapshot(tensors):
    return [as_bytes(t).clone() for t in tensors]


def page_tokens(pages, page_size: int) -> torch.Tensor:
    """Page ids -> page-aligned int64 token indices."""
    pages = torch.as_tensor(pages, dtype=torch.int64)
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def random_device_pages(num_pages_total: int, count: int, gen) -> list[int]:
    """Distinct device pages >= 1 (page 0 is the allocator's padding page)."""
    return (torch.randperm(num_pages_total - 1, generator=gen)[:count] + 1).tolist()


def move_indices_like_controller(io_backend: str, host_pool, host_indices, device_indices, *, for_write: bool):
    """sglang's HiCacheController index conventions, by calling its own ``move_indices``:
    kernel -> host indices on the pool's device (a no-op on CPU); direct + layer_first -> host
    sorted, device permuted to match; the staged write-back keeps host indices on CPU."""
    from sglang.srt.managers.cache_controller import HiCacheController

    if for_write and io_backend == "kernel" and host_pool.layout == "page_first" and getattr(host_pool, "can_use_write_back_jit", False):
        return host_indices, device_indices
    fake_self = types.SimpleNamespace(io_backend=io_backend, mem_pool_host=host_pool, device=torch.device("cpu"))
    return HiCacheController.move_indices(fake_self, host_indices, device_indices)


def check_equal(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    a, e = as_bytes(actual), as_bytes(expected)
    if not torch.equal(a, e):
        diff = (a.reshape(-1) != e.reshape(-1)).nonzero().reshape(-1)
        raise AssertionError(f"{name}: {diff.numel()} of {a.numel()} bytes differ, first at flat byte offsets {diff[:4].tolist()}")


def roundtrip(*, name, host, host_bufs, host_row, dev_bufs, dev_row, comps, n_host_layers, page_rows: bool, page_size: int, dev_pages, io_backend: str, backup, load, load_plan, gen) -> dict:
    """backup_from_device_all_layer -> whole host image checked -> load_to_device_per_layer
    layer by layer, the whole device image checked after each.

      backup(h_idx, d_idx); load(h_idx, d_idx, layer_id, is_draft, device_pool)
      load_plan: [(host_layer, layer_id, is_draft, device_pool_arg), ...]
      units are tokens, or pages when page_rows (DSA indexer, DeepSeek-V4 page rows).
    Returns the sglang-bound transfer names called by the backup and by the loads."""
    fill_random(dev_bufs, gen)
    fill_random(host_bufs, gen)
    dev_before, host_before = snapshot(dev_bufs), snapshot(host_bufs)
    n_tokens = len(dev_pages) * page_size
    host_idx = host.alloc(n_tokens)
    assert host_idx is not None and host_idx.dtype == torch.int64 and host_idx.device.type == "cpu"
    # Shuffle host page order so host and device page ids differ non-trivially.
    hp = host_idx.view(-1, page_size)[torch.randperm(len(dev_pages), generator=gen)]
    host_idx = hp.reshape(-1).contiguous()
    dev_idx = page_tokens(dev_pages, page_size)

    # ---- backup (D2H), indices as the controller passes them
    h_w, d_w = move_indices_like_controller(io_backend, host, host_idx, dev_idx, for_write=True)
    with Spy() as spy:
        backup(h_w, d_w)
    targets = spy.targets()
    backup_calls = spy.take()
    pairs = list(zip(h_w.tolist(), d_w.tolist()))
    if page_rows:
        pairs = [(h // page_size, d // page_size) for h, d in pairs[::page_size]]
    exp = [b.clone() for b in host_before]
    exp_t = [e.view(t.dtype) for e, t in zip(exp, host_bufs)]
    src_t = [e.view(t.dtype) for e, t in zip(dev_before, dev_bufs)]
    for h, d in pairs:
        for l in range(n_host_layers):
            for c in comps:
                host_row(exp_t, c, l, h).copy_(dev_row(src_t, c, l, d))
    for i, (a, e) in enumerate(zip(host_bufs, exp)):
        check_equal(f"{name} backup host[{i}]", a, e)
    for i, (a, e) in enumerate(zip(dev_bufs, dev_before)):
        check_equal(f"{name} backup left device[{i}] alone", a, e)

    # ---- load (H2D) layer by layer into fresh random device bytes
    fill_random(dev_bufs, gen)
    dev_before2 = snapshot(dev_bufs)
    host_now = [e.view(t.dtype) for e, t in zip(snapshot(host_bufs), host_bufs)]
    h_r, d_r = move_indices_like_controller(io_backend, host, host_idx, dev_idx, for_write=False)
    pairs_r = list(zip(h_r.tolist(), d_r.tolist()))
    if page_rows:
        pairs_r = [(h // page_size, d // page_size) for h, d in pairs_r[::page_size]]
    exp = [b.clone() for b in dev_before2]
    exp_t = [e.view(t.dtype) for e, t in zip(exp, dev_bufs)]
    with Spy() as spy:
        for host_layer, layer_id, is_draft, device_pool in load_plan:
            load(h_r, d_r, layer_id, is_draft, device_pool)
            for h, d in pairs_r:
                for c in comps:
                    dev_row(exp_t, c, host_layer, d).copy_(host_row(host_now, c, host_layer, h))
            # after each layer: that layer and the earlier ones complete, nothing else touched
            for i, (a, e) in enumerate(zip(dev_bufs, exp)):
                check_equal(f"{name} load layer_id={layer_id} dev[{i}]", a, e)
    targets.update(spy.targets())
    load_calls = spy.take()
    for i, (a, e) in enumerate(zip(host_bufs, host_now)):
        check_equal(f"{name} loads left host[{i}] alone", a, e)
    host.free(host_idx)
    return dict(backup_calls=backup_calls, load_calls=load_calls, targets=targets, units=len(pairs))


def expected_target(bound: str) -> str:
    """The hicache-io function a name sglang bound must be: ``jit_X`` -> hicache.X (install()
    replaced sglang's JIT module), ``X`` -> kvcacheio.X (sgl_kernel.kvcacheio is hicache-io's)."""
    return f"hicache.{bound[4:]}" if bound.startswith("jit_") else f"kvcacheio.{bound}"
