"""Read-only inspection of the nodes: who holds which lock, and are the nodes fit.

This is what ``manage.py locks`` shows. It never writes (``release --force`` goes
through :meth:`LockManager.force_release`), and it never uses ``KEYS``:

* locks are found with ``SCAN MATCH "<prefix>:<glob>" COUNT 500`` on every node,
  then read with one pipeline of ``GET`` + ``PTTL`` + ``LLEN <waiter queue>``
  per batch of keys. A lock key's value is ``token|fence|owner-json``
  (:mod:`django_redlock.core.owner`), so the owner costs nothing extra. Fencing
  counters and waiter queues start with ``{`` (:mod:`django_redlock.core.keys`)
  and never match. A matching key whose value is not a lock value (a raw
  ``SET``, a key of another type, the counter or queue of the layout before
  0.1.0) still blocks the lock, so it is reported (:class:`ForeignKey`), never
  listed as a lock nor skipped in silence.
* the waiters of a lock are the length of its waiter queue. A waiter joins the
  queue of each node that refuses it: usually the lock's gate node alone (a
  waiter's retry asks that node first and stops there when it is busy), every
  busy node when the gate node is out. So the count shown is the longest queue
  among the nodes read, not a sum (which would count a waiter once per node).
* the per-node views are merged by lock name. Nodes that agree on the same
  holder token are counted together: ``k/N`` with ``k`` the size of the largest
  group. ``k`` below the quorum means a *minority* lock: a leftover of a failed
  attempt, or the survivor of nodes that restarted empty. Such a lock blocks
  nobody for long (acquirers need a quorum), but it is shown, not hidden.
* the time left is what the holder can count on: with ``k >= quorum`` it is the
  quorum-th largest ``PTTL`` among the agreeing nodes (when that node's key
  expires, fewer than a quorum hold it); below a quorum it is the largest.

Every node is asked from its own daemon thread and the caller waits for them
against one deadline, so a dead, paused or slow node costs at most that
deadline, never a hang; each socket operation is also bounded by the node
timeout of the manager's connection pools. A node's failure is reported with a
short reason, never with its password (:attr:`NodeSpec.display`, and the
password is scrubbed from error texts).
"""

from __future__ import annotations

import re
import socket
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import unquote, urlsplit

import redis
from redis.exceptions import InvalidResponse, ResponseError

from .core.keys import (
    MAX_NAME_LENGTH,
    fence_key,
    legacy_internal_role,
    lock_key,
    name_from_key,
    waiters_key,
)
from .core.owner import parse_value
from .transport.sync import NODE_DOWN_ERRORS

if TYPE_CHECKING:
    from .manager import LockManager
    from .transport.sync import NodeClient

#: Keys asked per ``SCAN`` call (a hint to Redis; it bounds the work per call).
SCAN_COUNT = 500
#: Stop collecting after this many lock keys per node: the command is for
#: people and scripts, not for exporting millions of keys. Reported as truncated.
MAX_KEYS_PER_NODE = 100_000
#: Seconds a whole scan of one node may take before it is reported as failed.
SCAN_DEADLINE = 10.0
#: A node whose clock differs from the median of the nodes by more than this
#: (milliseconds) gets a warning in ``locks health``. Redis expires keys by its own
#: clock, so a node ahead by more than the drift allowance drops leases early.
CLOCK_OFFSET_WARN_MS = 100.0
#: Pings per node in ``locks health``; the fastest one is the round trip.
PINGS = 3

_GLOB_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

T = TypeVar("T")


# ----------------------------------------------------------------- helpers

class PatternError(ValueError):
    """A ``--pattern`` that Redis would not match the way the user meant."""


def validate_pattern(pattern: str) -> str:
    """Return ``pattern`` if it is a usable glob over lock names, else raise :class:`PatternError`.

    Redis glob syntax: ``*``, ``?``, ``[abc]``, ``[^a]``, ``[a-z]``, ``\\x`` escapes.
    Redis silently accepts an unclosed ``[`` or a trailing ``\\`` and then matches
    nothing useful; refusing them gives the operator an error instead of an
    empty list.
    """
    if not pattern:
        raise PatternError("the pattern is empty; use '*' for every lock")
    if len(pattern) > MAX_NAME_LENGTH:
        raise PatternError(f"the pattern is longer than {MAX_NAME_LENGTH} characters")
    if _GLOB_CONTROL.search(pattern):
        raise PatternError(f"the pattern contains a control character: {pattern!r}")
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 >= n:
                raise PatternError(f"the pattern ends with a lone backslash: {pattern!r}")
            i += 2
            continue
        if c == "[":
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                raise PatternError(f"the pattern has an empty '[]' class: {pattern!r}")
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            if j >= n:
                raise PatternError(f"the pattern has an unclosed '[': {pattern!r}")
            i = j + 1
            continue
        if c == "]":
            raise PatternError(f"the pattern has a ']' without '[': {pattern!r}")
        i += 1
    return pattern


