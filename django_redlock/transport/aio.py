"""The asyncio transport: every node asked concurrently, from the running event loop.

(Why one module of 1,600 lines: its connections per loop, their set-ups, the
replies left behind by settled rounds and the requests sent behind them are
one state, read and changed by every round; split, each part would reach into
the others'.)

Same contract as :class:`~django_redlock.transport.sync.SyncTransport`: a round asks
node *i* ``requests[i]`` and returns, per node, the reply, a :class:`NodeError` (no
answer in time; ``sent`` says whether the request may have been executed) or a
``redis.ResponseError``. A round writes the request to every node first and then
reads the replies, each within its node's own deadline (connections that need
opening are opened concurrently first), so it costs about one round trip to the
slowest node that answers in time, with no task per node. Scripts go by
``EVALSHA`` with one ``EVAL`` after ``NOSCRIPT``. A connection whose exchange
timed out or was cancelled is disconnected, never reused: a late reply must never
be read as the answer to a later command. The back-off of failed nodes is the sync :class:`NodeClient`'s own
(``backing_off`` / ``mark_failed``), so a node found dead by one flavour is skipped
by both.

Connections and event loops
    asyncio connections belong to the loop that opened them, and one manager may
    serve several loops (Django runs async views in a fresh loop per request under
    the test client and ``async_to_sync``; ASGI servers run one long-lived loop).
    So the idle connections are kept *per running loop*, in a weak dictionary
    keyed by the loop. They are closed when that loop shuts down: the first use
    in a loop starts a tiny async generator (:func:`_loop_guard`) which the loop
    tracks through its async-generator hooks; ``asyncio.run`` (hence uvicorn and
    most servers) and asgiref's ``async_to_sync`` call
    ``loop.shutdown_asyncgens()`` before ``loop.close()``, and
    the generator's ``finally`` disconnects that loop's connections. A loop
    closed without that call leaves its connections to the garbage collector;
    its entry is pruned the next time a loop is added.

    A process that runs each call in a loop of its own (an async view under a
    WSGI server: Django runs it with ``async_to_sync``, a new loop per request)
    would open a connection to every node per call (202 for 200 requests,
    issue 25). So once :data:`PER_CALL_LOOPS` of a transport's loops have shut
    down, the rounds of every new loop go through the sync transport and its
    process-wide connections: one blocking round trip in a loop that serves
    one call costs nothing to anyone else. A long-lived loop (an ASGI server)
    never shuts down and keeps its asyncio connections.

    The pool is a plain list of idle ``redis.asyncio`` connections per node (not a
    ``redis.asyncio.ConnectionPool``): taking and returning a connection is
    synchronous, so a cancellation can never land between "read the reply" and
    "give the connection back" and leak it from the pool's accounting.

Connection parameters
    A URL node gets the connection class and keyword arguments that
    ``redis.asyncio`` derives from its URL and node ``OPTIONS``, like the sync
    pool; the socket timeouts are replaced by the round's own deadlines (the
    connect timeout stays). A ``cache:<alias>`` node cannot share
    the django-redis cache's pool (it is synchronous), so its asyncio connections
    are built from that pool's ``connection_kwargs`` (host, port, db, password,
    TLS settings...), keeping only the plain values the asyncio connection class
    accepts.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import redis.asyncio.connection as aconn
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError

from . import finalizers
from .resp import PRELOAD, PRELOAD_SCRIPTS, Call, Chain, ChainReply
from .sync import (
    ALSO_GRACE,
    NODE_DOWN_ERRORS,
    NOT_AWAITED,
    PARALLEL_SETUPS,
    NodeClient,
    NodeError,
    Request,
    Settle,
    SyncTransport,
    _short,
    call_deadline,
    connection_wait,
    nodes_to_skip,
    not_redis_reason,
    round_began,
    router_of,
    unread_bytes,
)

_HIREDIS_PARSER: Any = None  # redis-py's hiredis parser, whose replies _response reads itself
_NOT_ENOUGH_DATA: Any = None
try:
    from redis._parsers import hiredis as _hiredis_parsers

    _HIREDIS_PARSER = _hiredis_parsers._AsyncHiredisParser
    _NOT_ENOUGH_DATA = _hiredis_parsers.NOT_ENOUGH_DATA
except (ImportError, AttributeError):  # pragma: no cover - then its own read
    pass

if sys.version_info >= (3, 11, 3):
    from asyncio import timeout as _timeout
else:  # pragma: no cover - redis-py depends on async-timeout on these versions
    # mypy cannot evaluate a 3-part version test, so it reads this branch on 3.11.3+
    # too, where async-timeout is not installed and _timeout is already defined
    from async_timeout import timeout as _timeout  # type: ignore[import-not-found, no-redef, unused-ignore]

logger = finalizers.get_logger("django_redlock.transport")

#: Idle connections kept per node and loop when the node sets no ``max_connections``.
DEFAULT_MAX_IDLE = 50

#: Keyword arguments of a sync pool that are objects of the sync flavour (or
#: plumbing of the sync pool) and must not reach an asyncio connection.
_SYNC_ONLY_KWARGS = frozenset({
    "retry", "redis_connect_func", "connection_pool", "event_dispatcher", "himport_registry",
    "maint_notifications_config", "maint_notifications_pool_handler",
    "oss_cluster_maint_notifications_handler", "parser_class", "encoder_class", "cache",
    "cache_config", "command_packer",
})
#: Non-plain values that are still meaningful to an asyncio connection.
_OBJECT_KWARGS = frozenset({"credential_provider", "socket_keepalive_options"})


def _accepted(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for pname, param in inspect.signature(init).parameters.items():
            if param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD):
                names.add(pname)
    return names


def _async_class_for(sync_class: type) -> type:
    import redis.connection as sconn

    if issubclass(sync_class, sconn.UnixDomainSocketConnection):
        return aconn.UnixDomainSocketConnection
    if issubclass(sync_class, sconn.SSLConnection):
        return aconn.SSLConnection
    return aconn.Connection


def connection_params(node: NodeClient) -> tuple[type, dict[str, Any], int]:
    """``(asyncio connection class, its kwargs, max idle)`` for one node.

    Also starts the thread that sends the signals of the releases a garbage
    collection runs (``finalizers.prepare``), as a sync node's first
    connection does: a task destroyed while pending inside ``async with
    lock`` is one."""
    finalizers.prepare()
    if node.spec.kind == "cluster":  # never connected to: its masters are (nodekinds)
        return aconn.Connection, {}, 0
    if node.spec.kind == "sentinel":  # its master's address comes at set-up (_setup)
        options = {k: v for k, v in node.spec.options.items() if k != "max_connections"}
        kwargs = {**options, "client_name": options.get("client_name", "django-redlock")}
        cls: type = aconn.SSLConnection if node.spec.addresses[0].startswith("rediss") \
            else aconn.Connection
        max_idle = int(node.spec.options.get("max_connections") or DEFAULT_MAX_IDLE)
    elif node.spec.kind == "cache":
        sync_pool = node.pool  # the django-redis cache's own (see NodeClient)
        cls = _async_class_for(sync_pool.connection_class)
        accepted = _accepted(cls)
        kwargs = {
            k: v for k, v in sync_pool.connection_kwargs.items()
            if k in accepted and k not in _SYNC_ONLY_KWARGS
            and (k in _OBJECT_KWARGS or v is None or isinstance(v, (str, bytes, int, float)))
        }
        max_idle = getattr(sync_pool, "max_connections", None) or DEFAULT_MAX_IDLE
    else:
        options = dict(node.spec.options)
        max_idle = int(options.pop("max_connections", 0) or DEFAULT_MAX_IDLE)
        kwargs = dict(options)
        kwargs["socket_connect_timeout"] = node.connect_timeout
        kwargs.setdefault("client_name", "django-redlock")
        kwargs.update(aconn.parse_url(node.spec.url))  # URL query options win, as in redis-py
        cls = kwargs.pop("connection_class", aconn.Connection)
    kwargs["decode_responses"] = False  # the engine parses bytes
    # The lock's connect bound wins over a longer one from the URL or a cache.
    kwargs["socket_connect_timeout"] = node.connect_timeout
    # Every exchange is bounded by the round's own per-node deadline; a socket
    # timeout on top would only make redis-py wrap each send in one more task.
    kwargs["socket_timeout"] = None
    return cls, kwargs, min(int(max_idle), 2 ** 16)


class _NodeConns:
    """The idle connections of one node in one event loop, and its set-ups.

    Connection set-up is shared, as in the sync transport
    (:meth:`NodeClient.wait_connection`, whose rules these are): a round that
    finds no idle connection waits in line for the first to come free, one
    set up for it or for another round, or one given back. A burst of rounds
    on a cold loop thus opens a few connections at a time instead of one per
    round and node at once (50 concurrent acquisitions opened 250 and timed
    out, issue 25). A failed set-up ends every wait at once with its reason.

    * Until a set-up succeeded in this loop (``accepting``), one runs at a
      time (a task each of whose steps waits at most the node's connect
      timeout): the node may be down or black-holed, and one probe tells
      every waiter.
    * Once one succeeded, up to :data:`PARALLEL_SETUPS` run at once.
    * A round waits up to its caller's deadline either way
      (:func:`connection_wait`): while a set-up is in flight the node has not
      failed, and waiting in line is queueing, not an outage. With one set-up
      at a time and waits capped at 1 s, 200 acquisitions on a fresh loop and
      a starved CPU had 45 rounds time out in line on every node while each
      node served the others, and a healthy quorum was reported unavailable
      (issue 25, seen in CI); the sync transport had been fixed so, and this
      one had not followed.
    """

    __slots__ = ("accepting", "behind", "cls", "failed", "idle", "inflight", "kwargs", "later",
                 "later_tags", "max_idle", "open", "setting_up", "waiters", "tasks")

    def __init__(self, cls: type, kwargs: dict[str, Any], max_idle: int) -> None:
        self.cls = cls
        self.kwargs = kwargs
        self.max_idle = max_idle
        self.idle: list[Any] = []
        self.open: weakref.WeakSet[Any] = weakref.WeakSet()
        self.setting_up = 0
        #: A set-up succeeded in this loop, and none failed since (see above).
        self.accepting = False
        #: The last failed set-up: (when, on time.monotonic; its error). A
        #: round that began before it takes it as its answer (:meth:`wait`).
        self.failed: tuple[float, NodeError] | None = None
        self.waiters: deque[asyncio.Future[Any]] = deque()
        self.tasks: set[asyncio.Task[None]] = set()
        #: Releases to send first on the connection being set up (see
        #: NodeClient.deliver_later).
        self.later: list[tuple[bytes, Any]] = []
        #: The tokens of those releases, until each ran (see round's ``tag``).
        self.later_tags: list[Any] = []
        #: Replies a settled round did not wait for, still being read, by lock
        #: token: that token's next request to this node is sent behind it on
        #: the same connection, so that on this node they run in the order sent
        #: (an acquire before its release, as the sync transport's owed
        #: connections keep them).
        self.inflight: dict[Any, _Exchange] = {}
        #: Every reply a settled round left to be read, oldest first: with no
        #: idle connection, a round sends behind the newest (as the sync
        #: transport pipelines behind an owed connection) instead of waiting
        #: for a new connection while those replies are on their way.
        self.behind: list[_Exchange] = []

    def tail(self) -> "_Exchange | None":
        """The newest exchange still reading a left-behind reply that nothing
        was sent behind yet, or None."""
        for exchange in reversed(self.behind):
            if not exchange.task.done() and not exchange.taken and exchange.conn is not None:
                return exchange
        return None

    def take(self) -> Any:
        """An idle connection, or None (then :meth:`wait`)."""
        return self.idle.pop() if self.idle else None

    def give(self, conn: Any) -> bool:
        """Keep ``conn`` for the next round (a waiting one first); False when it
        must be closed instead."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return True
        if len(self.idle) >= self.max_idle:
            return False
        self.idle.append(conn)
        return True

    async def wait(self, node: NodeClient, start: float, until: float,
                   clock: Callable[[], float], asked: float) -> Any:
        """A connected connection for a round whose wait for it starts at
        ``start``, or a :class:`NodeError` (returned) when none came in time
        (:func:`connection_wait`; ``until``: the caller's deadline).
        ``asked``: when the round began (``start``, or earlier when it waited
        for an earlier request first)."""
        if (self.failed is not None and not self.idle
                and self.failed[0] >= round_began(asked, clock)):
            # A set-up failed since this round began (it waited for an
            # earlier request meanwhile): that is the node's answer, as in
            # the sync transport; a new set-up would cost another connect
            # timeout on a node that is down or paused.
            return self.failed[1]
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        self._grow(node)
        got = None
        try:
            while True:
                left = start + connection_wait(node, start, until) - clock()
                if left <= 0:
                    return NodeError(node.name, "no connection yet (set-up under way, up to "
                                     f"{node.connect_timeout:g} s per step)", sent=False)
                done, _ = await asyncio.wait([waiter], timeout=min(left, 1.0))
                if done:
                    got = waiter.result()
                    return got
        finally:
            if got is None:
                if waiter.done() and not waiter.cancelled() and not isinstance(
                        waiter.result(), NodeError):
                    # Handed to us as the wait ended: pass it on.
                    if not self.give(waiter.result()):
                        await _disconnect(waiter.result())
                else:
                    waiter.cancel()

    def _grow(self, node: NodeClient) -> None:
        """Start set-ups while more rounds wait than set-ups are under way (one
        at a time until the node accepts, then up to PARALLEL_SETUPS)."""
        limit = PARALLEL_SETUPS if self.accepting else 1
        if self.setting_up >= limit:
            return
        waiting = sum(1 for w in self.waiters if not w.done())
        while self.setting_up < limit and waiting > self.setting_up:
            self._start_setup(node)

    def _start_setup(self, node: NodeClient) -> None:
        self.setting_up += 1
        node.note_set_up_began()  # now, not when the task gets to run
        task = asyncio.get_running_loop().create_task(self._setup(node))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _setup(self, node: NodeClient) -> None:
        conn = self.cls(**self.kwargs)
        self.open.add(conn)
        error: NodeError | None = None
        waiting_for, bound = "master address", node.connect_timeout  # what a TimeoutError means
        try:
            if node.moves:  # a Sentinel node: where its master is now (nodekinds)
                # One connect timeout per sentinel asked, as in the sync
                # set-up: a first sentinel that does not answer is given up
                # after its own, and the next names the master in time.
                bound = node.resolve_bound()  # type: ignore[attr-defined]
                async with _timeout(bound):
                    conn.host, conn.port = await asyncio.to_thread(node.resolve)  # type: ignore[attr-defined]
            # Each step (the TCP connect, each handshake reply, the scripts)
            # waits at most the connect timeout for the node, as in the sync
            # set-up (NodeClient.connect): a bound on the node, not on this
            # loop's CPU. One bound on the whole set-up failed a live node
            # whose steps all answered in time on a starved loop or a distant
            # link (connection_wait).
            waiting_for = "answer to a set-up step"
            conn.socket_timeout = node.connect_timeout
            read = conn.read_response

            async def read_counted(*args: Any, **kwargs: Any) -> Any:
                reply = await read(*args, **kwargs)
                node.note_set_up_reply()  # each step answered: the node is alive
                return reply

            # Also the handshake's replies, which redis-py reads itself (as
            # the sync set-up counts them, NodeClient.connect).
            conn.read_response = read_counted
            try:
                if hasattr(conn, "connect_check_health"):  # no retries: one bound
                    await conn.connect_check_health(check_health=False,
                                                    retry_socket_connect=False)
                else:  # pragma: no cover - redis-py < 6
                    await conn.connect()
                # The scripts, as the sync set-up loads them (resp.PRELOAD):
                # requests may then be sent behind others on a connection
                # without a NOSCRIPT making one of them go again out of order.
                await conn.send_packed_command(PRELOAD, check_health=False)
                for _ in PRELOAD_SCRIPTS:
                    try:
                        await conn.read_response()
                    except ResponseError:  # SCRIPT denied by an ACL: EVAL after NOSCRIPT
                        pass
            finally:
                conn.socket_timeout = None  # exchanges have the round's deadlines
                vars(conn).pop("read_response", None)
            waiting_for, bound = "reply to a release sent first", node.timeout
            while self.later:
                later, self.later = self.later, []
                try:
                    async with _timeout(bound):
                        await conn.send_packed_command([packed for packed, _ in later],
                                                       check_health=False)
                        for _ in later:
                            try:
                                await conn.read_response()
                                node.note_set_up_reply()
                            except ResponseError:
                                pass
                finally:
                    for _, tag in later:
                        if tag is not None and tag in self.later_tags:
                            self.later_tags.remove(tag)
        except asyncio.TimeoutError:  # not the builtin one on Python 3.10
            error = NodeError(node.name, f"no {waiting_for} within {bound:g} s",
                              sent=False)
        except (*NODE_DOWN_ERRORS, RedisError) as e:
            error = NodeError(node.name, not_redis_reason(e), sent=False)
        except Exception as e:  # noqa: BLE001 - anything else (a master address that
            # cannot be resolved, a pool that cannot be built) is this node's failure:
            # its waiters are told, as the sync set-up tells them
            error = NodeError(node.name, _short(e), sent=False)
        except BaseException:  # cancelled: the loop is closing
            self.setting_up -= 1
            await _disconnect(conn)
            raise
        self.setting_up -= 1
        if not self.setting_up:
            self.later = []  # no set-up left to carry them
            self.later_tags = []
        if error is not None:
            self.accepting = False
            self.failed = (time.monotonic(), error)
            node.note_set_up_failed(self.failed[0])
            await _disconnect(conn)
            node.mark_failed(self.failed[0])
            waiters, self.waiters = self.waiters, deque()
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(error)
            return
        self.accepting = True
        if not self.give(conn):  # pragma: no cover - only with max_connections reached
            await _disconnect(conn)
        self._grow(node)  # more rounds wait than there are connections


