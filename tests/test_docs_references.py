"""Every reference the documentation makes into the repository exists.

The pages (README.md, docs/*.md, deploy/helm/README.md) cite the code as it is: a file or
folder (`services/scheduler/policy/stops.py`, or one shortened to its end inside a
service's section, `policy/stops.py`), a file and a name defined in it (`manager.py`
`TokenizerManager.generate`, or `path.py:name`), a dotted name (`executor.device.DeviceRuntime`,
`Engine.step`), a Markdown link and its anchor. A reference that no longer resolves after a
move or a rename fails here with the page, the line and what is missing.

What is checked and how:

- paths: a code span of path characters that names a top-level folder of the repository
  (`services/...`, `bench/...`) must exist; a shorter one ending in a source suffix or `/`
  (`policy/stops.py`, `kernels/cpu/`) must be the end of some path in the repository. Words
  of a command (`.venv/bin/python bench/engine.py --model DIR`) are checked the same way.
- a name right after a Python, C or proto path (only blanks between the two code spans), or
  after `path:`: defined in that file (a def, class, assignment or attribute, at any depth;
  `A.b`: b defined in class A; C: an identifier; proto: a message, service, rpc, enum or field).
- dotted names: when the leading parts name a Python module of the repository (by its dotted
  path or by its end: `model_runner.FutureIds`), the rest must be defined in it; when the
  first part is a class (`Engine.step`), some class of that name in the repository or some
  proto message or service must define the member (a class found nowhere is taken as a
  library's, `F.linear`). `ringserve.v1.X` is the proto package.
  Helm values (`config.scheduler.dtype`) are the chart tests' business and are skipped.
- Markdown links to files of the repository: the file exists, and an anchor `#x` is one of
  its headings' GitHub anchors or an explicit `<a id="x">`.

Fenced code blocks are skipped except for paths in their commands.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.repo import REPO

PAGES = sorted([REPO / "README.md", REPO / "deploy" / "helm" / "README.md", *(REPO / "docs").glob("*.md")])
# Not the repository's: hidden folders (git, the virtualenv, tool caches), build and cache output.
SKIP_DIRS = {"__pycache__", "node_modules", "build", "dist"}
TOP_DIRS = ("services", "ringserve", "tests", "bench", "deploy", "protos", "docs", "examples")
SOURCE_SUFFIXES = (".py", ".proto", ".c", ".h", ".md", ".jinja", ".sh", ".yaml")
# Files a command writes, named by the pages as where to find its output.
WRITTEN_BY_COMMANDS = {"bench/results/gpu_check.json", "bench/results/deterministic.json"}
# Dotted words that are not Python: OpenAI object types, a Kubernetes resource field.
NOT_CODE = {"chat.completion", "chat.completion.chunk", "limits.cpu",
            # span attribute names (docs/tracing.md), not the ringserve package's
            *(f"ringserve.{name}" for name in ("rid", "choices", "extend_tokens", "prefix_tokens", "prompt_done",
                                                "cached_tokens", "retractions", "output_tokens"))}
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = re.compile(rf"{IDENT}(?:\.{IDENT})+")
PATHLIKE = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_./-]*")


@dataclass(frozen=True)
class Span:
    """One inline code span of a page: its text, line, and whether only blanks separate it
    from the span before it."""

    text: str
    line: int
    follows_previous: bool
    fenced: bool


def _walk_files() -> list[str]:
    out = []
    stack = [REPO]
    while stack:
        folder = stack.pop()
        for entry in folder.iterdir():
            if entry.is_dir():
                if not (entry.name.startswith(".") or entry.name.endswith(".egg-info") or entry.name in SKIP_DIRS):
                    stack.append(entry)
            else:
                out.append(entry.relative_to(REPO).as_posix())
    return sorted(out)


@functools.cache
def repo_files() -> tuple[str, ...]:
    """Every file of the checkout, relative to the root (``SKIP_DIRS`` and hidden folders excluded)."""
    return tuple(_walk_files())


@functools.cache
def repo_dirs() -> frozenset[str]:
    """Every folder that holds a file, as ``a/b/`` (the root excluded)."""
    dirs = set()
    for f in repo_files():
        parts = f.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add("/".join(parts[:i]) + "/")
    return frozenset(dirs)


def resolve_path(ref: str) -> list[str]:
    """The files (or, for ``x/``, folders) of the repository that ``ref`` names: itself when it
    starts with a top-level folder, else every path that ends with it."""
    ref = ref.removeprefix("./")
    if ref.endswith("/"):
        pool = repo_dirs()
    else:
        pool = frozenset(repo_files())
        if ref + "/" in repo_dirs():
            return [ref + "/"]
    if ref.split("/")[0] in TOP_DIRS or ref in ("README.md", "Makefile", "pyproject.toml"):
        return [ref] if ref in pool else []
    return sorted(p for p in pool if p == ref or p.endswith("/" + ref))


def _checked_path(word: str) -> bool:
    """Whether a code span's word is a path this test checks (see the module docstring)."""
    if not PATHLIKE.fullmatch(word) or word.startswith(".venv/") or ".." in word:
        return False
    if "/" in word and word.split("/")[0] in TOP_DIRS:
        return True
    return "/" in word and (word.endswith("/") or word.endswith(SOURCE_SUFFIXES)) \
        or word.endswith((".py", ".proto", ".c", ".h", ".jinja", ".md"))


