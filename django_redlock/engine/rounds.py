"""What each Redlock round asks the nodes, and what their answers mean.

(Why one module of 1,400 lines: every round of every lock shares the same
vocabulary, the Ask exchange, the settle rules, the tallies and the hand-over
node; split, each part would import all the others.)

Sans-I/O: these functions build the requests and interpret the replies; the
sync manager and the asyncio flavour only carry them to the nodes and back, so
the two flavours cannot drift apart on the rules:

* acquire: granted only with ``N // 2 + 1`` yes answers *and* validity
  ``ttl - elapsed - drift`` > 0; otherwise the caller releases wherever the key
  may be ours (``maybe_ours``), then either the lock is busy (a quorum answered)
  or :class:`QuorumUnavailable` is raised (fewer than a quorum answered);
* extend: the same counting; "lost" when more than ``N - quorum`` nodes no
  longer have our key (the quorum can no longer be ours);
* release: "lost" on the same condition, so a release notices a lock that was
  taken before the renewal thread did;
* with ``REPLICA_ACKS`` (``mgr.replica_acks``), acquire and extend requests
  carry ``WAIT`` behind them (:func:`with_acks`), and a node's grant counts
  only when its replicas confirmed it (:func:`confirmed`); releases do not.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterable, NamedTuple, Protocol, Sequence, TypeVar

from ..core import quorum as q
from ..exceptions import LockKindConflict, QuorumUnavailable
from ..transport.finalizers import get_logger
from ..transport.resp import (
    ACQUIRE,
    EXTEND,
    EXTEND_MANY,
    RELEASE,
    RW_ACQUIRE,
    RW_EXTEND,
    RW_RELEASE,
    Call,
    Chain,
    ChainReply,
    Command,
    Script,
)
from ..transport.sync import NOT_AWAITED, NodeError, Settle

logger = get_logger("django_redlock.manager")

T = TypeVar("T")

#: How long a fencing counter outlives the clock passing it (ms). See core/keys.py.
FENCE_GRACE_MS = 3_600_000
_FENCE_GRACE_B = b"%d" % FENCE_GRACE_MS


@dataclass
class AcquireResult:
    acquired: bool
    fence: int = 0
    valid_until: float = 0.0
    holder_ttl: float | None = None
    errors: dict[str, str] = field(default_factory=dict)
    #: Nodes where a won round may have put the waiter in line (they answered
    #: busy, or were not waited for): it leaves the line there.
    queued_at: list[bool] | None = None
    #: Refused by the gate node alone (the other nodes were not asked).
    at_gate: bool = False
    #: A refused waiter's round: when it started (``mgr.clock()``) and the
    #: node's clock (ms) when it queued the waiter; a lock that node's release
    #: hands over later is timed from these (:func:`handed_over`). 0: unknown.
    asked_at: float = 0.0
    queued_ms: int = 0
    #: A refused round that found something no lock wrote at the key, or a
    #: key with no expiry: what is in the way, for the caller's error.
    obstacle: str = ""
    #: A won round: how many nodes had granted it when the round was decided
    #: (0: not counted, e.g. a lock handed over by a release).
    granted: int = 0
    #: A guarded attempt (:class:`Guard`) refused by the guard: node name to
    #: ``(code, detail)`` (5: another permit count, recorded as ``detail``; 6:
    #: someone is in the semaphore's line).
    guard: dict[str, tuple[int, Any]] = field(default_factory=dict)


@dataclass
class AcquireTally:
    """The replies of one acquire round, counted."""

    ok: int
    fence: int
    #: The lowest clock (ms) among the granting nodes, as their fences tell
    #: it: a node's fence, less how far it said its fence is ahead of its
    #: clock (fence_issue.lua's ``granted``, which says so from a quarter of
    #: the lease on). Far below ``fence`` means one node's clock runs ahead
    #: (see :func:`fences_disagree`).
    clock_min: int
    busy_ttls: list[float]
    errors: dict[str, str]
    maybe_ours: list[bool]
    #: busy or not waited for: a waiter's entry may have been queued there
    queued_at: list[bool] = field(default_factory=list)
    #: The hand-over node's clock (ms) when it queued a waiter (0: it did not).
    queued_ms: int = 0
    #: Busy nodes whose key has no expiry (a raw SET, a PERSIST): no lock's.
    no_expiry: int = 0
    #: Busy nodes whose key holds a value no lock wrote (acquire.lua's flag).
    foreign: dict[str, int] = field(default_factory=dict)
    #: Nodes that answered with an error reply (READONLY, OOM...): they are
    #: up, but cannot take part; counted apart from the silent ones.
    error_replies: int = 0
    #: Nodes that said to ask again in a moment (a Cluster's ``TRYAGAIN``: the
    #: lock's slot is being migrated; :func:`retry_later`): they ran nothing,
    #: and count as busy, not as an error (the move ends, the lock is free).
    moving: int = 0
    #: Granting nodes where the grant was a lock a release had handed to us
    #: (acquire.lua's third element): a lost round hands it on from there.
    handed: list[bool] = field(default_factory=list)
    #: Nodes whose guard refused the attempt (:class:`Guard`): name to (code, detail).
    guard: dict[str, tuple[int, Any]] = field(default_factory=dict)
    #: The hand-over node said someone else goes first: the lock was just
    #: handed to the first in line (:data:`HANDED_FIRST`), or this waiter
    #: stands behind another there (:data:`BEHIND_IN_LINE`). This round is
    #: lost even with a quorum of grants.
    handed_first: bool = False

    @property
    def answered(self) -> int:
        return self.ok + len(self.busy_ttls) + self.no_expiry + self.moving


@dataclass
class ReleaseResult:
    released: int
    not_ours: int
    #: A majority no longer had this holder's key: it had expired or been taken
    #: before the release, whatever the holder's clock said.
    lost: bool
    #: How many nodes woke a queued waiter (named it in their release notice)
    #: or handed it the lock.
    woken: int = 0


@dataclass(frozen=True)
class ExtendResult:
    extended: bool
    #: Extended: the new end of the lease. Not extended: where some node did
    #: apply the new lease, the latest the lease can now be trusted to last
    #: (:func:`tally_extend`); 0.0 when no node applied it.
    valid_until: float = 0.0
    lost: bool = False
    reason: str = ""


def quorum_error(what: str, n_nodes: int, answered: int, errors: dict[str, str],
                 lock_name: str | None, error_replies: int = 0,
                 note: str = "") -> QuorumUnavailable:
    """``error_replies``: nodes that answered, but with an error (READONLY, OOM...):
    said apart, since such a node is up and needs a different fix than a dead one.
    ``note``: said once after the nodes' reasons."""
    needed = q.quorum(n_nodes)
    detail = "; ".join(f"{node}: {why}" for node, why in errors.items())
    also = f", {error_replies} more answered with an error" if error_replies else ""
    return QuorumUnavailable(
        f"{what}: {answered} of {n_nodes} nodes answered, {needed} needed{also}"
        + (f" ({detail})" if detail else "") + (f"; {note}" if note else ""),
        lock_name=lock_name, answered=answered, needed=needed, errors=errors)


# -- replica acknowledgement (REDLOCK["REPLICA_ACKS"]) ------------------------------
#: The share of a node's timeout that ``WAIT`` may block: the rest is for the
#: script and the round trip, so that the reply of a node whose replicas do
#: not acknowledge comes back in time. Late, it would cost the node its
#: connection and a back-off (the transport drops a connection whose reply is
#: overdue), where it only has to cost this round that node's grant.
WAIT_SHARE = 0.5

#: How the reason of a :class:`ReplicasShort` begins: the acquire loop tells
#: it apart from a node that was merely late (engine.protocol._quorum_alive).
UNCONFIRMED = "not confirmed by its replicas: "


class ReplicasShort(NodeError):
    """A node granted (or extended) the lock, but ``WAIT`` did not confirm that
    ``REPLICA_ACKS`` replicas have it within its share of the node timeout.

    It counts as that node not answering, like a timeout: a grant that only
    the master has is the one a failover loses (the replica promoted without
    it grants the lock to the next client). ``sent`` is True: the key is
    there, so a lost attempt's clean-up releases it like any other.
    """

    def __init__(self, node: str, reason: str) -> None:
        super().__init__(node, reason, sent=True)


def wait_ms(node_timeout: float) -> int:
    """``WAIT``'s timeout for a node (ms): never 0, which would block for ever."""
    return max(1, int(node_timeout * 1000 * WAIT_SHARE))


@functools.lru_cache(maxsize=64)
def wait_command(replicas: int, timeout_ms: int) -> Command:
    return Command(b"WAIT", replicas, timeout_ms)


