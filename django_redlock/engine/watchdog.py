"""The renewal thread: one per lock manager, however many locks are held.

A thread per lock (python-redis-lock) costs a thread start per acquire; one
shared thread with a timer queue (:class:`DueQueue`) costs nothing on the hot
path. The queue holds weak references, so a lock object that is dropped without
release does not keep renewing forever (its key then simply expires). The thread
waits on a condition, never spins, and exits when the manager is closed.
"""

from __future__ import annotations

import heapq
import itertools
import sys
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Protocol, Sequence

from ..transport.finalizers import get_logger
from .rounds import Extension

logger = get_logger("django_redlock.watchdog")

#: Longest single sleep of the thread (a huge due time must not overflow the wait).
_MAX_WAIT = 3600.0


#: A lock due within this share of its TTL is renewed in the same batch as
#: the locks due now (a renewal a little early costs nothing; a batch saves a
#: round trip per lock), but never more than BATCH_AHEAD_MAX seconds early.
BATCH_AHEAD_SHARE = 0.1
BATCH_AHEAD_MAX = 0.05


class Renewable(Protocol):
    ttl: float
    _key_b: bytes
    _fence_key_b: bytes
    _hold_no: int

    def _watchdog_tick(self, hold: int) -> float | None:
        """Renew hold number ``hold`` if due; return the next due time
        (monotonic) or None to stop (that hold is over)."""

    def _renewal_begin(self, hold: int) -> Any:
        """See ``Lock._renewal_begin``."""

    def _renewal_end(self, plan: Any, result: Any) -> float | None:
        """See ``Lock._renewal_end``."""

    def _renewal_abort(self, plan: Any) -> None:
        """See ``Lock._renewal_abort``."""


class _Entry(weakref.ref):  # type: ignore[type-arg]
    """A queue entry: a weak reference to a lock, and the hold it renews
    (``LockBase._hold_no`` when it was scheduled).

    One lock object is held again and again (a worker's job loop, a
    semaphore's permit, a family's line locks), and each acquire schedules
    its first renewal. An entry knew only the object, so one of an earlier
    hold, still queued, fell due during a later hold, renewed it and was
    queued again: every acquire/release cycle left one more entry for good::

        t0      acquire (hold 1): entry E1 due t0+ttl/3; release at once
        t0+     acquire (hold 2): entry E2 due about t0+ttl/3
        t0+ttl/3  E1 and E2 both renew hold 2 and are both queued again

    (51 entries after 51 acquires, 153 renewals in 3 s where 3 were due.)
    The tick drops an entry of an older hold instead (``Lock._watchdog_tick``)."""

    __slots__ = ("hold",)
    hold: int

    def __new__(cls, lock: "Renewable", hold: int) -> "_Entry":
        entry = super().__new__(cls, lock)
        entry.hold = hold
        return entry

    def __init__(self, lock: "Renewable", hold: int) -> None:
        super().__init__(lock)  # type: ignore[call-arg]  # weakref.ref's __init__ takes the object


#: Lanes a :class:`DueQueue` keeps at most (one per distinct ttl); the
#: entries of more ttls go to its heap.
LANES_MAX = 8


class _Lane:
    """One ttl's entries in due order: due times and references side by
    side, so an entry adds no object of its own (a ``(due, ref)`` tuple per
    renewal, 10,000 a second, lived long enough to be promoted to the old
    generation and made the garbage collector's full passes come sooner:
    each one walks every object of the process, in the renewal thread)."""

    __slots__ = ("dues", "refs")

    def __init__(self) -> None:
        self.dues: deque[float] = deque()
        self.refs: deque[weakref.ref[Renewable]] = deque()

    def __len__(self) -> int:
        return len(self.dues)


