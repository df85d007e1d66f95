"""The package's layout keeps what docs/architecture.rst promises (issue 19).

Read from the source, not by importing it: every ``import`` statement counts,
those inside functions (lazy) and under ``TYPE_CHECKING`` included, since a
lazy import is a dependency all the same.

* no import circle anywhere in the package;
* dependencies point down: the Django layer -> ``engine/`` -> ``transport/`` ->
  ``core/``; ``exceptions`` is a leaf any layer may use (the signals the
  engine sends live in ``engine/events``; ``signals`` re-exports them); the
  harness (``testing/``) stands beside the layers and uses only ``transport/resp``
  and ``core/``;
* a module of more than about 600 lines says at its top why it is one module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "django_redlock"
LONG = 600  # "about 600 lines"
LEAVES = {"django_redlock.exceptions"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _package_of(module: str) -> str:
    path = MODULES[module]
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _target(name: str) -> str | None:
    """The module of ours that importing ``name`` loads last (None: not ours)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (hit := _target(alias.name)) is not None:
                    out.add(hit)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module)
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:
                # "from .. import signals" imports the module signals;
                # "from .lock import Lock" imports the module lock.
                hit = _target(f"{source}.{alias.name}")
                if hit is not None and hit != source and f"{source}.{alias.name}" in MODULES:
                    out.add(hit)
                elif (hit := _target(source)) is not None:
                    out.add(hit)
    out.discard(module)
    return out


GRAPH = {module: _imports(module) for module in MODULES}


def _layer(module: str) -> str:
    parts = module.split(".")
    if module in LEAVES:
        return "leaf"
    if len(parts) > 1 and parts[1] in ("core", "transport", "engine", "testing"):
        return parts[1]
    return "django"


# What each layer may import of ours (besides itself).
ALLOWED = {
    "leaf": set(),
    "core": {"leaf"},
    "transport": {"core", "leaf"},
    "engine": {"transport", "core", "leaf"},
    "testing": {"transport", "core", "leaf"},  # transport/resp only: see below
    "django": {"engine", "transport", "core", "leaf", "testing"},
}


def test_the_graph_was_read() -> None:
    assert len(MODULES) > 40
    assert "django_redlock.engine.protocol" in GRAPH["django_redlock.engine.lock"]
    assert "django_redlock.engine.events" in GRAPH["django_redlock.engine.lock"]  # from . import events
    assert "django_redlock.engine.events" in GRAPH["django_redlock.signals"]
    assert _layer("django_redlock.signals") == "django"
    assert _layer("django_redlock.engine.events") == "engine"
    assert "django_redlock.transport.resp" in GRAPH["django_redlock.testing.base"]


def test_no_import_circle() -> None:
    # Tarjan's strongly connected components, iteratively.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in GRAPH:
        if root in index:
            continue
        work = [(root, iter(sorted(GRAPH[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(GRAPH[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    assert circles == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_dependencies_point_down(module: str) -> None:
    layer = _layer(module)
    wrong = sorted(dep for dep in GRAPH[module]
                   if _layer(dep) != layer and _layer(dep) not in ALLOWED[layer])
    assert wrong == [], f"{module} ({layer}) imports {wrong}"


def test_a_leaf_imports_nothing_of_ours() -> None:
    # What makes a leaf safe for every layer; a module that imports one of ours
    # cannot be declared a leaf to hide an import of a layer above.
    assert {leaf: GRAPH[leaf] for leaf in LEAVES} == {leaf: set() for leaf in LEAVES}


def test_the_lower_layers_reach_no_module_of_the_django_layer() -> None:
    """engine/, transport/ and core/ load no Django-layer module of ours, not even
    through another module (what they import, and what that imports, ...)."""
    reached: dict[str, list[str]] = {}
    for module in GRAPH:
        if _layer(module) not in ("engine", "transport", "core"):
            continue
        seen: set[str] = set()
        todo = [module]
        while todo:  # bounded: each module of ours is visited once
            for dep in GRAPH[todo.pop()]:
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        if above := sorted(dep for dep in seen if _layer(dep) == "django"):
            reached[module] = above
    assert reached == {}


def test_the_harness_uses_only_the_reply_reader_of_the_transport() -> None:
    used = {dep for module, deps in GRAPH.items() if _layer(module) == "testing"
            for dep in deps if _layer(dep) == "transport"}
    assert used <= {"django_redlock.transport.resp"}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_long_module_says_why(module: str) -> None:
    text = MODULES[module].read_text()
    if text.count("\n") <= LONG:
        return
    docstring = ast.get_docstring(ast.parse(text)) or ""
    assert "Why one module" in docstring[:600], (
        f"{module}: {text.count(chr(10))} lines and no '(Why one module ...)' at its top")
