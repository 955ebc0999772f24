"""``torch.ops.sgl_kernel.<op>`` backed by hicache-io, for code that calls sgl-kernel's ops
through torch's dispatcher (``torch.ops.sgl_kernel.transfer_kv_per_layer.default(...)``) rather
than through ``sgl_kernel.kvcacheio``.

:func:`register` defines each op with sgl-kernel's schema string (the same argument names,
types and order, so positional calls bind alike) in a ``torch.library`` fragment of the
namespace, and implements it for the ``CPU`` and ``CUDA`` dispatch keys with the function of the
same name in :mod:`hicache_io.kvcacheio`. An op the namespace already has (sgl_kernel loaded in
the same process) is refused unless ``overwrite=True``, which routes the existing op's CPU and
CUDA kernels to hicache-io instead (its schema must be the one below).

torch is imported only here, when :func:`register` is called. Register under ``sgl_kernel``
only in a process that does not import sgl_kernel afterwards: its own definitions of the same
names would then collide with these (import it first and pass ``overwrite=True`` instead).
"""

from typing import Any, Callable, Dict, List

from . import kvcacheio

_T = "Tensor src_k, Tensor dst_k, Tensor src_v, Tensor dst_v, Tensor src_indices, Tensor dst_indices"
_TUNING = "int block_quota, int num_warps_per_block"

#: Name -> schema (without the name), as sgl-kernel registers them; the spacing of the two
#: page_first_direct schemas is sgl-kernel's own. The last three rows are hicache-io's
#: per-layer backups (not in sgl-kernel), named and shaped like their all-layer siblings.
SCHEMAS: Dict[str, str] = {
    "transfer_kv_per_layer": f"({_T}, int item_size, {_TUNING}) -> ()",
    "transfer_kv_per_layer_pf_lf": f"({_T}, int layer_id, int item_size, int src_layout_dim, {_TUNING}) -> ()",
    "transfer_kv_per_layer_ph_lf": f"({_T}, int layer_id, int item_size, int src_layout_dim, int page_size, int head_num, {_TUNING}) -> ()",
    "transfer_kv_all_layer": "(Tensor src_k_layers, Tensor dst_k_layers, Tensor src_v_layers, Tensor dst_v_layers, Tensor src_indices, Tensor dst_indices, int item_size, int num_layers, int block_quota, int num_warps_per_block) -> ()",
    "transfer_kv_all_layer_lf_pf": "(Tensor src_k_layers, Tensor dst_k, Tensor src_v_layers, Tensor dst_v, Tensor src_indices, Tensor dst_indices, int item_size, int dst_layout_dim, int num_layers, int block_quota, int num_warps_per_block) -> ()",
    "transfer_kv_all_layer_lf_ph": "(Tensor src_k_layers, Tensor dst_k, Tensor src_v_layers, Tensor dst_v, Tensor src_indices, Tensor dst_indices, int item_size, int dst_layout_dim, int num_layers, int page_size, int head_num, int block_quota, int num_warps_per_block) -> ()",
    "transfer_kv_per_layer_mla": "(Tensor src, Tensor dst, Tensor src_indices, Tensor dst_indices, int item_size, int block_quota, int num_warps_per_block) -> ()",
    "transfer_kv_per_layer_mla_pf_lf": "(Tensor src, Tensor dst, Tensor src_indices, Tensor dst_indices, int layer_id, int item_size, int src_layout_dim, int block_quota, int num_warps_per_block) -> ()",
    "transfer_kv_all_layer_mla": "(Tensor src_layers, Tensor dst_layers, Tensor src_indices, Tensor dst_indices, int item_size, int num_layers, int block_quota, int num_warps_per_block) -> ()",
    "transfer_kv_all_layer_mla_lf_pf": "(Tensor src_layers, Tensor dst, Tensor src_indices, Tensor dst_indices, int item_size, int dst_layout_dim, int num_layers, int block_quota, int num_warps_per_block) -> ()",
    "transfer_kv_direct": "(Tensor[] src_layers, Tensor[] dst_layers, Tensor src_indices, Tensor dst_indices, int page_size) -> ()",
    "transfer_kv_per_layer_direct_pf_lf": "(Tensor[] src_ptrs, Tensor[] dst_ptrs, Tensor src_indices, Tensor dst_indices, int layer_id, int page_size)->()",
    "transfer_kv_all_layer_direct_lf_pf": "(Tensor[] src_ptrs, Tensor[] dst_ptrs, Tensor src_indices, Tensor dst_indices, int page_size) ->()",
    "transfer_embedding_ranges_direct": "(Tensor src, Tensor! dst, int[] src_starts, int[] dst_starts, int[] lengths) -> ()",
    "transfer_kv_per_layer_pfdhg_lf": f"({_T}, int layer_id, int item_size, int src_layout_dim, int page_size, int head_num, {_TUNING}) -> ()",
    "transfer_kv_all_layer_lf_pfdhg": "(Tensor src_k_layers, Tensor dst_k, Tensor src_v_layers, Tensor dst_v, Tensor src_indices, Tensor dst_indices, int item_size, int dst_layout_dim, int num_layers, int page_size, int head_num, int block_quota, int num_warps_per_block) -> ()",
    "copy_all_layer_kv_cache_cpu": "(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()",
    "get_device_accessible_ptr": "(Tensor tensor, int device_index) -> int",
    "transfer_kv_per_layer_lf_pf": f"({_T}, int layer_id, int item_size, int dst_layout_dim, {_TUNING}) -> ()",
    "transfer_kv_per_layer_mla_lf_pf": "(Tensor src, Tensor dst, Tensor src_indices, Tensor dst_indices, int layer_id, int item_size, int dst_layout_dim, int block_quota, int num_warps_per_block) -> ()",
    "transfer_kv_per_layer_direct_lf_pf": "(Tensor[] src_ptrs, Tensor[] dst_ptrs, Tensor src_indices, Tensor dst_indices, int layer_id, int page_size) -> ()",
}

