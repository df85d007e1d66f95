"""Sphinx configuration for django-redlock.

Built by ``make docs`` (``sphinx-build -W --keep-going``): every warning is an
error, so the build stays honest. No network (intersphinx is off) and no theme
dependency (the built-in ``alabaster``).

The toctrees in ``index.rst`` use ``:glob:`` patterns (``howto/*``, ``commands*``)
and ``toc.empty_glob`` is suppressed, so a pattern with no page yet is not an error.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

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
# Optional extras: the docs build without them (tox's docs env has only sphinx).
autodoc_mock_imports = ["prometheus_client"]
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
def _glob_matches(srcdir: Any, pattern: str) -> bool:
    import glob

    root = str(srcdir)
    for ext in (".rst", ".md"):
        for path in glob.glob(os.path.join(root, pattern + ext)):
            if "_build" not in os.path.relpath(path, root).split(os.sep):
                return True
    return False


def setup(app: Any) -> None:
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
