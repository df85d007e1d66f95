"""Who holds which lock: ``locks list`` / ``show`` / ``release`` (see the package
docstring for how the nodes are read and merged).

(Why one module of 600 lines: the scan, the merge of the nodes' views and the
forced release read the same values in the same layout; the node plumbing
and the health checks are already apart, in ``common`` and ``health``.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis
from redis.exceptions import ResponseError

from ...core.keys import (
    fence_key,
    legacy_internal_role,
    lock_key,
    name_from_key,
    permits_key,
    waiters_key,
)
from ...core.owner import parse_value

if TYPE_CHECKING:
    from ...transport.sync import NodeClient
    from ..protocol import LockHost
from .common import (
    MAX_KEYS_PER_NODE,
    SCAN_COUNT,
    SCAN_DEADLINE,
    PatternError,
    _client,
    _clients,
    _each_node,
    glob_escape,
    short_reason,
    validate_pattern,
)
from .records import PREVIEW_CHARS, ForeignValue, LockInfo, NodeLockValue
from .semaphores import SemaphoreInfo, candidate_base, group_semaphores

# ------------------------------------------------------------------- locks

@dataclass
class NodeFailure:
    node: str
    reason: str


@dataclass
class ForeignKey:
    """A key under the prefix, named like a lock, that holds no lock value."""

    name: str
    key: str
    per_node: list[ForeignValue]
    total: int

    @property
    def legacy(self) -> tuple[str, str] | None:
        """``(name, role)`` when this looks like an internal key of the previous layout."""
        found = legacy_internal_role(self.name)
        if found is None:
            return None
        want = "list" if found[1] == "waiters" else "string"
        if all(v.type == want for v in self.per_node) and (
                want == "list" or all((v.preview or "").isdigit() for v in self.per_node)):
            return found
        return None

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for v in self.per_node:
            kinds[v.describe()] = kinds.get(v.describe(), 0) + 1
        text = "; ".join(f"{what} on {n} of {self.total} node(s)" for what, n in kinds.items())
        legacy = self.legacy
        if legacy is not None:
            role = "fencing counter" if legacy[1] == "fence" else "waiter queue"
            text += (f" (the {role} of lock {legacy[0]!r} in the previous key layout: a "
                     f"process still running an older version, or a leftover that expires "
                     f"on its own)")
        return text

    def as_json(self) -> dict[str, Any]:
        legacy = self.legacy
        return {"name": self.name, "key": self.key, "state": "foreign",
                "nodes": len(self.per_node), "nodes_total": self.total,
                "foreign": [v.as_json() for v in self.per_node],
                "legacy_of": None if legacy is None else {"name": legacy[0], "role": legacy[1]}}


@dataclass
class Inventory:
    """The result of a scan: the locks, and which nodes could not be read."""

    locks: list[LockInfo]
    total: int
    answered: int
    quorum_size: int
    failures: list[NodeFailure] = field(default_factory=list)
    truncated: bool = False
    skipped: int = 0  # matching keys whose value is not a lock value
    #: Keys named like locks that hold something else (sorted by name).
    foreign: list[ForeignKey] = field(default_factory=list)
    #: Semaphores whose permits or line some node holds (sorted by name); their
    #: locks are in ``locks`` too (:mod:`.semaphores`).
    semaphores: list[SemaphoreInfo] = field(default_factory=list)

    def ungrouped(self) -> list[LockInfo]:
        """``locks`` without the permits and lines of ``semaphores``."""
        grouped = {id(lock) for sem in self.semaphores for lock in sem.locks()}
        return [lock for lock in self.locks if id(lock) not in grouped]

    @property
    def complete(self) -> bool:
        """Every node was read."""
        return self.answered == self.total

    @property
    def enough(self) -> bool:
        """A quorum of nodes was read: a lock held on a quorum has a copy in what was read."""
        return self.answered >= self.quorum_size


def _short_token(token: str) -> str:
    return token[:8]


def _owner_of(stored: Any) -> dict[str, Any]:
    owner = dict(stored.owner)
    owner.setdefault("host", None)
    owner.setdefault("pid", None)
    return owner


def merge(name: str, key: str, views: Sequence[tuple[str, Any, int | None] | None],
          node_names: Sequence[str], quorum_size: int, *, now: float,
          errors: Sequence[str | None] | None = None,
          counters: Sequence[int | None] | None = None,
          waiters: Sequence[int | None] | None = None,
          foreign: Sequence[ForeignValue | None] | None = None) -> LockInfo | None:
    """Merge the per-node views of one lock; None when no node holds it.

    ``views[i]`` is ``(raw value, StoredLock, pttl_ms)`` for node i, or None when
    node i does not hold the key (or did not answer: ``errors[i]`` then says why).
    ``waiters[i]`` is the length of node i's waiter queue, None when not read
    (ignored for a node with an error); the lock's count is the largest, since a
    waiter may be queued on one node (the gate node) or on several.
    Pure: no I/O, so the arithmetic is tested without Redis.
    """
    total = len(node_names)
    held = {i: view for i, view in enumerate(views) if view is not None}
    groups: dict[str, list[int]] = {}
    for i, view in held.items():
        groups.setdefault(view[1].token, []).append(i)
    if not groups:
        return None

    def weight(token: str) -> tuple[int, int]:
        members = groups[token]
        return len(members), max(held[i][1].fence for i in members)

    main = max(groups, key=weight)
    members = groups[main]
    holders = sum(len(m) for m in groups.values())
    ttls = sorted((held[i][2] for i in members), key=lambda t: float("inf") if t is None or t < 0
                  else t, reverse=True)
    pick = ttls[quorum_size - 1] if len(members) >= quorum_size else ttls[0]
    ttl_ms = -1 if pick is None or pick < 0 else int(pick)
    first = held[members[0]][1]
    fence = max(held[i][1].fence for i in members)
    owner = _owner_of(first)
    since = owner.get("since")
    since_f = None
    if isinstance(since, (int, float)) and not isinstance(since, bool):
        since_f = float(since)
    per_node: list[NodeLockValue] = []
    for i, maybe_view in enumerate(views):
        error = errors[i] if errors is not None else None
        counter = counters[i] if counters is not None else None
        queued = waiters[i] if waiters is not None and not error else None
        stranger = foreign[i] if foreign is not None else None
        if maybe_view is None:
            per_node.append(NodeLockValue(
                node=node_names[i],
                state="unreachable" if error else "foreign" if stranger else "absent",
                error=error, fence_counter=counter, waiters=queued, foreign=stranger))
            continue
        _, stored, pttl = maybe_view
        per_node.append(NodeLockValue(
            node=node_names[i], state="held", token=_short_token(stored.token), fence=stored.fence,
            pttl_ms=pttl, owner=_owner_of(stored), fence_counter=counter,
            agrees=stored.token == main, waiters=queued))
    return LockInfo(
        name=name, key=key, nodes=len(members), total=total, quorum_size=quorum_size,
        ttl_ms=ttl_ms, owner=owner, fence=fence, token=_short_token(main),
        others=holders - len(members), since=since_f,
        unread=sum(1 for e in (errors or ()) if e is not None),
        age_s=None if since_f is None else max(0.0, now - since_f), per_node=per_node,
        waiters=max((v.waiters for v in per_node if v.waiters is not None), default=None))


def _queue_key(key: bytes) -> bytes:
    """The waiter queue key of a lock key as SCAN returned it (bytes in, bytes out)."""
    return waiters_key(key.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")


def _queue_length(reply: Any) -> int | None:
    """An ``LLEN`` reply as a count; None for an error (a key of another type)."""
    return reply if isinstance(reply, int) and not isinstance(reply, bool) else None


def _preview(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace")
    return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS] + "..."


def _type_name(reply: Any) -> str:
    if isinstance(reply, bytes):
        return reply.decode("ascii", "replace")
    return reply if isinstance(reply, str) else "unknown"


def _read_values(client: redis.Redis, keys: Sequence[bytes]
                 ) -> tuple[dict[bytes, tuple[Any, int | None]], dict[bytes, int],
                            dict[bytes, tuple[str, int | None, str | None]]]:
    """``GET`` + ``PTTL`` of ``keys`` and ``LLEN`` of their waiter queues, in pipelines
    of SCAN_COUNT keys: ({key: (lock value, pttl)}, {key: queued waiters},
    {key: (type, pttl, preview)} for keys that hold something else)."""
    found: dict[bytes, tuple[Any, int | None]] = {}
    queued: dict[bytes, int] = {}
    foreign: dict[bytes, tuple[str, int | None, str | None]] = {}
    for start in range(0, len(keys), SCAN_COUNT):
        chunk = keys[start:start + SCAN_COUNT]
        pipe = client.pipeline(transaction=False)
        for k in chunk:
            pipe.get(k)
            pipe.pttl(k)
            pipe.llen(_queue_key(k))
        replies = pipe.execute(raise_on_error=False)
        other_type: list[bytes] = []
        for j, k in enumerate(chunk):
            raw, pttl, length = replies[3 * j], replies[3 * j + 1], replies[3 * j + 2]
            if isinstance(pttl, int) and pttl == -2:
                continue  # expired (or deleted) meanwhile
            ttl = pttl if isinstance(pttl, int) else None
            if isinstance(raw, ResponseError):
                other_type.append(k)  # WRONGTYPE: a list, hash, ... at a lock key
                foreign[k] = ("?", ttl, None)
                continue
            if not isinstance(raw, bytes):
                continue  # expired between the SCAN and the GET
            if parse_value(raw) is None:
                foreign[k] = ("string", ttl, _preview(raw))
                continue
            found[k] = (raw, ttl)
            count = _queue_length(length)
            if count is not None:
                queued[k] = count
        if other_type:
            pipe = client.pipeline(transaction=False)
            for k in other_type:
                pipe.type(k)
                pipe.hgetall(k)
            replies = pipe.execute(raise_on_error=False)
            for j, k in enumerate(other_type):
                name = _type_name(replies[2 * j])
                held = _read_write_holder(replies[2 * j + 1]) if name == "hash" else None
                if name == "none":
                    del foreign[k]
                elif held is not None:
                    found[k] = (held, foreign.pop(k)[1])
                    count = _queue_length(client.llen(_queue_key(k)))
                    if count is not None:
                        queued[k] = count
                else:
                    foreign[k] = (name, foreign[k][1], None)
    return found, queued, foreign


def _read_write_holder(fields: Any) -> bytes | None:
    """A read-write lock's key (a hash, rw_common.lua) as one lock value: its
    writer's, or its reader with the highest fence; None when the hash is not
    a read-write lock's. The token shows the mode: ``r.`` a reader, ``w.`` the
    writer (``locks show`` lists one holder per node)."""
    if not isinstance(fields, dict) or not fields:
        return None
    best: tuple[bool, int, bytes] | None = None
    for token, value in fields.items():
        if not (isinstance(token, bytes) and isinstance(value, bytes)
                and token[1:2] == b"." and token[:1] in (b"r", b"w")):
            return None
        parts = value.split(b"|", 2)
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
            return None
        rank = (token[:1] == b"w", int(parts[1]), token + b"|" + parts[1] + b"|" + parts[2])
        if best is None or rank[:2] > best[:2]:
            best = rank
    return None if best is None else best[2]


@dataclass
class _NodeScan:
    values: dict[bytes, tuple[Any, int | None]]
    truncated: bool
    waiters: dict[bytes, int] = field(default_factory=dict)
    foreign: dict[bytes, tuple[str, int | None, str | None]] = field(default_factory=dict)
    #: The permit count recorded for each semaphore name some found key may be a
    #: permit or the line of (names without a record are left out).
    permits: dict[str, int] = field(default_factory=dict)


def _read_permit_records(client: redis.Redis, prefix: str, keys: Sequence[bytes]
                         ) -> dict[str, int]:
    """The recorded count of each semaphore that a key in ``keys`` may belong to."""
    bases: set[str] = set()
    for k in keys:
        name = name_from_key(prefix, k.decode("utf-8", "replace"))
        base = None if name is None else candidate_base(name)
        if base is not None:
            bases.add(base)
    if not bases:
        return {}
    ordered = sorted(bases)
    records: dict[str, int] = {}
    for start in range(0, len(ordered), SCAN_COUNT):
        chunk = ordered[start:start + SCAN_COUNT]
        pipe = client.pipeline(transaction=False)
        for base in chunk:
            pipe.get(permits_key(lock_key(prefix, base)).encode())
        for base, raw in zip(chunk, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(raw, str):
                raw = raw.encode()
            if isinstance(raw, bytes) and raw.isdigit():
                records[base] = int(raw)
    return records


def _scan_node(node: NodeClient, match: bytes, deadline: float,
               prefix: str | None = None) -> _NodeScan:
    """Every lock key on ``node`` (on each master of a Cluster node)."""
    end = time.monotonic() + deadline
    found = _NodeScan(values={}, truncated=False)
    for client in _clients(node):
        part = _scan_server(client, match, max(end - time.monotonic(), 0.0), deadline, prefix)
        found.values.update(part.values)
        found.waiters.update(part.waiters)
        found.foreign.update(part.foreign)
        found.permits.update(part.permits)
        found.truncated = found.truncated or part.truncated
    return found


def _scan_server(client: redis.Redis, match: bytes, left: float, deadline: float,
                 prefix: str | None) -> _NodeScan:
    keys: list[bytes] = []
    seen: set[bytes] = set()
    cursor: int = 0
    truncated = False
    end = time.monotonic() + left
    while True:
        cursor, batch = client.scan(cursor=cursor, match=match, count=SCAN_COUNT)
        for k in batch:
            if isinstance(k, str):  # a borrowed cache pool may decode replies
                k = k.encode("utf-8")
            if k not in seen:  # SCAN may return a key twice
                seen.add(k)
                keys.append(k)
        if int(cursor) == 0:
            break
        if len(keys) >= MAX_KEYS_PER_NODE:
            truncated = True
            break
        if time.monotonic() > end:
            raise TimeoutError(f"scan did not finish within {deadline:g} s")
    values, waiters, foreign = _read_values(client, keys)
    permits = {} if prefix is None else _read_permit_records(client, prefix, list(values))
    return _NodeScan(values=values, truncated=truncated, waiters=waiters, foreign=foreign,
                     permits=permits)


def scan_locks(manager: "LockHost", pattern: str = "*", *,
               now: Callable[[], float] = time.time, deadline: float = SCAN_DEADLINE) -> Inventory:
    """Every lock under the manager's key prefix whose name matches ``pattern``, sorted by name."""
    validate_pattern(pattern)
    prefix = manager.key_prefix
    match = f"{prefix}:{pattern}".encode()
    nodes = manager.nodes
    outcomes = _each_node(nodes, lambda node: _scan_node(node, match, deadline, prefix),
                          deadline + 1.0)
    node_names = [node.name for node in nodes]
    per_key: dict[bytes, list[tuple[str, Any, int | None] | None]] = {}
    queued: dict[bytes, list[int | None]] = {}
    errors: list[str | None] = [o.error for o in outcomes]
    strangers: dict[bytes, list[ForeignValue]] = {}
    records: dict[str, list[int]] = {}
    truncated = False
    for i, outcome in enumerate(outcomes):
        if outcome.error is not None:
            continue
        result: _NodeScan = outcome.value
        truncated = truncated or result.truncated
        for base, count in result.permits.items():
            records.setdefault(base, []).append(count)
        for k, (raw, pttl) in result.values.items():
            stored = parse_value(raw)
            if stored is None:  # pragma: no cover - _read_values sorted these out
                continue
            per_key.setdefault(k, [None] * len(nodes))[i] = (raw, stored, pttl)
            if k in result.waiters:
                queued.setdefault(k, [None] * len(nodes))[i] = result.waiters[k]
        for k, (kind, pttl, preview) in result.foreign.items():
            strangers.setdefault(k, []).append(
                ForeignValue(node=node_names[i], type=kind, ttl_ms=pttl, preview=preview))
    wall = now()
    locks: list[LockInfo] = []
    for k, views in per_key.items():
        key = k.decode("utf-8", "replace")
        name = name_from_key(prefix, key)
        if name is None:
            continue
        info = merge(name, key, views, node_names, manager.quorum, now=wall, errors=errors,
                     waiters=queued.get(k))
        if info is not None:
            locks.append(info)
    locks.sort(key=lambda lock: lock.name)
    _, semaphores = group_semaphores(
        locks, records, {base: lock_key(prefix, base) for base in records}, len(nodes),
        manager.quorum)
    foreign: list[ForeignKey] = []
    for k, values in strangers.items():
        key = k.decode("utf-8", "replace")
        name = name_from_key(prefix, key)
        if name is not None:
            foreign.append(ForeignKey(name=name, key=key, per_node=values, total=len(nodes)))
    foreign.sort(key=lambda f: f.name)
    return Inventory(
        locks=locks, total=len(nodes),
        answered=sum(1 for o in outcomes if o.error is None), quorum_size=manager.quorum,
        failures=[NodeFailure(node_names[i], o.error) for i, o in enumerate(outcomes)
                  if o.error is not None],
        truncated=truncated, skipped=len(set(strangers) - set(per_key)), foreign=foreign,
        semaphores=semaphores)


