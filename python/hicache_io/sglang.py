"""Points a released sglang at hicache-io with one call.

    import hicache_io.sglang
    hicache_io.sglang.install()      # before sglang's pool modules are imported
    # ... then build sglang's host pools / start its scheduler in this process

sglang's server and ``Engine`` run their schedulers in processes they spawn, which a call here
does not reach: there set ``HICACHE_IO_SGLANG=1`` instead (a hook the wheel installs calls
:func:`install` in every process as sglang loads, see :mod:`hicache_io._sglang_hook`).

sglang binds its transfer functions when its modules are imported, in three ways, and
:func:`install` serves all three with hicache-io:

1. ``from sgl_kernel.kvcacheio import ...`` in each host-pool module (the thirteen classic
   ops, ``transfer_embedding_ranges_direct`` and, lazily, ``get_device_accessible_ptr``):
   ``sys.modules["sgl_kernel.kvcacheio"]`` becomes :mod:`hicache_io.kvcacheio`. When sgl-kernel
   is installed it is imported first and only its ``kvcacheio`` submodule is replaced (its
   other kernels stay); when it is not, a package ``sgl_kernel`` holding just ``kvcacheio``,
   ``copy_all_layer_kv_cache_cpu`` and the CPU engine's imports
   (:data:`hicache_io.sglang_cpu.STAND_INS`) is made.
2. ``torch.ops.sgl_kernel.<op>``, which sglang checks with ``hasattr`` before it uses
   ``get_device_accessible_ptr`` and ``transfer_embedding_ranges_direct``: every op of
   :mod:`hicache_io.torch_ops` is defined there (or, when sgl-kernel defined it with the same
   schema, routed to hicache-io; one sgl-kernel defined with another schema stays sgl-kernel's
   and is listed in the result).
3. The JIT entry points of ``sglang.kernels.ops.kvcache.hicache``, which the pools import under
   aliases (``transfer_hicache_one_layer as jit_transfer_hicache_one_layer``): the module's
   functions become :mod:`hicache_io.hicache`'s, and every ``sglang`` module already imported
   that bound one of the replaced objects under any name is rebound too. Where that module
   cannot be imported (its JIT toolchain's Python packages missing) a module of hicache-io's
   functions takes its name. The other JIT modules whose ops the catalogue serves
   (:data:`JIT_OPS`: the Mamba state copies, DeepSeek-V4's token copy) are served the same way, by the
   :mod:`hicache_io.kvcacheio` functions of those names.

So :func:`install` may also run after some sglang modules were imported; only a pool module
imported earlier on a machine without sgl-kernel has already failed (its import raised).

It refuses an sglang whose version it was not built against (:data:`SUPPORTED_VERSIONS`)
unless ``allow_other_versions=True`` (or ``HICACHE_IO_SGLANG_ANY_VERSION=1``): a newer sglang
may call these names with other arguments.
"""

import importlib
import importlib.util
import importlib.metadata
import logging
import os
import sys
import types
from typing import Any, Dict, List, Optional

from . import hicache, kvcacheio

__all__ = ["SUPPORTED_VERSIONS", "JIT_MODULE", "KVCACHEIO_OPS", "JIT_NAMES", "JIT_OPS", "install", "installed"]

logger = logging.getLogger(__name__)

#: sglang releases whose call sites :func:`install` was checked against.
SUPPORTED_VERSIONS = ("0.5.23",)

#: Where sglang 0.5.23 keeps its JIT HiCache entry points.
JIT_MODULE = "sglang.kernels.ops.kvcache.hicache"

#: What sglang imports from ``sgl_kernel.kvcacheio`` (the catalogue's sgl-kernel ops).
KVCACHEIO_OPS = tuple(spec["name"] for spec in kvcacheio.CATALOGUE if spec["sglang"] == "Aot")

#: sglang's other JIT modules the catalogue serves: module path -> op names (the Mamba state
#: copies, ...).
JIT_OPS: Dict[str, "tuple[str, ...]"] = {}
for _spec in kvcacheio.CATALOGUE:
    if isinstance(_spec["sglang"], dict):
        _module = _spec["sglang"]["Jit"]
        JIT_OPS[_module] = (*JIT_OPS.get(_module, ()), _spec["name"])
