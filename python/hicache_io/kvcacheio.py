"""sglang's ``sgl_kernel.kvcacheio`` under the same names, arguments and defaults, on hicache-io.

``block_quota`` and ``num_warps_per_block`` size the cuda executor's launch of that call when
given (clamped: 1 to 65536 blocks, 1 to 32 warps); left out, the executor's own grid applies
(sglang's 2 blocks of 32 warps, or ``HICACHE_CUDA_BLOCK_QUOTA`` / ``HICACHE_CUDA_WARPS_PER_BLOCK``).
They never change the bytes moved. Errors carry sglang's message text with sglang's exception
class (``RuntimeError`` for the kernels' checks); see :mod:`hicache_io`.

Sizes are bytes. Index arguments are int64 arrays or sequences of ints. Layer arguments
(``*_layers``) take a list of arrays, or a 1-D table of layer base addresses as sglang passes
them: int64 or uint64, in host memory or on the GPU (a GPU table is read on the caller's stream). Host arrays run on
the cpu executor and the call returns when the bytes have moved; CUDA arrays (torch, CuPy)
run on the cuda executor of their device, enqueued on the caller's current stream as
sgl-kernel does (host arrays next to them must be pinned). The GIL is released meanwhile.
Beyond sglang's checks, every index must lie inside the array it addresses, destinations must
be unique and must not overlap another argument; a call that raises has moved no byte.

CUDA index arrays (sglang passes them whenever ``io_backend="kernel"``) stay on the device: the
``kernel`` ops check them there, before their copy kernels, without waiting for the stream. A
call whose lists fail a check moves no byte; its error (the same text the host checks give,
naming the op) is raised by :func:`synchronize` or by the next op on that device and stream.
Index arrays on another device than the data are refused. The ``direct`` ops, and layer
arguments given as tables of addresses, need index values on the host: there a CUDA index array
is copied first, which waits for the stream (as sgl-kernel does for ``direct``).
"""

import json
import os
import sys
from typing import Any, Dict, List, Optional

from . import _native, _torch_library

#: Every op of hicache-io's catalogue (``hicache_io::kvcacheio::catalogue``): name, arguments and
#: their kinds, launch tuning, sglang's torch schema, dispatch keys, docstring. The generic ops
#: below are made from it; :mod:`hicache_io.torch_ops` and :mod:`hicache_io.sglang` read it too.
CATALOGUE: List[Dict[str, Any]] = json.loads(_native.op_catalogue())

_DL_CUDA = 2


def _cuda_stream(*args: Any) -> Optional[int]:
    """The caller's current stream on the device of the first CUDA array (torch's or CuPy's),
    as a raw handle, so the op is enqueued where sgl-kernel would enqueue it; ``None`` when every
    array is in host memory. The default stream (handle 0) is passed as DLPack's 1, the legacy
    default stream."""
    for arg in args:
        for a in arg if isinstance(arg, (list, tuple)) else (arg,):
            device = getattr(a, "__dlpack_device__", None)
            if device is None:
                continue
            kind, index = device()
            if kind != _DL_CUDA:
                continue
            torch = sys.modules.get("torch")
            if torch is not None and isinstance(a, torch.Tensor):
                return torch.cuda.current_stream(index).cuda_stream or 1
            cupy = sys.modules.get("cupy")
            if cupy is not None:
                with cupy.cuda.Device(index):
                    return cupy.cuda.get_current_stream().ptr or 1
            return 1
    return None



def _device_stream(device: Optional[int]) -> "tuple[int, int]":
    """(device index, the caller's current stream on it) for :func:`synchronize`."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        index = torch.cuda.current_device() if device is None else device
        return index, torch.cuda.current_stream(index).cuda_stream or 1
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        index = cupy.cuda.Device().id if device is None else device
        with cupy.cuda.Device(index):
            return index, cupy.cuda.get_current_stream().ptr or 1
    return (0 if device is None else device), 1


def _env_block_quota(default: Optional[int]) -> Optional[int]:
    """sglang's ``SGLANG_HICACHE_BLOCK_QUOTA`` override when set and an int, else ``default``."""
    override = os.environ.get("SGLANG_HICACHE_BLOCK_QUOTA")
    if override is None:
        return default
    try:
        return int(override)
    except ValueError:
        return default


def _positive_quota(block_quota: int) -> int:
    if block_quota <= 0:
        raise RuntimeError(f"block_quota must be positive, got {block_quota}")
    return block_quota