class _LoopConns:
    """Everything a transport keeps for one event loop."""

    def __init__(self, params: Sequence[tuple[type, dict[str, Any], int]]) -> None:
        self.nodes = [_NodeConns(*p) for p in params]
        self.closed = False
        self.guard: Any = None
        #: This loop's rounds go through the sync transport (PER_CALL_LOOPS).
        self.sync = False
        #: The connections of the node clients a routed round goes to (a
        #: Cluster node's masters come and go): see :meth:`of`.
        self.by_node: dict[NodeClient, _NodeConns] = {}
        #: The deadlines of this loop's exchanges (made in the loop).
        self.deadlines = _Deadlines(asyncio.get_running_loop())

    def of(self, node: NodeClient) -> _NodeConns:
        """``node``'s connections in this loop, made on first use."""
        found = self.by_node.get(node)
        if found is None:
            found = self.by_node[node] = _NodeConns(*connection_params(node))
        return found

    async def aclose(self) -> None:
        self.closed = True
        every = [*self.nodes, *self.by_node.values()]
        conns = [c for node in every for c in list(node.open)]
        for node in every:
            node.idle.clear()
            for task in list(node.tasks):
                task.cancel()
        await asyncio.gather(*(_disconnect(c) for c in conns), return_exceptions=True)