del _spec

def _no_warmup() -> None:
    """sglang compiles its page-row JIT kernels here; hicache-io's copy needs no compiling."""


#: Names beside a JIT module's ops that sglang's pools import from it.
_JIT_EXTRAS: Dict[str, Dict[str, Any]] = {
    "sglang.kernels.ops.kvcache.nvfp4_hicache": {"warmup_page_row_transfer": _no_warmup},
}

#: The JIT names sglang's pools import (and the probes and constants beside them).
JIT_NAMES = tuple(hicache.__all__)

_STATE: Dict[str, Any] = {}


def installed() -> Optional[Dict[str, Any]]:
    """What :func:`install` did in this process, or ``None`` before it ran."""
    return dict(_STATE["report"]) if "report" in _STATE else None


def _sglang_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        mod = sys.modules.get("sglang")
        version = getattr(mod, "__version__", None)
        if version is None:
            raise ImportError("hicache_io.sglang.install: sglang is not installed") from None
        return str(version)


def _kvcacheio_module() -> "tuple[Dict[str, Any], str]":
    """Makes ``sgl_kernel.kvcacheio`` hicache-io's; returns the objects it replaced, by name,
    and where sgl-kernel came from."""
    replaced: Dict[str, Any] = {}
    pkg = sys.modules.get("sgl_kernel")
    origin = "hicache-io (sgl-kernel not installed)"
    if pkg is None and importlib.util.find_spec("sgl_kernel") is not None:
        try:
            pkg = importlib.import_module("sgl_kernel")
        except Exception as e:  # noqa: BLE001 - an sgl-kernel that cannot load here (no GPU build)
            logger.warning("sgl_kernel is installed but does not import (%s); hicache-io provides sgl_kernel.kvcacheio alone", e)
            pkg = None
    if pkg is not None and not getattr(pkg, "_hicache_io_stub", False):
        origin = f"sgl-kernel at {getattr(pkg, '__file__', '?')}, kvcacheio replaced"
        old = sys.modules.get("sgl_kernel.kvcacheio") or getattr(pkg, "kvcacheio", None)
        if old is None:
            try:
                old = importlib.import_module("sgl_kernel.kvcacheio")
            except Exception:  # noqa: BLE001 - nothing to replace
                old = None
        if old is not None and old is not kvcacheio:
            replaced = {name: getattr(old, name) for name in KVCACHEIO_OPS if hasattr(old, name)}
    elif pkg is None:
        pkg = types.ModuleType("sgl_kernel")
        pkg.__path__ = []  # a package, so `import sgl_kernel.kvcacheio` resolves through sys.modules
        pkg._hicache_io_stub = True  # type: ignore[attr-defined]
        pkg.copy_all_layer_kv_cache_cpu = kvcacheio.copy_all_layer_kv_cache_cpu  # type: ignore[attr-defined]
        # What sglang's CPU engine imports from sgl_kernel (see hicache_io.sglang_cpu).
        from .sglang_cpu import STAND_INS

        for name, fn in STAND_INS.items():
            setattr(pkg, name, fn)
        sys.modules["sgl_kernel"] = pkg
    pkg.kvcacheio = kvcacheio  # type: ignore[attr-defined]
    sys.modules["sgl_kernel.kvcacheio"] = kvcacheio
    return replaced, origin


def _jit_module(module_name: str, names: Dict[str, Any], doc: Optional[str]) -> "tuple[Dict[str, Any], str]":
    """Makes the names of sglang's JIT module ``module_name`` hicache-io's (``names``: name ->
    function); returns the objects replaced, by name, and where the module came from."""
    try:
        mod = importlib.import_module(module_name)
        origin = "sglang's module, functions replaced"
    except Exception as e:  # noqa: BLE001 - its JIT toolchain packages missing
        logger.warning("%s does not import (%s); hicache-io's functions take its name", module_name, e)
        mod = types.ModuleType(module_name)
        mod.__doc__ = doc
        sys.modules[module_name] = mod
        parent_name, _, leaf = module_name.rpartition(".")
        parent = sys.modules.get(parent_name)
        if parent is not None:
            setattr(parent, leaf, mod)
        origin = "hicache-io's module under sglang's name"
    replaced = {}
    for name, new in names.items():
        old = getattr(mod, name, None)
        if old is not None and old is not new and callable(old):
            replaced[name] = old
        setattr(mod, name, new)
    return replaced, origin


