"""``multi_lock(names)``: all of several locks, or none, deadlock-free.

Why a fixed order: two callers that take ``a`` then ``b`` and ``b`` then ``a``
can each hold one and wait for the other forever::

    t0  P takes a            Q takes b
    t1  P waits for b        Q waits for a     (neither ever gets it)

Every multi-lock takes its locks in one global order (by key), whatever order
the caller gave, so no cycle of waits can form; the caller's ``timeout`` is one
deadline for the whole set. When one lock cannot be had in time, or a round
fails, or the call is interrupted, the locks already taken are given back
before ``acquire`` returns False or the exception goes on: all or none.

Each name keeps its own fence (``fences``); ``fence`` is the largest of them.
"""

from __future__ import annotations

from types import EllipsisType
from typing import TYPE_CHECKING, Any, Sequence

from ..core.arguments import check_timeout
from ..exceptions import LockNotAcquired, LockNotOwned
from . import compose
from .compose import Plan, Take

if TYPE_CHECKING:
    from .protocol import LockHost


def check_names(names: Any) -> list[str]:
    """The names of a multi-lock: a non-empty sequence of distinct strings."""
    if isinstance(names, (str, bytes)) or not hasattr(names, "__iter__"):
        raise ValueError(f"multi_lock(names) takes a list of lock names, not {names!r}")
    given: list[str] = list(names)
    if not given:
        raise ValueError("multi_lock(names) needs at least one name")
    seen = set()
    for name in given:
        if name in seen:
            raise ValueError(f"multi_lock(names): {name!r} is named twice")
        seen.add(name)
    return given


class MultiLockBase(compose.Composite):
    """The rules; :class:`MultiLock` and :class:`AsyncMultiLock` run them."""

    def __init__(self, manager: "LockHost", names: Sequence[str], locks: Sequence[Any],
                 timeout: float | None) -> None:
        self.manager = manager
        self.names = list(names)
        self.timeout = timeout
        #: One lock per name, in the global order (by key).
        self._locks = sorted(locks, key=lambda lock: lock.key)
        self._held = False
        self.retry_after = 0.0

    def __repr__(self) -> str:
        state = "held" if self._held else "unlocked"
        return f"<{type(self).__name__} {self.names!r} {state}>"

    @property
    def fences(self) -> dict[str, int]:
        """Each name's fence (0 for a name not held)."""
        return {lock.name: lock.fence for lock in self._locks}

    @property
    def fence(self) -> int:
        """The largest fence of the set (each name's is in :attr:`fences`)."""
        return int(max(lock.fence for lock in self._locks))

    @property
    def validity(self) -> float:
        """The shortest lease left among the names (0.0 when not held)."""
        return min(lock.validity for lock in self._locks) if self._held else 0.0

    def owned(self) -> bool:
        """True while every name is held with lease left."""
        return self._held and all(lock.owned() for lock in self._locks)

    def _wait(self, blocking: bool, timeout: float | None | EllipsisType) -> float | None:
        wait = self.timeout if timeout is ... else check_timeout(timeout)
        if not isinstance(blocking, bool):
            raise ValueError(f"blocking must be True or False, not {blocking!r}")
        if self._held:
            raise LockNotOwned(f"multi-lock {self.names!r} is already held by this object",
                               lock_name=self.names[0])
        return 0.0 if not blocking else wait

    def _acquire_plan(self, wait: float | None) -> Plan:
        """Take every lock in the global order; all held with lease left, or
        none.

        A lock taken early may lose its lease while a later one is waited for
        (``auto_renew=False`` with a wait longer than the TTL, or a renewal
        that failed)::

            t0.0  a taken (ttl 1 s)        b busy: wait
            t1.0  a's lease runs out       another client takes a
            t1.5  b taken: "all" would be held, a is not

        Then everything is given back and the set is taken again from the
        first name while the caller's time lasts (taking only ``a`` again,
        while holding ``b``, would break the order that keeps multi-locks
        free of deadlocks).
        """
        clock = self.manager.clock
        deadline = None if wait is None else clock() + wait
        while True:
            taken: list[int] = []
            try:
                for index in range(len(self._locks)):
                    left = None if deadline is None else max(0.0, deadline - clock())
                    if not (yield Take(index, left)):
                        self.retry_after = self._locks[index].retry_after
                        yield from compose.give_back(taken)
                        return False
                    taken.append(index)
            except BaseException:
                yield from compose.give_back(taken)
                raise
            if all(lock.owned() for lock in self._locks):
                return self._grant("_held", True)
            yield from compose.give_back(taken)
            if deadline is not None and clock() >= deadline:
                self.retry_after = 0.0
                return False

    def _release_plan(self, grant: int | None = None) -> Plan:
        with compose._entries_guard:
            if not self._held or not self._release_begins(grant):
                raise LockNotOwned(f"multi-lock {self.names!r} is not held by this object",
                                   lock_name=self.names[0])
            self._held = False
        yield from compose.release_all(len(self._locks), "multi-lock", repr(self.names))

    def _holding(self) -> bool:
        return self._held

    def _extend_targets(self) -> list[Any]:
        return list(self._locks)

    def _busy(self) -> LockNotAcquired:
        return LockNotAcquired(f"multi-lock {self.names!r}: not every lock acquired in time",
                               lock_name=self.names[0], retry_after=self.retry_after)


class MultiLock(MultiLockBase, compose.Composed):
    """All of ``names`` or none; from :meth:`LockManager.multi_lock`."""


class AsyncMultiLock(MultiLockBase, compose.AsyncComposed):
    """The asyncio twin of :class:`MultiLock`; from :meth:`LockManager.amulti_lock`."""
