"""The lock's protocol, written once: every rule of acquire, renew, release.

(Why one module of 890 lines: the plans share one lock state and one set of
steps; split, each plan would reach into the others' state.)

Timeline of the race this protocol is built to survive::

    t0  A acquires "stock:1" (fence 41), lease 10 s, starts its work
    t1  A is paused (GC, SIGSTOP, a swapped-out VM) for 15 s
    t10 A's lease expires on the nodes; its renewal could not run
    t11 B acquires "stock:1" (fence 42) and writes
    t16 A resumes. Its renewal finds B's token on the nodes: A's lock is *lost*.
        A's ``owned()`` is False, ``lock_lost`` fires, and the ``with`` block
        raises ``LockLost`` when it ends. A's release compares tokens and leaves
        B's key alone. If A writes before noticing, its fence (41) is lower than
        B's (42), and a fenced write refuses it.

:class:`LockBase` holds a lock's state and its *plans*: generators that yield
what to do next (an acquire round, a subscription, a wait, a release or
extension round, a signal) and receive the answers, with no I/O of their own
(the sans-I/O style of h11 and wsproto). :class:`~.lock.Lock` runs them from
a thread with the sync transport, :class:`~.aio.AsyncLock` from a coroutine with
the asyncio one; neither knows a rule, so they cannot drift apart. The rounds'
own rules (what to ask each node, what the replies mean) are in :mod:`.rounds`.
"""

from __future__ import annotations

import functools
import math
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Generator, NamedTuple, Protocol, Sequence, Union

from ..core.arguments import check_label, check_timeout
from ..core.keys import fence_key, lock_key, segment_channel, validate_name, waiters_key
from ..core.owner import new_token, owner_json
from ..core.pid import getpid
from ..core.retry import jittered_delay
from ..exceptions import LockLost, LockNotAcquired, LockNotOwned, QuorumUnavailable, RedlockError
from ..transport.finalizers import get_logger
from ..transport.sync import call_deadline, round_began
from . import events, held, rounds
from .entries import EntryRecords, _Block, _HandRecord

if TYPE_CHECKING:
    from ..transport.notify import Subscription
    from .rounds import AcquireResult

logger = get_logger("django_redlock.lock")

_UNLOCKED, _HELD, _LOST = "unlocked", "held", "lost"


def _claim(unreported: list[int]) -> bool:
    """Take a hold's right to report its loss: True for one caller only,
    whichever threads race for it (``list.pop`` is one atomic step, with or
    without the GIL; a check of a flag and then its write is two, and a
    thread switch or a collection between them let both report)."""
    try:
        unreported.pop()
    except IndexError:
        return False
    return True




class LockHost(Protocol):
    """What a lock needs from its manager (:class:`~.manager.LockManager` is the
    one implementation). Named here so that the locks do not import the
    manager that makes them: the engine's imports point one way."""

    key_prefix: str
    quorum: int
    node_timeout: float
    retry_delay: float
    drift_factor: float
    replica_acks: int
    transport: Any
    _reentrant: Any

    @property
    def nodes(self) -> Sequence[Any]: ...
    @property
    def notifier(self) -> Any: ...
    @property
    def watchdog(self) -> Any: ...
    def clock(self) -> float: ...
    def next_wait(self, remaining: float | None, holder_ttl: float | None) -> float: ...
    def force_release(self, name: str, *, holder: str = ...) -> Any: ...
    def _handoff_pause(self, key: bytes) -> float: ...
    def _note_release(self, key: bytes, woken: int) -> None: ...
    _closing: bool
    def _call_begins(self) -> None: ...
    def _call_ends(self) -> None: ...
    def closed_under_grant(self) -> bool: ...
    def _holders(self, key: bytes) -> int: ...
    def _acquire_round(self, *args: Any, **kwargs: Any) -> Any: ...
    def _release_round(self, *args: Any, **kwargs: Any) -> Any: ...
    def _extend_round(self, *args: Any, **kwargs: Any) -> Any: ...
    def _leave_queue(self, *args: Any, **kwargs: Any) -> None: ...
    def _give_up(self, *args: Any, **kwargs: Any) -> None: ...
    def _send_later(self, requests: Sequence[Any], replies: Sequence[Any],
                    lasts: float) -> None: ...


