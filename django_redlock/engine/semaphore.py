"""``semaphore(name, permits)``: at most ``permits`` holders of ``name`` at once.

(Why one module of 650 lines: the permits, the waiting line and the count
check are one acquire plan, driven by a sync and an asyncio driver, whose
steps only make sense together; split, each part would need the others'
state to be read.)

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

The first try is one round trip: a permit chosen at random is asked for
with the count check and a look at the line in the same script on each node
(acquire.lua with the semaphore's guard, ``rounds.Guard``). When nobody is in
line and that permit is free, that is the whole acquire; and a release
publishes the free notice from its own script (release.lua, ``ARGV[6]``). So
an uncontended acquire + release costs what a plain lock's does.

How it waits (no polling): an acquirer that did not get its permit at once
takes the *line*, the plain lock ``"<name>#line"``. Its waiters queue on the nodes and a release wakes
them one at a time, in the order they queued (the plain lock's release
notices). The line's holder, the head, tries each permit once (timeout 0);
when all are busy it subscribes to the semaphore's *free* channel, tries them
all again (a release between that try and the wait is not missed: the
subscription came first) and sleeps until a holder's ``release()`` publishes
on that channel, or until the soonest lease of a busy permit runs out (a
crashed holder never publishes), or its timeout. With a permit, it gives the
line to the next in it, without waiting for that release's reply
(:class:`HandOn`). So arrival order is kept among acquirers, as far as
the line lock's waiter queue keeps it, and a release costs one wake-up, not
one per waiter. Newcomers cannot jump ahead: their first try steps aside when
any node sees the line held or anyone queued on it (then any permit it was
granted is given back), and they queue on the line too. The one exception is a
try (``timeout=0`` or ``blocking=False``): it does not queue, and takes a
permit that is free at that moment, if any.

Permits must agree: ``permits`` is recorded per name on the nodes (the key
``keys.permits_key``, written by a try's script when absent) and checked by
*every* try of a permit (the first try, the head's, a ``timeout=0`` try's),
on every node, in the script that grants it: a node with a different count
grants nothing and says so. A permit is held only when a quorum granted it,
so a quorum of nodes that record this count: two counts never both have one
(two majorities share a node, which holds one record). Checking the first
try only was not enough; the head's tries then asked no node, and one node
paused at a time made four holders of ``semaphore(name, 3)``::

    t0  node 3 paused; A1..A3 (permits=3) hold #0..#2 on nodes 1, 2; node 3 never sees 3
    t1  node 3 resumed, node 1 paused; B (permits=5) tries: node 2 says "3",
        node 3 records 5; one node against, so B went on and queued on the line
    t2  B, head of the line, takes #3 on nodes 2 and 3 unchecked: a fourth holder

The caller gets :class:`PermitsMismatch` (any permit other nodes granted is
given back) when a try finds nodes that record another count and fewer than
a quorum that agree with its own: the nodes that answered without a count
refusal are counted, and a node that did not answer agrees to nothing (B
above, at t1). A minority with another count (a node restarted empty that a
caller with a wrong count reached first) is outvoted while a quorum of the
others agrees. Every acquire renews the record's lease (:data:`COUNT_LEASE`);
once it runs out, after the last acquire of the name, a new count may be used.

On a Redis Cluster node (``one_slot_per_call``) a script's keys must share a
hash slot, and a try's script touches a permit's keys, the count key and the
line's: the name must have a hash tag (``"{pool}"``, ``"{pool}:exports"``),
or the semaphore is refused when it is made (``ValueError``), before anything
is sent. Unrefused, the Cluster answered ``CROSSSLOT`` to every try: alone it
made every acquire ``QuorumUnavailable``; beside plain nodes it never voted.
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
from ..transport.resp import SEMAPHORE_PEEK, Call
from . import compose
from .compose import Drop, Take
from .rounds import GUARD_COUNT, GUARD_UNHEARD, Guard

if TYPE_CHECKING:
    from .protocol import LockHost

#: How long a permit count stays recorded after the last acquire of its name (s).
COUNT_LEASE = 3600.0
#: Rounds asked again, while time is left, after one that reached no quorum:
#: of the first try, and of the head's tries of the permits (in a row).
COUNT_RETRIES = 2
#: The shortest wait of a head between two tries when no notice comes (s).
MIN_PAUSE = 0.005


class PermitsMismatch(RedlockError):
    """Two users of one semaphore name disagree on its number of permits."""

    def __init__(self, message: str, *, lock_name: str | None = None, permits: int = 0,
                 recorded: int = 0) -> None:
        super().__init__(message, lock_name=lock_name)
        self.permits = permits
        self.recorded = recorded


def _hand_on(lock: Any) -> None:
    """Run a :class:`HandOn` (sync)."""
    try:
        lock._release_unawaited()
    except LockNotOwned:
        pass
    except RedlockError:  # unreachable nodes: the line expires with its lease
        compose.logger.warning("lock %r could not be released; it expires with its lease",
                               lock.name, exc_info=True)


async def _ahand_on(lock: Any) -> None:
    """Run a :class:`HandOn` (asyncio)."""
    try:
        await lock._release_unawaited()
    except LockNotOwned:
        pass
    except RedlockError:
        compose.logger.warning("lock %r could not be released; it expires with its lease",
                               lock.name, exc_info=True)


def check_permits(permits: Any) -> int:
    return check_count_of(permits, "semaphore(name, permits)", "permits")


def permit_name(name: str, index: int) -> str:
    """The plain lock name of permit ``index`` of semaphore ``name``."""
    return f"{name}#{index}"


def line_name(name: str) -> str:
    """The plain lock name of the line every acquirer of ``name`` queues on."""
    return f"{name}#line"


class TryPermit(NamedTuple):
    """Try permit ``at`` once with the guard (the count check; with ``aside``,
    stepping aside while anyone is in line); answer ``(granted, refusal)``,
    ``refusal`` the guards' answers (``LockBase._guard_refusal``), or throw
    the ``RedlockError`` of the round. Every try of a permit is one of these:
    no permit is granted by a node that records another count."""

    at: int
    aside: bool


class Listen(NamedTuple):
    """Subscribe to the free channel (confirmed within ``confirm`` s); answer anything."""

    confirm: float


class Peek(NamedTuple):
    """Read which permits may be free, in one round; answer ``(maybe_free,
    soonest)``: a flag per permit (absent on enough nodes to be granted) and
    the shortest lease left among the busy ones (seconds; None: unknown), or
    None when it could not tell (too few nodes answered): then every permit
    is tried.

    First the free notices already heard are dropped: this read covers them.
    A notice is read after the release script that published it ran, so a
    read sent later sees that release. Kept, such a notice (heard while in
    line, for a permit the head before took) made the next :class:`Notice`
    answer at once with a permit already taken: one lost try and one more
    read in about a third of the handoffs of 50 waiters on 5 permits. A
    notice heard after the drop and before the read ran is kept (at worst
    one lost try, as before), and one that the drop races with wakes the
    next wait for nothing (it reads again): no release is missed."""


class HandOn(NamedTuple):
    """Release lock ``at`` (the line, once the head holds its permit) without
    waiting for the nodes' replies; answer None. Its release script wakes
    the next in line (or hands it the line) as a release does; the head's
    ``acquire()`` returns meanwhile, one round trip sooner, holding its
    permit. Its grant came before this request left, so the order of the
    grants is the order of the line."""

    at: int


class Notice(NamedTuple):
    """Wait up to ``seconds`` for a free notice; answer with the permit it named
    (its index), or None (no notice, or one that named none)."""

    seconds: float


Step = Union[Take, Drop, TryPermit, Listen, Peek, HandOn, Notice]
#: A semaphore's plan: the composites' steps and its own.
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
        for permit in self._locks[:self.permits]:
            permit._notify = self._free_channel  # published by the release script
        self.ttl = float(self._locks[0].ttl)
        if any(getattr(node, "one_slot_per_call", False) for node in manager.nodes):
            self._check_one_slot()
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

    def _check_one_slot(self) -> None:
        """Refuse, before anything is sent, a name whose keys lie in several
        hash slots when a node is a Redis Cluster (``one_slot_per_call``).
        One script touches a permit's keys, the count key and the line's
        (:meth:`_guard`), another every permit's (:class:`Peek`): without a
        hash tag in the name they lie in several slots, and the Cluster
        answers every try ``CROSSSLOT``. A Cluster node alone made every
        acquire ``QuorumUnavailable``; beside plain nodes it never voted,
        which silently left the semaphore one fault from no quorum."""
        from redis.crc import key_slot

        line = self._locks[self.permits]
        keys = [self._count_key, line._key_b, line._fence_key_b, line._waiters_key_b]
        for lock in self._locks[:self.permits]:
            keys += [lock._key_b, lock._fence_key_b, lock._waiters_key_b]
        if len({key_slot(key) for key in keys}) > 1:
            raise ValueError(
                f"semaphore {self.name!r}: a Redis Cluster node runs a script on one hash "
                f"slot, and this name's keys (its permits, its line, its permit count) lie "
                f"in several; give the name a hash tag, e.g. \"{{pool}}\" or "
                f"\"{{pool}}:exports\" (every key of \"{{pool}}...\" shares the slot of "
                f"\"pool\")")

    def _guard(self, aside: bool) -> Guard:
        line = self._locks[self.permits]
        lease_ms = int(max(COUNT_LEASE, 3 * self.ttl) * 1000)
        return Guard((self._count_key, line._key_b, line._waiters_key_b),
                     (str(self.permits).encode(), lease_ms, b"1" if aside else b"0"))

    def _check_count(self, refusal: dict[str, tuple[int, Any]]) -> None:
        """After a refused try of a permit: raise :class:`PermitsMismatch` when
        some nodes record another count and fewer than a quorum agree with
        this one. Agreement is counted, not assumed: the nodes that answered
        without a count refusal (they granted, or found the permit busy, or
        someone in line, all after the count check passed); a node that did
        not answer (``GUARD_UNHEARD``) agrees to nothing. Counting "not
        enough disagree" instead let a caller with another count through
        while one node was out (the module docstring, t1). A minority with
        another count beside a quorum that agrees (a node restarted empty
        that a stray caller reached first) only grants nothing there.

        Raised only when the count can no longer win: fewer than a quorum
        agree even if every node that did not answer agreed. Undecided (a node
        out, and another with a stray count) is a refused try, like a busy
        permit: the caller waits while its timeout lasts, and no count gets a
        quorum of grants meanwhile (every try carries the guard). Blaming the
        caller there told one with the right count that its holders used
        another, at once, for the whole outage."""
        others = [detail for code, detail in refusal.values() if code == GUARD_COUNT]
        if not others:
            return
        nodes = len(self.manager.nodes)
        unheard = sum(1 for code, _ in refusal.values() if code == GUARD_UNHEARD)
        agreed = nodes - len(others) - unheard
        if agreed + unheard >= self.manager.quorum:
            return
        counts = [detail.decode() if isinstance(detail, bytes) else str(detail)
                  for detail in others]
        recorded = max(set(counts), key=counts.count)
        heard = (f" ({len(others)} of {nodes} nodes record permits={recorded}, {agreed} "
                 f"agree and {unheard} did not answer)") if unheard else ""
        raise PermitsMismatch(
            f"semaphore {self.name!r}: permits={self.permits} was asked, but its "
            f"holders use permits={recorded}{heard}; every user of one name must give the "
            f"same count (the recorded one expires {COUNT_LEASE:g} s after the last "
            f"acquire)", lock_name=self.name, permits=self.permits,
            recorded=int(recorded) if recorded.isdigit() else 0)

    def _acquire_plan(self, wait: float | None) -> Plan:  # type: ignore[override]
        clock = self.manager.clock
        deadline = None if wait is None else clock() + wait
        self._deadline = deadline
        line = self.permits
        order = list(range(self.permits))
        self._rng.shuffle(order)
        for asked in range(COUNT_RETRIES + 1):
            try:
                got, refusal = yield TryPermit(order[0], aside=wait != 0)
                break
            except QuorumUnavailable:
                # A cold manager under a burst can miss a round with every node
                # up (its connections are still being set up); the next one
                # finds them ready. A majority that is down fails each round.
                if asked == COUNT_RETRIES or (deadline is not None and clock() >= deadline):
                    raise
        if got:  # nobody in line, and this permit was free: one round trip in all
            return self._grant("index", order[0])
        self._check_count(refusal)
        if wait == 0:
            # A try (timeout 0, blocking=False) does not queue: it takes a free
            # permit if there is one now. Through the line it would answer busy
            # whenever another acquirer held the line for its own try.
            for index in order[1:]:
                got, refusal = yield TryPermit(index, aside=False)
                if got:
                    return self._grant("index", index)
                self._check_count(refusal)
            self.retry_after = min(lock.retry_after for lock in self._locks[:line])
            return False
        # Listen while in line, not only once at its head: the free channel
        # then stays subscribed from one head to the next (each head's own
        # SUBSCRIBE was a round trip in every handoff). A notice heard before
        # becoming the head is stale at worst: its permit is tried and found
        # taken, then the head reads the permits again.
        left = None if deadline is None else deadline - clock()
        yield Listen(self.manager.node_timeout if left is None
                     else max(0.0, min(self.manager.node_timeout, left)))
        if not (yield Take(line, None if deadline is None else max(0.0, deadline - clock()))):
            self.retry_after = self._locks[line].retry_after
            return False
        try:
            listening = True
            missed = 0
            freed: int | None = None
            soonest: float | None = None
            while True:
                if freed is not None:
                    # The permit a free notice named, alone: one round trip
                    # for the handoff. Lost (a try of a newcomer got there
                    # first): read the others at once.
                    candidates = [freed]
                else:
                    # One round says which permits are free, instead of one
                    # acquire attempt per busy permit (five round trips on a
                    # full semaphore, every time a waiter took the line).
                    peek = yield Peek()
                    if peek is None:
                        start = self._rng.randrange(self.permits)
                        candidates = [(start + k) % self.permits for k in range(self.permits)]
                        soonest = None
                    else:
                        maybe_free, soonest = peek
                        candidates = [i for i in range(self.permits) if maybe_free[i]]
                        self._rng.shuffle(candidates)
                named, freed = freed is not None, None
                for index in candidates:
                    try:
                        # The count check goes with every try (aside: no,
                        # the head holds the line it would step aside for).
                        got, refusal = yield TryPermit(index, aside=False)
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
                        grant = self._grant("index", index)
                        yield HandOn(line)  # the next in line becomes the head
                        return grant
                    self._check_count(refusal)
                left = None if deadline is None else deadline - clock()
                if left is not None and left <= 0:
                    self.retry_after = min(lock.retry_after for lock in self._locks[:line])
                    yield Drop(line)
                    return False
                if named:
                    continue
                if not listening:
                    # Read again once listening: a permit freed before the
                    # subscription held sent a notice nobody heard.
                    listening = True
                    yield Listen(self.manager.node_timeout if left is None
                                 else min(self.manager.node_timeout, left))
                    continue
                # No notice comes from a holder that crashed: wake when the
                # soonest lease of a busy permit runs out.
                if soonest is None:
                    soonest = min(lock.retry_after for lock in self._locks[:line])
                pause = max(MIN_PAUSE, soonest) * self._rng.uniform(1.0, 1.1)
                freed = yield Notice(pause if left is None else min(pause, left))
        except BaseException:
            if self.index is not None:
                yield from compose.give_back([self.index])
                self.index = None
            yield Drop(line)
            raise

    def _peek_requests(self) -> list[Any]:
        keys = tuple(lock._key_b for lock in self._locks[:self.permits])
        return [Call(SEMAPHORE_PEEK, keys, ())] * len(self.manager.nodes)

    def _peek_verdict(self, replies: Sequence[Any]) -> tuple[list[bool], float | None] | None:
        """What :class:`Peek` answers, from each node's PTTLs (see there)."""
        quorum = self.manager.quorum
        read = [r for r in replies if isinstance(r, list) and len(r) == self.permits]
        if len(read) < quorum:
            return None
        unread = len(replies) - len(read)
        maybe_free = [sum(1 for r in read if r[i] == -2) + unread >= quorum
                      for i in range(self.permits)]
        leases = [int(r[i]) for r in read for i in range(self.permits) if int(r[i]) > 0]
        return maybe_free, (min(leases) / 1000.0 if leases else None)

    def _freed(self, payload: bytes | None) -> int | None:
        """The permit a free notice named (its lock key), or None."""
        if payload:
            for index, lock in enumerate(self._locks[:self.permits]):
                if lock._key_b == payload:
                    return index
        return None

    def _release_plan(self, grant: int | None = None) -> Plan:  # type: ignore[override]
        with compose._entries_guard:
            if self.index is None or not self._release_begins(grant):
                raise LockNotOwned(f"semaphore {self.name!r}: no permit held by this object",
                                   lock_name=self.name)
            index, self.index = self.index, None
        lost = yield Drop(index)  # its script publishes the free notice
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
        return bool(self._acquire_grant(blocking, timeout))

    def release(self) -> None:
        """Release the permit held; ``LockLost`` afterwards if it was lost."""
        self._release_grant(None)

    def _acquire_grant(self, blocking: bool = True,
                       timeout: float | None | EllipsisType = ...) -> Any:
        return self._run(self._acquire_plan(self._wait(blocking, timeout)))

    def _release_grant(self, grant: int | None) -> None:
        self._run(self._release_plan(grant))

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
        held = compose._HeldBack()  # a give-back is not cut short (see there)
        try:
            step = next(plan)
            while True:
                if held.exc is not None and not isinstance(step, Drop):
                    step = plan.throw(held.pop())
                    continue
                try:
                    answer: Any = None
                    if isinstance(step, Take):
                        answer = locks[step.at].acquire(timeout=step.timeout)
                    elif isinstance(step, Drop):
                        answer = compose._drop(locks[step.at])
                    elif isinstance(step, TryPermit):
                        lock = locks[step.at]
                        lock._guard = self._guard(step.aside)
                        try:
                            answer = (lock.acquire(timeout=0), lock._guard_refusal)
                        finally:
                            lock._guard = None
                    elif isinstance(step, HandOn):
                        _hand_on(locks[step.at])
                    elif isinstance(step, Peek):
                        if sub is not None:  # notices heard so far: this read covers them
                            sub.payload = None
                            sub.clear()
                        answer = self._peek_verdict(mgr.transport.round(self._peek_requests()))
                    elif isinstance(step, Listen):
                        sub = mgr.notifier.subscribe(self._free_channel, step.confirm)
                    else:
                        assert sub is not None  # a Notice: the plan listened first
                        sub.wait(step.seconds)
                        answer = self._freed(sub.payload)
                        sub.payload = None
                        sub.clear()
                except BaseException as exc:  # noqa: BLE001 - the plan gives back, re-raises
                    if not isinstance(step, Drop):
                        step = plan.throw(exc)
                        continue
                    held.keep(exc)
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


