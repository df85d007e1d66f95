"""Which asyncio task awaits which: a call that asyncio runs in a task of
its own (``asyncio.wait_for`` before Python 3.12, ``asyncio.shield``) is
still its caller's, as if awaited directly.

Used where a lock must tell whose an acquisition is: the reentrant locks
(whose hold a task joins, reentrant.py) and the plain ones (which open
``async with`` block a hold taken by hand belongs to, aio.py). Reads
asyncio's private ``_callbacks`` only where they are, with bounded
searches; anything unexpected means "not found".
"""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import types
from typing import Any

#: asyncio's own source files (``wait_for``, ``shield``...): see :func:`runs_alone`.
ASYNCIO_DIR = os.path.dirname(asyncio.__file__) + os.sep


def runs_alone(task: "asyncio.Task[Any]", frame: Any) -> bool:
    """Whether ``frame``'s coroutine (an ``acquire()``, a ``release()``) is all
    that ``task`` runs: the task's own coroutine, or reached from it only
    through asyncio's coroutines (``asyncio.shield(asyncio.wait_for(...))`` on
    Python 3.12, where ``wait_for`` no longer makes a task but ``shield``
    does). A coroutine of the caller's anywhere in between makes it the
    caller's task. While a coroutine runs, its awaiting coroutine is its
    frame's ``f_back``, up to the task's coroutine."""
    top = getattr(task.get_coro(), "cr_frame", None)
    if top is None or frame is None:
        return False
    while frame is not top:
        frame = frame.f_back
        if frame is None or not frame.f_code.co_filename.startswith(ASYNCIO_DIR):
            return False
    return True


def _asyncio_function(function: Any, qualname: str) -> bool:
    """Whether ``function`` is asyncio's own ``asyncio.tasks.<qualname>``."""
    return (getattr(function, "__module__", None) == "asyncio.tasks"
            and getattr(function, "__qualname__", None) == qualname)


def _passes_through(callback: Any) -> bool:
    """Whether a done callback is one by which ``asyncio.shield`` or
    ``asyncio.wait_for`` (before 3.12) hand their task's outcome to the
    future their caller awaits: the caller awaits the task as if directly.
    ``gather``'s, ``asyncio.wait``'s, a ``TaskGroup``'s or a plain ``await
    task`` are not: the task awaited there is a task of its own (a child),
    not its caller's await made in another task."""
    if isinstance(callback, functools.partial):
        return _asyncio_function(callback.func, "_release_waiter")  # wait_for, 3.10, 3.11
    return _asyncio_function(callback, "shield.<locals>._inner_done_callback")


def _futures_of(callback: Any) -> list["asyncio.Future[Any]"]:
    """The futures a done callback refers to: the arguments of a
    ``functools.partial`` (``wait_for``'s ``_release_waiter``) or the variables
    a closure keeps (``shield``'s and ``gather``'s ``outer``)."""
    if isinstance(callback, functools.partial):
        refs = [*callback.args, *(callback.keywords or {}).values()]
    else:
        refs = []
        for cell in getattr(callback, "__closure__", None) or ():
            try:
                refs.append(cell.cell_contents)
            except ValueError:  # a cell not yet filled
                continue
    return [ref for ref in refs if isinstance(ref, asyncio.Future)]


def awaiting_task(task: "asyncio.Task[Any]", any_await: bool) -> "asyncio.Task[Any] | None":
    """The task that awaits ``task`` when it can be found, else None; only
    through ``shield`` or ``wait_for`` (:func:`_passes_through`) unless
    ``any_await``.

    A task awaiting a future adds its wake-up method to the future's done
    callbacks (its ``__self__`` is that task: the C and the Python tasks of
    3.10 to 3.13 alike). ``await task`` adds it to ``task`` itself;
    ``asyncio.shield`` and ``wait_for`` (before 3.12) make the caller await
    another future, which ``task``'s own done callback completes: that
    callback's partial or closure refers to it. ``_callbacks`` is private: read
    only if there, with a bounded search, and anything unexpected means "not
    found"."""
    todo: list[asyncio.Future[Any]] = [task]
    seen: set[int] = set()
    while todo and len(seen) < 16:
        future = todo.pop(0)
        if id(future) in seen:
            continue
        seen.add(id(future))
        for entry in list(getattr(future, "_callbacks", None) or ()):
            callback = entry[0] if isinstance(entry, tuple) else entry
            owner = getattr(callback, "__self__", None)
            if isinstance(owner, asyncio.Task) and owner is not task:
                if any_await or future is not task:  # not a plain ``await task``
                    return owner
            elif any_await or _passes_through(callback):
                todo.extend(_futures_of(callback))
    return None


_ASYNC_GEN_AWAITABLES = frozenset({"async_generator_asend", "async_generator_athrow"})


def awaited_frames(coro: Any, limit: int = 256) -> "dict[int, Any]":
    """The frames of ``coro`` (a task's coroutine) and of what it awaits,
    down its suspended chain of awaits: id -> the frame.

    An ``async for`` (``await agen.asend()``, ``athrow``, ``aclose``)
    awaits an object that leads to no frame and names no generator: its
    generator, whose frame runs an ``async with`` block there, is found
    among what that object refers to (``gc.get_referents``, which reads the
    references the collector follows: no private attribute)."""
    frames: dict[int, Any] = {}
    for _ in range(limit):  # bounded: a deep chain is followed down its first `limit` steps
        if coro is None:
            break
        frame = (getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                 or getattr(coro, "ag_frame", None))
        if frame is None:
            coro = _async_generator_of(coro)
            continue
        frames[id(frame)] = frame
        coro = (getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
                or getattr(coro, "ag_await", None))
    return frames


def _async_generator_of(awaitable: Any) -> Any:
    """The async generator an ``asend`` / ``athrow`` object runs, else None."""
    if type(awaitable).__name__ not in _ASYNC_GEN_AWAITABLES:
        return None
    for referent in gc.get_referents(awaitable):
        if isinstance(referent, types.AsyncGeneratorType):
            return referent
    return None
