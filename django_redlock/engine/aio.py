"""The asyncio flavour: :class:`AsyncLock`, with the semantics of the sync :class:`Lock`.

(Why one module of 940 lines: besides the thin driver of the protocol's plans,
asyncio needs what a thread gets from the watchdog and the notice thread: renewals
batched per event loop, the bridge from the notice thread to the loop, and the
guard against a loop that stopped (the timeline below); apart, each would reach
into the lock's state.)

>>> async with manager.alock("stock:42") as held:   # or django_redlock.alock(...)
...     ...                                          # held.fence, held.validity

It shares everything that is not I/O with the sync engine: the manager's nodes,
options, quorum, node back-off and settings; the Lua scripts and their packing;
the quorum, validity, retry and owner code in ``core/``. Only the rounds run on
:class:`~django_redlock.transport.aio.AsyncTransport`.

The event loop is a clock that can stop. Timeline of the failure this module is
built around (aioredlock's renewal task has it, and its holder never learns)::

    t0    task A acquires "report" (TTL 1 s); its renewal task is due at t0+0.33
    t0.1  A calls a blocking function (time.sleep, a sync ORM call, CPU work)
          for 2 s: the event loop is stuck, the renewal task cannot run
    t1    A's lease expires on the nodes; B acquires "report" (fence higher)
    t2.1  A's call returns and its ``async with`` block ends

So validity is never taken from "the renewal did not complain": it is the
monotonic deadline ``valid_until`` measured when the lease was last granted.
``owned()`` and ``validity`` read it, a late renewal checks it before extending,
and ``release()`` (hence the end of ``async with``) raises :class:`LockLost` when
it has passed, although no renewal ever ran to notice. A's release compares
tokens and leaves B's key alone.

Cancellation: a release, once begun, always reaches the nodes. ``release()`` (and
so the exit of an ``async with`` whose body was cancelled) runs its round in a
shielded task and waits for it; a cancellation that arrives meanwhile is
re-raised afterwards. An ``acquire()`` cancelled in the middle of a round
releases whatever that round may have taken on the nodes, the same way.

Renewal (``auto_renew``): a loop timer per held lock, due at TTL/3 (rounded up
to a :data:`RENEWAL_SLOT`, so that locks due about together fire together); a
failed renewal is retried while the lease lasts, and the lock is marked lost
when the lease ran out or a majority no longer has the key. The timer holds the
lock only weakly (a lock dropped without release stops renewing and simply
expires). The locks of one manager that fall due in one turn of the loop are
renewed together, with one ``extend_many`` call per node (:class:`_Renewals`,
as the sync watchdog does): 1,000 locks held in a loop cost a few round trips
per renewal period, not 1,000. ``release()`` cancels the timer; a batched round
already in flight is not cancelled (other locks ride in it) and may reach a node
after the release: it finds no key of ours there (an extension compares the
token and never creates a key), and its result is dropped (the plan sees the
lock released).

Wake-ups: a waiter reuses the manager's :class:`ReleaseNotifier` (shared with
the sync locks). The blocking subscribe runs in the loop's default executor; the
subscription is then *passive*: a waiting sync thread, or else the notifier's
own thread, reads the notices and wakes the waiter through
``loop.call_soon_threadsafe`` on an ``asyncio.Event``. One notifier per manager,
whatever the number of loops, and none of redis-py's RESP3 push-handler quirks.

An ``AsyncLock`` belongs to the event loop (task) that acquires it. The manager
may be shared by any number of loops and threads.
"""

from __future__ import annotations

import asyncio
import functools
import math
import sys
import threading
import weakref
from collections.abc import Awaitable, Coroutine, Generator, Sequence
from types import EllipsisType, TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

from django.dispatch import Signal