# --- names defined in a file -------------------------------------------------------------

def _python_names(tree: ast.AST) -> tuple[set[str], dict[str, set[str]]]:
    """(every name defined anywhere in the module, {class name: names defined in it})."""
    names: set[str] = set()
    classes: dict[str, set[str]] = {}

    def targets(node: ast.AST) -> list[str]:
        found = []
        for t in ast.walk(node):
            if isinstance(t, ast.Name):
                found.append(t.id)
            elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"):
                found.append(t.attr)
        return found

    def defined(node: ast.AST) -> list[str]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return [node.name]
        if isinstance(node, ast.Assign):
            return [n for t in node.targets for n in targets(t)]
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            return targets(node.target)
        return []

    for node in ast.walk(tree):
        names.update(defined(node))
        if isinstance(node, ast.ClassDef):
            members = classes.setdefault(node.name, set())
            for sub in ast.walk(node):
                if sub is not node:
                    members.update(defined(sub))
    return names, classes


@functools.cache
def python_defs(path: str) -> tuple[set[str], dict[str, set[str]]]:
    """``_python_names`` of a repository file."""
    return _python_names(ast.parse((REPO / path).read_text()))


@functools.cache
def proto_defs() -> dict[str, set[str]]:
    """{message, service or enum name: its fields, rpcs and values} over protos/ (nested
    messages flattened under their own names)."""
    defs: dict[str, set[str]] = {}
    for path in sorted((REPO / "protos").rglob("*.proto")):
        stack: list[str] = []
        for line in path.read_text().splitlines():
            code = line.split("//")[0]
            head = re.match(rf"\s*(message|service|enum|oneof)\s+({IDENT})\s*{{", code)
            if head:
                if head.group(1) != "oneof":
                    defs.setdefault(head.group(2), set())
                    if stack and stack[-1]:
                        defs[stack[-1]].add(head.group(2))
                    stack.append(head.group(2))
                else:
                    stack.append(stack[-1] if stack else "")
                continue
            member = re.match(rf"\s*rpc\s+({IDENT})|\s*(?:[\w.<>, ]+\s+)?({IDENT})\s*=\s*\d+", code)
            if member and stack:
                defs[stack[-1]].add(member.group(1) or member.group(2))
            stack = stack[: len(stack) - code.count("}")] if "}" in code else stack
    return defs


def defined_in(path: str, name: str) -> bool:
    """Whether ``name`` (``a`` or ``A.b``) is defined in the repository file ``path``."""
    if path.endswith(".py"):
        names, classes = python_defs(path)
        head, _, rest = name.partition(".")
        if not rest:
            return head in names
        return head in classes and rest.split(".")[0] in classes[head]
    if path.endswith(".proto"):
        head, _, rest = name.partition(".")
        text = (REPO / path).read_text()
        if not re.search(rf"\b(message|service|enum|rpc)\s+{head}\b|\b{head}\s*=\s*\d+", text):
            return False
        return not rest or rest in proto_defs().get(head, set())
    if path.endswith((".c", ".h")):
        return re.search(rf"\b{re.escape(name)}\b", (REPO / path).read_text()) is not None
    return True


