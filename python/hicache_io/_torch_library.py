"""Defining the catalogue's ops in a ``torch.library`` namespace: the one registry behind
:func:`hicache_io.kvcacheio.register_torch_ops` and :mod:`hicache_io.torch_ops`.

A leaf: it imports no other module of the package. Its callers pass the catalogue and the
functions that implement its ops, so :mod:`~hicache_io.kvcacheio` and
:mod:`~hicache_io.torch_ops` share one registration per namespace without importing each
other. torch is imported only here, when :func:`register` is called.
"""

from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

# Library objects must outlive their registrations: one per namespace, kept for the process.
_LIBRARIES: Dict[str, object] = {}
_REGISTERED: Dict[str, List[str]] = {}
_KEPT: Dict[str, List[str]] = {}


def schemas(catalogue: Sequence[Mapping[str, Any]]) -> Dict[str, str]:
    """Name -> schema (without the name), as sgl-kernel registers them (its own spacing), for
    every op of ``catalogue`` that has one."""
    return {spec["name"]: spec["schema"] for spec in catalogue if spec["schema"]}


def _exists(torch, namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
        return True
    except (AttributeError, RuntimeError):
        return False


def _kernel(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args):
        return fn(*args)

    run.__name__ = name
    return run


def register(
    namespace: str,
    catalogue: Sequence[Mapping[str, Any]],
    kernels: Mapping[str, Callable[..., Any]],
    *,
    overwrite: bool,
    keep_mismatched: bool,
) -> Tuple[List[str], List[str]]:
    """Defines (or, with ``overwrite``, re-routes) every op of ``catalogue`` that has a schema
    under ``torch.ops.<namespace>``, implemented by ``kernels[name]`` for the op's dispatch keys.
    Returns (names served here, names left alone: ops the namespace has with another schema,
    kept when ``keep_mismatched``). A namespace is registered once per process: a second call
    returns the first one's answer."""
    import torch

    if namespace in _REGISTERED:
        return list(_REGISTERED[namespace]), list(_KEPT.get(namespace, []))
    table = schemas(catalogue)
    keys = {spec["name"]: list(spec["keys"]) for spec in catalogue if spec["schema"]}
    existing = [name for name in table if _exists(torch, namespace, name)]
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
        want = str(torch._C.parse_schema(f"{namespace}::{name}{table[name]}"))
        if have != want:
            if not keep_mismatched:
                raise RuntimeError(f"torch.ops.{namespace}.{name} has the schema {have}, not {want}: not routed to hicache-io")
            kept.append(name)
    lib = torch.library.Library(namespace, "FRAGMENT")
    served = [name for name in table if name not in kept]
    for name in served:
        if name not in existing:
            lib.define(name + table[name])
        for key in keys[name]:
            lib.impl(name, _kernel(name, kernels[name]), key)
    _LIBRARIES[namespace] = lib
    _REGISTERED[namespace] = served
    _KEPT[namespace] = kept
    return list(served), list(kept)
