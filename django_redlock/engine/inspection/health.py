"""Are the nodes fit: ``locks health`` and the deploy checks (clock offsets,
eviction settings, what answers at a node's address)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis
from redis.exceptions import InvalidResponse, ResponseError

from ...transport.sync import NODE_DOWN_ERRORS

if TYPE_CHECKING:
    from ...transport.sync import NodeClient
    from ..protocol import LockHost
from .common import (
    CLOCK_OFFSET_WARN_MS,
    PINGS,
    _client,
    _each_node,
    short_reason,
)

#: What reading one server can raise that means "this server is not usable"
#: (what ``_each_node`` catches for a whole node).
_UNREADABLE = (*NODE_DOWN_ERRORS, ResponseError, InvalidResponse)


def _masters(node: NodeClient) -> list[tuple[str, redis.Redis]]:
    """``(host:port, client)`` for each master of a node that has several (a
    Cluster node: ``master_pools``); empty for a node that is one server.

    Each master holds the locks of its own slots and has its own settings:
    reading only the one serving slot 0 (``node.pool``) passed a Cluster
    whose other masters evict keys (``maxmemory-policy allkeys-lru``) as
    healthy, in ``locks health`` and in ``check --deploy`` alike."""
    if not hasattr(node, "master_pools"):
        return []
    found = []
    for pool in node.master_pools():
        kwargs = getattr(pool, "connection_kwargs", None) or {}
        host, port = str(kwargs.get("host", "?")), kwargs.get("port", "?")
        shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        found.append((shown, redis.Redis(connection_pool=pool)))
    return found

# ------------------------------------------------------------------ health

@dataclass
class NodeHealth:
    """One node's answers to ``locks health``."""

    node: str
    ok: bool
    error: str | None = None
    rtt_ms: float | None = None
    server: str | None = None  # "redis" or "valkey"
    version: str | None = None
    role: str | None = None  # "master" or "replica"
    aof_enabled: bool | None = None
    appendfsync: str | None = None  # None when CONFIG GET is refused
    save: str | None = None  # RDB snapshot schedule, "" when off, None when unknown
    config_readable: bool = False
    clock_ms: float | None = None  # node time minus local time, at the midpoint of TIME
    clock_offset_ms: float | None = None  # against the median of the reachable nodes
    warnings: list[str] = field(default_factory=list)
    maxmemory: int | None = None  # bytes, 0: no limit; None when unknown
    maxmemory_policy: str | None = None  # None when unknown
    #: Why the node is not counted healthy although it answered (eviction that
    #: drops locks, or eviction settings that could not be read).
    problem: str | None = None
    #: A Sentinel node: the master its sentinels name now ("host:port");
    #: a Cluster node: its state ("cluster_state:ok, 3 masters, 16384 slots").
    topology: str | None = None
    #: A Cluster node: each master read ("host:port"). Its warnings are each
    #: master's, named; its eviction settings (and so ``status``) the worst
    #: master's, named in ``problem``. Empty for a node that is one server.
    masters: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        """``ok``; ``down`` (no answer, or not Redis); ``unsafe`` (it evicts keys, so
        it can drop a held lock); ``unknown`` (its eviction settings could not be read)."""
        if self.error is not None:
            return "down"
        verdict = eviction_verdict(self.maxmemory, self.maxmemory_policy)
        if verdict is not None and verdict[0] in ("unsafe", "unknown"):
            return verdict[0]
        return "ok"

    @property
    def persistence(self) -> str:
        """A short summary such as ``aof always``, ``aof everysec``, ``rdb 3600 1`` or ``none``."""
        if self.aof_enabled is None:
            return "unknown"
        if self.aof_enabled:
            return f"aof {self.appendfsync or '?'}"
        if self.save:
            return f"rdb {self.save}"
        return "none" if self.save == "" else "no aof"

    def as_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "ok": self.ok,
            "error": self.error,
            "rtt_ms": None if self.rtt_ms is None else round(self.rtt_ms, 3),
            "server": self.server,
            "version": self.version,
            "role": self.role,
            "persistence": {"aof_enabled": self.aof_enabled, "appendfsync": self.appendfsync,
                            "save": self.save},
            "clock_offset_ms": None if self.clock_offset_ms is None
            else round(self.clock_offset_ms, 1),
            "warnings": list(self.warnings),
            "status": self.status,
            "problem": self.problem,
            "eviction": {"maxmemory": self.maxmemory, "policy": self.maxmemory_policy},
            "topology": self.topology,
            "masters": list(self.masters),
        }