class _StateView:
    """One loop's state as a routed round sees it (transport/nodekinds.py):
    ``nodes[i]``, the connections of the node client request ``i`` goes to;
    everything else is the loop's state."""

    def __init__(self, state: _LoopConns, nodes: Sequence[NodeClient]) -> None:
        self._state = state
        self.nodes = [state.of(node) for node in nodes]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


async def _loop_guard(conns: _LoopConns, on_end: Callable[[], None]) -> AsyncIterator[None]:
    """Closes a loop's connections when the loop shuts down (see the module docstring)."""
    try:
        yield
    finally:
        on_end()
        await conns.aclose()


#: After this many of its event loops shut down, a transport sends the rounds
#: of every new loop through the sync transport (see the module docstring).
PER_CALL_LOOPS = 2


#: Connections closed by this process (a round's clean-up, a cancelled
#: task's, a loop's shutdown): a read that fails on one of them says nothing
#: of its node (see :meth:`AsyncTransport._read`).
_closed_here: "weakref.WeakSet[Any]" = weakref.WeakSet()


async def _disconnect(conn: Any) -> None:
    _closed_here.add(conn)
    try:
        await conn.disconnect(nowait=True)
    except (RedisError, OSError):  # already broken: nothing left to close
        pass


#: How long a passed deadline waits, once, for a reply whose bytes are
#: already here (:meth:`_Deadline.answered`): the task that reads them runs at
#: the loop's next turn.
LATE_GRACE = 0.02


class _Deadline:
    """A node's deadline on one connection: when it passes before :meth:`end`,
    the connection is aborted, which ends a write or read waiting on it with a
    connection error (``passed`` says it was the deadline).

    A deadline per node and round instead of an ``asyncio.timeout`` per write
    and per read: no task is cancelled to end a wait, so a round run where
    cancellation cannot reach it (the engine's releases) still ends on time.
    A connection that saw its deadline pass is never reused (it was aborted);
    one whose exchange timed out was closed before this too. The loop's
    :class:`_Deadlines` keeps it (one timer for all of them).
    """

    __slots__ = ("conn", "passed", "graced", "_watch")

    def __init__(self, conn: Any, delay: float, watch: "_Deadlines") -> None:
        self.conn = conn
        self.passed = False
        #: Whether it was given LATE_GRACE once (see :meth:`answered`).
        self.graced = False
        self._watch = watch
        watch.add(self, delay)

    def answered(self) -> bool:
        """Whether bytes of the node's reply are already here, unread: in the
        stream's buffer, or in the socket's.

        A loop blocked past a deadline (a synchronous call in a coroutine)
        runs the reply's read callback and this deadline's timer in the same
        turn, the timer first, before the task that reads the reply: aborting
        then took a node that had answered in time for a node that did not,
        and an acquire failed with a quorum up (a review saw 5 of 40 with the
        loop blocked 0.3 s and one node of three down). The sync transport
        reads a reply already come however late its thread runs; so does
        this one now, given :data:`LATE_GRACE` once."""
        reader = getattr(self.conn, "_reader", None)
        if reader is not None and getattr(reader, "_buffer", None):
            return True
        writer = getattr(self.conn, "_writer", None)
        extra = getattr(getattr(writer, "transport", None), "get_extra_info", None)
        try:
            sock = extra("socket") if extra is not None else None
        except Exception:  # noqa: BLE001 - a transport closing under us: nothing to read
            return False
        return unread_bytes(sock) > 0

    def expire(self) -> None:
        self.passed = True
        writer = getattr(self.conn, "_writer", None)  # redis-py's StreamWriter
        if writer is not None:
            writer.transport.abort()

    def end(self) -> None:
        self._watch.entries.pop(self, None)


class _Deadlines:
    """The deadlines in force in one event loop, and one loop timer for all.

    Why not a timer each: ``loop.call_later`` and ``cancel`` per exchange cost
    about 4 µs of a 1-node round trip's 90 (a heap entry made and cancelled,
    then skipped by the loop), and nearly every deadline is ended long before
    it passes. Here a deadline is a dict entry; the timer is set for the
    earliest entry only when none is set before it. When it fires it aborts
    what has passed and is set again for the earliest entry left, if any.
    So the timer is never later than the earliest live deadline: an entry
    ended before the timer fires leaves the timer early, never late; the
    deadlines of a busy loop are looked at about once per node timeout.
    """

    __slots__ = ("loop", "entries", "_handle", "_at")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        #: Each live deadline and when it passes, on the loop's clock.
        self.entries: dict[_Deadline, float] = {}
        self._handle: asyncio.TimerHandle | None = None
        self._at = float("inf")

    def add(self, deadline: _Deadline, delay: float) -> None:
        when = self.loop.time() + (delay if delay > 0.0 else 0.0)
        self.entries[deadline] = when
        if when < self._at:
            if self._handle is not None:
                self._handle.cancel()
            self._handle = self.loop.call_at(when, self._fire)
            self._at = when

    def _fire(self) -> None:
        self._handle, self._at = None, float("inf")
        now = self.loop.time()
        passed = [d for d, when in self.entries.items() if when <= now]
        for deadline in passed:
            del self.entries[deadline]
        if self.entries:
            self._at = min(self.entries.values())
            self._handle = self.loop.call_at(self._at, self._fire)
        for deadline in passed:
            try:
                answered = not deadline.graced and deadline.answered()
            except Exception:  # noqa: BLE001 - it passes all the same
                logger.exception("looking for a reply before a deadline passed failed")
                answered = False
            try:
                if answered:
                    deadline.graced = True  # the reader's task runs before this timer again
                    self.add(deadline, LATE_GRACE)
                    continue
                deadline.expire()
            except Exception:  # noqa: BLE001 - the other deadlines must still pass
                logger.exception("aborting a connection whose deadline passed failed")


