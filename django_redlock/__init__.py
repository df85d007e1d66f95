"""django-redlock: safe Redis distributed locks for Django.

>>> import django_redlock
>>> with django_redlock.lock("stock:42") as held:
...     ...   # held.fence is this holder's fencing token

See the docs for the safety model: what a Redis lock promises, and why fencing
is what protects the data when a holder pauses past its lease.
"""

from __future__ import annotations

from types import EllipsisType

from .aio import AsyncLock, alock
from .conf import get_manager
from .decorators import current_lock, with_lock
from .exceptions import (
    FencedWriteRejected,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    QuorumUnavailable,
    RedlockError,
)
from .lock import Lock, release_held_locks
from .manager import LockManager

__version__ = "0.1.0"

__all__ = [
    "lock",
    "alock",
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
         max_hold: float | None | EllipsisType = ..., label: str | None = None) -> Lock:
    """A lock on ``name`` from the settings' manager; not yet acquired.

    Use it as a context manager (``with lock("stock:42") as held: ...``) or call
    ``acquire()`` / ``release()``. Options left out fall back to ``REDLOCK``.
    """
    return get_manager().lock(name, ttl=ttl, timeout=timeout, auto_renew=auto_renew,
                              fencing=fencing, max_hold=max_hold, label=label)