def _secrets_of(node: NodeClient) -> list[str]:
    """The password(s) of a node, to scrub them from any error text."""
    found: list[str] = []
    spec = node.spec
    if spec.kind == "url":
        try:
            parts = urlsplit(spec.url)
            if parts.password:
                found += [parts.password, unquote(parts.password)]
            for item in parts.query.split("&"):
                if item.startswith("password="):
                    value = item[len("password="):]
                    found += [value, unquote(value)]
        except ValueError:
            pass
    password = spec.options.get("password")
    if isinstance(password, str):
        found.append(password)
    return [s for s in found if s]


def short_reason(node: NodeClient, exc: BaseException) -> str:
    """A one-line, password-free reason for a node's failure."""
    text = " ".join((str(exc) or type(exc).__name__).split())
    for secret in _secrets_of(node):
        text = text.replace(secret, "***")
    return text if len(text) <= 160 else text[:157] + "..."


def _client(node: NodeClient) -> redis.Redis:
    """A redis-py client on the manager's pool for ``node`` (bounded by its timeouts)."""
    return redis.Redis(connection_pool=node.pool)


#: Bytes read from a service that answered something other than Redis' protocol.
_PEEK_BYTES = 64


def _describe_answer(data: bytes) -> str:
    """What a service's first bytes say it is, for an operator."""
    if not data:
        return "the service there closed the connection without a reply"
    first = data.split(b"\r\n", 1)[0].split(b"\n", 1)[0]
    text = first.decode("latin-1")
    shown = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)[:60]
    if data.startswith(b"HTTP/") or data.lstrip()[:14].lower() in (b"<!doctype html", b"<html>"):
        return f"an HTTP server answered {shown!r}"
    if data[:1] in (b"E", b"N", b"R") and len(data) >= 5 and data[1:2] == b"\x00":
        return f"a PostgreSQL-like service answered {shown!r}"
    return f"something answered {shown!r}"


