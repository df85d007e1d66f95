"""``semaphore(name, permits)``: at most ``permits`` holders of ``name`` at once.

Each permit is its own plain Redlock mutex, the lock ``"<name>#<i>"`` (i from
0 to permits - 1): a holder holds exactly one of them, with everything a plain
lock has (a quorum of nodes, renewal that reports loss, a fence per
acquisition, a lease after which a crashed holder's permit comes back).

Why not one counting set per node (a sorted set of holders, admitted while it
has fewer than ``permits`` members) granted by a majority of nodes, as a
Redlock of a counter would be: with ``permits >= 2`` it admits too many.
Three nodes, ``permits=2``::

    t0  A is admitted by nodes 1 and 2        (node 1: {A}, node 2: {A})
    t1  B is admitted by nodes 2 and 3        (node 2: {A, B}, node 3: {B})
    t2  C is admitted by nodes 1 and 3        (node 1: {A, C}, node 3: {B, C})

No node ever holds more than 2, each client has a majority (2 of 3), and
three clients hold a 2-permit semaphore. Majorities of two different grants
must share a node only when each node admits one holder, which is what a
mutex per permit gives: two holders of permit ``i`` would need two majorities
of ``"<name>#i"``, which overlap on a node that holds one key.

How it waits (no polling): every acquirer first takes the *line*, the plain
lock ``"<name>#line"``. Its waiters queue on the nodes and a release wakes
them one at a time, in the order they queued (the plain lock's release
notices). The line's holder, the head, tries each permit once (timeout 0);
when all are busy it subscribes to the semaphore's *free* channel, tries them
all again (a release between that try and the wait is not missed: the
subscription came first) and sleeps until a holder's ``release()`` publishes
on that channel, or until the soonest lease of a busy permit runs out (a
crashed holder never publishes), or its timeout. With a permit, it gives the
line to the next in it. So arrival order is kept among acquirers, as far as
the line lock's waiter queue keeps it, and a release costs one wake-up, not
one per waiter. Newcomers cannot jump ahead: they queue on the line too. The
one exception is a try (``timeout=0`` or ``blocking=False``): it does not
queue, and takes a permit that is free at that moment, if any.

Permits must agree: ``permits`` is recorded per name on the nodes (the key
``keys.permits_key``, written with SET NX by a script that answers the count
recorded) and checked by a quorum before the line is taken; a different
count raises :class:`PermitsMismatch`. Every acquire renews the record's lease
(:data:`COUNT_LEASE`); once it runs out, after the last acquire of the name, a
new count may be used.
"""

from __future__ import annotations

import random
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Generator, NamedTuple, Sequence, Union

from ..core.arguments import check_count_of, check_timeout
from ..core.keys import lock_key, permits_key, validate_name
from ..exceptions import (
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    QuorumUnavailable,
    RedlockError,
)
from ..transport.resp import Call, Command, Script
from . import compose
from .compose import Drop, Take

if TYPE_CHECKING:
    from .protocol import LockHost

#: How long a permit count stays recorded after the last acquire of its name (s).
COUNT_LEASE = 3600.0
#: Rounds asked again, while time is left, after one that reached no quorum:
#: of the count check, and of the head's tries of the permits (in a row).
COUNT_RETRIES = 2
#: The shortest wait of a head between two tries when no notice comes (s).
MIN_PAUSE = 0.005

PERMITS = Script("semaphore_permits")


class PermitsMismatch(RedlockError):
    """Two users of one semaphore name disagree on its number of permits."""

    def __init__(self, message: str, *, lock_name: str | None = None, permits: int = 0,
                 recorded: int = 0) -> None:
        super().__init__(message, lock_name=lock_name)
        self.permits = permits
        self.recorded = recorded


def check_permits(permits: Any) -> int:
    return check_count_of(permits, "semaphore(name, permits)", "permits")


def permit_name(name: str, index: int) -> str:
    """The plain lock name of permit ``index`` of semaphore ``name``."""
    return f"{name}#{index}"


def line_name(name: str) -> str:
    """The plain lock name of the line every acquirer of ``name`` queues on."""
    return f"{name}#line"


class CheckCount(NamedTuple):
    """Record or compare the permit count on a quorum; answer None, or throw
    the ``RedlockError`` that says why not."""


