"""What sglang 0.5.23's own engine needs on a machine without a CUDA driver, beyond
:func:`hicache_io.sglang.install`.

sglang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports a few CPU kernels from ``sgl_kernel``,
binds the HiCache transfer ops only on CUDA, and registers host pools with the CUDA driver. Three
pieces make HiCache run there on hicache-io:

- :data:`STAND_INS` -- the ``sgl_kernel`` names sglang's CPU path imports, put into hicache-io's
  ``sgl_kernel`` stand-in (only when sgl-kernel is not installed: a real sgl-kernel is never
  shadowed). sglang imports them at module load; it calls them only with speculative decoding
  on. ``assign_req_to_token_pool_cpu`` (its speculative allocation's request-table writes) is
  implemented; the others raise ``NotImplementedError`` naming themselves.
- :func:`bind_guarded_ops` -- each host-pool module imports its transfer ops inside
  ``if _is_cuda or _is_hip: from sgl_kernel.kvcacheio import (...)``; on CPU those names do
  not exist and the first transfer raises ``NameError``. This runs exactly those import
  statements (read from the module's source) in the module, resolved through
  ``sys.modules["sgl_kernel.kvcacheio"]``, which is hicache-io's after ``install()``.
- :func:`register_host_noop` -- sglang pins its host pools with ``cudaHostRegister``
  (``_cuda_host_register`` in ``pool_host/common.py``), which fails without a driver; hicache-io's
  cpu executor needs no registration, so both calls become no-ops that keep the attribute
  sglang reads (the registered ranges).

:mod:`hicache_io._sglang_hook` applies all three, as each module is imported, in every process
where ``HICACHE_IO_SGLANG=1`` is set (and :func:`apply` does it by hand in a process that has
already imported them).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from typing import Any, Callable, Dict, List

__all__ = [
    "AOT_MODULES",
    "HOST_REGISTER_MODULE",
    "STAND_INS",
    "apply",
    "assign_req_to_token_pool_cpu",
    "bind_guarded_ops",
    "guarded_imports",
    "needs_fixups",
    "register_host_noop",
]

#: sglang 0.5.23's modules whose ``if _is_cuda or _is_hip:`` block imports the transfer ops.
AOT_MODULES = (
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.pool_host.dsa",
    "sglang.srt.mem_cache.memory_pool_host",
    "sglang.srt.mem_cache.pool_host.mamba",
    "sglang.srt.mem_cache.pool_host.unified",
    "sglang.srt.mem_cache.hisparse_memory_pool",
    "sglang.srt.mem_cache.pool_host.minimax_m3_nvfp4",
)

#: Where sglang keeps ``_cuda_host_register`` / ``_cuda_host_unregister`` (the other pool
#: modules import them from here, so replacing them here before those import is enough).
HOST_REGISTER_MODULE = "sglang.srt.mem_cache.pool_host.common"


def assign_req_to_token_pool_cpu(req_pool_indices: Any, req_to_token: Any, start_offset: Any, end_offset: Any, out_cache_loc: Any, pool_len: int) -> None:
    """sgl-kernel's CPU op, as sglang's Triton kernel of the same name defines it: for request
    ``i`` of the batch, ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` takes
    the next ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc`` (the requests'
    new slots, concatenated in batch order). Shapes: ``req_pool_indices``, ``start_offset``,
    ``end_offset`` ``[batch]``; ``req_to_token`` ``[rows, pool_len]``; ``out_cache_loc``
    ``[sum of lengths]``. Raises ``ValueError`` for a negative length, a range past
    ``pool_len``, or too few slots, before writing anything."""
    rows = [int(r) for r in req_pool_indices.tolist()]
    starts = [int(s) for s in start_offset.tolist()]
    ends = [int(e) for e in end_offset.tolist()]
    if not len(rows) == len(starts) == len(ends):
        raise ValueError(f"assign_req_to_token_pool_cpu: batch lengths differ ({len(rows)}, {len(starts)}, {len(ends)})")
    total = 0
    for row, start, end in zip(rows, starts, ends):
        if not 0 <= start <= end <= pool_len or not 0 <= row < req_to_token.shape[0]:
            raise ValueError(f"assign_req_to_token_pool_cpu: row {row} [{start}, {end}) outside [{req_to_token.shape[0]}, {pool_len}]")
        total += end - start
    if total > out_cache_loc.numel():
        raise ValueError(f"assign_req_to_token_pool_cpu: {total} slots needed, out_cache_loc holds {out_cache_loc.numel()}")
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def _not_served(name: str) -> Callable[..., Any]:
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name}: hicache-io's sgl_kernel stand-in serves sglang's KV-cache transfers and the CPU "
            "engine's request table, not speculative decoding; install sgl-kernel's CPU build for this kernel"
        )

    stand_in.__name__ = stand_in.__qualname__ = name
    return stand_in


#: sglang 0.5.23's CPU path imports these from ``sgl_kernel`` (``mem_cache/allocation.py``;
#: ``kernels/ops/speculative/*``, imported whether or not speculative decoding is on).
STAND_INS: Dict[str, Callable[..., Any]] = {
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
    **{
        name: _not_served(name)
        for name in (
            "rotate_input_ids_cpu",
            "fill_accept_out_cache_loc_cpu",
            "fill_bonus_tokens_cpu",
            "assign_draft_cache_locs_contiguous_cpu",
            "assign_extend_cache_locs_cpu",
            "build_tree_kernel_efficient_cpu",
            "verify_tree_greedy_cpu",
        )
    },
}


def needs_fixups(module: Any) -> bool:
    """Whether ``module`` took sglang's non-CUDA path at import (its ``_is_cuda`` and
    ``_is_hip`` flags both false)."""
    return not (getattr(module, "_is_cuda", False) or getattr(module, "_is_hip", False))


def guarded_imports(module: Any) -> List[ast.ImportFrom]:
    """The ``from sgl_kernel.kvcacheio import ...`` statements (and those from a JIT module
    hicache-io serves) inside ``module``'s top-level ``if _is_cuda ...:`` blocks, read from its
    source so that a name sglang adds is picked up."""
    from .kvcacheio import CATALOGUE  # not hicache_io.sglang, which imports this module

    served = {"sgl_kernel.kvcacheio", *(spec["sglang"]["Jit"] for spec in CATALOGUE if isinstance(spec["sglang"], dict))}
    tree = ast.parse(inspect.getsource(module))
    found = []
    for node in tree.body:
        if not isinstance(node, ast.If):
            continue
        if "_is_cuda" not in {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}:
            continue
        found.extend(s for s in node.body if isinstance(s, ast.ImportFrom) and s.module in served)
    return found


def bind_guarded_ops(module: Any) -> List[str]:
    """Runs ``module``'s guarded transfer-op imports in its namespace (see the module
    docstring); returns the names bound. Raises ``RuntimeError`` when ``module`` has no such
    block (an sglang whose pools bind their ops some other way)."""
    if "sgl_kernel.kvcacheio" not in sys.modules:
        raise RuntimeError("bind_guarded_ops: call hicache_io.sglang.install() first (the imports resolve through sgl_kernel.kvcacheio)")
    stmts = guarded_imports(module)
    if not stmts:
        raise RuntimeError(f"{module.__name__}: no `if _is_cuda: from sgl_kernel.kvcacheio import` block found")
    code = compile(ast.fix_missing_locations(ast.Module(body=stmts, type_ignores=[])), module.__file__, "exec")
    exec(code, vars(module))  # noqa: S102 - sglang's own statements, as it runs them on CUDA
    return [a.asname or a.name for s in stmts for a in s.names]


def _host_register(buffer: Any, registration_granularity_bytes: Any = None) -> None:
    setattr(buffer, "_sglang_cuda_host_registered_ranges", [(buffer.data_ptr(), buffer.numel() * buffer.element_size())])


def _host_unregister(buffer: Any) -> None:
    setattr(buffer, "_sglang_cuda_host_registered_ranges", [])


def register_host_noop(module: Any) -> None:
    """Replaces ``module``'s ``_cuda_host_register`` / ``_cuda_host_unregister`` with no-ops
    that record the range sglang reads back."""
    if hasattr(module, "_cuda_host_register"):
        module._cuda_host_register = _host_register
    if hasattr(module, "_cuda_host_unregister"):
        module._cuda_host_unregister = _host_unregister


def cuda_driver_present() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - no torch: no CUDA either
        return False


def apply() -> Dict[str, Any]:
    """The fixups for a process that imported sglang's pool modules already (the hook applies
    them at import instead): guarded ops bound in each pool module that took the non-CUDA
    path, and, without a CUDA driver, host registration as no-ops in every sglang module that
    holds ``HOST_REGISTER_MODULE``'s functions. Returns what it did."""
    bound = {}
    for name in AOT_MODULES:
        mod = importlib.import_module(name)
        if needs_fixups(mod):
            bound[name] = bind_guarded_ops(mod)
    registered = []
    if not cuda_driver_present():
        for name, mod in list(sys.modules.items()):
            # Every sglang module that took a copy (the pools, sglang.srt.state_capturer.base, ...).
            if mod is not None and name.startswith("sglang.") and (hasattr(mod, "_cuda_host_register") or hasattr(mod, "_cuda_host_unregister")):
                register_host_noop(mod)
                registered.append(name)
    return {"bound": bound, "host_register_noop": sorted(registered)}
