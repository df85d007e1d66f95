"""The synchronous transport: every node asked in parallel, from the calling thread.

(Why one module of 1,500 lines: the connection pool, the owed replies and the
round are one state machine per node; the invariants between them, such as
"a token's requests stay on one connection", must be read in one place.)

A round sends one command to every node first and only then reads the replies, so
the nodes work at the same time and a round costs about one round trip to the
slowest node, not the sum over nodes (redlock-py and pottery's per-call thread
pools pay much more). No thread is created per request.

Each node has its own deadline (its timeout from the start of the round). A node
that does not answer in time (dead, SIGSTOPped, partitioned) is reported as a
:class:`NodeError` and its connection is dropped, so a late reply can never be
read as the answer to a later command. A node that failed is skipped for a short,
growing back-off, so a dead node does not cost every round a connect timeout.

Settled rounds
    An acquire or release round may return as soon as its outcome is known (a
    :class:`Settle` says when: a quorum said yes, or so many said no that a
    quorum cannot say yes), without waiting for the slowest nodes. With five
    servers sharing two CPUs the third reply comes about a fifth of a round
    sooner than the fifth. The replies not read then are *owed* by their
    connections: such a connection is kept aside, and the next round that takes
    it sends its own request behind them (pipelining) and reads and drops them
    first. Requests on one connection run in the order they were sent, so the
    connection is tagged with the lock token it carried, and that token's next
    round (a release behind its acquire, a clean-up behind its attempt) takes
    the same one (:meth:`NodeClient.checkout`). A connection whose oldest owed
    reply is overdue (a paused or dead node) is dropped and its node marked
    failed, as a timed-out read would be.
"""

from __future__ import annotations

import array
import bisect
import fcntl
import inspect
import math
import select
import ssl
import termios
import threading
import time
from collections import deque
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Deque, Sequence, Tuple
from urllib.parse import unquote, urlsplit

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..core.config import NodeSpec, Secret
from ..core.pid import getpid
from ..core.retry import backoff
from . import finalizers
from .resp import PRELOAD, PRELOAD_SCRIPTS, Call, Chain, ChainReply, Command

logger = finalizers.get_logger("django_redlock.transport")

#: Errors that mean "this node did not answer", as opposed to a Redis-level error
#: reply. OSError covers a socket torn down under us.
NODE_DOWN_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)

#: Set on a connection once it carried resp.PRELOAD; one about to reconnect
#: (no socket) carries it again.
_LOADED = "_redlock_scripts_loaded"

#: REDLOCK["CONNECT_TIMEOUT"]'s default (core/config.py), for a NodeClient made
#: without a manager.
DEFAULT_CONNECT_TIMEOUT = 1.0

#: Upper bounds (s) of the buckets of each node's round-trip times
#: (NodeClient.note_round_trip; reported by django_redlock.metrics).
ROUND_TRIP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

#: How many connection set-ups to one node may run at once, once the node
#: accepted one (NodeClient._grow).
PARALLEL_SETUPS = 4

BACKOFF_FIRST = 0.05
BACKOFF_MAX = 1.0

#: A read waits at least this long (s) for its reply, even at its deadline.
_TIMEOUT_SLACK = 0.0005
#: A read whose deadline is at most this much (s) short of a whole node timeout
#: away uses the socket's own timeout, the node timeout (:class:`_Reads`): it
#: may end this much after its deadline, a fifth of the slack above.
_SOCKET_TIMEOUT_SLACK = 0.0001

_GET_NEEDS_NAME = (
    inspect.signature(redis.ConnectionPool.get_connection).parameters["command_name"].default
    is inspect.Parameter.empty)


#: The passwords this process's nodes connect with (their URLs, OPTIONS, the
#: pools they use, a cache's included): every node failure's reason is
#: scrubbed of them (:func:`scrub`).
_SECRETS: set[str] = set()


def remember_secrets(*values: Any) -> None:
    """Note passwords (non-empty strings among ``values``) to scrub."""
    for value in values:
        if isinstance(value, str) and value:
            _SECRETS.add(Secret(value))  # shown as '***' by repr, as in a node's options


def scrub(text: str) -> str:
    """``text`` with every password of this process's nodes replaced by
    ``***``. A server may quote a request's arguments in its error: one that
    does not know ``AUTH`` (renamed away, an old or a proxied server) answers
    the handshake with "unknown command 'AUTH', with args beginning with:
    '<password>'", and that reason reached ``QuorumUnavailable``, its
    ``errors``, the logs and a view's 503 log line."""
    for secret in tuple(_SECRETS):
        if secret in text:
            text = text.replace(secret, "***")
    return text


class NodeError(Exception):
    """One node's failure in a round: unreachable, timed out, or skipped (back-off).

    Its reason is scrubbed of the nodes' passwords (:func:`scrub`): every
    node's failure, whichever path made it, is told through one."""

    def __init__(self, node: str, reason: str, *, sent: bool = True,
                 closed: bool = False, skipped: bool = False) -> None:
        reason = scrub(reason)
        super().__init__(f"{node}: {reason}")
        self.node = node
        self.reason = reason
        #: The round did not try the node (its back-off, or an earlier
        #: attempt's clean-up still on its way): nothing was learnt of it.
        self.skipped = skipped
        #: The node had closed the connection (a restart): worth one new one.
        self.closed = closed
        #: False when the request never left (the node was skipped or the connect
        #: failed): the node certainly did not execute it.
        self.sent = sent


