"""``HICACHE_IO_SGLANG=1``: sglang on hicache-io in every process it starts.

sglang runs its schedulers (where the KV pools live) in spawned processes, so a call to
:func:`hicache_io.sglang.install` in the user's script never reaches them. The wheel installs
``hicache_io_sglang.pth`` into site-packages; Python runs its one line at every interpreter
start, and that line imports this module only when ``HICACHE_IO_SGLANG`` is set to ``1``. Then
:func:`activate` puts an import hook first on ``sys.meta_path`` that acts when sglang's own
modules finish loading:

- ``sglang`` (the package): :func:`hicache_io.sglang.install` -- before any pool module exists;
- the host-pool modules that took the non-CUDA path: their guarded transfer-op imports bound
  (:func:`hicache_io.sglang_cpu.bind_guarded_ops`);
- ``pool_host/common.py`` without a CUDA driver: host registration as no-ops.

Without the variable the ``.pth`` line costs one environment lookup and imports nothing; with
it, every Python process imports ``hicache_io`` (numpy and its native module) at start. A failure
in an action (an sglang version ``install`` refuses, say) raises from the ``import sglang`` that
triggered it: the setting asked for hicache-io, and a server silently without it would be worse.
(Should ``hicache_io`` itself not import, Python prints that error at every start and goes on
without the hook.)
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from typing import Any, Callable, Dict, Optional

ENV = "HICACHE_IO_SGLANG"
#: The attribute that marks the hook on ``sys.meta_path`` (a class check would miss a hook made
#: by a reloaded copy of this module).
MARK = "_hicache_io_sglang_hook"

logger = logging.getLogger("hicache_io.sglang")

#: What each process's hook did, by module name (read by :func:`report`).
_DONE: Dict[str, Any] = {}


def _after_sglang(module: Any) -> None:
    from . import sglang

    _DONE["sglang"] = sglang.install()


def _after_pool(module: Any) -> None:
    from . import sglang_cpu

    if sglang_cpu.needs_fixups(module):
        _DONE[module.__name__] = sglang_cpu.bind_guarded_ops(module)


def _after_common(module: Any) -> None:
    from . import sglang_cpu

    if not sglang_cpu.cuda_driver_present():
        sglang_cpu.register_host_noop(module)
        _DONE[module.__name__] = "host registration: no-op (no CUDA driver)"


def _actions() -> Dict[str, Callable[[Any], None]]:
    from .sglang_cpu import AOT_MODULES, HOST_REGISTER_MODULE

    actions: Dict[str, Callable[[Any], None]] = {"sglang": _after_sglang, HOST_REGISTER_MODULE: _after_common}
    actions.update({name: _after_pool for name in AOT_MODULES})
    return actions


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched name it asks the finders after it, then makes the
    found loader run the action once the module's own code has run."""

    def __init__(self, actions: Dict[str, Callable[[Any], None]]):
        self.actions = actions
        setattr(self, MARK, True)
        # Names being looked up by this thread: a finder after this one that asks the whole
        # meta path again (as this one does) must not bring the question back here.
        self._asking = threading.local()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Optional[Any]:
        action = self.actions.get(name)
        asking = self._asking.__dict__.setdefault("names", set())
        if action is None or name in asking:
            return None
        asking.add(name)
        try:
            return self._wrapped(name, path, target, action)
        finally:
            asking.discard(name)

    def _wrapped(self, name: str, path: Any, target: Any, action: Callable[[Any], None]) -> Optional[Any]:
        for finder in sys.meta_path:
            if getattr(finder, MARK, False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is None:
                continue
            loader = spec.loader
            if loader is None or not hasattr(loader, "exec_module"):
                raise ImportError(f"{ENV}=1: {name} is loaded by {loader!r}, which hicache-io's hook cannot follow; call hicache_io.sglang.install() in the process instead")
            run = loader.exec_module

            def exec_module(module: Any, run: Callable[[Any], None] = run) -> None:
                run(module)
                action(module)

            # The loader object is this spec's own (one per find), so the wrapper touches no
            # other module; its type stays the same, which inspect and linecache rely on.
            loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec
        return None


def activate() -> bool:
    """Puts the hook on ``sys.meta_path`` (once); True when it was added now. A module already
    imported is not revisited: call :func:`hicache_io.sglang.install` and
    :func:`hicache_io.sglang_cpu.apply` for those."""
    if any(getattr(f, MARK, False) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _AfterImport(_actions()))
    return True


def report() -> Dict[str, Any]:
    """What the hook did in this process: ``sglang`` (``install()``'s report) and, per pool
    module, the op names bound or the host-registration note."""
    return dict(_DONE)