# What an acquire's waiting rules (LockBase._acquire_plan) ask its flavour to do.
class Attempt(NamedTuple):
    """Make one acquire round; answer with its ``AcquireResult``, or throw its
    :class:`QuorumUnavailable` into the plan (``plan.throw``): the plan decides
    whether that ends the call (see ``LockBase._acquire_plan``)."""

    woken: bool  # a release notice named us since the last attempt
    ask_all: bool  # skip the gate node this time (see rounds.gate_node)
    #: Asked again after a round that met a late reply: ask the nodes in
    #: back-off too (the late one is in back-off now; see _acquire_plan).
    again: bool = False
    #: This attempt's number in its acquire() call, from 1: written into the
    #: lock value, so that no late request of an earlier attempt undoes this
    #: one's grant (rounds.attempt_owner).
    number: int = 0


class Subscribe(NamedTuple):
    """Register for release notices (wait up to ``confirm`` s for a node to
    confirm); from now on every attempt queues. Answer with anything."""

    confirm: float


class Wait(NamedTuple):
    """Wait up to ``seconds`` for a release notice; answer True when one came."""

    seconds: float


class Pause(NamedTuple):
    """Sleep ``seconds`` (not woken by a notice): the jitter before an attempt
    that follows a round that reached no quorum."""

    seconds: float


#: How many rounds in a row that reached no quorum one acquire() asks again,
#: when some node was asked and did not answer in time (a slow reply, not a
#: refusal or a skipped node, and no set-up of it failed since: _slow_reply)
#: and the round's attempt took at most ``SHORT_ROUND`` node timeouts (a
#: round that already waited for connection set-ups, up to CONNECT_TIMEOUT,
#: gave every node its chance). The clean-up release after the lost attempt
#: is not counted: its wait for a late node's new connection gives the
#: attempt no chance, and made a round of 0.2 s one of 0.7 s on a link 60 ms
#: away, which then ended the call. A round that reached a quorum (busy or
#: not) starts the count again: a contended waiter makes many rounds, and
#: each may meet one slow reply under load. The rounds asked again wait for a
#: connection no longer than the node timeout, and a node that stopped
#: answering loses its connection on the first miss, so its next round says
#: "no connection", not a slow reply, and its new set-up never answers (one
#: that does is alive: _set_up_answers): a majority that is really gone costs
#: one round more, the bound in docs/reliability.rst.
UNAVAILABLE_RETRIES = 2
SHORT_ROUND = 3.0

#: The reason the transports give for a node that was asked and did not
#: answer within its node timeout.
_SLOW_REPLY = "no answer within"


#: The reasons of a node that missed a round waiting for a connection set-up
#: (its own, or the one carrying an earlier request of the lock).
_WAITED_FOR_SET_UP = ("no connection yet", "an earlier attempt's clean-up")

#: The reasons of a node that missed a round for want of time (a reply, a
#: connection, its back-off after such a miss), as the transports give them;
#: an error reply (READONLY, OOM...), a refusal or a node that is not Redis is
#: an answer, and is never asked again for it (_quorum_alive).
_TRANSIENT = (_SLOW_REPLY, "skipped: failed recently", *_WAITED_FOR_SET_UP)


def _answers(nodes: Sequence[Any]) -> list[int]:
    """Each node's count of replies read so far (``NodeClient.answers``)."""
    return [getattr(node, "answers", 0) for node in nodes]


def _quorum_alive(exc: QuorumUnavailable, nodes: Sequence[Any], before: list[int],
                  quorum: int) -> bool:
    """Whether a quorum of nodes showed life during the round that ``exc``
    ended: those that answered it, those that missed it but answered
    another round meanwhile (their reply count grew since ``before``), and
    those that missed it waiting for a connection whose set-up answers
    (``_set_up_answers``).

    Only a miss for want of time counts (``_TRANSIENT``): a node that
    answered with an error (a replica's READONLY, OOM) answered, and its reply
    counts its reply count up too. Then the miss says nothing about the nodes:
    it was this process that was slow (a burst of 200 rounds on two loaded cores: replies queued behind
    other threads past the node timeout, connections in use by other rounds)
    and the caller, who still has time, is owed another round. A paused or
    dead node answers nobody, so an outage never passes this test: it keeps
    the bounds of UNAVAILABLE_RETRIES (issue 25, seen again in CI).

    A node whose grant its replicas did not confirm (``REPLICA_ACKS``) answered,
    but is not alive for the lock: asking it again at once changes nothing.
    """
    alive = 0
    for node, count in zip(nodes, before):
        reason = exc.errors.get(node.name)
        if reason is None:
            alive += 1  # it answered this round
        elif str(reason).startswith(_TRANSIENT) and getattr(node, "answers", 0) > count:
            alive += 1  # late for us, answering others
        elif str(reason).startswith(_WAITED_FOR_SET_UP) and _set_up_answers(node):
            alive += 1  # its connection's set-up answers, slower than the round
    return alive >= quorum


