"""The package's import graph: no cycles (function-local imports included), no alias modules, one errors module.

Every ``import`` / ``from ... import`` anywhere in a module under ``sparkjax/`` is an edge, except those under
``if TYPE_CHECKING:``. ``from pkg import name`` is an edge to the submodule ``pkg.name`` when that is a module,
else to ``pkg`` itself. A package's implicit import of its parents is not an edge.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "sparkjax"
ALIASES = ("decode.py", "draft.py", "convert.py", "checkpoint.py", "atomic.py", "eval/tokenizer.py")


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("sparkjax", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node of ``tree``, skipping the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _edges(name: str, path: pathlib.Path, mods: dict[str, pathlib.Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in mods)
            continue
        if node.level:
            base = package.split(".")
            base = base[: len(base) - node.level + 1]
            src = ".".join(base + ([node.module] if node.module else []))
        else:
            src = node.module or ""
        if src not in mods:
            continue
        for a in node.names:
            sub = f"{src}.{a.name}"
            out.add(sub if sub in mods else src)
    out.discard(name)
    return out


def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _edges(name, path, mods) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``g`` with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
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

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(found)


def test_cycle_finder_sees_function_local_imports_and_skips_type_checking(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from . import b\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n"
                                   "from .a import f\n")
    (tmp_path / "c.py").write_text("from .b import x\n")
    mods = {f"p.{n}": tmp_path / f"{n}.py" for n in "abc"} | {"p": tmp_path / "__init__.py"}
    g = {name: _edges(name, path, mods) for name, path in mods.items() if path.exists()}
    assert g == {"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.b"}}
    assert cycles(g) == [["p.a", "p.b"]]


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles in sparkjax/:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_alias_modules_and_one_errors_module():
    assert [a for a in ALIASES if (ROOT / a).exists()] == []
    assert [str(p.relative_to(ROOT)) for p in ROOT.rglob("errors.py")] == ["errors.py"]