class AsyncSemaphore(SemaphoreBase, compose.AsyncComposed):
    """The asyncio twin of :class:`Semaphore`; from :meth:`LockManager.asemaphore`."""

    async def acquire(self, blocking: bool = True,
                      timeout: float | None | EllipsisType = ...) -> bool:
        return bool(await self._acquire_grant(blocking, timeout))

    async def release(self) -> None:
        await self._release_grant(None)

    async def _acquire_grant(self, blocking: bool = True,
                             timeout: float | None | EllipsisType = ...) -> Any:
        return await self._arun(self._acquire_plan(self._wait(blocking, timeout)))

    async def _release_grant(self, grant: int | None) -> None:
        await self._arun(self._release_plan(grant))

    async def extend(self, ttl: float | EllipsisType = ...) -> None:
        lock = self._extend_targets()[0]
        try:
            await lock.extend(ttl)
        except LockNotOwned:
            raise self._lost(lock) from None

    async def _arun(self, plan: Plan) -> Any:
        from .aio import _subscribe

        mgr = self.manager
        locks = self._locks
        waiter = None
        held = compose._HeldBack()  # a give-back is not cut short (see there)
        try:
            step = next(plan)
            while True:
                if held.exc is not None and not isinstance(step, Drop):
                    step = plan.throw(held.pop())
                    continue
                try:
                    answer: Any = None
                    if isinstance(step, Take):
                        answer = await locks[step.at].acquire(timeout=step.timeout)
                    elif isinstance(step, Drop):
                        answer = await compose._adrop(locks[step.at])
                    elif isinstance(step, TryPermit):
                        lock = locks[step.at]
                        lock._guard = self._guard(step.aside)
                        try:
                            answer = (await lock.acquire(timeout=0), lock._guard_refusal)
                        finally:
                            lock._guard = None
                    elif isinstance(step, HandOn):
                        await _ahand_on(locks[step.at])
                    elif isinstance(step, Peek):
                        if waiter is not None:  # see Semaphore._run
                            waiter.sub.payload = None
                            waiter.clear()
                        answer = self._peek_verdict(
                            await locks[0].transport.round(self._peek_requests()))
                    elif isinstance(step, Listen):
                        waiter = await _subscribe(mgr, self._free_channel, step.confirm,
                                                  b"", b"")
                    else:
                        assert waiter is not None  # a Notice: the plan listened first
                        await waiter.wait(step.seconds)
                        answer = self._freed(waiter.sub.payload)
                        waiter.sub.payload = None
                        waiter.clear()
                except BaseException as exc:  # noqa: BLE001 - see Semaphore._run
                    if not isinstance(step, Drop):
                        step = plan.throw(exc)
                        continue
                    held.keep(exc)
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