#: redis-py's own write and read of a connection (see :func:`_direct`).
_PLAIN_IO = (getattr(aconn, "AbstractConnection", None),
             ("send_packed_command", "read_response"))
_direct_classes: dict[type, bool] = {}


def _direct(conn: Any) -> bool:
    """Whether requests go straight to ``conn``'s transport and replies come
    straight from its parser: true for redis-py's connection classes (their
    ``send_packed_command`` and ``read_response`` not overridden).

    Their layers cost about 11 µs per round trip here (a 1-node acquire +
    release is two), where the stream and the parser under them cost about
    2 µs more than a blocking socket: what they add is not needed by these
    exchanges (a socket timeout, which the rounds replace by their deadlines;
    health checks, which they turn off; a reconnect, which they never want;
    a disconnect after an error, which they make themselves).
    """
    cls = type(conn)
    ok = _direct_classes.get(cls)
    if ok is None:
        base, names = _PLAIN_IO
        ok = _direct_classes[cls] = base is not None and isinstance(conn, base) and all(
            getattr(cls, name, None) is getattr(base, name, None) for name in names) and all(
            hasattr(conn, attr) for attr in ("_writer", "_parser", "_host_error"))
    return ok


async def _response(conn: Any) -> Any:
    """The next reply on ``conn``, an error reply raised: redis-py's
    ``read_response`` without its layers (:func:`_direct`).

    With redis-py's hiredis parser, its ``read_response`` written out here
    (its reader fed from the stream until a reply is whole): two coroutines
    less per reply, about what one loop turn costs on the uncontended path.
    A push message (RESP3) goes to the parser's handler, as its own read
    sends it, and the reply is the next one."""
    if not _direct(conn):
        return await conn.read_response()
    parser: Any = conn._parser
    try:
        if _HIREDIS_PARSER is None or type(parser) is not _HIREDIS_PARSER:
            reply = await parser.read_response()
        else:
            while True:
                if not parser._connected:
                    raise RedisConnectionError("Connection closed by server.")
                reader = parser._reader
                reply = reader.gets()
                while reply is _NOT_ENOUGH_DATA:
                    data = await parser._stream.read(parser._read_size)
                    if not data or not isinstance(data, bytes):
                        raise RedisConnectionError("Connection closed by server.")
                    reader.feed(data)
                    reply = reader.gets()
                push = getattr(parser, "_hiredis_PushNotificationType", None)
                if push is None or not isinstance(reply, push):
                    break
                await parser.handle_push_response(reply)
            if isinstance(reply, RedisConnectionError):
                raise reply
            if isinstance(reply, list) and reply and isinstance(reply[0],
                                                                RedisConnectionError):
                raise reply[0]
    except OSError as e:  # worded as redis-py words it
        raise RedisConnectionError(
            f"Error while reading from {conn._host_error()} : {e.args}") from None
    if isinstance(reply, ResponseError):
        raise reply
    return reply


def _write_now(conn: Any, packed: bytes) -> bool | None:
    """:func:`_write` without a coroutine, where it needs no await: True
    when ``packed`` went to ``conn``'s transport and the socket took all of
    it; False when it went, and the rest waits in the transport's buffer
    (the caller awaits the stream's flow control); None when it was not
    written (the caller awaits :func:`_write`, which tells why).

    Why: a round writes to every node it asks, and the coroutines of
    ``_send`` and ``_write`` cost more than the write itself on the
    uncontended path (two per node and round trip)."""
    if not _direct(conn) or not conn.is_connected:
        return None
    writer = conn._writer
    if writer is None:
        return None
    transport = writer.transport
    if transport.is_closing():
        return None
    transport.write(packed)
    return not transport.get_write_buffer_size()


async def _write(conn: Any, packed: bytes) -> None:
    """Send ``packed`` on ``conn``: redis-py's ``send_packed_command`` without
    its layers (:func:`_direct`); the stream's flow control is waited for
    only when the socket took less than all of it.

    A connection closed meanwhile is an error, never connected again here
    (redis-py's ``send_packed_command`` would reconnect it): a request sent
    behind another (:meth:`AsyncTransport._behind`) found the connection
    closed by that one's deadline, and the reconnect's handshake read the
    stream while that task still read it ("read() called while another
    coroutine is already waiting", seen under a starved CPU). A connection
    comes only from a set-up, which loads the scripts and sends the
    releases handed to it first; a silent reconnect skips both."""
    if not conn.is_connected:
        raise RedisConnectionError(f"Error while writing to {conn._host_error()}: "
                                   "connection closed")
    writer = conn._writer if _direct(conn) else None
    if writer is None:
        await conn.send_packed_command(packed, check_health=False)
        return
    transport = writer.transport
    if transport.is_closing():
        raise RedisConnectionError(f"Error while writing to {conn._host_error()}: "
                                   "connection lost")
    transport.write(packed)
    if transport.get_write_buffer_size():
        await writer.drain()


