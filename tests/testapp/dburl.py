"""The optional PostgreSQL database of the test suite, from ``DATABASE_URL``.

``tests/settings.py`` adds the alias ``"postgres"`` when ``DATABASE_URL`` is a
``postgres://user:password@host:port/name`` URL *and* a PostgreSQL driver is
importable; tests marked ``postgres`` run the fenced-write tests on it and skip
otherwise, saying why (:func:`skip_reason`). Parsed by hand: no extra dependency.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

ALIAS = "postgres"


def _driver() -> str | None:
    for name in ("psycopg", "psycopg2"):
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def _url(environ: Mapping[str, str]) -> str:
    url = environ.get("DATABASE_URL", "").strip()
    return url if url.startswith(("postgres://", "postgresql://")) else ""


def postgres_databases(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """``{"postgres": {...}}`` for ``DATABASES``, or ``{}`` when unset or no driver."""
    url = _url(environ)
    if not url or _driver() is None:
        return {}
    parts = urlsplit(url)
    return {ALIAS: {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")) or "postgres",
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }}


def skip_reason(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why the PostgreSQL tests cannot run, or None when they can."""
    if not _url(environ):
        return "DATABASE_URL is not set to a postgres:// URL"
    if _driver() is None:
        return "DATABASE_URL is set but no PostgreSQL driver (psycopg) is installed"
    return None
