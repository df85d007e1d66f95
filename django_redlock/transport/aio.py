"""The asyncio transport: every node asked concurrently, from the running event loop.

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
import inspect
import logging
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import redis.asyncio.connection as aconn
from redis.exceptions import NoScriptError, RedisError, ResponseError

from .resp import Call, Chain, ChainReply
from .sync import (
    NODE_DOWN_ERRORS,
    NodeClient,
    NodeError,
    Request,
    SyncTransport,
    _short,
    call_deadline,
    connection_wait,
    nodes_to_skip,
    not_redis_reason,
)

if sys.version_info >= (3, 11, 3):
    from asyncio import timeout as _timeout
else:  # pragma: no cover - redis-py depends on async-timeout on these versions
    # mypy cannot evaluate a 3-part version test, so it reads this branch on 3.11.3+
    # too, where async-timeout is not installed and _timeout is already defined
    from async_timeout import timeout as _timeout  # type: ignore[import-not-found, no-redef, unused-ignore]

logger = logging.getLogger("django_redlock.transport")

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
    """``(asyncio connection class, its kwargs, max idle)`` for one node."""
    if node.spec.kind == "cache":
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
    (:meth:`NodeClient.wait_connection`): a round that finds no idle
    connection waits for the first to come free, one set up for it or for
    another round, or one given back; a node has one set-up in flight at a
    time (a task, bounded by the node's connect timeout). A burst of rounds on
    a cold loop thus opens a few connections in turn instead of one per round
    and node at once (50 concurrent acquisitions opened 250 and timed out,
    issue 25). A failed set-up ends every wait at once with its reason.
    """

    __slots__ = ("cls", "idle", "kwargs", "later", "later_tags", "max_idle", "open", "setting_up",
                 "waiters", "tasks")

    def __init__(self, cls: type, kwargs: dict[str, Any], max_idle: int) -> None:
        self.cls = cls
        self.kwargs = kwargs
        self.max_idle = max_idle
        self.idle: list[Any] = []
        self.open: weakref.WeakSet[Any] = weakref.WeakSet()
        self.setting_up = 0
        self.waiters: deque[asyncio.Future[Any]] = deque()
        self.tasks: set[asyncio.Task[None]] = set()
        #: Releases to send first on the connection being set up (see
        #: NodeClient.deliver_later).
        self.later: list[tuple[bytes, Any]] = []
        #: The tokens of those releases, until each ran (see round's ``tag``).
        self.later_tags: list[Any] = []

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

    async def wait(self, node: NodeClient, deadline: float, clock: Callable[[], float]) -> Any:
        """A connected connection by ``deadline``, or a :class:`NodeError` (returned)."""
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        if not self.setting_up:
            self._start_setup(node)
        got = None
        try:
            async with _timeout(max(deadline - clock(), 0.0)):
                got = await waiter
        except asyncio.TimeoutError:  # not the builtin one on Python 3.10
            return NodeError(node.name, "no connection yet (connecting, up to "
                             f"{node.connect_timeout:g} s)", sent=False)
        finally:
            if got is None:
                if waiter.done() and not waiter.cancelled() and not isinstance(
                        waiter.result(), NodeError):
                    # Handed to us as the wait ended: pass it on.
                    if not self.give(waiter.result()):
                        await _disconnect(waiter.result())
                else:
                    waiter.cancel()
        return got

    def _start_setup(self, node: NodeClient) -> None:
        self.setting_up += 1
        task = asyncio.get_running_loop().create_task(self._setup(node))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _setup(self, node: NodeClient) -> None:
        conn = self.cls(**self.kwargs)
        self.open.add(conn)
        error: NodeError | None = None
        try:
            async with _timeout(node.connect_timeout):
                if hasattr(conn, "connect_check_health"):  # no retries: one bound
                    await conn.connect_check_health(check_health=False,
                                                    retry_socket_connect=False)
                else:  # pragma: no cover - redis-py < 6
                    await conn.connect()
            while self.later:
                later, self.later = self.later, []
                try:
                    async with _timeout(node.timeout):
                        await conn.send_packed_command([packed for packed, _ in later],
                                                       check_health=False)
                        for _ in later:
                            try:
                                await conn.read_response()
                            except ResponseError:
                                pass
                finally:
                    for _, tag in later:
                        if tag is not None and tag in self.later_tags:
                            self.later_tags.remove(tag)
        except asyncio.TimeoutError:  # not the builtin one on Python 3.10
            error = NodeError(node.name, f"no connection within {node.connect_timeout:g} s",
                              sent=False)
        except (*NODE_DOWN_ERRORS, RedisError) as e:
            error = NodeError(node.name, not_redis_reason(e), sent=False)
        except BaseException:  # cancelled: the loop is closing
            self.setting_up -= 1
            await _disconnect(conn)
            raise
        self.setting_up -= 1
        self.later = []
        self.later_tags = []
        if error is not None:
            await _disconnect(conn)
            node.mark_failed(time.monotonic())
            waiters, self.waiters = self.waiters, deque()
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(error)
            return
        if not self.give(conn):  # pragma: no cover - only with max_connections reached
            await _disconnect(conn)
        if any(not w.done() for w in self.waiters) and not self.setting_up:
            self._start_setup(node)  # more rounds wait than there are connections