from ..core.arguments import check_ttl
from ..exceptions import (
    LockLost,
    QuorumUnavailable,
    RedlockError,
)
from ..transport import finalizers
from . import events, rounds
from .awaits import awaited_frames, awaiting_task, runs_alone
from .blocks import entered_by_statement
from .lock import Lock  # the sender of every lock signal
from .protocol import (
    _HELD,
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
from .rounds import AcquireResult, ExtendResult, ReleaseResult

if TYPE_CHECKING:
    from ..transport.aio import AsyncTransport
    from ..transport.notify import Subscription
    from .protocol import LockHost

__all__ = ["AsyncLock"]

logger = finalizers.get_logger("django_redlock.lock")


T = TypeVar("T")


# -- helpers -----------------------------------------------------------------
class _Shielded:
    """What the task waits on in place of ``fut`` while :func:`_complete` runs
    a coroutine: the same future, except that a cancellation cannot reach it
    (``cancel()`` declines). The task is then cancelled once ``fut`` is done,
    at the ``yield`` of :class:`_Complete`, which notes it and goes on."""

    __slots__ = ("_asyncio_future_blocking", "_fut")

    def __init__(self, fut: Any) -> None:
        self._fut = fut
        self._asyncio_future_blocking = True

    def get_loop(self) -> asyncio.AbstractEventLoop:
        loop: asyncio.AbstractEventLoop = self._fut.get_loop()
        return loop

    def add_done_callback(self, fn: Any, *, context: Any = None) -> None:
        self._fut.add_done_callback(fn, context=context)

    def remove_done_callback(self, fn: Any) -> int:
        removed: int = self._fut.remove_done_callback(fn)
        return removed

    def cancel(self, msg: Any = None) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return bool(self._fut.done())

    def result(self) -> Any:
        return self._fut.result()

    def exception(self) -> Any:
        return self._fut.exception()


class _Complete:
    """The awaitable of :func:`_complete`: drives ``coro`` in the calling task,
    handing the task a :class:`_Shielded` for every future ``coro`` waits on."""

    __slots__ = ("_coro",)

    def __init__(self, coro: Coroutine[Any, Any, T]) -> None:
        self._coro = coro

    def __await__(self) -> Generator[Any, None, tuple[Any, bool]]:
        coro = self._coro
        cancelled = False
        throw: BaseException | None = None
        while True:
            try:
                if throw is None:
                    waited = coro.send(None)
                else:
                    waited, throw = coro.throw(throw), None
            except StopIteration as done:
                return done.value, cancelled
            try:
                yield None if waited is None else _Shielded(waited)
            except GeneratorExit:
                coro.close()
                raise
            except asyncio.CancelledError as exc:
                if waited is not None and not waited.done():
                    throw = exc  # not a cancellation of the task (see _Shielded): passed on
                elif waited is None or not waited.cancelled():
                    cancelled = True  # the caller's: noted, re-raised by the caller after
                # else: ``waited`` itself was cancelled; ``coro`` reads it from there
            except BaseException:  # noqa: BLE001 - ``waited`` failed; ``coro`` reads it from there
                pass


def _complete(aw: Coroutine[Any, Any, T]) -> Awaitable[tuple[T, bool]]:
    """Run ``aw`` to its end even if the caller is cancelled meanwhile.

    Returns ``(result, cancelled)``; the caller re-raises ``CancelledError`` after
    its own bookkeeping when ``cancelled``. ``aw`` runs in the calling task (no
    task of its own, no turn of the loop to start it or to hand its result
    back): a cancellation of the task is deferred until the future ``aw``
    waits on is done, then noted. So every wait of ``aw`` must be bounded
    without cancelling the task (the transport's rounds are: their deadlines
    abort connections, ``transport.aio._Deadlines``; waits for their tasks
    and ``asyncio.wait`` have timeouts of their own), and only the loop
    shutting down can cut ``aw`` short.
    """
    return _Complete(aw)


async def _send(signal: Signal, **kwargs: Any) -> None:
    """Send like :func:`.events.send` (sender=Lock, failures logged), from a coroutine.

    Django 5's ``asend_robust`` is used when present: ``send_robust`` would call
    async receivers through ``async_to_sync``, which refuses to run inside a loop.
    """
    if not signal.receivers:
        return  # free; has_listeners() below walks the receivers
    if events.only_loop_safe(signal):
        # The package's own receivers only (metrics, the debug panel): called
        # here, in the loop's thread; asend_robust would run each through
        # sync_to_async, a worker thread's round trip (events._loop_safe).
        events.send(signal, Lock, **kwargs)
        return
    if not signal.has_listeners(Lock):
        return
    asend = getattr(signal, "asend_robust", None)
    if asend is None:
        events.send(signal, Lock, **kwargs)
        return
    for receiver, result in await asend(Lock, **kwargs):
        if isinstance(result, Exception):
            events.logger.error("receiver %r of %s failed", receiver, kwargs.get("name"),
                                 exc_info=result)


class _LoopEvent(threading.Event):
    """A ``threading.Event`` whose ``set()``, from any thread, also wakes an asyncio waiter."""

    def __init__(self, loop: asyncio.AbstractEventLoop, target: asyncio.Event) -> None:
        super().__init__()
        self._loop = loop
        self._target = target

    def set(self) -> None:
        super().set()
        try:
            self._loop.call_soon_threadsafe(self._target.set)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass


class _Waiter:
    """An asyncio waiter's release-notice subscription (see the module docstring)."""

    def __init__(self, sub: Subscription, event: asyncio.Event) -> None:
        self.sub = sub
        self.event = event

    async def wait(self, timeout: float) -> bool:
        if self.event.is_set():
            return True
        try:
            await asyncio.wait_for(self.event.wait(), timeout)
        except asyncio.TimeoutError:  # not the builtin one on Python 3.10
            return False
        return True

    def clear(self) -> None:
        self.event.clear()
        self.sub.clear()

    def close(self) -> None:
        self.sub.close()


def _close_subscription(fut: asyncio.Future[Subscription]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result().close()


async def _subscribe(manager: LockHost, channel: bytes, confirm: float,
                     waiter: bytes, hand_over: bytes) -> _Waiter:
    loop = asyncio.get_running_loop()
    notifier = manager.notifier
    fut = loop.run_in_executor(None, notifier.subscribe, channel, confirm, waiter, hand_over)
    try:
        sub = await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(_close_subscription)
        raise
    event = asyncio.Event()
    # Swap in an event that reaches this loop. A notice that set the old event
    # just before the swap is not lost: the caller makes one more attempt right
    # after subscribing, and that attempt sees the release the notice announced.
    old, sub.event = sub.event, _LoopEvent(loop, event)
    if old.is_set() or sub.notified:
        event.set()
    sub.make_passive()  # this thread cannot read for it while the loop runs
    return _Waiter(sub, event)


# -- rounds (the rules live in rounds.py, shared with the sync manager) --------
async def _run(mgr: LockHost, transport: AsyncTransport, steps: rounds.Steps[T]) -> T:
    """Drive a round's steps (rounds.py) with the asyncio transport; a failed
    request worth sending again goes to ``mgr``'s late sender, as in
    ``LockManager._run``."""
    try:
        ask = next(steps)
        while True:
            replies = await transport.round(ask.requests, skip_backoff=ask.skip_backoff,
                                            last=ask.last, tag=ask.tag,
                                            settle=ask.settle, final=ask.final)
            if ask.redo:
                mgr._send_later(ask.requests, replies, ask.redo)
            ask = steps.send(replies)
    except StopIteration as done:
        value: T = done.value
        return value


async def _acquire_round(mgr: LockHost, transport: AsyncTransport, key: bytes, fkey: bytes,
                         wkey: bytes, token: str, ttl_ms: int, owner: str, fencing: bool,
                         ttl: float, *, lock_name: str, waiter: bytes = b"",
                         hand_over: bytes = b"", woken: bool = False, ask_all: bool = False,
                         again: bool = False,
                         handed: AcquireResult | None = None, attempt: int = 0,
                         guard: rounds.Guard | None = None) -> AcquireResult:
    return await _run(mgr, transport, rounds.acquire_steps(
        mgr, key, fkey, wkey, token, ttl_ms, owner, fencing, ttl, lock_name=lock_name,
        waiter=waiter, hand_over=hand_over, woken=woken, ask_all=ask_all, again=again,
        handed=handed, attempt=attempt, guard=guard))


async def _release_round(mgr: LockHost, transport: AsyncTransport, key: bytes, fkey: bytes,
                         wkey: bytes, token: str, fence: int, *,
                         only: Sequence[bool] | None = None,
                         notify: bytes = b"", wait: bool = True,
                         redo: float = 0.0) -> ReleaseResult:
    return await _run(mgr, transport, rounds.release_steps(
        mgr, key, fkey, wkey, token, fence, only=only, notify=notify, wait=wait, redo=redo))


async def _leave_queue(mgr: LockHost, transport: AsyncTransport, wkey: bytes,
                       entries: Sequence[bytes], *, only: Sequence[bool] | None = None) -> None:
    """See :meth:`LockHost._leave_queue`."""
    await _run(mgr, transport, rounds.leave_queue_steps(mgr, wkey, entries, only=only))


async def _give_up(mgr: LockHost, transport: AsyncTransport, key: bytes, fkey: bytes,
                   wkey: bytes, token: str, entries: Sequence[bytes]) -> None:
    """See :meth:`LockHost._give_up`."""
    await _run(mgr, transport, rounds.give_up_steps(mgr, key, fkey, wkey, token, entries))


async def _extend_round(mgr: LockHost, transport: AsyncTransport, key: bytes, fkey: bytes,
                        token: str, fence: int, ttl: float) -> ExtendResult:
    return await _run(mgr, transport, rounds.extend_steps(mgr, key, fkey, token, fence, ttl))


async def _holders(mgr: LockHost, transport: AsyncTransport, key: bytes) -> int:
    return await _run(mgr, transport, rounds.holders_steps(mgr, key))


#: Renewal timers are rounded up to this many seconds, so that the locks due
#: within one slot fire in one turn of the loop and share one batched round.
RENEWAL_SLOT = 0.02


def _renewal_due(ref: weakref.ref[AsyncLock], hold: int) -> None:
    """Timer callback: hand the lock to its manager's batch of this loop (the
    lock is held only weakly until then). ``hold``: the hold that set the
    timer (``LockBase._hold_no``); a timer of an earlier hold renews nothing
    (see ``AsyncLock._schedule_renewal``)."""
    lock = ref()
    if lock is None or lock._state != _HELD or lock._hold_no != hold:
        return
    lock._renewal_timer = None
    _Renewals.of(lock).add(lock, hold)


class _Renewals:
    """The renewals of one manager's asyncio locks in one event loop, batched.

    Timers that fire in one turn of the loop add their locks here; one task
    then renews them all with ``rounds.extend_many_steps`` (one script call per
    node), each lock's plan run to its extension round first and resumed with
    its own result after (``AsyncLock._renewal_begin`` / ``_renewal_end``), so
    a lock's renewal rules (``MAX_HOLD``, retries, reporting a loss) are the
    single lock's. A lock whose ``extend()`` is running waits for the next turn.
    """

    _by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.WeakKeyDictionary[Any, _Renewals]]" = (  # noqa: E501
        weakref.WeakKeyDictionary())

    def __init__(self, mgr: LockHost, transport: AsyncTransport) -> None:
        self.mgr = mgr
        self.transport = transport
        self.due: list[tuple[AsyncLock, int]] = []  # each lock, and the hold due
        self.task: asyncio.Task[None] | None = None

    @classmethod
    def of(cls, lock: AsyncLock) -> _Renewals:
        per_mgr = cls._by_loop.setdefault(asyncio.get_running_loop(),
                                          weakref.WeakKeyDictionary())
        batch = per_mgr.get(lock.manager)
        if batch is None:
            batch = per_mgr[lock.manager] = cls(lock.manager, lock.transport)
        return batch

    def add(self, lock: AsyncLock, hold: int) -> None:
        self.due.append((lock, hold))
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while self.due:
                await asyncio.sleep(0)  # the other timers of this turn join
                locks, self.due = self.due, []
                try:
                    await self._renew(locks)
                except Exception:  # a renewal bug must be reported, never kill the loop
                    logger.exception("batched renewal failed unexpectedly")
        finally:
            self.task = None

    async def _renew(self, locks: list[tuple[AsyncLock, int]]) -> None:
        begun: list[tuple[AsyncLock, int, HoldPlan, ExtendRound]] = []
        for lock, hold in locks:
            try:
                first = await lock._renewal_begin(hold)
            except Exception:  # noqa: BLE001 - one lock's failure must not stop the others'
                logger.exception("renewal of lock %r failed unexpectedly", lock.name)
                continue
            if isinstance(first, tuple):
                begun.append((lock, hold, *first))
            elif first is not None and lock._still(hold):
                lock._schedule_renewal(first)
        if not begun:
            return
        try:
            results: list[Any] = await _run(self.mgr, self.transport, rounds.extend_many_steps(
                self.mgr, [rounds.Extension(lock._key_b, lock._fence_key_b, step.token,
                                            step.fence, step.ttl)
                           for lock, _, _, step in begun]))
        except Exception:  # noqa: BLE001 - every lock of the batch tries again soon
            logger.exception("batched renewal failed unexpectedly")
            for lock, hold, plan, _ in begun:
                lock._renewal_abort(plan)
                if lock._still(hold):
                    lock._schedule_renewal(self.mgr.clock() + 0.05)
            return
        for (lock, hold, plan, _), result in zip(begun, results):
            try:
                due = await lock._renewal_end(plan, result)
            except Exception:  # noqa: BLE001
                logger.exception("renewal of lock %r failed unexpectedly", lock.name)
                continue
            if due is not None and lock._still(hold):
                lock._schedule_renewal(due)