def with_acks(requests: list[Any], nodes: Sequence[Any], replicas: int) -> list[Any]:
    """Each request with ``WAIT replicas <ms>`` pipelined behind it on its
    connection (:class:`~..transport.resp.Chain`): ``WAIT`` confirms the
    writes of the connection it runs on, and cannot run inside a script."""
    return [None if r is None else Chain(r, wait_command(replicas, wait_ms(nodes[i].timeout)))
            for i, r in enumerate(requests)]


def confirmed(reply: Any, replicas: int, node: Any, wrote: Callable[[Any], bool]) -> Any:
    """One node's reply to a chained request, as the rounds count it: the
    script's reply when it wrote nothing that needs confirming (busy, not
    ours, an error) or when ``WAIT`` confirmed enough replicas; else
    :class:`ReplicasShort`. Any other result (a :class:`NodeError`,
    ``NOT_AWAITED``) is returned as it is."""
    if type(reply) is not ChainReply:
        return reply
    first, acks = reply
    if not wrote(first):
        return first
    if isinstance(acks, int) and not isinstance(acks, bool) and acks >= replicas:
        return first
    if isinstance(acks, int):
        why = (f"only {acks} of {replicas} replica(s) acknowledged the write within "
               f"{wait_ms(node.timeout)} ms (REPLICA_ACKS)")
    else:
        why = f"WAIT {error_reply_reason(acks)}"
    return ReplicasShort(node.name, UNCONFIRMED + why)


def confirm_all(replies: list[Any], nodes: Sequence[Any], replicas: int,
                wrote: Callable[[Any], bool]) -> list[Any]:
    return [confirmed(r, replicas, nodes[i], wrote) for i, r in enumerate(replies)]


def _extended(reply: Any) -> bool:
    return reply == 1 and not isinstance(reply, bool)


def _confirm_batch(reply: Any, replicas: int, node: Any) -> Any:
    """:func:`confirmed` for a batched extension's reply (one answer per lock):
    when the replicas did not confirm, each lock the node extended gets the
    :class:`ReplicasShort`, and the others keep their answer (0: not ours)."""
    if type(reply) is not ChainReply or not isinstance(reply.first, list):
        return confirmed(reply, replicas, node, _extended)
    short = confirmed(ChainReply(1, reply.then), replicas, node, _extended)
    if short == 1:
        return reply.first
    return [short if _extended(r) else r for r in reply.first]


# -- acquire -------------------------------------------------------------------
#: How long a waiter queue outlives the lock (ms). Waiters refresh it with each
#: attempt; the grace only bounds how long entries of dead waiters survive.
WAITERS_GRACE_MS = 30_000
_WAITERS_GRACE_B = b"%d" % WAITERS_GRACE_MS


#: Token prefixes of a read-write lock's holders (``ReadLock``, ``WriteLock``):
#: the token says which scripts serve the hold, on every node and in every
#: round (acquire, release, renewal, the batch), so no round needs to be told.
#: A plain lock's token (url-safe base64) never has a '.' second.
READ_PREFIX = "r."
WRITE_PREFIX = "w."


def _rw(token: str) -> bool:
    return token[1:2] == "."


def _acquire_script(token: str) -> Script:
    return RW_ACQUIRE if _rw(token) else ACQUIRE


def _release_script(token: str) -> Script:
    return RW_RELEASE if _rw(token) else RELEASE


def _extend_script(token: str) -> Script:
    return RW_EXTEND if _rw(token) else EXTEND


def attempt_owner(owner: str, attempt: int) -> str:
    """``owner`` (compact JSON, :func:`~..core.owner.owner_json`) with the
    attempt's number as its last field, ``"n":<attempt>``.

    Every attempt of one ``acquire()`` uses the same holder token, and a
    request of an earlier attempt may run on a node after a later one's (its
    connection was dropped after a timeout, but the node still runs what it
    had received, and it may read that socket after a newer one). The scripts
    compare this number (``lua/attempt.lua``), so that the late clean-up of a
    lost attempt never deletes the next attempt's grant::

        attempt 1   SET k T   node X slow: no reply in time, connection dropped
        clean-up    DEL k if T (attempt 1)   sent on another connection
        attempt 2   SET k T   on a third connection: granted, the lock is held
        node X      runs the clean-up last: without the number it deleted the
                    grant, and a second client could take the lock (seen once
                    in CI, under a burst on a loaded machine)
    """
    return f'{owner[:-1]},"n":{attempt}}}'


class Guard(NamedTuple):
    """What every try of a semaphore's permit adds to the permit's acquire
    script (acquire.lua, KEYS[4..6] and ARGV[9..11]): its count key, its line's
    lock and waiter queue keys; its permits, the count record's lease (ms) and
    whether to step aside while anyone is in line (b"1") or not (b"0")."""

    keys: tuple[bytes, bytes, bytes]
    args: tuple[bytes, int, bytes]


#: Guard refusals (acquire.lua): another permit count is recorded; someone is in line.
GUARD_COUNT, GUARD_LINE = 5, 6
#: Beside a refused round's guard refusals (:func:`refused`): a node that gave
#: no verdict (silent, or an error reply). A semaphore counts the nodes that
#: agreed on its count; a node it did not hear agreed to nothing.
GUARD_UNHEARD = 0


def guard_stops(guard: dict[str, tuple[int, Any]]) -> bool:
    """Whether a round's guard refusals lose it even with a quorum of grants:
    anyone in line on any node does (arrival order), a count recorded
    otherwise on a minority does not. The grants are the nodes whose guard
    passed, so a quorum of grants is a quorum that agreed on the count, and
    two counts cannot both have one (two majorities share a node, which
    holds one record). Losing the round on any node's other count let one
    stray caller (a wrong count that reached a node restarted empty first)
    refuse every right one for the record's hour."""
    return any(code == GUARD_LINE for code, _ in guard.values())
#: acquire.lua's busy flag: the key is a lock a release handed to the first in
#: line, who has it to itself for a moment (release.lua's ``first_until``).
HANDED_FIRST = 7
#: acquire.lua's busy flag on the hand-over node: the asking waiter stands
#: behind another in the lock's line there.
BEHIND_IN_LINE = 8


def acquire_call(key: bytes, fkey: bytes, wkey: bytes, token: str, ttl_ms: int, owner: str,
                 fencing: bool, waiter: bytes = b"", woken: bool = False,
                 guard: Guard | None = None, listeners: bool = True) -> Call:
    """One node's acquire script call.

    ``waiter`` is the waiter's queue entry (``Subscription.entry``), empty for a
    first attempt, which stays out of the queue. A waiter joins the queue at the
    back; one that was woken by name (``woken``) and still lost, to a newcomer
    that got there first, goes back to the front. ``guard``: checks the script
    makes first (a semaphore's permit, :class:`Guard`). ``listeners``: for a
    read-write lock, whether the node can tell that a queued writer's process
    still listens on its inbox (``PUBSUB NUMSUB``; not on a Cluster or a
    Sentinel node, whose notices may reach a listener on another server):
    rw_acquire.lua then drops a dead writer's entry instead of holding every
    reader back behind it.
    """
    mode = b"0" if not waiter else b"2" if woken else b"1"
    args: tuple[Any, ...] = (token, ttl_ms, owner, b"1" if fencing else b"0", _FENCE_GRACE_B,
                             mode, _WAITERS_GRACE_B, waiter)
    if _rw(token):
        args += (b"1" if listeners else b"0",)
    if guard is not None:
        return Call(_acquire_script(token), (key, fkey, wkey, *guard.keys), args + guard.args)
    return Call(_acquire_script(token), (key, fkey, wkey), args)


def granted_by(reply: Any) -> bool:
    """Whether one node's acquire reply granted the lock."""
    return isinstance(reply, list) and len(reply) >= 2 and reply[0] == 1


def _busy_reply(reply: Any) -> bool:
    return isinstance(reply, list) and len(reply) >= 2 and reply[0] == 0


@functools.lru_cache(maxsize=64)
def acquire_settle(need: int, replicas: int = 0) -> Settle:
    """An acquire round is decided by ``need`` grants, or by so many busy answers
    that ``need`` grants are out of reach. Replies not waited for count as
    possibly ours (:func:`tally_acquire`), so a lost round cleans them up too.
    With ``replicas`` (``REPLICA_ACKS``), a grant is one that ``WAIT`` confirmed
    (:func:`confirmed`)."""
    if not replicas:
        return Settle(need, granted_by, _busy_reply)

    def yes(reply: Any) -> bool:
        return (type(reply) is ChainReply and granted_by(reply.first)
                and isinstance(reply.then, int) and reply.then >= replicas)

    def no(reply: Any) -> bool:
        return _busy_reply(reply.first if type(reply) is ChainReply else reply)

    return Settle(need, yes, no)