def forget_layer_tables() -> None:
    """Forgets the tables of layer addresses in CUDA memory the cuda executors remember. The
    all-layer ops read such a table (sglang's ``make_kernel_ptr_table``) once, at its first use
    with CUDA index arrays, and then only check on the device, before each call's copies, that it
    still holds the same addresses (a table that changed moves nothing; the error comes from
    :func:`synchronize` or the next op). Call this after rewriting a table in place, or after
    freeing one and making another at the same address."""
    _native.forget_layer_tables()


def synchronize(device: Optional[int] = None) -> None:
    """Waits for the caller's current stream on CUDA ``device`` (the current one by default),
    then raises the first op since the last report whose CUDA index arrays failed their device
    checks (``IndexError`` for an index out of range, ``ValueError`` for a destination written
    twice; nothing of that op was copied)."""
    index, stream = _device_stream(device)
    _native.synchronize(index, stream=stream)


# ---- the generic ops, made from the catalogue ----------------------------------------------

_INT_KINDS = {"Int": "int", "Ints": "List[int]"}


def _tuning(spec: Dict[str, Any]) -> "tuple[str, str, str]":
    """(extra parameters, prologue, extra keyword arguments of the native call) of an op's launch
    tuning."""
    t = spec["tuning"]
    if t == "None":
        return "", "", ""
    if t == "PerItem":
        return ", num_warps_per_item: int = 32", "", ""
    if t == "BlockSize":
        check = (
            "    if not (32 <= block_size <= 1024 and block_size % 32 == 0):\n"
            "        raise ValueError(f\"block_size must be a multiple of 32 from 32 to 1024, got {block_size}\")\n"
        )
        return ", block_size: int = 1024", check, ""
    params = ", block_quota: Optional[int] = None, num_warps_per_block: Optional[int] = None"
    kw = ", block_quota=block_quota, num_warps_per_block=num_warps_per_block"
    if t == "Env":
        return params, "    if block_quota is None:\n        block_quota = _env_block_quota(None)\n", kw
    if isinstance(t, dict) and "EnvOr" in t:
        return params, f"    block_quota = _positive_quota(_env_block_quota({t['EnvOr']}) if block_quota is None else block_quota)\n", kw
    return params, "", kw


def _source(spec: Dict[str, Any]) -> str:
    """The Python source of a generic op's wrapper: its signature, docstring and one native call."""
    names = [a for a, _ in spec["args"]]
    typed = ", ".join(f"{a}: {_INT_KINDS.get(k, 'Any')}" for a, k in spec["args"])
    tensors = ", ".join(a for a, k in spec["args"] if k not in _INT_KINDS)
    params, prologue, kw = _tuning(spec)
    doc = "\n".join(("    " + line) if line else "" for line in spec["docstring"].replace("\\", "\\\\").split("\n")).lstrip()
    return (
        f"def {spec['name']}({typed}{params}) -> None:\n"
        f'    """{doc}\n    """\n'
        f"{prologue}"
        f"    _native.call_op({spec['name']!r}, ({', '.join(names)},), stream=_cuda_stream({tensors}){kw})\n"
    )


_GENERIC = [spec for spec in CATALOGUE if spec["binding"] == "Generic"]
for _spec in _GENERIC:
    exec(compile(_source(_spec), f"<hicache_io.kvcacheio {_spec['name']}>", "exec"), globals())
del _spec

__all__ = ["CATALOGUE", "synchronize", "forget_layer_tables", *(spec["name"] for spec in CATALOGUE), "register_torch_ops"]

_SCALAR_TYPES = {
    "int64": "Long", "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte", "uint16": "UInt16",
    "uint32": "UInt32", "uint64": "UInt64", "float16": "Half", "float32": "Float", "float64": "Double",
    "bfloat16": "BFloat16", "bool": "Bool",
}


def _scalar_type(t: Any) -> str:
    """torch's ScalarType name of an array's dtype (``UInt64``, ``Long``, ...), for sglang's messages."""
    name = str(getattr(t, "dtype", "?")).replace("torch.", "")
    return _SCALAR_TYPES.get(name, name)


def _numel(t: Any) -> int:
    n = getattr(t, "numel", None)
    if callable(n):
        return int(n())
    return int(getattr(t, "size", 0))


def _is_cpu(t: Any) -> bool:
    device = getattr(t, "__dlpack_device__", None)
    return device is None or device()[0] in (1, 3)


def _is_contiguous(t: Any) -> bool:
    c = getattr(t, "is_contiguous", None)
    if callable(c):
        return bool(c())
    flags = getattr(t, "flags", None)
    return bool(getattr(flags, "c_contiguous", True))