class Listen(NamedTuple):
    """Subscribe to the free channel (confirmed within ``confirm`` s); answer anything."""

    confirm: float


class Notice(NamedTuple):
    """Wait up to ``seconds`` for a free notice; answer True when one came."""

    seconds: float


class Ring(NamedTuple):
    """Publish a free notice (best effort); answer anything."""


Step = Union[Take, Drop, CheckCount, Listen, Notice, Ring]
#: A semaphore's plan: the composites' steps and its own four.
Plan = Generator[Step, Any, Any]


class SemaphoreBase(compose.Composite):
    """The rules; :class:`Semaphore` and :class:`AsyncSemaphore` run them.

    ``locks``: the permits' locks, then the line's."""

    def __init__(self, manager: "LockHost", name: str, locks: Sequence[Any],
                 timeout: float | None, rng: random.Random | None = None) -> None:
        self.manager = manager
        self.name = validate_name(name)
        self.permits = len(locks) - 1
        self.timeout = timeout
        self._locks = list(locks)
        self._rng = rng or random.Random()
        key = lock_key(manager.key_prefix, name)
        self._count_key = permits_key(key).encode()
        self._free_channel = lock_key(manager.key_prefix, f"{name}#free").encode()
        self.ttl = float(self._locks[0].ttl)
        #: The permit held (0 to permits - 1), or None.
        self.index: int | None = None
        self.retry_after = 0.0
        self._deadline: float | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} x{self.permits} index={self.index}>"

    @property
    def lock(self) -> Any:
        """The plain lock of the permit held (None when none is)."""
        return None if self.index is None else self._locks[self.index]

    @property
    def fence(self) -> int:
        return 0 if self.index is None else int(self._locks[self.index].fence)

    @property
    def validity(self) -> float:
        return 0.0 if self.index is None else float(self._locks[self.index].validity)

    def owned(self) -> bool:
        return self.index is not None and bool(self._locks[self.index].owned())

    def _wait(self, blocking: bool, timeout: float | None | EllipsisType) -> float | None:
        wait = self.timeout if timeout is ... else check_timeout(timeout)
        if not isinstance(blocking, bool):
            raise ValueError(f"blocking must be True or False, not {blocking!r}")
        if self.index is not None:
            raise LockNotOwned(f"semaphore {self.name!r}: this object already holds permit "
                               f"{self.index}", lock_name=self.name)
        return 0.0 if not blocking else wait

    def _count_requests(self) -> list[Call]:
        lease_ms = int(max(COUNT_LEASE, 3 * self.ttl) * 1000)
        call = Call(PERMITS, (self._count_key,), (str(self.permits).encode(), lease_ms))
        return [call] * len(self.manager.nodes)

    def _count_verdict(self, replies: Sequence[Any]) -> None:
        """Raise unless a quorum answered, all with our count."""
        mgr = self.manager
        answers = [r for r in replies if isinstance(r, (bytes, str))]
        if len(answers) < mgr.quorum:
            errors = {getattr(node, "name", str(i)): str(r)
                      for i, (node, r) in enumerate(zip(mgr.nodes, replies))
                      if not isinstance(r, (bytes, str))}
            raise QuorumUnavailable(
                f"semaphore {self.name!r}: the permit count was checked by {len(answers)} of "
                f"{len(mgr.nodes)} nodes, {mgr.quorum} needed", lock_name=self.name,
                answered=len(answers), needed=mgr.quorum, errors=errors)
        ours = str(self.permits)
        for answer in answers:
            recorded = answer.decode() if isinstance(answer, bytes) else answer
            if recorded != ours:
                raise PermitsMismatch(
                    f"semaphore {self.name!r}: permits={self.permits} was asked, but its "
                    f"holders use permits={recorded}; every user of one name must give the "
                    f"same count (the recorded one expires {COUNT_LEASE:g} s after the last "
                    f"acquire)", lock_name=self.name, permits=self.permits,
                    recorded=int(recorded) if recorded.isdigit() else 0)

    def _ring_requests(self) -> list[Command]:
        return [Command(b"PUBLISH", self._free_channel, b"1")] * len(self.manager.nodes)

    def _acquire_plan(self, wait: float | None) -> Plan:  # type: ignore[override]
        clock = self.manager.clock
        deadline = None if wait is None else clock() + wait
        self._deadline = deadline
        line = self.permits
        for asked in range(COUNT_RETRIES + 1):
            try:
                yield CheckCount()
                break
            except QuorumUnavailable:
                # A cold manager under a burst can miss a round with every node
                # up (its connections are still being set up); the next one
                # finds them ready. A majority that is down fails each round.
                if asked == COUNT_RETRIES or (deadline is not None and clock() >= deadline):
                    raise
        if wait == 0:
            # A try (timeout 0, blocking=False) does not queue: it takes a free
            # permit if there is one now. Through the line it would answer busy
            # whenever another acquirer held the line for its own try.
            order = list(range(self.permits))
            self._rng.shuffle(order)
            for index in order:
                if (yield Take(index, 0)):
                    self.index = index
                    return True
            self.retry_after = min(lock.retry_after for lock in self._locks[:line])
            return False
        if not (yield Take(line, None if deadline is None else max(0.0, deadline - clock()))):
            self.retry_after = self._locks[line].retry_after
            return False
        try:
            listening = False
            missed = 0
            while True:
                start = self._rng.randrange(self.permits)
                for k in range(self.permits):
                    index = (start + k) % self.permits
                    try:
                        got = yield Take(index, 0)
                    except QuorumUnavailable:
                        # A try has no time of its own to ask again; the head
                        # has the caller's. Missed rounds in a row end it.
                        missed += 1
                        if missed > COUNT_RETRIES or (deadline is not None
                                                      and clock() >= deadline):
                            raise
                        continue
                    missed = 0
                    if got:
                        self.index = index
                        yield Drop(line)  # the next in line becomes the head
                        return True
                left = None if deadline is None else deadline - clock()
                if left is not None and left <= 0:
                    self.retry_after = min(lock.retry_after for lock in self._locks[:line])
                    yield Drop(line)
                    return False
                if not listening:
                    listening = True
                    yield Listen(self.manager.node_timeout if left is None
                                 else min(self.manager.node_timeout, left))
                    continue
                # No notice comes from a holder that crashed: wake when the
                # soonest lease of a busy permit runs out.
                pause = max(MIN_PAUSE, min(lock.retry_after for lock in self._locks[:line]))
                pause *= self._rng.uniform(1.0, 1.1)
                yield Notice(pause if left is None else min(pause, left))
        except BaseException:
            if self.index is not None:
                yield from compose.give_back([self.index])
                self.index = None
            yield Drop(line)
            raise

    def _release_plan(self) -> Plan:  # type: ignore[override]
        if self.index is None:
            raise LockNotOwned(f"semaphore {self.name!r}: no permit held by this object",
                               lock_name=self.name)
        index, self.index = self.index, None
        lost = yield Drop(index)
        yield Ring()
        if lost is not None:
            raise lost

    def _holding(self) -> bool:
        return self.index is not None

    def _extend_targets(self) -> list[Any]:
        if self.index is None:
            raise LockNotOwned(f"semaphore {self.name!r}: no permit held", lock_name=self.name)
        return [self._locks[self.index]]

    def _lost(self, lock: Any) -> LockLost:
        """The error of ``extend()`` on a permit this object still counts as
        held but whose lock was lost (it calls itself not held)."""
        return LockLost(f"semaphore {self.name!r}: permit {self.index} was lost "
                        f"({lock._lost_reason or 'its lease ran out'})", lock_name=self.name,
                        fence=lock.fence)

    def _busy(self) -> LockNotAcquired:
        return LockNotAcquired(
            f"semaphore {self.name!r}: all {self.permits} permits busy for "
            f"{'ever' if self.timeout is None else format(self.timeout, 'g') + ' s'}",
            lock_name=self.name, retry_after=self.retry_after)


