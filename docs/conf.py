"""Sphinx configuration for django-redlock.

Built by ``make docs`` (``sphinx-build -W --keep-going``): every warning is an
error, so the build stays honest. No network (intersphinx is off) and no theme
dependency (the built-in ``alabaster``).

Every page the toctrees name must exist: a missing one is an error, not a
silently shorter table of contents.
"""

from __future__ import annotations

import os
import sys

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