def copy_all_layer_kv_cache_cpu(data_ptrs: Any, strides: Any, tgt_loc: Any, src_loc: Any) -> None:
    """sglang's CPU row move inside the device KV pool: for every buffer ``b`` (normally the 2·L K and
    V layer buffers), ``buf_b[tgt_loc[i], :] = buf_b[src_loc[i], :]`` as one simultaneous assignment
    (all sources are read before any target is written, so overlapping moves are safe).

    ``data_ptrs``: uint64 host addresses of the buffers (trusted, as in sglang: each must hold the
    rows the largest location addresses); ``strides``: int64 bytes per row of each buffer;
    ``tgt_loc`` / ``src_loc``: int32 or int64 rows, of one dtype. sglang's checks and messages first
    (``tgt_loc must be a CPU tensor``, ``CHECK_EQ(strides.numel(), num_bufs) failed. 3 vs 4``, ...);
    beyond sglang a negative location or a target named twice raises before any row moves.
    """
    for name, t in (("data_ptrs", data_ptrs), ("strides", strides), ("tgt_loc", tgt_loc), ("src_loc", src_loc)):
        if not _is_cpu(t):
            raise RuntimeError(f"{name} must be a CPU tensor")
        if not _is_contiguous(t):
            raise RuntimeError(f"{name} must be contiguous")
    checks = (
        ("data_ptrs.scalar_type()", _scalar_type(data_ptrs), "at::kUInt64", "UInt64"),
        ("strides.scalar_type()", _scalar_type(strides), "at::kLong", "Long"),
        ("tgt_loc.scalar_type()", _scalar_type(tgt_loc), "src_loc.scalar_type()", _scalar_type(src_loc)),
        ("strides.numel()", _numel(strides), "num_bufs", _numel(data_ptrs)),
        ("src_loc.numel()", _numel(src_loc), "num_locs", _numel(tgt_loc)),
    )
    for a, va, b, vb in checks:
        if va != vb:
            raise RuntimeError(f"CHECK_EQ({a}, {b}) failed. {va} vs {vb}")
    if _numel(data_ptrs) == 0 or _numel(tgt_loc) == 0:
        return
    if _scalar_type(tgt_loc) not in ("Int", "Long"):
        raise RuntimeError(f'"copy_all_layer_kv_cache_cpu" not implemented for \'{_scalar_type(tgt_loc)}\'')
    _native.copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc)


def _address(t: Any) -> "tuple[int, bool]":
    """(address of element 0, whether it is CUDA device memory) of a torch, CuPy, numpy or other
    DLPack array, strided views included (their first element's address)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        return t.data_ptr(), t.device.type == "cuda"
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(t, cupy.ndarray):
        return t.data.ptr, True
    ai = getattr(t, "__array_interface__", None)
    if ai is not None:
        return int(ai["data"][0]), False
    device = getattr(t, "__dlpack_device__", None)
    if device is not None and device()[0] == _DL_CUDA and hasattr(t, "ptr"):
        return int(t.ptr), True
    raise TypeError(f"get_device_accessible_ptr: cannot take the address of a {type(t).__name__}")


def get_device_accessible_ptr(tensor: Any, device_index: int) -> int:
    """The address a kernel on CUDA device ``device_index`` reads ``tensor`` at, as sglang builds
    its layer tables (``make_kernel_ptr_table``): a CUDA tensor's own address; for host memory,
    the device alias of pinned or registered memory (``cuMemHostGetDevicePointer``; interior
    pointers of a registered region, such as a page_first buffer's per-layer views, keep their
    offset; unregistered memory raises). Without a CUDA device (none in this build or on this
    machine) a host tensor's address itself: where the cpu executor reads it.

    Registered as ``torch.ops.sgl_kernel.get_device_accessible_ptr`` by
    :func:`register_torch_ops`, which sglang's ``hasattr`` gate looks for."""
    addr, on_device = _address(tensor)
    if on_device or addr == 0:
        return addr
    return int(_native.device_accessible_ptr(addr, int(device_index)))


def register_torch_ops(namespace: str = "sgl_kernel", *, overwrite: bool = False) -> List[str]:
    """Defines every op of this module as ``torch.ops.<namespace>.<op>`` with sglang's schema
    strings, for code that calls ``torch.ops.sgl_kernel.<op>.default(...)`` directly. See
    :mod:`hicache_io.torch_ops`; returns the names defined.
    """
    routed, _ = _torch_library.register(namespace, CATALOGUE, globals(), overwrite=overwrite, keep_mismatched=False)
    return routed