def _count_refused(reply: Any) -> bool:
    """Whether one node's acquire reply is a guard's count refusal (``GUARD_COUNT``)."""
    first = reply.first if type(reply) is ChainReply else reply
    return isinstance(first, list) and len(first) > 3 and first[3] == GUARD_COUNT


@functools.lru_cache(maxsize=64)
def guarded_settle(need: int, replicas: int = 0) -> Settle:
    """When a semaphore's try of a permit that does not step aside (a
    :class:`Guard` with ``b"0"``: a ``timeout=0`` try, the head's tries) is
    decided: ``need`` grants (each passed the count check on its node, so a
    quorum of grants is a quorum that agrees on the count: granted); or so
    many *plain* busy answers that ``need`` grants are out of reach. A plain
    busy answer also passed the count check, and a settled round has heard
    at least ``need`` nodes, so these are a quorum that agrees on the count:
    whatever the nodes not waited for say, the count cannot lose
    (``PermitsMismatch`` needs more than ``N - quorum`` count refusals), and
    the try is simply refused. A count refusal decides neither: a round that
    meets one hears the others out, so that ``_check_count`` (semaphore.py)
    counts every verdict it can get.

    Heard out whatever the answers (no settle), a try waited for a paused
    node, its node timeout, even when two nodes of three had granted with
    the right count: a ``timeout=0`` acquire of a 5-permit semaphore took
    one node timeout per busy permit it tried (1.5 s for a 0.5 s node
    timeout) until that node's back-off began. The replies not waited for
    are read later and dropped, and a lost round's clean-up goes to those
    nodes too (``maybe_ours``), as for a plain lock's round."""
    settle = acquire_settle(need, replicas)

    def plain_busy(reply: Any) -> bool:
        return settle.no(reply) and not _count_refused(reply)

    return Settle(need, settle.yes, plain_busy)


def tally_acquire(replies: Sequence[Any], node_names: "Sequence[str] | _NodeNames",
                  clock_node: int = 0) -> AcquireTally:
    """Count one acquire round's replies. ``clock_node``: the node whose clock
    a refused waiter keeps (:func:`hand_over_node`)."""
    n = len(replies)
    fence = clock_min = ok = 0
    for reply in replies:
        # The usual round: every node granted with ``[1, fence]`` (nothing
        # handed over, nobody queued); counted here in one pass.
        if type(reply) is not list or len(reply) != 2 or reply[0] != 1:
            break
        got = int(reply[1])
        clock_min = got if ok == 0 else min(clock_min, got)
        fence = max(fence, got)
        ok += 1
    else:
        return AcquireTally(ok=n, fence=fence, clock_min=clock_min, busy_ttls=[], errors={},
                            maybe_ours=[True] * n, queued_at=[False] * n)
    tally = AcquireTally(ok=0, fence=0, clock_min=0, busy_ttls=[], errors={},
                         maybe_ours=[False] * len(replies), queued_at=[False] * len(replies))
    for i, reply in enumerate(replies):
        if reply is NOT_AWAITED:
            tally.maybe_ours[i] = True  # sent; its reply is read later and dropped
            tally.queued_at[i] = True
        elif isinstance(reply, list) and len(reply) >= 2:
            if reply[0] == 1:
                fence = int(reply[1])
                clock = fence - int(reply[3]) if len(reply) > 3 else fence
                tally.clock_min = clock if tally.ok == 0 else min(tally.clock_min, clock)
                tally.fence = max(tally.fence, fence)
                tally.ok += 1
                tally.maybe_ours[i] = True
                if len(reply) > 2 and reply[2] == 1:
                    if not tally.handed:
                        tally.handed = [False] * len(replies)
                    tally.handed[i] = True
            else:
                pttl = int(reply[1])
                if pttl < 0:
                    # No expiry: not a lock's key. Counting it as "0 ms left"
                    # made waiters retry every millisecond, forever.
                    tally.no_expiry += 1
                else:
                    tally.busy_ttls.append(pttl / 1000.0)
                tally.queued_at[i] = True
                if len(reply) > 3 and reply[3] in (HANDED_FIRST, BEHIND_IN_LINE):
                    tally.handed_first = True
                elif len(reply) > 3 and reply[3] in (GUARD_COUNT, GUARD_LINE):
                    tally.guard[node_names[i]] = (int(reply[3]),
                                                  reply[4] if len(reply) > 4 else None)
                elif len(reply) > 3 and reply[3]:
                    tally.foreign[node_names[i]] = int(reply[3])
                if i == clock_node and len(reply) > 2:  # it queued a waiter: its clock then
                    tally.queued_ms = int(reply[2])
        elif isinstance(reply, NodeError):
            tally.errors[reply.node] = reply.reason
            tally.maybe_ours[i] = reply.sent
        elif retry_later(reply):
            tally.moving += 1  # ran nothing (not ours, not in line): busy for this round
        elif isinstance(reply, Exception):
            # The node is up and said no: READONLY (a replica), OOM (maxmemory
            # with noeviction), a script error... say what it said.
            tally.errors[node_names[i]] = error_reply_reason(reply)
            tally.error_replies += 1
        else:
            tally.errors[node_names[i]] = f"unexpected reply: {reply!r}"[:160]
    return tally


#: What an error reply from a node means for a lock, by its first word.
_ERROR_MEANINGS = {
    "READONLY": "it is a read-only replica; Redlock nodes must be masters",
    "OOM": "it is out of memory (maxmemory with noeviction)",
    "NOPERM": "the connection's ACL user may not run the lock's scripts or keys",
    "NOAUTH": "it needs a password",
    "MASTERDOWN": "it is a replica that lost its master",
    "LOADING": "it is still loading its data set",
    "BUSY": "a script is running too long on it",
    "WRONGTYPE": "a key of this lock holds a value of another type, which other code wrote",
    "TRYAGAIN": "its Cluster slot is being migrated",
}


#: redis-py turns these error codes into their own exception classes and drops
#: the code from the text (``OOM command not allowed...`` becomes
#: ``OutOfMemoryError('command not allowed...')``); redis-py 5 keeps no
#: ``status_code``, so the class says which code it was.
_CODE_OF_CLASS = {
    "ReadOnlyError": "READONLY",
    "OutOfMemoryError": "OOM",
    "NoPermissionError": "NOPERM",
    "BusyLoadingError": "LOADING",
    "MasterDownError": "MASTERDOWN",
    "TryAgainError": "TRYAGAIN",
}


def retry_later(reply: Any) -> bool:
    """Whether ``reply`` is a Cluster's ``TRYAGAIN``, still there after the
    transport followed its redirections (``transport.nodekinds``): the
    request's slot is being migrated and some of its keys are on neither
    side yet, so nothing ran. It lasts as long as the migration (seconds),
    and ends with it.

    An acquire round counts it as busy (:func:`tally_acquire`), as the node
    would answer for a lock it cannot grant yet. Counted as an error reply,
    a blocking ``acquire(timeout=5)`` of a *free* lock whose slot was being
    moved raised ``QuorumUnavailable`` at once on a Cluster node alone
    (its only vote an error), and a try raised instead of returning False::

        t=0.0  slot S MIGRATING: the lock's keys exist nowhere yet
        t=0.0  acquire: the source answers ASK, the target (behind ASKING)
               TRYAGAIN, three times 5 ms apart: the call ended there
        t=1.0  the migration ends: the lock is free on the new owner
        now    refused (busy), the acquire waits and retries: granted at
               t=1.0 and a bit; a try returns False"""
    if not isinstance(reply, Exception):
        return False
    code = getattr(reply, "status_code", None) or _CODE_OF_CLASS.get(type(reply).__name__)
    return code == "TRYAGAIN" or str(reply).startswith("TRYAGAIN")


def error_reply_reason(reply: BaseException) -> str:
    """A node's error reply, said as what it means: the node answered, with an error.

    The reply as the node sent it, error code first (put back where the
    client library took it off), and what that code means for a lock."""
    text = str(reply).strip()
    code = getattr(reply, "status_code", None) or _CODE_OF_CLASS.get(type(reply).__name__)
    if isinstance(code, str) and code and not text.startswith(code):
        text = f"{code} {text}"
    word = text.split(" ", 1)[0]
    meaning = _ERROR_MEANINGS.get(word)
    text = text if len(text) <= 120 else text[:117] + "..."
    return f"answered with an error ({meaning}): {text}" if meaning \
        else f"answered with an error: {text}"