class _LoopConns:
    """Everything a transport keeps for one event loop."""

    def __init__(self, params: Sequence[tuple[type, dict[str, Any], int]]) -> None:
        self.nodes = [_NodeConns(*p) for p in params]
        self.closed = False
        self.guard: Any = None
        #: This loop's rounds go through the sync transport (PER_CALL_LOOPS).
        self.sync = False

    async def aclose(self) -> None:
        self.closed = True
        conns = [c for node in self.nodes for c in list(node.open)]
        for node in self.nodes:
            node.idle.clear()
            for task in list(node.tasks):
                task.cancel()
        await asyncio.gather(*(_disconnect(c) for c in conns), return_exceptions=True)


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


async def _disconnect(conn: Any) -> None:
    try:
        await conn.disconnect(nowait=True)
    except (RedisError, OSError):  # already broken: nothing left to close
        pass


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

    def _loop_ended(self) -> None:
        self._ended_loops += 1

    # -- per-loop state ------------------------------------------------------
    async def _conns(self) -> _LoopConns:
        loop = asyncio.get_running_loop()
        state = self._loops.get(loop)
        if state is not None:
            return state
        with self._lock:
            if self._params is None:
                self._params = [connection_params(node) for node in self.nodes]
            for old in [lp for lp in list(self._loops) if lp.is_closed()]:
                self._loops.pop(old, None)
            state = self._loops.get(loop)
            if state is None:
                state = self._loops[loop] = _LoopConns(self._params)
                state.sync = self._ended_loops >= PER_CALL_LOOPS
                if state.sync and self._sync is None:
                    self._sync = SyncTransport(self.nodes, clock=self.clock)
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
                    tag: Any = None) -> list[Any]:
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
        """
        state = await self._conns()
        if state.sync and self._sync is not None:
            # A loop per call (an async view under WSGI): the process-wide
            # connections, one blocking round trip in a loop that serves one call.
            return self._sync.round(requests, skip_backoff=skip_backoff, last=last, until=until,
                                    tag=tag)
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
                results[i] = NodeError(nodes[i].name, "skipped: failed recently", sent=False)
                continue
            if tag is not None and tag in state.nodes[i].later_tags:
                results[i] = NodeError(nodes[i].name, "an earlier attempt's clean-up is "
                                       "still on its way", sent=False)
                continue
            asked.append(i)
        if not asked:
            return results
        conns: list[Any] = [None] * n
        deadlines = [start + nodes[i].timeout for i in range(n)]
        keep = [False] * n
        try:
            cold: list[int] = []
            for i in asked:
                conn = state.nodes[i].take()
                if conn is not None and (not conn.is_connected or await _stale(conn)):
                    await _disconnect(conn)  # the node closed it (a restart): a new one
                    conn = None
                conns[i] = conn
                if conn is None:
                    cold.append(i)
            if cold:
                if until is None:
                    until = call_deadline.get()
                wait_until = [start + connection_wait(nodes[i], start, until) for i in range(n)]
                got = await asyncio.gather(*(state.nodes[i].wait(nodes[i], wait_until[i],
                                                                  self.clock) for i in cold))
                for i, conn in zip(cold, got, strict=True):
                    if isinstance(conn, NodeError):
                        results[i] = conn
                        request = requests[i]
                        if (isinstance(request, Call) and request.script.releases
                                and state.nodes[i].setting_up):
                            # A release is never dropped for want of time: the
                            # set-up sends it first (NodeClient.deliver_later).
                            state.nodes[i].later.append((request.packed, tag))
                            if tag is not None:
                                state.nodes[i].later_tags.append(tag)
                    else:
                        conns[i] = conn
                        # The set-up had its own bound; the exchange gets the full one.
                        deadlines[i] = self.clock() + nodes[i].timeout
            live = [i for i in asked if results[i] is None]
            if last in live:
                live = [i for i in live if i != last] + [last]
            for i in live:
                results[i] = await self._send(nodes[i], conns[i], requests[i], deadlines[i])
            for i in live:
                if results[i] is None:
                    results[i], keep[i] = await self._read(nodes[i], conns[i], requests[i],
                                                           deadlines[i])
        finally:
            # Anything but a complete exchange (timeout, error, cancellation) may
            # leave a reply in flight: that connection is closed, never reused.
            for i in asked:
                conn = conns[i]
                if conn is None:
                    continue
                if not (keep[i] and not state.closed and state.nodes[i].give(conn)):
                    await _disconnect(conn)
        return results

    async def _send(self, node: NodeClient, conn: Any, request: Request,
                    deadline: float) -> NodeError | None:
        assert request is not None
        try:
            async with _timeout(max(deadline - self.clock(), 0.0)):
                await conn.send_packed_command(request.packed, check_health=False)
        except asyncio.TimeoutError:  # not the builtin one on Python 3.10
            node.mark_failed(self.clock())
            return NodeError(node.name, f"could not send within {node.timeout:g} s")
        except (*NODE_DOWN_ERRORS, RedisError) as e:
            node.mark_failed(self.clock())
            return NodeError(node.name, _short(e))
        return None

    async def _read(self, node: NodeClient, conn: Any, request: Request,
                    deadline: float) -> tuple[Any, bool]:
        """``(reply or error, whether the connection may be reused)``."""
        assert request is not None
        try:
            async with _timeout(max(deadline - self.clock(), 0.0)):
                if type(request) is Chain:
                    reply = await _read_chain(conn, request)
                    node.mark_ok()
                    node.note_round_trip(self.clock() - (deadline - node.timeout))
                    return reply, True
                try:
                    reply = await conn.read_response()
                except NoScriptError:
                    assert request.packed_eval is not None
                    await conn.send_packed_command(request.packed_eval, check_health=False)
                    reply = await conn.read_response()
        except asyncio.TimeoutError:  # not the builtin one on Python 3.10
            node.mark_failed(self.clock())
            return NodeError(node.name, f"no answer within {node.timeout:g} s"), False
        except ResponseError as e:
            node.mark_ok()
            return e, True
        except (*NODE_DOWN_ERRORS, RedisError) as e:
            node.mark_failed(self.clock())
            return NodeError(node.name, not_redis_reason(e)), False
        node.mark_ok()
        node.note_round_trip(self.clock() - (deadline - node.timeout))
        return reply, True

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


#: Strong references to closing tasks (the loop keeps only weak ones).
_closing: set[asyncio.Task[None]] = set()


async def _reply_or_error(conn: Any) -> Any:
    """The next reply on ``conn``; an error reply as its exception."""
    try:
        return await conn.read_response()
    except ResponseError as e:
        return e


async def _read_chain(conn: Any, chain: Chain) -> ChainReply:
    """Both replies of a chain (resp.Chain), always both. After ``NOSCRIPT``
    (this flavour sends scripts by SHA and loads them on demand) the whole
    chain goes again with ``EVAL``: the command behind the script must
    follow the run that counts."""
    first, then = await _reply_or_error(conn), await _reply_or_error(conn)
    if isinstance(first, NoScriptError) and chain.first.packed_eval is not None:
        await conn.send_packed_command(chain.first.packed_eval + chain.then.packed,
                                       check_health=False)
        first, then = await _reply_or_error(conn), await _reply_or_error(conn)
    return ChainReply(first, then)


async def _stale(conn: Any) -> bool:
    """True when an idle connection has unread data or was closed by the server."""
    check = getattr(conn, "can_read", None) or conn.can_read_destructive
    try:
        return bool(await check())
    except (*NODE_DOWN_ERRORS, RedisError):
        return True
