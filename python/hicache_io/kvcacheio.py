"""sglang's ``sgl_kernel.kvcacheio`` under the same names, arguments and defaults, on hicache-io.

``block_quota`` and ``num_warps_per_block`` are accepted for compatibility and ignored: the
executor sizes its own launches. Errors carry sglang's message text with sglang's exception
class (``RuntimeError`` for the kernels' checks); see :mod:`hicache_io`.

Sizes are bytes. Index arguments are int64 arrays or sequences of ints. Host arrays run on
the cpu executor and the call returns when the bytes have moved; CUDA arrays (torch, CuPy)
run on the cuda executor of their device, enqueued on the caller's current stream as
sgl-kernel does (host arrays next to them must be pinned; CUDA index arrays are copied to
the host first, which waits for the stream, since indices are checked before any byte
moves). The GIL is released meanwhile. Beyond sglang's checks, every index must lie inside the array it
addresses, destinations must be unique and must not overlap another argument; a call that
raises has moved no byte.
"""

import sys
from typing import Any, List, Optional

from . import _native

__all__ = [
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_per_layer_lf_pf",
    "transfer_kv_per_layer_mla_lf_pf",
    "transfer_kv_per_layer_direct_lf_pf",
]

_DEFAULT_WARPS = 32  # sgl-kernel's CUDA default (16 on ROCm)
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



def transfer_kv_per_layer(src_k: Any, dst_k: Any, src_v: Any, dst_v: Any, src_indices: Any, dst_indices: Any, item_size: int, block_quota: int = 2, num_warps_per_block: int = _DEFAULT_WARPS) -> None:
    """One layer, layer_first to layer_first: ``dst_k[d] = src_k[s]`` and ``dst_v[d] = src_v[s]`` for each index pair (items of ``item_size`` bytes; negative indices skipped).

    Sizes are bytes; arrays, executors and checks: see the module docstring.
    """
    _native.transfer_kv_per_layer(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size, stream=_cuda_stream(src_k, dst_k, src_v, dst_v, src_indices, dst_indices))


def transfer_kv_per_layer_pf_lf(src_k: Any, dst_k: Any, src_v: Any, dst_v: Any, src_indices: Any, dst_indices: Any, layer_id: int, item_size: int, src_layout_dim: int, block_quota: int = 2, num_warps_per_block: int = _DEFAULT_WARPS) -> None:
    """Layer ``layer_id`` of a page_first host buffer ``[slots][L][item]`` (``src_layout_dim = L * item_size``) into one layer_first device layer.

    Sizes are bytes; arrays, executors and checks: see the module docstring.
    """
    _native.transfer_kv_per_layer_pf_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size, src_layout_dim, stream=_cuda_stream(src_k, dst_k, src_v, dst_v, src_indices, dst_indices))


def transfer_kv_per_layer_ph_lf(src_k: Any, dst_k: Any, src_v: Any, dst_v: Any, src_indices: Any, dst_indices: Any, layer_id: int, item_size: int, src_layout_dim: int, page_size: int, head_num: int, block_quota: int = 2, num_warps_per_block: int = _DEFAULT_WARPS) -> None:
    """Layer ``layer_id`` of a page_head host buffer ``[pages][head_num][page_size][L][item / head_num]`` into one layer_first device layer.

    Sizes are bytes; arrays, executors and checks: see the module docstring.
    """
    _native.transfer_kv_per_layer_ph_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size, src_layout_dim, page_size, head_num, stream=_cuda_stream(src_k, dst_k, src_v, dst_v, src_indices, dst_indices))


def transfer_kv_all_layer(src_k_layers: Any, dst_k_layers: Any, src_v_layers: Any, dst_v_layers: Any, src_indices: Any, dst_indices: Any, item_size: int, num_layers: int, block_quota: int = 2, num_warps_per_block: int = _DEFAULT_WARPS) -> None:
    """Every layer ``j < num_layers``: ``dst_*_layers[j][d] = src_*_layers[j][s]`` (layer_first both sides).

    ``*_layers`` arguments take a list of arrays (every index is bounds-checked against its layer) or, as sglang passes them, a 1-D int64 table of layer base addresses in host memory, which is trusted: each layer is assumed to hold what the largest index needs.

    Sizes are bytes; arrays, executors and checks: see the module docstring.
    """
    _native.transfer_kv_all_layer(src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices, dst_indices, item_size, num_layers, stream=_cuda_stream(src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices, dst_indices))