_FOREIGN_KINDS = {1: "a value of another type (not a string; or a hash no read-write lock "
                     "wrote)",
                  2: "a string not written by a lock",
                  3: "a read-write lock (read_lock / write_lock)",
                  4: "a plain lock (lock)"}

#: The foreign codes that are another kind of lock (rw_acquire.lua, acquire.lua).
_OTHER_KIND = (3, 4)


def kind_conflict(tally: AcquireTally, lock_name: str) -> LockKindConflict | None:
    """The error for a name used as two kinds of lock, when a node said so."""
    kinds = {kind for kind in tally.foreign.values() if kind in _OTHER_KIND}
    return _conflict(min(kinds), lock_name) if kinds else None


def _conflict(kind: int, lock_name: str) -> LockKindConflict:
    return LockKindConflict(
        f"lock name {lock_name!r} is held as {_FOREIGN_KINDS[kind]} now; one name cannot be "
        f"two kinds of lock at once: give each kind its own name", lock_name=lock_name)


def obstacle(tally: AcquireTally, key: bytes) -> str:
    """What holds the key, when it is not a lock: for the waiter's error and log.

    A value in a lock's format with no expiry is a lock someone made
    persistent (``PERSIST`` while it was held): named as such, since "something
    other than a lock" would send the operator looking for a stranger."""
    if tally.no_expiry and not tally.foreign:
        return (f"key {key.decode(errors='replace')!r} holds a lock with no expiry on "
                f"{tally.no_expiry} node(s) (made persistent by hand, e.g. PERSIST); it will "
                f"not expire by itself: once its holder is gone, 'manage.py locks release "
                f"NAME --force' removes it")
    parts = []
    for node, kind in tally.foreign.items():
        parts.append(f"{node} has {_FOREIGN_KINDS.get(kind, 'a foreign value')}")
    if tally.no_expiry:
        parts.append(f"{tally.no_expiry} node(s) have it with no expiry")
    if not parts:
        return ""
    return (f"key {key.decode(errors='replace')!r} is held by something other than a lock "
            f"({'; '.join(parts)}); it will not expire by itself: remove it (manage.py locks "
            f"show names it)")


def gate_node(key: bytes, nodes: Sequence[Any], now: float) -> int | None:
    """The node a contended retry asks first, or None to ask all at once.

    When several clients retry together (every waiter woken by one release), all
    asking all nodes in parallel splits the votes: each wins some nodes, nobody a
    quorum, and everyone cleans up and retries. Asking one node first, the same
    one for a given lock name (spread over the nodes by name), lets the clients
    queue on it: only the one it grants goes on to ask the others. It costs a
    retry one extra round trip, never the first attempt. No gate when that node
    failed recently.

    The gate is skipped too (the caller's ``ask_all``) on a retry that follows
    a refusal *at the gate* with no release notice since: the gate's copy may
    be stale (a release that reached every node but that one, which keeps it
    until its lease ends), while a majority is free. Asking every node on every
    other such retry bounds that stall to about two retry delays.
    """
    if len(nodes) < 2:
        return None
    index = hand_over_node(key, len(nodes))
    return None if nodes[index].backing_off(now) else index


def hand_over_node(key: bytes, n_nodes: int) -> int:
    """The one node whose release may hand the lock to a waiter: the gate node
    (:func:`gate_node`), or the only node. Only there does a waiter queue in the
    hand-over form (:func:`waiter_entries`): if every node handed the lock to
    whoever stands first *there*, lines that differ would split the vote."""
    return zlib.crc32(key) % n_nodes


def waiter_entries(key: bytes, n_nodes: int, entry: bytes, hand_over: bytes) -> list[bytes]:
    """A waiter's queue entry per node: ``hand_over`` (the entry in the
    hand-over form) at :func:`hand_over_node`, ``entry`` elsewhere. Each node
    always sees the same form of one waiter's entry (``LPOS``/``LREM`` match it)."""
    h = hand_over_node(key, n_nodes)
    return [hand_over if i == h else entry for i in range(n_nodes)]


def busy_at_gate(reply: Any, start: float, node_name: str = "", key: bytes = b"") -> AcquireResult | None:
    """The refused result when the gate node says the lock is held, else None."""
    if isinstance(reply, list) and len(reply) >= 2 and reply[0] == 0:
        pttl = int(reply[1])
        tally = AcquireTally(ok=0, fence=0, clock_min=0, busy_ttls=[], errors={}, maybe_ours=[],
                             no_expiry=int(pttl < 0))
        if len(reply) > 3 and reply[3] and reply[3] not in (HANDED_FIRST, BEHIND_IN_LINE):
            tally.foreign[node_name] = int(reply[3])
        return AcquireResult(False, holder_ttl=pttl / 1000.0 if pttl >= 0 else None,
                             at_gate=True, asked_at=start,
                             queued_ms=int(reply[2]) if len(reply) > 2 else 0,
                             obstacle=obstacle(tally, key))
    return None


def granted(tally: AcquireTally, *, n_nodes: int, start: float, elapsed: float, ttl: float,
            drift_factor: float) -> AcquireResult | None:
    """The acquired result when the round won the lock, else None.

    ``valid`` is what is left of the lease *now*, at the round's end: it
    started, at the latest, at the round's ``start`` (no node set its expiry
    before the request left), so the lease ends at ``start + ttl - drift``,
    i.e. ``now + valid``. Adding ``valid`` to ``start`` instead counted the
    round's time twice: harmless for a round of a millisecond, but a round
    that waited 8 s in line for connections (a cold burst, issue 25) got a
    10 s lock whose deadline had already passed, and its holder was told
    the lock was lost although every node still held it for 2 s."""
    valid = q.validity(ttl, elapsed, drift_factor)
    if tally.ok >= q.quorum(n_nodes) and valid > 0:
        # Where the waiter may still stand in line: every node whose grant it
        # does not have. Not only those that put it in line in this round: a
        # node that answered an error here (a timeout under load) may hold its
        # entry from an earlier round, and a release there would later hand
        # the lock to a waiter that is gone, blocking the line behind it for a
        # whole lease (tests/test_burst.py saw 30 s).
        leave = [queued or not ours for queued, ours in zip(tally.queued_at, tally.maybe_ours)]
        return AcquireResult(True, fence=tally.fence, valid_until=start + elapsed + valid,
                             queued_at=leave if any(leave) else None, granted=tally.ok)
    return None


#: Granting nodes whose fences differ by this share of the lease or more must
#: agree before the fence is handed out (see :func:`fences_disagree`).
FENCE_SPREAD_LIMIT = 0.25


def fences_disagree(tally: AcquireTally, ttl: float) -> bool:
    """Whether the maximum fence must be written back before it is used.

    Each node issues ``max(counter + 1, its clock in ms)``, and the holder takes
    the maximum. When one granting node's clock runs far ahead, that maximum
    comes from it alone; if the holder then pauses before its first renewal (the
    usual write-back) and the next holder's quorum lacks that node, the next
    fence would be *lower*: a stale holder's writes would win. The chaos run
    showed it with a node 5 s ahead and a 1 s lease. So when the maximum is
    ahead of a granting node's clock by a quarter of the lease or more, the
    holder first writes the maximum back to a quorum (one extend round); only
    then is the lock acquired. With clocks within that bound (NTP), this costs
    nothing.

    The clocks, not the fences: after one write-back, the other nodes' counters
    sit near the fast node's clock, and they issue ``counter + 1`` close to its
    next fence. Compared by fences, nothing was written back again, and a
    holder that paused past its lease left the next one a lower fence (a
    review drove it with a node 10 s ahead, a 3 s lease and a busy lock)::

        P   granted by 2, 3, 4 (4 is 10 s ahead): fence V, written back
        A   150 ms later, by 2, 3 (V + 1) and 4 (V + 150): fence V + 150,
            fences 149 ms apart: not written back; A pauses
        B   after A's lease, by 0, 1, 2, 3 (their clocks: V - 10 s): V + 2
    """
    return tally.ok > 1 and tally.fence - tally.clock_min >= ttl * 1000 * FENCE_SPREAD_LIMIT