# -- the lock ------------------------------------------------------------------
class AsyncLock(LockBase):
    """A distributed lock on ``name`` for asyncio code; from :meth:`LockHost.alock`.

    Same semantics as :class:`~django_redlock.Lock`, with coroutines:
    ``await acquire()``, ``await release()``, ``await extend()``, ``await locked()``,
    ``async with``. ``owned()``, ``validity``, ``fence``, ``name``, ``key`` and
    ``retry_after`` are plain attributes: they need no round trip. One object is
    one holder, used from one event loop; locks are not reentrant.
    """

    def __init__(self, manager: LockHost, transport: AsyncTransport, name: str,
                 **options: Any) -> None:
        super().__init__(manager, name, **options)
        self.transport = transport
        self._io = asyncio.Lock()
        self._renewal_timer: asyncio.TimerHandle | None = None
        #: A renewal task of this lock alone: none now that renewals are batched
        #: (_Renewals); release() still cancels one if a subclass starts it.
        self._renewal: asyncio.Task[None] | None = None

    async def locked(self) -> bool:
        """Whether anyone holds the lock (its key is on a quorum of nodes); one round trip."""
        return await _holders(self.manager, self.transport, self._key_b) >= self.manager.quorum

    # -- acquire ---------------------------------------------------------------
    async def acquire(self, blocking: bool = True,
                      timeout: float | None | EllipsisType = ...) -> bool:
        """Acquire the lock; True when held, False when the wait ran out.

        ``timeout``: None waits forever, 0 tries once, a number waits that many
        seconds; left out, the lock's (then the manager's) timeout applies.
        ``blocking=False`` is the same as ``timeout=0``. Raises
        :class:`QuorumUnavailable` when fewer than a quorum of nodes answer.
        """
        return await self._acquire(blocking, timeout, None)

    async def _acquire(self, blocking: bool, timeout: float | None | EllipsisType,
                       block: Any) -> bool:
        """``acquire()``; ``block``: the frame of the ``async with`` statement
        it is for (None: by hand), recorded with the hold
        (LockBase._record_block)."""
        mgr = self.manager
        started, deadline, token, owner, ttl_ms, pause = self._start_acquire(blocking, timeout)
        stale = self._end_stale_hold()
        if self._state == _UNLOCKED:
            self._cancel_renewal_timer()  # an earlier hold's, left by a lease that lapsed
        if stale is not None:
            await self._report_lost(*stale)
        if pause:
            # We just handed the lock over: go straight into the line (Lock.acquire).
            await asyncio.sleep(pause)
        plan = self._acquire_plan(deadline, in_line=bool(pause))
        waiter: _Waiter | None = None
        served = False
        refusal: AcquireResult | None = None  # the last refused attempt
        try:
            try:
                step = next(plan)
                while True:
                    if type(step) is Attempt:
                        sub = waiter.sub if waiter else None
                        try:
                            answer: Any = await _acquire_round(
                                mgr, self.transport, self._key_b, self._fence_key_b,
                                self._waiters_key_b, token, ttl_ms, owner, self.fencing,
                                self.ttl, lock_name=self.name,
                                waiter=sub.entry if sub else b"",
                                hand_over=sub.hand_over_entry if sub else b"",
                                woken=step.woken, ask_all=step.ask_all, again=step.again,
                                handed=self._take_handover(sub, refusal),
                                attempt=step.number, guard=self._guard)
                        except asyncio.CancelledError:
                            # The round may have set our key on some nodes: take it
                            # back, and again where it missed a node, for as long as
                            # the key may be there (Lock._take_back).
                            mgr._call_begins()  # no retired manager closes under it
                            try:
                                await _complete(_release_round(
                                    mgr, self.transport, self._key_b, self._fence_key_b,
                                    self._waiters_key_b, token, 0, redo=self.ttl))
                            finally:
                                mgr._call_ends()
                            raise
                        except QuorumUnavailable as exc:
                            step = plan.throw(exc)  # re-raised, or the plan asks again
                            continue
                        if not answer.acquired:
                            refusal = answer
                    elif type(step) is Pause:
                        await asyncio.sleep(step.seconds)
                        answer = None
                    elif type(step) is Subscribe:
                        answer = waiter = await _subscribe(
                            mgr, self._key_b, step.confirm, token.encode(),
                            self._hand_over_entry(ttl_ms, owner))
                    else:
                        assert waiter is not None
                        answer = await waiter.wait(cast(Wait, step).seconds)
                        waiter.clear()
                        if answer:
                            await _send(events.lock_waiter_woken, lock=self, name=self.name)
                    step = plan.send(answer)
            except StopIteration as done:
                result = done.value
            if result is None:
                await _send(events.lock_not_acquired, lock=self, name=self.name,
                            wait=mgr.clock() - started, outcome="busy")
                return False
            served = True  # the granting nodes' scripts took us out of the line
            self.granted_nodes = result.granted  # for the debug-toolbar panel
            try:
                self._on_acquired(token, result.fence, result.valid_until, block)
                granted = (self._hold_no, self.fence)
            except QuorumUnavailable:
                # Granted on a retired manager closed meanwhile (_enter_hold):
                # not held, so taken back where the nodes can still be reached
                # (the sync flavour's _take_back), and out of the line (finally).
                served = False
                mgr._call_begins()
                try:
                    await _complete(_release_round(mgr, self.transport, self._key_b,
                                                   self._fence_key_b, self._waiters_key_b,
                                                   token, 0, redo=self.ttl))
                finally:
                    mgr._call_ends()
                raise
            try:
                if waiter is not None and result.queued_at:
                    # Nodes that answered busy put us in line: leave it there too.
                    _, cancelled = await _complete(_leave_queue(
                        mgr, self.transport, self._waiters_key_b, self._entries(waiter.sub),
                        only=result.queued_at))
                    if cancelled:
                        raise asyncio.CancelledError
                await _send(events.lock_acquired, lock=self, name=self.name,
                            fence=self.fence, hold=self._hold_no,
                            wait=self._acquired_at - started)
            except asyncio.CancelledError:
                # Cancelled meanwhile (or in a signal receiver): the caller
                # never learns it holds the lock, so it must not stay held.
                # Its own hold: the object may hold anew by now (its lease
                # ran out during a slow receiver, another task entered).
                self._unrecord_block(block, granted[0])
                try:
                    await self._release(granted)
                except (RedlockError, asyncio.CancelledError):
                    pass
                raise
            return True
        except QuorumUnavailable:
            await _send(events.lock_not_acquired, lock=self, name=self.name,
                        wait=mgr.clock() - started, outcome="quorum_unavailable")
            raise
        finally:
            if waiter is not None:
                waiter.close()
                if not served:
                    # Timed out, failed or cancelled: out of the line, or the next
                    # release would wake us in vain while others wait. Finished
                    # even when cancelled; the CancelledError goes on afterwards.
                    # A lock handed to us meanwhile is handed on (Lock.acquire).
                    await _complete(_give_up(mgr, self.transport, self._key_b,
                                             self._fence_key_b, self._waiters_key_b, token,
                                             self._entries(waiter.sub)))

    def _entrant(self, own: Any = None) -> Any:
        """The task entering (leaving) by hand, None outside one. When
        ``own`` (the frame of ``__aenter__`` / ``__aexit__``) is all its task
        runs, a task that ``asyncio.wait_for`` (before 3.12) or
        ``asyncio.shield`` made for the call: the task awaiting it there
        (recorded for that task, which ends at once, an entry was taken by
        another task's exit for its own: two holders). A task running code
        of its own is its own entrant, however awaited."""
        try:
            task = asyncio.current_task()
        except RuntimeError:
            return None
        if task is None or own is None or not runs_alone(task, own):
            return task
        return self._awaiting_chain(task)[-1]

    @staticmethod
    def _awaiting_chain(task: "asyncio.Task[Any]") -> "list[asyncio.Task[Any]]":
        """``task`` and the tasks awaiting it through wait_for / shield, innermost first."""
        chain = [task]
        for _ in range(8):  # nested wait_for / shield, bounded
            outer = awaiting_task(chain[-1], False)
            if outer is None:
                break
            chain.append(outer)
        return chain

    def _adopt_blocks(self, frame: Any) -> None:
        """As a sync lock's (LockBase), and through a task that
        ``asyncio.wait_for`` (before 3.12) or ``asyncio.shield`` made for the
        acquire (or for a coroutine of the caller's around it): the caller's
        task awaits it as if directly, and the blocks on that task's chain
        of awaits adopt the hold (``async with L: ... await
        asyncio.wait_for(L.acquire(), 3)`` after the lease lapsed: left to
        nobody, that hold was renewed for good)."""
        super()._adopt_blocks(frame)
        try:
            task = asyncio.current_task()
        except RuntimeError:
            return
        for _ in range(8):  # nested wait_for / shield, bounded
            if task is None or not self._blocks:
                return
            # Only through wait_for / shield: a task awaited by gather, a
            # TaskGroup or a plain ``await task`` is a child, and a hold it
            # takes by hand is its own to release.
            task = awaiting_task(task, False)
            if task is None:
                return
            self._adopt_on(awaited_frames(task.get_coro()))  # down its chain of awaits

    def _on_acquired(self, token: str, fence: int, valid_until: float,
                     block: Any = None) -> None:
        self._enter_hold(token, fence, valid_until)
        self._record_block(block)  # before anything can run (a receiver, another task)
        if self.auto_renew:
            self._schedule_renewal(self._first_renewal())

    def _schedule_renewal(self, due: float) -> None:
        """Set the renewal timer of the current hold, due at ``due``.

        A timer, not a sleeping task: nothing to create or tear down per
        acquisition, and the timer refers to the lock only weakly. Rounded up
        to a slot of the loop's clock, so that locks due about together fire
        in one turn and share one batched round (:class:`_Renewals`).

        One chain of renewals per object: a timer left pending by a hold that
        ended without ``release()`` (lost, or its lease lapsed) is cancelled,
        and carries its hold's number besides (a timer already fired, its
        lock waiting in a batch, is not cancellable). Timeline of the two
        chains this stops::

            t0      acquire (hold 1): timer T1 due t0+ttl/3
            t0+     the hold is lost (extend() finds the key gone)
            t0+     acquire again (hold 2): timer T2, set over T1
            t0+ttl/3  T1 fires, renews hold 2, sets a timer of its own:
                    two chains now renew hold 2, and release() cancels one
        """
        self._cancel_renewal_timer()
        loop = asyncio.get_running_loop()
        at = loop.time() + max(0.0, due - self.manager.clock())
        at = math.ceil(at / RENEWAL_SLOT) * RENEWAL_SLOT
        self._renewal_timer = loop.call_at(at, _renewal_due, weakref.ref(self), self._hold_no)

    def _cancel_renewal_timer(self) -> None:
        timer, self._renewal_timer = self._renewal_timer, None
        if timer is not None:
            timer.cancel()

    def _still(self, hold: int) -> bool:
        """Whether hold number ``hold`` is still on (held, not ended meanwhile)."""
        return self._state == _HELD and self._hold_no == hold

    async def _renewal_begin(self, hold: int) -> "tuple[HoldPlan, ExtendRound] | float | None":
        """A batched renewal's first half (:class:`_Renewals`): the renewal plan
        of hold number ``hold`` run up to its extension round, holding ``_io``
        until :meth:`_renewal_end`; or, when no round is needed, the next due
        time (None: stop renewing, as for a later hold than ``hold``). The twin
        of ``Lock._renewal_begin``."""
        mgr = self.manager
        if self._hold_no != hold:
            return None
        if self._io.locked():
            return mgr.clock() + min(0.05, self.ttl / 10)  # an extend() is running
        await self._io.acquire()
        if self._hold_no != hold:  # ended and acquired again while we waited
            self._io.release()
            return None
        try:
            reports, outcome = run_to_round(self._renew_plan())
            for report in reports:
                await _send(report.signal, **report.kwargs)
        except BaseException:
            self._io.release()
            raise
        if not isinstance(outcome, tuple):
            self._io.release()
        return outcome

    async def _renewal_end(self, plan: HoldPlan, result: Any) -> float | None:
        """The second half: the plan gets its round's result; ``_io`` is let go."""
        try:
            due: float | None = await self._run_plan(plan, result)
            return due
        finally:
            self._io.release()

    def _renewal_abort(self, plan: HoldPlan) -> None:
        """The batch failed before this lock's result: drop the plan, let ``_io`` go."""
        plan.close()
        self._io.release()

    # -- the hold's plans (LockBase), run with the asyncio transport ------------------
    async def _run_plan(self, plan: HoldPlan, answer: Any = None) -> Any:
        """Run a hold plan from here on (see ``Lock._run_plan``)."""
        mgr = self.manager
        try:
            step = plan.send(answer)
            while True:
                if type(step) is ReleaseRound:
                    answer = await _release_round(mgr, self.transport, self._key_b,
                                                  self._fence_key_b, self._waiters_key_b,
                                                  step.token, step.fence, notify=self._notify,
                                                  redo=step.lease)
                elif type(step) is ExtendRound:
                    answer = await _extend_round(mgr, self.transport, self._key_b,
                                                 self._fence_key_b, step.token, step.fence,
                                                 step.ttl)
                else:
                    assert isinstance(step, Report)
                    await _send(step.signal, **step.kwargs)
                    answer = None
                step = plan.send(answer)
        except StopIteration as done:
            return done.value

    # -- release ---------------------------------------------------------------
    async def release(self) -> None:
        """Release the lock on every node; the round completes even if cancelled.

        Raises :class:`LockNotOwned` when this object does not hold it, and
        :class:`LockLost` when the lease had run out (by the monotonic clock, even
        if no renewal noticed) or the lock was taken before this call: the key is
        still deleted wherever it is ours, but the caller learns that its critical
        section was not protected to the end. A cancellation that arrives during
        the release is re-raised once the nodes have been told.
        """
        await self._release(None)

    async def _release(self, block: "tuple[int, int] | None") -> None:
        """``release()``; ``block``: (hold, fence) of the hold to end, for a
        block's exit (``LockLost`` if the object holds another by now: see
        LockBase._record_block)."""
        plan = self._release_plan(block)
        step = next(plan)  # the state changes here, before anything yields to the loop
        assert type(step) is ReleaseRound
        self._cancel_renewal_timer()
        renewal, self._renewal = self._renewal, None
        if finalizers.finalizing() or asyncio._get_running_loop() is None:
            self._release_elsewhere(plan, step, renewal)
            return
        try:
            result, cancelled = await _complete(self._release_nodes(renewal, step))
        except BaseException:
            plan.close()  # now, not when the exception is freed (Lock.release)
            raise
        try:
            await self._run_plan(plan, result)
        finally:
            if cancelled:
                # The caller's, held back until the nodes were told (and before
                # a LockLost, which the cancelled caller would not look at).
                raise asyncio.CancelledError

    def _release_elsewhere(self, plan: HoldPlan, step: ReleaseRound,
                           renewal: asyncio.Task[None] | None) -> None:
        """The rest of a ``release()`` that cannot await: run by a garbage
        collection (a task destroyed while pending inside ``async with lock``,
        its coroutine closed, ``Task was destroyed but it is pending!``) or
        outside any event loop (its loop closed before). The coroutine was
        closed: its first real await raised ``RuntimeError`` (no running loop;
        or "coroutine ignored GeneratorExit"), the round was never sent, and
        the key, no longer counted as held, stayed for its whole lease::

            t=0   task T: async with lock: await event.wait()
            t=1   the loop ends with T pending (or T, unreferenced, is collected)
            t=1   gc closes T's coroutine: __aexit__ -> release(): the state
                  changes, the round's first await fails; the key stays 30 s

        The round goes through the manager's sync transport (as the exit hook
        sends an asyncio lock's), at once, as a sync lock's release run by a
        collection is sent (put off to the end of the library's section when
        this thread is inside one); its signals go through the library's
        thread (transport/finalizers.py)."""
        if renewal is not None and not renewal.done():
            try:
                renewal.cancel()
            except RuntimeError:
                pass  # its loop is closed: it runs no more
        rest = functools.partial(self._release_synchronously, plan, step)
        if finalizers.inside():
            finalizers.put_off(rest)
        else:
            rest()

    def _release_synchronously(self, plan: HoldPlan, step: ReleaseRound) -> None:
        mgr = self.manager
        try:
            answer: Any = mgr._release_round(self._key_b, self._fence_key_b,
                                             self._waiters_key_b, step.token, step.fence,
                                             notify=self._notify, redo=step.lease)
        except BaseException:
            plan.close()
            raise
        try:
            while True:
                report = plan.send(answer)
                assert isinstance(report, Report)
                finalizers.call_later(events.send, report.signal, Lock, **report.kwargs)
                answer = None
        except StopIteration:
            pass
        except LockLost as lost:
            logger.warning("lock %r, released after its task's coroutine was closed: %s",
                           self.name, lost)

    async def _release_unawaited(self) -> None:
        """``release()`` without waiting for the nodes' replies (see
        ``Lock._release_unawaited``)."""
        plan = self._release_plan()
        step = next(plan)  # the state as release() changes it (LockNotOwned if not held)
        mgr = self.manager
        mgr._call_begins()  # the plan's own count ends at close(), before the round
        try:
            plan.close()
            assert type(step) is ReleaseRound
            self._cancel_renewal_timer()
            renewal, self._renewal = self._renewal, None
            if renewal is not None and not renewal.done():
                renewal.cancel()
            _, cancelled = await _complete(_release_round(
                mgr, self.transport, self._key_b, self._fence_key_b, self._waiters_key_b,
                step.token, step.fence, notify=self._notify, wait=False, redo=step.lease))
        finally:
            mgr._call_ends()
        if cancelled:  # sent all the same, as release() does
            raise asyncio.CancelledError

    async def _release_nodes(self, renewal: asyncio.Task[None] | None,
                             step: ReleaseRound) -> ReleaseResult:
        if renewal is not None and not renewal.done():
            renewal.cancel()
            await asyncio.wait([renewal])  # no renewal outlives release()
        return await _release_round(self.manager, self.transport, self._key_b,
                                    self._fence_key_b, self._waiters_key_b, step.token,
                                    step.fence, notify=self._notify, redo=step.lease)

    # -- extend / renew --------------------------------------------------------
    async def extend(self, ttl: float | EllipsisType = ...) -> None:
        """Reset the lease to ``ttl`` seconds (default: the lock's TTL) on a quorum.

        The holder counts on ``ttl`` from this call (``validity``); a node
        never shortens a lease, so after a longer one the key stays there
        until that longer end (or ``release()``): a request of this holder
        that a node runs late cannot cut the lease a later extend set
        (tests/test_extend_order.py has the timeline).

        Raises :class:`LockNotOwned` when not held; :class:`LockLost` when the
        lease already ran out or a majority no longer has our key;
        :class:`QuorumUnavailable` when too few nodes answered (the lock is still
        held until its current lease ends; the renewal task keeps trying).
        """
        new_ttl = self.ttl if ttl is ... else check_ttl(ttl)  # before anything is sent
        async with self._io:
            await self._run_plan(self._extend_call_plan(new_ttl))

    async def _report_lost(self, reason: str, held: float) -> None:
        await self._run_plan(self._report_lost_plan(reason, held))

    # -- context manager -------------------------------------------------------
    async def __aenter__(self) -> AsyncLock:
        # The async with's frame (awaiting this, before any await here), told
        # before the acquire: nothing but the record follows the grant (Lock).
        caller = sys._getframe(1)
        block = caller if entered_by_statement(caller) else self._hand_entry(
            caller, sys._getframe())
        if not await self._acquire(True, ..., block):
            raise self._busy_error()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            release, block = self._leaving(sys._getframe(1), sys._getframe())
            if release:
                await self._release(block)  # the hold this block entered
        except LockLost:
            if exc_type is None:
                raise
            # The body already failed (or was cancelled): its exception propagates,
            # the loss is logged.
            logger.warning("lock %r was lost while the body raised %s", self.name,
                           exc_type.__name__)