@dataclass
class HealthReport:
    nodes: list[NodeHealth]
    quorum_size: int

    @property
    def healthy(self) -> int:
        return sum(1 for n in self.nodes if n.ok)

    @property
    def reachable(self) -> int:
        """Nodes that answered, healthy or not."""
        return sum(1 for n in self.nodes if n.error is None)

    @property
    def ok(self) -> bool:
        """A quorum of nodes answers and keeps its keys (no eviction, settings known)."""
        return self.healthy >= self.quorum_size


#: ``maxmemory-policy`` values that delete keys when ``maxmemory`` is reached.
#: ``volatile-*`` counts: every lock key has an expiry, so it is a candidate
#: (``volatile-ttl`` even picks the keys closest to expiry first).
EVICTING_POLICY_PREFIXES = ("allkeys-", "volatile-")


def eviction_verdict(maxmemory: int | None, policy: str | None) -> tuple[str, str] | None:
    """What a node's eviction settings do to held locks: None when nothing, else
    ``(kind, sentence)`` with kind ``unsafe``, ``inert`` or ``unknown``.

    Pure, shared by ``locks health`` and the ``manage.py check --deploy`` check.
    """
    if maxmemory is None or policy is None:
        return ("unknown", "eviction settings unknown (CONFIG GET maxmemory/maxmemory-policy "
                           "refused): a node that evicts keys drops held locks; make sure "
                           "maxmemory-policy is noeviction (or maxmemory is 0)")
    if not policy.startswith(EVICTING_POLICY_PREFIXES):
        return None
    if maxmemory > 0:
        return ("unsafe", f"evicts keys: maxmemory {maxmemory} bytes with maxmemory-policy "
                          f"{policy}; under memory pressure it deletes held locks, and a second "
                          f"holder gets in while the first still sees owned() true; use "
                          f"maxmemory-policy noeviction on lock nodes (not a shared cache)")
    return ("inert", f"maxmemory-policy {policy} with no maxmemory: nothing is evicted now, "
                     f"but setting maxmemory would start deleting held locks; use noeviction")


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, (str, bytes)) and value.strip().isdigit():
        return int(value)
    return None


def _eviction_settings(maxmemory_reply: Any, policy_reply: Any, memory_info: Any
                       ) -> tuple[int | None, str | None]:
    """``(maxmemory, policy)`` from ``CONFIG GET`` replies, or ``INFO memory`` when
    ``CONFIG`` is refused (managed services rename it); None where neither says."""
    maxmemory = _int_or_none(_config_value(maxmemory_reply, "maxmemory"))
    policy = _config_value(policy_reply, "maxmemory-policy")
    if isinstance(memory_info, dict):
        if maxmemory is None:
            maxmemory = _int_or_none(memory_info.get("maxmemory"))
        if policy is None and isinstance(memory_info.get("maxmemory_policy"), str):
            policy = memory_info["maxmemory_policy"]
    return maxmemory, policy


@dataclass
class NodeSettings:
    """The settings of one node that decide whether it keeps a held lock."""

    node: str
    error: str | None = None
    role: str | None = None
    maxmemory: int | None = None
    maxmemory_policy: str | None = None
    #: Replicas connected to it (INFO replication); None when unknown.
    replicas: int | None = None


def _read_server(name: str, client: redis.Redis) -> NodeSettings:
    pipe = client.pipeline(transaction=False)
    pipe.info("replication")
    pipe.info("memory")
    pipe.config_get("maxmemory")
    pipe.config_get("maxmemory-policy")
    replication, memory, maxmemory, policy = pipe.execute(raise_on_error=False)
    found = NodeSettings(node=name)
    if isinstance(replication, dict) and replication.get("role"):
        role = str(replication["role"])
        found.role = "replica" if role == "slave" else role
        connected = replication.get("connected_slaves")
        found.replicas = connected if isinstance(connected, int) else None
    found.maxmemory, found.maxmemory_policy = _eviction_settings(maxmemory, policy, memory)
    return found


def _read_settings(node: NodeClient) -> list[NodeSettings]:
    """The node's settings; a Cluster node's, one per master (named by its
    address), each master that could not be read with its reason."""
    masters = _masters(node)
    if not masters:
        return [_read_server(node.name, _client(node))]
    found = []
    for address, client in masters:
        name = f"{node.name} master {address}"
        try:
            found.append(_read_server(name, client))
        except _UNREADABLE as e:
            found.append(NodeSettings(node=name, error=short_reason(node, e)))
    return found


def read_node_settings(manager: "LockHost", *, deadline: float) -> list[NodeSettings]:
    """Role and eviction settings of every node, in parallel, within ``deadline``
    s: one entry per node, and per master of a Cluster node (in the node's place)."""
    nodes = manager.nodes
    outcomes = _each_node(nodes, _read_settings, deadline)
    found: list[NodeSettings] = []
    for node, o in zip(nodes, outcomes, strict=True):
        found += o.value if o.error is None else [NodeSettings(node=node.name, error=o.error)]
    return found


