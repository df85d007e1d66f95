"""A semaphore seen as one thing: ``locks list`` groups its permits and its line.

A semaphore ``NAME`` with ``permits`` permits is made of plain locks
(:mod:`django_redlock.engine.semaphore`): permit ``i`` is ``NAME#<i>``, the line
its acquirers queue on is ``NAME#line``, and its count is recorded beside the
name (``keys.permits_key``). A scan finds the permit and line locks like any
lock; listed one by one they say neither how many permits there are nor how
many callers wait. So they are grouped, but only for a name whose count record
is found on a node read: the record is what makes ``NAME#0`` a permit rather
than a lock some user named ``"x#0"`` (the record lives for an hour after the
last acquire, see ``semaphore.COUNT_LEASE``; a permit held longer than that
with no acquire since is listed as a plain lock again).

Pure: the scan reads the records (:func:`candidate_base`, then one ``GET`` per
base in the node's pipeline), this module only sorts what was read.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .records import LockInfo

#: ``NAME#<i>`` or ``NAME#line``: the lock name of a permit or of the line.
_MEMBER = re.compile(r"\A(?P<base>.+)#(?P<part>0|[1-9][0-9]*|line)\Z", re.DOTALL)


def candidate_base(name: str) -> str | None:
    """The semaphore name ``name`` would be a permit or the line of, or None."""
    found = _MEMBER.match(name)
    return None if found is None else found.group("base")


@dataclass
class SemaphoreInfo:
    """One semaphore merged across the nodes: its permits held and its line."""

    name: str
    key: str  # the lock key of NAME (its count is recorded beside it)
    #: The count recorded on most of the nodes read (None: the records disagree
    #: on a tie, shown as ``?``).
    permits: int | None
    #: How many of the nodes read hold a count record, and which counts.
    recorded: dict[int, int]
    total: int
    quorum_size: int
    #: (permit index, the permit's lock), by index; only permits some node holds.
    holders: list[tuple[int, LockInfo]] = field(default_factory=list)
    #: The line's lock: held by the first acquirer in line while it waits for a
    #: permit (None: nobody is at the head).
    line: LockInfo | None = None

    def locks(self) -> list[LockInfo]:
        """The permits held, then the line (when held)."""
        return [lock for _, lock in self.holders] + ([self.line] if self.line else [])

    @property
    def held(self) -> int:
        """Permits held on a quorum of nodes (the leftovers of failed tries are not)."""
        return sum(1 for _, lock in self.holders if lock.quorum)

    @property
    def queued(self) -> int | None:
        """Acquirers queued behind the head of the line (None: not read)."""
        return None if self.line is None else self.line.waiters

    @property
    def waiters(self) -> int:
        """Acquirers waiting for a permit: the head of the line and those queued
        behind it (tries, ``timeout=0``, never wait)."""
        if self.line is None:
            return 0
        return (1 if self.line.quorum else 0) + (self.line.waiters or 0)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "state": "semaphore",
            "permits": self.permits,
            "recorded": {str(count): nodes for count, nodes in sorted(self.recorded.items())},
            "held": self.held,
            "waiters": self.waiters,
            "nodes_total": self.total,
            "holders": [{"index": index, **lock.as_json()} for index, lock in self.holders],
            "line": None if self.line is None else self.line.as_json(),
        }


def group_semaphores(locks: Sequence[LockInfo], records: Mapping[str, Sequence[int]],
                     key_of: Mapping[str, str], total: int, quorum_size: int
                     ) -> tuple[list[LockInfo], list[SemaphoreInfo]]:
    """Split ``locks`` into the plain ones and the semaphores they belong to.

    ``records[base]``: the counts recorded for semaphore ``base`` on the nodes
    read that have one (one entry per node). Only bases with a record group;
    ``key_of[base]`` is the lock key of that name. Both lists keep the order of
    ``locks`` (sorted by name) and semaphores are sorted by name.
    """
    plain: list[LockInfo] = []
    found: dict[str, SemaphoreInfo] = {}
    for lock in locks:
        base = candidate_base(lock.name)
        counts = records.get(base) if base is not None else None
        if not counts:
            plain.append(lock)
            continue
        assert base is not None
        sem = found.get(base)
        if sem is None:
            tally = Counter(counts)
            ranked = tally.most_common()
            tie = len(ranked) > 1 and ranked[0][1] == ranked[1][1]
            sem = found[base] = SemaphoreInfo(
                name=base, key=key_of[base], permits=None if tie else ranked[0][0],
                recorded=dict(tally), total=total, quorum_size=quorum_size)
        part = lock.name[len(base) + 1:]
        if part == "line":
            sem.line = lock
        else:
            sem.holders.append((int(part), lock))
    for sem in found.values():
        sem.holders.sort(key=lambda held: held[0])
    return plain, [found[name] for name in sorted(found)]
