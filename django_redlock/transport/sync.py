"""The synchronous transport: every node asked in parallel, from the calling thread.

A round sends one command to every node first and only then reads the replies, so
the nodes work at the same time and a round costs about one round trip to the
slowest node, not the sum over nodes (redlock-py and pottery's per-call thread
pools pay much more). No thread is created per request.

Each node has its own deadline (its timeout from the start of the round). A node
that does not answer in time (dead, SIGSTOPped, partitioned) is reported as a
:class:`NodeError` and its connection is dropped, so a late reply can never be
read as the answer to a later command. A node that failed is skipped for a short,
growing back-off, so a dead node does not cost every round a connect timeout.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..core.config import NodeSpec
from .resp import Call, Command

logger = logging.getLogger("django_redlock.transport")

#: Errors that mean "this node did not answer", as opposed to a Redis-level error
#: reply. OSError covers a socket torn down under us.
NODE_DOWN_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)

BACKOFF_FIRST = 0.05
BACKOFF_MAX = 1.0

#: redis-py >= 5.1 reads with a per-call timeout; older versions need a poll first.
_READ_TAKES_TIMEOUT = "timeout" in inspect.signature(redis.Connection.read_response).parameters

_GET_NEEDS_NAME = (
    inspect.signature(redis.ConnectionPool.get_connection).parameters["command_name"].default
    is inspect.Parameter.empty)


class NodeError(Exception):
    """One node's failure in a round: unreachable, timed out, or skipped (back-off)."""

    def __init__(self, node: str, reason: str, *, sent: bool = True) -> None:
        super().__init__(f"{node}: {reason}")
        self.node = node
        self.reason = reason
        #: False when the request never left (the node was skipped or the connect
        #: failed): the node certainly did not execute it.
        self.sent = sent


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) < 160 else text[:157] + "..."


class NodeClient:
    """One node: a connection pool, a timeout and a failure back-off.

    For a ``cache:<alias>`` node the pool is the django-redis cache's own (borrowed,
    never disconnected by us); otherwise the pool is ours, built from the URL with
    the node timeout as socket timeouts.
    """

    def __init__(self, spec: NodeSpec, *, node_timeout: float,
                 pool_factory: Callable[[NodeSpec], Any] | None = None) -> None:
        self.spec = spec
        self.name = spec.display
        options = dict(spec.options)
        self.timeout: float = float(options.get("socket_timeout", node_timeout))
        self._connect_timeout = float(options.get("socket_connect_timeout", self.timeout))
        self._pool_factory = pool_factory
        self._pool: Any = None
        self._pool_lock = threading.Lock()
        self._borrowed = spec.kind == "cache"
        self._failures = 0
        self.down_until = 0.0
        self._idle: list[Any] = []
        self._pid = os.getpid()
        self._closed = False

    # -- pool ---------------------------------------------------------------
    @property
    def pool(self) -> Any:
        if self._pool is None:
            with self._pool_lock:
                if self._pool is None:
                    self._pool = self._build_pool()
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
        """A connection for one request/reply exchange; give it back with :meth:`put`.

        Our own nodes keep a LIFO free list instead of going through redis-py's
        pool: the pool's checkout polls the socket and takes a lock on every
        call, which is a measurable share of a ~100 us acquire. It is safe here
        because a connection only comes back after its reply was read in full
        (a timed-out one is disconnected first), and we speak RESP2, so the
        server never pushes unasked data. A forked child starts with an empty
        list: it must never share its parent's sockets.
        """
        if self._borrowed:
            return self.pool.get_connection("_") if _GET_NEEDS_NAME else self.pool.get_connection()
        if self._pid != os.getpid():
            self._idle = []
            self._pid = os.getpid()
        try:
            return self._idle.pop()
        except IndexError:
            return self.new_connection()

    def put(self, conn: Any) -> None:
        if self._borrowed:
            self.pool.release(conn)
        elif self._pid == os.getpid() and not self._closed:
            self._idle.append(conn)
        else:
            conn.disconnect()

    def new_connection(self) -> Any:
        """A connection outside the pool's accounting (also for the pub/sub listener)."""
        pool = self.pool
        return pool.connection_class(**pool.connection_kwargs)

    def close(self) -> None:
        if self._pool is not None and not self._borrowed:
            self._closed = True
            idle, self._idle = self._idle, []
            for conn in idle:
                conn.disconnect()
            self._pool.disconnect()
        self._pool = None

    # -- health -------------------------------------------------------------
    def backing_off(self, now: float) -> bool:
        return now < self.down_until

    def mark_failed(self, now: float) -> None:
        self._failures += 1
        self.down_until = now + min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (self._failures - 1))

    def mark_ok(self) -> None:
        if self._failures:
            logger.info("node %s answers again", self.name)
        self._failures = 0
        self.down_until = 0.0

    def reset_backoff(self) -> None:
        self._failures = 0
        self.down_until = 0.0