def _config_value(reply: Any, name: str) -> str | None:
    """The value of a ``CONFIG GET name`` reply (redis-py returns a dict), None if refused."""
    if isinstance(reply, dict):
        value = reply.get(name, reply.get(name.encode()))
        if isinstance(value, bytes):
            return value.decode("utf-8", "replace")
        return value if isinstance(value, str) else None
    return None


def _probe(node: NodeClient) -> NodeHealth:
    masters = _masters(node)
    if not masters:
        client = _client(node)
        health = _probe_server(node.name, client)
    else:
        client, health = _probe_masters(node, masters)
    describe = getattr(node, "topology", None)  # Sentinel and Cluster nodes (transport.nodekinds)
    if describe is not None:
        health.topology, trouble = describe(client)
        if trouble:
            health.warnings.append(trouble)
    return health


#: How bad a master's eviction settings are, to pick a Cluster node's worst.
_VERDICT_RANK = {None: 0, "inert": 1, "unknown": 2, "unsafe": 3}


def _probe_masters(node: NodeClient, masters: list[tuple[str, redis.Redis]]
                   ) -> tuple[redis.Redis, NodeHealth]:
    """Probe every master of a Cluster node: the node's health is the first
    master that answered (its round trip, clock, server), with every master's
    warnings named by its address, and the eviction settings of the worst
    master (an unsafe one makes the node unsafe; one that could not be read,
    unknown). All masters down: the first one's error, the node's."""
    probes: list[tuple[str, redis.Redis, NodeHealth | None, str]] = []
    first_error: BaseException | None = None
    for address, client in masters:
        try:
            probes.append((address, client, _probe_server(node.name, client), ""))
        except _UNREADABLE as e:
            first_error = first_error or e
            probes.append((address, client, None, short_reason(node, e)))
    answered = [(address, client, h) for address, client, h, _ in probes if h is not None]
    if not answered:
        assert first_error is not None
        raise first_error
    _, base_client, base = answered[0]
    base.masters = [address for address, *_ in probes]
    warnings: list[str] = []
    worst_rank = -1
    settings: tuple[int | None, str | None]
    problem: str | None
    for address, _, probe, error in probes:
        if probe is None:
            warnings.append(f"master {address} could not be read: {error}")
            rank, settings, problem = _VERDICT_RANK["unknown"], (None, None), \
                f"master {address} could not be read ({error}): its eviction settings are unknown"
        else:
            warnings += [f"master {address}: {w}" for w in _server_warnings(probe)]
            if probe.clock_ms is not None and base.clock_ms is not None \
                    and abs(probe.clock_ms - base.clock_ms) > CLOCK_OFFSET_WARN_MS:
                warnings.append(f"master {address}: clock differs from master "
                                f"{base.masters[0]}'s by {probe.clock_ms - base.clock_ms:+.0f} ms "
                                f"(more than {CLOCK_OFFSET_WARN_MS:g} ms): slew clocks with NTP")
            verdict = eviction_verdict(probe.maxmemory, probe.maxmemory_policy)
            rank = _VERDICT_RANK[verdict[0] if verdict is not None else None]
            settings = (probe.maxmemory, probe.maxmemory_policy)
            problem = f"master {address} {verdict[1]}" \
                if verdict is not None and verdict[0] in ("unsafe", "unknown") else None
        if rank > worst_rank:
            worst_rank = rank
            base.maxmemory, base.maxmemory_policy = settings
            base.problem = problem
    base.warnings = warnings
    return base_client, base


