"""Sphinx configuration for django-redlock.

Built by ``make docs`` (``sphinx-build -W --keep-going``): every warning is an
error, so the build stays honest. No network (intersphinx is off) and no theme
dependency (the built-in ``alabaster``).

Some pages and modules are written by other people at the same time as these
docs. Two small helpers keep the build green whichever of them exist yet:

* ``.. optional-automodule:: dotted.name`` documents a module with autodoc when it
  can be found, and says plainly that it is not part of this build otherwise;
* ``:optdoc:`text <page>``` links to a page when ``page.rst`` exists and renders
  the text without a link otherwise.

The toctrees in ``index.rst`` use ``:glob:`` patterns (``howto/*``, ``commands*``)
and ``toc.empty_glob`` is suppressed, so a pattern with no page yet is not an error.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from typing import Any, ClassVar

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# -- Django, before autodoc imports anything ------------------------------------
import django
from django.conf import settings

if not settings.configured:
    settings.configure(
        SECRET_KEY="docs-only-not-secret",
        INSTALLED_APPS=[
            "django.contrib.contenttypes",
            "django.contrib.auth",
            "django_redlock",
        ],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        USE_TZ=True,
        # Never contacted: autodoc only imports the code.
        REDLOCK_NODES=["redis://127.0.0.1:6379/0"],
    )
django.setup()

import django_redlock

# -- Project ----------------------------------------------------------------------
project = "django-redlock"
author = "the django-redlock authors"
copyright = "2026, the django-redlock authors"
release = django_redlock.__version__
version = ".".join(release.split(".")[:2])

# -- General ----------------------------------------------------------------------
extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
]
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
root_doc = "index"
nitpicky = False
suppress_warnings = [
    # index.rst globs pages other engineers add (howto/*, commands, ...);
    # a pattern that matches nothing yet is fine.
    "toc.empty_glob",
]
pygments_style = "sphinx"

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_default_options = {
    "members": True,
    "show-inheritance": True,
}

# -- HTML -------------------------------------------------------------------------
html_theme = "alabaster"
html_title = f"django-redlock {release}"
html_theme_options = {
    "description": "Safe Redis distributed locks for Django",
    "fixed_sidebar": True,
    "show_relbars": True,
}
html_sidebars = {
    "**": ["about.html", "navigation.html", "relations.html", "searchbox.html"],
}


# -- Helpers for pages and modules that may not exist yet --------------------------
def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _page_exists(srcdir: str, docname: str) -> bool:
    return any(os.path.exists(os.path.join(srcdir, docname + ext)) for ext in (".rst", ".md"))


def _glob_matches(srcdir: Any, pattern: str) -> bool:
    import glob

    root = str(srcdir)
    for ext in (".rst", ".md"):
        for path in glob.glob(os.path.join(root, pattern + ext)):
            if "_build" not in os.path.relpath(path, root).split(os.sep):
                return True
    return False


def setup(app: Any) -> None:
    from docutils import nodes
    from docutils.parsers.rst import Directive, directives
    from docutils.statemachine import StringList

    class OptionalAutomodule(Directive):
        """``automodule`` when the module can be found; a plain note otherwise."""

        required_arguments = 1
        has_content = False
        option_spec: ClassVar[dict[str, Any]] = {
            "members": directives.unchanged, "no-members": directives.flag}

        def run(self) -> list[Any]:
            name = self.arguments[0]
            if not _module_exists(name):
                para = nodes.paragraph()
                para += nodes.Text("Module ")
                para += nodes.literal(name, name)
                para += nodes.Text(" is not part of this build yet.")
                return [nodes.note("", para)]
            lines = [f".. automodule:: {name}"]
            if "no-members" in self.options:
                lines.append("   :no-members:")
            elif self.options.get("members"):
                lines.append(f"   :members: {self.options['members']}")
            source = self.state_machine.get_source(self.lineno)
            self.state_machine.insert_input(StringList(lines + [""], source), source)
            return []

    def optdoc_role(name: str, rawtext: str, text: str, lineno: int, inliner: Any,
                    options: dict[str, Any] | None = None,
                    content: list[str] | None = None) -> tuple[list[Any], list[Any]]:
        """``:doc:`` when the target page exists, plain emphasis otherwise."""
        env = inliner.document.settings.env
        match = re.match(r"^(.*?)\s*<([^<>]+)>$", text, re.DOTALL)
        title, target = (match.group(1), match.group(2)) if match else (None, text)
        docname = target.strip()
        if not docname.startswith("/"):
            docname = os.path.join(os.path.dirname(env.docname), docname)
        if _page_exists(env.srcdir, os.path.normpath(docname.lstrip("/"))):
            role = env.get_domain("std").role("doc")
            return role("std:doc", rawtext, text, lineno, inliner, options or {}, content or [])
        shown = title or target
        return [nodes.emphasis(rawtext, shown)], []

    def drop_empty_globs(app: Any, docname: str, source: list[str]) -> None:
        """Remove toctree glob entries that match no page yet.

        Sphinx warns about an empty glob (and, in the versions we use, that
        warning cannot be silenced through ``suppress_warnings``), which ``-W``
        turns into an error. Pages such as ``howto/*`` or ``commands`` are added
        by other people over time; until one exists its entry is simply dropped.
        """
        if docname != root_doc:
            return
        out = []
        for line in source[0].splitlines(keepends=True):
            match = re.match(r"^\s+([\w./-]*[*?\[][\w./*?\[\]-]*)\s*$", line)
            if match and not _glob_matches(app.srcdir, match.group(1)):
                continue
            out.append(line)
        source[0] = "".join(out)

    app.connect("source-read", drop_empty_globs)
    app.add_directive("optional-automodule", OptionalAutomodule)
    app.add_role("optdoc", optdoc_role)