Request = Call | Command | None


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


class SyncTransport:
    """Sends one request per node and gathers the replies within the node timeouts."""

    def __init__(self, nodes: Sequence[NodeClient], *, clock: Callable[[], float] = time.monotonic) -> None:
        self.nodes = list(nodes)
        self.clock = clock

    def round(self, requests: Sequence[Request], *, skip_backoff: bool = True) -> list[Any]:
        """Ask node i ``requests[i]`` (None: do not ask it); return answers or errors.

        Each result is the node's reply, a :class:`NodeError` (no answer in time) or
        a ``redis.ResponseError`` (the node answered with an error).
        """
        nodes = self.nodes
        n = len(nodes)
        results: list[Any] = [None] * n
        conns: list[Any] = [None] * n
        deadlines = [0.0] * n
        start = self.clock()
        skip = nodes_to_skip(nodes, requests, start, skip_backoff)
        try:
            # Nodes with an open connection are asked first; a node that needs a
            # (re)connect is asked after them, so a black-holed node stalling in
            # its connect handshake cannot hold back the healthy nodes' requests.
            fresh: list[int] = []
            for i in range(n):
                if requests[i] is None:
                    continue
                node = nodes[i]
                if skip[i]:
                    results[i] = NodeError(node.name, "skipped: failed recently", sent=False)
                    continue
                try:
                    conn = conns[i] = node.get()  # a borrowed pool may connect here
                except NODE_DOWN_ERRORS as e:
                    node.mark_failed(self.clock())
                    results[i] = NodeError(node.name, _short(e), sent=False)
                    continue
                if getattr(conn, "_sock", None) is None:
                    fresh.append(i)
                else:
                    self._send(i, requests[i], conns, results, deadlines)
            for i in fresh:
                self._send(i, requests[i], conns, results, deadlines)
            # Each node's deadline counts from its own send: one slow connect
            # costs the others nothing.
            for i in range(n):
                conn = conns[i]
                if conn is not None:
                    results[i] = self._read(nodes[i], conn, requests[i], deadlines[i])
        finally:
            for i in range(n):
                if conns[i] is not None:
                    nodes[i].put(conns[i])
        return results

    def _send(self, i: int, request: Request, conns: list[Any], results: list[Any],
              deadlines: list[float]) -> None:
        node, conn = self.nodes[i], conns[i]
        assert request is not None
        try:
            conn.send_packed_command((request.packed,), check_health=False)
        except NODE_DOWN_ERRORS as e:
            node.mark_failed(self.clock())
            results[i] = NodeError(node.name, _short(e), sent=False)
            conns[i] = None
            conn.disconnect()
            node.put(conn)
            return
        deadlines[i] = self.clock() + node.timeout

    def _read(self, node: NodeClient, conn: Any, request: Request, deadline: float) -> Any:
        for _ in range(2):  # the second pass only after NOSCRIPT
            try:
                left = deadline - self.clock()
                if _READ_TAKES_TIMEOUT:
                    # One syscall fewer than poll-then-read; a timeout disconnects.
                    reply = conn.read_response(timeout=max(left, 0.0005))
                elif conn.can_read(timeout=max(left, 0.0)):
                    reply = conn.read_response()
                else:
                    conn.disconnect()
                    node.mark_failed(self.clock())
                    return NodeError(node.name, f"no answer within {node.timeout:g} s")
            except NoScriptError:
                assert request is not None and request.packed_eval is not None
                try:
                    conn.send_packed_command((request.packed_eval,), check_health=False)
                except NODE_DOWN_ERRORS as e:
                    conn.disconnect()
                    node.mark_failed(self.clock())
                    return NodeError(node.name, _short(e))
                continue
            except ResponseError as e:
                node.mark_ok()
                return e
            except RedisTimeoutError:
                conn.disconnect()
                node.mark_failed(self.clock())
                return NodeError(node.name, f"no answer within {node.timeout:g} s")
            except NODE_DOWN_ERRORS as e:
                conn.disconnect()
                node.mark_failed(self.clock())
                return NodeError(node.name, _short(e))
            except BaseException:
                # Interrupted (KeyboardInterrupt, a timeout signal): the reply may
                # still arrive, so this connection must never be reused.
                conn.disconnect()
                raise
            node.mark_ok()
            return reply
        return NodeError(node.name, "script could not be loaded")

    def close(self) -> None:
        for node in self.nodes:
            node.close()
