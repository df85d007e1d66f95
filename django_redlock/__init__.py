"""django-redlock: safe Redis distributed locks for Django.

>>> import django_redlock
>>> with django_redlock.lock("stock:42") as held:
...     ...   # held.fence is this holder's fencing token

See the docs for the safety model: what a Redis lock promises, and why fencing
is what protects the data when a holder pauses past its lease.
"""

from __future__ import annotations

from types import EllipsisType
from typing import TYPE_CHECKING, Any

from .exceptions import (
    FencedWriteRejected,
    LockKindConflict,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    QuorumUnavailable,
    RedlockError,
)

if TYPE_CHECKING:  # the real imports happen on first use, in __getattr__ below
    from .aio import AsyncLock, alock
    from .conf import get_manager
    from .decorators import (
        current_lock,
        with_lock,
        with_multi_lock,
        with_segments,
        with_semaphore,
    )
    from .engine.held import release_held_locks
    from .engine.lock import Lock
    from .engine.manager import LockManager

__version__ = "0.1.0"

#: Public name -> the submodule that defines it. Importing the package loads only
#: the version and the exceptions (no Django, no redis-py, no asyncio); each of
#: these is imported from its submodule on first access (PEP 562), so
#: ``from django_redlock import with_lock`` works as before.
_LAZY = {
    "alock": "aio",
    "AsyncLock": "aio",
    "get_manager": "conf",
    "current_lock": "decorators",
    "with_lock": "decorators",
    "with_semaphore": "decorators",
    "with_segments": "decorators",
    "with_multi_lock": "decorators",
    "Lock": "engine.lock",
    "LockManager": "engine.manager",
    "release_held_locks": "engine.held",
}


def __getattr__(name: str) -> Any:
    from importlib import import_module

    module = _LAZY.get(name)
    if module is not None:
        value = getattr(import_module(f".{module}", __name__), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    if not name.startswith("_"):
        # A submodule, as when the package imported them all at once
        # (``django_redlock.conf.reset_manager()`` after ``import django_redlock``).
        try:
            return import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise  # the submodule exists but needs something missing: say what
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "lock",
    "alock",
    "multi_lock",
    "amulti_lock",
    "segments",
    "asegments",
    "read_lock",
    "write_lock",
    "aread_lock",
    "awrite_lock",
    "semaphore",
    "asemaphore",
    "with_lock",
    "with_semaphore",
    "with_segments",
    "with_multi_lock",
    "current_lock",
    "release_held_locks",
    "get_manager",
    "LockManager",
    "Lock",
    "AsyncLock",
    "RedlockError",
    "LockNotAcquired",
    "LockLost",
    "LockNotOwned",
    "QuorumUnavailable",
    "FencedWriteRejected",
    "LockKindConflict",
]


def _manager() -> Any:
    from .conf import get_manager

    return get_manager()


def lock(name: str, *, ttl: float | EllipsisType = ..., timeout: float | None | EllipsisType = ...,
         auto_renew: bool | EllipsisType = ..., fencing: bool = True,
         max_hold: float | None | EllipsisType = ..., label: str | None = None,
         reentrant: bool = False) -> Any:
    """A lock on ``name`` from the settings' manager; not yet acquired.

    Use it as a context manager (``with lock("stock:42") as held: ...``) or call
    ``acquire()`` / ``release()``. Options left out fall back to ``REDLOCK``.
    ``reentrant=True``: the same thread may acquire it again without waiting
    (one hold on the nodes, one fence; freed by the matching last release).
    """
    return _manager().lock(name, ttl=ttl, timeout=timeout, auto_renew=auto_renew,
                           fencing=fencing, max_hold=max_hold, label=label,
                           reentrant=reentrant)


def multi_lock(names: Any, **options: Any) -> Any:
    """All of ``names`` or none, deadlock-free whatever order callers give;
    ``.fences`` maps each name to its fence. Options as for :func:`lock`."""
    return _manager().multi_lock(names, **options)


def amulti_lock(names: Any, **options: Any) -> Any:
    """The asyncio twin of :func:`multi_lock`."""
    return _manager().amulti_lock(names, **options)


def segments(name: str, count: int, **options: Any) -> Any:
    """Any one free segment of ``count`` locks on ``name``; ``.index`` is the
    one held. Options as for :func:`lock`."""
    return _manager().segments(name, count, **options)


def asegments(name: str, count: int, **options: Any) -> Any:
    """The asyncio twin of :func:`segments`."""
    return _manager().asegments(name, count, **options)


def read_lock(name: str, **options: Any) -> Any:
    """A shared hold of ``name``: many readers at once, never with a writer; a
    waiting writer stops new readers. Options as for :func:`lock`."""
    return _manager().read_lock(name, **options)


def write_lock(name: str, **options: Any) -> Any:
    """The exclusive hold of ``name``: no reader, no other writer; its fence
    exceeds every earlier reader's and writer's. Options as for :func:`lock`."""
    return _manager().write_lock(name, **options)


def aread_lock(name: str, **options: Any) -> Any:
    """The asyncio twin of :func:`read_lock`."""
    return _manager().aread_lock(name, **options)


def awrite_lock(name: str, **options: Any) -> Any:
    """The asyncio twin of :func:`write_lock`."""
    return _manager().awrite_lock(name, **options)


def semaphore(name: str, permits: int, **options: Any) -> Any:
    """At most ``permits`` holders of ``name`` at once; ``.index`` is the
    permit held. Options as for :func:`lock`."""
    return _manager().semaphore(name, permits, **options)


def asemaphore(name: str, permits: int, **options: Any) -> Any:
    """The asyncio twin of :func:`semaphore`."""
    return _manager().asemaphore(name, permits, **options)
