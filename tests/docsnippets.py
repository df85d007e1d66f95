"""The Python blocks of the README and the docs, found and run by the snippet tests.

Every Python block a user may copy (``.. code-block:: python`` and its aliases in
reStructuredText, a ```` ```python ```` fence in Markdown) is preceded by a marker,
``.. snippet: NAME`` or ``<!-- snippet: NAME -->``, with nothing but blank lines
between the marker and the block. A test named ``test_snippet_<name>`` (``-`` read
as ``_``) in ``tests/`` runs it and checks what it did:
``tests/test_doc_examples.py::test_every_python_block_is_marked_and_executed``
walks *every* page, not a list, and fails on a block without a marker, a marker
without its test, a test whose marker is gone, and a ``::`` literal block that is
Python code (those must be marked ``code-block:: python`` blocks; a ``::`` block of
timelines, shell lines or a JSON result is text and is left alone).

Blocks run with :func:`run`: the docs' ``shop`` app and its ``Item``/``Product``
are the test app's ``Product`` (:data:`RENAMES`), and :func:`run` takes whatever
else a block uses but does not define (``pk``, ``rows``, ``log``...).
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import django_redlock

ROOT = Path(__file__).resolve().parent.parent

#: The languages of a ``code-block``/``code``/``sourcecode`` directive (or a
#: Markdown fence) that are Python.
PYTHON = {"python", "py", "python3", "py3", "pycon", "ipython", "ipython3"}
MARKER = re.compile(r"\s*(?:\.\. snippet: |<!-- snippet: )([\w-]+)(?: -->)?\s*$")
DIRECTIVE = re.compile(r"(\s*)\.\. (?:code-block|code|sourcecode)::\s*(\S*)\s*$")
FENCE = re.compile(r"\s*```\s*([\w+-]*)")

#: What the docs call things the test app names differently.
RENAMES = {"shop.product": "testapp.product", "inventory.item": "testapp.product",
           "warehouse=7": "name='w7'", "from shop.models import": "from tests.testapp.models import"}


@dataclass(frozen=True)
class Block:
    path: str
    line: int            # 1-based line of the directive, fence or ``::`` paragraph
    lang: str            # the directive's language; "::" for a literal block
    marker: str | None
    code: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files() -> list[str]:
    """README.md and every page under docs/ (not a hand-made list)."""
    pages = [p for p in (ROOT / "docs").rglob("*") if p.suffix in (".rst", ".md")
             and "_build" not in p.parts]
    return ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in pages)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _rst_body(lines: list[str], start: int, indent: int, *, options: bool) -> tuple[str, int]:
    """The body of a directive or literal block opened on line ``start - 1``: the
    lines indented deeper than ``indent`` (and the blank ones between them)."""
    j = start
    if options:  # the directive's :options: come first
        while j < len(lines) and lines[j].strip().startswith(":") and _indent(lines[j]) > indent:
            j += 1
    body: list[str] = []
    while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > indent):
        body.append(lines[j])
        j += 1
    return textwrap.dedent("\n".join(body)).strip("\n"), j


def blocks(path: str) -> list[Block]:
    """Every code block of ``path`` that is Python, or a ``::`` literal block
    (whatever it holds: :func:`looks_like_python` tells), with its marker."""
    lines = (ROOT / path).read_text().splitlines()
    out: list[Block] = []
    marker: str | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        m = MARKER.match(line)
        fence = FENCE.match(line) if path.endswith(".md") else None
        directive = DIRECTIVE.match(line) if path.endswith(".rst") else None
        if m:
            marker = m.group(1)
            i += 1
            continue
        if fence:
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith("```"):
                j += 1
            if fence.group(1).lower() in PYTHON or marker:
                out.append(Block(path, i + 1, fence.group(1).lower(), marker,
                                 "\n".join(lines[i + 1:j])))
            marker, i = None, j + 1
            continue
        if directive:
            code, j = _rst_body(lines, i + 1, len(directive.group(1)), options=True)
            lang = directive.group(2).lower()
            if lang in PYTHON or marker:
                out.append(Block(path, i + 1, lang, marker, code))
            marker, i = None, j
            continue
        if (path.endswith(".rst") and line.rstrip().endswith("::")
                and not line.lstrip().startswith(".. ")):
            code, j = _rst_body(lines, i + 1, _indent(line), options=False)
            out.append(Block(path, i + 1, "::", marker, code))
            marker, i = None, j
            continue
        if line.strip():
            marker = None  # a marker names the block right after it, nothing later
        i += 1
    return out


def looks_like_python(code: str) -> bool:
    """A ``::`` block that is Python code a user would copy: it compiles, and it
    is not only literals (a JSON result, a dict a task returns)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    for node in tree.body:
        if not isinstance(node, ast.Expr):
            return True
        try:
            ast.literal_eval(node.value)
        except ValueError:
            return True
    return False


def python_blocks() -> list[Block]:
    return [b for path in doc_files() for b in blocks(path)
            if b.lang != "::" or looks_like_python(b.code)]


def _snippets() -> dict[str, Block]:
    found: dict[str, Block] = {}
    for block in python_blocks():
        if block.marker:
            assert block.marker not in found, (
                f"snippet {block.marker!r} is marked twice: {found[block.marker].where}, "
                f"{block.where}")
            found[block.marker] = block
    return found


SNIPPETS = _snippets()


def code(name: str) -> str:
    """The snippet's code with the docs' names replaced by the test app's."""
    text = SNIPPETS[name].code
    for old, new in RENAMES.items():
        text = text.replace(old, new)
    return text


def run(name: str, ns: dict[str, Any] | None = None, *, replace: dict[str, str] | None = None,
        **namespace: Any) -> dict[str, Any]:
    """Execute snippet ``name`` in ``ns`` (a new dict by default) and return it.

    ``replace`` rewrites text first (a documented address to a test server's);
    ``namespace`` adds names the block uses without defining them.
    """
    from django.http import JsonResponse

    from tests.testapp.models import Product

    text = code(name)
    for old, new in (replace or {}).items():
        assert old in text, f"snippet {name!r} no longer says {old!r}"
        text = text.replace(old, new)
    ns = {} if ns is None else ns
    ns.update({"django_redlock": django_redlock, "Item": Product, "Product": Product,
               "JsonResponse": JsonResponse, "__name__": "doc_snippet"})
    ns.update(namespace)
    exec(compile(text, f"<snippet {name}>", "exec"), ns)  # noqa: S102 - our own docs
    return ns


def tested_snippets() -> dict[str, list[str]]:
    """snippet name -> where a ``test_snippet_<name>`` test is, for every such test
    in tests/*.py that names its snippet (a string constant in its body)."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if not (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and node.name.startswith("test_snippet_")):
                continue
            name = node.name[len("test_snippet_"):].replace("_", "-")
            strings = {c.value for c in ast.walk(node)
                       if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            where = f"{path.relative_to(ROOT)}::{node.name}"
            found.setdefault(name, []).append(where if name in strings
                                              else f"{where} (never names {name!r})")
    return found