class AsyncTransport:
    """Sends one request per node and gathers the replies within the node timeouts."""

    def __init__(self, nodes: Sequence[NodeClient], *, clock: Callable[[], float]) -> None:
        self.nodes = list(nodes)
        self.clock = clock
        self._params: list[tuple[type, dict[str, Any], int]] | None = None
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopConns] = \
            weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._ended_loops = 0
        self._sync: SyncTransport | None = None
        #: A Sentinel or Cluster node among them (see SyncTransport.routed).
        self.router = router_of(self.nodes)
        self.routed = self.router is not None

    #: A routed round's copy of the transport (nodekinds._view): its nodes are
    #: the node clients of that round, its loop state a _StateView; ``_base``
    #: the transport's own nodes.
    viewing = False
    _base: list[NodeClient] | None = None

    def _base_nodes(self) -> list[NodeClient]:
        return self._base if self._base is not None else self.nodes

    def _loop_ended(self) -> None:
        self._ended_loops += 1

    # -- per-loop state ------------------------------------------------------
    async def _conns(self) -> _LoopConns:
        if self.viewing:
            state = await self._base_conns()
            return _StateView(state, self.nodes)  # type: ignore[return-value]
        return await self._base_conns()

    async def _base_conns(self) -> _LoopConns:
        loop = asyncio.get_running_loop()
        state = self._loops.get(loop)
        if state is not None:
            return state
        with self._lock:
            if self._params is None:
                self._params = [connection_params(node) for node in self._base_nodes()]
            for old in [lp for lp in list(self._loops) if lp.is_closed()]:
                stale = self._loops.pop(old, None)
                if stale is not None and not stale.closed:
                    # Closed without shutdown_asyncgens() (``run_until_complete``
                    # then ``close()``): its guard never ran, and it did not
                    # count as ended. The reading tasks a settled round left
                    # in it never finish, each keeping the loop, its selector
                    # and a connection: a thousand such loops held 567 file
                    # descriptors, and under a limit of 1,024 every call
                    # failed with all nodes up. Counted now, after
                    # PER_CALL_LOOPS of them the next loops' rounds go
                    # through the sync transport, which leaves no task behind.
                    stale.closed = True
                    self._ended_loops += 1
            state = self._loops.get(loop)
            if state is None:
                state = self._loops[loop] = _LoopConns(self._params)
                state.sync = self._ended_loops >= PER_CALL_LOOPS
                if state.sync and self._sync is None:
                    self._sync = SyncTransport(self._base_nodes(), clock=self.clock)
                created = True
            else:
                created = False
        if created:
            # The first iteration registers the generator with this loop's
            # async-generator hooks; loop.shutdown_asyncgens() then closes it.
            state.guard = _loop_guard(state, self._loop_ended)
            await state.guard.__anext__()
        return state

    # -- rounds --------------------------------------------------------------
    async def round(self, requests: Sequence[Request], *, skip_backoff: bool = True,
                    last: int | None = None, until: float | None = None,
                    tag: Any = None, settle: Settle | None = None,
                    final: bool = False) -> list[Any]:
        """Ask node i ``requests[i]`` (None: do not ask it); return answers or errors.

        Each result is the node's reply, a :class:`NodeError` (no answer in time)
        or a ``redis.ResponseError`` (the node answered with an error).

        Like the sync transport, a round sends to every node first and only then
        reads the replies, in node order, each within its own deadline: the
        replies of the other nodes are buffered by their streams meanwhile, so
        reading in order costs nothing and needs no task per node. Nodes
        without an idle connection wait for one first, concurrently (see
        :class:`_NodeConns`; ``until`` as in the sync transport). A round
        that is cancelled disconnects every connection it had not finished with.
        ``last``: a node to send to after the others. ``tag``: the lock token
        the round is for; a node still to run a clean-up of that token, handed
        to its connection set-up, sits the round out (see
        ``NodeClient.deliver_later``).

        ``settle`` (as in the sync transport): the round returns as soon as
        its outcome is known; the other nodes' replies are read after it
        (:data:`NOT_AWAITED` in the results; by a :class:`_Reading` each, with
        no task), so one slow node costs an acquire or a release nothing. A request of the same
        ``tag`` to such a node is sent at once behind it on the same
        connection (``inflight``, :meth:`_behind`): on the node, requests of
        one token run in the order sent, and a request is never held back
        (what was sent runs even if the loop closes before its reply is read). ``final``: no
        request of that token follows (a release), so nothing waits for them.
        """
        state = None if self.viewing else self._loops.get(asyncio.get_running_loop())
        if state is None:
            state = await self._conns()
        if state.sync and self._sync is not None:
            # A loop per call (an async view under WSGI): the process-wide
            # connections, one blocking round trip in a loop that serves one call.
            return self._sync.round(requests, skip_backoff=skip_backoff, last=last, until=until,
                                    tag=tag, settle=settle, final=final)
        if self.routed:
            routed: list[Any] = await self.router.around(
                self, requests, skip_backoff=skip_backoff, last=last, until=until, tag=tag,
                settle=settle, final=final)
            return routed
        nodes = self.nodes
        n = len(nodes)
        results: list[Any] = [None] * n
        start = self.clock()
        skip = nodes_to_skip(nodes, requests, start, skip_backoff)
        asked: list[int] = []
        for i in range(n):
            if requests[i] is None:
                continue
            if skip[i]:
                results[i] = NodeError(nodes[i].name, "skipped: failed recently", sent=False,
                                       skipped=True)
                continue
            if tag is not None and tag in state.nodes[i].later_tags:
                results[i] = NodeError(nodes[i].name, "an earlier attempt's clean-up is "
                                       "still on its way", sent=False, skipped=True)
                continue
            asked.append(i)
        if not asked:
            return results
        conns: list[Any] = [None] * n
        deadlines = [start + nodes[i].timeout for i in range(n)]
        keep = [False] * n
        #: Node i's deadline on its connection, until its reply was read (or
        #: a settled round's reading or task reads it).
        watches: list[_Deadline | None] = [None] * n
        later: dict[int, _Exchange] = {}
        try:
            if tag is not None:
                for i in asked:
                    before = state.nodes[i].inflight.get(tag)
                    if before is not None and not before.task.done():
                        # This token's previous reply there is still being
                        # read: this request goes behind it (in a task).
                        behind = self._behind(state, i, requests[i], before, deadlines[i],
                                              until, tag)
                        if behind is not None:
                            later[i] = behind
            for i in asked:
                if i in later:
                    continue
                conn = state.nodes[i].take()
                if conn is not None and (not conn.is_connected or not nodes[i].accepts(conn)
                                         or (_stale_now(conn) is not False and await _stale(conn))):
                    await _disconnect(conn)  # the node closed it (a restart): a new one
                    conn = None
                tail = state.nodes[i].tail() if conn is None else None
                behind = None if tail is None else self._behind(
                    state, i, requests[i], tail, deadlines[i], until, tag)
                if behind is not None:
                    # No idle connection, but replies left behind are on their
                    # way on one: sent behind them (pipelined).
                    later[i] = behind
                elif conn is None:
                    # No idle connection: one is waited for (shared set-ups, see
                    # _NodeConns) by a task that then sends and reads, while
                    # the nodes with a connection are asked at once.
                    exchange = _Exchange(None, sent=False)
                    exchange.task = asyncio.get_running_loop().create_task(
                        self._connect_then(state, i, exchange, requests[i], start, until, tag))
                    later[i] = exchange
                conns[i] = conn
            live = [i for i in asked if conns[i] is not None]
            if last in live:
                live = [i for i in live if i != last] + [last]
            now = self.clock()
            for i in live:
                watch = watches[i] = _Deadline(conns[i], deadlines[i] - now, state.deadlines)
                written = _write_now(conns[i], requests[i].packed)  # type: ignore[union-attr]
                if written is not True:  # buffered (flow control) or not written here
                    results[i] = await self._send(nodes[i], conns[i], requests[i], watch,
                                                  written=written is False)
            sent = [i for i in live if results[i] is None]
            if settle is not None and (len(sent) + len(later) > 1 or settle.need <= 0):
                await self._read_settled(state, sent, later, conns, requests, deadlines, watches,
                                         results, settle, None if final else tag,
                                         asked=sum(r is not None for r in requests),
                                         start=start)
            else:
                for i in sent:
                    reading = watches[i]
                    assert reading is not None
                    results[i], keep[i] = await self._read(nodes[i], conns[i], requests[i],
                                                           deadlines[i], reading)
                for i, exchange in later.items():
                    results[i] = await exchange.task
        finally:
            for pending in watches:
                if pending is not None:
                    pending.end()
            for exchange in later.values():
                if not exchange.task.done() and exchange.task not in _background:
                    exchange.task.cancel()  # this round was cancelled: it closes its connection
            # Anything but a complete exchange (timeout, error, cancellation) may
            # leave a reply in flight: that connection is closed, never reused.
            for i in asked:
                conn = conns[i]
                if conn is None:
                    continue
                if not (keep[i] and not state.closed and state.nodes[i].give(conn)):
                    await _disconnect(conn)
        return results

    def _start(self, state: _LoopConns, i: int, conn: Any, request: Request,
               deadline: float, watch: _Deadline) -> "_Exchange":
        """A task reading node ``i``'s reply to ``request``, sent on ``conn``
        (``watch``: its deadline there, ended by the task)."""
        exchange = _Exchange(conn)
        exchange.task = asyncio.get_running_loop().create_task(
            self._finish(state, i, exchange, request, deadline, watch=watch))
        return exchange

    def _behind(self, state: _LoopConns, i: int, request: Request, before: "_Exchange",
                deadline: float, until: float | None, tag: Any) -> "_Exchange | None":
        """Send ``request`` to node ``i`` now, on the connection whose reply
        ``before`` is still reading, and read its own reply after that one
        (or, when ``before`` is still waiting for a connection, send it once
        ``before`` is done, on any connection).

        Requests already sent behind ``before`` come first: this one goes
        behind the last of them (one reader at a time on a connection). None
        when that last one's reply was read meanwhile: nothing to wait for,
        the caller asks the node as usual."""
        while before.next is not None:
            before = before.next
        if before.task.done():
            return None
        if before.conn is None:
            exchange = _Exchange(None, sent=False)
            exchange.task = asyncio.get_running_loop().create_task(self._connect_then(
                state, i, exchange, request, self.clock(), until, tag, after=before.task))
            return exchange
        before.taken = True  # that connection is ours once its reply is read
        exchange = _Exchange(before.conn, sent=False)
        before.next = exchange
        exchange.task = asyncio.get_running_loop().create_task(
            self._finish(state, i, exchange, request, deadline, before=before.task))
        exchange.task.add_done_callback(functools.partial(_unstarted_behind, before, exchange))
        return exchange

    async def _connect_then(self, state: _LoopConns, i: int, exchange: "_Exchange",
                            request: Request, start: float, until: float | None, tag: Any,
                            after: asyncio.Future[Any] | None = None) -> Any:
        """Node ``i``'s exchange on a connection that has to be waited for
        (after ``after``, an earlier request of the same token, is done): an
        idle one or one set up (bounded as the sync transport bounds it,
        :func:`connection_wait`), then the request and its reply."""
        try:
            return await self._connect_and_send(state, i, exchange, request, start, until, tag,
                                                after)
        finally:
            exchange.mark_sent()

    async def _connect_and_send(self, state: _LoopConns, i: int, exchange: "_Exchange",
                                request: Request, start: float, until: float | None, tag: Any,
                                after: asyncio.Future[Any] | None) -> Any:
        node = self.nodes[i]
        if until is None:
            until = call_deadline.get()
        asked = start
        if after is not None:
            # Bounded as a wait for a connection is: that request is waiting
            # for one too (or this round's caller has no time left).
            done, _ = await asyncio.wait([after], timeout=connection_wait(node, start, until))
            if not done:
                return NodeError(node.name, "no connection yet for an earlier request of "
                                 "this lock", sent=False)
            start = self.clock()
        conn = state.nodes[i].take()
        if conn is not None and (not conn.is_connected or not node.accepts(conn)
                                 or (_stale_now(conn) is not False and await _stale(conn))):
            await _disconnect(conn)
            conn = None
        if conn is None:
            got = await state.nodes[i].wait(node, start, until, self.clock, asked)
            if isinstance(got, NodeError):
                if (isinstance(request, Call) and request.script.releases
                        and state.nodes[i].setting_up):
                    # A release is never dropped for want of time: the set-up
                    # sends it first (NodeClient.deliver_later).
                    state.nodes[i].later.append((request.packed, tag))
                    if tag is not None:
                        state.nodes[i].later_tags.append(tag)
                return got
            conn = got
        exchange.conn = conn
        # The set-up had its own bound; the exchange gets the full one.
        deadline = self.clock() + node.timeout
        watch = _Deadline(conn, node.timeout, state.deadlines)
        try:
            error = await self._send(node, conn, request, watch)
        except BaseException:  # cancelled: what was written may still run; never reuse it
            watch.end()
            await _disconnect(conn)
            raise
        exchange.mark_sent()
        if error is not None:
            watch.end()
            await _disconnect(conn)
            return error
        return await self._finish(state, i, exchange, request, deadline, watch=watch)

    async def _finish(self, state: _LoopConns, i: int, exchange: "_Exchange", request: Request,
                      deadline: float, before: asyncio.Future[Any] | None = None,
                      watch: _Deadline | None = None) -> Any:
        """Node ``i``'s reply on ``exchange.conn`` (a task: a request sent
        behind another, or a settled round's on a connection not :func:`_direct`),
        within ``watch`` (ended here), or within ``deadline``.

        With ``before`` (:meth:`_behind`), the request is sent first, behind
        the one whose reply ``before`` reads, and read once that one was.
        Afterwards the connection goes back to the idle ones, unless a later
        request was sent behind this one (``exchange.taken``: its task reads
        on), or is closed when the exchange did not end cleanly (a late reply
        must never answer a later command)."""
        node, conn = self.nodes[i], exchange.conn
        keep = False
        try:
            if before is not None:
                watch = _Deadline(conn, deadline - self.clock(), state.deadlines)
                try:
                    error = await self._send(node, conn, request, watch)
                finally:
                    exchange.mark_sent()
                    watch.end()
                if error is not None:
                    return error
                await asyncio.wait([before])  # bounded by its own deadline
                if before.cancelled() or isinstance(before.result(), NodeError):
                    return NodeError(node.name, f"no answer within {node.timeout:g} s (to a "
                                     "request sent before this one on its connection)")
                # Its own deadline on the connection now that it reads there.
                watch = _Deadline(conn, deadline - self.clock(), state.deadlines)
            elif watch is None:
                watch = _Deadline(conn, deadline - self.clock(), state.deadlines)
            reply, keep = await self._read(node, conn, request, deadline, watch, exchange)
            return reply
        finally:
            if watch is not None:
                watch.end()
            if not keep or _next_gone(exchange):
                await _disconnect(conn)
            elif not exchange.taken and not (not state.closed and state.nodes[i].give(conn)):
                await _disconnect(conn)

    async def _read_settled(self, state: _LoopConns, sent: list[int],
                            later: dict[int, "_Exchange"], conns: list[Any],
                            requests: Sequence[Request], deadlines: list[float],
                            watches: list[_Deadline | None],
                            results: list[Any], settle: Settle, tag: Any, *,
                            asked: int, start: float) -> None:
        """Read replies as they come until ``settle`` says the outcome is known
        (the sync transport's ``_read_until_settled``); the replies not waited
        for are read on after this round returns. ``later``: the exchanges
        sent behind an earlier one on their node (:meth:`_behind`), each read
        by a task.

        The replies to the requests this round sent itself are read by a
        :class:`_Reading` each, not a task: at 5 nodes a task per node and
        round, and ``asyncio.wait`` over them, were half of an asyncio acquire
        + release's instructions (1.72 M against 0.85 M for sync). A reading
        runs its steps in the callbacks of the futures it waits on, and wakes
        this round once, when the outcome may have changed."""
        loop = asyncio.get_running_loop()
        arrivals = _Arrivals()
        exchanges = dict(later)
        readings: dict[int, _Reading] = {}
        for i in sent:
            watch, watches[i] = watches[i], None  # the reading (or task) ends it
            assert watch is not None
            if _direct(conns[i]):
                exchange = exchanges[i] = _Exchange(conns[i])
                reading = readings[i] = _Reading(self, state, i, exchange, requests[i],
                                                 deadlines[i], watch, arrivals)
                reading.start()
            else:  # redis-py's own read, whose timeout needs a task to run in
                exchanges[i] = self._start(state, i, conns[i], requests[i], deadlines[i], watch)
            conns[i] = None  # the reading gives it back or closes it
        for i, exchange in exchanges.items():
            if i not in readings:
                exchange.task.add_done_callback(functools.partial(arrivals.task_done, i))
        yes = no = 0
        give_up_at = asked - settle.need + 1
        also = settle.also if settle.also in sent else None
        also_until = 0.0
        pending = set(exchanges)
        try:
            while pending and settle.need > 0:
                timeout = None
                if yes >= settle.need or (no >= give_up_at and yes + no >= settle.need):
                    if also is None or results[also] is not None:
                        break
                    also_until = also_until or self.clock() + ALSO_GRACE
                    timeout = also_until - self.clock()
                    if timeout <= 0:
                        break
                if not arrivals.nodes:
                    wake = arrivals.wake = loop.create_future()
                    if timeout is None:
                        await wake
                    else:
                        await asyncio.wait([wake], timeout=timeout)
                    arrivals.wake = None
                while arrivals.nodes:
                    i = arrivals.nodes.popleft()
                    pending.discard(i)
                    result = results[i] = (readings[i].result() if i in readings
                                           else exchanges[i].task.result())
                    if settle.yes(result):
                        yes += 1
                    elif settle.no(result):
                        no += 1
            unsent = [e.sent for e in exchanges.values() if e.sent is not None and not e.sent.done()]
            if unsent:
                # A request still waiting for a connection (a cold node) goes
                # out before the round returns, so that it runs even if the
                # loop closes right after (a release); but within the node
                # timeout: a node that takes longer to connect is slow, and
                # its task goes on without us.
                left = max(self.nodes[i].timeout for i in exchanges) - (self.clock() - start)
                if left > 0:
                    await asyncio.wait(unsent, timeout=left)
        finally:
            # Decided, or this round was cancelled: the replies not read yet
            # are read on, within their deadlines, and the token's next
            # request to such a node (the release that takes a cancelled
            # acquire back) goes behind them, so it runs after the acquire.
            arrivals.closed = True
            self._leave(state, pending, exchanges, readings, results, tag)

    def _leave(self, state: _LoopConns, pending: set[int], exchanges: dict[int, "_Exchange"],
               readings: "dict[int, _Reading]", results: list[Any], tag: Any) -> None:
        for i in pending:
            results[i] = NOT_AWAITED
            exchange = exchanges[i]
            if i in readings:
                task = exchange.task = readings[i].future_of()
            else:
                task = exchange.task
                assert isinstance(task, asyncio.Task)
                _background.add(task)
                task.add_done_callback(_background.discard)
            behind = state.nodes[i].behind
            behind.append(exchange)
            task.add_done_callback(functools.partial(_drop_exchange, behind, exchange))
            if tag is not None:
                state.nodes[i].inflight[tag] = exchange
                task.add_done_callback(functools.partial(_forget_read, state.nodes[i].inflight,
                                                         tag, exchange))

    async def _send(self, node: NodeClient, conn: Any, request: Request,
                    watch: _Deadline, *, written: bool = False) -> NodeError | None:
        """Write ``request`` on ``conn`` (by ``watch``'s deadline); a :class:`NodeError`
        when it could not be. ``written``: :func:`_write_now` wrote it, and
        only the stream's flow control is left to wait for."""
        assert request is not None
        try:
            if written:
                await conn._writer.drain()
            else:
                await _write(conn, request.packed)
        except (*NODE_DOWN_ERRORS, RedisError) as e:
            node.mark_failed(self.clock())
            if watch.passed:
                return NodeError(node.name, f"could not send within {node.timeout:g} s")
            return NodeError(node.name, _short(e))
        return None

    async def _read(self, node: NodeClient, conn: Any, request: Request, deadline: float,
                    watch: _Deadline, exchange: "_Exchange | None" = None) -> tuple[Any, bool]:
        """``(reply or error, whether the connection may be reused)``, read by
        ``watch``'s deadline (``deadline``, on the transport's clock).

        ``NOSCRIPT`` (the node lost its scripts) sends the request again as
        ``EVAL``, unless another request was sent behind it on this
        connection meanwhile (``exchange.taken``): sent again, it would run
        after that one, and its reply would be read as this one's. Then the
        ``NOSCRIPT`` is the answer (the script did not run there)."""
        assert request is not None

        def may_resend() -> bool:
            return exchange is None or not exchange.taken

        try:
            if type(request) is Chain:
                reply = await _read_chain(conn, request, may_resend)
            else:
                try:
                    reply = await _response(conn)
                except NoScriptError:
                    if not may_resend():
                        if getattr(request, "last_of_token", False):
                            self._send_again(node, request)
                        raise
                    assert request.packed_eval is not None
                    await _write(conn, request.packed_eval)
                    reply = await _response(conn)
        except ResponseError as e:
            node.mark_ok()
            return e, not watch.passed
        except (*NODE_DOWN_ERRORS, RedisError) as e:
            if conn not in _closed_here:
                # (A connection closed here says nothing of the node: a reply
                # left behind, read on while a task cancelled at the loop's
                # end closed its connection, marked the node failed, and the
                # next loop's release skipped it, which left the lock there
                # for its whole lease.)
                node.mark_failed(self.clock())
            if watch.passed:
                return NodeError(node.name, f"no answer within {node.timeout:g} s"), False
            return NodeError(node.name, not_redis_reason(e)), False
        node.mark_ok()
        node.note_round_trip(self.clock() - (deadline - node.timeout))
        # A reply read as the deadline passed is an answer; its connection was
        # aborted with the deadline and goes.
        return reply, not watch.passed

    def _send_again(self, node: NodeClient, request: Request) -> None:
        """Send a release that met ``NOSCRIPT`` (the node lost its scripts)
        to ``node`` again, in a round of its own, when it could not be sent
        again on its connection (requests were sent behind it there): the
        sync transport's rule. Nothing of its token follows a release, so it
        may run after them; dropped, it would leave the lock on that node
        for its whole lease (another holder's quorum short of that node)."""
        if node not in self.nodes:  # a routed round's node (transport/nodekinds.py)
            return
        requests: list[Request] = [None] * len(self.nodes)
        requests[self.nodes.index(node)] = request
        task = asyncio.get_running_loop().create_task(self._again(requests))
        _closing.add(task)
        task.add_done_callback(_closing.discard)

    async def _again(self, requests: Sequence[Request]) -> None:
        try:
            await self.round(requests)
        except Exception:  # noqa: BLE001 - its lease ends it all the same
            logger.debug("a release sent again after NOSCRIPT failed", exc_info=True)

    # -- closing -------------------------------------------------------------
    async def aclose(self) -> None:
        """Close the running loop's connections now, and the other loops' as :meth:`close`."""
        loop = asyncio.get_running_loop()
        state = self._loops.pop(loop, None)
        if state is not None:
            await state.aclose()
        self.close()

    def close(self) -> None:
        """Close what can be closed from here; forget every loop's connections.

        A loop that is running (in another thread, or this one) closes its own
        connections soon after; a loop that already shut down closed them itself.
        """
        with self._lock:
            states = list(self._loops.items())
            self._loops.clear()
        for loop, state in states:
            state.closed = True
            if loop.is_closed() or not loop.is_running():
                continue
            try:
                loop.call_soon_threadsafe(_schedule_close, loop, state)
            except RuntimeError:  # the loop closed meanwhile
                pass