def _set_up_answers(node: Any) -> bool:
    """Whether ``node``'s connection set-up answered since the newest began
    (``NodeClient.set_up_began``, ``NodeClient.set_up_answered``).

    That is what a single caller has to tell a live node from a paused one
    when a round missed it waiting for its connection: no other round of the
    process answers. One node of three down, a second late with one reply
    (its connection is dropped), and the round asked again waits for that
    node's new connection no longer than the node timeout; the set-up takes
    several round trips (the handshake, the scripts, the late attempt's
    clean-up) and outlasts it on a distant link or a starved CPU::

        t=0.00  round 1: node 0 refuses (down), node 2 grants, node 1 late
        t=0.20  node 1 missed it: its connection dropped, a set-up begins
        t=0.33  the set-up's first step answered (a link 60 ms away)
        t=0.45  round 2 (node timeout 0.2 s) waits for node 1's connection
        t=0.65  round 2 ends: "no connection yet", the set-up is still on
                its scripts (their replies come at t=0.70)

    Round 2 ended the call with ``QuorumUnavailable`` while both live nodes
    answered (every asyncio call of ``tests/test_faults.py``'s
    ``test_one_slow_reply_with_a_minority_down_is_not_an_outage[distant-*]``
    failed).

    A paused node's set-up connects (the kernel accepts) and never answers;
    one that stops answering mid-way fails within ``CONNECT_TIMEOUT``, and
    its failure is that node's answer (a set-up failed since the last reply:
    not alive). A set-up's replies count for a round missed waiting for a
    connection only: a node whose every request comes late answers its
    set-ups too, and its late replies stay bounded by UNAVAILABLE_RETRIES.
    """
    answered = getattr(node, "set_up_answered", -math.inf)
    return (answered > getattr(node, "set_up_began", math.inf)
            and answered > getattr(node, "set_up_failed", -math.inf))


def _slow_reply(exc: QuorumUnavailable, nodes: Sequence[Any], began: float) -> bool:
    """Whether a node was merely slow in ``exc``'s round (worth asking again),
    rather than every failing node refusing, being skipped or erroring.

    A node that was late and whose connection set-up then failed, before the
    round ended (``began``: its start on time.monotonic), was not merely
    slow: the clean-up release after the lost attempt waits for a late
    node's new connection, and a black-holed node's set-up fails there after
    ``CONNECT_TIMEOUT``. That failure is its answer: asking it again would
    cost another round for nothing (``test_partitioned_node_behind_a_proxy``).
    """
    late = {name for name, reason in exc.errors.items() if str(reason).startswith(_SLOW_REPLY)}
    return any(node.name in late and getattr(node, "set_up_failed", -math.inf) < began
               for node in nodes)


Step = Union[Attempt, Subscribe, Wait, Pause]


# What the hold's plans (release, extend, renewal) ask their flavour to do.
class ReleaseRound(NamedTuple):
    """Release ``token`` on every node; answer with its ``ReleaseResult``."""

    token: str
    fence: int
    #: How long the key may still be on a node (its lease): a release that
    #: failed on a node is sent again for that long (engine/leftovers.py).
    lease: float = 0.0


class ExtendRound(NamedTuple):
    """Set the lease of ``token`` to ``ttl`` s on a quorum; answer with its
    ``ExtendResult``."""

    token: str
    fence: int
    ttl: float


class Report(NamedTuple):
    """Send ``signal`` (sender ``Lock``; a failing receiver is logged) with
    ``kwargs``; answer with anything."""

    signal: Any
    kwargs: dict[str, Any]


HoldStep = Union[ReleaseRound, ExtendRound, Report]
#: A plan for a held lock: yields HoldSteps, receives their answers, returns T.
HoldPlan = Generator[HoldStep, Any, Any]
#: Yields steps, receives their answers, returns the winning result or None
#: when the wait ran out.
AcquirePlan = Generator[Step, Any, "AcquireResult | None"]


