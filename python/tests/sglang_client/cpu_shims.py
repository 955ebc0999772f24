"""Every shim a CPU-only machine forces on sglang 0.5.23's HiCache classes, in one place.

hicache-io itself is installed by ``hicache_io.sglang.install()`` (conftest.py calls it before
this module touches any sglang pool module): it makes ``sys.modules["sgl_kernel.kvcacheio"]``
hicache-io's, registers ``torch.ops.sgl_kernel.*`` and replaces the JIT entry points of
``sglang.kernels.ops.kvcache.hicache`` (what the recipe called S3 is therefore *not* here).

What remains are the things a machine without a CUDA driver changes in sglang itself:

- S1  publish a (dummy) server config and the parallel ranks       -> :func:`apply`
- S2  bind the AOT names the ``if _is_cuda or _is_hip:`` blocks skipped -> :func:`apply`
- S4  the modules' ``_is_cuda`` flags (toggle)                        -> :func:`sglang_paths`
- S5  ``current_platform.capabilities.hicache_device_kernels`` (toggle) -> :func:`sglang_paths`
- S6  host-memory registration (cudaHostRegister) as no-ops            -> :func:`apply`
- S7  a CPU ``device_module`` for the controller / L2 transfer engine  -> :func:`apply`

S4 and S5 are read by the pools at construction: a test builds its pools inside
``with sglang_paths(cuda=..., device_kernels=...)`` and the previous values come back on exit
(the conftest also resets them after every test, so test order does not matter).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

import msgspec
import torch

from hicache_io import sglang_cpu

# Modules whose ``if _is_cuda or _is_hip: from sgl_kernel.kvcacheio import ...`` block S2 re-runs
# (the product's list: HICACHE_IO_SGLANG=1 binds the same ones in a real engine).
AOT_MODULES = sglang_cpu.AOT_MODULES
guarded_aot_imports = sglang_cpu.guarded_imports

# Modules whose ``_is_cuda`` global gates the CUDA transfer branches (S4).
IS_CUDA_MODULES = (
    "sglang.srt.mem_cache.pool_host.mha",  # can_use_jit, prepare_mha_write_back_staging
    "sglang.srt.mem_cache.pool_host.mla",  # can_use_jit, can_use_write_back_jit
    "sglang.srt.mem_cache.pool_host.dsa",  # can_use_write_back_jit = _is_cuda and ...
    "sglang.srt.mem_cache.memory_pool_host",  # DeepSeek-V4: can_use_write_back_jit = _is_cuda and ...
    "sglang.srt.mem_cache.pool_host.mha_mxfp8",  # its own copy (`from .mha import _is_cuda`)
)

# Modules holding a reference to ``_cuda_host_unregister`` (called by destroy()) (S6).
UNREGISTER_MODULES = (
    "sglang.srt.mem_cache.pool_host.common",
    "sglang.srt.mem_cache.pool_host.base",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mha_mxfp8",
    "sglang.srt.mem_cache.pool_host.dsa",
)

_STATE: dict = {}


# ------------------------------------------------------------------------------ S2


def _bind_aot_names() -> dict[str, list[str]]:
    # Exactly the statements sglang runs on CUDA, resolved through sys.modules
    # ["sgl_kernel.kvcacheio"] (hicache-io's after install()): the product's fixup, applied here
    # to every module whatever its flags (the tests toggle them afterwards).
    return {name: sglang_cpu.bind_guarded_ops(importlib.import_module(name)) for name in AOT_MODULES}


# ------------------------------------------------------------------------------ S6


# ------------------------------------------------------------------------------ S7


class CpuEvent:
    """torch.cuda.Event's interface; CPU work is synchronous, so an event is complete once
    recorded. Counts its records so tests can assert each layer event fired once."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self.record_count = 0

    def record(self, stream=None):
        self.record_count += 1

    def wait(self, stream=None):
        pass

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end_event) -> float:
        return 0.0


