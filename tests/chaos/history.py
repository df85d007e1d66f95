"""The records a chaos run leaves behind, and how they are written and read back.

Three kinds of record, each one JSON object per line so a worker that is killed
or paused mid-run loses at most the operation it was in:

* :class:`Op` -- one client operation (acquire, read, fenced write, release) as
  the *client* saw it: start/end on ``time.monotonic()`` (system-wide on Linux,
  so comparable across the worker processes and the nemesis) and on the wall
  clock, the fence, the outcome and the error type.
* :class:`Event` -- one nemesis action (a fault starting or ending, or a fault
  skipped with its reason), on the same clocks.
* :class:`Write` -- one write *as the resource saw it*, in the order the resource
  applied it (a SQLite trigger's audit table, a Redis list appended by the Lua
  write). The checker trusts these over the clients: a client can be paused
  between the write landing and its record.

Outcomes (``Op.outcome``):

``ok``                  acquired, wrote (the resource accepted), released cleanly
``refused-by-fence``    acquired, but the resource refused the write: a holder
                        with a higher fence had written first
``not-acquired``        ``LockNotAcquired``: the wait ran out (lock busy)
``quorum-unavailable``  ``QuorumUnavailable``: fewer than 3 of 5 nodes answered
``lost``                ``LockLost`` at release, or ``owned()`` false before the
                        write (the careful client then skips the write); see
                        ``Op.write`` for whether a write landed first
``error``               anything else (``error`` holds its type)
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

OUTCOMES = ("ok", "refused-by-fence", "not-acquired", "quorum-unavailable", "lost", "error")


@dataclasses.dataclass
class Op:
    """One read-modify-write attempt by one worker on one resource."""

    worker: int
    seq: int  # per worker
    resource: str  # "db:<pk>", "ctr:<n>" or "cas:<n>"
    lock: str  # the lock name
    start: float  # monotonic, before acquire
    start_wall: float
    end: float = 0.0  # monotonic, after release (or after the error)
    end_wall: float = 0.0
    acquired: float | None = None  # monotonic, when acquire returned holding the lock
    released: float | None = None  # monotonic, just before release began
    fence: int = 0
    read: int | None = None  # value read under the lock
    #: The write: None = not attempted, True = the resource accepted it,
    #: False = refused by its fence check.
    write: bool | None = None
    write_start: float | None = None
    write_end: float | None = None
    stored_fence: int | None = None  # the resource's fence the write was compared with
    owned_before_write: bool | None = None
    lost_signal: bool = False  # the lock_lost signal fired for this lock
    #: Start of the lease as the client's own clock puts it, read right after
    #: acquiring: ``now + lock.validity - ttl``. The round that granted the lease
    #: began no earlier than this (validity counts from the start of that round,
    #: less the drift allowance; a lease handed over by a release has less left,
    #: which only moves this earlier). The checker uses it as a lower bound.
    lease_start: float | None = None
    gen: int = 0  # the worker's generation: 1 after its first crash and restart, ...
    #: The lock family (``family`` schedule): ``""`` a plain lock, ``"read"`` /
    #: ``"write"`` a read_lock / write_lock of ``rw:<n>``, ``"permit"`` a permit of
    #: the semaphore ``sem:<n>`` (``lock`` is then the permit's plain lock),
    #: ``"multi"`` a multi_lock over two of the counters ``mx:a``, ``mx:b``,
    #: ``mx:c``, ``"segment"`` a segment of ``segments("chaos-seg:<n>")`` (its
    #: counter ``seg:<n>#<i>``, ``lock`` the segment's plain lock).
    mode: str = ""
    #: The critical section as the resource server saw it: the holder adds its id
    #: (``w<worker>.<seq>``) to the resource's set of those inside, reading who was
    #: already inside (``present``), and removes it at ``exit``; ``valid`` is
    #: ``owned()`` asked *after* that removal, so True means the lease covered the
    #: whole section. Two valid sections that exclude each other cannot meet.
    enter: float | None = None  # monotonic, just before joining the set
    exit: float | None = None  # monotonic, after leaving it
    present: list[str] = dataclasses.field(default_factory=list)
    valid: bool | None = None
    read_again: int | None = None  # a reader's second read, at the end of its section
    #: ``multi``: the counters of every name the multi-lock holds (``resource`` is
    #: the first of them, ``lock`` / ``fence`` its lock and fence).
    names: list[str] = dataclasses.field(default_factory=list)
    #: ``multi`` / ``segment``: the sections inside the resource's set when the
    #: acquisition *began* (read before acquiring): holders it may have had to wait for.
    before: list[str] = dataclasses.field(default_factory=list)
    outcome: str = "error"
    error: str = ""  # exception type name
    detail: str = ""  # short message (no secrets: URLs are not part of our messages)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))


@dataclasses.dataclass
class Event:
    """One nemesis action."""

    t: float  # monotonic
    wall: float
    kind: str  # a fault kind (nemesis.py), "plan", "run" or "progress"
    action: str  # start, end, skip, info
    target: str  # "n0".."n4", "w0".., or "" for run-level info
    params: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))


@dataclasses.dataclass
class Write:
    """One write as the resource applied it, in resource order (``index``)."""

    resource: str
    index: int
    fence: int
    prev_fence: int  # the fence stored before this write
    old: int  # value before
    new: int  # value written


class JsonlWriter:
    """Append records to a JSONL file, flushed per record (a paused or killed
    process keeps everything it had finished)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fh: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: Op | Event) -> None:
        self._fh.write(record.to_json() + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def _lines(path: str) -> Iterator[dict[str, Any]]:
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill: that op is unknown, not invented


def read_ops(paths: Iterable[str]) -> list[Op]:
    fields = {f.name for f in dataclasses.fields(Op)}
    ops = [Op(**{k: v for k, v in d.items() if k in fields}) for p in paths for d in _lines(p)]
    ops.sort(key=lambda o: o.start)
    return ops


def read_events(path: str) -> list[Event]:
    events = [Event(**d) for d in _lines(path)]
    events.sort(key=lambda e: e.t)
    return events
