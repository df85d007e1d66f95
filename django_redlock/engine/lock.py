"""``Lock``: the protocol (:mod:`.protocol`) run from a thread.

A ``Lock`` performs the plans of :class:`~.protocol.LockBase` with the sync
transport and the manager's renewal thread; it adds only the thread-side
concerns: a reentrant ``_io`` lock shared with the renewal thread, taking back
what an interrupted acquire may hold, and the batched renewal's two halves.
Renewal happens on the manager's watchdog thread at about TTL/3; nothing about
a loss is silent.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from types import EllipsisType, TracebackType
from typing import TYPE_CHECKING, Any, Callable, cast

from ..core.arguments import check_ttl
from ..core.pid import getpid
from ..exceptions import LockLost, LockNotOwned, QuorumUnavailable, RedlockError
from ..transport import finalizers
from . import events
from .blocks import entered_by_statement
from .held import release_held_locks
from .protocol import (
    _UNLOCKED,
    Attempt,
    ExtendRound,
    HoldPlan,
    LockBase,
    Pause,
    ReleaseRound,
    Report,
    Subscribe,
    Wait,
    run_to_round,
)

if TYPE_CHECKING:
    from .protocol import LockHost
    from .rounds import AcquireResult

logger = finalizers.get_logger("django_redlock.lock")

__all__ = ["Lock", "release_held_locks"]


class Lock(LockBase):
    """A distributed lock on ``name``; created by :meth:`LockManager.lock`, not yet acquired.

    One object is one holder: use it from one thread at a time (the manager and
    its connections are shared safely between threads; create one ``Lock`` per
    critical section). Locks are not reentrant.
    """

    def __init__(self, manager: "LockHost", name: str, **options: Any) -> None:
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
        return self._acquire(blocking, timeout, None)

    def _acquire(self, blocking: bool, timeout: float | None | EllipsisType,
                 block: Any) -> bool:
        """``acquire()``; ``block``: the frame of the ``with`` statement it is
        for (None: by hand), recorded with the hold (LockBase._record_block)."""
        mgr = self.manager
        started, deadline, token, owner, ttl_ms, pause = self._start_acquire(blocking, timeout)
        stale = None
        if self._state != _UNLOCKED:  # only this thread's acquire leaves "unlocked"
            if self._pid != getpid():
                # A parent's hold (a forked child): no thread here renews it,
                # and the parent's renewal thread may have held ``_io`` at the
                # fork (engine/held.py gives the child a new one; this is for
                # a fork that ran no such hook). A fresh acquire follows.
                self._io = threading.RLock()
            else:
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
                        try:
                            answer: Any = mgr._acquire_round(
                                self._key_b, self._fence_key_b, self._waiters_key_b, token,
                                ttl_ms, owner, self.fencing, self.ttl, lock_name=self.name,
                                waiter=subscription.entry if subscription else b"",
                                hand_over=subscription.hand_over_entry if subscription
                                else b"",
                                woken=step.woken, ask_all=step.ask_all, again=step.again,
                                handed=self._take_handover(subscription, refusal),
                                attempt=step.number, guard=self._guard)
                        except QuorumUnavailable as exc:
                            step = plan.throw(exc)  # re-raised, or the plan asks again
                            continue
                        if not answer.acquired:
                            refusal = answer
                    elif type(step) is Pause:
                        time.sleep(step.seconds)
                        answer = None
                    elif type(step) is Subscribe:
                        answer = subscription = mgr.notifier.subscribe(
                            self._key_b, step.confirm, waiter=token.encode(),
                            hand_over=self._hand_over_entry(ttl_ms, owner))
                    else:
                        assert subscription is not None
                        answer = subscription.wait(cast(Wait, step).seconds)
                        subscription.clear()
                        if answer:
                            events.send(events.lock_waiter_woken, Lock, lock=self,
                                         name=self.name)
                    step = plan.send(answer)
            except StopIteration as done:
                result = done.value
            if result is None:
                events.send(events.lock_not_acquired, Lock, lock=self, name=self.name,
                             wait=mgr.clock() - started, outcome="busy")
                return False
            served = True  # the granting nodes' scripts took us out of the line
            if subscription is not None and result.queued_at:
                # Nodes that answered busy put us in line: leave it there
                # too, or their next release wakes us in vain.
                mgr._leave_queue(self._waiters_key_b, self._entries(subscription), token,
                                 only=result.queued_at, wait=False)
            self.granted_nodes = result.granted  # for the debug-toolbar panel
            self._on_acquired(token, result.fence, result.valid_until, started, block)
            return True
        except BaseException as exc:
            if isinstance(exc, QuorumUnavailable):
                events.send(events.lock_not_acquired, Lock, lock=self, name=self.name,
                             wait=mgr.clock() - started, outcome="quorum_unavailable")
            # Interrupted (a signal handler such as Celery's soft time limit,
            # KeyboardInterrupt) in the middle of a round, or after the grant:
            # the nodes may have set our key, and the caller never learns it
            # holds it. Take it back on every node now instead of leaving it
            # for a whole TTL (tests/test_interrupted.py has the timeline). A
            # waiter's give-up below already releases; a failed round
            # (RedlockError) released what it took itself.
            if served or (subscription is None and not isinstance(exc, RedlockError)):
                self._unrecord_block(block, self._hold_no if self._token == token else -1)
                self._take_back(token, exc)
            raise
        finally:
            try:
                if subscription is not None:
                    subscription.close()
                    if not served:
                        # Timed out or interrupted: out of the line, or the next
                        # release would wake us in vain while others wait; and a
                        # lock handed to us meanwhile is handed on.
                        mgr._give_up(self._key_b, self._fence_key_b, self._waiters_key_b,
                                     token, self._entries(subscription))
                if not served:
                    mgr.transport.forget(token)  # no round of this token follows
            except BaseException as exc:
                # Interrupted here, after the grant (a signal handler's
                # exception in the subscription's clean-up): the caller never
                # learns it holds the lock; taken back as above.
                if served and self._token == token:
                    self._unrecord_block(block, self._hold_no)
                    self._take_back(token, exc)
                raise

    def _take_back(self, token: str, exc: BaseException) -> None:
        """Release whatever an interrupted acquire of ``token`` may hold.

        The transport keeps the token's requests in order on each connection
        (``NodeClient.checkout``), so this release reaches each node after the
        acquire it follows, even when that acquire's reply was never read.
        Bounded by the node timeouts; an error here is logged, and the
        interrupting exception goes on. A node it does not reach (its link
        down when it arrives) is sent it again by the late sender for as long
        as the key may be there (the TTL), as the clean-up of a lost attempt
        is (``rounds.acquire_steps``): sent once, it left the key there for
        the whole lease, and the lock busy when that was two nodes of three.
        """
        mgr = self.manager
        mgr._call_begins()  # a retired manager must not close under this round
        try:
            with self._io:
                if self._token == token:
                    self._forget_hold(released=True)  # blocks on it: nothing lost
            mgr._release_round(self._key_b, self._fence_key_b, self._waiters_key_b,
                               token, 0, redo=self.ttl)
        except Exception:  # noqa: BLE001 - the interrupt matters more than this round
            logger.warning("lock %r: acquire interrupted by %s; its key could not be taken "
                           "back on every node and expires with its lease (%.3f s at most)",
                           self.name, type(exc).__name__, self.ttl, exc_info=True)
        finally:
            mgr._call_ends()

    def _on_acquired(self, token: str, fence: int, valid_until: float, started: float,
                     block: Any = None) -> None:
        mgr = self.manager
        with self._io:
            self._enter_hold(token, fence, valid_until)
            self._record_block(block)  # before anything can run (a receiver, another thread)
        if self.auto_renew:
            mgr.watchdog.schedule(self, self._first_renewal())
        if events.lock_acquired.receivers:  # none: sending does nothing, skip its arguments
            events.send(events.lock_acquired, Lock, lock=self, name=self.name, fence=fence,
                        hold=self._hold_no, wait=self._acquired_at - started)

    # -- the hold's plans, run with the sync transport ------------------------
    def _run_plan(self, plan: HoldPlan, answer: Any = None,
                  send: Callable[..., Any] = events.send) -> Any:
        """Run a hold plan (``LockBase``) from here on; ``answer``: the reply to
        the step the caller already took from it (None for a new plan);
        ``send``: how its signals are sent."""
        mgr = self.manager
        try:
            step = plan.send(answer)
            while True:
                if type(step) is ReleaseRound:
                    answer = mgr._release_round(self._key_b, self._fence_key_b,
                                                self._waiters_key_b, step.token, step.fence,
                                                notify=self._notify, redo=step.lease)
                elif type(step) is ExtendRound:
                    answer = mgr._extend_round(self._key_b, self._fence_key_b, step.token,
                                               step.fence, step.ttl)
                else:
                    assert isinstance(step, Report)
                    send(step.signal, Lock, **step.kwargs)
                    answer = None
                step = plan.send(answer)
        except StopIteration as done:
            return done.value

    # -- release ---------------------------------------------------------------
    def release(self) -> None:
        """Release the lock on every node.

        Raises :class:`LockNotOwned` when this object does not hold it (never
        acquired, already released, or a child process after ``fork()``), and
        :class:`LockLost` when the lease had run out or the lock was taken before
        this call: the key is still deleted wherever it is ours, but the caller
        learns that its critical section was not protected to the end.
        """
        self._release(None)

    def _release(self, block: "tuple[int, int] | None") -> None:
        """``release()``; ``block``: (hold, fence) of the hold to end, for a
        block's exit or a release put off (``LockLost`` if the object holds
        another by then: see LockBase._record_block)."""
        if finalizers.held_up() and self._release_later(block):
            return
        if self._pid != getpid():
            self._check_process()
        plan = self._release_plan(block)
        with self._io:  # the state changes before the first step (the renewal reads it)
            step = next(plan)
        self._release_steps(plan, step)

    def _release_later(self, block: "tuple[int, int] | None" = None) -> bool:
        """``release()`` run by a garbage collection (a generator finalized
        inside ``with lock``), inside one of the library's sections, or as
        work put off until a section's end; see transport/finalizers.py.
        True when taken care of here.

        Inside a section: put off until the section ends (a round here
        waited for a node's lock its own thread held). Otherwise it runs
        now, with its signals handed to the library's thread
        (:func:`finalizers.call_later`): their receivers may take a lock
        this thread holds (the application's, a metrics library's).

        ``_io`` is not waited for: it is busy only with a renewal or an
        ``extend()`` of this same object under way in another thread, whose
        own signals' receivers may be waiting for this thread (each would
        wait for the other, for good). The state changes without it: the
        extension's plan finds the hold released when its round is back
        ("released while the extension ran") and stops."""
        if finalizers.inside():
            # Bound to the hold it is for: by the section's end, the object
            # may hold anew (its lease ran out, another thread acquired).
            finalizers.put_off(functools.partial(
                self._release_put_off,
                block if block is not None else (self._hold_no, self.fence)))
            return True
        if self._pid != getpid():
            self._check_process()
        plan = self._release_plan(block)
        got = self._io.acquire(blocking=False)
        try:
            step = next(plan)  # LockNotOwned: raised here, as release() raises it
        finally:
            if got:
                self._io.release()
        self._release_steps(plan, step, functools.partial(finalizers.call_later, events.send))
        return True

    def _release_put_off(self, block: "tuple[int, int]") -> None:
        """A release put off to a section's end: a hold lost (or gone) by then
        is a warning, as a collection's exit outside a section logs it, not
        a failure of the put-off work with its traceback."""
        try:
            self._release(block)
        except LockLost as exc:
            logger.warning("lock %r, released after a garbage collection: %s", self.name, exc)
        except LockNotOwned:
            pass  # that hold ended meanwhile (its lease, a release): nothing to do

    def _release_steps(self, plan: HoldPlan, step: Any,
                       send: Callable[..., Any] = events.send) -> None:
        """The rest of ``release()`` once the state changed: its round, then its
        reports (``LockLost``; the signal, through ``send``)."""
        assert type(step) is ReleaseRound
        try:
            result = self.manager._release_round(self._key_b, self._fence_key_b,
                                                 self._waiters_key_b, step.token, step.fence,
                                                 notify=self._notify, redo=step.lease)
        except BaseException:
            # Ended now (its count of releases in flight with it), not when
            # the garbage collector finalizes it, which an exception kept
            # alive (a stored traceback) put off to any thread, any time.
            plan.close()
            raise
        self._run_plan(plan, result, send)

    def _release_unawaited(self) -> None:
        """``release()`` without waiting for the nodes' replies, and so without
        its reports (no ``lock_released`` signal, no ``LockLost``): the state
        changes as ``release()`` changes it, the requests go out, and their
        replies are read by the next round on their connections. For a
        semaphore's line, handed on by a head that already holds its permit:
        the next head is woken by the release script as it would be, and the
        head's ``acquire()`` returns without one more round trip. Raises
        :class:`LockNotOwned` as ``release()`` does."""
        if self._pid != getpid():
            self._check_process()
        plan = self._release_plan()
        with self._io:  # the state changes before the round (the renewal reads it)
            step = next(plan)
        mgr = self.manager
        mgr._call_begins()  # the plan's own count ends at close(), before the round
        try:
            plan.close()
            assert type(step) is ReleaseRound
            mgr._release_round(self._key_b, self._fence_key_b, self._waiters_key_b,
                               step.token, step.fence, notify=self._notify, wait=False,
                               redo=step.lease)
        finally:
            mgr._call_ends()

    # -- extend / renew --------------------------------------------------------
    def extend(self, ttl: float | EllipsisType = ...) -> None:
        """Reset the lease to ``ttl`` seconds (default: the lock's TTL) on a quorum.

        The holder counts on ``ttl`` from this call (``validity``); a node
        never shortens a lease, so after a longer one the key stays there
        until that longer end (or ``release()``): a request of this holder
        that a node runs late cannot cut the lease a later extend set
        (tests/test_extend_order.py has the timeline).

        Raises :class:`LockNotOwned` when not held; :class:`LockLost` when the
        lease already ran out or a majority no longer has our key;
        :class:`QuorumUnavailable` when too few nodes answered (the lock is still
        held until its current lease ends; the renewal thread keeps trying).
        """
        new_ttl = self.ttl if ttl is ... else check_ttl(ttl)  # before anything is sent
        if self._pid != getpid():
            self._check_process()
        with self._io:
            self._run_plan(self._extend_call_plan(new_ttl))

    def _check_process(self) -> None:
        """Raise :class:`LockNotOwned` in a process that never acquired this
        object (a forked child), before ``_io`` is waited for: a parent thread
        that held it at the fork does not exist here (see engine/held.py)."""
        if self._pid != getpid():
            raise LockNotOwned(f"lock {self.name!r} is not held by this object",
                               lock_name=self.name)

    def _watchdog_tick(self, hold: int) -> float | None:
        """Called by the watchdog thread for the entry of hold number ``hold``;
        returns the next due time or None (an entry of an earlier hold of this
        object, see ``watchdog._Entry``, stops: the current hold has its own)."""
        mgr = self.manager
        if not self._io.acquire(blocking=False):
            return mgr.clock() + min(0.05, self.ttl / 10)  # a release/extend is running
        try:
            if hold != self._hold_no:
                return None
            due: float | None = self._run_plan(self._renew_plan())
            return due
        finally:
            self._io.release()

    def _renewal_begin(self, hold: int) -> "tuple[HoldPlan, ExtendRound] | float | None":
        """A batched renewal's first half (the watchdog thread, see
        ``Watchdog._renew``): the renewal plan of hold number ``hold`` run up
        to its extension round.

        Returns that plan and round, holding ``_io`` until :meth:`_renewal_end`;
        or, when no round is needed, the next due time (None: stop renewing,
        as for an entry of an earlier hold: see :meth:`_watchdog_tick`).
        """
        mgr = self.manager
        if not self._io.acquire(blocking=False):
            return mgr.clock() + min(0.05, self.ttl / 10)  # a release/extend is running
        if hold != self._hold_no:
            self._io.release()
            return None
        try:
            reports, outcome = run_to_round(self._renew_plan())
            for report in reports:
                events.send(report.signal, Lock, **report.kwargs)
        except BaseException:
            self._io.release()
            raise
        if not isinstance(outcome, tuple):
            self._io.release()
        return outcome

    def _renewal_end(self, plan: HoldPlan, result: Any) -> float | None:
        """The second half: the plan gets its round's result; ``_io`` is let go."""
        try:
            due: float | None = self._run_plan(plan, result)
            return due
        finally:
            self._io.release()

    def _renewal_abort(self, plan: HoldPlan) -> None:
        """The batch failed before this lock's result: drop the plan, let ``_io`` go
        (the watchdog tries again soon)."""
        plan.close()
        self._io.release()

    def _report_lost(self, reason: str, held: float) -> None:
        self._run_plan(self._report_lost_plan(reason, held))

    # -- context manager -------------------------------------------------------
    def __enter__(self) -> "Lock":
        # Told before the acquire (a code's first time: a pass over its
        # instructions), so that nothing but the record follows the grant:
        # an interrupt there left the hold with no block to end it.
        caller = sys._getframe(1)
        block = caller if entered_by_statement(caller) else self._hand_entry(caller)
        granted = False
        try:
            granted = self._acquire(True, ..., block)
            if not granted:
                raise self._busy_error()
            return self
        except BaseException:
            if granted:  # interrupted after the grant: the with never runs its exit
                self._drop_block_hold(block)
            raise

    def _records_io(self) -> bool:
        """Take ``_io`` for a look at the entry records and a change of them
        (engine/entries.py), as the grant records its entry under it: two
        exits by hand of two threads, or an exit and a grant, each read the
        records the other was changing, and an exit took another holder's
        entry (review 8). True when taken. Not waited for by an exit that a
        garbage collection or put-off work runs (``finalizers.held_up``; see
        :meth:`_release_later`): it looks without it when a renewal or an
        ``extend()`` of this object holds it in another thread."""
        if finalizers.held_up():
            return self._io.acquire(blocking=False)
        self._io.acquire()
        return True

    def _drop_block_hold(self, block: Any) -> None:
        """Release the hold just granted to the block in frame ``block``,
        which the caller will never hold (an interrupt at the end of
        ``__enter__``): left, it was renewed and "already held" for good."""
        mine = self._block_of(block) if block is not None else None
        try:
            self._release(mine if mine is not None else (self._hold_no, self.fence))
        except RedlockError:
            pass  # lost or gone meanwhile: nothing of it to release

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            caller = sys._getframe(1)
            guarded = self._records_io()
            try:
                release, block = self._leaving(caller)
            finally:
                if guarded:
                    self._io.release()
            if release:
                self._release(block)  # the hold this block entered
        except LockLost:
            if exc_type is None:
                raise
            # The body already failed; its exception propagates, the loss is logged.
            logger.warning("lock %r was lost while the body raised %s", self.name,
                           exc_type.__name__)
