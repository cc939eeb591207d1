"""Each front service's extra in pyproject.toml declares every package its code imports.

The gateway, tokenizer and detokenizer are installed (in their images, and by users who deploy
them apart) with the core dependencies and their own extra only, while the test venv has
every extra: a module-level import of a package that only the dev extra brings passes every
ring test and fails the service's start-up everywhere else (seen: the gateway's metrics
upstream imported httpx). This reads the imports of each service's files, and of the
``ringserve`` modules they import, at module level (an import inside a function runs only
where it is used), and checks each third-party package against the requirements the core
dependencies and the service's extra pull in, followed through the installed packages'
metadata.
"""

from __future__ import annotations

import ast
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
FIRST_PARTY = {"ringserve", "services", "tests"}


def _module_imports(path: Path) -> set[str]:
    """Top-level names of the modules ``path`` imports outside functions."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        stack = [node]
        while stack:  # module level, including under if/try/with, not inside defs
            n = stack.pop()
            if isinstance(n, ast.Import):
                names.update(a.name.split(".")[0] for a in n.names)
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                names.add(n.module.split(".")[0])
                if n.module == "ringserve" or n.module.startswith(("ringserve.", "services.")):
                    names.update(f"{n.module}.{a.name}" for a in n.names)  # a submodule imported by name
            elif not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                stack.extend(ast.iter_child_nodes(n))
    return names


def _first_party_path(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _full_imports(path: Path) -> set[str]:
    """Module-level imports of ``path`` and of the first-party modules it reaches."""
    seen: set[Path] = set()
    todo, third_party = [path], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        tree = ast.parse(p.read_text())
        dotted = {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module}
        for name in _module_imports(p) | dotted:
            top = name.split(".")[0]
            if top in FIRST_PARTY:
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # each package's __init__ runs on the way
                    found = _first_party_path(".".join(parts[:i]))
                    if found is not None:
                        todo.append(found)
            elif top not in sys.stdlib_module_names and top != "__future__":
                third_party.add(top)
    return third_party


def _closure(requirements: list[str], extras: tuple[str, ...] = ()) -> set[str]:
    """The distributions ``requirements`` install (markers evaluated here), followed through
    the installed packages' own requirements and the extras asked of them."""
    out: set[tuple[str, str]] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        wanted = {(name, e) for e in req.extras} | {(name, "")}
        if name == "ringserve":
            for e in req.extras:
                todo.extend((Requirement(r), "") for r in PYPROJECT["optional-dependencies"][e])
            continue
        if all(w in out for w in wanted):
            continue
        for sub_extra in {"", *req.extras}:
            out.add((name, sub_extra))
            try:
                requires = metadata.requires(req.name) or []
            except metadata.PackageNotFoundError:
                continue
            todo.extend((Requirement(r), sub_extra) for r in requires)
    return {n for n, _ in out}


@pytest.mark.parametrize("service", ["gateway", "tokenizer", "detokenizer"])
def test_a_front_service_imports_only_what_its_extra_installs(service):
    allowed = _closure(PYPROJECT["dependencies"] + PYPROJECT["optional-dependencies"][service])
    providers = metadata.packages_distributions()
    imported = set()
    for path in sorted((ROOT / "services" / service).glob("*.py")):
        imported |= _full_imports(path)
    missing = {}
    for module in sorted(imported):
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        assert dists, f"{module}: imported by the {service} but installed by no package"
        if not dists & allowed:
            missing[module] = sorted(dists)
    assert missing == {}, f"the {service} imports these at module level, but its extra does not install them"
