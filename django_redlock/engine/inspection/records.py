"""The records the operator's read model is made of: one lock merged across
the nodes (:class:`LockInfo`), one node's view of it (:class:`NodeLockValue`)
and something at a lock key that no lock wrote (:class:`ForeignValue`).

Plain data, in a module of their own: the lock reader (:mod:`.locks`) builds
them and the semaphore grouping (:mod:`.semaphores`) reads them, and neither
needs the other to know what a lock looks like.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
            "token": self.token,  # its start: what `locks release --holder` takes
            "since": self.since,
            "age_s": None if self.age_s is None else round(self.age_s, 3),
            "other_holders": self.others,
            "nodes_unread": self.unread,
            "waiters": self.waiters,
        }
        if per_node:
            data["per_node"] = [v.as_json() for v in self.per_node]
        return data
