"""The import structure of ``services/`` and ``ringserve/``: no import cycle, counting imports
inside functions (a deferred import hides a cycle from import time, not from the design),
and no import from the shared package ``ringserve/`` up into a service (``ringserve/cli.py``
names each service's ``main`` as a string to dispatch to, which is not an import).

Imports under ``if TYPE_CHECKING:`` are annotations only and are left out.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

from tests.helpers.repo import REPO


def _modules(root: Path) -> dict[str, Path]:
    mods = {}
    for top in ("services", "ringserve"):
        for path in (root / top).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _type_checking_only(tree: ast.Module) -> set[int]:
    return {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
            and getattr(block.test, "id", getattr(block.test, "attr", None)) == "TYPE_CHECKING"
            for stmt in block.body for node in ast.walk(stmt)}


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    """{module: the modules of services/ and ringserve/ under ``root`` it imports at run time}."""
    mods = _modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges = graph.setdefault(mod, set())
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            edges.update(t for t in map(resolve, targets) if t and t != mod)
    return graph


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 150  # the walk found the tree
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the cycle


def test_the_shared_package_imports_no_service():
    up = {(mod, dep) for mod, deps in import_graph().items() if mod.startswith("ringserve")
          for dep in deps if dep.startswith("services")}
    assert up == set()


def test_a_cycle_is_found(tmp_path):
    """The check itself: a deferred import that closes a loop is a cycle; a type-only one is not."""
    (tmp_path / "services").mkdir()
    (tmp_path / "services" / "a.py").write_text("import services.b\n")
    (tmp_path / "services" / "b.py").write_text("def f():\n    from services import a\n")
    (tmp_path / "services" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import services.d\n")
    (tmp_path / "services" / "d.py").write_text("import services.c\n")
    graph = import_graph(tmp_path)
    assert graph == {"services.a": {"services.b"}, "services.b": {"services.a"}, "services.c": set(),
                     "services.d": {"services.c"}}
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()
