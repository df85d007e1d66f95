"""``segments(name, count)``: any one of ``count`` locks on one hot resource.

Lock segmentation (lock striping): one item whose stock is split over
``count`` rows, each with its own lock, serves ``count`` buyers at once where
one lock would serve one. ``acquire()`` takes whichever segment is free;
``index`` says which one (0 to count - 1), and the caller works on that
segment's row. Segment ``i`` is the plain lock ``"<name>[<i>]"``, so
``manage.py locks`` shows each one.

How it waits (no polling): it tries every segment once, in a random order
(so callers spread over the segments instead of all trying segment 0 first).
When all are busy it listens on the name's *free* channel, which the release
script of every segment publishes on (release.lua, ``ARGV[6]``, as a
semaphore's permits do; any holder of ``"<name>[<i>]"``, a plain lock too), tries them all once more (a segment freed between
the first pass and the subscription published a notice nobody heard; this
pass finds it free), and sleeps until a notice comes. A notice names the
segment freed: that one is tried first, then, if another waiter took it, the
others (two releases close together leave one notice to read, and the other
segment free). A crashed holder publishes nothing, and a notice can be
missed: like a plain lock's waiter, it also wakes when the soonest lease of
a busy segment runs out or after the retry delay (``RETRY_DELAY``), and at
its timeout.

A segments waiter has no line: a release wakes every waiter of the name, in
every process, and the first try to reach the nodes gets the segment (the
others sleep again). A semaphore keeps arrival order with a line
(``engine/semaphore.py``); segments never promised it: a buyer wants any
segment with stock, soon.
"""

from __future__ import annotations

import random
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Sequence

from ..core.arguments import check_count_of, check_timeout
from ..core.keys import segment_channel
from ..exceptions import LockNotAcquired, LockNotOwned
from . import compose
from .compose import Drop, Listen, Notice, Plan, Take

if TYPE_CHECKING:
    from .protocol import LockHost

#: The shortest wait for a notice between two passes when no notice comes (s):
#: the soonest lease of a busy segment, read at the last pass, may be nearly over.
MIN_PAUSE = 0.005


def check_count(count: Any) -> int:
    return check_count_of(count, "segments(name, count)", "count")


def segment_name(name: str, index: int) -> str:
    """The plain lock name of segment ``index`` of ``name``."""
    return f"{name}[{index}]"


def free_channel(prefix: str, name: str) -> bytes:
    """The channel every segment's release of ``name`` publishes its key on
    (any lock named like a segment does: ``core.keys.segment_channel``)."""
    return segment_channel(prefix, segment_name(name, 0))


class SegmentsBase(compose.Composite):
    """The rules; :class:`Segments` and :class:`AsyncSegments` run them."""

    def __init__(self, manager: "LockHost", name: str, locks: Sequence[Any],
                 timeout: float | None, rng: random.Random | None = None) -> None:
        self.manager = manager
        self.name = name
        self.count = len(locks)
        self.timeout = timeout
        self._locks = list(locks)
        self._rng = rng or random.Random()
        #: The segment held (0 to count - 1), or None.
        self.index: int | None = None
        #: Segments not to try (a segment whose stock ran out, say): ``acquire()``
        #: takes any other free one, and returns False at once when none is left.
        self.skip: set[int] = set()
        self.retry_after = 0.0
        #: Every segment's release script publishes there (``LockBase._notify``),
        #: whoever holds it: a plain ``lock("<name>[<i>]")`` too.
        self._free_channel = free_channel(manager.key_prefix, name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} x{self.count} index={self.index}>"

    @property
    def lock(self) -> Any:
        """The plain lock of the segment held (None when none is)."""
        return None if self.index is None else self._locks[self.index]

    @property
    def fence(self) -> int:
        return 0 if self.index is None else self._locks[self.index].fence

    @property
    def validity(self) -> float:
        return 0.0 if self.index is None else self._locks[self.index].validity

    def owned(self) -> bool:
        return self.index is not None and self._locks[self.index].owned()

    def _wait(self, blocking: bool, timeout: float | None | EllipsisType) -> float | None:
        wait = self.timeout if timeout is ... else check_timeout(timeout)
        if not isinstance(blocking, bool):
            raise ValueError(f"blocking must be True or False, not {blocking!r}")
        if self.index is not None:
            raise LockNotOwned(f"segments {self.name!r}: this object already holds segment "
                               f"{self.index}", lock_name=self.name)
        return 0.0 if not blocking else wait

    def _acquire_plan(self, wait: float | None) -> Plan:
        clock = self.manager.clock
        deadline = None if wait is None else clock() + wait
        order = [i for i in range(self.count) if i not in self.skip]
        if not order:
            self.retry_after = 0.0
            return False
        listening = False
        freed: int | None = None
        while True:
            if freed is not None:
                # The segment a notice named: tried alone first (one round
                # trip); lost to another waiter, the others are tried too.
                if (yield Take(freed, 0)):
                    return self._grant("index", freed)
            candidates = [i for i in order if i != freed]
            self._rng.shuffle(candidates)
            for index in candidates:
                if (yield Take(index, 0)):
                    return self._grant("index", index)
            left = None if deadline is None else deadline - clock()
            if left is not None and left <= 0:
                self.retry_after = min(self._locks[i].retry_after for i in order)
                return False
            if not listening:
                # Listen, then try them all again: a segment freed before the
                # subscription held published a notice nobody heard.
                listening = True
                yield Listen(self._free_channel, self.manager.node_timeout if left is None
                             else min(self.manager.node_timeout, left))
                freed = None
                continue
            # No notice comes from a holder that crashed, and a notice can be
            # missed (a listener reconnecting, a node down): wake as a plain
            # lock's waiter does, when the soonest lease of a busy segment
            # runs out or after the retry delay, whichever comes first.
            soonest = min(self._locks[i].retry_after for i in order)
            pause = max(MIN_PAUSE, self.manager.next_wait(left, soonest))
            freed = self._freed((yield Notice(pause if left is None else min(pause, left))),
                                order)

    def _freed(self, payload: bytes | None, order: list[int]) -> int | None:
        """The segment a notice named (its lock key), when it may be tried."""
        if payload:
            for index in order:
                if self._locks[index]._key_b == payload:
                    return index
        return None

    def _release_plan(self, grant: int | None = None) -> Plan:
        with compose._entries_guard:
            if self.index is None or not self._release_begins(grant):
                raise LockNotOwned(f"segments {self.name!r}: no segment held by this object",
                                   lock_name=self.name)
            index, self.index = self.index, None
        lost = yield Drop(index)
        if lost is not None:
            raise lost

    def _holding(self) -> bool:
        return self.index is not None

    def _extend_targets(self) -> list[Any]:
        if self.index is None:
            raise LockNotOwned(f"segments {self.name!r}: no segment held", lock_name=self.name)
        return [self._locks[self.index]]

    def _busy(self) -> LockNotAcquired:
        return LockNotAcquired(f"segments {self.name!r}: all {self.count} busy",
                               lock_name=self.name, retry_after=self.retry_after)


class Segments(SegmentsBase, compose.Composed):
    """Any one free segment of ``name``; from :meth:`LockManager.segments`."""


class AsyncSegments(SegmentsBase, compose.AsyncComposed):
    """The asyncio twin of :class:`Segments`; from :meth:`LockManager.asegments`."""