class CpuStream:
    """torch.cuda.Stream's interface (torch.cpu.Stream lacks synchronize/query)."""

    def __init__(self, device=None, priority: int = 0):
        self.device = device

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or CpuEvent()
        event.record(self)
        return event

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True


class CpuDeviceModule(types.SimpleNamespace):
    """What l2_transfer / cache_controller call on their module-level ``device_module``."""

    def __init__(self):
        super().__init__(__name__="sglang_client.CpuDeviceModule", Stream=CpuStream)
        self._current = CpuStream()
        self.events_created: list[CpuEvent] = []

        def _event(*a, **k):
            e = CpuEvent(*a, **k)
            self.events_created.append(e)
            return e

        self.Event = _event

    @contextlib.contextmanager
    def stream(self, s):
        prev, self._current = self._current, (s or self._current)
        try:
            yield
        finally:
            self._current = prev

    def current_stream(self, device=None):
        return self._current

    def synchronize(self, device=None):
        pass


# ------------------------------------------------------------------------------ apply


def apply() -> dict:
    """S1, S2, S6 and S7 (once per process; idempotent). Call after hicache_io.sglang.install()."""
    if "report" in _STATE:
        return _STATE["report"]
    if "sgl_kernel.kvcacheio" not in sys.modules:
        raise RuntimeError("cpu_shims.apply(): call hicache_io.sglang.install() first (S2 binds from sys.modules['sgl_kernel.kvcacheio'])")
    report: dict = {}

    # (S1) Config. Pools, the assembler (build_kv_only_group), the controller and the storage
    # attach read get_memory() (hicache_io_backend, hicache_mem_layout, ratio, storage keys)
    # and get_parallel() (DSATokenToKVPool: attn_dcp_size; _generate_storage_config: tp/pp/dcp
    # ranks). A server process publishes these at startup; a bare test process has nothing
    # published, so publish a dummy ServerArgs with sglang's own test hook and stamp the ranks.
    # (Not CPU-specific: a bare process on a GPU box needs it too.)
    from sglang.srt.runtime_context import get_context, get_parallel

    fields = dict(enable_hierarchical_cache=True, hicache_io_backend="kernel", hicache_mem_layout="page_first")
    get_context().override_server_args(**fields).install()
    get_parallel().override_permanently(tp_rank=0, pp_rank=0, attn_dcp_rank=0)
    report["S1"] = fields

    # (S2) AOT op names. Each pool module imports the classic ops inside
    # `if _is_cuda or _is_hip: from sgl_kernel.kvcacheio import (...)`; `_is_cuda` is computed at
    # import from torch.cuda.is_available() and is False here, so those names do not exist and
    # the first transfer would raise NameError. Re-run exactly those import statements (found
    # in the modules' source) in each module's namespace: they resolve through
    # sys.modules["sgl_kernel.kvcacheio"], which install() made hicache_io.kvcacheio.
    report["S2"] = _bind_aot_names()

    # (S6) Host registration. ALLOC_MEMORY_FUNCS falls back to alloc_with_host_register for
    # "cpu", which with pin_memory=True (every host pool's default, and what the assembler
    # passes) calls torch.cuda.cudart().cudaHostRegister -> "Found no NVIDIA driver"; destroy()
    # calls cudaHostUnregister. Replace both with no-ops that keep the range attribute sglang
    # reads.
    for name in (sglang_cpu.HOST_REGISTER_MODULE, *UNREGISTER_MODULES):
        sglang_cpu.register_host_noop(importlib.import_module(name))
    report["S6"] = list(UNREGISTER_MODULES)

    # (S7) Streams and events. get_device_module() is torch.cpu here: its Stream has no
    # synchronize(), which L2TransferEngine._submission calls on its exception path (so any
    # transfer error would surface as AttributeError instead), and its Event counts nothing.
    # Give l2_transfer and cache_controller a CPU module with CUDA's interface.
    dm = CpuDeviceModule()
    l2 = importlib.import_module("sglang.srt.mem_cache.l2_transfer")
    cc = importlib.import_module("sglang.srt.managers.cache_controller")
    l2.device_module = cc.device_module = dm
    l2._timing_events_supported.cache_clear()
    report["S7"] = ["sglang.srt.mem_cache.l2_transfer", "sglang.srt.managers.cache_controller"]

    for name in IS_CUDA_MODULES:
        importlib.import_module(name)
    from sglang.srt.platforms import current_platform

    _STATE["defaults"] = (current_state(), current_platform.capabilities)
    _STATE["device_module"] = dm
    _STATE["report"] = report
    return report


