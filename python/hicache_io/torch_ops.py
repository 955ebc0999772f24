"""``torch.ops.sgl_kernel.<op>`` backed by hicache-io, for code that calls sgl-kernel's ops
through torch's dispatcher (``torch.ops.sgl_kernel.transfer_kv_per_layer.default(...)``) rather
than through ``sgl_kernel.kvcacheio``.

:func:`register` defines each op with sgl-kernel's schema string (the same argument names,
types and order, so positional calls bind alike) in a ``torch.library`` fragment of the
namespace, and implements it for the ``CPU`` and ``CUDA`` dispatch keys with the function of the
same name in :mod:`hicache_io.kvcacheio`. An op the namespace already has (sgl_kernel loaded in
the same process) is refused unless ``overwrite=True``, which routes the existing op's CPU and
CUDA kernels to hicache-io instead (its schema must be the one below).

The registry itself (one ``torch.library`` fragment per namespace, shared with
:func:`hicache_io.kvcacheio.register_torch_ops`) is :mod:`hicache_io._torch_library`; this module
imports :mod:`~hicache_io.kvcacheio`, never the other way round. torch is imported only when
:func:`register` is called. Register under ``sgl_kernel`` only in a process that does not import
sgl_kernel afterwards: its own definitions of the same names would then collide with these
(import it first and pass ``overwrite=True`` instead).
"""

from typing import List, Tuple

from . import _torch_library, kvcacheio

#: Name -> schema (without the name), as sgl-kernel registers them (its own spacing), for every
#: op of the catalogue; hicache-io's own ops (not in sgl-kernel) are named and shaped like their
#: sglang siblings.
SCHEMAS = _torch_library.schemas(kvcacheio.CATALOGUE)


def register(namespace: str = "sgl_kernel", *, overwrite: bool = False) -> List[str]:
    """Defines (or, with ``overwrite``, re-routes) every op in :data:`SCHEMAS` under
    ``torch.ops.<namespace>``; returns their names. Calling it again for the same namespace is a
    no-op. Raises ``ImportError`` without torch, ``RuntimeError`` when the namespace already has
    one of the ops and ``overwrite`` is false, or has one with another schema (nothing is
    registered then). The same as :func:`hicache_io.kvcacheio.register_torch_ops`."""
    return kvcacheio.register_torch_ops(namespace, overwrite=overwrite)


def register_routing(namespace: str = "sgl_kernel") -> Tuple[List[str], List[str]]:
    """:func:`register` with ``overwrite`` for a namespace another library (sgl-kernel) may have
    filled: ops it lacks are defined, ops it has with hicache-io's schema are routed here, ops it
    has with another schema are left as they are. Returns (names served by hicache-io, names
    left alone)."""
    return _torch_library.register(namespace, kvcacheio.CATALOGUE, vars(kvcacheio), overwrite=True, keep_mismatched=True)