class DueQueue:
    """The locks to renew, in due order: a FIFO lane per ttl, and a heap.

    A held lock is scheduled again a third of its ttl after each renewal, so
    the entries of one ttl arrive in the order they fall due, and a lane
    takes and gives them without comparing anything, as Node.js keeps one
    timer list per duration. A heap of 10,000 entries cost about 2 µs per
    renewal in pushes and pops (cold caches: each entry is touched once a
    period), of the 9 µs a renewal cost the thread in all. An entry that
    would land before its lane's last (the first renewal of a lock granted
    with less than its ttl left, a retry after a failed round, a lock whose
    ``MAX_HOLD`` cut its lease), and the entries of ttls beyond
    :data:`LANES_MAX` lanes, go to the heap. Not thread-safe: the watchdog
    holds its condition around every use.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, weakref.ref[Renewable]]] = []
        self._lanes: dict[float, _Lane] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap) + sum(len(lane) for lane in self._lanes.values())

    def push(self, due: float, ref: weakref.ref[Renewable], period: float) -> None:
        """Add ``ref`` due at ``due``; ``period``: its lock's ttl (its lane)."""
        lane = self._lanes.get(period)
        if lane is None and len(self._lanes) < LANES_MAX:
            lane = self._lanes[period] = _Lane()
        if lane is not None and (not lane.dues or lane.dues[-1] <= due):
            lane.dues.append(due)
            lane.refs.append(ref)
        else:
            heapq.heappush(self._heap, (due, next(self._seq), ref))

    def earliest(self) -> float | None:
        """The earliest due time of a live entry (dropped locks at the heads
        are let go first: popping them now, not at their due times, keeps a
        process that acquires in a loop from waking the thread once per
        acquisition); None when there is none."""
        first = None
        heap = self._heap
        while heap and heap[0][2]() is None:
            heapq.heappop(heap)
        if heap:
            first = heap[0][0]
        emptied = False
        for lane in self._lanes.values():
            dues, refs = lane.dues, lane.refs
            while refs and refs[0]() is None:
                dues.popleft()
                refs.popleft()
            if not dues:
                emptied = True
            elif first is None or dues[0] < first:
                first = dues[0]
        if emptied:
            self._drop_empty_lanes()
        return first

    def pop_due(self, now: float) -> list[weakref.ref[Renewable]]:
        """Every live entry due by ``now``, and those due a little later
        (:data:`BATCH_AHEAD_SHARE` of their ttl, at most
        :data:`BATCH_AHEAD_MAX` s), in no particular order."""
        out: list[weakref.ref[Renewable]] = []
        heap = self._heap
        while heap:
            due, _, ref = heap[0]
            lock = ref()
            if lock is not None and due > now and due > now + min(
                    BATCH_AHEAD_MAX, lock.ttl * BATCH_AHEAD_SHARE):
                break
            heapq.heappop(heap)
            if lock is not None:
                out.append(ref)
        emptied = False
        for period, lane in self._lanes.items():
            # One ttl per lane: one horizon for the whole lane.
            horizon = now + min(BATCH_AHEAD_MAX, period * BATCH_AHEAD_SHARE)
            dues, refs, append = lane.dues, lane.refs, out.append
            while dues and dues[0] <= horizon:
                dues.popleft()
                ref = refs.popleft()
                if ref() is not None:
                    append(ref)
            emptied = emptied or not dues
        if emptied:
            self._drop_empty_lanes()
        return out

    def _drop_empty_lanes(self) -> None:
        """Let an emptied lane go: its ttl's next entry starts a new one, and
        a lane kept empty would hold one of the :data:`LANES_MAX` places."""
        self._lanes = {period: lane for period, lane in self._lanes.items() if lane.dues}

    def clear(self) -> None:
        self._heap.clear()
        self._lanes.clear()