@dataclass
class LockDetail:
    """``locks show``: the merged lock (None when no node holds it) and the failures."""

    lock: LockInfo | None
    total: int
    answered: int
    failures: list[NodeFailure]
    #: What the key holds on nodes where it is not a lock value (None: nothing).
    foreign: ForeignKey | None = None


def inspect_semaphore(manager: "LockHost", name: str
                      ) -> tuple[SemaphoreInfo | None, list[NodeFailure]]:
    """Semaphore ``name`` as :func:`scan_locks` groups it (a scan of its permits
    and line, ``NAME#*``), or None when it is none: no count recorded for it on
    the nodes read, or none of its permits nor its line held. With the nodes
    not read. ``name`` must already be valid."""
    try:
        pattern = validate_pattern(glob_escape(name) + "#*")
    except PatternError:  # a name too long to be escaped into a pattern
        return None, []
    inventory = scan_locks(manager, pattern)
    return (next((sem for sem in inventory.semaphores if sem.name == name), None),
            inventory.failures)


def inspect_lock(manager: "LockHost", name: str, *, now: Callable[[], float] = time.time,
                 deadline: float | None = None) -> LockDetail:
    """One lock node by node: value, PTTL, fencing counter and waiter queue of every node.

    ``name`` must already be valid (:func:`django_redlock.core.keys.validate_name`).
    """
    key = lock_key(manager.key_prefix, name)
    kb, fb, wb = key.encode(), fence_key(key).encode(), waiters_key(key).encode()

    def job(node: NodeClient) -> tuple[Any, Any, Any, Any, Any]:
        pipe = _client(node, kb).pipeline(transaction=False)
        pipe.get(kb)
        pipe.pttl(kb)
        pipe.get(fb)
        pipe.llen(wb)
        pipe.type(kb)
        raw, pttl, counter, length, kind = pipe.execute(raise_on_error=False)
        return raw, pttl, counter, length, kind

    nodes = manager.nodes
    limit = deadline if deadline is not None else 2 * max(n.timeout for n in nodes) + 1.0
    outcomes = _each_node(nodes, job, limit)
    views: list[tuple[str, Any, int | None] | None] = []
    counters: list[int | None] = []
    queued: list[int | None] = []
    strangers: list[ForeignValue | None] = []
    node_names = [node.name for node in nodes]
    for i, outcome in enumerate(outcomes):
        view = None
        counter = None
        length = None
        stranger = None
        if outcome.error is None:
            raw, pttl, counter_raw, length_raw, kind = outcome.value
            length = _queue_length(length_raw)
            stored = parse_value(raw) if isinstance(raw, bytes) else None
            gone = isinstance(pttl, int) and pttl == -2
            ttl = pttl if isinstance(pttl, int) else None
            if stored is not None and not gone:
                view = (raw, stored, ttl)
            elif isinstance(raw, bytes) and not gone:
                stranger = ForeignValue(node=node_names[i], type="string", ttl_ms=ttl,
                                        preview=_preview(raw))
            elif isinstance(raw, ResponseError) and _type_name(kind) not in ("none", "string"):
                stranger = ForeignValue(node=node_names[i], type=_type_name(kind), ttl_ms=ttl)
            if isinstance(counter_raw, bytes) and counter_raw.isdigit():
                counter = int(counter_raw)
        views.append(view)
        counters.append(counter)
        queued.append(length)
        strangers.append(stranger)
    errors = [o.error for o in outcomes]
    info = merge(name, key, views, node_names, manager.quorum, now=now(), errors=errors,
                 counters=counters, waiters=queued, foreign=strangers)
    found = [v for v in strangers if v is not None]
    return LockDetail(
        lock=info, total=len(nodes), answered=sum(1 for e in errors if e is None),
        failures=[NodeFailure(node_names[i], e) for i, e in enumerate(errors) if e is not None],
        foreign=ForeignKey(name=name, key=key, per_node=found, total=len(nodes))
        if found else None)


