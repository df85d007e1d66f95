"""Primitives made of plain locks: their plans, written once, and two drivers.

A multi-lock or a set of segments is a sequence of plain acquisitions and
releases. Its rules (in which order, how long each may wait, what to give back
when one fails or the call is interrupted) are a *plan*: a generator that
yields :class:`Take` and :class:`Drop` steps and gets their answers, with no
I/O of its own. :func:`run` drives a plan with ``Lock`` objects from a thread,
:func:`arun` with ``AsyncLock`` objects from a coroutine; neither knows the
rules, so the two flavours cannot drift apart (the sans-I/O style of h11).

An exception raised by a step (``QuorumUnavailable``, ``KeyboardInterrupt``,
``CancelledError``) is thrown into the plan, which gives back what it took
before the exception goes on. A :class:`Drop` is the exception: what
interrupts it is held back until the plan has run its other steps up to the
next that is not a ``Drop`` (:class:`_HeldBack`), so a give-back, once begun,
gives back every lock.

A plan that waits for any of its locks to be freed (segments) listens on a
channel their release scripts publish on (:class:`Listen`, :class:`Notice`);
the driver holds that subscription for the call and closes it at its end.
"""

from __future__ import annotations

import threading
from types import EllipsisType, TracebackType
from typing import Any, Generator, NamedTuple, Sequence, TypeVar, Union

from ..exceptions import LockLost, LockNotAcquired, LockNotOwned, RedlockError
from ..transport.finalizers import get_logger

logger = get_logger("django_redlock.engine")


class Take(NamedTuple):
    """Acquire lock ``at`` waiting up to ``timeout`` s (None: no limit, 0:
    once); answer True or False."""

    at: int
    timeout: float | None


class Drop(NamedTuple):
    """Release lock ``at``; answer None, or the ``LockLost`` it raised
    (the plan decides what a loss means for the whole)."""

    at: int


class Listen(NamedTuple):
    """Subscribe to ``channel``, confirmed by the nodes within ``confirm`` s
    (then a release published there is heard); answer None. Once per plan."""

    channel: bytes
    confirm: float


class Notice(NamedTuple):
    """Wait up to ``seconds`` for a notice on the channel listened to; answer
    what the last one carried (the freed lock's key), ``b""`` for a wake-up
    that named nothing (a dropped link: a notice may be lost), or None when
    nothing came. Notices are taken, not kept: the next ``Notice`` waits for
    a new one."""

    seconds: float


Step = Union[Take, Drop, Listen, Notice]
Plan = Generator[Step, Any, Any]


class _HeldBack:
    """The exception that interrupted a :class:`Drop`, held back by a driver
    until the plan's give-back is over.

    Thrown into the plan at once, it cut the give-back short: the locks after
    the interrupted one were never released, while the composite already
    counted itself released (a second ``release()`` raised ``LockNotOwned``)
    and, with ``auto_renew``, went on renewing them::

        t0  amulti_lock.release(): Drop(c), its round in flight
        t1  the task is cancelled (asyncio.timeout): c's round completes
            (AsyncLock.release), CancelledError is thrown into release_all
        t2  Drop(b) and Drop(a) never run; b and a stay held for ever

    So the plan is answered None for that ``Drop`` (the lock's own release
    saw to its lock) and runs on; the exception is thrown into it at its next
    step that is not a ``Drop`` (it then gives back what it took, e.g. when
    an acquire starts its set again), or raised when it ends. Of two (a
    second cancellation during the give-back of an interrupted acquire), the
    first goes on; an interrupt goes on rather than an error of the plan
    (the ``LockLost`` of a cancelled release, its context)."""

    __slots__ = ("exc",)

    def __init__(self) -> None:
        self.exc: BaseException | None = None

    def keep(self, exc: BaseException) -> None:
        if self.exc is None:
            self.exc = exc

    def pop(self) -> BaseException:
        exc, self.exc = self.exc, None
        assert exc is not None
        return exc

    def instead_of(self, raised: BaseException) -> None:
        """Raise the one held back rather than ``raised``, an error of the
        plan (an interrupt the plan raised came first: it goes on). Called
        while ``raised`` is handled, which becomes its context."""
        if self.exc is not None and isinstance(raised, Exception):
            raise self.pop()

    def end(self) -> None:
        """The plan ended: raise the one held back, if any."""
        if self.exc is not None:
            raise self.pop()


