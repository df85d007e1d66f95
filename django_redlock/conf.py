"""Settings: read lazily, validated once, rebuilt when they change.

Nothing is read at import time and nothing is written back into
``django.conf.settings`` (debug-toolbar's ``get_config()`` pattern): the manager is
built on first use from ``REDLOCK_NODES`` and ``REDLOCK``, and retired when a
``setting_changed`` signal (``override_settings`` in tests) touches them, or
``CACHES`` when a ``cache:`` node is configured. A retired manager is no longer
handed out; it is closed at once when nothing of it is in use, else by a later
``get_manager()`` once the locks it still held are gone (``LockManager.retire``).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver

from .core.config import check_cache_aliases, check_options, parse_nodes, resolve_options

if TYPE_CHECKING:
    from .engine.manager import LockManager

_lock = threading.Lock()
_manager: LockManager | None = None
#: Managers a settings change retired that were still needed then (held
#: locks, releases in flight or to send again): closed by a later look once
#: nothing needs them (a lock lost or dropped unreleased never says so).
_retired: weakref.WeakSet[LockManager] = weakref.WeakSet()
_next_look = 0.0
#: How often ``get_manager()`` looks at the retired managers (seconds).
RETIRED_LOOK_EVERY = 5.0

WATCHED_SETTINGS = frozenset({"REDLOCK_NODES", "REDLOCK", "CACHES"})


def get_options() -> dict[str, Any]:
    """The ``REDLOCK`` dict merged with the documented defaults (upper-case keys)."""
    return resolve_options(getattr(settings, "REDLOCK", None) or {})


def _settings_errors() -> str:
    """The ``redlock.E0xx`` errors in the settings, as one message ("" when none).

    A helper of its own so that the raw ``REDLOCK_NODES`` (passwords and all)
    is not a local variable of the frame that raises: Django's debug page and
    error e-mails show every frame's locals.
    """
    options = getattr(settings, "REDLOCK", None)
    problems = check_options(options)
    specs, node_problems = parse_nodes(getattr(settings, "REDLOCK_NODES", None))
    problems += node_problems
    # A cache: node whose alias is missing or not django-redis: E006 here, not
    # an ImproperlyConfigured at the first acquire (from a set-up thread).
    problems += check_cache_aliases(specs, getattr(settings, "CACHES", {}))
    return "; ".join(f"redlock.{p.id}: {p.msg}" for p in problems if p.is_error)


def get_manager() -> LockManager:
    """The :class:`LockManager` built from settings; built on first call.

    Raises ``ImproperlyConfigured`` (with the ``redlock.E0xx`` ids and wording
    that ``manage.py check`` reports) when the settings are invalid.
    """
    global _manager
    if _retired and time.monotonic() >= _next_look:
        _look_at_retired()
    manager = _manager
    if manager is not None:
        return manager
    with _lock:
        if _manager is None:
            from .engine.manager import LockManager

            errors = _settings_errors()
            if errors:
                raise ImproperlyConfigured(errors)
            options = getattr(settings, "REDLOCK", None) or {}
            _manager = LockManager(settings.REDLOCK_NODES,
                                   **{k.lower(): v for k, v in options.items()})
        return _manager


def _look_at_retired() -> None:
    """Close the retired managers nothing needs any more (at most every
    ``RETIRED_LOOK_EVERY`` seconds, from ``get_manager()``), in a thread of
    its own: closing joins a manager's threads (seconds at worst), which the
    caller (a request; an event loop through ``sync_to_async``) must not
    wait for."""
    global _next_look
    _next_look = time.monotonic() + RETIRED_LOOK_EVERY
    managers = list(_retired)

    def look() -> None:
        for manager in managers:
            if manager._close_if_idle():
                _retired.discard(manager)

    try:
        threading.Thread(target=look, name="redlock-retired", daemon=True).start()
    except RuntimeError:  # the interpreter is shutting down: nothing to close for
        pass


def reset_manager() -> None:
    """Forget the settings' manager (the next ``get_manager()`` rebuilds it)
    and retire it: it is closed at once when nothing of it is in use, else by
    a later look (:func:`_look_at_retired`) once nothing is, and until then
    keeps renewing the locks it holds (``LockManager.retire``: closing it
    here stopped their renewal silently, and a second holder got in once
    their leases ran out)."""
    global _manager
    with _lock:
        manager, _manager = _manager, None
    if manager is not None:
        manager.retire()
        if not manager._closed:
            _retired.add(manager)


def _uses_caches(manager: LockManager | None) -> bool:
    """Whether ``manager`` borrows a connection pool from ``CACHES`` (a ``cache:`` node)."""
    return manager is not None and any(node.spec.kind == "cache" for node in manager.nodes)


@receiver(setting_changed)
def _on_setting_changed(*, setting: str, **kwargs: Any) -> None:
    # CACHES matters only to a manager with a cache: node; others are left
    # alone (every override_settings(CACHES=...) in a test suite rebuilt the
    # manager and its connections for nothing).
    if setting in WATCHED_SETTINGS and (setting != "CACHES" or _uses_caches(_manager)):
        reset_manager()