@dataclass
class ReleaseReport:
    """What ``force_release`` found: the values it deleted, and the nodes it missed."""

    name: str
    deleted: list[tuple[str, Any]]  # (node, StoredLock or None for foreign data)
    absent: list[str]
    failures: list[NodeFailure]
    total: int
    quorum_size: int
    #: (node, StoredLock or None) where another holder than the one asked for
    #: holds the lock: kept (``force_release(..., holder=...)``).
    kept: list[tuple[str, Any]] = field(default_factory=list)
    #: Nodes where the holder asked for was deleted from a read-write lock
    #: that other holders still hold (counted in ``deleted`` too): the key
    #: stays, and nobody was woken there.
    shared: list[str] = field(default_factory=list)

    @property
    def answered(self) -> int:
        return len(self.deleted) + len(self.absent) + len(self.kept)


def force_release(manager: "LockHost", name: str, holder: str = "") -> ReleaseReport:
    """Delete lock ``name`` on every node (and wake its waiters); report who held it.
    ``holder``: only while that holder holds it (``LockManager.force_release``)."""
    from ...transport.sync import NodeError

    replies = manager.force_release(name, holder=holder)
    deleted: list[tuple[str, Any]] = []
    absent: list[str] = []
    kept: list[tuple[str, Any]] = []
    shared: list[str] = []
    failures: list[NodeFailure] = []
    for node, reply in zip(manager.nodes, replies, strict=True):
        if isinstance(reply, list) and len(reply) == 2 and reply[0] in (0, 1):
            raw = reply[1] if isinstance(reply[1], (bytes, str)) else str(reply[1])
            if reply[0] == 0:
                kept.append((node.name, parse_value(raw)))
            else:  # one holder of a read-write lock, the others still hold it
                deleted.append((node.name, parse_value(raw)))
                shared.append(node.name)
        elif isinstance(reply, NodeError):
            failures.append(NodeFailure(node.name, short_reason(node, Exception(reply.reason))))
        elif isinstance(reply, Exception):
            failures.append(NodeFailure(node.name, short_reason(node, reply)))
        elif reply is None:
            absent.append(node.name)
        else:
            raw = reply if isinstance(reply, (bytes, str)) else str(reply)
            deleted.append((node.name, parse_value(raw)))
    return ReleaseReport(name=name, deleted=deleted, absent=absent, failures=failures,
                         total=len(manager.nodes), quorum_size=manager.quorum, kept=kept,
                         shared=shared)