def run_to_round(plan: HoldPlan) -> "tuple[Sequence[Report], tuple[HoldPlan, ExtendRound] | Any]":
    """Run a renewal plan up to its extension round, without I/O (a batched
    renewal's first half: ``Lock._renewal_begin``, ``AsyncLock._renewal_begin``).

    Returns the reports it made on the way, for the driver to send, and either
    ``(plan, round)`` or, when it needed no round, its result (the next due
    time; None: stop renewing). A renewal plan reports only on the paths that
    end without a round (a loss), so sending them afterwards keeps their order.
    """
    reports: Sequence[Report] = ()  # a list of its own at the first report (most have none)
    answer: Any = None
    while True:
        try:
            step = plan.send(answer)
        except StopIteration as done:
            return reports, done.value
        if type(step) is ExtendRound:
            return reports, (plan, step)
        if type(step) is not Report:  # pragma: no cover - a renewal releases nothing
            raise AssertionError(f"unexpected renewal step {step!r}")
        reports = [*reports, step]
        answer = None


@functools.lru_cache(maxsize=1024)
def _keys(prefix: str, name: str) -> tuple[str, bytes, bytes, bytes, bytes]:
    """A lock's key (str and bytes), fencing counter and waiter queue keys,
    and the free channel its release publishes on (``segment_channel``: b""
    unless the name is a segment's), for a name that :func:`validate_name`
    accepts (it raises, and nothing is cached, for any other): derived once
    per name, not per lock object."""
    key = lock_key(prefix, validate_name(name))
    return (key, key.encode(), fence_key(key).encode(), waiters_key(key).encode(),
            segment_channel(prefix, name))


