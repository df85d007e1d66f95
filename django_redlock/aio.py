"""asyncio: :func:`alock` and :class:`AsyncLock`.

``async with alock("stock:42") as held: ...`` takes the lock without blocking
the event loop; everything :class:`~django_redlock.Lock` promises holds for
:class:`AsyncLock` too. The lock itself lives in the engine
(:mod:`django_redlock.engine.aio`, the asyncio driver of the protocol that
:mod:`django_redlock.engine.lock` writes once); this module is its public face
and the settings' entry point.
"""

from __future__ import annotations

from types import EllipsisType
from typing import Any

from .conf import get_manager
from .engine.aio import AsyncLock

__all__ = ["AsyncLock", "alock"]


def alock(name: str, *, ttl: float | EllipsisType = ...,
          timeout: float | None | EllipsisType = ..., auto_renew: bool | EllipsisType = ...,
          fencing: bool = True, max_hold: float | None | EllipsisType = ...,
          label: str | None = None, reentrant: bool = False) -> Any:
    """An :class:`AsyncLock` on ``name`` from the settings' manager; not yet acquired.

    ``async with alock("stock:42") as held: ...``. Options left out fall back to
    ``REDLOCK``. Building the manager does no I/O, so this is safe to call in a
    coroutine. ``reentrant=True``: the same asyncio task may acquire it again
    without waiting.
    """
    return get_manager().alock(name, ttl=ttl, timeout=timeout, auto_renew=auto_renew,
                               fencing=fencing, max_hold=max_hold, label=label,
                               reentrant=reentrant)