def device_module() -> CpuDeviceModule:
    return _STATE["device_module"]


# ------------------------------------------------------------------------------ S4 / S5


def current_state() -> dict:
    from sglang.srt.platforms import current_platform

    return {
        "cuda": {name: sys.modules[name]._is_cuda for name in IS_CUDA_MODULES},
        "device_kernels": current_platform.capabilities.hicache_device_kernels,
    }


def _set(cuda: bool | None, device_kernels: bool | None) -> None:
    from sglang.srt.platforms import current_platform

    if cuda is not None:
        # (S4) `_is_cuda` module globals, computed once at import (False here). They gate
        # can_use_jit (JIT one-layer / all-layer calls), the MHA write-back staging buffers and
        # every can_use_write_back_jit; on CUDA they are True. pool_host.base / common (destroy()
        # -> cudaHostUnregister), memory_pool (device pools: CUDA alt streams) and mamba/unified
        # are left alone. Toggle: True = sglang's CUDA code paths (hicache-io's probes then
        # decide), False = its CPU paths (the AOT ops).
        for name in IS_CUDA_MODULES:
            setattr(sys.modules[name], "_is_cuda", bool(cuda))
    if device_kernels is not None:
        # (S5) Platform capability. current_platform is the base SRTPlatform without a GPU:
        # hicache_device_kernels=False, so no pool builds its staging buffer and the staged
        # page_first write-back branch is unreachable. Only this field changes (copying CUDA's
        # capabilities would also turn on supports_triton: the allocator would launch Triton).
        current_platform.capabilities = msgspec.structs.replace(current_platform.capabilities, hicache_device_kernels=bool(device_kernels))


@contextlib.contextmanager
def sglang_paths(*, cuda: bool, device_kernels: bool = True):
    """Pools built inside take sglang's CUDA code paths (``cuda=True``) or its CPU ones, with the
    staged write-back capability on or off; both come back on exit."""
    from sglang.srt.platforms import current_platform

    saved_cuda = current_state()["cuda"]
    saved_caps = current_platform.capabilities
    _set(cuda, device_kernels)
    try:
        yield
    finally:
        for name, value in saved_cuda.items():
            setattr(sys.modules[name], "_is_cuda", value)
        current_platform.capabilities = saved_caps


def reset_paths() -> None:
    """Back to the state right after apply() (sglang's own CPU values)."""
    from sglang.srt.platforms import current_platform

    cuda, caps = _STATE["defaults"]
    for name, value in cuda["cuda"].items():
        setattr(sys.modules[name], "_is_cuda", value)
    current_platform.capabilities = caps


# ------------------------------------------------------------------------------ S1 helpers


@contextlib.contextmanager
def memory_config(**fields):
    """(S1) Change published config leaves (hicache_mem_layout, hicache_io_backend) for the
    duration; the previous values come back on exit."""
    from sglang.srt.runtime_context import get_context

    ctx = get_context()
    saved = {name: ctx.config_leaf(name) for name in fields}
    ctx.override("sglang_client", **fields)
    try:
        yield
    finally:
        ctx.override("sglang_client.restore", **saved)


@contextlib.contextmanager
def no_attn_cp_group():
    """(S1) LayerSplitDSATokenToKVPool.__init__ reads get_parallel().attn_cp_group to build an
    NCCL broadcast communicator; a bare process has no process groups. world_size=1 with no
    pynccl communicator makes it skip that, as on a single rank."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_cp_group=types.SimpleNamespace(world_size=1, pynccl_comm=None)):
        yield
