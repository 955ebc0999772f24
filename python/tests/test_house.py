"""The shape of the Python package, checked: no import circle, the L3 store one class built by
composition, each format in one module, test builders written once and test functions a reader
holds at once."""

import ast
import os
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hicache_io"
TESTS = Path(__file__).resolve().parent


def _sources(root: Path):
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE):
    """Module -> the package's modules it imports anywhere in its file (a lazy import inside a
    function is an edge too). ``from . import x`` names module ``x`` where there is one, else
    the package it comes from; the native module is a leaf."""
    files = {_module(p, root): p for p in _sources(root)}
    known = set(files) | {f"{root.name}._native"}
    graph = {}
    for mod, path in files.items():
        base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    up = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                    target = ".".join(up + ([node.module] if node.module else []))
                elif node.module and node.module.split(".")[0] == root.name:
                    target = node.module
                else:
                    continue
                edges |= {f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names}
            elif isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name.split(".")[0] == root.name}
        graph[mod] = {e for e in edges if e in known and e != mod}
    return graph


def circles(graph):
    """Every circle a depth-first walk meets, as module lists."""
    found, state, path = [], {}, []

    def walk(u):
        state[u] = 1
        path.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                found.append(path[path.index(v) :] + [v])
            elif not state.get(v):
                walk(v)
        path.pop()
        state[u] = 2

    for m in sorted(graph):
        if not state.get(m):
            walk(m)
    return found


def test_the_package_has_no_import_circle():
    assert circles(import_graph()) == []


def test_the_circle_check_sees_a_lazy_import(tmp_path):
    pkg = tmp_path / "hicache_io"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    assert circles(import_graph(pkg)) == [["hicache_io.a", "hicache_io.b", "hicache_io.a"]]


def test_the_stores_are_one_page_store():
    from hicache_io.l3.config import HiCacheStorage
    from hicache_io.l3.store import PageStore
    from hicache_io.storage import LocalStore, MooncakeStore

    assert MooncakeStore.__bases__ == (PageStore,) and LocalStore.__bases__ == (PageStore,)
    assert PageStore.__bases__ == (HiCacheStorage,)


def unowned_attributes(paths):
    """``(file, class, attribute)`` for each ``self.x`` a class reads that neither it nor a base
    class among ``paths`` assigns or defines."""
    classes = {}
    for p in paths:
        for node in ast.parse(Path(p).read_text()).body:
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (p, node)

    def owned(name):
        _p, cls = classes[name]
        out = set()
        for n in cls.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.add(n.name)
            elif isinstance(n, ast.Assign):
                out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                out.add(n.target.id)
        for n in ast.walk(cls):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                out |= {e.attr for e in ast.walk(t) if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self"}
        for b in cls.bases:
            if isinstance(b, ast.Name) and b.id in classes:
                out |= owned(b.id)
        return out

    bad = []
    for name, (p, cls) in classes.items():
        mine = owned(name)
        for n in ast.walk(cls):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" and n.attr not in mine:
                bad.append((Path(p).name, name, n.attr))
    return sorted(set(bad))


def test_no_store_class_uses_an_attribute_it_does_not_define():
    paths = [*_sources(PACKAGE / "l3"), PACKAGE / "storage.py"]
    assert unowned_attributes(paths) == []


def test_the_attribute_check_sees_a_mixin(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("class Mixin:\n    def go(self):\n        return self._io\n\nclass Store(Mixin):\n    def __init__(self):\n        self._io = 1\n")
    assert unowned_attributes([f]) == [("m.py", "Mixin", "_io")]


def _spelled(word, root, suffixes):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.suffix in suffixes and "__pycache__" not in p.parts and word in p.read_text())


def test_the_trailer_is_named_in_one_module():
    # The native module spells the magic; l3/trailer.py is the one Python module that names it.
    assert _spelled("TRAILER_MAGIC", PACKAGE, {".py"}) == [os.path.join("l3", "trailer.py")]


def test_no_test_function_over_100_lines():
    long = []
    for p in _sources(TESTS):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test") and n.end_lineno - n.lineno + 1 > 100:
                long.append(f"{p.relative_to(TESTS)}::{n.name} ({n.end_lineno - n.lineno + 1} lines)")
    assert long == []


@pytest.mark.parametrize("builder", ["pools", "pages", "page_bytes", "mooncake_problem"])
def test_test_builders_are_written_once(builder):
    defined = [str(p.relative_to(TESTS)) for p in _sources(TESTS) for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.FunctionDef) and n.name == builder]
    assert len(defined) <= 1, f"{builder} is defined in {defined}: one builder, in common.py"
