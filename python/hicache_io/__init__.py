"""hicache-io: sglang HiCache host<->device KV-cache transfers on cpu, wgpu and cuda.

- :mod:`hicache_io.kvcacheio` -- every op of ``sgl_kernel.kvcacheio`` under the same names
  and arguments (the thirteen classic transfers, the head-group-major ``pfdhg`` pair,
  ``transfer_embedding_ranges_direct``, ``copy_all_layer_kv_cache_cpu``), over any array that
  speaks DLPack (numpy, torch, CuPy), plus the per-layer ``page_first`` / ``page_first_direct``
  backups sglang lacks; ``kvcacheio.register_torch_ops()`` exposes them as
  ``torch.ops.sgl_kernel.<op>``.
- :mod:`hicache_io.hicache` -- sglang's JIT HiCache entry points (``transfer_hicache_one_layer``
  and its five siblings), destination first, as sglang's pools call them.
- :mod:`hicache_io.storage` -- sglang's L3 tier on Mooncake Store (``MooncakeStore``: host-pool
  pages to and from a distributed store, zero-copy; imported on demand).
- :class:`Device`, :class:`DevicePool`, :class:`HostPool` -- the pools with sglang's method
  names, on an executor chosen by name (``"cpu"``, ``"wgpu"``, ``"cuda"``) or ``"auto"``.
- :func:`matrix`, :func:`check` -- what ``hicache-io matrix --json`` and ``hicache-io check
  --json`` print, as data.

Errors are the exception classes sglang raises for the same condition with its message text:
``ValueError`` from the pools' dispatch (``Unsupported layout: ...``), ``RuntimeError`` from the
kernels' checks (``Source and destination indices must have the same length``), and for the
checks sglang does not make, ``IndexError`` (an index outside its array or pool) or
``ValueError``. A call that raises has moved no byte, with one exception: an
:class:`IntegrityError` (a ``RuntimeError``) from a load whose host items no longer match the
checksums their backups recorded -- the call's other items landed, and ``e.items`` names the
failed ones (treat them as a cache miss). Pools of profile ``extended`` keep checksums unless
built with ``integrity=False``; ``sglang`` pools only with ``integrity=True``.
"""

import json as _json
from typing import Any, Dict, List, Optional, Sequence

from . import _native, hicache, kvcacheio
from ._native import Device, DeviceLostError, DevicePool, HostPool, IntegrityError

__all__ = ["Device", "DeviceLostError", "DevicePool", "HostPool", "IntegrityError", "hicache", "kvcacheio", "matrix", "check"]
__version__ = "0.1.0"


def matrix(profile: str = "extended", pools: Optional[Sequence[str]] = None, dsa_page_size: int = 64) -> List[Dict[str, Any]]:
    """The support matrix: one entry per (pool, op, layout, io backend) cell with the path that
    runs it (``{"Ok": {...}}``) or sglang's error text (``{"Err": "..."}``)."""
    return _json.loads(_native.matrix_json(profile, list(pools) if pools is not None else None, dsa_page_size))


def check(device: "Device | str" = "cpu", profile: str = "extended", rounds: int = 4, seed: int = 1, io_backend: Optional[str] = None) -> List[Dict[str, Any]]:
    """Random cases in every supported cell on ``device``, each compared byte for byte with the
    oracle: one ``{"cell": ..., "tally": {"cases", "matched", "mismatched", "rejected", ...}}``
    per cell."""
    dev = Device(device) if isinstance(device, str) else device
    return _json.loads(_native.check_json(dev, profile, rounds, seed, io_backend))
