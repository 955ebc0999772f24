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

#: Name -> schema (without the name), as sgl-kernel registers them (its own spacing), for every
#: op of the catalogue; hicache-io's own ops (not in sgl-kernel) are named and shaped like their
#: sglang siblings.
SCHEMAS: Dict[str, str] = {spec["name"]: spec["schema"] for spec in kvcacheio.CATALOGUE if spec["schema"]}

#: Dispatch keys each op is implemented for (sgl-kernel: CUDA, and CPU for the CPU op).
_KEYS: Dict[str, List[str]] = {spec["name"]: list(spec["keys"]) for spec in kvcacheio.CATALOGUE if spec["schema"]}

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
        for key in _KEYS[name]:
            lib.impl(name, _kernel(name), key)
    _LIBRARIES[namespace] = lib
    _REGISTERED[namespace] = served
    _KEPT[namespace] = kept
    return list(served), list(kept)