class _NotAwaited:
    """The result of a node whose reply a settled round did not wait for."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NOT_AWAITED"


#: In a settled round's results: this node was asked, its reply comes later and
#: is read and dropped by the next round on its connection. The request was
#: sent, so the node may have executed it.
NOT_AWAITED: Any = _NotAwaited()


@dataclass(frozen=True)
class Settle:
    """When a round's outcome is known before every node answered.

    ``yes`` and ``no`` classify one reply. The round returns once ``need`` nodes
    said yes, or once so many said no that ``need`` yes answers are out of
    reach among the nodes asked *and* at least ``need`` nodes answered: a
    caller that asked a gate node first, which failed, needs a full quorum of
    answers from the rest, or it would report the quorum unavailable on one
    busy answer while the other node, not waited for, was up (and the error
    named only the failed gate). Errors never end a round early: whether too
    few nodes *answered* is a different outcome (QuorumUnavailable), and only
    all the replies tell it. The reply of node ``also`` (when not None) is
    waited for a little longer (:data:`ALSO_GRACE`) once the rest is decided.
    """

    need: int
    yes: Callable[[Any], bool]
    no: Callable[[Any], bool]
    also: int | None = None


#: How long a decided round still waits for :attr:`Settle.also` (seconds): a
#: healthy node answers within a fraction of that after the others; a paused
#: one must not cost the round its timeout.
ALSO_GRACE = 0.002


#: One reply a connection still has to read: (request, whether it is the
#: current round's own, when it is due). Oldest first.
Expected = Tuple[Any, bool, float]


_UNREAD: Any = object()


class _Pending:
    """A :class:`~.resp.Chain` sent on a connection: it expects two replies
    (two entries of the connection's ``expect``, the first never the round's
    own), and keeps the first until the second is read, so that the round
    gets both as one :class:`~.resp.ChainReply`, and a chain owed to a later
    round is read and dropped whole."""

    __slots__ = ("chain", "first")

    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        self.first = _UNREAD

    def take(self, reply: Any, mine: bool) -> tuple[bool, Any]:
        if self.first is _UNREAD:
            self.first = reply
            return False, None
        return mine, ChainReply(self.first, reply)


class _Owed:
    """A connection with replies still to read (oldest first), and whose they are.

    ``tag`` is the lock token of the rounds that sent them (None: nobody's).
    """

    __slots__ = ("conn", "expect", "tag")

    def __init__(self, conn: Any, expect: Deque[Expected], tag: Any) -> None:
        self.conn = conn
        self.expect = expect
        self.tag = tag


def unread_bytes(sock: Any) -> int:
    """How many bytes wait unread in ``sock``'s receive buffer (FIONREAD; 0
    for no socket, a closed one, or one that reached its end): counted, never
    read, so the thread or task that reads the socket still reads them all."""
    count = array.array("i", [0])
    try:
        fd = sock.fileno() if sock is not None else -1
        if fd < 0:
            return 0
        fcntl.ioctl(fd, termios.FIONREAD, count, True)
    except (OSError, ValueError):  # closed under us by its reader
        return 0
    return count[0]


class _NotYet(Exception):
    """A settled round's read (:class:`_Reads` with ``wait`` False) found part
    of a reply and nothing more yet: the round reads the other nodes
    meanwhile, and this one again when more of it came. Not an OSError, so
    that redis-py's parsers let it through: they keep what they read (hiredis
    in its reader, the pure-Python parser in its buffer, rewound), and the
    next read resumes the reply where it stopped."""


#: What a ``recv`` on a socket without a timeout raises when nothing came: a
#: plain socket's EAGAIN, a TLS socket's want of the rest of a record.
_WOULD_BLOCK = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class _Reads:
    """The socket a connection's reply parser reads through: the socket's own
    calls, but a read armed with a deadline (:func:`_armed`) ends by it,
    however the reply arrives.

    A socket's timeout bounds each ``recv``, not a reply: redis-py's parsers
    call ``recv`` until the reply is whole, each call with the whole timeout.
    A node that sends part of a reply and then a byte every so often, each
    within the timeout (a failing disk or NIC, a proxy or a TLS terminator
    that stalls mid-stream), held a round, and with it every call of the
    process that needed that node's connection, for ever, also as one node
    of three (and the exit hook with it)::

        t=0.0  acquire sends its SET to nodes 1, 2, 3 (node timeout 0.5 s)
        t=0.0  nodes 2 and 3 answer; node 1 sends "$100000\\r\\n"
        t=0.2  node 1 sends one byte; the parser reads it and calls recv
               again with a new 0.5 s ... and again at t=0.4, 0.6 ...

    So the first ``recv`` of a read uses the socket's own timeout when that
    ends by the deadline (the usual case: the read right after the send, the
    reply whole in one ``recv``; no system call added, and no Python call:
    it goes to the socket ``direct``), every later one gets what is left of
    the deadline, and once it passed only what came already (a ``recv``
    that does not wait: a reply that came whole is read however late its
    reader runs). A read that still lacks part of its reply then fails as
    any timed-out read (its connection is dropped: a half-read reply must
    never be taken for the next command's).

    A settled round's read (``wait`` False) never waits before its
    deadline: every ``recv`` takes only what came already, and when that is
    nothing it raises :class:`_NotYet` (the round reads the other nodes
    meanwhile). Only a plain socket that the round's ``poll`` just found
    readable (``ready``) is read directly: its ``recv`` returns at once. A
    readable TLS socket may hold part of a record only, for which
    ``SSLSocket.recv`` would wait; a parser's buffer may hold part of a reply
    (``can_read`` then says True while nothing more came)::

        round 2  node C sends round 1's owed reply and the head of round 2's
                 own in one segment; the read drops the owed reply, and the
                 next recv would wait for the rest of C's until its deadline
                 (1 s) while A and B, which answered, sat unread

    Disarmed (``deadline`` None), it is the socket: ``can_read`` and
    redis-py's own reads go through unchanged.
    """

    __slots__ = ("clock", "deadline", "direct", "first", "home", "parser", "plain", "sock",
                 "wait")

    def __init__(self, sock: Any, parser: Any) -> None:
        self.sock = sock
        self.parser = parser
        self.deadline: float | None = None
        self.clock: Callable[[], float] = time.monotonic
        #: The socket's timeout between reads (the node timeout; the connect
        #: timeout in a set-up), which a bounded ``recv`` puts back.
        self.home = 0.0
        #: The next ``recv`` goes to the socket as it is: disarmed, or the
        #: first of a read that ends by its deadline anyway (_armed).
        self.direct = True
        #: The next ``recv`` is the read's first, not ``direct``.
        self.first = False
        self.wait = True
        #: Not TLS: readable means a ``recv`` returns at once.
        self.plain = not isinstance(sock, ssl.SSLSocket)

    def __getattr__(self, name: str) -> Any:  # fileno, settimeout, pending (TLS)...
        return getattr(self.sock, name)

    # The arguments go through as given: a TLS socket's defaults differ.
    def recv_into(self, *args: Any) -> Any:
        if self.direct:
            if self.deadline is not None:
                self.direct = False  # the rest of the reply by the deadline
            return self.sock.recv_into(*args)
        return self._bounded(self.sock.recv_into, args)

    def recv(self, *args: Any) -> Any:
        if self.direct:
            if self.deadline is not None:
                self.direct = False
            return self.sock.recv(*args)
        return self._bounded(self.sock.recv, args)

    def _bounded(self, recv: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        assert self.deadline is not None
        sock = self.sock
        left = self.deadline - self.clock()
        first = self.first
        self.first = False
        if left > 0 and not self.wait:
            return self._now(recv, args, _NotYet)  # a settled round reads the others meanwhile
        if left <= 0 and not first:
            # The rest of the reply, if it came already; else too late.
            return self._now(recv, args, TimeoutError("timed out"))
        sock.settimeout(max(left, _TIMEOUT_SLACK))  # a reply already come is read however late
        try:
            return recv(*args)
        finally:
            sock.settimeout(self.home)

    def _now(self, recv: Callable[..., Any], args: tuple[Any, ...],
             nothing: BaseException | type[BaseException]) -> Any:
        """``recv`` what came already; raise ``nothing`` when that is nothing."""
        sock = self.sock
        sock.settimeout(0.0)
        try:
            return recv(*args)
        except _WOULD_BLOCK:
            raise nothing from None
        finally:
            sock.settimeout(self.home)


def _readable_now(sock: Any) -> bool:
    """Whether a ``recv`` on ``sock`` returns without waiting (a TLS socket's
    decrypted bytes included)."""
    pending = getattr(sock, "pending", None)
    if pending is not None and pending():
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


#: A connection's :class:`_Reads` (an attribute of the connection).
_READS = "_redlock_reads"


def _armed(conn: Any, deadline: float, home: float, clock: Callable[[], float],
           wait: bool = True, ready: bool = False) -> _Reads:
    """Arm ``conn``'s reads with ``deadline`` (on ``clock``) for one reply;
    disarm with :func:`_disarm`. ``ready``: a ``poll`` just found the
    socket readable, and nothing read it since. A connection's parser is
    wrapped once per socket (redis-py's parsers keep the socket they read:
    hiredis as ``_sock``, the pure-Python ones in their buffer; a handshake
    may change the parser)."""
    sock = conn._sock
    parser = conn._parser
    reads = getattr(conn, _READS, None)
    if sock is None:  # not connected: redis-py's read raises; nothing to wrap
        return _Reads(None, None)
    if reads is None or reads.sock is not sock or reads.parser is not parser:
        reads = _Reads(sock, parser)
        if getattr(parser, "_sock", None) is sock:
            parser._sock = reads
        buffer: Any = getattr(parser, "_buffer", None)
        if getattr(buffer, "_sock", None) is sock:
            buffer._sock = reads
        setattr(conn, _READS, reads)
    reads.deadline = deadline
    reads.home = home
    reads.clock = clock
    reads.wait = wait
    if wait:
        # The socket's own timeout ends by the deadline, to within the slack:
        # a timeout of its own would cost two more system calls (set, and
        # set back).
        direct = deadline - clock() >= home - _SOCKET_TIMEOUT_SLACK
        if direct and sock.gettimeout() != home:
            sock.settimeout(home)  # changed by someone else's read
    else:
        direct = ready and reads.plain
    reads.direct = direct
    reads.first = not direct
    return reads


def _disarm(reads: _Reads) -> None:
    """The socket as it is again (:func:`_armed`)."""
    reads.deadline = None
    reads.direct = True


def secrets_of(spec: NodeSpec) -> list[str]:
    """The passwords a node's settings hold, as written and decoded: its
    URL's (user info, a ``password=`` query item), its OPTIONS', its
    sentinels' own URLs'."""
    found: list[Any] = [spec.options.get("password")]
    found += [dict(own).get("password") for own in getattr(spec, "address_options", ()) or ()]
    url = getattr(spec, "url", None)
    if isinstance(url, str):
        try:
            parts = urlsplit(url)
            found += [parts.password, unquote(parts.password or "")]
            for item in parts.query.split("&"):
                if item.startswith("password="):
                    value = item[len("password="):]
                    found += [value, unquote(value)]
        except ValueError:  # not a URL urlsplit reads: nothing to take from it
            pass
    return [s for s in found if isinstance(s, str) and s]


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) < 160 else text[:157] + "..."


def not_redis_reason(exc: BaseException) -> str:
    """What to say about a node that answered something other than Redis (an
    HTTP server, PostgreSQL) or refused our handshake (NOAUTH...): it counts as
    a node down, and the message says what answered there (issue 26)."""
    if isinstance(exc, InvalidResponse):
        return "not a Redis server? it answered: " + _short(exc)
    if isinstance(exc, RedisConnectionError) and "closed by server" in str(exc):
        # redis-py's own parser (no hiredis) reads a reply up to "\r\n"; an HTTP
        # server's "\n"-only error page then ends as a closed connection
        return _short(exc) + " (in the handshake, with no Redis reply: not a Redis server?)"
    return _short(exc)


class NodeClient:
    """One node: a connection pool, a timeout and a failure back-off.

    For a ``cache:<alias>`` node the pool is the django-redis cache's own (borrowed,
    never disconnected by us); otherwise the pool is ours, built from the URL with
    the node timeout as socket timeouts.
    """

    def __init__(self, spec: NodeSpec, *, node_timeout: float,
                 pool_factory: Callable[[NodeSpec], Any] | None = None,
                 connect_timeout: float | None = None) -> None:
        self.spec = spec
        self.name = spec.display
        options = dict(spec.options)
        remember_secrets(*secrets_of(spec))
        # The lock's own bounds win over longer socket timeouts given in the
        # node's OPTIONS, its URL or a borrowed cache pool (applied to every
        # connection we make: see new_connection); shorter ones are kept.
        self.timeout: float = min(float(options.get("socket_timeout") or node_timeout),
                                  float(node_timeout))
        bound = float(connect_timeout if connect_timeout is not None else DEFAULT_CONNECT_TIMEOUT)
        #: How long one connection set-up (TCP, TLS, AUTH, the scripts) may
        #: take; REDLOCK["CONNECT_TIMEOUT"]. See wait_connection.
        self.connect_timeout: float = min(
            float(options.get("socket_connect_timeout") or bound), bound)
        self._connect_timeout = self.connect_timeout  # the name notify/aio used
        self._pool_factory = pool_factory
        self._pool: Any = None
        self._pool_lock = threading.Lock()
        self._borrowed = spec.kind == "cache"
        self._failures = 0
        self.down_until = 0.0
        #: Replies read from this node so far, by any round of either flavour:
        #: a node whose count grew while our round missed it is alive, merely
        #: late for us (engine.protocol: such a miss is asked again).
        self.answers = 0
        #: When this node's newest connection set-up began, and when a set-up
        #: of it last read a reply (each handshake step, the scripts, a release
        #: handed to it; or a round that missed the node found one waiting
        #: unread: _set_up_reply_waits), on time.monotonic: a node whose
        #: set-up answered since its newest began is alive, its set-up merely
        #: slower than the round that waited for it
        #: (engine.protocol._quorum_alive). A paused node's set-up connects
        #: (the kernel accepts) and never answers.
        self.set_up_began = -math.inf
        self.set_up_answered = -math.inf
        #: When a set-up of this node last failed (time.monotonic): a node
        #: late for a round whose set-up then failed was not merely late
        #: (engine.protocol._slow_reply).
        self.set_up_failed = -math.inf
        #: Failures so far (no answer in time, refused, a set-up that failed),
        #: and the round trips of the replies read, bucketed by
        #: ROUND_TRIP_BUCKETS (the last count: above the last bound), with
        #: their sum: plain counters, read by a metrics scrape (an increment
        #: lost to a race between threads is a count one short, never wrong).
        self.errors = 0
        self.round_trips = [0] * (len(ROUND_TRIP_BUCKETS) + 1)
        self.round_trip_sum = 0.0
        self._idle: list[Any] = []
        #: connections whose replies a settled round did not wait for
        self._owed: list[_Owed] = []
        self._owed_lock = threading.Lock()
        self._pid = getpid()
        self._closed = False
        # Shared connection set-up (see wait_connection).
        self._cond = threading.Condition(threading.Lock())
        self._waiting = 0
        self._setting_up = 0
        self._setup_error = ""
        #: When the last set-up failed (time.monotonic), or -inf: a round that
        #: began before it takes that failure as its answer (wait_connection).
        self._setup_failed_at = -math.inf
        #: Whether the last set-up succeeded (see _grow).
        self._accepting = False
        #: The connections being set up (see _set_up_reply_waits).
        self._setting_up_conns: list[Any] = []
        #: Releases to send first on the connection being set up (deliver_later).
        self._later: list[tuple[bytes, Any]] = []
        #: The lock tokens (round tags) whose release is in ``_later`` or on its
        #: way by a set-up: their next rounds must not overtake it (checkout).
        self._later_tags: list[Any] = []

    # -- pool ---------------------------------------------------------------
    @property
    def pool(self) -> Any:
        if self._pool is None:
            with self._pool_lock:
                if self._pool is None:
                    pool = self._build_pool()
                    kwargs = getattr(pool, "connection_kwargs", None) or {}
                    remember_secrets(kwargs.get("password"))
                    self._pool = pool
        return self._pool

    def _build_pool(self) -> Any:
        if self._pool_factory is not None:
            return self._pool_factory(self.spec)
        kwargs = dict(self.spec.options)
        kwargs["socket_timeout"] = self.timeout
        kwargs["socket_connect_timeout"] = self._connect_timeout
        kwargs.setdefault("client_name", "django-redlock")
        kwargs["protocol"] = 2  # no server pushes on request/reply connections
        return redis.ConnectionPool.from_url(self.spec.url, **kwargs)

    def get(self) -> Any:
        """An idle connection for one request/reply exchange, or None when there
        is none (then :meth:`wait_connection`); give it back with :meth:`put`.

        Every node keeps a LIFO free list instead of going through redis-py's
        pool: the pool's checkout polls the socket and takes a lock on every
        call, which is a measurable share of a ~100 us acquire. It is safe here
        because a connection only comes back after its reply was read in full
        (a timed-out one is disconnected first), and we speak RESP2, so the
        server never pushes unasked data. A forked child starts with an empty
        list: it must never share its parent's sockets. A ``cache:`` node's
        connections are made with the cache pool's settings (host, password,
        TLS...), but the lock's own timeouts (:meth:`new_connection`): its pool
        would connect with the cache's timeouts, seconds where a lock round has
        a tenth of one.
        """
        if self._pid != getpid():
            self._after_fork()
        if self._waiting:
            return None  # rounds wait in line for one: no overtaking them (wait_connection)
        try:
            return self._idle.pop()
        except IndexError:
            return None

    def _after_fork(self) -> None:
        """In a forked child (lazily, at its first use of the node, and from
        the manager's fork hook): none of the parent's connections, set-ups
        or locks. A lock a parent thread held at the fork (building the pool:
        a Sentinel node resolves its master there) stays held in the child
        for good, by a thread that does not exist in it."""
        self._idle = []
        self._owed = []
        self._owed_lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._later = []
        self._later_tags = []
        self._setting_up_conns = []  # the parent's set-ups: no thread here
        self._cond = threading.Condition(threading.Lock())
        self._waiting = self._setting_up = 0
        self._pid = getpid()

    def put(self, conn: Any) -> None:
        if self._pid == getpid() and not self._closed and conn._sock is not None:
            self._idle.append(conn)
            if self._waiting:
                # Lock-free above (the hot path); a waiter counts itself in
                # before it looks at the list, so it sees this one or is told.
                with self._cond:
                    self._cond.notify()
        else:
            conn.disconnect()

    def wait_connection(self, start: float, until: float | None,
                        clock: Callable[[], float] = time.monotonic) -> Any:
        """A connected connection for a round that started at ``start``, or
        :class:`NodeError` (``sent=False``) when none came in time (see
        :func:`connection_wait`; ``until``: the caller's deadline).

        Connection set-up is shared: a node has a set-up in flight whenever a
        round waits (one at a time while the node is not known to accept,
        more once it is: :meth:`_grow`; each in a thread of its own, each of
        its steps bounded by :attr:`connect_timeout`, apart from the node
        timeout), and the rounds that need a connection wait in line, first
        come first served, for a connection set up for them or given back. A burst of rounds on a cold
        process thus opens connections a few at a time instead of one per
        round and node at once (250 concurrent handshakes timed out under
        load, issue 25). A set-up that fails ends every wait at once with its
        reason (a node that refuses costs nobody a timeout), also the waits of
        rounds that began before it failed and come to wait later; one that
        outlives a caller's deadline goes on in the background, so the next
        round finds it ready.
        """
        if self._pid != getpid():
            self._after_fork()
        began = round_began(start, clock)
        with self._cond:
            self._waiting += 1
            try:
                while True:
                    try:
                        return self._idle.pop()
                    except IndexError:
                        pass
                    if self._setup_failed_at >= began:
                        # A set-up failed since this round began, also before
                        # the round came to wait for this node (it waited for
                        # another meanwhile): that is this node's answer. A
                        # new set-up would cost the round another connect
                        # timeout on a node that is down or paused.
                        raise NodeError(self.name, self._setup_error, sent=False)
                    if self._closed:
                        raise NodeError(self.name, "closed", sent=False)
                    self._grow()
                    if self._idle or self._setup_failed_at >= began:
                        # A set-up ran in this thread (interpreter shutdown), or
                        # a connection was given back (put() takes no lock).
                        continue
                    left = start + connection_wait(self, start, until) - clock()
                    if left <= 0:
                        if self._set_up_reply_waits():
                            self.note_set_up_reply()
                        raise NodeError(self.name, "no connection yet (set-up under way, up to "
                                        f"{self.connect_timeout:g} s per step)", sent=False)
                    self._cond.wait(min(left, 1.0))
            finally:
                self._waiting -= 1

    def want_connection(self) -> None:
        """Start a set-up now unless one is under way or a connection is idle:
        a round calls this for every node it will wait for before it waits for
        any, so that their set-ups run in parallel."""
        if self._pid != getpid():
            self._after_fork()
        with self._cond:
            if not self._idle and not self._setting_up and not self._closed:
                self._start_setup()

    def deliver_later(self, request: Any, tag: Any = None) -> bool:
        """Send release ``request`` (of lock token ``tag``) on the connection
        being set up, before anyone else uses it; False when no set-up is
        under way.

        A clean-up after a lost attempt must reach every node that may have
        granted it, also one that timed out (its request was sent and may run
        when it wakes): that node's connection was dropped, and a new one may
        take longer than the round waits. The set-up thread sends the release
        and reads its reply before the connection serves anything else, so it
        runs within the connect timeout (issue 17).

        It must run before the next attempt of the same token on this node,
        which another connection (given back meanwhile, or another set-up's)
        could carry first::

            attempt 1   SET k T  -> node X  (no reply in time: dropped)
            clean-up    DEL k if T: X has no connection -> handed to a set-up
            attempt 2   SET k T  -> X, on a connection given back: granted
            set-up      DEL k if T -> runs now: attempt 2's grant is gone, and
                        a second client takes the lock while we hold it

        So until the set-up has run it, a round for ``tag`` gets no connection
        to this node (:meth:`checkout`): the node sits that round out.
        """
        with self._cond:
            if not self._setting_up:
                return False
            self._later.append((request.packed, tag))
            if tag is not None:
                self._later_tags.append(tag)
            return True

    def _grow(self) -> None:
        """Under ``_cond``: start set-ups while rounds wait for more connections
        than are idle or on their way. A node not yet known to accept (cold, or
        its last set-up failed) gets one set-up at a time: it may be down or
        black-holed, and one probe tells every waiter. Once one succeeded, up
        to :data:`PARALLEL_SETUPS` run at once: a burst of rounds on a cold
        process needs about one connection per concurrent round, and one
        set-up after the other (10-40 ms each on a loaded CPU) could not keep
        up: a round holding a sent request on one node waited past its
        connect bound for a connection to the next, and a healthy quorum was
        reported unavailable (issue 25, seen again in CI)."""
        limit = PARALLEL_SETUPS if self._accepting else 1
        while (self._setting_up < limit and not self._closed
               and self._waiting > len(self._idle) + self._setting_up):
            if not self._start_setup():
                # None in flight (one ran in this thread, at interpreter
                # shutdown): the waiter looks at its outcome. Looping on
                # would set up again and again while the node fails, a
                # connect timeout each time (a black-holed node held the exit
                # hook of a 60-lock process for more than 30 s on Python 3.12).
                break

    def _start_setup(self) -> bool:
        """Under ``_cond``: one more set-up in flight, in a daemon thread (only
        a cold node pays for it; a round never creates a thread). False when
        no thread could be started and the set-up ran in the calling thread
        instead."""
        self._setting_up += 1
        self.note_set_up_began()  # now, not when the thread gets to run
        thread = threading.Thread(target=self._setup, name=f"redlock-connect {self.name}",
                                  daemon=True)
        try:
            thread.start()
            return True
        except RuntimeError:
            # "can't create new thread at interpreter shutdown" (Python 3.12):
            # the exit hook's releases (engine/held.py) set the connection up
            # here, in the calling thread, bounded by the connect timeout, with
            # ``_cond`` let go meanwhile (``_setup`` takes it itself).
            self._cond.release()
            try:
                self._setup()
            finally:
                self._cond.acquire()
            return False

    def _setup(self) -> None:
        """The set-up thread. Its blocks under the node's ``_cond`` are
        sections (transport/finalizers.py): a release a collection runs
        there is put off until the block ends. Run at once, it waited for
        the ``_cond`` its own thread held, and the node hung for good (every
        round, every renewal); put off to the end of the whole set-up, it
        waited for the network steps (several connect timeouts), its lock
        held and no longer renewed."""
        conn: Any = None
        error = ""
        while True:
            try:
                if conn is None:
                    conn = self.new_connection()
                    self._setting_up_conns.append(conn)
                    self.connect(conn)
                self._send_later(conn)
            except NodeError as e:
                error = e.reason
            except Exception as e:  # noqa: BLE001 - a pool that cannot be built (a cache: node
                # whose cache lends none): this node's failure, not a thread dying with a
                # traceback and leaving its waiters counted as set up
                error = _short(e)
            with finalizers.SECTION, self._cond:  # see _setup
                if not error and self._later and not self._closed:
                    continue  # a release handed over meanwhile goes first, too
                self._setting_up -= 1
                if conn is not None:
                    self._setting_up_conns.remove(conn)
                if not self._setting_up:
                    self._later = []  # no set-up left to carry them
                    self._later_tags = []
                if error:
                    self._accepting = False
                    self._setup_error = error
                    self._setup_failed_at = time.monotonic()
                    self.note_set_up_failed(self._setup_failed_at)
                    self.mark_failed(self._setup_failed_at)
                    self._cond.notify_all()
                    return
                if self._closed or self._pid != getpid():
                    conn.disconnect()
                    return
                self._accepting = True
                self._idle.append(conn)
                self._cond.notify()
                self._grow()  # more rounds wait than there are connections
                return

    def _set_up_reply_waits(self) -> bool:
        """Whether a reply waits unread in the socket of a connection being
        set up: the node answered it, and only the set-up's thread has not
        read it yet (:meth:`note_set_up_reply` is then stamped by the round
        that missed the node, not only by that thread).

        On a starved CPU the thread a reply woke may not run before the round
        waiting for the connection ends, and a single caller has no other
        sign that the node lives (engine.protocol._set_up_answers)::

            t=0.00  round 2 waits for node 1's connection (node timeout 0.2 s)
            t=0.15  node 1's handshake reply is in the set-up's socket; the
                    set-up thread waits for the CPU (or the GIL)
            t=0.20  round 2's wait ends first: "no connection yet", and no
                    set-up reply read since the set-up began: the call ended
                    with QuorumUnavailable while a quorum answered

        The bytes are counted, not read (FIONREAD: the set-up's thread reads
        its socket, and the kernel's count is never consumed by looking): a
        reply of a paused node never comes, and a closed connection has none
        (its end of file counts no byte). A TLS socket's count is of the
        node's TLS bytes: still a reply.
        """
        return any(unread_bytes(getattr(conn, "_sock", None)) > 0
                   for conn in list(self._setting_up_conns))

    def _send_later(self, conn: Any) -> None:
        """The releases handed to this set-up (:meth:`deliver_later`), each
        reply read (their outcome changes nothing for anyone)."""
        while True:
            with finalizers.SECTION, self._cond:  # see _setup
                later, self._later = self._later, []
            if not later:
                return
            try:
                conn.send_packed_command([packed for packed, _ in later], check_health=False)
                for _ in later:
                    # Each reply within the node timeout, as a whole (_Reads).
                    reads = _armed(conn, time.monotonic() + self.timeout, self.timeout,
                                   time.monotonic)
                    try:
                        conn.read_response()
                        self.note_set_up_reply()
                    except ResponseError:
                        pass
                    finally:
                        _disarm(reads)
            except NODE_DOWN_ERRORS as e:
                conn.disconnect()
                raise NodeError(self.name, _short(e)) from e
            finally:
                # Run (or the connection is gone, and with it anything unsent;
                # what was sent ran before anything a newer connection carries).
                with finalizers.SECTION, self._cond:  # see _setup
                    for _, tag in later:
                        if tag is not None and tag in self._later_tags:
                            self._later_tags.remove(tag)

    def connect(self, conn: Any) -> None:
        """Set ``conn`` up: TCP (and TLS, AUTH, SELECT, CLIENT SETNAME:
        redis-py's handshake), then the scripts (resp.PRELOAD), each step
        waiting at most :attr:`connect_timeout` for the node (a bound on the
        node, not on our CPU: a reply already come is read however late this
        thread runs), each reply as a whole, not each ``recv`` of it
        (:class:`_Reads`: a node that trickled a reply held the set-up's
        thread for ever, and no set-up of that node ever ran again). Raises
        :class:`NodeError` (``sent=False``)."""
        bound = self.connect_timeout
        conn.socket_connect_timeout = bound
        conn.socket_timeout = bound  # the handshake's replies
        read = conn.read_response

        def read_counted(*args: Any, **kwargs: Any) -> Any:
            reads = _armed(conn, time.monotonic() + bound, bound, time.monotonic)
            try:
                reply = read(*args, **kwargs)
            finally:
                _disarm(reads)
            self.note_set_up_reply()  # each step answered: the node is alive
            return reply

        # Also the handshake's replies, which redis-py reads itself: on a
        # starved CPU or a distant link, a set-up that outlasts the round that
        # waits for it is the only sign a single caller gets that the node
        # lives (see engine.protocol._quorum_alive).
        conn.read_response = read_counted
        try:
            try:
                if hasattr(conn, "connect_check_health"):  # no retries: one bound
                    conn.connect_check_health(check_health=False, retry_socket_connect=False)
                else:  # pragma: no cover - redis-py < 6
                    conn.connect()
                conn.send_packed_command((PRELOAD,), check_health=False)
                for _ in PRELOAD_SCRIPTS:
                    try:
                        conn.read_response()
                    except ResponseError:  # SCRIPT denied by an ACL: EVAL after NOSCRIPT
                        pass
            finally:
                conn.socket_timeout = self.timeout
                vars(conn).pop("read_response", None)
            conn._sock.settimeout(self.timeout)
        except NODE_DOWN_ERRORS as e:
            conn.disconnect()
            raise NodeError(self.name, not_redis_reason(e), sent=False) from e
        except RedisError as e:  # a protocol error, NOAUTH...: not a Redis we can use
            conn.disconnect()
            raise NodeError(self.name, not_redis_reason(e), sent=False) from e
        setattr(conn, _LOADED, True)

    def checkout(self, now: float, tag: Any = None) -> tuple[Any, Deque[Expected]]:
        """A connection for a round, with the replies it still owes.

        A round for lock token ``tag`` takes the connection that owes that
        token's earlier requests, so that on this node they run in the order
        sent: an attempt's clean-up must never run after the next attempt's
        grant (it would delete it), nor a release before its acquire. Other
        rounds take a connection that owes nobody's replies, or one whose
        replies are all due, so that owed connections are drained promptly
        and a node needs no more connections than before. A connection whose
        oldest owed reply is overdue, with nothing new on its socket (part of
        a reply left in its parser by a settled round is no answer), belongs
        to a node that stopped answering: it is dropped and the node marked
        failed (:class:`NodeError`, raised here). One with something new is
        taken, and its overdue reply read by its own due time: whole by now,
        or the node fails.
        """
        if self._later_tags and tag is not None and tag in self._later_tags:
            if self._set_up_reply_waits():
                self.note_set_up_reply()
            raise NodeError(self.name, "an earlier attempt's clean-up is still on its way",
                            sent=False, skipped=True)  # see deliver_later
        if self._owed and self._pid == getpid():
            with self._owed_lock:
                owed = self._take_owed(now, tag)
            if owed is not None:
                if owed.expect[0][2] >= now or self._readable(owed.conn):
                    return owed.conn, owed.expect
                self._drop(owed.conn)
                self.mark_failed(now)
                raise NodeError(self.name, f"no answer within {self.timeout:g} s", sent=False)
        return self.get(), deque()  # None: no idle one (SyncTransport.round waits for one)

    def _take_owed(self, now: float, tag: Any) -> _Owed | None:
        owed = self._owed
        if tag is not None:
            for k in range(len(owed) - 1, -1, -1):
                if owed[k].tag == tag:
                    return owed.pop(k)
        for k in range(len(owed) - 1, -1, -1):
            entry = owed[k]
            if entry.tag is None or entry.expect[-1][2] < now:
                return owed.pop(k)
        return None

    def owe(self, conn: Any, expect: Deque[Expected], tag: Any = None) -> None:
        """Keep ``conn`` aside until a round reads the replies in ``expect``."""
        if self._closed or self._pid != getpid():
            self._drop(conn)
        else:
            with self._owed_lock:
                self._owed.append(_Owed(conn, expect, tag))

    def forget(self, tag: Any) -> None:
        """No round of lock token ``tag`` follows: its owed connections are anyone's."""
        if self._owed:
            with self._owed_lock:
                for entry in self._owed:
                    if entry.tag == tag:
                        entry.tag = None

    @staticmethod
    def _readable(conn: Any) -> bool:
        """Whether something came on ``conn``'s socket since it was last
        read. The socket, not the parser (``can_read``): a settled round may
        leave part of a reply in the parser's buffer (:class:`_NotYet`), and
        then ``can_read`` says True however long nothing more comes: a node
        that sent part of a reply and stopped was never dropped nor failed,
        every round sent behind it, and its connection's owed replies grew
        by one per round."""
        sock = conn._sock
        if sock is None:
            return False
        try:
            return _readable_now(sock)
        except (OSError, ValueError):  # closed under us
            return False

    @staticmethod
    def _drop(conn: Any) -> None:
        conn.disconnect()

    def new_connection(self) -> Any:
        """A connection outside the pool's accounting (also for the pub/sub
        listener), with the lock's bounds: a longer socket timeout from the URL
        or a cache's pool never applies (issue 17: a ``cache:`` node took 5 s
        with a node timeout of 0.2 s). The first one of a process also starts
        the thread that sends the signals of the releases a garbage
        collection runs (``finalizers.prepare``): before a collection needs it."""
        finalizers.prepare()
        pool = self.pool
        kwargs = dict(pool.connection_kwargs)
        kwargs["socket_timeout"] = self.timeout
        kwargs["socket_connect_timeout"] = self.connect_timeout
        return pool.connection_class(**kwargs)

    def close(self) -> None:
        owed, self._owed = self._owed, []
        for entry in owed:
            self._drop(entry.conn)
        pool, self._pool = self._pool, None  # two closes at once: one disconnects it
        if pool is not None:
            self._closed = True
            idle, self._idle = self._idle, []
            for conn in idle:
                conn.disconnect()
            if not self._borrowed:  # a cache's own pool stays the cache's
                pool.disconnect()
            with self._cond:
                self._cond.notify_all()

    #: What routes the rounds of a transport with this node (a Sentinel or
    #: Cluster node's: transport/nodekinds.py); None: plain rounds.
    router: Any = None

    #: Whether this node's address may change (a Sentinel node follows its
    #: master: transport/nodekinds.py); its connections are then checked with
    #: :meth:`accepts` before use.
    moves = False

    def accepts(self, conn: Any) -> bool:
        """Whether ``conn`` still goes where this node's requests must go."""
        return True

    # -- health -------------------------------------------------------------
    def backing_off(self, now: float) -> bool:
        return now < self.down_until

    def mark_failed(self, now: float) -> None:
        self.errors += 1
        self._failures += 1
        self.down_until = now + backoff(self._failures, first=BACKOFF_FIRST, cap=BACKOFF_MAX)

    def note_set_up_began(self) -> None:
        """A connection set-up of this node begins (:attr:`set_up_began`)."""
        self.set_up_began = time.monotonic()

    def note_set_up_reply(self) -> None:
        """A connection set-up read a reply (:attr:`set_up_answered`); unlike
        a round's reply (:meth:`mark_ok`) it ends no back-off and counts in no
        metric."""
        self.set_up_answered = time.monotonic()

    def note_set_up_failed(self, at: float) -> None:
        """A connection set-up failed at ``at`` (:attr:`set_up_failed`)."""
        self.set_up_failed = at

    def mark_ok(self) -> None:
        self.answers += 1
        if self._failures:
            logger.info("node %s answers again", self.name)
        self._failures = 0
        self.down_until = 0.0

    def note_round_trip(self, seconds: float) -> None:
        """One reply read ``seconds`` after its request was sent."""
        self.round_trip_sum += seconds
        self.round_trips[bisect.bisect_left(ROUND_TRIP_BUCKETS, seconds)] += 1

    def reset_backoff(self) -> None:
        self._failures = 0
        self.down_until = 0.0


Request = Call | Command | Chain | None


def nodes_to_skip(nodes: Sequence[NodeClient], requests: Sequence[Request], now: float,
                  skip_backoff: bool) -> list[bool]:
    """Which nodes a round skips because they failed recently.

    Skipping saves a timeout per round on a dead node, but never when it would
    leave fewer than a quorum to ask: then every node gets its chance (with a
    single node, a node that failed once would otherwise refuse every request
    for the length of its back-off).
    """
    n = len(nodes)
    if not skip_backoff:
        return [False] * n
    skip = [requests[i] is not None and nodes[i].backing_off(now) for i in range(n)]
    if n - sum(skip) < n // 2 + 1:
        return [False] * n
    return skip


#: The deadline (the transport's clock; ``inf``: none) of the acquire that the
#: rounds of this thread or task serve, set by ``LockBase._start_acquire``;
#: 0.0 (the default, or a past value) means no time to spare beyond the node
#: timeout. See :func:`connection_wait`.
call_deadline: ContextVar[float] = ContextVar("redlock_call_deadline", default=0.0)


def round_began(start: float, clock: Callable[[], float]) -> float:
    """When a round that began at ``start`` on the transport's ``clock`` began,
    on ``time.monotonic`` (the clock a set-up's failure is stamped with): the
    two agree whatever clock a manager was given."""
    return time.monotonic() - max(clock() - start, 0.0)


def connection_wait(node: NodeClient, start: float, until: float | None) -> float:
    """How long a round that starts at ``start`` waits for a connection to
    ``node``: its node timeout, or up to the caller's deadline ``until`` when
    that is later (a call with no time left is not held past its node timeout,
    issue 17: ``acquire(timeout=T)`` returns by T plus one node timeout).

    The wait is bounded by the node's health too, not only by the clock: a
    round waits only while a set-up is in flight (:meth:`NodeClient._grow`),
    each step of a set-up (the TCP connect, each handshake reply, the scripts)
    waits at most the connect timeout for the node, and a set-up that fails
    ends every wait at once. So a node that is gone, paused (TCP still
    connects, the handshake's first reply never comes) or black-holed ends the
    wait within about one connect timeout, whatever time the caller has left.

    What the clock alone cannot tell apart is a slow node from a slow
    process, so it is not used for that:

    * every connection in use by other rounds: this round waits its turn,
      which is queueing, not an outage (a burst of 200 rounds on two loaded
      cores kept some in line longer than the connect timeout, and a healthy
      quorum was reported unavailable; issue 25, seen again in CI);
    * a first set-up that answers every step in time but takes longer than
      the connect timeout as a whole (a starved CPU, a distant node): rounds
      used to stop waiting for a cold node at the connect timeout, and 1 of
      200 threads of a burst on a loaded CPU, one node of three down, got
      ``QuorumUnavailable`` while the other two were up, their first set-ups
      still under way (seen in CI; ``tests/test_connections.py`` drives it
      with a distant node).
    """
    wait = node.timeout
    if until is not None and until - start > wait:
        wait = until - start
    return wait


class _NodeDone(Exception):
    """A node's exchange ended without its reply: the result to report instead."""

    def __init__(self, result: NodeError) -> None:
        super().__init__(result.reason)
        self.result = result


def router_of(nodes: Sequence[NodeClient]) -> Any:
    """The router of the first node that needs one (a Sentinel or Cluster node:
    ``NodeClient.router``, set by transport/nodekinds.py), or None."""
    return next((node.router for node in nodes if node.router is not None), None)


class SyncTransport:
    """Sends one request per node and gathers the replies within the node timeouts."""

    def __init__(self, nodes: Sequence[NodeClient], *, clock: Callable[[], float] = time.monotonic) -> None:
        self.nodes = list(nodes)
        self.clock = clock
        #: A Sentinel or Cluster node among them: rounds go through its router
        #: (nodekinds.routed_round: where each request goes, MOVED, failover).
        self.router = router_of(self.nodes)
        self.routed = self.router is not None

    def round(self, requests: Sequence[Request], *, skip_backoff: bool = True,
              settle: Settle | None = None, tag: Any = None, final: bool = False,
              last: int | None = None, until: float | None = None) -> list[Any]:
        """:meth:`_round`, as a section (transport/finalizers.py): a release a
        garbage collection runs meanwhile in this thread waits until it ends.
        It takes the nodes' locks (a connection's checkout, the owed
        replies) this round may hold, whoever called it: the manager, its
        ``force_release``, the late sender's thread, an asyncio call run
        through this transport."""
        finalizers.enter()
        try:
            return self._round(requests, skip_backoff=skip_backoff, settle=settle, tag=tag,
                               final=final, last=last, until=until)
        finally:
            finalizers.leave()

    def _round(self, requests: Sequence[Request], *, skip_backoff: bool = True,
               settle: Settle | None = None, tag: Any = None, final: bool = False,
               last: int | None = None, until: float | None = None) -> list[Any]:
        """Ask node i ``requests[i]`` (None: do not ask it); return answers or errors.

        Each result is the node's reply, a :class:`NodeError` (no answer in time) or
        a ``redis.ResponseError`` (the node answered with an error). With
        ``settle``, the round may return before every node answered: the others'
        results are :data:`NOT_AWAITED` (see the module docstring).

        ``tag``, the lock token the round is for, keeps that token's requests in
        order on each node (:meth:`NodeClient.checkout`); ``final`` says no
        round of that token follows (a release), so what it leaves owed is
        nobody's. ``last``: a node to send to after the others.

        A node without an idle connection waits for one
        (:meth:`NodeClient.wait_connection`) after the others were sent
        theirs (:func:`connection_wait`: its node timeout, or up to ``until``,
        the caller's deadline, when it has one); the nodes' set-ups run in
        parallel. A connection taken idle that the node
        closed meanwhile (it restarted) is replaced once, and the request sent
        again: the node never saw it.
        """
        if self.routed:
            routed: list[Any] = self.router.round(
                self, requests, skip_backoff=skip_backoff, settle=settle, tag=tag, final=final,
                last=last, until=until)
            return routed
        nodes = self.nodes
        n = len(nodes)
        if until is None:
            until = call_deadline.get()
        results: list[Any] = [None] * n
        conns: list[Any] = [None] * n
        expects: list[Any] = [None] * n
        deadlines = [0.0] * n
        start = self.clock()
        skip = nodes_to_skip(nodes, requests, start, skip_backoff)
        try:
            # Nodes with an open connection are asked first; a node that needs a
            # connection waits for one after them, so a black-holed node stalling
            # in its connect handshake cannot hold back the healthy nodes' requests.
            fresh: list[int] = []
            reused = [False] * n
            order: Sequence[int] = range(n)
            if last is not None:
                order = [i for i in range(n) if i != last] + [last]
            for i in order:
                if requests[i] is None:
                    continue
                node = nodes[i]
                if skip[i]:
                    results[i] = NodeError(node.name, "skipped: failed recently", sent=False,
                                           skipped=True)
                    continue
                try:
                    conns[i], expects[i] = node.checkout(start, tag)
                except NodeError as e:
                    results[i] = e
                    continue
                if conns[i] is None or conns[i]._sock is None:
                    if conns[i] is not None:  # pragma: no cover - an owed one closed under us
                        node._drop(conns[i])
                        conns[i] = None
                    fresh.append(i)
                else:
                    reused[i] = not expects[i]
                    self._send(i, requests[i], conns, expects, results, deadlines)
            for i in fresh:
                nodes[i].want_connection()
            for i in fresh:
                self._connect_and_send(i, requests[i], conns, expects, results, deadlines,
                                       start, until, tag)
            # Each node's deadline counts from its own send: one slow connect
            # costs the others nothing.
            live = [i for i in range(n) if conns[i] is not None and results[i] is None]
            if settle is not None and settle.need <= 0:
                pass  # nobody waits: every reply is owed (rounds.NO_WAIT)
            elif settle is not None and len(live) > 1:
                self._read_until_settled(live, conns, expects, results, deadlines, settle,
                                         asked=sum(r is not None for r in requests))
            else:
                for i in live:
                    results[i] = self._read_up_to_mine(i, conns[i], expects[i], deadlines[i])
            for i in range(n):
                result = results[i]
                if reused[i] and isinstance(result, NodeError) and result.closed:
                    # The node closed this idle connection (a restart): once more
                    # on a new one, or the restarted node sits out this round.
                    results[i] = None
                    expects[i] = deque()
                    if conns[i] is not None:
                        conns[i].disconnect()
                        conns[i] = None
                    self._connect_and_send(i, requests[i], conns, expects, results, deadlines,
                                           self.clock(), until, tag)
                    if results[i] is None:
                        results[i] = self._read_up_to_mine(i, conns[i], expects[i],
                                                           deadlines[i])
                    again = results[i]
                    if result.sent and isinstance(again, NodeError) and not again.sent:
                        # The first copy left: the node may have run it before
                        # it closed the connection (see _read_next). Said so,
                        # or the engine would take a grant for a request that
                        # never ran, and leave it on the node for a lease.
                        again.sent = True
        finally:
            for i in range(n):
                conn = conns[i]
                if conn is None:
                    continue
                expect = expects[i]
                if expect:
                    for k, (request, _, due) in enumerate(expect):
                        expect[k] = (request, False, due)  # nobody waits for them now
                    if results[i] is None:
                        results[i] = NOT_AWAITED
                    nodes[i].owe(conn, expect, None if final else tag)
                else:
                    nodes[i].put(conn)
        return results

    def _connect_and_send(self, i: int, request: Request, conns: list[Any], expects: list[Any],
                          results: list[Any], deadlines: list[float], start: float,
                          until: float | None, tag: Any = None) -> None:
        node = self.nodes[i]
        try:
            conns[i] = node.wait_connection(start, until, self.clock)
        except NodeError as e:
            if isinstance(request, Call) and request.script.releases:
                node.deliver_later(request, tag)  # never dropped for want of time
            results[i] = e
            return
        expects[i] = deque()
        self._send(i, request, conns, expects, results, deadlines)

    def _send(self, i: int, request: Request, conns: list[Any], expects: list[Any],
              results: list[Any], deadlines: list[float]) -> None:
        node, conn, expect = self.nodes[i], conns[i], expects[i]
        assert request is not None
        # A new connection (or one we have not used before, lent by a cache's
        # pool) loads the scripts first; see resp.PRELOAD.
        sock = conn._sock
        preload = sock is None or not getattr(conn, _LOADED, False)
        try:
            if preload:
                conn.send_packed_command((PRELOAD, request.packed), check_health=False)
            else:
                # The socket itself: what send_packed_command does for one
                # packed request on a live connection, without its checks.
                try:
                    sock.sendall(request.packed)
                except TimeoutError as e:  # socket.timeout
                    conn.disconnect()
                    raise RedisTimeoutError("Timeout writing to socket") from e
                except BaseException:
                    conn.disconnect()
                    raise
        except NODE_DOWN_ERRORS as e:
            node.mark_failed(self.clock())
            # Owed requests may have run; this one did not.
            results[i] = NodeError(node.name, _short(e), sent=False,
                                   closed=isinstance(e, (RedisConnectionError, OSError)))
            conns[i] = None
            conn.disconnect()
            node.put(conn)
            return
        deadline = deadlines[i] = self.clock() + node.timeout
        if preload:
            setattr(conn, _LOADED, True)
            expect.extend((None, False, deadline) for _ in PRELOAD_SCRIPTS)
        if type(request) is Chain:
            expect.extend((None, False, deadline) for _ in request.lead)  # read, dropped
            pending = _Pending(request)
            expect.append((pending, False, deadline))
            expect.append((pending, True, deadline))
        else:
            expect.append((request, True, deadline))

    def _read_up_to_mine(self, i: int, conn: Any, expect: Deque[Expected], deadline: float,
                         *, block: bool = True, ready: bool = False) -> Any:
        """Read replies on ``conn`` up to and including this round's; return its result.

        With ``block=False`` (a settled round: ``ready``, its ``poll`` just
        said node ``i`` sent something; or the node's deadline passed), stop
        when no whole reply is in the parser and nothing more came on the
        socket, and return None (:class:`_NotYet`). Not ``can_read``: it says
        True for part of a reply in the parser's buffer, and the next read
        waited for the rest of it.
        """
        try:
            while True:
                mine, reply = self._read_next(i, conn, expect, deadline, wait=block, ready=ready)
                if mine:
                    return reply
                ready = False  # read since
        except _NotYet:  # nothing more came yet
            return None
        except _NodeDone as done:
            return done.result

    def _read_next(self, i: int, conn: Any, expect: Deque[Expected], deadline: float,
                   *, wait: bool = True, ready: bool = False) -> tuple[bool, Any]:
        """Read the next reply on ``conn``: ``(True, reply)`` when it is this round's.

        The whole reply is read by ``deadline``, not each ``recv`` within the
        node timeout (:class:`_Reads`); a reply owed by an earlier round by
        its own due time, when that is sooner (a node must not keep an owed
        connection alive, and every round on it waiting, by sending a byte now
        and then). With ``wait`` False (a settled round), a reply not yet
        whole raises :class:`_NotYet` when nothing more came: the round reads
        it on when more came, and the other nodes meanwhile (``ready``: its
        ``poll`` just found the socket readable).

        A reply owed by an earlier round is dropped. ``NOSCRIPT`` sends this
        round's own request again as ``EVAL``, and an owed release too; any
        other owed request is dropped (sent again, it would run after the
        requests behind it). A node that fails
        raises :class:`_NodeDone`, after its connection was disconnected (a
        late reply must never be read as the answer to a later command).
        """
        node = self.nodes[i]
        request, mine, expect_due = expect[0]
        try:
            if conn._sock is None:
                raise RedisConnectionError("Connection closed by server.")
            reads = _armed(conn, expect_due if expect_due < deadline else deadline, node.timeout,
                           self.clock, wait, ready)
            try:
                if wait:
                    reply = conn.read_response()
                else:  # _NotYet must not drop the connection (redis-py's default)
                    reply = conn.read_response(disconnect_on_error=False)
            finally:
                reads.deadline = None  # _disarm, inline: every round passes here
                reads.direct = True
        except _NotYet:
            raise
        except NoScriptError as e:
            # The node lost its scripts (SCRIPT FLUSH under a live connection):
            # the next request on this connection loads them again first.
            expect.popleft()
            setattr(conn, _LOADED, False)
            node.mark_ok()
            if type(request) is _Pending:
                return self._chain_again(node, conn, expect, request, e)
            if not mine and not getattr(request, "last_of_token", False):
                # An owed request that never ran, and that must not run later:
                # sent again it would go behind requests sent after it (an
                # attempt's clean-up behind the next attempt would delete its
                # grant). Nobody counted on it.
                return False, None
            # This round's own request, or a release (nothing of its token
            # follows, so it may run after the rest): send it again as EVAL.
            if request.packed_eval is None:  # pragma: no cover - only scripts answer NOSCRIPT
                return mine, ResponseError("NOSCRIPT")
            try:
                conn.send_packed_command((request.packed_eval,), check_health=False)
            except NODE_DOWN_ERRORS as e:
                raise _NodeDone(self._fail(node, conn, expect, _short(e))) from e
            expect.append((request, mine, self.clock() + node.timeout))
            return False, None
        except ResponseError as e:
            expect.popleft()
            node.mark_ok()
            if type(request) is _Pending:
                return request.take(e, mine)
            return mine, e
        except RedisTimeoutError as e:
            raise _NodeDone(self._fail(node, conn, expect,
                                       f"no answer within {node.timeout:g} s")) from e
        except NODE_DOWN_ERRORS as e:
            done = self._fail(node, conn, expect, _short(e))
            # Closed by the node: before it read anything of ours (a restart
            # closed this idle connection), and then the round sends the
            # request once more on a new connection; or after it ran it (the
            # node died before its reply was read), and then the request
            # stays "sent" whatever the second try gives. The two look the
            # same from here. Timeline of the second (a Sentinel master killed
            # in the bench's failover section, 2 of 6 kills)::
            #
            #   t0  the acquire goes out on the master's pooled connection
            #   t0  the master runs it (its replica gets the key) and dies
            #   t0  the read finds the connection closed; the second try is
            #       refused: "not sent", so no clean-up was sent anywhere
            #   t2  the replica is promoted with the key: every acquire is
            #       refused as busy until the lease ends (10 s)
            done.closed = mine and isinstance(e, RedisConnectionError)
            raise _NodeDone(done) from e
        except InvalidResponse as e:  # not Redis speaking there (issue 26)
            raise _NodeDone(self._fail(node, conn, expect, not_redis_reason(e))) from e
        except BaseException:
            # Interrupted (KeyboardInterrupt, a timeout signal): the reply may
            # still arrive, so this connection must never be reused.
            conn.disconnect()
            expect.clear()
            raise
        expect.popleft()
        node.mark_ok()
        if type(request) is _Pending:
            mine, reply = request.take(reply, mine)
        if mine:  # an owed reply is read late by design: it says nothing of the node
            node.note_round_trip(self.clock() - (expect_due - node.timeout))
        return mine, reply

    def _chain_again(self, node: NodeClient, conn: Any, expect: Deque[Expected],
                     pending: _Pending, error: NoScriptError) -> tuple[bool, Any]:
        """A chain's first request answered ``NOSCRIPT`` (``expect[0]`` is now
        the reply of the command behind it). The round's own chain goes again
        whole, the script as ``EVAL``: the command behind it must follow the
        run that counts. The old second reply is then read and dropped. An owed
        chain is not sent again (see :meth:`_read_next`): its reply is the error.
        """
        pending.first = error
        _, then_mine, then_due = expect[0]
        packed_eval = pending.chain.first.packed_eval
        if not then_mine or packed_eval is None:
            return False, None
        lead = pending.chain.lead
        try:
            conn.send_packed_command((*(c.packed for c in lead), packed_eval,
                                      pending.chain.then.packed), check_health=False)
        except NODE_DOWN_ERRORS as e:
            raise _NodeDone(self._fail(node, conn, expect, _short(e))) from e
        expect[0] = (pending, False, then_due)
        again = _Pending(pending.chain)
        due = self.clock() + node.timeout
        expect.extend((None, False, due) for _ in lead)
        expect.append((again, False, due))
        expect.append((again, True, due))
        return False, None

    def _fail(self, node: NodeClient, conn: Any, expect: Deque[Expected],
              reason: str) -> NodeError:
        """Disconnect (a late reply must never answer a later command), back off."""
        conn.disconnect()
        expect.clear()
        node.mark_failed(self.clock())
        return NodeError(node.name, reason)

    def _read_until_settled(self, live: list[int], conns: list[Any],
                            expects: list[Deque[Expected]], results: list[Any],
                            deadlines: list[float], settle: Settle, *, asked: int) -> None:
        """Read replies as they come, from whichever node answers first, until
        ``settle`` says the outcome is known (or every node answered)."""
        yes = no = 0
        give_up_at = asked - settle.need + 1  # this many noes: need is out of reach
        poller = select.poll()
        by_fd: dict[int, int] = {}
        fd_of: dict[int, int] = {}
        for i in live:
            fd = conns[i]._sock.fileno()
            by_fd[fd] = i
            fd_of[i] = fd
            poller.register(fd, select.POLLIN)
        pending = len(live)
        also = settle.also if settle.also in live else None
        also_until = 0.0
        while pending:
            now = self.clock()
            limit = min(deadlines[i] for i in by_fd.values())
            if yes >= settle.need or (no >= give_up_at and yes + no >= settle.need):
                if also is None or results[also] is not None:
                    break
                # Decided; node ``also`` gets a short grace, never a timeout.
                also_until = also_until or now + ALSO_GRACE
                if now >= also_until:
                    break
                limit = min(limit, also_until)
            wait = limit - now
            events = poller.poll(max(0.0, wait) * 1000.0 + 0.5) if wait > 0 else []
            ready = [by_fd[fd] for fd, _ in events]
            if not ready:
                now = self.clock()
                ready = [i for i in by_fd.values() if deadlines[i] <= now]
            for i in ready:
                result = self._read_up_to_mine(i, conns[i], expects[i], deadlines[i],
                                               block=False, ready=bool(events))
                if result is None:
                    continue
                results[i] = result
                pending -= 1
                fd = fd_of[i]
                del by_fd[fd]
                poller.unregister(fd)
                if settle.yes(result):
                    yes += 1
                elif settle.no(result):
                    no += 1

    def forget(self, tag: Any) -> None:
        """Lock token ``tag`` is done (its acquire gave up): see NodeClient.checkout.
        A section, as :meth:`round` is: it holds the nodes' owed-reply locks."""
        finalizers.enter()
        try:
            for node in self.nodes:
                node.forget(tag)
        finally:
            finalizers.leave()

    def close(self) -> None:
        for node in self.nodes:
            node.close()