def _schedule_close(loop: asyncio.AbstractEventLoop, state: _LoopConns) -> None:
    task = loop.create_task(state.aclose())
    _closing.add(task)
    task.add_done_callback(_closing.discard)


#: Strong references to closing tasks, and to the tasks that send a release
#: again or close a reading's connection (the loop keeps only weak ones).
_closing: set[asyncio.Task[None]] = set()

#: Strong references to the reading tasks a settled round left behind
#: (AsyncTransport.round; a :class:`_Reading` is kept by the future it waits on).
_background: set[asyncio.Task[Any]] = set()


class _Exchange:
    """One node's request whose reply a task (:meth:`AsyncTransport._finish`)
    or a :class:`_Reading` reads.

    ``taken``: a later request of the same lock token was sent behind it on
    ``conn`` (:meth:`AsyncTransport._behind`), whose task now owns the
    connection: this one's reader must not give it back when its reply is read.
    """

    __slots__ = ("conn", "next", "sent", "taken", "task")

    def __init__(self, conn: Any, *, sent: bool = True) -> None:
        self.conn = conn
        self.taken = False
        #: The exchange sent behind this one on ``conn`` (``taken`` then).
        self.next: _Exchange | None = None
        #: What reads its reply: a task, or the future of a :class:`_Reading`.
        self.task: asyncio.Future[Any]
        #: Done once the request was written (or will never be): a round
        #: returns only after every request it makes was sent, so that what
        #: it asked (a release) runs even if the loop closes right after.
        self.sent: asyncio.Future[None] | None = (
            None if sent else asyncio.get_running_loop().create_future())

    def mark_sent(self) -> None:
        if self.sent is not None and not self.sent.done():
            self.sent.set_result(None)