# --- dotted names --------------------------------------------------------------------------

@functools.cache
def class_index() -> dict[str, list[str]]:
    """{class name: the Python files of the repository that define it}."""
    index: dict[str, list[str]] = {}
    for f in repo_files():
        if f.endswith(".py") and f.split("/")[0] in TOP_DIRS:
            for cls in python_defs(f)[1]:
                index.setdefault(cls, []).append(f)
    return index


@functools.cache
def helm_top_keys() -> frozenset[str]:
    values = (REPO / "deploy" / "helm" / "ringserve" / "values.yaml").read_text()
    return frozenset(re.findall(rf"^({IDENT}):", values, re.M))


def module_files(parts: list[str]) -> list[str]:
    """The repository's Python files that the dotted module ``parts`` names (a module or a
    package), by its whole path or by its end."""
    stem = "/".join(parts)
    return resolve_path(stem + ".py") + resolve_path(stem + "/__init__.py")


def dotted_problem(token: str) -> str | None:
    """Why the dotted name ``token`` does not resolve, or None (resolves, or is not checked)."""
    parts = token.split(".")
    if parts[0] in helm_top_keys() or token in NOT_CODE:
        return None
    if token.startswith("ringserve.v1."):
        rest = parts[2:]
        if rest[0] not in proto_defs() or (len(rest) > 1 and rest[1] not in proto_defs()[rest[0]]):
            return f"{'.'.join(rest)} is no message, service or member of protos/"
        return None
    for cut in range(len(parts), 0, -1):
        files = module_files(parts[:cut])
        if not files:
            continue
        rest = parts[cut:]
        if not rest:
            return None
        name = ".".join(rest[:2])
        if any(defined_in(f, name) for f in files):
            return None
        # A submodule named by the rest is fine too (``executor.device`` inside ``services.scheduler``).
        if module_files(parts[: cut + 1]):
            continue
        return f"{name} is not defined in {' or '.join(files)}"
    if parts[0][0].isupper():
        owners = class_index().get(parts[0], [])
        member = parts[1]
        if parts[0] in proto_defs() and member in proto_defs()[parts[0]]:
            return None
        if any(member in python_defs(f)[1][parts[0]] for f in owners):
            return None
        if owners or parts[0] in proto_defs():
            return f"{member} is not defined in class {parts[0]} ({', '.join(owners) or 'protos/'})"
    return None


# --- reading the pages ---------------------------------------------------------------------