def _probe_server(name: str, client: redis.Redis) -> NodeHealth:
    """``locks health``'s reading of one server (no topology)."""
    client.ping()  # connects (and authenticates) outside the timed pings
    rtts = []
    for _ in range(PINGS):
        t0 = time.perf_counter()
        client.ping()
        rtts.append((time.perf_counter() - t0) * 1000.0)
    before = time.time()
    seconds, micros = client.time()
    after = time.time()
    node_time = int(seconds) + int(micros) / 1e6
    pipe = client.pipeline(transaction=False)
    pipe.info("server")
    pipe.info("replication")
    pipe.info("persistence")
    pipe.config_get("save")
    pipe.config_get("appendonly")
    pipe.config_get("appendfsync")
    pipe.info("memory")
    pipe.config_get("maxmemory")
    pipe.config_get("maxmemory-policy")
    (server, replication, persistence, save, appendonly, appendfsync, memory, maxmemory,
     policy) = pipe.execute(raise_on_error=False)
    health = NodeHealth(node=name, ok=True, rtt_ms=min(rtts),
                        clock_ms=(node_time - (before + after) / 2) * 1000.0)
    if isinstance(server, dict):
        if "valkey_version" in server or server.get("server_name") == "valkey":
            health.server = "valkey"
            health.version = str(server.get("valkey_version") or server.get("redis_version"))
        else:
            health.server = "redis"
            health.version = str(server.get("redis_version")) if "redis_version" in server else None
    if isinstance(replication, dict) and replication.get("role"):
        role = str(replication["role"])
        health.role = "replica" if role == "slave" else role
    if isinstance(persistence, dict) and "aof_enabled" in persistence:
        health.aof_enabled = bool(int(persistence["aof_enabled"]))
    health.save = _config_value(save, "save")
    fsync = _config_value(appendfsync, "appendfsync")
    health.config_readable = fsync is not None
    health.appendfsync = fsync
    if health.aof_enabled is None:
        aof = _config_value(appendonly, "appendonly")
        if aof is not None:
            health.aof_enabled = aof == "yes"
    health.maxmemory, health.maxmemory_policy = _eviction_settings(maxmemory, policy, memory)
    return health


def _warnings(health: NodeHealth) -> list[str]:
    """A node's warnings; a Cluster node's server warnings are its masters'
    (``_probe_masters``): only the clock is left to say here."""
    found = [] if health.masters else _server_warnings(health)
    if health.clock_offset_ms is not None and abs(health.clock_offset_ms) > CLOCK_OFFSET_WARN_MS:
        found.append(f"clock differs from the other nodes by {health.clock_offset_ms:+.0f} ms "
                     f"(more than {CLOCK_OFFSET_WARN_MS:g} ms): Redis expires keys by its own "
                     f"clock, so a node ahead drops leases early; slew clocks with NTP, never "
                     f"step them")
    return found


def _server_warnings(health: NodeHealth) -> list[str]:
    found = []
    verdict = eviction_verdict(health.maxmemory, health.maxmemory_policy)
    if verdict is not None:
        found.append(verdict[1])
    if health.role == "replica":
        found.append("reports itself a replica: Redlock needs independent masters (a replica "
                     "refuses writes, and a failover can hand a held lock to a second holder)")
    if health.aof_enabled is False:
        found.append("no AOF persistence: restarted empty, this node can grant a lock that "
                     "another client still holds on the others; use appendonly yes with "
                     "appendfsync always, or delay restarts longer than the longest TTL")
    elif health.aof_enabled and health.appendfsync is not None \
            and health.appendfsync != "always":
        found.append(f"appendfsync is {health.appendfsync}, not always: a crash can lose the "
                     f"last lock writes, and the restarted node can grant a lock another client "
                     f"still holds; use appendfsync always, or delay restarts longer than the "
                     f"longest TTL")
    elif health.aof_enabled and health.appendfsync is None:
        found.append("appendfsync unknown (CONFIG GET refused): make sure it is always, or "
                     "delay restarts longer than the longest TTL")
    return found


def check_health(manager: "LockHost", *, deadline: float | None = None) -> HealthReport:
    """Ping, ``INFO``, ``CONFIG GET`` and ``TIME`` every node, in parallel.

    ``ok`` means the node answered and keeps its keys: a node whose eviction
    policy can delete a held lock, or whose eviction settings cannot be read, is
    not ok (``status`` says which). Other warnings (replica role, persistence,
    clock offset) do not change it. Clock offsets are measured against the median of
    all reachable nodes (robust to one bad clock: with three nodes the median
    is a good one), each node's ``TIME`` taken relative to the local clock at
    the midpoint of the request.
    """
    nodes = manager.nodes
    limit = deadline if deadline is not None else (PINGS + 3) * max(n.timeout for n in nodes) + 1.0
    outcomes = _each_node(nodes, _probe, limit)
    report: list[NodeHealth] = []
    for node, outcome in zip(nodes, outcomes, strict=True):
        if outcome.error is not None:
            report.append(NodeHealth(node=node.name, ok=False, error=outcome.error))
        else:
            report.append(outcome.value)
    clocks = [h.clock_ms for h in report if h.clock_ms is not None]
    if len(clocks) >= 2:
        middle = statistics.median(clocks)
        for h in report:
            if h.clock_ms is not None:
                h.clock_offset_ms = h.clock_ms - middle
    for h in report:
        if h.error is None:
            h.warnings = h.warnings + _warnings(h)
            if h.status != "ok":
                if h.problem is None:  # (a Cluster node's names its worst master)
                    verdict = eviction_verdict(h.maxmemory, h.maxmemory_policy)
                    h.problem = verdict[1] if verdict is not None else h.status
                h.ok = False
    return HealthReport(nodes=report, quorum_size=manager.quorum)