def refused(tally: AcquireTally, *, n_nodes: int, start: float, elapsed: float, ttl: float,
            lock_name: str, key: bytes = b"", beside: Sequence[bytes] = ()) -> AcquireResult:
    """After a lost round (and its clean-up release): busy, or QuorumUnavailable.

    ``beside``: the keys the round's script keeps beside the lock key (its
    fencing counter and waiter queue). A foreign value at the lock key itself
    is busy (acquire.lua reads it under ``pcall``), so a ``WRONGTYPE`` reply
    comes from one of these, and the error names them."""
    if tally.answered < q.quorum(n_nodes):
        note = ""
        if beside and any("WRONGTYPE" in why for why in tally.errors.values()):
            note = ("the value of another type is at " + " or ".join(
                repr(k.decode(errors="backslashreplace")) for k in beside)
                + " (a key no lock wrote: delete it once you know whose it is)")
        error = quorum_error(f"cannot acquire lock {lock_name!r}", n_nodes, tally.answered,
                             tally.errors, lock_name, tally.error_replies, note)
        error.round_seconds = elapsed  # the attempt's, not its clean-up's (engine.protocol)
        raise error
    if tally.ok >= q.quorum(n_nodes) and not guard_stops(tally.guard) and not tally.handed_first:
        logger.info("lock %r: quorum reached but the round took %.3f s of a %.3f s lease; "
                    "retrying", lock_name, elapsed, ttl)
    busy = sorted(tally.busy_ttls)
    holder_ttl = busy[len(busy) // 2] if busy else None  # None: wait the normal pace
    guard = tally.guard
    if guard:  # and the nodes that said nothing (GUARD_UNHEARD)
        guard = {**{name: (GUARD_UNHEARD, why) for name, why in tally.errors.items()}, **guard}
    return AcquireResult(False, holder_ttl=holder_ttl, errors=tally.errors, asked_at=start,
                         queued_ms=tally.queued_ms, obstacle=obstacle(tally, key),
                         guard=guard)


# -- a lock handed over by a release (the hand-over node) --------------------------
#: A lock handed over with less of its lease left than this share (as far as
#: the waiter can prove: :func:`core.quorum.handover_validity`) is taken with an
#: attempt instead, which finds the key already ours and renews the lease: a
#: waiter that waited long loses ``drift_factor`` of its wait from the bound.
HANDOVER_MIN_SHARE = 0.5


def hand_over_entry(ttl_ms: int, fencing: bool, owner: str, first_ms: int = 0) -> bytes:
    """What a waiter appends to its queue entry on the hand-over node
    (:func:`hand_over_node`) so that a release there hands it the lock
    outright (release.lua): the key is set for it and its notice carries the
    fence, so the woken waiter sends no acquire request to that node (one
    round trip less on every contended handoff: on one node, its whole
    acquire; on several, the gate's, before it asks the others).

    ``first_ms`` (several nodes): how long the waiter then has the lock to
    itself on that node while it asks the others (:data:`HANDED_FIRST`); it
    bounds how long a hand-over the waiter never completes (it died, or the
    release missed the other nodes' copy... ) holds everyone else back.
    """
    return b"%d|%s|%d|%s" % (ttl_ms, b"1" if fencing else b"0", first_ms,
                             owner.encode("utf-8"))


def first_ms(node_timeout: float, retry_delay: float) -> int:
    """How long a waiter handed a lock on the hand-over node has it to itself
    there (:func:`hand_over_entry`), in ms: long enough for its notice and its
    round to the other nodes (two node timeouts), and at least one retry
    delay. It is also the longest a hand-over that is never completed holds
    the others back (then their rounds win as before)."""
    return max(1, int(1000 * max(2 * node_timeout, retry_delay)))


def handed_over(notice: bytes, *, asked_at: float, queued_ms: int, now: float, ttl: float,
                drift_factor: float) -> AcquireResult | None:
    """The acquired result for a lock a release handed over, or None to make an
    attempt instead (which wins at once: the key is ours already).

    ``notice`` is ``<fence>|<node clock ms>|<key>`` from the release notice;
    ``asked_at``/``queued_ms`` from the waiter's last refused attempt
    (:class:`AcquireResult`). A hand-over that the node's clock places before
    that attempt is stale: that lease ran out unseen (the attempt found
    someone else's key), so it is not used. One in the same millisecond is
    not: a hand-over before the attempt would have made the attempt find the
    key ours, unless that lease had run out in between, which takes the
    whole lease (more than the millisecond: ``handed_over`` needs half of it).
    """
    fence_b, _, rest = notice.partition(b"|")
    clock_b = rest.partition(b"|")[0]  # then the key (for a process whose waiter is gone)
    try:
        fence, handed_ms = int(fence_b), int(clock_b)
    except ValueError:
        return None
    if queued_ms <= 0 or handed_ms < queued_ms:
        return None
    valid = q.handover_validity(ttl, now - asked_at, handed_ms - queued_ms, drift_factor)
    if valid < ttl * HANDOVER_MIN_SHARE:
        return None
    return AcquireResult(True, fence=fence, valid_until=now + valid)


# -- release -------------------------------------------------------------------
def leave_queue_command(wkey: bytes, waiter: bytes) -> Command:
    """Take a waiter that gives up out of the line, so no release wakes it in vain."""
    return Command(b"LREM", wkey, 0, waiter)


def release_requests(n_nodes: int, key: bytes, fkey: bytes, wkey: bytes, token: str,
                     fence: int, only: Sequence[bool] | None,
                     wake_at: int | None = None, notify: bytes = b"", *, attempt: int = 0,
                     handed: Sequence[bool] = ()) -> list[Call | None]:
    """Release on every node, or only where ``only`` says (the clean-up after a
    lost attempt, which wakes nobody: the lock was never held; except on node
    ``wake_at`` and the nodes ``handed`` says, whose lock a release had handed
    to us while others queued there: it goes on to the next in line).

    ``notify``: a channel each node publishes on once it deleted the key (a
    semaphore's free channel; a release only, not a clean-up).
    ``attempt``: the number of the lost attempt (:func:`attempt_owner`); its
    clean-up then deletes only what that attempt or an earlier one wrote, never
    a later attempt's grant that a node happened to run first (0: unnumbered,
    any value of the token is deleted)."""
    script = _release_script(token)
    if only is None:
        args: tuple[Any, ...] = (token, fence, _FENCE_GRACE_B, b"1")
        if notify:
            args += (b"", notify)
        call = Call(script, (key, fkey, wkey), args, last_of_token=True)
        return [call] * n_nodes
    plain: tuple[Any, ...] = (token, fence, _FENCE_GRACE_B, b"0")
    hand_on: tuple[Any, ...] = (token, fence, _FENCE_GRACE_B, b"1")
    if attempt:
        plain += (b"", b"", str(attempt).encode())
        hand_on += (b"", b"", str(-attempt).encode())
    call = Call(script, (key, fkey, wkey), plain)
    requests: list[Call | None] = [call if only[i] else None for i in range(n_nodes)]
    for i in range(n_nodes):
        if only[i] and (i == wake_at or (handed and handed[i])):
            requests[i] = Call(script, (key, fkey, wkey), hand_on)
    return requests


def orphan_hand_on_requests(n_nodes: int, node: int, key: bytes, fkey: bytes, wkey: bytes,
                            token: str) -> list[Call | None]:
    """Hand on, on ``node``, a lock a release handed to ``token``'s waiter that
    no longer waits: deleted (and given to the next in line) only while it is
    still that untaken hand-over (attempt number 0, attempt.lua); once the
    waiter took it over, it may count it in its hold, and it stays."""
    call = Call(_release_script(token), (key, fkey, wkey),
                (token, 0, _FENCE_GRACE_B, b"1", b"", b"", b"0"))
    return [call if i == node else None for i in range(n_nodes)]


def _never(reply: Any) -> bool:
    return False


#: Send and do not wait: every reply is read later by the next round on its
#: connection (for best-effort clean-ups nobody waits for).
NO_WAIT = Settle(0, _never, _never)


def _released_reply(reply: Any) -> bool:
    return isinstance(reply, int) and reply >= 1


def _not_ours_reply(reply: Any) -> bool:
    return isinstance(reply, int) and reply == 0


@functools.lru_cache(maxsize=256)
def release_settle(n_nodes: int, gate: int | None) -> Settle:
    """A release is done, for its caller, once a quorum deleted the key (the lock
    is free for the next holder) or so many did not have it that it was lost;
    the other nodes' deletions still happen, their replies are read later.

    The gate node's reply (:func:`gate_node`) gets a short grace: waiters queue
    there first, so it is the node that says whether the release woke one,
    which the releaser's step-back depends on.
    """
    return Settle(q.quorum(n_nodes), _released_reply, _not_ours_reply, gate)


def tally_release(replies: Sequence[Any], key: bytes,
                  node_names: "Sequence[str] | _NodeNames" = (),
                  beside: Sequence[bytes] = ()) -> ReleaseResult:
    """Count one release round's replies. A node that answered with an error
    reply (``WRONGTYPE`` from a foreign value at ``beside``, the lock's
    fencing counter or waiter queue; ``READONLY``...) did not confirm the
    release; it is said at WARNING with what it said, since it needs a fix
    on the node, where an unreachable one only needs time."""
    n = len(replies)
    released = not_ours = woken = 0
    for r in replies:
        if type(r) is not int:
            break  # an error or a reply not waited for: counted below
        if r >= 1:
            released += 1
            if r >= 2:
                woken += 1
        elif r == 0:
            not_ours += 1
    else:  # every node answered with a count (the usual release)
        return ReleaseResult(released=released, not_ours=not_ours,
                             lost=not_ours > n - q.quorum(n), woken=woken)
    failed = [r for r in replies if isinstance(r, NodeError)]
    if failed:
        logger.info("release of %r did not reach %d node(s): %s; it is sent again while its "
                    "lease lasts (a release and a clean-up are), else the key expires there "
                    "with its lease", key.decode(), len(failed), "; ".join(map(str, failed)))
    answered_errors = [(node_names[i] if i < len(node_names) else f"node {i}",
                        error_reply_reason(r))
                       for i, r in enumerate(replies)
                       if isinstance(r, Exception) and not isinstance(r, NodeError)]
    if answered_errors:
        where = ""
        if beside and any("WRONGTYPE" in why for _, why in answered_errors):
            where = ("; the value of another type is at " + " or ".join(
                repr(k.decode(errors="backslashreplace")) for k in beside))
        logger.warning("release of %r: %d node(s) did not confirm it (%s)%s", key.decode(),
                       len(answered_errors),
                       "; ".join(f"{node}: {why}" for node, why in answered_errors), where)
    counts = [r for r in replies if isinstance(r, int)]
    not_ours = sum(1 for r in counts if r == 0)
    return ReleaseResult(released=sum(1 for r in counts if r >= 1), not_ours=not_ours,
                         lost=not_ours > n - q.quorum(n),
                         woken=sum(1 for r in counts if r >= 2))


# -- extend --------------------------------------------------------------------
def extend_call(key: bytes, fkey: bytes, token: str, fence: int, ttl: float) -> Call:
    return Call(_extend_script(token), (key, fkey),
                (token, max(1, int(ttl * 1000)), fence, _FENCE_GRACE_B))


def tally_extend(replies: Sequence[Any], *, start: float, elapsed: float, ttl: float,
                 drift_factor: float) -> ExtendResult:
    """Count an extend round.

    A node that applied the new lease no longer keeps the old one: when the
    new lease is shorter than what was left, the holder's quorum may now end
    sooner than its old deadline, whether or not the round counts as an
    extension. So any applied round bounds the lease by ``start + ttl -
    drift`` (the round's end plus its validity; the caller keeps the earlier
    of that and its old deadline). Timeline of
    what this stops (``extend`` with a lease shorter than the round)::

        t0  A holds "x" until t10 by its clock; it extends with a 1 ms lease
        t0  every node applies PEXPIRE 1 ms: the key is gone at t0 + 1 ms
        t0  the round is "not extended" (no validity left); A keeps t10
        t1  B acquires "x": two owners until t10, A's owned() still True

    With the bound, A's lease ends at once and A's lock is reported lost.
    """
    n = len(replies)
    need = q.quorum(n)
    ok = replies.count(1)  # (an error object is never == 1 or 0)
    not_ours = replies.count(0)
    valid = q.validity(ttl, elapsed, drift_factor)
    if ok >= need and valid > 0:
        return ExtendResult(True, valid_until=start + elapsed + valid)
    # A node whose replicas did not confirm the new lease (ReplicasShort) does
    # not count, but its master applied it: it bounds the lease all the same.
    applied = ok or any(isinstance(r, ReplicasShort) for r in replies)
    bound = start + elapsed + valid if applied else 0.0
    if not_ours > n - need:
        return ExtendResult(False, valid_until=bound, lost=True, reason=(
            f"{not_ours} of {n} nodes no longer have this holder's key (it expired or was taken)"))
    if ok >= need:
        return ExtendResult(False, valid_until=bound, lost=True, reason=(
            f"the new lease of {ttl:g} s left no validity by the time {ok} of {n} nodes "
            f"applied it ({elapsed * 1000:.1f} ms)"))
    reason = f"{ok} of {n} nodes extended, {need} needed"
    errors = [str(r) for r in replies if isinstance(r, Exception)]
    if errors:
        reason += " (" + "; ".join(errors) + ")"
    return ExtendResult(False, valid_until=bound, reason=reason)


# -- locked() ------------------------------------------------------------------
def exists_command(key: bytes) -> Command:
    return Command(b"EXISTS", key)


def tally_holders(replies: Sequence[Any], key: bytes) -> int:
    """How many nodes have the key; QuorumUnavailable when too few answered."""
    answered = [r for r in replies if isinstance(r, int)]
    if len(answered) < q.quorum(len(replies)):
        errors = {r.node: r.reason for r in replies if isinstance(r, NodeError)}
        raise quorum_error(f"cannot tell whether {key.decode()!r} is locked", len(replies),
                           len(answered), errors, None)
    return sum(answered)


# -- whole rounds, as steps both flavours run -------------------------------------
class Ask(NamedTuple):
    """One exchange for a transport to run: node i is sent ``requests[i]``
    (None: not asked); the other fields are :meth:`SyncTransport.round`'s options.

    The asyncio transport reads every reply, so it uses ``skip_backoff`` only.
    (A named tuple: built twice per acquire + release, where a frozen
    dataclass measured a microsecond slower each.)
    """

    requests: list[Any]
    settle: Settle | None = None
    tag: Any = None
    final: bool = False
    skip_backoff: bool = True
    #: A node to send to after the others (a release's hand-over node, see
    #: :func:`release_steps`).
    last: int | None = None
    #: Seconds for which a request that failed on its node (no reply, or an
    #: error reply) is still worth sending: the driver hands it to the
    #: manager's late sender (engine/leftovers.py). 0: not sent again.
    redo: float = 0.0


#: A round as a generator: it yields the exchanges it needs, receives each
#: one's replies, and returns the outcome. The sync manager and the asyncio
#: flavour each drive it with their own transport (``LockManager._run``,
#: ``aio._run``), so the decisions between the exchanges are written once.
Steps = Generator[Ask, list[Any], T]


class _NodeNames:
    """The nodes' names, as the tallies index them (``names[i]``, ``len``):
    read only for a node that failed or refused, so not listed each round."""

    __slots__ = ("nodes",)

    def __init__(self, nodes: Sequence[Any]) -> None:
        self.nodes = nodes

    def __getitem__(self, i: int) -> str:
        name: str = self.nodes[i].name
        return name

    def __len__(self) -> int:
        return len(self.nodes)


class RoundContext(Protocol):
    """What the steps read from the lock manager (never its I/O)."""

    @property
    def nodes(self) -> Sequence[Any]: ...  # read-only: a manager's list[NodeClient] fits

    quorum: int
    drift_factor: float
    #: REDLOCK["REPLICA_ACKS"]: replicas that must confirm a grant or an
    #: extension on its node before it counts (0: none, nothing more is sent).
    replica_acks: int

    def clock(self) -> float: ...


def acquire_steps(mgr: RoundContext, key: bytes, fkey: bytes, wkey: bytes, token: str,
                  ttl_ms: int, owner: str, fencing: bool, ttl: float, *, lock_name: str,
                  waiter: bytes = b"", hand_over: bytes = b"", woken: bool = False,
                  ask_all: bool = False, again: bool = False,
                  handed: AcquireResult | None = None,
                  attempt: int = 0, guard: Guard | None = None) -> Steps[AcquireResult]:
    """One acquire attempt: the gate node first for a waiter, then a quorum; on a
    win with fences far apart, the write-back; on a loss, the clean-up.

    ``waiter``/``hand_over``: the waiter's queue entry, plain and in the
    hand-over form (:func:`waiter_entries`). ``handed``: the hand-over node's
    release handed us its lock (:func:`handed_over`): on one node that is the
    whole result; on several the gate is not asked again, and the lease
    counts from the handover when that is earlier. ``again``: the attempt
    after a round that met a late reply; the nodes in back-off are asked too.
    ``attempt``: this attempt's number within its ``acquire()`` call (1, 2...),
    written into the lock value (:func:`attempt_owner`) so that no late request
    of an earlier attempt undoes this one's grant (0: unnumbered).
    ``guard``: a semaphore's checks on every node (:class:`Guard`); a node's
    guard refusal grants nothing there, and one node with someone in line
    loses the round even with a quorum of grants (what was granted is
    released; :func:`guard_stops`).
    """
    nodes = mgr.nodes
    n = len(nodes)
    if handed is not None and n == 1:
        return handed
    if attempt:
        owner = attempt_owner(owner, attempt)
    call = acquire_call(key, fkey, wkey, token, ttl_ms, owner, fencing, waiter, woken,
                        guard=guard)
    h = hand_over_node(key, n)
    calls: list[Any] = [call] * n
    if hand_over and hand_over != waiter:
        calls[h] = acquire_call(key, fkey, wkey, token, ttl_ms, owner, fencing, hand_over, woken)
    if _rw(token):
        for i, node in enumerate(nodes):
            if not getattr(node, "hands_over", True):  # see acquire_call's listeners
                calls[i] = acquire_call(key, fkey, wkey, token, ttl_ms, owner, fencing,
                                        hand_over if i == h and hand_over else waiter, woken,
                                        listeners=False)
    acks = mgr.replica_acks
    if acks:
        calls = with_acks(calls, nodes, acks)
    start = mgr.clock()
    # A waiter (it queues) asks the gate node first; see gate_node.
    # A read-write lock's waiters ask every node: a writer must stand in line
    # on every node, or readers would pass it on the nodes it never asked.
    # ``ask_all`` (a retry after a refusal at the gate with no notice since):
    # the gate is still asked first, but only its "someone goes first" ends
    # the round there (HANDED_FIRST, BEHIND_IN_LINE); a plain "busy" may be a
    # copy a release never reached, so the other nodes are asked anyway.
    # Asked all at once instead, a waiter behind another took grants on the
    # nodes a release had just freed, lost the round on the gate's answer,
    # and gave them back: meanwhile the first in line found them busy and
    # lost its turn (tests/test_hand_over_first.py, the timer retry).
    gate = gate_node(key, nodes, start) if waiter and not _rw(token) else None
    if gate is not None:
        if handed is not None:
            first: Any = [1, handed.fence]  # the gate's release handed it to us
        else:
            first = (yield Ask([calls[i] if i == gate else None for i in range(n)],
                               tag=token, skip_backoff=not again))[gate]
            if acks:
                first = confirmed(first, acks, nodes[gate], granted_by)
            busy = busy_at_gate(first, start, nodes[gate].name, key)
            if busy is not None:
                if isinstance(first, list) and len(first) > 3 and first[3] in _OTHER_KIND:
                    raise _conflict(int(first[3]), lock_name)
                if not ask_all or (isinstance(first, list) and len(first) > 3
                                   and first[3] in (HANDED_FIRST, BEHIND_IN_LINE)):
                    return busy
        need = mgr.quorum - (1 if granted_by(first) else 0)
        # A woken waiter's place at the front is the gate's, where the release
        # popped it. Elsewhere it joins at the back: on a node whose release is
        # still on its way, the front would make that release wake this waiter
        # (served by then) instead of whoever stands first there.
        rest = acquire_call(key, fkey, wkey, token, ttl_ms, owner, fencing, waiter) \
            if woken else call
        others: list[Any] = [None if i == gate else rest for i in range(n)]
        if acks:
            others = with_acks(others, nodes, acks)
        replies = yield Ask(others, settle=acquire_settle(need, acks), tag=token,
                            skip_backoff=not again)
        if acks:
            replies = confirm_all(replies, nodes, acks, granted_by)
        replies[gate] = first
    else:
        handed = None  # the gate is not trusted now: its copy is asked like any
        # A guarded attempt that steps aside (a semaphore's first try of a
        # blocking acquire) hears every node out (within the node timeout):
        # one node's "someone in line" loses the round, and a round settled
        # on a quorum of grants left it unread about one run in three. One
        # that does not step aside (a try, the head's tries) settles once
        # its outcome is decided, count check included (guarded_settle). A
        # first attempt settles at once: a newcomer whose round ends before
        # the hand-over node answers may pass the line (barging); a waiter
        # in it asks the gate first.
        if n > 1 and guard is not None:
            settle = None if guard.args[2] == b"1" else guarded_settle(mgr.quorum, acks)
        else:
            settle = acquire_settle(mgr.quorum, acks)
        # (positional: requests, settle, tag, final, skip_backoff; built per attempt)
        replies = yield Ask(calls, settle, token, False, not again)
        if acks:
            replies = confirm_all(replies, nodes, acks, granted_by)
    elapsed = mgr.clock() - start
    tally = tally_acquire(replies, _NodeNames(nodes), clock_node=h)
    # The first in line goes first: a release handed it the lock on the
    # hand-over node and left the other nodes free for it to ask. A round
    # that took them meanwhile would win with a quorum and pass the line; the
    # hand-over node says so for a moment (HANDED_FIRST), and a round that
    # heard it is lost, its grants released. Only ever a refusal: never a
    # second holder. A waiter asks the gate first and stops there on it (or
    # on BEHIND_IN_LINE: the release to the gate is sent last, so the other
    # nodes may be free while the gate still has the holder's key); a
    # newcomer asks all at once and is stopped when its round read the gate:
    #
    #   release     hands the gate's key to W; the 2 other nodes are free
    #   S (new)     asks all 3: gate busy (HANDED_FIRST), 2 grants: lost
    #   W (notice)  asks the 2 others: granted, W holds the lock
    won = granted(tally, n_nodes=n, start=start, elapsed=elapsed, ttl=ttl,
                  drift_factor=mgr.drift_factor) \
        if not guard_stops(tally.guard) and not tally.handed_first else None
    if won is not None:
        if handed is not None and handed.valid_until < won.valid_until:
            won.valid_until = handed.valid_until  # that lease began before this round
        if not fences_disagree(tally, ttl):
            return won
        synced = yield from extend_steps(mgr, key, fkey, token, won.fence, ttl)
        if synced.extended:
            return won
        logger.info("lock %r: the fence could not be written back to a quorum; retrying",
                    lock_name)
    if any(tally.maybe_ours):
        # Release wherever the key may be ours, including nodes that went
        # silent after the request left: a leftover would block others. The
        # gate's lock, when it was handed to us, goes on to the next in line.
        yield from release_steps(mgr, key, fkey, wkey, token, 0, only=tally.maybe_ours,
                                 wake_at=gate if handed is not None else None,
                                 attempt=attempt, handed=tally.handed, redo=ttl)
    conflict = kind_conflict(tally, lock_name)
    if conflict is not None:
        raise conflict
    return refused(tally, n_nodes=n, start=start, elapsed=elapsed, ttl=ttl,
                   lock_name=lock_name, key=key, beside=(fkey, wkey))


def release_steps(mgr: RoundContext, key: bytes, fkey: bytes, wkey: bytes, token: str,
                  fence: int, *, only: Sequence[bool] | None = None,
                  wake_at: int | None = None, notify: bytes = b"", attempt: int = 0,
                  handed: Sequence[bool] = (), wait: bool = True,
                  redo: float = 0.0, every: bool = False) -> Steps[ReleaseResult]:
    """A release on every node, or the clean-up after a lost attempt (``only``).

    The clean-up waits for no reply: it is sent behind the attempt on the same
    connection (``tag``), so it runs after it and before the next attempt, and
    what it finds changes nothing for the caller. A release is the token's last
    exchange (``final``). ``wait=False``: a release that waits for no reply
    either (its result counts none: a semaphore's line, handed on by a head
    that holds its permit, ``Lock._release_unawaited``). ``redo``: how long
    the key may last (its lease), and so how long a request that failed on
    a node is sent again (:attr:`Ask.redo`). ``every``: wait for every node's
    reply, not only a quorum's (the exit hook: a request still on its way when
    the process ends may never leave it, and a node that did not answer in time
    must be known, to be sent the release again).
    """
    n = len(mgr.nodes)
    requests = release_requests(n, key, fkey, wkey, token, fence, only, wake_at, notify,
                                attempt=attempt, handed=handed)
    gate = gate_node(key, mgr.nodes, mgr.clock()) if n > 1 else None
    settle = (NO_WAIT if only is not None or not wait
              else None if every else release_settle(n, gate))
    # The gate's release hands the lock to a waiter, which then asks the other
    # nodes at once: sent last, it gives the other releases a head start (sent
    # in node order, the handed waiter found one still held 5 % of the time on
    # 5 nodes and lost its turn).
    # (positional: requests, settle, tag, final, skip_backoff, last)
    replies = yield Ask(requests, settle, token, only is None, only is None, gate, redo)
    return tally_release(replies, key, _NodeNames(mgr.nodes), (fkey, wkey))


def extend_steps(mgr: RoundContext, key: bytes, fkey: bytes, token: str, fence: int,
                 ttl: float) -> Steps[ExtendResult]:
    """A lease extension on every node. Every reply is read: an extension is off
    the hot path (the renewal thread's), and its caller may rely on every node
    having the new lease."""
    call = extend_call(key, fkey, token, fence, ttl)
    requests: list[Any] = [call] * len(mgr.nodes)
    acks = mgr.replica_acks
    if acks:
        requests = with_acks(requests, mgr.nodes, acks)
    start = mgr.clock()
    replies = yield Ask(requests, tag=token)
    if acks:
        replies = confirm_all(replies, mgr.nodes, acks, _extended)
    return tally_extend(replies, start=start, elapsed=mgr.clock() - start, ttl=ttl,
                        drift_factor=mgr.drift_factor)


class Extension(NamedTuple):
    """One lock of a batched extension (:func:`extend_many_steps`)."""

    key: bytes
    fkey: bytes
    token: str
    fence: int
    ttl: float


#: Locks per EXTEND_MANY call: a call runs alone on its node, so a batch stays
#: short (about a millisecond of the node's time for 1,000 locks).
EXTEND_BATCH = 1000


def _extended_every_lock(reply: Any) -> bool:
    """A node's reply to an EXTEND_MANY call that extended every lock of it."""
    return type(reply) is list and reply.count(1) == len(reply)


def _never_decides(reply: Any) -> bool:
    return False


@functools.lru_cache(maxsize=64)
def extend_many_settle(need: int, replicas: int = 0) -> Settle:
    """A batched extension's call is decided once ``need`` nodes (a quorum)
    extended every lock of it (with ``replicas``, ``REPLICA_ACKS``: and
    ``WAIT`` confirmed it there). The other nodes' replies are read later, by
    the next round on their connection, and counted as nothing here; the
    requests themselves still run there. Any other answer decides nothing on
    its own (no reply counts as a "no"): a call where some lock was not
    extended on some node waits for every node, as every call did before, so
    that lock's result hears from each node that may still have its key.

    Why not every reply (:func:`extend_many_steps` has the timeline): the
    calls of a pass go one after the other, and a minority node that answers
    slowly but within its timeout made each call, so the pass, wait for it:
    a pass cost calls x that node's round trip, and past the TTL the locks
    ran out although a healthy majority renewed them.
    """
    if not replicas:
        return Settle(need, _extended_every_lock, _never_decides)

    def yes(reply: Any) -> bool:
        return (type(reply) is ChainReply and _extended_every_lock(reply.first)
                and isinstance(reply.then, int) and reply.then >= replicas)

    return Settle(need, yes, _never_decides)


def extend_many_steps(mgr: RoundContext, items: Sequence[Extension]
                      ) -> Steps[list[ExtendResult]]:
    """Extend many locks with one call per node (per :data:`EXTEND_BATCH`
    locks): the renewal thread's round trips per period grow with the nodes,
    not with the locks held. Each lock's result is counted exactly as
    :func:`extend_steps` counts its own round (a node that failed failed for
    every lock of the call).

    A call waits for a quorum of nodes that extended every lock of it, not for
    every node (:func:`extend_many_settle`). The calls of a pass go one after
    the other, so a minority node that answers slowly but within the node
    timeout used to cost the pass one of its round trips per call (20,000
    locks held, 20 calls, a node 90 ms away: 1.8 s of a 2 s lease)::

        t0.00  renewal pass, call 1: nodes A, B answer in 1 ms, C in 90 ms
        t0.09  call 2 ... each call waits for C
        t1.80  call 20 sent; the locks of the last calls ran out meanwhile
               (owned() False), reported lost although A and B renewed them

    Now each call returns on A's and B's replies; C's request goes out all
    the same, behind the one before it on the same connection (a settled
    round leaves its connection owed, and the next call takes it), so the
    calls reach C pipelined, and C's replies are read and dropped by the next
    round there. A pass costs the calls x the quorum's round trip.
    """
    n = len(mgr.nodes)
    results: list[ExtendResult] = [None] * len(items)  # type: ignore[list-item]
    settle = extend_many_settle(mgr.quorum, mgr.replica_acks)
    for at, chunk in _extend_batches(mgr, items):
        keys: list[bytes] = []
        args: list[Any] = [_FENCE_GRACE_B]
        add_key, add_arg = keys.append, args.append
        for item in chunk:  # appends, not a tuple per lock: see engine.watchdog._Lane
            add_key(item.key)
            add_key(item.fkey)
            add_arg(item.token)
            add_arg(max(1, int(item.ttl * 1000)))
            add_arg(item.fence)
        call = Call(EXTEND_MANY, tuple(keys), tuple(args))
        requests: list[Any] = [call] * n
        if mgr.replica_acks:
            requests = with_acks(requests, mgr.nodes, mgr.replica_acks)
        start = mgr.clock()
        replies = yield Ask(requests, settle)
        if mgr.replica_acks:
            replies = [_confirm_batch(r, mgr.replica_acks, mgr.nodes[i])
                       for i, r in enumerate(replies)]
        elapsed = mgr.clock() - start
        # The locks of a call share its start and elapsed time, and most share
        # their replies (1 on every node) and ttl: each distinct (replies, ttl)
        # is counted once (a result is frozen, so the locks may share it).
        tallied: dict[float, dict[tuple[Any, ...], ExtendResult]] = {}
        size = len(chunk)
        if all(type(r) is list and len(r) == size for r in replies):
            columns: Iterable[tuple[Any, ...]] = zip(*replies)  # each lock's replies
        else:  # a node failed for every lock of the call (an error, not a list)
            columns = (tuple([r[k] if isinstance(r, list) and k < len(r) else r
                              for r in replies]) for k in range(size))
        for k, (item, own) in enumerate(zip(chunk, columns)):
            by_replies = tallied.get(item.ttl)
            if by_replies is None:
                by_replies = tallied[item.ttl] = {}
            result = by_replies.get(own)
            if result is None:
                result = by_replies[own] = tally_extend(
                    own, start=start, elapsed=elapsed, ttl=item.ttl,
                    drift_factor=mgr.drift_factor)
            results[at[k]] = result
    return results


def _extend_batches(mgr: RoundContext, items: Sequence[Extension]
                    ) -> list[tuple[list[int], Sequence[Extension]]]:
    """``items`` in batches of at most :data:`EXTEND_BATCH` (with the place of
    each item). When a node is a Redis Cluster, a batch holds the locks of one
    hash slot only: a script's keys must share a slot there."""
    if not any(getattr(node, "one_slot_per_call", False) for node in mgr.nodes):
        return [(list(range(at, min(at + EXTEND_BATCH, len(items)))),
                 items[at:at + EXTEND_BATCH]) for at in range(0, len(items), EXTEND_BATCH)]
    from redis.crc import key_slot

    by_slot: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        by_slot.setdefault(key_slot(item.key), []).append(i)
    return [(places[at:at + EXTEND_BATCH], [items[i] for i in places[at:at + EXTEND_BATCH]])
            for places in by_slot.values() for at in range(0, len(places), EXTEND_BATCH)]


def holders_steps(mgr: RoundContext, key: bytes) -> Steps[int]:
    """How many nodes have ``key``; QuorumUnavailable when too few answer."""
    return tally_holders((yield Ask([exists_command(key)] * len(mgr.nodes))), key)


def give_up_steps(mgr: RoundContext, key: bytes, fkey: bytes, wkey: bytes, token: str,
                  entries: Sequence[bytes]) -> Steps[None]:
    """A waiter gives up: out of the line on every node (``entries``: its entry
    there, :func:`waiter_entries`), and in the same script a lock handed to it
    meanwhile is released and handed on, so a waiter leaving never holds the
    lock for a lease nobody uses."""
    yield Ask([Call(_release_script(token), (key, fkey, wkey),
                    (token, 0, _FENCE_GRACE_B, b"1", entry),
                    last_of_token=True) for entry in entries], tag=token, final=True)


def leave_queue_steps(mgr: RoundContext, wkey: bytes, entries: Sequence[bytes], *,
                      token: Any = None, only: Sequence[bool] | None = None,
                      wait: bool = True) -> Steps[None]:
    """A served waiter leaves the line where it may still stand (``only``: just
    those nodes; ``entries``: its entry on each node); ``wait=False`` sends
    without waiting for the replies."""
    yield Ask([leave_queue_command(wkey, entries[i]) if only is None or only[i] else None
               for i in range(len(mgr.nodes))],
              settle=None if wait else NO_WAIT, tag=token, final=only is None)