def spans(text: str) -> list[Span]:
    """Every inline code span of a Markdown text (a span may wrap onto the next line), and the
    lines of fenced blocks as spans of their own, in page order."""
    out: list[Span] = []
    prose: list[str] = []  # the text with fenced blocks' lines blanked, so offsets keep their line
    fenced = False
    for no, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            prose.append("(fence)")  # not blank: a span after a block does not follow one before it
        elif fenced:
            out.append(Span(line, no, False, True))
            prose.append("")
        else:
            prose.append(line)
    body = "\n".join(prose)
    prev_end = None
    for m in re.finditer(r"`([^`]+)`", body):
        line = body.count("\n", 0, m.start()) + 1
        follows = prev_end is not None and body[prev_end:m.start()].strip() == ""
        out.append(Span(" ".join(m.group(1).split()), line, follows, False))
        prev_end = m.end()
    return sorted(out, key=lambda s: s.line)


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading's text."""
    text = re.sub(r"`|\*|_{2,}|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache
def anchors(path: str) -> frozenset[str]:
    """The anchors a Markdown file of the repository offers."""
    text = (REPO / path).read_text()
    found = set(re.findall(r'<a id="([^"]+)"', text))
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.add(github_anchor(line.lstrip("#")))
    return frozenset(found)


def page_problems(page: Path, text: str | None = None) -> list[str]:
    """Every reference of ``page`` (its ``text``, default the file's) that does not resolve, as
    ``page:line: what``."""
    rel = page.relative_to(REPO).as_posix()
    text = page.read_text() if text is None else text
    problems: list[str] = []

    def problem(line: int, what: str) -> None:
        problems.append(f"{rel}:{line}: {what}")

    last_files: list[str] = []
    for span in spans(text):
        words = span.text.split()
        if not words:
            continue
        if span.fenced or len(words) > 1:
            for word in words:
                word = word.strip("'\"(),;")
                if "/" in word and word.split("/")[0] in TOP_DIRS and _checked_path(word) \
                        and word not in WRITTEN_BY_COMMANDS and not resolve_path(word):
                    problem(span.line, f"`{word}` (in a command) is not in the repository")
            last_files = []
            continue
        token = words[0].removesuffix("()").rstrip(".,:;")
        path, colon, name = token.partition(":")
        if _checked_path(path) and path not in WRITTEN_BY_COMMANDS:
            files = resolve_path(path)
            if not files:
                problem(span.line, f"`{path}` is not in the repository")
            elif colon and not any(defined_in(f, name) for f in files):
                problem(span.line, f"`{name}` is not defined in {' or '.join(files)}")
            last_files = files
            continue
        if span.follows_previous and last_files and re.fullmatch(rf"{IDENT}(\.{IDENT})*", token):
            if not any(defined_in(f, token) for f in last_files):
                problem(span.line, f"`{token}` is not defined in {' or '.join(last_files)}")
        elif DOTTED.fullmatch(token):
            why = dotted_problem(token)
            if why:
                problem(span.line, f"`{token}`: {why}")
        last_files = []

    fenced = False
    for no, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            where = (page.parent / file_part).resolve() if file_part else page
            try:
                rel_target = where.relative_to(REPO).as_posix()
            except ValueError:
                problem(no, f"link `{target}` leaves the repository")
                continue
            if not where.exists():
                problem(no, f"link `{target}`: no {rel_target}")
            elif anchor and where.suffix == ".md" and anchor not in anchors(rel_target):
                problem(no, f"link `{target}`: no anchor #{anchor} in {rel_target}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_reference_resolves(page: Path) -> None:
    assert page_problems(page) == []


def test_the_checker_finds_what_is_missing() -> None:
    """The checker is not vacuous: a missing file (alone, in a command, as a link), a missing
    name after a path (the next span, even on the next line, or ``path:name``), a missing
    member of a class, an unknown module member and a missing anchor are each reported."""
    text = (
        "See `services/scheduler/policy/no_such.py`.\n"
        "It runs `policy/schedule.py` `SchedulePolicy.no_such_method`, then\n"
        "`Engine.no_such_step` and `executor.device.NoSuchRuntime`;\n"
        "`policy/schedule.py:SchedulePolicy` is fine, so is `Engine.step`.\n"
        "[here](serving.md#no-such-heading) and [there](architecture.md#the-four-invariants).\n"
        "`policy/schedule.py:no_such`, `.venv/bin/python bench/no_such.py --x`, [gone](no_such.md),\n"
        "and `models/config.py`\n`ModelConfig.no_such_hf`.\n"
        "```sh\n.venv/bin/python bench/engine.py --model DIR\n```\n"
    )
    assert page_problems(REPO / "docs" / "__probe__.md", text) == [
        "docs/__probe__.md:1: `services/scheduler/policy/no_such.py` is not in the repository",
        "docs/__probe__.md:2: `SchedulePolicy.no_such_method` is not defined in "
        "services/scheduler/policy/schedule.py",
        "docs/__probe__.md:3: `Engine.no_such_step`: no_such_step is not defined in class Engine "
        "(services/scheduler/engine/engine.py)",
        "docs/__probe__.md:3: `executor.device.NoSuchRuntime`: NoSuchRuntime is not defined in "
        "services/scheduler/executor/device.py",
        "docs/__probe__.md:6: `no_such` is not defined in services/scheduler/policy/schedule.py",
        "docs/__probe__.md:6: `bench/no_such.py` (in a command) is not in the repository",
        "docs/__probe__.md:8: `ModelConfig.no_such_hf` is not defined in services/scheduler/models/config.py",
        "docs/__probe__.md:5: link `serving.md#no-such-heading`: no anchor #no-such-heading in docs/serving.md",
        "docs/__probe__.md:6: link `no_such.md`: no docs/no_such.md",
    ]