def _rebind(replacements: Dict[int, Any]) -> List[str]:
    """Every ``sglang`` module already imported that holds a replaced object under any name
    gets hicache-io's instead; returns ``module.name`` of each rebinding."""
    done = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "sglang" or mod_name.startswith("sglang.")):
            continue
        for attr, value in list(vars(mod).items()):
            new = replacements.get(id(value))
            if new is not None and new is not value:
                setattr(mod, attr, new)
                done.append(f"{mod_name}.{attr}")
    # sglang resolves get_device_accessible_ptr once (lru_cache): forget an earlier answer.
    common = sys.modules.get("sglang.srt.mem_cache.pool_host.common")
    resolve = getattr(common, "_resolve_device_accessible_ptr_fn", None)
    if resolve is not None and hasattr(resolve, "cache_clear"):
        resolve.cache_clear()
    return done


def install(*, allow_other_versions: bool = False, torch_ops: bool = True) -> Dict[str, Any]:
    """Makes this process's sglang move KV-cache bytes through hicache-io (see the module
    docstring). Idempotent; returns what it did: ``sglang`` (version), ``sgl_kernel`` and
    ``jit`` (where each came from), ``jit_families`` (the same for each module of
    :data:`JIT_OPS`), ``torch_ops`` (names defined or routed under
    ``torch.ops.sgl_kernel``), ``torch_ops_kept`` (sgl-kernel's ops of another schema, left
    alone) and ``rebound`` (``module.name`` of every earlier binding replaced).

    ``torch_ops=False`` skips the ``torch.ops.sgl_kernel`` registration (then sglang uses raw
    host addresses for its layer tables and skips ``transfer_embedding_ranges_direct``, as
    with an sgl-kernel that lacks them). Raises ``ImportError`` without sglang (or, with
    ``torch_ops``, without torch) and ``RuntimeError`` for an sglang version not in
    :data:`SUPPORTED_VERSIONS`."""
    version = _sglang_version()
    if version not in SUPPORTED_VERSIONS and not (allow_other_versions or os.environ.get("HICACHE_IO_SGLANG_ANY_VERSION") == "1"):
        raise RuntimeError(
            f"hicache_io.sglang.install: sglang {version} is not a version hicache-io was checked against "
            f"({', '.join(SUPPORTED_VERSIONS)}); its call sites may pass other arguments. "
            "Pass allow_other_versions=True (or set HICACHE_IO_SGLANG_ANY_VERSION=1) to install anyway."
        )
    if "report" in _STATE:
        return installed()  # type: ignore[return-value]
    old_ops, kernel_origin = _kvcacheio_module()
    old_jit, jit_origin = _jit_module(JIT_MODULE, {name: getattr(hicache, name) for name in JIT_NAMES}, hicache.__doc__)
    jit_families = {}
    replacements: Dict[int, Any] = {}
    for module_name, names in JIT_OPS.items():
        served = {name: getattr(kvcacheio, name) for name in names}
        served.update(_JIT_EXTRAS.get(module_name, {}))
        old, origin = _jit_module(module_name, served, None)
        replacements.update({id(fn): served[name] for name, fn in old.items()})
        jit_families[module_name] = origin
    routed: List[str] = []
    kept: List[str] = []
    if torch_ops:
        from . import torch_ops as ops

        routed, kept = ops.register_routing("sgl_kernel")
    replacements.update({id(old): getattr(kvcacheio, name) for name, old in old_ops.items()})
    replacements.update({id(old): getattr(hicache, name) for name, old in old_jit.items()})
    report = {
        "sglang": version,
        "sgl_kernel": kernel_origin,
        "jit": jit_origin,
        "jit_families": jit_families,
        "torch_ops": routed,
        "torch_ops_kept": kept,
        "rebound": _rebind(replacements),
    }
    _STATE["report"] = report
    logger.info("hicache-io serves sglang %s: sgl_kernel.kvcacheio (%s), JIT (%s), %d torch ops", version, kernel_origin, jit_origin, len(routed))
    return dict(report)