class Semaphore(SemaphoreBase, compose.Composed):
    """At most ``permits`` holders of ``name``; from :meth:`LockManager.semaphore`."""

    def acquire(self, blocking: bool = True, timeout: float | None | EllipsisType = ...) -> bool:
        """True when a permit is held within ``timeout``; False when the wait ran out."""
        return bool(self._run(self._acquire_plan(self._wait(blocking, timeout))))

    def release(self) -> None:
        """Release the permit held; ``LockLost`` afterwards if it was lost."""
        self._run(self._release_plan())

    def extend(self, ttl: float | EllipsisType = ...) -> None:
        """Extend the permit held (see :meth:`Lock.extend`); ``LockLost`` when
        it was lost (the renewal found it gone, or its lease ran out)."""
        lock = self._extend_targets()[0]
        try:
            lock.extend(ttl)
        except LockNotOwned:
            raise self._lost(lock) from None

    def _run(self, plan: Plan) -> Any:
        mgr = self.manager
        locks = self._locks
        sub = None
        try:
            step = next(plan)
            while True:
                try:
                    answer: Any = None
                    if isinstance(step, Take):
                        answer = locks[step.at].acquire(timeout=step.timeout)
                    elif isinstance(step, Drop):
                        answer = compose._drop(locks[step.at])
                    elif isinstance(step, CheckCount):
                        until = self._deadline
                        self._count_verdict(mgr.transport.round(
                            self._count_requests(), skip_backoff=False,
                            until=None if until is None else max(until, mgr.clock())))
                    elif isinstance(step, Listen):
                        sub = mgr.notifier.subscribe(self._free_channel, step.confirm)
                    elif isinstance(step, Notice):
                        assert sub is not None
                        answer = sub.wait(step.seconds)
                        sub.clear()
                    else:
                        self._ring()
                except BaseException as exc:  # noqa: BLE001 - the plan gives back, re-raises
                    step = plan.throw(exc)
                    continue
                step = plan.send(answer)
        except StopIteration as done:
            return done.value
        finally:
            if sub is not None:
                sub.close()

    def _ring(self) -> None:
        from .rounds import NO_WAIT

        try:
            self.manager.transport.round(self._ring_requests(), settle=NO_WAIT)
        except Exception:  # noqa: BLE001 - a lost notice costs the head its timer, no more
            compose.logger.debug("semaphore %r: free notice not sent", self.name,
                                 exc_info=True)


