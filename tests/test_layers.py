"""The library's layers: every import inside drc_core points down (or sideways within a layer) and no set of
modules imports itself round in a cycle. Imports inside functions count like module-level ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "drc_core"

# Lowest first. A module belongs to the layer of the longest prefix listed here; every module must have one.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("drc_core.errors", "drc_core.guard", "drc_core.heap")),
    ("data", ("drc_core.data",)),
    ("model", ("drc_core.model",)),
    ("training", ("drc_core.training",)),
    ("analysis", ("drc_core.analysis",)),
    ("halting", ("drc_core.halting",)),
    ("explorer", ("drc_core.plotting", "drc_core.explorer")),
    ("api", ("drc_core.api", "drc_core")),
)


def module_name(root: Path, path: Path) -> str:
    """``drc_core/halting/rules.py`` -> ``drc_core.halting.rules``; a package's ``__init__`` is the package."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def internal_imports(root: Path) -> dict[str, set[str]]:
    """For every module under ``root`` (a package directory), the modules of the same package it imports
    anywhere in its source (module level, in functions, under ``if``). ``from a.b import c`` counts as an
    import of ``a.b.c`` when that is a module, else of ``a.b``; relative imports are resolved."""
    files = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    known = set(files)
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for t in targets:
                while t and t not in known:  # import drc_core.x.y.z of a name -> the module that holds it
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    deps.add(t)
        graph[mod] = deps
    return graph


def layer_of(mod: str) -> int:
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            inside = mod.startswith(p + ".") and p != PACKAGE.name  # the package itself: only its __init__
            if (mod == p or inside) and len(p) > best_len:
                best, best_len = i, len(p)
    if best < 0:
        raise AssertionError(f"{mod} belongs to no layer; add it to LAYERS in tests/test_layers.py")
    return best


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import that points to a higher layer, as ``a (layer) imports b (higher layer)``."""
    out = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if layer_of(dep) > layer_of(mod):
                out.append(f"{mod} ({LAYERS[layer_of(mod)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: the import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_every_module_has_a_layer() -> None:
    graph = internal_imports(PACKAGE)
    assert len(graph) > 20
    for mod in graph:
        layer_of(mod)


def test_no_import_points_up_a_layer() -> None:
    assert layer_violations(internal_imports(PACKAGE)) == []


def test_no_import_cycles() -> None:
    assert cycles(internal_imports(PACKAGE)) == []


def _tree(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "drc_core"
    for name, text in files.items():
        p = pkg / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return pkg


def test_checker_sees_function_local_upward_imports_and_cycles(tmp_path: Path) -> None:
    pkg = _tree(tmp_path, {
        "__init__.py": "",
        "errors.py": "",
        "model/__init__.py": "",
        "model/lm.py": "from drc_core.errors import DrcError\n",
        "analysis/__init__.py": "",
        "analysis/measure.py": "def f():\n    from drc_core.halting.rules import Rule\n",
        "analysis/tokens.py": "from . import measure\n",
        "halting/__init__.py": "",
        "halting/rules.py": "import drc_core.analysis.measure\nfrom drc_core.halting import sweep\n",
        "halting/sweep.py": "if True:\n    from drc_core.halting.rules import Rule\n",
    })
    graph = internal_imports(pkg)
    assert graph["drc_core.analysis.tokens"] == {"drc_core.analysis.measure"}
    assert graph["drc_core.model.lm"] == {"drc_core.errors"}
    assert layer_violations(graph) == [
        "drc_core.analysis.measure (analysis) imports drc_core.halting.rules (halting)"]
    assert cycles(graph) == [["drc_core.analysis.measure", "drc_core.halting.rules", "drc_core.halting.sweep"]]


@pytest.mark.parametrize(("mod", "layer"), [("drc_core.halting.skipping", "halting"),
                                            ("drc_core.explorer", "explorer"), ("drc_core", "api"),
                                            ("drc_core.errors", "base"), ("drc_core.model.lm", "model"),
                                            ("drc_core.training.train", "training")])
def test_layer_lookup(mod: str, layer: str) -> None:
    assert LAYERS[layer_of(mod)][0] == layer


def test_a_module_outside_every_layer_fails() -> None:
    with pytest.raises(AssertionError, match="belongs to no layer"):
        layer_of("drc_core.newthing")


# ----------------------------------------------------------------------------------------------------------
# No module reaches into another's private names: what two modules share is public in the one that defines it.

CODE_DIRS = ("drc_core", "drc_book", "book", "scripts", "bench")


def private_imports(root: Path, dirs: tuple[str, ...] = CODE_DIRS) -> list[str]:
    """``from drc_x.m import _name`` and ``m._name`` on an imported project module, in every .py under ``dirs``."""
    found = []
    for d in dirs:
        for path in sorted((root / d).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            modules = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("drc_core", "drc_book"):
                    found += [f"{path.relative_to(root)}: from {node.module} import {a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
                    modules |= {a.asname or a.name for a in node.names}
                elif isinstance(node, ast.Import):
                    modules |= {(a.asname or a.name).split(".")[0] for a in node.names
                                if a.name.split(".")[0] in ("drc_core", "drc_book")}
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                    base = node.value
                    while isinstance(base, ast.Attribute):
                        base = base.value
                    if isinstance(base, ast.Name) and base.id in modules:
                        found.append(f"{path.relative_to(root)}: {ast.unparse(node)}")
    return found


def test_no_private_name_crosses_a_module() -> None:
    assert private_imports(PACKAGE.parent) == []


def test_private_import_check_sees_both_forms(tmp_path: Path) -> None:
    (tmp_path / "drc_book").mkdir()
    (tmp_path / "drc_book" / "m.py").write_text("from drc_core.halting.generate import _check, ok\n"
                                                 "from drc_core.model import lm\nx = lm._kv_hook\ny = lm.fine\n")
    assert private_imports(tmp_path, ("drc_book",)) == [
        "drc_book/m.py: from drc_core.halting.generate import _check", "drc_book/m.py: lm._kv_hook"]
