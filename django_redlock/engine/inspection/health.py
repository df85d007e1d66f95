"""Are the nodes fit: ``locks health`` and the deploy checks (clock offsets,
eviction settings, what answers at a node's address)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...transport.sync import NodeClient
    from ..protocol import LockHost
from .common import (
    CLOCK_OFFSET_WARN_MS,
    PINGS,
    _client,
    _each_node,
)

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


def _read_settings(node: NodeClient) -> NodeSettings:
    pipe = _client(node).pipeline(transaction=False)
    pipe.info("replication")
    pipe.info("memory")
    pipe.config_get("maxmemory")
    pipe.config_get("maxmemory-policy")
    replication, memory, maxmemory, policy = pipe.execute(raise_on_error=False)
    found = NodeSettings(node=node.name)
    if isinstance(replication, dict) and replication.get("role"):
        role = str(replication["role"])
        found.role = "replica" if role == "slave" else role
        connected = replication.get("connected_slaves")
        found.replicas = connected if isinstance(connected, int) else None
    found.maxmemory, found.maxmemory_policy = _eviction_settings(maxmemory, policy, memory)
    return found


def read_node_settings(manager: "LockHost", *, deadline: float) -> list[NodeSettings]:
    """Role and eviction settings of every node, in parallel, within ``deadline`` s."""
    nodes = manager.nodes
    outcomes = _each_node(nodes, _read_settings, deadline)
    return [o.value if o.error is None else NodeSettings(node=node.name, error=o.error)
            for node, o in zip(nodes, outcomes, strict=True)]


def _config_value(reply: Any, name: str) -> str | None:
    """The value of a ``CONFIG GET name`` reply (redis-py returns a dict), None if refused."""
    if isinstance(reply, dict):
        value = reply.get(name, reply.get(name.encode()))
        if isinstance(value, bytes):
            return value.decode("utf-8", "replace")
        return value if isinstance(value, str) else None
    return None


def _probe(node: NodeClient) -> NodeHealth:
    client = _client(node)
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
    health = NodeHealth(node=node.name, ok=True, rtt_ms=min(rtts),
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
    describe = getattr(node, "topology", None)  # Sentinel and Cluster nodes (transport.nodekinds)
    if describe is not None:
        health.topology, trouble = describe(client)
        if trouble:
            health.warnings.append(trouble)
    return health


def _warnings(health: NodeHealth) -> list[str]:
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
    if health.clock_offset_ms is not None and abs(health.clock_offset_ms) > CLOCK_OFFSET_WARN_MS:
        found.append(f"clock differs from the other nodes by {health.clock_offset_ms:+.0f} ms "
                     f"(more than {CLOCK_OFFSET_WARN_MS:g} ms): Redis expires keys by its own "
                     f"clock, so a node ahead drops leases early; slew clocks with NTP, never "
                     f"step them")
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
                verdict = eviction_verdict(h.maxmemory, h.maxmemory_policy)
                h.problem = verdict[1] if verdict is not None else h.status
                h.ok = False
    return HealthReport(nodes=report, quorum_size=manager.quorum)

