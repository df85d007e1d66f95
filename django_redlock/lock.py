"""A lock on one name: acquire, renew, release, and an honest account of loss.

Timeline of the race this object is built to survive::

    t0  A acquires "stock:1" (fence 41), lease 10 s, starts its work
    t1  A is paused (GC, SIGSTOP, a swapped-out VM) for 15 s
    t10 A's lease expires on the nodes; its renewal could not run
    t11 B acquires "stock:1" (fence 42) and writes
    t16 A resumes. Its renewal finds B's token on the nodes: A's lock is *lost*.
        A's ``owned()`` is False, ``lock_lost`` fires, and the ``with`` block
        raises ``LockLost`` when it ends. A's release compares tokens and leaves
        B's key alone. If A writes before noticing, its fence (41) is lower than
        B's (42), and a fenced write refuses it.

Renewal happens on the manager's watchdog thread at about TTL/3. A renewal that
fails to reach a quorum is retried while the lease lasts; when the lease runs out
or a majority says the key is no longer ours, the lock is marked lost. Nothing
about a loss is silent.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from types import EllipsisType, TracebackType
from typing import TYPE_CHECKING, Any, Generator, NamedTuple, Union, cast

from . import rounds, signals
from .core.arguments import check_timeout, check_ttl
from .core.keys import fence_key, lock_key, validate_name, waiters_key
from .core.owner import new_token, owner_json
from .exceptions import LockLost, LockNotAcquired, LockNotOwned, QuorumUnavailable, RedlockError
from .transport.sync import call_deadline

if TYPE_CHECKING:
    from .manager import LockManager
    from .rounds import AcquireResult
    from .transport.notify import Subscription

logger = logging.getLogger("django_redlock.lock")

_UNLOCKED, _HELD, _LOST = "unlocked", "held", "lost"


# What an acquire's waiting rules (LockBase._acquire_plan) ask its flavour to do.
class Attempt(NamedTuple):
    """Make one acquire round; answer with its ``AcquireResult``."""

    woken: bool  # a release notice named us since the last attempt
    ask_all: bool  # skip the gate node this time (see rounds.gate_node)


class Subscribe(NamedTuple):
    """Register for release notices (wait up to ``confirm`` s for a node to
    confirm); from now on every attempt queues. Answer with anything."""

    confirm: float


class Wait(NamedTuple):
    """Wait up to ``seconds`` for a release notice; answer True when one came."""

    seconds: float


Step = Union[Attempt, Subscribe, Wait]
#: Yields steps, receives their answers, returns the winning result or None
#: when the wait ran out.
AcquirePlan = Generator[Step, Any, "AcquireResult | None"]


class LockBase:
    """State and rules shared by :class:`Lock` and :class:`~django_redlock.aio.AsyncLock`.

    Everything here is local: no I/O, so both flavours read their state the same
    way (``owned()`` and ``validity`` come from the monotonic clock, which stays
    right even when the renewal could not run).
    """

    def __init__(self, manager: "LockManager", name: str, *, ttl: float,
                 timeout: float | None, auto_renew: bool, fencing: bool = True,
                 max_hold: float | None = None, label: str | None = None) -> None:
        self.manager = manager
        self.name = validate_name(name)
        self.key = lock_key(manager.key_prefix, name)
        self._key_b = self.key.encode()
        self._fence_key_b = fence_key(self.key).encode()
        self._waiters_key_b = waiters_key(self.key).encode()
        self.ttl = float(ttl)
        self.timeout = timeout
        self.auto_renew = auto_renew
        self.fencing = fencing
        self.max_hold = max_hold
        self.label = label
        self.fence = 0
        self.retry_after = 0.0
        self._state = _UNLOCKED
        self._token = ""
        self._valid_until = 0.0
        self._acquired_at = 0.0
        self._pid = 0
        self._lost_reason = ""
        #: What held the key at the last refusal when it was not a lock
        #: (rounds.obstacle), for the busy error.
        self._obstacle = ""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self._state} fence={self.fence}>"

    @property
    def validity(self) -> float:
        """Seconds of lease left (0.0 when not held, lost, or in a forked child)."""
        if self._state != _HELD or self._pid != os.getpid():
            return 0.0
        return max(0.0, self._valid_until - self.manager.clock())

    def owned(self) -> bool:
        """True while this object holds the lock on a quorum with lease left.

        This is the local view, kept current by acquire, extend and the renewal;
        it costs no round trip. False in a child process after ``fork()``.
        """
        return self.validity > 0.0

    def _start_acquire(self, blocking: bool, timeout: float | None | EllipsisType
                       ) -> tuple[float, float | None, str, str, int, float]:
        """Check re-entry and resolve the wait.

        Returns (started, deadline, token, owner, ttl_ms, pause): ``pause`` is how
        long to step back before the first attempt, because this process just woke
        other processes' waiters for this lock (``LockManager._note_release``).
        """
        wait_for = self.timeout if timeout is ... else check_timeout(timeout)
        if not isinstance(blocking, bool):
            raise ValueError(f"blocking must be True or False, not {blocking!r}")
        if self._state != _UNLOCKED and self._pid == os.getpid() and self.owned():
            raise RedlockError(f"lock {self.name!r} is already held by this object "
                               f"(locks are not reentrant)", lock_name=self.name)
        if not blocking:
            wait_for = 0
        started = self.manager.clock()
        deadline = None if wait_for is None else started + float(wait_for)
        # The transport may wait this long for a connection set-up (not one
        # node timeout): a cold burst then queues instead of failing.
        call_deadline.set(math.inf if deadline is None else deadline)
        pause = 0.0
        if deadline is None or deadline > started:
            pause = self.manager._handoff_pause(self._key_b)
            if deadline is not None:
                pause = min(pause, deadline - started)
        return (started, deadline, new_token(), owner_json(self.label),
                max(1, int(self.ttl * 1000)), pause)

    def _end_stale_hold(self) -> tuple[str, float] | None:
        """Forget a hold whose lease ran out (or that was lost) without ``release()``.

        ``acquire()`` on such an object acquires anew (as redis-py's does)
        instead of calling it "already held". Returns ``(reason, held)`` when
        the loss was never reported (a lease that ran out with
        ``auto_renew=False`` and no release): the caller reports it, as
        ``release()`` would have; None otherwise. The old key needs no
        clean-up: its lease is over on the nodes too (validity is conservative).
        """
        if self._state == _UNLOCKED or self._pid != os.getpid() or self.owned():
            return None
        owed = None
        if self._state == _HELD:
            owed = ("the lease ran out without release(); acquiring again",
                    self.manager.clock() - self._acquired_at)
        self._state = _UNLOCKED
        self._token = ""
        self._valid_until = 0.0
        return owed

    def _acquire_plan(self, deadline: float | None, in_line: bool) -> AcquirePlan:
        """The waiting rules of an acquire, without its I/O: both flavours run
        this plan (``Lock.acquire``, ``AsyncLock.acquire``), so they cannot drift
        apart on when to queue, how long to wait, or which nodes to ask.

        ``in_line``: subscribe before the first attempt (``_start_acquire``).
        """
        mgr = self.manager
        subscribed = in_line
        if in_line:
            yield Subscribe(mgr.node_timeout)
        woken = ask_all = False
        self._obstacle = ""
        while True:
            result: AcquireResult = yield Attempt(woken, ask_all)
            remaining = None if deadline is None else deadline - mgr.clock()
            if result.acquired:
                return result
            if result.obstacle and result.obstacle != self._obstacle:
                logger.warning("lock %r: %s", self.name, result.obstacle)
            self._obstacle = result.obstacle
            if remaining is not None and remaining <= 0:
                self.retry_after = result.holder_ttl if result.holder_ttl is not None \
                    else mgr.retry_delay
                return None
            if not subscribed:
                # Subscribe before the final attempt, so a release that lands
                # between that attempt and the wait still wakes us. That
                # attempt puts us in the waiter queue (the release names us).
                subscribed = True
                yield Subscribe(mgr.node_timeout if remaining is None
                                else min(mgr.node_timeout, remaining))
                continue
            woken = yield Wait(mgr.next_wait(remaining, result.holder_ttl))
            # No notice after a refusal at the gate: see rounds.gate_node.
            ask_all = not woken and result.at_gate

    def _hand_over_entry(self, ttl_ms: int, owner: str) -> bytes:
        """What this acquire's queue entry adds on the hand-over node so that a
        release there may hand it the lock (``rounds.hand_over_entry``)."""
        return rounds.hand_over_entry(ttl_ms, self.fencing, owner)

    def _entries(self, sub: "Subscription") -> list[bytes]:
        """The waiter's queue entry on each node (``rounds.waiter_entries``)."""
        return rounds.waiter_entries(self._key_b, len(self.manager.nodes), sub.entry,
                                     sub.hand_over_entry)

    def _take_handover(self, sub: "Subscription | None",
                       refusal: "AcquireResult | None") -> "AcquireResult | None":
        """The lock a release handed to this waiter, when it can be used as it
        is (``rounds.handed_over``), for the next round (``rounds.acquire_steps``);
        None: make a plain attempt (which finds the key already ours on the
        node that handed it over)."""
        if sub is None or sub.handed is None:
            return None
        handed, sub.handed = sub.handed, None
        if refusal is None:
            return None
        mgr = self.manager
        return rounds.handed_over(handed, asked_at=refusal.asked_at, queued_ms=refusal.queued_ms,
                                  now=mgr.clock(), ttl=self.ttl, drift_factor=mgr.drift_factor)

    def _busy_error(self) -> LockNotAcquired:
        return LockNotAcquired(
            f"lock {self.name!r} is busy: not acquired within "
            f"{'no' if self.timeout is None else format(self.timeout, 'g')} s"
            + (f"; {self._obstacle}" if self._obstacle else ""),
            lock_name=self.name, retry_after=self.retry_after)

    def __getstate__(self) -> Any:
        raise TypeError("lock objects cannot be pickled: a lock belongs to one process")


class Lock(LockBase):
    """A distributed lock on ``name``; created by :meth:`LockManager.lock`, not yet acquired.

    One object is one holder: use it from one thread at a time (the manager and
    its connections are shared safely between threads; create one ``Lock`` per
    critical section). Locks are not reentrant.
    """

    def __init__(self, manager: "LockManager", name: str, **options: Any) -> None:
        super().__init__(manager, name, **options)
        self._io = threading.RLock()

    def locked(self) -> bool:
        """Whether anyone holds the lock (its key is on a quorum of nodes); one round trip."""
        return self.manager._holders(self._key_b) >= self.manager.quorum

    # -- acquire ---------------------------------------------------------------
    def acquire(self, blocking: bool = True, timeout: float | None | EllipsisType = ...) -> bool:
        """Acquire the lock; True when held, False when the wait ran out.

        ``timeout``: None waits forever, 0 tries once, a number waits that many
        seconds; left out, the lock's (then the manager's) timeout applies.
        ``blocking=False`` is the same as ``timeout=0``. Raises
        :class:`QuorumUnavailable` when fewer than a quorum of nodes answer.
        """
        mgr = self.manager
        started, deadline, token, owner, ttl_ms, pause = self._start_acquire(blocking, timeout)
        with self._io:  # the renewal thread reads the state under it
            stale = self._end_stale_hold()
        if stale is not None:
            self._report_lost(*stale)
        if pause:
            # We just handed the lock over: the others are queued, so skip the
            # attempt that would find it busy and go straight into the line.
            time.sleep(pause)
        plan = self._acquire_plan(deadline, in_line=bool(pause))
        subscription = None
        served = False
        refusal: AcquireResult | None = None  # the last refused attempt
        try:
            try:
                step = next(plan)
                while True:
                    if type(step) is Attempt:
                        answer: Any = mgr._acquire_round(
                            self._key_b, self._fence_key_b, self._waiters_key_b, token,
                            ttl_ms, owner, self.fencing, self.ttl, lock_name=self.name,
                            waiter=subscription.entry if subscription else b"",
                            hand_over=subscription.hand_over_entry if subscription else b"",
                            woken=step.woken, ask_all=step.ask_all,
                            handed=self._take_handover(subscription, refusal))
                        if not answer.acquired:
                            refusal = answer
                    elif type(step) is Subscribe:
                        answer = subscription = mgr.notifier.subscribe(
                            self._key_b, step.confirm, waiter=token.encode(),
                            hand_over=self._hand_over_entry(ttl_ms, owner))
                    else:
                        assert subscription is not None
                        answer = subscription.wait(cast(Wait, step).seconds)
                        subscription.clear()
                    step = plan.send(answer)
            except StopIteration as done:
                result = done.value
            if result is None:
                return False
            served = True  # the granting nodes' scripts took us out of the line
            if subscription is not None and result.queued_at:
                # Nodes that answered busy put us in line: leave it there
                # too, or their next release wakes us in vain.
                mgr._leave_queue(self._waiters_key_b, self._entries(subscription), token,
                                 only=result.queued_at, wait=False)
            self._on_acquired(token, result.fence, result.valid_until, started)
            return True
        finally:
            if subscription is not None:
                subscription.close()
                if not served:
                    # Timed out or interrupted: out of the line, or the next
                    # release would wake us in vain while others wait; and a
                    # lock handed to us meanwhile is handed on.
                    mgr._give_up(self._key_b, self._fence_key_b, self._waiters_key_b, token,
                                 self._entries(subscription))
            if not served:
                mgr.transport.forget(token)  # no round of this token follows

    def _on_acquired(self, token: str, fence: int, valid_until: float, started: float) -> None:
        mgr = self.manager
        with self._io:
            self._token = token
            self.fence = fence
            self._valid_until = valid_until
            self._acquired_at = mgr.clock()
            self._pid = os.getpid()
            self._state = _HELD
            self._lost_reason = ""
        if self.auto_renew:
            mgr.watchdog.schedule(self, self._next_renewal(self._acquired_at))
        signals.send(signals.lock_acquired, Lock, lock=self, name=self.name, fence=fence,
                     wait=self._acquired_at - started)

    def _next_renewal(self, now: float) -> float:
        return now + self.ttl / 3.0

    # -- release ---------------------------------------------------------------
    def release(self) -> None:
        """Release the lock on every node.

        Raises :class:`LockNotOwned` when this object does not hold it (never
        acquired, already released, or a child process after ``fork()``), and
        :class:`LockLost` when the lease had run out or the lock was taken before
        this call: the key is still deleted wherever it is ours, but the caller
        learns that its critical section was not protected to the end.
        """
        mgr = self.manager
        with self._io:
            if self._state == _UNLOCKED or self._pid != os.getpid():
                raise LockNotOwned(f"lock {self.name!r} is not held by this object",
                                   lock_name=self.name)
            was_lost = self._state == _LOST or self._valid_until <= mgr.clock()
            reason = self._lost_reason or "the lease ran out before release"
            token, fence = self._token, self.fence
            self._state = _UNLOCKED
            self._token = ""
            self._valid_until = 0.0
            held = mgr.clock() - self._acquired_at
        result = mgr._release_round(self._key_b, self._fence_key_b, self._waiters_key_b, token,
                                    fence)
        mgr._note_release(self._key_b, result.woken)
        if result.lost and not was_lost:
            was_lost = True
            reason = (f"{result.not_ours} of {len(mgr.nodes)} nodes no longer had this holder's "
                      f"key at release (it expired or was taken)")
        if was_lost:
            self._report_lost(reason, held, already_marked=self._lost_reason != "")
            raise LockLost(f"lock {self.name!r} was lost before release: {reason}",
                           lock_name=self.name, fence=fence)
        if result.released:  # only a release some node confirmed (see signals)
            signals.send(signals.lock_released, Lock, lock=self, name=self.name, fence=fence,
                         held=held, nodes=result.released)
        else:
            logger.warning("release of lock %r reached no node; the key expires with its "
                           "lease (%.3f s at most)", self.name, self.ttl)

    # -- extend / renew --------------------------------------------------------
    def extend(self, ttl: float | EllipsisType = ...) -> None:
        """Reset the lease to ``ttl`` seconds (default: the lock's TTL) on a quorum.

        Raises :class:`LockNotOwned` when not held; :class:`LockLost` when the
        lease already ran out or a majority no longer has our key;
        :class:`QuorumUnavailable` when too few nodes answered (the lock is still
        held until its current lease ends; the renewal thread keeps trying).
        """
        new_ttl = self.ttl if ttl is ... else check_ttl(ttl)  # before anything is sent
        with self._io:
            if self._state != _HELD or self._pid != os.getpid():
                raise LockNotOwned(f"lock {self.name!r} is not held by this object",
                                   lock_name=self.name)
            status, reason = self._extend_locked(new_ttl)
        if status == "lost":
            raise LockLost(f"lock {self.name!r} could not be extended: {reason}",
                           lock_name=self.name, fence=self.fence)
        if status == "retry":
            raise QuorumUnavailable(f"lock {self.name!r} was not extended: {reason}",
                                    lock_name=self.name, needed=self.manager.quorum)

    def _extend_locked(self, ttl: float) -> tuple[str, str]:
        """Extend while holding ``_io``: ("ok", ""), ("lost", why) or ("retry", why)."""
        mgr = self.manager
        if self._valid_until <= mgr.clock():
            reason = "the lease ran out before it could be extended"
            self._mark_lost(reason)
            return "lost", reason
        result = mgr._extend_round(self._key_b, self._fence_key_b, self._token, self.fence, ttl)
        if result.extended:
            self._valid_until = result.valid_until
            return "ok", ""
        if result.valid_until:  # some node took a shorter lease (rounds.tally_extend)
            self._valid_until = min(self._valid_until, result.valid_until)
        if result.lost or self._valid_until <= mgr.clock():
            self._mark_lost(result.reason)
            return "lost", result.reason
        return "retry", result.reason

    def _watchdog_tick(self) -> float | None:
        """Called by the watchdog thread; returns the next due time or None."""
        mgr = self.manager
        if not self._io.acquire(blocking=False):
            return mgr.clock() + min(0.05, self.ttl / 10)  # a release/extend is running
        try:
            if self._state != _HELD or self._pid != os.getpid():
                return None
            now = mgr.clock()
            ttl = self.ttl
            if self.max_hold is not None:
                cap_left = self._acquired_at + self.max_hold - now
                if cap_left <= 0:
                    if self._valid_until <= now:
                        self._mark_lost(f"MAX_HOLD ({self.max_hold:g} s) reached")
                        return None
                    return self._valid_until  # come back to report the expiry
                ttl = min(ttl, cap_left)
            status, _ = self._extend_locked(ttl)
            if status == "ok":
                return self._next_renewal(now)
            if status == "lost":
                return None  # _mark_lost reported it
            # Transient failure: try again soon, while the lease lasts.
            left = self._valid_until - mgr.clock()
            return mgr.clock() + max(0.01, min(ttl / 10, left / 3))
        finally:
            self._io.release()

    def _mark_lost(self, reason: str) -> None:
        if self._state != _HELD:
            return
        self._state = _LOST
        self._lost_reason = reason
        held = self.manager.clock() - self._acquired_at
        self._report_lost(reason, held)

    def _report_lost(self, reason: str, held: float, *, already_marked: bool = False) -> None:
        if already_marked:
            return
        logger.warning("lock %r (fence %d) lost after %.3f s: %s", self.name, self.fence, held,
                       reason)
        signals.send(signals.lock_lost, Lock, lock=self, name=self.name, fence=self.fence,
                     held=held, reason=reason)

    # -- context manager -------------------------------------------------------
    def __enter__(self) -> "Lock":
        if not self.acquire():
            raise self._busy_error()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._state == _UNLOCKED or self._pid != os.getpid():
            return  # released by hand inside the block, or a forked child
        try:
            self.release()
        except LockLost:
            if exc_type is None:
                raise
            # The body already failed; its exception propagates, the loss is logged.
            logger.warning("lock %r was lost while the body raised %s", self.name,
                           exc_type.__name__)