def run(locks: Sequence[Any], plan: Plan) -> Any:
    """Drive ``plan`` with sync ``locks``; return what the plan returns."""
    sub = None
    held = _HeldBack()
    try:
        step = next(plan)
        while True:
            if held.exc is not None and type(step) is not Drop:
                step = plan.throw(held.pop())
                continue
            try:
                if type(step) is Take:
                    answer: Any = locks[step.at].acquire(timeout=step.timeout)
                elif type(step) is Drop:
                    answer = _drop(locks[step.at])
                elif type(step) is Listen:
                    sub = locks[0].manager.notifier.subscribe(step.channel, step.confirm)
                    answer = None
                else:
                    assert type(step) is Notice and sub is not None  # listened first
                    answer = None
                    if sub.wait(step.seconds):
                        answer = sub.payload or b""
                    sub.payload = None
                    sub.clear()
            except BaseException as exc:  # noqa: BLE001 - the plan gives back what it took, re-raises
                if type(step) is not Drop:
                    step = plan.throw(exc)
                    continue
                held.keep(exc)  # the give-back goes on (_HeldBack)
                answer = None
            step = plan.send(answer)
    except StopIteration as done:
        result = done.value
    except BaseException as exc:
        held.instead_of(exc)
        raise
    finally:
        if sub is not None:
            sub.close()
    held.end()
    return result


async def arun(locks: Sequence[Any], plan: Plan) -> Any:
    """Drive ``plan`` with ``AsyncLock`` objects (see :func:`run`)."""
    from .aio import _subscribe

    waiter = None
    held = _HeldBack()
    try:
        step = next(plan)
        while True:
            if held.exc is not None and type(step) is not Drop:
                step = plan.throw(held.pop())
                continue
            try:
                if type(step) is Take:
                    answer: Any = await locks[step.at].acquire(timeout=step.timeout)
                elif type(step) is Drop:
                    answer = await _adrop(locks[step.at])
                elif type(step) is Listen:
                    waiter = await _subscribe(locks[0].manager, step.channel, step.confirm,
                                              b"", b"")
                    answer = None
                else:
                    assert type(step) is Notice and waiter is not None  # listened first
                    answer = None
                    if await waiter.wait(step.seconds):
                        answer = waiter.sub.payload or b""
                    waiter.sub.payload = None
                    waiter.clear()
            except BaseException as exc:  # noqa: BLE001 - see run()
                if type(step) is not Drop:
                    step = plan.throw(exc)
                    continue
                held.keep(exc)  # a cancellation: the give-back goes on (_HeldBack)
                answer = None
            step = plan.send(answer)
    except StopIteration as done:
        result = done.value
    except BaseException as exc:
        held.instead_of(exc)
        raise
    finally:
        if waiter is not None:
            waiter.close()
    held.end()
    return result


def _drop(lock: Any) -> LockLost | None:
    try:
        lock.release()
    except LockLost as lost:
        return lost
    except LockNotOwned:
        pass
    except RedlockError:  # unreachable nodes: the key expires with its lease
        logger.warning("lock %r could not be released; it expires with its lease", lock.name,
                       exc_info=True)
    return None


async def _adrop(lock: Any) -> LockLost | None:
    try:
        await lock.release()
    except LockLost as lost:
        return lost
    except LockNotOwned:
        pass
    except RedlockError:
        logger.warning("lock %r could not be released; it expires with its lease", lock.name,
                       exc_info=True)
    return None


def give_back(taken: Sequence[int]) -> Generator[Drop, Any, None]:
    """Release the locks ``taken`` (newest first), whatever happens to each."""
    for index in reversed(taken):
        yield Drop(index)


def release_all(count: int, what: str, name: str) -> Plan:
    """Release locks ``0 .. count-1`` (newest first); then raise ``LockLost``
    naming every lock that was lost, if any was (each was still released)."""
    lost = []
    for index in reversed(range(count)):
        result = yield Drop(index)
        if result is not None:
            lost.append(result)
    if lost:
        raise LockLost(f"{what} {name}: " + "; ".join(str(e) for e in lost),
                       lock_name=lost[0].lock_name, lost=lost)


def _lost_in_failed_body(lost: LockLost, exc_type: type[BaseException]) -> None:
    """Log a loss found by the release at the end of a ``with`` block that
    raised; the block's exception goes on, as with a plain lock's
    ``__exit__`` (docs/api.rst: ``LockLost`` is raised on exit unless the
    block itself raised).

    Raised there, ``LockLost`` replaced the caller's own error (a ``ValueError``,
    ``KeyboardInterrupt``, ``Http404``) and, under asyncio, a cancellation: the
    task ended with ``LockLost``, and ``asyncio.timeout()`` never turned its
    ``CancelledError`` into ``TimeoutError``."""
    logger.warning("%s (while the body raised %s)", lost, exc_type.__name__)


