"""Nodes that are more than one server: a Sentinel-managed master, a Redis Cluster.

(Why one module of 1,072 lines: both kinds hook into the transports at the same
few points, routed rounds, redirections and the master moving, which read best
side by side; issue 21.) Each counts as one Redlock node, and each is a
:class:`~django_redlock.transport.sync.NodeClient` to the engine, so the
protocol is unchanged; what differs is where a node's requests go.

Sentinel node (:class:`SentinelNode`)
    Its master's address comes from the sentinels (``SENTINEL
    GET-MASTER-ADDR-BY-NAME SERVICE``, :func:`discover_master`, through
    redis-py's ``Sentinel`` clients), asked when a connection is set up
    and the address is not known or no longer trusted. It is no longer
    trusted after a failure (no answer, refused), after a ``READONLY`` reply
    (the master was demoted: it is a replica now) and every
    :data:`RECHECK` seconds while rounds go on (a failover the node did not
    notice otherwise: the old master may still accept writes for a while).
    When the address changes, every connection to the old one is dropped,
    idle or given back later (:meth:`SentinelNode.accepts`), so the next
    rounds set up connections to the new master: they load the scripts there
    first (``resp.PRELOAD``), and the wake-up listener
    (:mod:`~django_redlock.transport.notify`) drops its pub/sub connection and
    subscribes again on the new master. Resolving is I/O to the sentinels: it
    runs in the connection set-up (a thread of the sync transport, a worker
    thread for asyncio), never in a round, and asks each sentinel for at most
    ``CONNECT_TIMEOUT`` in both (:meth:`SentinelNode.resolve_bound`).

Cluster node (:class:`ClusterNode`)
    Every key of one lock name lives in one hash slot (``core.keys``), so a
    request goes whole to the master serving its slot. The slot map is
    redis-py's (``redis.cluster.NodesManager``, what ``RedisCluster`` keeps),
    loaded in the background; each master is a :class:`_Shard`, a plain
    ``NodeClient`` with the Cluster's options, whose counters are also the
    Cluster node's. A ``MOVED`` reply updates the map at once (and reloads it
    in the background) and the request goes again to the new owner, in the
    same call, within the node timeout; an ``ASK`` reply sends it once to the
    importing master behind ``ASKING`` (a slot half-migrated); a ``TRYAGAIN``
    reply sends it again to the same master after :data:`TRYAGAIN_PAUSE`,
    which each transport waits its own way (slept in a thread, awaited in an
    event loop: :class:`Hop`). A request whose keys span slots
    (``EXTEND_MANY`` of locks of several names) is split by the engine before
    it gets here (``rounds.extend_many_steps``).

The transports call into this module only through :func:`routed`,
:func:`route` and :func:`after_round` (and :meth:`NodeClient.accepts`), and
only when a manager has such a node: a manager of plain masters runs exactly
as before.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from typing import Any, Callable, NamedTuple, Sequence

import redis
from redis.exceptions import (
    AskError,
    BusyLoadingError,
    MovedError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from ..core.config import NodeSpec
from .finalizers import get_logger
from .resp import Call, Chain, ChainReply, Command
from .sync import NodeClient, NodeError, scrub

logger = get_logger("django_redlock.transport")

#: Seconds after which a Sentinel node asks its sentinels again, in the
#: background, whether the master moved (only while rounds go on).
RECHECK = 1.0

#: Seconds between two loads of a Cluster node's slot map, at least.
REFRESH_MIN = 0.1

#: Replies that say this server is not (or not yet) the master: a script's
#: error text carries the server's message without its code.
_MOVED_AWAY = re.compile(r"^(READONLY|MASTERDOWN|LOADING)\b|read only replica")

#: Redirections (MOVED, ASK, TRYAGAIN) one request follows within one call (a
#: MOVED from a stale map, then an ASK from a slot half-moved, and one to spare).
MAX_REDIRECTS = 3

#: Seconds a request answered ``TRYAGAIN`` waits before it goes again (a
#: slot being migrated: the keys may have moved by then). The driver waits:
#: :func:`routed_round` sleeps, :func:`async_routed_round` awaits.
TRYAGAIN_PAUSE = 0.005


class Redirect(NamedTuple):
    """Where a redirected request goes next (:meth:`ClusterNode.redirect`)."""

    target: NodeClient
    request: Any
    #: Seconds to wait before it goes (:data:`TRYAGAIN_PAUSE`; 0: at once).
    pause: float = 0.0


class Hop(NamedTuple):
    """The round to send again (:func:`follow_redirects`)."""

    targets: list[NodeClient]
    #: The request of each node to send again; None for the others.
    requests: list[Any]
    #: Seconds the driver waits before it sends them, without blocking its
    #: callers' other work: ``time.sleep`` in a thread of the sync transport,
    #: ``await asyncio.sleep`` in the event loop (a sleep there would stop
    #: every task of the loop for as long, each time a slot move answers).
    pause: float


def make_node(spec: NodeSpec, *, node_timeout: float,
              pool_factory: Callable[[NodeSpec], Any] | None = None,
              connect_timeout: float | None = None) -> NodeClient:
    """The node client for ``spec``, whatever its kind."""
    cls: type[NodeClient] = {"sentinel": SentinelNode, "cluster": ClusterNode,
                             "cache": CacheNode}.get(spec.kind, NodeClient)
    return cls(spec, node_timeout=node_timeout, pool_factory=pool_factory,
               connect_timeout=connect_timeout)


class Router:
    """What a transport with a Sentinel or Cluster node routes its rounds
    through (``NodeClient.router``; the transports find it on the nodes, so
    they import nothing from here)."""

    @staticmethod
    def round(transport: Any, requests: Sequence[Any], **kwargs: Any) -> list[Any]:
        return routed_round(transport, requests, **kwargs)

    @staticmethod
    async def around(transport: Any, requests: Sequence[Any], **kwargs: Any) -> list[Any]:
        return await async_routed_round(transport, requests, **kwargs)


class MasterUnknown(NodeError, RedisConnectionError):
    """The sentinels named no master (all down, or none knows the service).

    Both a :class:`NodeError` (the sync set-up's failure) and a redis-py
    ``ConnectionError`` (what the pub/sub listener and asyncio set-ups catch)."""


def discover_master(sentinel: Any, service: str) -> tuple[str, int, Any]:
    """Where the sentinels say ``service``'s master is, and which sentinel
    said so: ``(host, port, that sentinel's client)``. ``SENTINEL
    GET-MASTER-ADDR-BY-NAME`` of the first sentinel (of redis-py's ``Sentinel``
    ``sentinel``, in its order; the one that answered is asked first next time)
    that names one, as the Sentinel client guidelines ask. Not redis-py's ``discover_master``: that reads ``SENTINEL
    MASTERS``, which names the *old* master until a failover has reconfigured
    every replica (a second or more), while this answer names the promoted
    replica as soon as it is promoted; the old master, demoted, would answer
    ``READONLY`` to every request meanwhile. (A master the sentinels call down
    but have not replaced yet is still named: connecting to it fails, as
    asking would.) Raises redis-py's ``MasterNotFoundError`` (a
    ``ConnectionError``) naming each sentinel's reason, never a password."""
    from redis.sentinel import MasterNotFoundError

    reasons = []
    clients = list(sentinel.sentinels)
    for k, client in enumerate(clients):
        try:
            reply = client.execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", service)
        except (RedisError, OSError) as e:
            reasons.append(f"{type(e).__name__}: {e}")
            continue
        if reply:
            if k:  # asked first next time (as redis-py does): a dead one costs once
                sentinel.sentinels = [client, *clients[:k], *clients[k + 1:]]
            host, port = reply[0], reply[1]
            return (host.decode() if isinstance(host, bytes) else str(host)), int(port), client
        reasons.append("does not know the service")
    raise MasterNotFoundError(f"No master found for {service!r}"
                              + (f" ({'; '.join(reasons)})" if reasons else ""))


def _address_of(spec: NodeSpec, url: str) -> tuple[str, int]:
    host_port = url.split("://", 1)[1].rsplit("/", 1)[0]
    host, _, port = host_port.rpartition(":")
    return host.strip("[]"), int(port)


def _connection_options(spec: NodeSpec, node: NodeClient) -> dict[str, Any]:
    """redis-py connection kwargs from a group node's OPTIONS (with its bounds)."""
    kwargs = dict(spec.options)
    kwargs.pop("max_connections", None)
    kwargs["socket_timeout"] = node.timeout
    kwargs["socket_connect_timeout"] = node.connect_timeout
    kwargs.setdefault("client_name", "django-redlock")
    if spec.addresses and spec.addresses[0].startswith("rediss://"):
        kwargs["connection_class"] = redis.SSLConnection
    return kwargs


# --------------------------------------------------------------------------
# Sentinel
# --------------------------------------------------------------------------


class SentinelNode(NodeClient):
    """A Sentinel-managed master: see the module docstring."""

    moves = True
    router = Router
    #: A release never hands the lock to a waiter here (engine.protocol's
    #: _hand_over_entry): right after a failover the waiter may still listen
    #: on the old master, now a replica, where the new master's notice still
    #: arrives (replicated) while its PUBLISH counted nobody, so the release
    #: took the lock back. The waiter is woken, and asks.
    hands_over = False

    def __init__(self, spec: NodeSpec, **kwargs: Any) -> None:
        super().__init__(spec, **kwargs)
        #: The master's (host, port) as last resolved; None before the first.
        self.address: tuple[str, int] | None = None
        #: Masters resolved so far (a failover followed adds one).
        self.switches = 0
        self._stale = True
        self._resolving = threading.Lock()
        #: Resolves ended, and why the last one failed ("" when it did not):
        #: a thread that waited for another's resolve takes its failure.
        self._resolves = 0
        self._resolve_failure = ""
        self._sentinel: Any = None
        #: The sentinel client that named ``address`` (see :meth:`_named_unreachable`).
        self._named_by: Any = None
        self._checked = 0.0
        self._checking = False

    @property
    def service(self) -> str:
        """The master's name as the sentinels know it."""
        return self.spec.service

    # -- where the master is ------------------------------------------------
    def sentinel(self) -> Any:
        """redis-py's ``Sentinel`` over this node's sentinels (built once), each
        sentinel's client with that sentinel URL's own user and password: a
        URL without them connects without (redis-py's ``sentinel_kwargs`` are
        one set for all; settings check ``redlock.E013`` refuses a list where
        only some URLs carry a password), each asked once per resolve."""
        if self._sentinel is None:
            from redis.backoff import NoBackoff
            from redis.retry import Retry
            from redis.sentinel import Sentinel

            common: dict[str, Any] = {
                "socket_timeout": self.connect_timeout,
                "socket_connect_timeout": self.connect_timeout,
                # One try per sentinel: redis-py's default retries a refused or
                # refusing sentinel (a wrong password too) 3 times with back-off,
                # 4 s before the next sentinel is asked, past the connection wait.
                "retry": Retry(NoBackoff(), 0)}
            if self.spec.addresses[0].startswith("rediss://"):
                common["ssl"] = True
                common.update({k: v for k, v in self.spec.options.items()
                               if k.startswith("ssl_")})
            addresses = [_address_of(self.spec, a) for a in self.spec.addresses]
            sentinel = Sentinel(addresses, sentinel_kwargs=common)  # type: ignore[no-untyped-call]
            own = list(self.spec.address_options) + [{}] * len(addresses)
            sentinel.sentinels = [redis.Redis(host=host, port=port, **common, **dict(own[k]))
                                  for k, (host, port) in enumerate(addresses)]
            self._sentinel = sentinel
        return self._sentinel

    def resolve(self) -> tuple[str, int]:
        """The master's address, asked of the sentinels when not trusted
        (blocking: at most ``CONNECT_TIMEOUT`` per sentinel). Raises
        :class:`MasterUnknown`.

        A resolve that waited for another thread's takes its outcome: the
        address, or its failure. Asking every sentinel again after a failure
        made each waiting thread's resolve a whole round of timeouts after
        the one before (three event loops' set-ups with every sentinel down:
        their workers ended at 1.5, 3 and 4.5 s, past the 2 s bound of
        :meth:`resolve_bound`)."""
        seen = self._resolves
        with self._resolving:
            if not self._stale and self.address is not None:
                return self.address
            if self._resolves != seen and self._resolve_failure:
                # One ended since this call came, having asked every sentinel.
                raise MasterUnknown(self.name, self._resolve_failure, sent=False)
            try:
                host, port, named_by = discover_master(self.sentinel(), self.service)
            except (RedisError, OSError) as e:
                self._resolve_failure = (f"no master for {self.service!r} from the "
                                         f"sentinels: {e}")
                self._resolves += 1
                raise MasterUnknown(self.name, self._resolve_failure, sent=False) from e
            self._resolve_failure = ""
            self._resolves += 1
            self._checked = time.monotonic()
            self._stale = False
            self._named_by = named_by
            address = (str(host), int(port))
            if address != self.address:
                if self.address is not None:
                    logger.warning("node %s: master moved from %s:%s to %s:%s", self.name,
                                   *self.address, *address)
                self.address = address
                self.switches += 1
                self._forget_connections()
            return address

    def resolve_bound(self) -> float:
        """How long the asyncio set-up waits for :meth:`resolve` (run in a
        worker thread): one ``CONNECT_TIMEOUT`` per sentinel asked, as the
        sync set-up's resolve takes at most (each sentinel is asked for at
        most that, one after the other), and one more for the worker thread
        to start and a resolve under way in another thread to end. The whole
        stays bounded: sentinels that all do not answer fail the set-up
        within it. Timeline (a cold node, its first sentinel paused, connect
        timeout 0.5 s)::

            t=0     the asyncio set-up resolves: sentinel 1 does not answer
            t=0.5   sentinel 1 given up; sentinel 2 names the master
            before: the set-up gave the whole resolve one connect timeout:
                    at t=0.5 it failed ("no master address within 0.5 s"),
                    and so did the first call (only the next one, in the
                    same process, found the address the thread had left)
            now:    3 sentinels, 2 s: the address at t=0.5+, the call granted

        A bound for the thread's work is all it is: the thread is not
        stopped (nothing stops a thread), its socket timeouts end it."""
        return self.connect_timeout * (len(self.sentinel().sentinels) + 1)

    def _after_fork(self) -> None:
        """In a forked child: what the parent's threads held is free, and the
        master is asked again. Timeline (a sentinel that does not answer is
        asked first, each costs ``CONNECT_TIMEOUT``)::

            t0  parent thread A resolves: holds _resolving (and _pool_lock,
                when the pool is being built), waits for the first sentinel
            t1  another thread forks (multiprocessing, a pre-fork server)
            t1+ before: in the child A does not exist, _resolving stays held:
                every connection set-up blocks for good (every call fails
                QuorumUnavailable, resolve() never returns); a recheck under
                way at the fork left _checking set: no recheck ever again
                now: both locks are new, nothing is being checked, and the
                address (maybe the one A was replacing) is asked again

        Not :meth:`distrust`: no I/O and no connection touched here (the
        idle ones are the parent's, dropped by the base class)."""
        super()._after_fork()
        self._resolving = threading.Lock()
        self._resolve_failure = ""
        self._checking = False
        self._checked = 0.0
        self._stale = True

    def distrust(self) -> None:
        """The master may have moved: ask the sentinels at the next set-up, and
        set up new connections (the idle ones may reach a demoted master)."""
        if not self._stale:
            self._stale = True
            self._forget_connections()

    def _named_unreachable(self) -> None:
        """The master a sentinel named could not be reached, or said it is
        not the master: that sentinel is asked last at the next resolve.

        Otherwise the first sentinel that answers is asked first every time
        (redis-py's order, kept by :func:`discover_master`), and one that
        names a dead master keeps every call failing while the others name a
        live one. Timeline (the chaos run's failover schedule, seen in CI)::

            t0  sentinel S1 forces a failover: R is promoted; S1's failover
                is still on (it reconfigures the other replicas)
            t1  R dies before S1's failover ends: S1 keeps naming R, and does
                not end its failover while R is down
            t2  S2 and S3 call R down, elect S2, promote M; they name M
            t2+ every resolve asked S1 first (it answered last time): R,
                connection refused, QuorumUnavailable, for as long as S1
                stayed so (7 s in that run; more than 25 s in isolation)

        A sentinel that names the right master costs nothing here: the
        order changes only after a failure, and all sentinels are equal."""
        named_by, self._named_by = self._named_by, None
        sentinel = self._sentinel
        if named_by is None or sentinel is None:
            return
        clients = list(sentinel.sentinels)
        if len(clients) > 1 and clients[0] is named_by:
            sentinel.sentinels = [*clients[1:], named_by]

    def _forget_connections(self) -> None:
        # Not under _pool_lock: the first resolve may run inside _build_pool.
        self._pool = None  # rebuilt for the new address (_build_pool)
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.disconnect()

    def accepts(self, conn: Any) -> bool:
        return (not self._stale and self.address is not None
                and (getattr(conn, "host", None), getattr(conn, "port", None)) == self.address)

    def recheck_due(self, now: float) -> None:
        """After a round: ask the sentinels again in the background every
        :data:`RECHECK` seconds (a failover with no error seen yet)."""
        if self._checking or now - self._checked < RECHECK or self.address is None:
            return
        self._checking = True
        self._checked = now
        try:
            threading.Thread(target=self._recheck, name=f"redlock-sentinel {self.name}",
                             daemon=True).start()
        except RuntimeError:  # at interpreter shutdown (3.12 refuses threads): no recheck
            self._checking = False

    def _recheck(self) -> None:
        try:
            host, port, _ = discover_master(self.sentinel(), self.service)
            if (str(host), int(port)) != self.address:
                self.distrust()
        except (RedisError, OSError):
            pass  # the next failure distrusts it; the sentinels may be back by then
        finally:
            self._checking = False

    def topology(self, client: Any) -> tuple[str, str | None]:
        """For ``locks health``: the master the sentinels name now (asked
        again), and a warning when the server reached is not it."""
        self.distrust()
        try:
            host, port = self.resolve()
        except MasterUnknown as e:
            return "master unknown", e.reason
        shown = f"master {host}:{port} ({self.service})"
        role = client.info("replication").get("role")
        if role != "master":
            return shown, f"the sentinels name {host}:{port}, which reports role {role}"
        return shown, None

    # -- connections (NodeClient hooks) -------------------------------------
    def _build_pool(self) -> Any:
        host, port = self.resolve()
        kwargs = _connection_options(self.spec, self)
        kwargs["protocol"] = 2
        return redis.ConnectionPool(host=host, port=port, db=0, **kwargs)

    def new_connection(self) -> Any:
        self.resolve()
        return super().new_connection()

    def async_address(self) -> dict[str, Any]:
        """host and port for an asyncio connection (resolving, blocking, first
        when not trusted: run in a worker thread)."""
        host, port = self.resolve()
        return {"host": host, "port": port}

    def put(self, conn: Any) -> None:
        if self.accepts(conn):
            super().put(conn)
        else:
            conn.disconnect()

    def mark_failed(self, now: float) -> None:
        super().mark_failed(now)
        self._named_unreachable()
        self.distrust()

    def unreached(self, result: Any) -> bool:
        """Whether ``result`` says this round could not reach the master the
        node trusted, and nothing was sent: the connection set-up failed
        (refused, no answer), and :meth:`mark_failed` has the master
        distrusted and its sentinel asked last. Worth once more in the same
        call: the next set-up asks the sentinels again, and the first of them
        names the new master when a failover has moved it. Timeline (the
        chaos run's failover schedule)::

            t0  the node trusts R, named by sentinel S1
            t1  R dies; S2 and S3 promote M; S1 stays in its own failover,
                naming R
            t2  a call: connecting to R is refused -> R distrusted, S1 last;
                before: the call failed (its only node refused it)
                now: once more, a set-up that asks S2 -> M; granted

        A round that skipped the node (its back-off) learnt nothing: not
        again. Nor when the request left (a timeout): it may have run; nor
        before a first master is known (a cold node's set-up is still on).
        The second round waits for its connection as any round does (the
        node timeout, or up to the caller's deadline), so a call whose
        sentinels all name a dead master fails after two tries."""
        return (isinstance(result, NodeError) and not result.sent and not result.skipped
                and self._stale and self.address is not None)

    @staticmethod
    def moved_away(result: Any) -> bool:
        """Whether a reply says this server is no longer (or not yet) the master."""
        error = result.first if isinstance(result, ChainReply) else result
        return isinstance(error, (ReadOnlyError, BusyLoadingError)) or (
            isinstance(error, ResponseError) and bool(_MOVED_AWAY.search(str(error))))

    def note_reply(self, result: Any) -> None:
        if self.moved_away(result):
            self._named_unreachable()
            self.distrust()


class CacheNode(SentinelNode):
    """A ``cache:<alias>`` node: the django-redis cache's own pool.

    When the cache is a Sentinel client (django-redis's ``SentinelClient``: its
    pool a ``redis.sentinel.SentinelConnectionPool``), the node follows the
    master like a Sentinel node, asking the cache's own sentinels for
    ``LOCATION``'s service; otherwise it is a plain node. Which one is known
    once the pool is lent (lazily, at the first connection, as for any cache
    node). django-redis has no Cluster client; a Cluster is a ``CLUSTER`` entry.
    """

    def __init__(self, spec: NodeSpec, **kwargs: Any) -> None:
        super().__init__(spec, **kwargs)
        self._follows: bool | None = None

    @property
    def follows(self) -> bool:
        """Whether the cache's pool is a Sentinel pool."""
        if self._follows is None:
            from redis.sentinel import SentinelConnectionPool

            self._follows = isinstance(self.pool, SentinelConnectionPool)
        return self._follows

    @property
    def moves(self) -> bool:  # type: ignore[override]
        return self.follows

    @property
    def hands_over(self) -> bool:  # type: ignore[override]
        return not self.follows

    @property
    def service(self) -> str:
        return str(self.pool.service_name)

    def sentinel(self) -> Any:
        return self.pool.sentinel_manager

    def _build_pool(self) -> Any:
        return NodeClient._build_pool(self)  # the cache's (pool_factory), never ours

    def _forget_connections(self) -> None:
        idle, self._idle = self._idle, []  # the borrowed pool stays the cache's
        for conn in idle:
            conn.disconnect()

    def new_connection(self) -> Any:
        if not self.follows:
            return NodeClient.new_connection(self)
        host, port = self.resolve()
        conn = NodeClient.new_connection(self)
        conn.host, conn.port = host, port  # (a SentinelManagedConnection asks again itself)
        return conn

    def accepts(self, conn: Any) -> bool:
        return not self.follows or super().accepts(conn)

    def distrust(self) -> None:
        if self.follows:
            super().distrust()

    def recheck_due(self, now: float) -> None:
        if self.follows:
            super().recheck_due(now)

    def topology(self, client: Any) -> tuple[str | None, str | None]:  # type: ignore[override]
        if not self.follows:
            return None, None
        return super().topology(client)


# --------------------------------------------------------------------------
# Cluster
# --------------------------------------------------------------------------


class _Shard(NodeClient):
    """One master of a Cluster node: a plain node client whose answers and
    failures are counted for the Cluster node too (the engine reads those of
    the node it knows)."""

    def __init__(self, parent: ClusterNode, host: str, port: int) -> None:
        scheme = "rediss" if parent.spec.addresses[0].startswith("rediss://") else "redis"
        shown = f"[{host}]" if ":" in host else host
        spec = NodeSpec(kind="url", url=f"{scheme}://{shown}:{port}/0",
                        options=parent.spec.options, name=parent.name)
        super().__init__(spec, node_timeout=parent.timeout,
                         connect_timeout=parent.connect_timeout)
        self.parent = parent
        self.address = (host, port)

    def mark_ok(self) -> None:
        super().mark_ok()
        self.parent.answers += 1

    def note_set_up_began(self) -> None:
        super().note_set_up_began()
        self.parent.note_set_up_began()

    def note_set_up_reply(self) -> None:
        super().note_set_up_reply()
        self.parent.note_set_up_reply()

    def note_set_up_failed(self, at: float) -> None:
        super().note_set_up_failed(at)
        self.parent.note_set_up_failed(at)

    def mark_failed(self, now: float) -> None:
        super().mark_failed(now)
        self.parent.errors += 1
        self.parent.refresh()

    def note_round_trip(self, seconds: float) -> None:
        super().note_round_trip(seconds)
        self.parent.note_round_trip(seconds)


def request_key(request: Any) -> bytes | None:
    """The first key a request touches (all its keys share its slot)."""
    if type(request) is Chain:
        request = request.first if not isinstance(request.first, _Asking) else request.then
    if isinstance(request, Call):
        return bytes(request.keys[0]) if request.keys else None  # type: ignore[arg-type]
    if isinstance(request, Command):
        return getattr(request, "key", None)
    return None


class _Asking(Command):
    """``ASKING``, sent right before a request redirected by ``ASK``."""

    def __init__(self) -> None:
        super().__init__(b"ASKING")


#: Cluster redirections by their reply's first word, for a redis-py whose plain
#: connections parse them as a bare ``ResponseError`` (5.x: only its cluster
#: client's parser knows them).
_REDIRECTIONS = {"MOVED": MovedError, "ASK": AskError, "TRYAGAIN": TryAgainError}


def _cluster_error(error: Any) -> Any:
    """``error`` as redis-py's ``MovedError``/``AskError``/``TryAgainError``
    when it is one of those replies under another class; else unchanged."""
    if type(error) is not ResponseError:
        return error
    code, _, rest = str(error).partition(" ")
    kind = _REDIRECTIONS.get(code)
    if kind is None:
        return error
    try:
        return kind(rest)
    except (ValueError, IndexError):  # not a redirection after all
        return error


def key_slot(key: bytes) -> int:
    from redis.crc import key_slot as crc_slot

    return int(crc_slot(key))


class ClusterNode(NodeClient):
    """A Redis Cluster: see the module docstring."""

    #: One script call touches one hash slot (rounds.extend_many_steps).
    one_slot_per_call = True
    router = Router
    #: A release never hands the lock to a waiter here (engine.protocol's
    #: _entries): its PUBLISH counts only the listeners on its own master, so
    #: it cannot tell whether the waiter heard; the waiter is woken instead.
    hands_over = False

    def __init__(self, spec: NodeSpec, **kwargs: Any) -> None:
        super().__init__(spec, **kwargs)
        self._shards: dict[tuple[str, int], _Shard] = {}
        self._shards_lock = threading.Lock()
        #: slot -> (host, port) learnt from MOVED since the last map.
        self._moved: dict[int, tuple[str, int]] = {}
        self._manager: Any = None
        self._refreshing = False
        self._refresh_lock = threading.Lock()
        #: Maps loaded so far.
        self.refreshes = 0
        self._refresh_started = -REFRESH_MIN

    # -- the slot map ---------------------------------------------------------
    def refresh(self) -> None:
        """Reload the slot map in the background (one load at a time, at most
        one every :data:`REFRESH_MIN` seconds: a Cluster that is down is not
        asked on every request)."""
        now = time.monotonic()
        with self._refresh_lock:
            if self._refreshing or now - self._refresh_started < REFRESH_MIN:
                return
            self._refreshing = True
            self._refresh_started = now
        try:
            threading.Thread(target=self._load, name=f"redlock-cluster {self.name}",
                             daemon=True).start()
        except RuntimeError:  # at interpreter shutdown (3.12 refuses threads): no reload
            self._refreshing = False

    def _load(self) -> None:
        try:
            from redis.cluster import ClusterNode as StartupNode
            from redis.cluster import NodesManager

            if self._manager is None:
                kwargs = _connection_options(self.spec, self)
                kwargs.pop("client_name", None)
                if kwargs.pop("connection_class", None) is not None:
                    kwargs["ssl"] = True
                self._manager = NodesManager(
                    [StartupNode(*_address_of(self.spec, a))  # type: ignore[no-untyped-call]
                     for a in self.spec.addresses],
                    require_full_coverage=False, **kwargs)
            else:
                self._manager.initialize()
            self._moved = {}
            self.refreshes += 1
        except (RedisError, RedisClusterException, OSError, IndexError, KeyError) as e:
            # (RedisClusterException: no start-up node reachable; not a
            # RedisError, it ended the thread with a traceback)
            logger.info("node %s: no slot map yet: %s", self.name, scrub(str(e)))
        finally:
            with self._refresh_lock:
                self._refreshing = False

    def owner(self, slot: int) -> tuple[str, int]:
        """Who serves ``slot``: MOVED first, then the map, else a start-up node
        (which answers MOVED)."""
        moved = self._moved.get(slot)
        if moved is not None:
            return moved
        manager = self._manager
        if manager is None:
            self.refresh()  # the first use (no I/O when the manager is built)
        else:
            try:
                node = manager.get_node_from_slot(slot)
            except (RedisError, IndexError, KeyError, TypeError):
                node = None
            if node is not None:
                return str(node.host), int(node.port)
        return _address_of(self.spec, self.spec.addresses[0])

    def shard(self, address: tuple[str, int]) -> _Shard:
        shard = self._shards.get(address)
        if shard is None:
            with self._shards_lock:
                shard = self._shards.get(address)
                if shard is None:
                    shard = self._shards[address] = _Shard(self, *address)
        return shard

    def route(self, request: Any) -> NodeClient:
        key = request_key(request)
        if key is None:  # a keyless command (PING, INFO): any master
            return self.shard(self.owner(0))
        return self.shard(self.owner(key_slot(key)))

    def redirect(self, result: Any, request: Any, sent: Any, target: NodeClient
                 ) -> Redirect | None:
        """Where a ``MOVED``/``ASK``/``TRYAGAIN`` reply (to ``sent``, which is
        ``request`` or it behind ``ASKING``) sends ``request`` next, and after
        what pause: it ran nothing. None for any other reply. No I/O and no
        wait here: the driver waits the pause its own way (:class:`Hop`)."""
        error = _cluster_error(result.first if isinstance(result, ChainReply) else result)
        if isinstance(error, MovedError):
            address = (str(error.host) or self.owner(error.slot_id)[0], int(error.port))
            self._moved[int(error.slot_id)] = address
            self.refresh()
            return Redirect(self.shard(address), request)
        if isinstance(error, AskError):
            shard = self.shard((str(error.host), int(error.port)))
            if type(request) is Chain:
                # A grant with WAIT behind it (REPLICA_ACKS): ASKING, the script,
                # then WAIT, all to the importing master, so that WAIT confirms
                # the write of the master that made it. (WAIT on the master that
                # answered ASK would confirm nothing: it wrote nothing.)
                return Redirect(shard, Chain(request.first, request.then, lead=(_Asking(),)))
            return Redirect(shard, Chain(_Asking(), request))
        if isinstance(error, TryAgainError):
            # Some of the request's keys moved, some not (or do not exist):
            # the same master, the same way, a moment later. A slot whose
            # move takes longer answers the call with the reply: nothing ran,
            # and an acquire round counts the node busy for this round
            # (engine.rounds.retry_later), so a blocking acquire waits for the
            # move to end and a try is refused. The moment is the driver's to
            # wait: a sleep here, under the asyncio transport, stopped the
            # whole event loop 5 ms for every TRYAGAIN of a move.
            return Redirect(target, sent, TRYAGAIN_PAUSE)
        return None

    def _map(self) -> Any:
        """The slot map, loaded now (blocking) when not yet: for inspection."""
        bound = time.monotonic() + self.connect_timeout * len(self.spec.addresses) + 1.0
        while self._manager is None and self._refreshing and time.monotonic() < bound:
            time.sleep(0.01)  # the background load under way (bounded)
        if self._manager is None:
            self._load()
        return self._manager

    def master_pools(self) -> list[Any]:
        """For ``locks list``: a pool per master of the Cluster."""
        manager = self._map()
        if manager is None:
            return [self.pool]
        masters = manager.get_nodes_by_server_type("primary")
        return [self.shard((str(m.host), int(m.port))).pool for m in masters]

    def pool_for(self, key: bytes) -> Any:
        """For ``locks show``: the pool of the master serving ``key``."""
        self._map()
        return self.shard(self.owner(key_slot(key))).pool

    def topology(self, client: Any) -> tuple[str, str | None]:
        """For ``locks health``: the Cluster's state as one of its masters
        sees it, and a warning unless it is ``ok`` with every slot served."""
        info = client.execute_command("CLUSTER", "INFO")
        if isinstance(info, bytes):
            info = info.decode()
        fields = dict(line.split(":", 1) for line in str(info).split() if ":" in line)
        state = fields.get("cluster_state", "?")
        slots = fields.get("cluster_slots_ok", "?")
        masters = fields.get("cluster_size", "?")
        shown = f"cluster_state:{state}, {masters} masters, {slots} slots ok"
        if state != "ok" or slots != "16384":
            return shown, f"the Cluster is not fully served ({shown}): locks on the " \
                          f"slots without a master fail"
        return shown, None

    def _after_fork(self) -> None:
        """In a forked child: what the parent's threads held is free, and the
        slot map is loaded again. A load under way at the fork (a background
        thread, in redis-py's ``NodesManager.initialize`` under its
        ``_initialization_lock``) left ``_refreshing`` set and that lock
        held: before, the child never loaded a map again (every request went
        to a start-up node and followed MOVED; a slot whose owner failed
        over was never found), and ``locks list`` in the child waited for
        good. The parent's map is dropped with its locks (its connections
        are the parent's too); the child's first request loads its own."""
        super()._after_fork()
        self._shards_lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._refreshing = False
        self._refresh_started = -REFRESH_MIN
        self._manager = None
        for shard in self.shards:
            shard._after_fork()

    def new_connection(self) -> Any:
        # The map may have changed since the pool was built (a failover).
        with self._pool_lock:
            pool = self._pool
            if pool is not None and (pool.connection_kwargs.get("host"),
                                     pool.connection_kwargs.get("port")) != self.owner(0):
                self._pool = None
        return super().new_connection()

    @property
    def shards(self) -> list[_Shard]:
        return list(self._shards.values())

    def forget(self, tag: Any) -> None:
        for shard in self.shards:
            shard.forget(tag)

    def close(self) -> None:
        for shard in self.shards:
            shard.close()
        manager, self._manager = self._manager, None
        if manager is not None:
            try:
                manager.reset()
            except Exception:  # noqa: BLE001 - closing: nothing to report to
                pass
        super().close()

    def _build_pool(self) -> Any:
        # For the pub/sub listener and inspection: the master of slot 0 when the
        # map is known (a PUBLISH reaches every node of a Cluster, so any one
        # serves the wake-up), else the first start-up node.
        host, port = self.owner(0)
        kwargs = _connection_options(self.spec, self)
        kwargs["protocol"] = 2
        return redis.ConnectionPool(host=host, port=port, db=0, **kwargs)


# --------------------------------------------------------------------------
# What the transports call
# --------------------------------------------------------------------------


def route(nodes: Sequence[NodeClient], requests: Sequence[Any]) -> list[NodeClient]:
    """The node client each request goes to (a Cluster node's: its slot's master)."""
    return [node.route(request) if isinstance(node, ClusterNode) and request is not None
            else node for node, request in zip(nodes, requests)]


def follow_redirects(nodes: Sequence[NodeClient], targets: list[NodeClient],
                     requests: Sequence[Any], sent: Sequence[Any], results: list[Any],
                     asked_again: set[int] | None = None) -> Hop | None:
    """The round to send again for the requests a Cluster redirected
    (``MOVED``/``ASK``/``TRYAGAIN``), a demoted Sentinel master refused, or
    a Sentinel node could not deliver because its master was unreachable
    (once per node and call: ``asked_again`` holds the nodes that had theirs):
    node clients, requests (None for the others) and the pause before it
    (the longest any redirection asked for); None when there is none.
    ``requests``: the originals; ``sent``: what went out last (None:
    nothing, this time). No I/O and no wait: the caller sends and waits."""
    again: list[Any] = [None] * len(nodes)
    found = False
    pause = 0.0
    new_targets = list(targets)
    for i, node in enumerate(nodes):
        if sent[i] is None:
            continue
        if isinstance(node, ClusterNode):
            hop = node.redirect(results[i], requests[i], sent[i], targets[i])
            if hop is not None:
                new_targets[i], again[i] = hop.target, hop.request
                pause = max(pause, hop.pause)
                found = True
        elif isinstance(node, SentinelNode) and node.moves and node.moved_away(results[i]):
            # Refused by a demoted master (a write refused runs nothing): again,
            # on a connection to the master the sentinels name now.
            node.distrust()
            again[i] = requests[i]
            found = True
        elif (isinstance(node, SentinelNode) and node.moves and asked_again is not None
              and i not in asked_again and node.unreached(results[i])):
            # Its master could not be reached (nothing sent): once more in this
            # call, through a set-up that asks the sentinels again, the one that
            # named the unreachable master last (SentinelNode.unreached).
            asked_again.add(i)
            again[i] = requests[i]
            found = True
    return Hop(new_targets, again, pause) if found else None


def unwrap(request: Any, result: Any) -> Any:
    """The reply of a request sent behind ``ASKING``: its own."""
    if type(request) is Chain and isinstance(request.first, _Asking):
        if isinstance(result, ChainReply):
            return result.then
    return result


def after_round(nodes: Sequence[NodeClient], results: Sequence[Any], now: float) -> None:
    """What the replies say about where the masters are (Sentinel nodes)."""
    for node, result in zip(nodes, results):
        if isinstance(node, SentinelNode):
            if not node.moves:
                continue
            if isinstance(result, (ResponseError, ChainReply)):
                node.note_reply(result)
            node.recheck_due(now)


def _view(transport: Any, targets: list[NodeClient]) -> Any:
    """The transport over ``targets`` (each node's client for this round),
    sharing everything else (the asyncio one's per-loop connections, keyed
    by node client); a plain round, not routed again."""
    import copy

    view = copy.copy(transport)
    view._base = transport.nodes
    view.nodes = targets
    view.routed = False
    view.viewing = True
    return view


def _releases(request: Any) -> bool:
    """Whether ``request`` releases a lock (a release, a clean-up), also
    behind ``WAIT`` (a :class:`Chain`)."""
    call = request.first if type(request) is Chain else request
    script = getattr(call, "script", None)
    return bool(getattr(script, "releases", False))


def _redirects_awaited(nodes: Sequence[NodeClient], requests: Sequence[Any],
                       kwargs: dict[str, Any]) -> dict[str, Any]:
    """The round's arguments, with no settling when it releases on a Cluster
    or Sentinel node: a redirection (``MOVED``, ``ASK``, ``TRYAGAIN``, a
    demoted master's refusal) is followed only when its reply is read in
    the call, and a round settled on the other nodes' replies left it unread
    (read and dropped by a later round): the key stayed on the slot's new
    master for its lease, that node busy for every other holder::

        t0   release: plain nodes A and B delete the key at once (a quorum)
        t0   the Cluster's old master, slow, answers MOVED later: unread
        ...  the key stays on the new master until its lease ends

    So such a round waits for every node's reply (within each node's
    timeout), as a round without a settle does. An acquire still settles:
    a grant a redirection would have given is not needed once a quorum
    decided, and its clean-up is a release."""
    if kwargs.get("settle") is None:
        return kwargs
    for node, request in zip(nodes, requests):
        if (request is not None and isinstance(node, (ClusterNode, SentinelNode))
                and _releases(request)):
            return dict(kwargs, settle=None)
    return kwargs


def routed_round(transport: Any, requests: Sequence[Any], **kwargs: Any) -> list[Any]:
    """A sync round through Sentinel and Cluster nodes: each request to its
    node's master; a Cluster's redirections followed (at most
    :data:`MAX_REDIRECTS` more rounds, for the redirected requests only); the
    replies then tell the Sentinel nodes whether their master moved. A
    release waits for those nodes' replies (:func:`_redirects_awaited`)."""
    nodes = transport.nodes
    kwargs = _redirects_awaited(nodes, requests, kwargs)
    targets = route(nodes, requests)
    results = _view(transport, targets).round(requests, **kwargs)
    sent: list[Any] = list(requests)
    asked_again: set[int] = set()
    for _ in range(MAX_REDIRECTS):
        hop = follow_redirects(nodes, targets, requests, sent, results, asked_again)
        if hop is None:
            break
        targets, sent = hop.targets, hop.requests
        if hop.pause:
            time.sleep(hop.pause)  # this thread's call only
        more = _view(transport, targets).round(
            sent, skip_backoff=False, tag=kwargs.get("tag"), final=kwargs.get("final", False),
            until=kwargs.get("until"))
        for i, request in enumerate(sent):
            if request is not None:
                results[i] = unwrap(request, more[i])
    after_round(nodes, results, transport.clock())
    return list(results)


async def async_routed_round(transport: Any, requests: Sequence[Any], **kwargs: Any
                             ) -> list[Any]:
    """:func:`routed_round` for the asyncio transport: the same redirections,
    and a ``TRYAGAIN``'s pause awaited, never slept (the loop goes on)."""
    nodes = transport.nodes
    kwargs = _redirects_awaited(nodes, requests, kwargs)
    targets = route(nodes, requests)
    results = await _view(transport, targets).round(requests, **kwargs)
    sent: list[Any] = list(requests)
    asked_again: set[int] = set()
    for _ in range(MAX_REDIRECTS):
        hop = follow_redirects(nodes, targets, requests, sent, results, asked_again)
        if hop is None:
            break
        targets, sent = hop.targets, hop.requests
        if hop.pause:
            await asyncio.sleep(hop.pause)  # the loop's other tasks run meanwhile
        more = await _view(transport, targets).round(
            sent, skip_backoff=False, tag=kwargs.get("tag"), final=kwargs.get("final", False),
            until=kwargs.get("until"))
        for i, request in enumerate(sent):
            if request is not None:
                results[i] = unwrap(request, more[i])
    after_round(nodes, results, transport.clock())
    return list(results)