#: Dispatch keys each op is implemented for (sgl-kernel: CUDA, and CPU for the CPU op).
_CPU_ONLY = {"copy_all_layer_kv_cache_cpu"}

# Library objects must outlive their registrations: one per namespace, kept for the process.
_LIBRARIES: Dict[str, object] = {}
_REGISTERED: Dict[str, List[str]] = {}
_KEPT: Dict[str, List[str]] = {}


def _exists(torch, namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
        return True
    except (AttributeError, RuntimeError):
        return False


def _kernel(name: str) -> Callable[..., Any]:
    fn = getattr(kvcacheio, name)

    def run(*args):
        return fn(*args)

    run.__name__ = name
    return run


def register(namespace: str = "sgl_kernel", *, overwrite: bool = False) -> List[str]:
    """Defines (or, with ``overwrite``, re-routes) every op in :data:`SCHEMAS` under
    ``torch.ops.<namespace>``; returns their names. Calling it again for the same namespace is a
    no-op. Raises ``ImportError`` without torch, ``RuntimeError`` when the namespace already has
    one of the ops and ``overwrite`` is false, or has one with another schema (nothing is
    registered then)."""
    routed, kept = _register(namespace, overwrite=overwrite, keep_mismatched=False)
    return routed


def register_routing(namespace: str = "sgl_kernel") -> "tuple[List[str], List[str]]":
    """:func:`register` with ``overwrite`` for a namespace another library (sgl-kernel) may have
    filled: ops it lacks are defined, ops it has with hicache-io's schema are routed here, ops it
    has with another schema are left as they are. Returns (names served by hicache-io, names
    left alone)."""
    return _register(namespace, overwrite=True, keep_mismatched=True)


def _register(namespace: str, *, overwrite: bool, keep_mismatched: bool) -> "tuple[List[str], List[str]]":
    import torch

    if namespace in _REGISTERED:
        return list(_REGISTERED[namespace]), list(_KEPT.get(namespace, []))
    existing = [name for name in SCHEMAS if _exists(torch, namespace, name)]
    if existing and not overwrite:
        raise RuntimeError(
            f"torch.ops.{namespace} already defines {', '.join(existing)} (is sgl_kernel loaded?); "
            "pass overwrite=True to route those ops to hicache-io, or use another namespace"
        )
    # Older sgl-kernel builds registered ops of the same names with other meanings (item sizes in
    # elements, not bytes): route only ops whose schema is the one hicache-io implements.
    kept = []
    for name in existing:
        have = str(getattr(getattr(torch.ops, namespace), name).default._schema)
        want = str(torch._C.parse_schema(f"{namespace}::{name}{SCHEMAS[name]}"))
        if have != want:
            if not keep_mismatched:
                raise RuntimeError(f"torch.ops.{namespace}.{name} has the schema {have}, not {want}: not routed to hicache-io")
            kept.append(name)
    lib = torch.library.Library(namespace, "FRAGMENT")
    served = [name for name in SCHEMAS if name not in kept]
    for name in served:
        if name not in existing:
            lib.define(name + SCHEMAS[name])
        keys = ("CPU",) if name in _CPU_ONLY else ("CPU", "CUDA")
        for key in keys:
            lib.impl(name, _kernel(name), key)
    _LIBRARIES[namespace] = lib
    _REGISTERED[namespace] = served
    _KEPT[namespace] = kept
    return list(served), list(kept)
