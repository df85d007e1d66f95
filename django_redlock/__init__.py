"""django-redlock: safe Redis distributed locks for Django.

>>> import django_redlock
>>> with django_redlock.lock("stock:42") as held:
...     ...   # held.fence is this holder's fencing token

See the docs for the safety model: what a Redis lock promises, and why fencing
is what protects the data when a holder pauses past its lease.
"""

from __future__ import annotations

import sys
from types import EllipsisType, ModuleType
from typing import TYPE_CHECKING, Any

from .exceptions import (
    FencedWriteRejected,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    QuorumUnavailable,
    RedlockError,
)

if TYPE_CHECKING:  # the real imports happen on first use, in __getattr__ below
    from .aio import AsyncLock, alock
    from .conf import get_manager
    from .decorators import current_lock, with_lock
    from .lock import Lock
    from .manager import LockManager

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
    "Lock": "lock",
    "LockManager": "manager",
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
    "with_lock",
    "current_lock",
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
    from .conf import get_manager

    return get_manager().lock(name, ttl=ttl, timeout=timeout, auto_renew=auto_renew,
                              fencing=fencing, max_hold=max_hold, label=label)


class _Package(ModuleType):
    """The package's module type: keeps ``django_redlock.lock`` the function.

    Importing the submodule ``django_redlock.lock`` (which now happens on first
    use, not at package import) makes Python set the package attribute ``lock``
    to that submodule; this keeps the documented function instead. The submodule
    stays importable as ``django_redlock.lock`` through ``sys.modules``.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "lock" and isinstance(value, ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