def transfer_kv_all_layer_lf_pf(src_k_layers: Any, dst_k: Any, src_v_layers: Any, dst_v: Any, src_indices: Any, dst_indices: Any, item_size: int, dst_layout_dim: int, num_layers: int, block_quota: int = 2, num_warps_per_block: int = _DEFAULT_WARPS) -> None:
    """Every device layer into its layer of a page_first host buffer (``dst_layout_dim = num_layers * item_size``).

    ``*_layers`` arguments take a list of arrays (every index is bounds-checked against its layer) or, as sglang passes them, a 1-D int64 table of layer base addresses in host memory, which is trusted: each layer is assumed to hold what the largest index needs.

    Sizes are bytes; arrays, executors and checks: see the module docstring.
    """
    _native.transfer_kv_all_layer_lf_pf(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size, dst_layout_dim, num_layers, stream=_cuda_stream(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices))


def transfer_kv_all_layer_lf_ph(src_k_layers: Any, dst_k: Any, src_v_layers: Any, dst_v: Any, src_indices: Any, dst_indices: Any, item_size: int, dst_layout_dim: int, num_layers: int, page_size: int, head_num: int, block_quota: int = 2, num_warps_per_block: int = _DEFAULT_WARPS) -> None:
    """Every device layer into its layer of a page_head host buffer.

    ``*_layers`` arguments take a list of arrays (every index is bounds-checked against its layer) or, as sglang passes them, a 1-D int64 table of layer base addresses in host memory, which is trusted: each layer is assumed to hold what the largest index needs.

    Sizes are bytes; arrays, executors and checks: see the module docstring.
    """
    _native.transfer_kv_all_layer_lf_ph(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size, dst_layout_dim, num_layers, page_size, head_num, stream=_cuda_stream(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices))


def transfer_kv_per_layer_mla(src: Any, dst: Any, src_indices: Any, dst_indices: Any, item_size: int, block_quota: int = 2, num_warps_per_block: int = _DEFAULT_WARPS) -> None:
    """One layer, layer_first to layer_first, one buffer (MLA, DSA indexer).

    Sizes are bytes; arrays, executors and checks: see the module docstring.
    """
    _native.transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size, stream=_cuda_stream(src, dst, src_indices, dst_indices))


def transfer_kv_per_layer_mla_pf_lf(src: Any, dst: Any, src_indices: Any, dst_indices: Any, layer_id: int, item_size: int, src_layout_dim: int, block_quota: int = 2, num_warps_per_block: int = _DEFAULT_WARPS) -> None:
    """Layer ``layer_id`` of a page_first host buffer into one layer_first device layer (one buffer).

    Sizes are bytes; arrays, executors and checks: see the module docstring.
    """
    _native.transfer_kv_per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim, stream=_cuda_stream(src, dst, src_indices, dst_indices))


def transfer_kv_all_layer_mla(src_layers: Any, dst_layers: Any, src_indices: Any, dst_indices: Any, item_size: int, num_layers: int, block_quota: int = 2, num_warps_per_block: int = _DEFAULT_WARPS) -> None:
    """Every layer, layer_first to layer_first, one buffer per layer.

    ``*_layers`` arguments take a list of arrays (every index is bounds-checked against its layer) or, as sglang passes them, a 1-D int64 table of layer base addresses in host memory, which is trusted: each layer is assumed to hold what the largest index needs.

    Sizes are bytes; arrays, executors and checks: see the module docstring.
    """
    _native.transfer_kv_all_layer_mla(src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers, stream=_cuda_stream(src_layers, dst_layers, src_indices, dst_indices))


def transfer_kv_all_layer_mla_lf_pf(src_layers: Any, dst: Any, src_indices: Any, dst_indices: Any, item_size: int, dst_layout_dim: int, num_layers: int, block_quota: int = 2, num_warps_per_block: int = _DEFAULT_WARPS) -> None:
    """Every device layer into its layer of a page_first host buffer (one buffer).

    ``*_layers`` arguments take a list of arrays (every index is bounds-checked against its layer) or, as sglang passes them, a 1-D int64 table of layer base addresses in host memory, which is trusted: each layer is assumed to hold what the largest index needs.

    Sizes are bytes; arrays, executors and checks: see the module docstring.
    """
    _native.transfer_kv_all_layer_mla_lf_pf(src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers, stream=_cuda_stream(src_layers, dst, src_indices, dst_indices))