def what_answered(node: NodeClient) -> str:
    """Ask the node's address with a bare ``PING`` and describe the raw reply.

    Used when redis-py could not parse a reply (``InvalidResponse``): its own
    message says nothing about *what* answered. Plain TCP and Unix sockets only
    (under TLS the bytes are not readable without a handshake we would have to
    repeat); bounded by the node timeout.
    """
    kwargs = node.pool.connection_kwargs
    timeout = float(kwargs.get("socket_timeout") or node.timeout or 1.0)
    if issubclass(node.pool.connection_class, redis.SSLConnection):
        return "not a Redis reply (over TLS)"
    try:
        if kwargs.get("path"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(kwargs["path"])
        else:
            sock = socket.create_connection((kwargs.get("host", "localhost"),
                                             int(kwargs.get("port", 6379))), timeout=timeout)
    except OSError as e:
        return f"not a Redis reply, and no second look ({e})"
    data = b""
    try:
        sock.sendall(b"PING\r\n")
        while len(data) < _PEEK_BYTES:
            chunk = sock.recv(_PEEK_BYTES - len(data))
            if not chunk:
                break
            data += chunk
            if b"\n" in data:
                break
    except OSError:
        if not data:
            return "no Redis reply"
    finally:
        sock.close()
    return _describe_answer(data)


@dataclass
class _Outcome:
    value: Any = None
    error: str | None = None
    done: bool = False


def _each_node(nodes: Sequence[NodeClient], job: Callable[[NodeClient], T],
               deadline: float) -> list[_Outcome]:
    """Run ``job(node)`` for every node in parallel; give up on a node after ``deadline`` s.

    Daemon threads, so a node stuck past the deadline can never keep the
    process alive; its outcome is reported as "no answer". Only the Redis
    errors that mean "this node is not usable" are caught; anything else is a
    bug and propagates.
    """
    outcomes = [_Outcome() for _ in nodes]
    failures: list[BaseException] = []

    def run(i: int, node: NodeClient) -> None:
        try:
            outcomes[i].value = job(node)
        except NODE_DOWN_ERRORS as e:
            reason = short_reason(node, e)
            if "closed by server" in reason:
                # What a PostgreSQL server does with a Redis command: reads it as
                # a bad startup packet and hangs up without a word. redis-py's
                # pure-Python parser also says this (where hiredis raises
                # InvalidResponse) when a service wrote something else and hung
                # up, e.g. an HTTP server's HTML error page: look at what it says.
                answered = what_answered(node)
                if answered.startswith(("an HTTP server", "a PostgreSQL-like", "something")):
                    reason = short_reason(node, Exception(f"not a Redis server: {answered}"))
                else:
                    reason += (" (the service there closes connections without a Redis "
                               "reply: not a Redis server?)")
            outcomes[i].error = reason
        except ResponseError as e:
            outcomes[i].error = short_reason(node, e)
        except InvalidResponse:
            # A port that reaches another service (HTTP, PostgreSQL...): a node
            # down, said plainly, not a traceback.
            outcomes[i].error = short_reason(
                node, Exception(f"not a Redis server: {what_answered(node)}"))
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread below
            failures.append(e)
        finally:
            outcomes[i].done = True

    threads = [threading.Thread(target=run, args=(i, node), daemon=True,
                                name=f"redlock-inspect-{i}")
               for i, node in enumerate(nodes)]
    for t in threads:
        t.start()
    end = time.monotonic() + deadline
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    if failures:
        raise failures[0]
    for outcome in outcomes:
        if not outcome.done:
            outcome.error = f"no answer within {deadline:g} s"
    return outcomes


# ------------------------------------------------------------------- locks

@dataclass
class NodeLockValue:
    """One node's view of one lock, for ``locks show``."""

    node: str
    state: str  # "held", "absent", "unreachable", "foreign"
    token: str | None = None  # the first characters of the holder token
    fence: int | None = None
    pttl_ms: int | None = None
    owner: dict[str, Any] = field(default_factory=dict)
    fence_counter: int | None = None
    error: str | None = None
    agrees: bool = False  # holds the same token as the lock's main holder
    waiters: int | None = None  # length of the node's waiter queue (None: not read)
    foreign: ForeignValue | None = None  # what the key holds instead of a lock value

    def as_json(self) -> dict[str, Any]:
        return {"node": self.node, "state": self.state, "agrees": self.agrees,
                "token": self.token, "fence": self.fence, "ttl_ms": self.pttl_ms,
                "owner": self.owner or None, "fence_counter": self.fence_counter,
                "error": self.error, "waiters": self.waiters,
                "foreign": None if self.foreign is None else self.foreign.as_json()}


@dataclass
class LockInfo:
    """One lock merged across the nodes."""

    name: str
    key: str
    nodes: int  # nodes holding it for the main holder (k of k/N)
    total: int  # configured nodes (N)
    quorum_size: int
    ttl_ms: int  # -1: a key without expiry (not written by us)
    owner: dict[str, Any]
    fence: int
    token: str
    others: int = 0  # nodes holding the key for a different holder
    unread: int = 0  # nodes that did not answer: they may hold it too
    since: float | None = None
    age_s: float | None = None
    per_node: list[NodeLockValue] = field(default_factory=list)
    #: Acquirers queued for the lock: the longest waiter queue among the nodes
    #: read (None when no node's queue was read).
    waiters: int | None = None

    @property
    def quorum(self) -> bool:
        return self.nodes >= self.quorum_size

    @property
    def state(self) -> str:
        """How the lock stands across the nodes.

        ``quorum``: held on a quorum. ``uncertain``: below a quorum on the nodes
        that answered, but the silent ones could make up a quorum. ``split``:
        several holders, none with a quorum (leftovers of competing attempts).
        ``minority``: one holder on fewer nodes than a quorum.
        """
        if self.quorum:
            return "quorum"
        if self.nodes + self.unread >= self.quorum_size:
            return "uncertain"
        return "split" if self.others else "minority"

    def as_json(self, *, per_node: bool = False) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "key": self.key,
            "nodes": self.nodes,
            "nodes_total": self.total,
            "quorum": self.quorum,
            "state": self.state,
            "ttl_ms": self.ttl_ms,
            "owner": self.owner,
            "fence": self.fence,
            "since": self.since,
            "age_s": None if self.age_s is None else round(self.age_s, 3),
            "other_holders": self.others,
            "nodes_unread": self.unread,
            "waiters": self.waiters,
        }
        if per_node:
            data["per_node"] = [v.as_json() for v in self.per_node]
        return data


@dataclass
class NodeFailure:
    node: str
    reason: str


#: Characters of a foreign string value shown by ``locks list`` / ``show``.
PREVIEW_CHARS = 40


@dataclass
class ForeignValue:
    """Something at a lock key that is not a django-redlock lock value, on one node.

    It still blocks the lock: the acquire script's ``SET NX`` (and its ``GET``)
    sees a key there, so every acquire of the name is refused by this node until
    the key goes. An operator needs to see it, not a lock list that skips it.
    """

    node: str
    type: str  # Redis type: "string", "list", "hash", ...
    ttl_ms: int | None  # -1: no expiry
    preview: str | None = None  # first characters of a string value

    def describe(self) -> str:
        what = self.type if self.preview is None else f"{self.type} {self.preview!r}"
        if self.ttl_ms is not None and self.ttl_ms < 0:
            return what + ", no expiry"
        return what + ("" if self.ttl_ms is None else f", {self.ttl_ms} ms left")

    def as_json(self) -> dict[str, Any]:
        return {"node": self.node, "type": self.type, "ttl_ms": self.ttl_ms,
                "preview": self.preview}


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
            for k, kind in zip(other_type, pipe.execute(raise_on_error=False), strict=True):
                name = _type_name(kind)
                if name == "none":
                    del foreign[k]
                else:
                    foreign[k] = (name, foreign[k][1], None)
    return found, queued, foreign