# -- the two drivers, as base classes of a composite primitive -----------------------
SC = TypeVar("SC", bound="Composed")
AC = TypeVar("AC", bound="AsyncComposed")


#: Guards every composite's entry records (a few list operations, nothing
#: else taken under it; reentrant: a collection inside may run an exit).
_entries_guard = threading.RLock()
#: Past this many open entries of one object, the oldest whose hold ended
#: goes, counted (see Composite._take_entry).
ENTRIES_KEPT = 1024


class Composite:
    """A primitive made of plain locks: its rules, which each subclass states.

    :class:`Composed` and :class:`AsyncComposed` turn them into the public
    methods (``acquire``, ``release``, ``extend``, the context manager), so a
    new composite writes its rules once and gets both flavours.

    An entry (a ``with`` block, ``__enter__()`` by hand) ends only the hold it
    entered. Its exit released whatever the object held, and a hold released
    by hand before the exit was another holder's by then (review 8)::

        thread A   sem.__enter__(); sem.release()   (or: with sem: sem.release() ...)
        thread B   with sem: a permit, anew
        thread A   sem.__exit__(): released B's permit
        rival      acquires: two holders, B still inside

    So every grant has a number (``_grant_no``), taken with the held state
    in one section of the guard (``_grant``, called by the acquire plans),
    and every release that begins marks the current one ended
    (``_ended_no``, with the state, in the release plans: ``_release_begins``).
    An entry records its grant's number, from the acquire plan's own return;
    its exit ends that grant or nothing. Review 9 showed why both ends must
    be one section each: read after the acquire returned, or checked before
    the release began, another thread's release and a third thread's grant
    fitted between, and the exit ended the third thread's hold::

        thread A   with obj: granted ... (C's release, D's with: granted) ... recorded D's
        thread A   leaves: released D's hold while D was inside

    An exit cannot tell which entry it is for: it takes an entry whose hold
    ended before one on the current hold (taking the current one for an
    ended one ended a holder's hold under it; the other way round only
    leaves the current hold to the next exit). A composite is never entered
    again while it holds, so at most one open entry is on the current hold.
    A hold taken by ``acquire()`` inside an entry whose hold was released is
    its taker's to release."""

    _locks: list[Any]
    #: The number of the latest grant (taken with the held state: _grant).
    _grant_no = 0
    #: The latest grant whose release began (with the state: _release_begins).
    _ended_no = 0
    #: The open entries' grant numbers, oldest first (None: none yet).
    _entries: "list[int] | None" = None
    #: Entries whose hold ended, dropped past ENTRIES_KEPT: their exits take these.
    _entries_dropped = 0

    def _grant(self, attr: str, value: Any) -> int:
        """Hold: set ``attr`` (the acquire plan's held state) to ``value``,
        and number the grant, in one section; the plan returns the number
        (truthy: ``acquire()`` returns it as True)."""
        with _entries_guard:
            setattr(self, attr, value)
            self._grant_no += 1
            return self._grant_no

    def _release_begins(self, grant: int | None) -> bool:
        """Called by a release plan under the guard, with its check of the
        held state and its change of it: whether this release may end the
        current hold (``grant`` None: ``release()``; else the exit's entry's
        grant, which must be the current one, not ended yet)."""
        if grant is not None and (grant != self._grant_no or grant <= self._ended_no):
            return False
        self._ended_no = self._grant_no
        return True

    def _live(self, grant: int) -> bool:
        return grant == self._grant_no and grant > self._ended_no

    def _push_entry(self, grant: int) -> None:
        """An entry was made on grant number ``grant``."""
        with _entries_guard:
            entries = self._entries
            if entries is None:
                entries = self._entries = []
            entries.append(grant)
            if len(entries) > ENTRIES_KEPT:
                ended = [at for at, made in enumerate(entries) if not self._live(made)]
                if ended:
                    del entries[ended[0]]
                    self._entries_dropped += 1

    def _take_entry(self) -> "int | None | bool":
        """For an exit: the grant it ends (False: its entry's hold ended
        already, nothing to end; None: no entry recorded, an exit with no
        entry: the current hold, as before). Takes an entry whose hold ended
        first, the oldest; then the current hold's."""
        with _entries_guard:
            entries = self._entries
            for at, made in enumerate(entries or ()):
                if not self._live(made):
                    del entries[at]  # type: ignore[union-attr]
                    return False
            if self._entries_dropped:
                self._entries_dropped -= 1
                return False
            if entries:
                return entries.pop()
            return None

    @property
    def metrics_label(self) -> str | None:
        """The ``lock`` label of its metrics (``django_redlock.metrics``); set
        on it, it is set on every plain lock it is made of, which are the
        ones that send the signals the metrics count (``@with_semaphore``'s
        template, not each caller's name: a label per name filled the bounded
        label set with client-chosen values)."""
        return getattr(self, "_metrics_label", None)

    @metrics_label.setter
    def metrics_label(self, label: str | None) -> None:
        self._metrics_label = label
        for lock in self._locks:
            lock.metrics_label = label

    def _wait(self, blocking: bool, timeout: float | None | EllipsisType) -> float | None:
        """The checked wait of one ``acquire()`` (raises on bad arguments)."""
        raise NotImplementedError

    def _acquire_plan(self, wait: float | None) -> Plan:
        raise NotImplementedError

    def _release_plan(self, grant: int | None = None) -> Plan:
        """Its first step checks the held state, ``_release_begins(grant)``
        and changes the state, in one section of ``_entries_guard``."""
        raise NotImplementedError

    def _holding(self) -> bool:
        """Whether this object holds what ``release()`` would give back."""
        raise NotImplementedError

    def _extend_targets(self) -> list[Any]:
        """The locks ``extend()`` extends (raises ``LockNotOwned`` when none)."""
        raise NotImplementedError

    def _busy(self) -> LockNotAcquired:
        raise NotImplementedError


