"""Requests that failed on a node and stay worth sending: a release, and the
clean-up after a lost attempt.

A release that does not reach a node leaves the holder's key there until its
lease ends, and the lock busy for everyone that needs that node. Most of the
time that node is simply down and the key goes with it, but not always:

    t=0     A holds the lock on a Sentinel node; the replica has A's key
    t=1     the master dies; A releases: no node answers, A's key stays
            on the replica
    t=3     the sentinels promote the replica: the new master has A's key
    t=3..10 every acquire is refused: busy, until A's lease (10 s) ends

The same happens to an attempt's clean-up when the node died after running
the attempt, and to a node that answered an error (``READONLY`` from a master
the sentinels just demoted). The lock manager keeps such requests here and
sends them again, with growing pauses, until the node answers or the lease
they were for has ended; with the node back (the new master), the key is
deleted and the next acquire gets the lock: the lock is back shortly after
the failover, not a whole lease later.

Sending again is safe whenever it runs: a release and a clean-up delete
only a key that still holds this holder's token (and, for a clean-up, this
attempt's or an earlier one's: ``attempt.lua``), compare-and-delete on the
node. They never touch a later holder's key, nor this holder's next grant.

One daemon thread per lock manager (started at the first leftover), apart
from the renewal thread: a node that hangs in its connect costs this thread
its node timeout, never a renewal. The requests wait per node, and a node is
tried with its oldest one at growing pauses (0.1 s doubling to 1 s): a node
that is down costs one try per pause however many releases wait for it, and
once one goes through, the others follow at once. Bounded: at most
:data:`MAX_PENDING` requests wait per node; beyond that the oldest is dropped
(its key expires with its lease, as it did before this module). Asyncio locks
use it too (with the manager's sync transport): a retry outlives the event
loop.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

from ..transport.finalizers import get_logger

logger = get_logger("django_redlock.leftovers")

#: Requests waiting to be sent again, at most (one per failed node and call).
MAX_PENDING = 10_000
#: The first pause before sending again, and the longest (it doubles).
FIRST_PAUSE = 0.1
LONGEST_PAUSE = 1.0


def failed_requests(requests: Sequence[Any], replies: Sequence[Any]) -> list[Any] | None:
    """The requests of a round to send again: those whose node failed (no
    reply in time, no connection, skipped) or answered with an error; None
    when there are none. A reply the round did not wait for is not a
    failure: the request left, the node runs it."""
    again: list[Any] | None = None
    for i, reply in enumerate(replies):
        if isinstance(reply, Exception) and requests[i] is not None:
            if again is None:
                again = [None] * len(requests)
            again[i] = requests[i]
    return again


class Leftovers:
    """The late sender: ``send`` is the manager's transport round
    (``SyncTransport.round``) over ``n_nodes`` nodes, ``clock`` its clock."""

    def __init__(self, send: Callable[..., list[Any]], n_nodes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._send = send
        self._n = n_nodes
        self._clock = clock
        #: per node: (request, until) in the order they failed
        self._pending: list[deque[tuple[Any, float]]] = [deque() for _ in range(n_nodes)]
        #: per node: when to try it next (inf: nothing waits), and the pause after that
        self._due = [math.inf] * n_nodes
        self._pause = [FIRST_PAUSE] * n_nodes
        self._dropped = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def waiting(self) -> int:
        """How many requests wait to be sent again (for tests and ``locks health``)."""
        with self._cond:
            return sum(len(q) for q in self._pending)

    def add(self, requests: Sequence[Any], lasts: float) -> None:
        """Send ``requests`` (per node; None: not that node) again, for up to
        ``lasts`` seconds from now."""
        now = self._clock()
        with self._cond:
            if self._stopping:
                return
            for i, request in enumerate(requests):
                if request is None:
                    continue
                queue = self._pending[i]
                if len(queue) >= MAX_PENDING:
                    queue.popleft()  # the oldest: the nearest to expiring anyway
                    self._dropped += 1
                    if self._dropped == 1 or self._dropped % MAX_PENDING == 0:
                        logger.warning("%d releases that failed wait to be sent again to "
                                       "one node; the oldest are dropped (their keys expire "
                                       "with their leases)", MAX_PENDING)
                queue.append((request, now + lasts))
                if self._due[i] == math.inf:
                    self._due[i] = now + FIRST_PAUSE
            if self._thread is None or not self._thread.is_alive():
                thread = threading.Thread(target=self._run, name="redlock-leftovers",
                                          daemon=True)
                try:
                    thread.start()
                except RuntimeError:
                    # "can't create new thread at interpreter shutdown" (Python
                    # 3.12): a release of the exit hook. They stay queued, and
                    # the hook's flush() sends them from its own thread.
                    self._thread = None
                else:
                    self._thread = thread
            else:
                self._cond.notify()

    def flush(self, timeout: float) -> int:
        """Send every waiting request now, and wait until none waits, at most
        ``timeout`` s (the exit hook: the daemon thread dies with the process, so
        a release one slow reply left here would otherwise never be sent). Returns
        how many still wait."""
        deadline = self._clock() + timeout
        with self._cond:
            now = self._clock()
            for i, queue in enumerate(self._pending):
                if queue:
                    self._due[i] = min(self._due[i], now)
            self._cond.notify_all()
            thread = self._thread
            if thread is not None and thread.is_alive():
                while True:
                    left = sum(len(q) for q in self._pending)
                    wait = deadline - self._clock()
                    if not left or wait <= 0 or not thread.is_alive():
                        return left
                    self._cond.wait(timeout=min(wait, 0.05))
        # No thread to send them (none could be started at interpreter
        # shutdown): this one does, at the same pauses, until the deadline.
        while True:
            with self._cond:
                left = sum(len(q) for q in self._pending)
                now = self._clock()
                if not left or now >= deadline or self._stopping:
                    return left
                due = [i for i in range(self._n) if self._due[i] <= now]
                pause = min(self._due) - now
            if due:
                for i in due:
                    self._try_node(i)
            else:
                time.sleep(max(0.0, min(pause, deadline - now, 0.05)))

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            for queue in self._pending:
                queue.clear()
            self._cond.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping:
                    delay = min(self._due) - self._clock()
                    if delay <= 0:
                        break
                    self._cond.wait(timeout=None if delay == math.inf else delay)
                if self._stopping:
                    return
                now = self._clock()
                due = [i for i in range(self._n) if self._due[i] <= now]
            for i in due:
                self._try_node(i)

    def _try_node(self, i: int) -> None:
        """Send node ``i`` its waiting requests, oldest first, until one fails
        (then the node waits a longer pause) or none is left."""
        for _ in range(MAX_PENDING):
            with self._cond:
                queue = self._pending[i]
                now = self._clock()
                while queue and queue[0][1] <= now:
                    queue.popleft()  # its key has expired by now: nothing to delete
                if not queue or self._stopping:
                    self._due[i] = math.inf
                    self._pause[i] = FIRST_PAUSE
                    return
                request = queue[0][0]
            requests: list[Any] = [None] * self._n
            requests[i] = request
            try:
                reply = self._send(requests, skip_backoff=True)[i]
            except Exception:  # noqa: BLE001 - one leftover must not stop the others
                logger.exception("sending a release again failed unexpectedly")
                reply = None  # dropped: it would fail the same way again
            with self._cond:
                if isinstance(reply, Exception):
                    self._due[i] = self._clock() + self._pause[i]
                    self._pause[i] = min(self._pause[i] * 2, LONGEST_PAUSE)
                    return
                self._pause[i] = FIRST_PAUSE  # it answers again
                if queue and queue[0][0] is request:
                    queue.popleft()
                    self._cond.notify_all()  # a flush() may wait for the queue
        with self._cond:
            self._due[i] = self._clock()  # more than one batch: the next turn goes on
