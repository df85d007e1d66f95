"""The renewal thread: one per lock manager, however many locks are held.

A thread per lock (python-redis-lock) costs a thread start per acquire; one
shared thread with a timer heap costs nothing on the hot path. The heap holds
weak references, so a lock object that is dropped without release does not keep
renewing forever (its key then simply expires). The thread waits on a condition,
never spins, and exits when the manager is closed.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import sys
import threading
import time
import weakref
from typing import Callable, Protocol

logger = logging.getLogger("django_redlock.watchdog")

#: Longest single sleep of the thread (a huge due time must not overflow the wait).
_MAX_WAIT = 3600.0


class Renewable(Protocol):
    def _watchdog_tick(self) -> float | None:
        """Renew if due; return the next due time (monotonic) or None to stop."""


class Watchdog:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._heap: list[tuple[float, int, weakref.ref[Renewable]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def schedule(self, lock: Renewable, due: float) -> None:
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._seq), weakref.ref(lock)))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="redlock-watchdog",
                                                daemon=True)
                self._thread.start()
            elif self._heap[0][0] == due:
                # Wake the thread only when its next deadline moved closer: on the
                # acquire hot path most entries land behind an earlier one.
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._heap.clear()
            self._cond.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            _close_db_connections(final=True)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping:
                    heap = self._heap
                    while heap and heap[0][2]() is None:
                        # Dropped lock objects: nothing to renew. Popping them now,
                        # not at their due times, keeps a process that acquires in
                        # a loop from waking this thread once per acquisition.
                        heapq.heappop(heap)
                    if not heap:
                        self._cond.wait()
                        continue
                    delay = self._heap[0][0] - self._clock()
                    if delay <= 0:
                        break
                    self._cond.wait(timeout=min(delay, _MAX_WAIT))
                if self._stopping:
                    return
                _, _, ref = heapq.heappop(self._heap)
            lock = ref()
            if lock is None:
                continue
            try:
                due = lock._watchdog_tick()
            except Exception:  # noqa: BLE001 - one lock's failure must not stop the others' renewal
                logger.exception("renewal of a lock failed unexpectedly")
                due = None
            del lock
            _close_db_connections(final=False)
            if due is not None:
                with self._cond:
                    if not self._stopping:
                        heapq.heappush(self._heap, (due, next(self._seq), ref))


def _close_db_connections(*, final: bool) -> None:
    """End this thread's use of Django's database connections, as a request does.

    A tick may send ``lock_lost`` and a receiver may use the ORM, which opens a
    connection that belongs to this thread (Django's connections are per thread).
    After each tick the ones past ``CONN_MAX_AGE`` or unusable are closed (what
    ``request_finished`` does for a request); when the thread ends, all of them,
    so none is left for the garbage collector (Python 3.13 warns about an
    unclosed ``sqlite3`` connection). Costs nothing when Django's ORM was never
    imported or this thread never touched a database.
    """
    db = sys.modules.get("django.db")
    if db is None:
        return
    try:
        from django.conf import settings

        if not settings.configured:
            return
        for conn in db.connections.all(initialized_only=True):
            if final:
                conn.close()
            else:
                conn.close_if_unusable_or_obsolete()
    except Exception:  # noqa: BLE001 - closing must never stop renewal
        logger.exception("closing the renewal thread's database connections failed")
