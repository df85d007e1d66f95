"""django-redlock: safe Redis distributed locks for Django.

>>> import django_redlock
>>> with django_redlock.lock("stock:42") as held:
...     ...   # held.fence is this holder's fencing token

See the docs for the safety model: what a Redis lock promises, and why fencing
is what protects the data when a holder pauses past its lease.
"""

from __future__ import annotations

from types import EllipsisType
from typing import Any

from .aio import AsyncLock, alock
from .conf import get_manager
from .decorators import current_lock, with_lock
from .engine.lock import Lock, release_held_locks
from .engine.manager import LockManager
from .exceptions import (
    FencedWriteRejected,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    QuorumUnavailable,
    RedlockError,
)

__version__ = "0.1.0"

__all__ = [
    "lock",
    "alock",
    "multi_lock",
    "amulti_lock",
    "segments",
    "asegments",
    "with_lock",
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
]


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
    return get_manager().lock(name, ttl=ttl, timeout=timeout, auto_renew=auto_renew,
                              fencing=fencing, max_hold=max_hold, label=label,
                              reentrant=reentrant)


def multi_lock(names: Any, **options: Any) -> Any:
    """All of ``names`` or none, deadlock-free whatever order callers give;
    ``.fences`` maps each name to its fence. Options as for :func:`lock`."""
    return get_manager().multi_lock(names, **options)


def amulti_lock(names: Any, **options: Any) -> Any:
    """The asyncio twin of :func:`multi_lock`."""
    return get_manager().amulti_lock(names, **options)


def segments(name: str, count: int, **options: Any) -> Any:
    """Any one free segment of ``count`` locks on ``name``; ``.index`` is the
    one held. Options as for :func:`lock`."""
    return get_manager().segments(name, count, **options)


def asegments(name: str, count: int, **options: Any) -> Any:
    """The asyncio twin of :func:`segments`."""
    return get_manager().asegments(name, count, **options)