def transfer_kv_direct(src_layers: Any, dst_layers: Any, src_indices: Any, dst_indices: Any, page_size: int) -> None:
    """For every layer ``j``, the runs of consecutive index pairs copied row by row, ``src_layers[j]`` to ``dst_layers[j]`` (rows along dimension 0). ``page_size`` only gates the index count, as in sglang.

    Sizes are bytes; arrays, executors and checks: see the module docstring.
    """
    _native.transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size, stream=_cuda_stream(src_layers, dst_layers, src_indices, dst_indices))


def transfer_kv_per_layer_direct_pf_lf(src_ptrs: List[Any], dst_ptrs: List[Any], src_indices: Any, dst_indices: Any, layer_id: int, page_size: int) -> None:
    """Whole pages of layer ``layer_id + j`` of page_first_direct host buffers (``src_ptrs``: ``[K, V]`` or ``[C]``, shape ``[pages, L, page_size, ...]``) into device layer ``j`` (``dst_ptrs``: K layers then V layers). Only the first index of each page is read; the rest must follow it.

    Sizes are bytes; arrays, executors and checks: see the module docstring.
    """
    _native.transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size, stream=_cuda_stream(src_ptrs, dst_ptrs, src_indices, dst_indices))


def transfer_kv_all_layer_direct_lf_pf(src_ptrs: List[Any], dst_ptrs: List[Any], src_indices: Any, dst_indices: Any, page_size: int) -> None:
    """Whole pages of every device layer (``src_ptrs``: K layers then V layers, or the MLA layers) into page_first_direct host buffers (``dst_ptrs``: ``[K, V]`` or ``[C]``).

    Sizes are bytes; arrays, executors and checks: see the module docstring.
    """
    _native.transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size, stream=_cuda_stream(src_ptrs, dst_ptrs, src_indices, dst_indices))


def transfer_kv_per_layer_lf_pf(src_k: Any, dst_k: Any, src_v: Any, dst_v: Any, src_indices: Any, dst_indices: Any, layer_id: int, item_size: int, dst_layout_dim: int, block_quota: int = 2, num_warps_per_block: int = _DEFAULT_WARPS) -> None:
    """Not in sglang: one device layer into layer ``layer_id`` of a page_first host buffer (``dst_layout_dim = L * item_size``) -- the per-layer LF->PF path whose absence makes sglang raise ``Layer-sharded DSA indexer HiCache backup with page_first layout is not supported without a per-layer LF->PF kernel.``

    Sizes are bytes; arrays, executors and checks: see the module docstring.
    """
    _native.transfer_kv_per_layer_lf_pf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size, dst_layout_dim, stream=_cuda_stream(src_k, dst_k, src_v, dst_v, src_indices, dst_indices))


def transfer_kv_per_layer_mla_lf_pf(src: Any, dst: Any, src_indices: Any, dst_indices: Any, layer_id: int, item_size: int, dst_layout_dim: int, block_quota: int = 2, num_warps_per_block: int = _DEFAULT_WARPS) -> None:
    """Not in sglang: :func:`transfer_kv_per_layer_lf_pf` with one buffer (MLA, and the DSA indexer with page-sized items and page indices).

    Sizes are bytes; arrays, executors and checks: see the module docstring.
    """
    _native.transfer_kv_per_layer_mla_lf_pf(src, dst, src_indices, dst_indices, layer_id, item_size, dst_layout_dim, stream=_cuda_stream(src, dst, src_indices, dst_indices))


def transfer_kv_per_layer_direct_lf_pf(src_ptrs: List[Any], dst_ptrs: List[Any], src_indices: Any, dst_indices: Any, layer_id: int, page_size: int) -> None:
    """Not in sglang: whole pages of one device layer (``src_ptrs``: ``[K, V]`` or ``[C]``) into layer ``layer_id`` of page_first_direct host buffers (``dst_ptrs``: ``[K, V]`` or ``[C]``, shape ``[pages, L, page_size, ...]``).

    Sizes are bytes; arrays, executors and checks: see the module docstring.
    """
    _native.transfer_kv_per_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size, stream=_cuda_stream(src_ptrs, dst_ptrs, src_indices, dst_indices))