class AsyncSemaphore(SemaphoreBase, compose.AsyncComposed):
    """The asyncio twin of :class:`Semaphore`; from :meth:`LockManager.asemaphore`."""

    async def acquire(self, blocking: bool = True,
                      timeout: float | None | EllipsisType = ...) -> bool:
        return bool(await self._arun(self._acquire_plan(self._wait(blocking, timeout))))

    async def release(self) -> None:
        await self._arun(self._release_plan())

    async def extend(self, ttl: float | EllipsisType = ...) -> None:
        lock = self._extend_targets()[0]
        try:
            await lock.extend(ttl)
        except LockNotOwned:
            raise self._lost(lock) from None

    async def _arun(self, plan: Plan) -> Any:
        from .aio import _subscribe

        mgr = self.manager
        transport = mgr._async_transport  # type: ignore[attr-defined]  # made by alock()
        locks = self._locks
        waiter = None
        try:
            step = next(plan)
            while True:
                try:
                    answer: Any = None
                    if isinstance(step, Take):
                        answer = await locks[step.at].acquire(timeout=step.timeout)
                    elif isinstance(step, Drop):
                        answer = await compose._adrop(locks[step.at])
                    elif isinstance(step, CheckCount):
                        until = self._deadline
                        self._count_verdict(await transport.round(
                            self._count_requests(), skip_backoff=False,
                            until=None if until is None else max(until, mgr.clock())))
                    elif isinstance(step, Listen):
                        waiter = await _subscribe(mgr, self._free_channel, step.confirm,
                                                  b"", b"")
                    elif isinstance(step, Notice):
                        assert waiter is not None
                        answer = await waiter.wait(step.seconds)
                        waiter.clear()
                    else:
                        try:
                            await transport.round(self._ring_requests())
                        except Exception:  # noqa: BLE001 - see Semaphore._ring
                            compose.logger.debug("semaphore %r: free notice not sent",
                                                 self.name, exc_info=True)
                except BaseException as exc:  # noqa: BLE001 - see Semaphore._run
                    step = plan.throw(exc)
                    continue
                step = plan.send(answer)
        except StopIteration as done:
            return done.value
        finally:
            if waiter is not None:
                waiter.close()