class _Arrivals:
    """The nodes of one settled round whose replies came, in the order they
    came, and the future the round waits on for the next (see
    :meth:`AsyncTransport._read_settled`). Once the round returned
    (``closed``), a reply read on is nobody's arrival."""

    __slots__ = ("closed", "nodes", "wake")

    def __init__(self) -> None:
        self.nodes: deque[int] = deque()
        self.wake: asyncio.Future[None] | None = None
        self.closed = False

    def arrived(self, i: int) -> None:
        if self.closed:
            return
        self.nodes.append(i)
        wake = self.wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def task_done(self, i: int, task: asyncio.Future[Any]) -> None:
        self.arrived(i)


class _Reading:
    """Node ``i``'s reply to the request a settled round sent it on
    ``exchange.conn``, read without a task: :meth:`AsyncTransport._read`
    stepped by hand, each step run by the callback of the future the last
    one waits on (a stream's wait for data), as a task would run it; then
    what :meth:`AsyncTransport._finish` does after a read (the deadline ended,
    the connection given back, or closed when the exchange did not end
    cleanly).

    Why not a task: a task costs its creation, a loop turn for its first
    step, and one for its completion's callbacks; ``asyncio.wait`` over the
    tasks adds a future and a callback per task and round. At 5 nodes an
    acquire + release made 10 such tasks, about half of its instructions.
    Here the first step runs in the round itself, and a reply that came
    wakes the round once, through :class:`_Arrivals`.

    Only for a connection whose reads are :func:`_direct`: redis-py's own
    ``read_response`` sets a timeout that needs the running task, and a step
    run by a callback runs in none. The read itself never needs one (a
    stream's read, a parser's feed, a write after ``NOSCRIPT``); closing the
    connection after a failed exchange does (redis-py's ``disconnect``), so
    that runs in a task of its own.

    Once its round returned without it (a laggard), :meth:`future_of` gives
    the future that stands for it where a task stood: later requests of the
    same token are sent behind it (:meth:`AsyncTransport._behind`), and
    ``inflight`` / ``behind`` forget it when it is done.
    """

    __slots__ = ("_arrivals", "_coro", "_error", "_future", "_transport", "_value", "done",
                 "exchange", "i", "request", "state", "watch")

    def __init__(self, transport: "AsyncTransport", state: _LoopConns, i: int,
                 exchange: "_Exchange", request: Request, deadline: float, watch: _Deadline,
                 arrivals: _Arrivals) -> None:
        self._transport = transport
        self.state = state
        self.i = i
        self.exchange = exchange
        self.request = request
        self.watch = watch
        self._arrivals = arrivals
        self._coro = transport._read(transport.nodes[i], exchange.conn, request, deadline, watch,
                                     exchange)
        self._future: asyncio.Future[Any] | None = None
        self._value: Any = None
        self._error: BaseException | None = None
        self.done = False

    def start(self) -> None:
        self._step()

    def result(self) -> Any:
        """The reply (or NodeError / ResponseError); an exception the read
        raised (a defect, never a node's failure) is raised here, as a
        task's ``result()`` raises it."""
        if self._error is not None:
            raise self._error
        return self._value

    def future_of(self) -> asyncio.Future[Any]:
        """A future done with this reading (its result, or its exception)."""
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
            if self.done:
                self._settle_future()
        return self._future

    def _step(self, _waited: Any = None) -> None:
        try:
            waited = self._coro.send(None)
        except StopIteration as stop:
            reply, keep = stop.value
            self._end(reply, None, keep)
            return
        except (KeyboardInterrupt, SystemExit) as exc:
            self._end(None, exc, False)
            raise
        except BaseException as exc:  # noqa: BLE001 - kept as a task keeps it
            self._end(None, exc, False)
            return
        if waited is None:  # a bare yield (asyncio.sleep(0)): go on at the next turn
            asyncio.get_running_loop().call_soon(self._step)
        elif getattr(waited, "_asyncio_future_blocking", None):
            waited._asyncio_future_blocking = False
            waited.add_done_callback(self._step)
        else:  # what a task would refuse too
            self._coro.close()
            self._end(None, RuntimeError(f"a reply's read yielded {waited!r}"), False)

    def _end(self, reply: Any, error: BaseException | None, keep: bool) -> None:
        self._value, self._error, self.done = reply, error, True
        self.watch.end()
        conn, state, i = self.exchange.conn, self.state, self.i
        if not keep or _next_gone(self.exchange) or (
                not self.exchange.taken
                and not (not state.closed and state.nodes[i].give(conn))):
            _disconnect_soon(conn)
        if self._future is not None:
            self._settle_future()
        self._arrivals.arrived(i)

    def _settle_future(self) -> None:
        future = self._future
        assert future is not None
        if future.done():
            return
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(self._value)