class Watchdog:
    """``extend_many``: the manager's batched extension (``rounds.extend_many_steps``):
    the locks due together are renewed with one call per node, so the round
    trips per renewal period grow with the nodes, not with the locks held."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 extend_many: Callable[[Sequence[Any]], list[Any]] | None = None) -> None:
        self._clock = clock
        self._extend_many = extend_many
        self._queue = DueQueue()
        #: When the thread wakes by itself (inf: it waits for an entry).
        self._wake_at = float("inf")
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def schedule(self, lock: Renewable, due: float) -> None:
        with self._cond:
            self._queue.push(due, _Entry(lock, lock._hold_no), lock.ttl)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="redlock-watchdog",
                                                daemon=True)
                self._thread.start()
            elif due < self._wake_at:
                # Wake the thread only when it sleeps past this due time: on the
                # acquire hot path most entries land behind an earlier one, and
                # a loop that acquires and drops its locks leaves dead entries
                # the thread clears when it wakes anyway.
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._queue.clear()
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
                    first = self._queue.earliest()  # dropped lock objects let go
                    if first is None:
                        self._wake_at = float("inf")
                        self._cond.wait()
                        continue
                    delay = first - self._clock()
                    if delay <= 0:
                        break
                    self._wake_at = first
                    self._cond.wait(timeout=min(delay, _MAX_WAIT))
                if self._stopping:
                    return
                refs = self._queue.pop_due(self._clock())
            self._renew_and_reschedule(refs)
            _close_db_connections(final=False)

    def _renew_and_reschedule(self, refs: list[weakref.ref[Renewable]]) -> None:
        """Renew the locks of ``refs`` and queue each again at its next due
        time. (A method of its own: no strong reference to a lock is left in
        the loop's frame while the thread waits.)"""
        locks = [ref() for ref in refs]
        dues = self._renew(locks, [_hold(ref) for ref in refs])
        with self._cond:
            if not self._stopping:
                push = self._queue.push
                for ref, lock, due in zip(refs, locks, dues):
                    # Still the hold it renewed: a release and a new acquire
                    # since then scheduled the new hold's own entry.
                    if due is not None and lock is not None and lock._hold_no == _hold(ref):
                        push(due, ref, lock.ttl)

    def _renew(self, locks: list[Renewable | None],
               holds: Sequence[int]) -> list[float | None]:
        """Renew ``locks`` (None: dropped), each the hold of ``holds`` (an
        entry of an earlier hold of the object renews nothing); the next due
        time of each."""
        dues: list[float | None] = [None] * len(locks)
        if sum(lock is not None for lock in locks) == 1 or self._extend_many is None:
            for i, lock in enumerate(locks):
                if lock is not None:
                    dues[i] = self._tick(lock, holds[i])
            return dues
        batch = []
        for i, lock in enumerate(locks):
            if lock is None:
                continue
            try:
                begun = lock._renewal_begin(holds[i])
            except Exception:  # noqa: BLE001 - one lock's failure must not stop the others' renewal
                logger.exception("renewal of a lock failed unexpectedly")
                continue
            if isinstance(begun, tuple):
                batch.append((i, lock, begun))
            else:
                dues[i] = begun
        if not batch:
            return dues
        try:
            results = self._extend_many([
                Extension(lock._key_b, lock._fence_key_b, step.token, step.fence, step.ttl)
                for _, lock, (_, step) in batch])
        except Exception as exc:  # noqa: BLE001 - each plan hears of it
            logger.exception("batched renewal failed unexpectedly")
            results = [exc] * len(batch)
        for (i, lock, (plan, _)), result in zip(batch, results):
            if isinstance(result, Exception):
                lock._renewal_abort(plan)
                dues[i] = self._clock() + 0.05  # try again soon, while the lease lasts
                continue
            try:
                dues[i] = lock._renewal_end(plan, result)
            except Exception:  # noqa: BLE001 - one lock's failure must not stop the others'
                logger.exception("renewal of a lock failed unexpectedly")
        return dues

    @staticmethod
    def _tick(lock: Renewable | None, hold: int) -> float | None:
        try:
            return lock._watchdog_tick(hold) if lock is not None else None
        except Exception:  # noqa: BLE001 - one lock's failure must not stop the others' renewal
            logger.exception("renewal of a lock failed unexpectedly")
            return None


def _hold(ref: weakref.ref[Renewable]) -> int:
    """The hold an entry renews (an :class:`_Entry`'s; -1 for a bare reference,
    which renews nothing)."""
    return getattr(ref, "hold", -1)


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