@dataclass
class _NodeScan:
    values: dict[bytes, tuple[Any, int | None]]
    truncated: bool
    waiters: dict[bytes, int] = field(default_factory=dict)
    foreign: dict[bytes, tuple[str, int | None, str | None]] = field(default_factory=dict)


def _scan_node(node: NodeClient, match: bytes, deadline: float) -> _NodeScan:
    client = _client(node)
    keys: list[bytes] = []
    seen: set[bytes] = set()
    cursor: int = 0
    truncated = False
    end = time.monotonic() + deadline
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
    return _NodeScan(values=values, truncated=truncated, waiters=waiters, foreign=foreign)


def scan_locks(manager: LockManager, pattern: str = "*", *,
               now: Callable[[], float] = time.time, deadline: float = SCAN_DEADLINE) -> Inventory:
    """Every lock under the manager's key prefix whose name matches ``pattern``, sorted by name."""
    validate_pattern(pattern)
    prefix = manager.key_prefix
    match = f"{prefix}:{pattern}".encode()
    nodes = manager.nodes
    outcomes = _each_node(nodes, lambda node: _scan_node(node, match, deadline), deadline + 1.0)
    node_names = [node.name for node in nodes]
    per_key: dict[bytes, list[tuple[str, Any, int | None] | None]] = {}
    queued: dict[bytes, list[int | None]] = {}
    errors: list[str | None] = [o.error for o in outcomes]
    strangers: dict[bytes, list[ForeignValue]] = {}
    truncated = False
    for i, outcome in enumerate(outcomes):
        if outcome.error is not None:
            continue
        result: _NodeScan = outcome.value
        truncated = truncated or result.truncated
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
        truncated=truncated, skipped=len(set(strangers) - set(per_key)), foreign=foreign)


@dataclass
class LockDetail:
    """``locks show``: the merged lock (None when no node holds it) and the failures."""

    lock: LockInfo | None
    total: int
    answered: int
    failures: list[NodeFailure]
    #: What the key holds on nodes where it is not a lock value (None: nothing).
    foreign: ForeignKey | None = None


def inspect_lock(manager: LockManager, name: str, *, now: Callable[[], float] = time.time,
                 deadline: float | None = None) -> LockDetail:
    """One lock node by node: value, PTTL, fencing counter and waiter queue of every node.

    ``name`` must already be valid (:func:`django_redlock.core.keys.validate_name`).
    """
    key = lock_key(manager.key_prefix, name)
    kb, fb, wb = key.encode(), fence_key(key).encode(), waiters_key(key).encode()

    def job(node: NodeClient) -> tuple[Any, Any, Any, Any, Any]:
        pipe = _client(node).pipeline(transaction=False)
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

    @property
    def answered(self) -> int:
        return len(self.deleted) + len(self.absent)


def force_release(manager: LockManager, name: str) -> ReleaseReport:
    """Delete lock ``name`` on every node (and wake its waiters); report who held it."""
    from .transport.sync import NodeError

    replies = manager.force_release(name)
    deleted: list[tuple[str, Any]] = []
    absent: list[str] = []
    failures: list[NodeFailure] = []
    for node, reply in zip(manager.nodes, replies, strict=True):
        if isinstance(reply, NodeError):
            failures.append(NodeFailure(node.name, short_reason(node, Exception(reply.reason))))
        elif isinstance(reply, Exception):
            failures.append(NodeFailure(node.name, short_reason(node, reply)))
        elif reply is None:
            absent.append(node.name)
        else:
            raw = reply if isinstance(reply, (bytes, str)) else str(reply)
            deleted.append((node.name, parse_value(raw)))
    return ReleaseReport(name=name, deleted=deleted, absent=absent, failures=failures,
                         total=len(manager.nodes), quorum_size=manager.quorum)


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
    found.maxmemory, found.maxmemory_policy = _eviction_settings(maxmemory, policy, memory)
    return found


def read_node_settings(manager: LockManager, *, deadline: float) -> list[NodeSettings]:
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


def check_health(manager: LockManager, *, deadline: float | None = None) -> HealthReport:
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
            h.warnings = _warnings(h)
            if h.status != "ok":
                verdict = eviction_verdict(h.maxmemory, h.maxmemory_policy)
                h.problem = verdict[1] if verdict is not None else h.status
                h.ok = False
    return HealthReport(nodes=report, quorum_size=manager.quorum)