class Composed(Composite):
    """The sync flavour: runs the rules with ``Lock`` objects (:func:`run`)."""

    def acquire(self, blocking: bool = True, timeout: float | None | EllipsisType = ...) -> bool:
        """True when held within ``timeout``; False (nothing held) when the wait ran out."""
        return bool(self._acquire_grant(blocking, timeout))

    def release(self) -> None:
        """Release what is held; ``LockLost`` afterwards if a lock was lost."""
        self._release_grant(None)

    def _acquire_grant(self, blocking: bool = True,
                       timeout: float | None | EllipsisType = ...) -> Any:
        """The grant's number (see Composite), or False."""
        return run(self._locks, self._acquire_plan(self._wait(blocking, timeout)))

    def _release_grant(self, grant: int | None) -> None:
        """Release grant ``grant`` (None: what is held); ``LockNotOwned``
        when it is not the current one."""
        run(self._locks, self._release_plan(grant))

    def extend(self, ttl: float | EllipsisType = ...) -> None:
        """Extend what is held (see :meth:`Lock.extend`)."""
        for lock in self._extend_targets():
            lock.extend(ttl)

    def __enter__(self: SC) -> SC:
        grant = self._acquire_grant()
        if not grant:
            raise self._busy()
        self._push_entry(grant)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        grant = self._take_entry()
        if grant is False:
            return  # its hold ended already (released by hand): nothing to end
        try:
            self._release_grant(grant)
        except LockNotOwned:
            pass  # not held, or its hold ended meanwhile: nothing to end
        except LockLost as lost:
            if exc_type is None:
                raise
            _lost_in_failed_body(lost, exc_type)


class AsyncComposed(Composite):
    """The asyncio flavour: runs the rules with ``AsyncLock`` objects (:func:`arun`)."""

    async def acquire(self, blocking: bool = True,
                      timeout: float | None | EllipsisType = ...) -> bool:
        return bool(await self._acquire_grant(blocking, timeout))

    async def release(self) -> None:
        await self._release_grant(None)

    async def _acquire_grant(self, blocking: bool = True,
                             timeout: float | None | EllipsisType = ...) -> Any:
        return await arun(self._locks, self._acquire_plan(self._wait(blocking, timeout)))

    async def _release_grant(self, grant: int | None) -> None:
        await arun(self._locks, self._release_plan(grant))

    async def extend(self, ttl: float | EllipsisType = ...) -> None:
        for lock in self._extend_targets():
            await lock.extend(ttl)

    async def __aenter__(self: AC) -> AC:
        grant = await self._acquire_grant()
        if not grant:
            raise self._busy()
        self._push_entry(grant)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        grant = self._take_entry()
        if grant is False:
            return
        try:
            await self._release_grant(grant)
        except LockNotOwned:
            pass
        except LockLost as lost:
            if exc_type is None:
                raise
            _lost_in_failed_body(lost, exc_type)
