"""Locks still held when the process exits are released, not left for a TTL.

Every lock this process acquires is enrolled here, weakly (a lock object
dropped without release just expires). :func:`release_held_locks` runs at
normal interpreter exit (:mod:`atexit`); see its docstring for SIGTERM.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from ..transport import finalizers

logger = finalizers.get_logger("django_redlock.lock")

#: Every lock this process acquired, held weakly (a lock dropped without
#: release just expires): at interpreter exit the ones still held are
#: released (:func:`release_held_locks`), not left to block others for a TTL.
_acquired: "weakref.WeakSet[Any]" = weakref.WeakSet()
_acquired_guard = threading.Lock()


def _after_fork_in_child() -> None:
    """A fork may happen while a parent thread holds the guard: the child's
    copy would stay held by a thread that does not exist there.

    So may every sync lock's ``_io``: the renewal thread holds it for its
    whole round (a slow node stretches that to a node timeout or more), and
    the child's ``release()``, ``extend()`` or ``acquire()`` of the inherited
    object waited for it forever. Each lock this process acquired gets a new
    one in the child, unless the forking thread itself holds it (it lets it
    go as it unwinds)::

        parent  renewal thread: extend round of L, holding L._io; node 3 slow
        parent  fork() from the main thread
        child   L.release() waits for L._io: no thread there ever lets it go
    """
    global _acquired_guard
    _acquired_guard = threading.Lock()
    try:
        # weak references (WeakSet's own set); no lock of this process is taken
        locks = list(getattr(_acquired, "data"))  # noqa: B009 - not in the type stubs
    except Exception:  # noqa: BLE001 - a set changed mid-fork: nothing else to do
        return
    for ref in locks:
        lock = ref()
        io = getattr(lock, "_io", None)
        if io is None or isinstance(io, asyncio.Lock) or io._is_owned():
            continue
        lock._io = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def release_held_locks() -> int:
    """Release every lock this process still holds; return how many were released.

    Runs by itself at normal interpreter exit (:mod:`atexit`), which covers
    gunicorn's and uvicorn's graceful stop on SIGTERM (their workers exit
    through ``sys.exit``). A process that dies on a bare SIGTERM runs no
    atexit hook: such a program calls this from its own SIGTERM handler, or
    turns SIGTERM into ``SystemExit`` (see the how-to on shutting down).

    Both sync and asyncio locks are released here, through the manager's sync
    transport (no event loop is needed, so a lock left held when
    ``asyncio.run`` ended is released too). Each release is bounded by the node
    timeouts; a node that cannot be reached keeps the key until its lease
    ends. No ``lock_released`` signal is sent: receivers may be gone at exit.
    Locks of a parent process are not touched from a forked child (nor
    waited for: a parent thread renewing one at the fork does not exist in
    the child). The whole takes at most :data:`EXIT_BUDGET` (5 s) plus one
    release round and :data:`EXIT_FLUSH`: with nodes that do not answer, the
    locks left are not released, and expire with their leases.

    The signals of releases a garbage collection ran, handed to the
    library's thread (``transport/finalizers.py``: a daemon, that dies with
    the process), are waited for last, for what is left of the budget and
    at most :data:`EXIT_FLUSH`: a receiver that is slow (or waits for a lock
    the exiting thread holds) does not cost the held locks their release.
    """
    budget = time.monotonic() + EXIT_BUDGET
    try:
        return _release_held(budget)
    finally:
        wait = min(EXIT_FLUSH, max(0.0, budget - time.monotonic()))
        if not finalizers.drain(wait):
            logger.warning("signals of releases run by a garbage collection were still "
                           "waiting to be sent at exit after %g s; they are dropped", wait)


def _release_held(budget: float) -> int:
    """:func:`release_held_locks` but its last wait, until ``budget`` (monotonic)."""
    with _acquired_guard:
        candidates = list(_acquired)
    released = skipped = 0
    pid = os.getpid()
    managers: dict[int, Any] = {}
    for lock in candidates:
        if lock._pid != pid:
            # A parent's lock (this is a forked child): not ours, and its
            # ``_io`` may have been held, at the fork, by a parent thread that
            # does not exist here: waiting for it hung the child's exit.
            continue
        if time.monotonic() >= budget:
            skipped += 1
            continue
        # A sync lock's renewal thread may be in a round: wait for it, bounded.
        io = lock._io
        if not isinstance(io, asyncio.Lock) and not io.acquire(timeout=EXIT_IO_WAIT):
            skipped += 1
            continue
        with contextlib.nullcontext() if isinstance(io, asyncio.Lock) else _held(io):
            if lock._state == "unlocked" or lock._pid != pid or not lock._token:
                continue
            # In flight from before it stops counting as held (LockManager.retire).
            lock.manager._call_begins()
            token, fence = lock._token, lock.fence
            # How long the key may still be on a node (an extend(ttl) may be
            # longer than the TTL): a node that misses the release is sent it
            # again for that long, as ``release()`` does (engine/leftovers.py).
            lease = lock._key_life(lock.manager.clock())
            lock._forget_hold(released=True)  # blocks open on it: released, not lost
        managers[id(lock.manager)] = lock.manager  # its late sender, flushed below
        try:
            lock.manager._release_round(lock._key_b, lock._fence_key_b, lock._waiters_key_b,
                                        token, fence, redo=lease, every=True)
        except Exception:  # noqa: BLE001 - keep releasing the others
            logger.warning("lock %r could not be released at exit; it expires with its "
                           "lease (%.3f s at most)", lock.name, lock.ttl, exc_info=True)
            continue
        finally:
            lock.manager._call_ends()
        released += 1
        logger.info("lock %r released at exit (it was still held)", lock.name)
    if skipped:
        logger.warning("%d lock(s) were not released at exit within %g s (nodes that do not "
                       "answer); they expire with their leases", skipped, EXIT_BUDGET)
    _flush_late_releases(managers.values())
    return released


@contextlib.contextmanager
def _held(io: Any) -> Iterator[None]:
    """``io`` (acquired by the caller) released on leaving."""
    try:
        yield
    finally:
        io.release()


#: How long the exit hook spends releasing held locks, at most: each release
#: is bounded by the node timeouts, but one after the other, with a majority
#: of nodes black-holed, 200 held locks took 28 s, past a process manager's
#: grace (gunicorn's 30 s) and into a SIGKILL. Locks left are not released:
#: their keys expire with their leases, as a crashed process's do.
EXIT_BUDGET = 5.0

#: How long the exit hook waits for a lock's renewal round in flight.
EXIT_IO_WAIT = 2.0


#: How long the exit hook waits, at most, for releases that failed on a node to
#: be sent again (engine/leftovers.py): the late sender is a daemon thread and
#: dies with the process.
EXIT_FLUSH = 1.0


def _flush_late_releases(managers: Any) -> None:
    """Give the releases a slow node missed one more chance before the process
    ends, bounded by :data:`EXIT_FLUSH` in all. Timeline of what this stops::

        exit    the hook releases A's lock: 2 nodes answer, node 3 replies late
        exit+   node 3's release waits for the late sender's next try (0.1 s)
        exit+   the process ends, the daemon thread with it: node 3 keeps A's
                key for the rest of the lease (a minority: the lock is free,
                but one node is down for it, with no margin left)
    """
    deadline = time.monotonic() + EXIT_FLUSH
    for manager in managers:
        leftovers = getattr(manager, "_leftovers", None)
        if leftovers is None or not leftovers.waiting():
            continue
        left = leftovers.flush(max(0.0, deadline - time.monotonic()))
        if left:
            logger.warning("%d release(s) that failed on a node were not sent again before "
                           "exit; those keys expire with their leases", left)


atexit.register(release_held_locks)



def enrol(lock: Any) -> None:
    """Remember a lock just acquired (``LockBase._enter_hold``)."""
    with _acquired_guard:
        _acquired.add(lock)


def holds_any(manager: Any) -> bool:
    """Whether this process still holds a lock of ``manager`` with lease left
    (``LockManager.retire``: a retired manager closes when this turns False).

    A lock that was lost, or whose lease ran out without a release, does not
    count: its ``release()`` only reports that (``LockLost``), and a lock
    object dropped unreleased is gone from the set, so neither keeps a retired
    manager's threads and connections for the rest of the process."""
    with _acquired_guard:
        candidates = list(_acquired)
    return any(lock.manager is manager and lock.owned() for lock in candidates)