def _next_gone(exchange: _Exchange) -> bool:
    """Whether the request sent behind ``exchange`` on its connection
    (``taken``) has a task that is done already, before ``exchange``'s reply
    was read: cancelled (a loop's end cancels every task), maybe before its
    first step, when its ``finally`` never ran. The connection is then
    nobody's: closed, never given back (what was sent behind may still
    answer on it)."""
    after = exchange.next
    return exchange.taken and after is not None and after.task.done()


def _unstarted_behind(before: _Exchange, exchange: _Exchange,
                      task: asyncio.Future[Any]) -> None:
    """The task of a request sent behind ``before`` is done without having
    sent it (cancelled before its first step, as a loop's end cancels every
    task): once ``before``'s reader is done too, nobody closes their
    connection, and the garbage collector found it unclosed (review of the
    readings: a ResourceWarning, the socket open until then). A reader still
    reading sees it in :func:`_next_gone`."""
    if exchange.sent is not None and not exchange.sent.done() and before.task.done():
        _disconnect_soon(before.conn)


def _disconnect_soon(conn: Any) -> None:
    """:func:`_disconnect` in a task of its own (see :class:`_Reading`);
    nothing when it is closed already (the loop's connections closed at its
    shutdown end a reading with an error: no task is then made that the
    loop may close before it ran)."""
    if not conn.is_connected:
        return
    task = asyncio.get_running_loop().create_task(_disconnect(conn))
    _closing.add(task)
    task.add_done_callback(_closing.discard)


def _drop_exchange(behind: list[_Exchange], exchange: _Exchange,
                   task: asyncio.Future[Any]) -> None:
    if exchange in behind:
        behind.remove(exchange)


def _forget_read(inflight: dict[Any, _Exchange], tag: Any, exchange: _Exchange,
                 task: asyncio.Future[Any]) -> None:
    """A reply left behind was read: nothing of its token goes behind it now."""
    if inflight.get(tag) is exchange:
        del inflight[tag]


async def _reply_or_error(conn: Any) -> Any:
    """The next reply on ``conn``; an error reply as its exception."""
    try:
        return await _response(conn)
    except ResponseError as e:
        return e


async def _read_chain(conn: Any, chain: Chain, may_resend: Callable[[], bool]) -> ChainReply:
    """Both replies of a chain (resp.Chain), always both. After ``NOSCRIPT``
    (the node lost its scripts) the whole chain goes again with ``EVAL``: the
    command behind the script must follow the run that counts; unless
    ``may_resend()`` says a request was sent behind it (see
    :meth:`AsyncTransport._read`)."""
    for _ in chain.lead:  # ASKING's OK (resp.Chain): read, dropped
        await _reply_or_error(conn)
    first, then = await _reply_or_error(conn), await _reply_or_error(conn)
    if (isinstance(first, NoScriptError) and chain.first.packed_eval is not None
            and may_resend()):
        await _write(conn, b"".join(c.packed for c in chain.lead)
                     + chain.first.packed_eval + chain.then.packed)
        for _ in chain.lead:
            await _reply_or_error(conn)
        first, then = await _reply_or_error(conn), await _reply_or_error(conn)
    return ChainReply(first, then)


def _stale_now(conn: Any) -> bool | None:
    """:func:`_stale` without awaiting, for a connection whose reader and
    parser are redis-py's own (:func:`_direct`); None: ask :func:`_stale`.

    Why: every round looks at each idle connection it takes, and redis-py's
    ``can_read`` is a coroutine that looks at the same buffers (its
    ``can_read_destructive`` before 5.1 reads with a zero timeout, which
    cancels a read at the next loop turn). A reply sitting in the stream's
    buffer, in the parser's, or the server's close seen (EOF) make it stale;
    bytes still in the kernel are read into the stream at the loop's next
    turn, as redis-py's check would find them at best."""
    if not _direct(conn):
        return None
    stream = conn._reader
    if stream is None:
        return True
    if stream.at_eof() or stream._buffer:
        return True
    parser = conn._parser
    if not getattr(parser, "_connected", True):
        return True  # its can_read raises: stale
    buffered = getattr(getattr(parser, "_reader", None), "has_data", None)  # hiredis
    if buffered is not None:
        return bool(buffered())
    pending = getattr(parser, "_buffer", None)  # redis-py's own RESP parser
    if isinstance(pending, (bytes, bytearray)):
        return bool(pending)
    return None


async def _stale(conn: Any) -> bool:
    """True when an idle connection has unread data or was closed by the server."""
    now = _stale_now(conn)
    if now is not None:
        return now
    check = getattr(conn, "can_read", None) or conn.can_read_destructive
    try:
        return bool(await check())
    except (*NODE_DOWN_ERRORS, RedisError):
        return True