class LockBase(EntryRecords):
    """State and rules shared by :class:`Lock` and :class:`~django_redlock.aio.AsyncLock`.

    Everything here is local: no I/O, so both flavours read their state the same
    way (``owned()`` and ``validity`` come from the monotonic clock, which stays
    right even when the renewal could not run).
    """

    #: What the holder's token starts with: empty for a plain lock; a read-write
    #: lock's holders say their mode in it ("r." / "w."), and the rounds pick
    #: that kind's scripts by it (rounds.READ_PREFIX).
    token_prefix = ""

    def __init__(self, manager: "LockHost", name: str, *, ttl: float,
                 timeout: float | None, auto_renew: bool, fencing: bool = True,
                 max_hold: float | None = None, label: str | None = None) -> None:
        self.manager = manager
        self.name = name if type(name) is str else validate_name(name)
        self.key, self._key_b, self._fence_key_b, self._waiters_key_b, notify = _keys(
            manager.key_prefix, self.name)
        self.ttl = float(ttl)
        self.timeout = timeout
        self.auto_renew = auto_renew
        self.fencing = fencing
        self.max_hold = max_hold
        self.label = label if label is None else check_label(label)
        self.fence = 0
        #: Nodes that had granted the last acquisition when it returned (0: not
        #: counted, e.g. handed over by a release); shown by the debug-toolbar panel.
        self.granted_nodes = 0
        self.retry_after = 0.0
        self._state = _UNLOCKED
        self._token = ""
        self._valid_until = 0.0
        #: Until when (this process's clock) a node may still have the key:
        #: the longest lease any round of this hold gave it, which a shorter
        #: renewal after an ``extend(60)`` does not take back (a node never
        #: shortens a lease). A release a node missed is sent again that long.
        self._keys_until = 0.0
        self._acquired_at = 0.0
        self._pid = 0
        #: How many holds this object began (``_enter_hold``): a renewal
        #: scheduled for one hold never renews a later one (``watchdog._Entry``).
        self._hold_no = 0
        self._lost_reason = ""
        #: This hold's ``lock_lost`` not sent yet while it has an item: who
        #: takes it (``_claim``) sends it, and nobody else.
        self._loss_unreported: list[int] = []
        #: The open ``with`` (``async with``) blocks a statement entered on
        #: this object: the id of the block's frame -> its blocks there,
        #: innermost last; made at the first (see _record_block).
        self._blocks: dict[int, list[_Block]] | None = None
        #: The open entries no statement made, per entrant (an exit stack,
        #: a thread, a task): id(entrant) -> (a weak reference to it, its
        #: entries, innermost last); see _hand_entry. A plain dict read in
        #: one step (``list(d.values())``): a WeakKeyDictionary's iteration
        #: runs Python code, and another thread's exit changed it meanwhile.
        self._hand: dict[int, tuple[Any, list[_HandRecord]]] | None = None
        #: What held the key at the last refusal when it was not a lock
        #: (rounds.obstacle), for the busy error.
        self._obstacle = ""
        #: Set by a semaphore around its first try of this permit: checks the
        #: acquire script makes first (``rounds.Guard``); and what the last
        #: refused attempt's guards answered (node name to (code, detail)).
        self._guard: rounds.Guard | None = None
        self._guard_refusal: dict[str, tuple[int, Any]] = {}
        #: The channel its release publishes its key on, in the release
        #: script itself: a segment's (``"<base>[<i>]"``) publishes on the
        #: segments' free channel, a semaphore's permit on the semaphore's.
        self._notify = notify

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self._state} fence={self.fence}>"

    @property
    def validity(self) -> float:
        """Seconds of lease left (0.0 when not held, lost, or in a forked child)."""
        if self._state != _HELD or self._pid != getpid():
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
        if self._state != _UNLOCKED and self._pid == getpid() and self.owned():
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
        return (started, deadline, self.token_prefix + new_token(), owner_json(self.label),
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
        if self._state == _UNLOCKED or self._pid != getpid() or self.owned():
            return None
        owed = None
        if self._state == _HELD and _claim(self._loss_unreported):
            owed = ("the lease ran out without release(); acquiring again",
                    self.manager.clock() - self._acquired_at)
        self._forget_hold(released=False)  # its blocks' exits: LockLost
        return owed

    def _forget_hold(self, released: bool) -> None:
        """End the current hold here (not on the nodes): the one place every
        path that ends a hold goes through (a release, the release at exit,
        an interrupted acquire taken back, a lapsed hold acquired anew).

        The token is emptied before the state is written: a loss report
        running meanwhile reads the token after it wrote "lost", so a release
        it did not see yet writes its own "unlocked" after it (see
        ``_mark_lost_plan``). ``released``: ended by a release, so the open
        blocks on it have nothing left to end and leave later holds alone
        (``_mark_released``); False for a lease that lapsed, whose blocks'
        exits raise ``LockLost``."""
        if released and (self._blocks or self._hand):
            self._mark_released(self._hold_no)
        self._token = ""
        self._state = _UNLOCKED
        self._valid_until = 0.0

    def _leaving(self, caller: Any, own: Any = None) -> "tuple[bool, tuple[int, int] | None]":
        """A block's exit, run in frame ``caller`` (``own``: the frame of
        ``__exit__`` / ``__aexit__``): (whether a release
        follows, the (hold, fence) it is for, None for the current hold).
        Raises ``LockLost`` when the block's own hold lapsed and a newer one
        began (held now, or come and gone): lost, whatever the object holds
        now. No release after a release by hand inside the block (nothing
        left to end), nor in a forked child."""
        block = self._exit_record(caller, own)
        if self._pid != getpid():
            return False, None
        if block is not None and block[0] not in (0, self._hold_no):
            raise self._gone_hold(block[1])
        if self._state == _UNLOCKED or (block is not None and block[0] == 0):
            return False, None
        return True, block

    def _gone_hold(self, fence: int) -> LockLost:
        return LockLost(f"lock {self.name!r} was lost before this block ended: its lease ran "
                        f"out (or its renewal failed) and the object was acquired again; "
                        f"that newer hold is left to its holder", lock_name=self.name,
                        fence=fence)

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
        self._guard_refusal = {}
        unavailable_retries = 0
        again = False
        number = 0
        while True:
            asked_at = mgr.clock()
            answers = _answers(mgr.nodes)
            number += 1
            try:
                result = yield Attempt(woken, ask_all, again, number)
            except QuorumUnavailable as exc:
                # Issue 25: with a minority down, one slow reply from a live
                # node left the round short of a quorum, and the call ended
                # although it could still wait. While the caller has time, ask
                # again (jittered, nodes in back-off included):
                # - as long as a quorum shows life (_quorum_alive): the miss
                #   was our own slowness, not the nodes';
                # - else at most UNAVAILABLE_RETRIES rounds in a row, when a
                #   node was merely late; those rounds wait for connections no
                #   longer than the node timeout, which bounds a real outage.
                now = mgr.clock()
                remaining = None if deadline is None else deadline - now
                if remaining is not None and remaining <= 0:
                    raise
                took = exc.round_seconds if exc.round_seconds is not None else now - asked_at
                if not _quorum_alive(exc, mgr.nodes, answers, mgr.quorum):
                    if (unavailable_retries >= UNAVAILABLE_RETRIES
                            or not _slow_reply(exc, mgr.nodes, round_began(asked_at, mgr.clock))
                            or took > SHORT_ROUND * mgr.node_timeout):
                        raise
                    unavailable_retries += 1
                    call_deadline.set(0.0)  # no connection wait past the node timeout now
                again = True
                logger.info("lock %r: %s; asking again", self.name, exc)
                pause = jittered_delay(min(mgr.retry_delay, mgr.node_timeout) / 2)
                if remaining is not None:
                    pause = min(pause, remaining)
                if pause > 0:
                    yield Pause(pause)
                continue
            again = False
            if unavailable_retries:  # a quorum answered: connection waits as before
                unavailable_retries = 0
                call_deadline.set(math.inf if deadline is None else deadline)
            remaining = None if deadline is None else deadline - mgr.clock()
            if result.acquired:
                won: AcquireResult = result
                return won
            self._guard_refusal = result.guard
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
        release there may hand it the lock (``rounds.hand_over_entry``).

        Nothing when that node is a Redis Cluster (``hands_over`` False):
        there a release's ``PUBLISH`` counts only the listeners on its own
        master while the notice reaches every master, so a waiter listening
        on another one would take a lock the release took back for want of a
        listener. Such a waiter is woken, and asks (transport/nodekinds.py).

        On several nodes the entry also says how long the waiter has a handed
        lock to itself while it asks the others (``rounds.first_ms``)."""
        nodes = self.manager.nodes
        if not getattr(nodes[rounds.hand_over_node(self._key_b, len(nodes))], "hands_over", True):
            return b""
        mgr = self.manager
        first = rounds.first_ms(mgr.node_timeout, mgr.retry_delay) if len(nodes) > 1 else 0
        return rounds.hand_over_entry(ttl_ms, self.fencing, owner, first)

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
        if refusal is None or self.manager.replica_acks:
            # With REPLICA_ACKS, no replica confirmed the releaser's hand-over
            # write: the attempt (the key is ours, its lease renewed) is
            # confirmed by WAIT like any grant.
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

    # -- the hold's plans: written once, run by Lock (threads) and AsyncLock ---------
    # Each plan holds every rule (state, what counts as lost, which signal) and
    # no I/O: it yields ReleaseRound / ExtendRound / Report and gets the answers.
    # A flavour runs it with its own transport and its own locking (Lock._run_plan,
    # AsyncLock._run_plan), so the two cannot drift apart.

    def _release_plan(self, block: "tuple[int, int] | None" = None) -> HoldPlan:
        """``release()``: see :meth:`Lock.release` for what it raises and when.
        ``block``: (hold, fence) of the hold to end (a block's exit, a release
        put off): ``LockLost`` when the object holds another by now."""
        mgr = self.manager
        if self._state == _UNLOCKED or self._pid != getpid():
            raise LockNotOwned(f"lock {self.name!r} is not held by this object",
                               lock_name=self.name)
        if block is not None and block[0] != self._hold_no:
            raise self._gone_hold(block[1])
        # Judged before the first yield (under the sync lock's _io; before the
        # asyncio flavour can yield to the loop): a renewal that runs late
        # must not make an expired lease look valid.
        now = mgr.clock()
        was_lost = self._state == _LOST or self._valid_until <= now
        reason = self._lost_reason or "the lease ran out before release"
        # (the claim of this hold's loss report with them: the object may hold again)
        token, fence, hold, unreported = (self._token, self.fence, self._hold_no,
                                          self._loss_unreported)
        # self._key_life(now), written out: every release
        lease = max(self.ttl, self._valid_until - now, self._keys_until - now)
        # Counted in flight from before it stops counting as held until its
        # replies are in: a retired manager (LockManager.retire) must not
        # close under this round.
        mgr._call_begins()
        try:
            self._forget_hold(released=True)
            held = now - self._acquired_at
            result = yield ReleaseRound(token, fence, lease)
        finally:
            mgr._call_ends()
        mgr._note_release(self._key_b, result.woken)
        if result.lost and not was_lost:
            # Taken or expired although our clock still gave it time (a node's
            # clock jumped, an operator's force release).
            was_lost = True
            reason = (f"{result.not_ours} of {len(mgr.nodes)} nodes no longer had this "
                      f"holder's key at release (it expired or was taken)")
        if was_lost:
            if _claim(unreported):  # else the renewal reported it (or is reporting it)
                yield from self._report_lost_plan(reason, held, fence, hold)
            raise LockLost(f"lock {self.name!r} was lost before release: {reason}",
                           lock_name=self.name, fence=fence)
        # Only a release some node confirmed (see signals); with no receiver
        # connected, sending would do nothing, so nothing is built for it.
        if result.released and events.lock_released.receivers:
            yield Report(events.lock_released, dict(lock=self, name=self.name, fence=fence,
                                                     hold=hold, held=held,
                                                     nodes=result.released))
        if not result.released:
            logger.warning("release of lock %r was confirmed by no node; it is sent again "
                           "to the nodes that failed until they answer, and where it "
                           "never arrives the key expires with its lease (%.3f s at most)",
                           self.name, self.ttl)
        elif result.released + result.not_ours < mgr.quorum:
            # The nodes it did not reach may keep the key, and fewer than a
            # quorum are known free: others can be kept out until it expires.
            logger.warning("release of lock %r was confirmed by %d of %d nodes (a quorum is "
                           "%d); it is sent again to the nodes that failed until they "
                           "answer, and where it never arrives the key expires with its "
                           "lease (%.3f s at most): the lock may stay busy until then",
                           self.name, result.released, len(mgr.nodes), mgr.quorum, self.ttl)

    def _extend_call_plan(self, ttl: float) -> HoldPlan:
        """``extend(ttl)`` once its argument was checked: raises as documented."""
        if self._state != _HELD or self._pid != getpid():
            raise LockNotOwned(f"lock {self.name!r} is not held by this object",
                               lock_name=self.name)
        status, reason = yield from self._extend_plan(ttl)
        if status == "lost":
            raise LockLost(f"lock {self.name!r} could not be extended: {reason}",
                           lock_name=self.name, fence=self.fence)
        if status == "retry":
            raise QuorumUnavailable(f"lock {self.name!r} was not extended: {reason}",
                                    lock_name=self.name, needed=self.manager.quorum)

    def _extend_plan(self, ttl: float) -> HoldPlan:
        """One extension: returns ("ok", ""), ("lost", why) or ("retry", why)."""
        mgr = self.manager
        if self._valid_until <= mgr.clock():
            reason = "the lease ran out before it could be extended"
            yield from self._mark_lost_plan(reason)
            return "lost", reason
        token = self._token
        result = yield ExtendRound(token, self.fence, ttl)
        if self._token != token or self._state == _UNLOCKED:
            return "lost", "released while the extension ran"
        if self._valid_until <= mgr.clock():
            # The lease ran out by our clock while the round ran: owned() has
            # said False since, and a late "extended" must not make it say
            # True again (a batched renewal's reply comes after the whole
            # pass). The lock is lost, as it would be had nothing answered;
            # the key the round extended goes with release(), or its lease.
            #
            #   t0  renewal sent; the lease ends at t1 by our clock
            #   t1  owned() False, nothing reported: the holder stops writing
            #   t2  the reply "extended" is counted: owned() was True again
            reason = "the lease ran out before its extension was confirmed"
            if result.extended:  # the nodes keep it that long: release() says so
                self._keys_until = max(self._keys_until, mgr.clock() + ttl)
            yield from self._mark_lost_plan(reason)
            return "lost", reason
        if result.extended:
            self._valid_until = result.valid_until
            self._keys_until = max(self._keys_until, mgr.clock() + ttl)
            # With no receiver connected, sending would do nothing: nothing is
            # built for it (10,000 held locks renew 3,000 times a second).
            if events.lock_extended.receivers:
                yield Report(events.lock_extended, dict(lock=self, name=self.name,
                                                         fence=self.fence, hold=self._hold_no,
                                                         ttl=ttl))
            return "ok", ""
        if result.valid_until:  # some node took a shorter lease (rounds.tally_extend)
            self._valid_until = min(self._valid_until, result.valid_until)
        if result.lost or self._valid_until <= mgr.clock():
            yield from self._mark_lost_plan(result.reason)
            return "lost", result.reason
        return "retry", result.reason

    def _renew_plan(self) -> HoldPlan:
        """One renewal of a held lock; returns the next due time, or None to stop."""
        mgr = self.manager
        if self._state != _HELD or self._pid != getpid():
            return None
        now = mgr.clock()
        ttl = self.ttl
        if self.max_hold is not None:
            cap_left = self._acquired_at + self.max_hold - now
            if cap_left <= 0:
                if self._valid_until <= now:
                    yield from self._mark_lost_plan(f"MAX_HOLD ({self.max_hold:g} s) reached")
                    return None
                return self._valid_until  # come back to report the expiry
            ttl = min(ttl, cap_left)
        status, _ = yield from self._extend_plan(ttl)
        if status == "ok":
            return self._next_renewal(now)
        if status == "lost":
            return None  # the plan reported it
        # Transient failure: try again soon, while the lease lasts.
        left = self._valid_until - mgr.clock()
        return mgr.clock() + max(0.01, min(ttl / 10, left / 3))

    def _next_renewal(self, now: float) -> float:
        return now + self.ttl / 3.0

    def _first_renewal(self) -> float:
        """A third of the lease left at the grant, when that is shorter than
        the ttl: a lock whose round waited long in line (a cold burst:
        seconds for connections) starts with less than its ttl, and a renewal
        a third of the ttl later came after its lease. (Later renewals keep a
        third of the ttl: a renewal leaves the ttl, unless MAX_HOLD capped it,
        and then the next tick reports the cap.)"""
        now = self._acquired_at
        return now + max(0.0, min(self.ttl, self._valid_until - now)) / 3.0

    def _mark_lost_plan(self, reason: str) -> HoldPlan:
        """The current hold is lost: ``lock_lost`` once, the state "lost".

        A release may run between any two of these lines and finish: one
        that a garbage collection runs does not wait for ``_io``
        (``Lock._release_later``), and in this thread a collection runs it
        right here. Both may report the loss; the claim decides which one
        does (``_claim``: one ``list.pop``, atomic). And the release's
        "unlocked" must not be overwritten by "lost"::

            here:    state "held": go on
            release: token "", state "unlocked", keys deleted, LockLost
            here:    state "lost": the released object stays "lost"

        The release empties the token before it writes the state; "lost"
        is written first here and the token read after it: a release seen
        has its "unlocked" written again here, one not seen yet writes its
        own after this one."""
        if self._state != _HELD:
            return
        if not _claim(self._loss_unreported):
            return  # a release running meanwhile reports it
        self._lost_reason = reason
        self._state = _LOST
        if not self._token:  # released meanwhile: it stays released
            self._state = _UNLOCKED
        yield from self._report_lost_plan(reason, self.manager.clock() - self._acquired_at)

    def _report_lost_plan(self, reason: str, held: float, fence: int | None = None,
                          hold: int | None = None) -> HoldPlan:
        """``lock_lost`` of the current hold, or of the hold ``fence``/``hold``
        (a release's: after its round, the object may hold again)."""
        fence = self.fence if fence is None else fence
        hold = self._hold_no if hold is None else hold
        logger.warning("lock %r (fence %d) lost after %.3f s: %s", self.name, fence, held,
                       reason)
        yield Report(events.lock_lost, dict(lock=self, name=self.name, fence=fence,
                                             hold=hold, held=held, reason=reason))

    def _key_life(self, now: float) -> float:
        """How long from ``now`` a node may still have this hold's key: a
        release that misses a node is sent again that long
        (engine/leftovers.py). Not the validity, which a renewal after an
        ``extend(60)`` brings back to the TTL while the nodes keep 60 s::

            t0     extend(60): the nodes keep the key until t0+60
            t0+1   a renewal (ttl 3): validity until t0+4, nodes unchanged
            t0+2   release; a node misses it: sent again for 3 s only
            t0+5   the key stays on that node until t0+60
        """
        return max(self.ttl, self._valid_until - now, self._keys_until - now)

    def _enter_hold(self, token: str, fence: int, valid_until: float) -> None:
        """The state of a lock just acquired; enrolled for the release at exit
        (:func:`release_held_locks`)."""
        self._token = token
        self.fence = fence
        self._valid_until = valid_until
        self._acquired_at = self.manager.clock()
        self._keys_until = self._acquired_at + self.ttl
        self._pid = getpid()
        self._state = _HELD
        self._hold_no += 1
        self._lost_reason = ""
        self._loss_unreported = [self._hold_no]
        held.enrol(self)
        mgr = self.manager
        if mgr._closing and mgr.closed_under_grant():  # a retired manager closed meanwhile
            self._forget_hold(released=True)
            raise QuorumUnavailable(
                f"lock {self.name!r} was granted after its manager was closed (retired by a "
                f"settings change): nobody would renew it, so it is not held; it is taken "
                f"back where the nodes can still be reached, else its keys expire with the "
                f"lease. Take the lock from django_redlock.get_manager() again",
                lock_name=self.name, needed=self.manager.quorum)

    def __getstate__(self) -> Any:
        raise TypeError("lock objects cannot be pickled: a lock belongs to one process")

