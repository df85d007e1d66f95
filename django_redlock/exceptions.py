"""The errors django-redlock raises.

One base class, :class:`RedlockError`, carries context (the lock name and, where one
node is to blame, that node's masked name), so a handler can log something useful.
The subclasses are narrow on purpose: "the lock is busy" (:class:`LockNotAcquired`)
and "Redis is not there" (:class:`QuorumUnavailable`) call for different reactions
(retry later vs. page someone), and most peers fold them into one.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "RedlockError",
    "LockNotAcquired",
    "LockLost",
    "LockNotOwned",
    "QuorumUnavailable",
    "FencedWriteRejected",
    "LockKindConflict",
]


class RedlockError(Exception):
    """Base of every error raised by django-redlock."""

    def __init__(self, message: str, *, lock_name: str | None = None, **context: Any) -> None:
        super().__init__(message)
        self.lock_name = lock_name
        self.context = context


class LockNotAcquired(RedlockError):
    """The wait for a busy lock ran out.

    ``retry_after`` is a hint in seconds: how long the current holder's lease has
    left on the nodes that answered (or the retry delay when that is unknown).
    """

    def __init__(self, message: str, *, lock_name: str | None = None,
                 retry_after: float = 0.0, **context: Any) -> None:
        super().__init__(message, lock_name=lock_name, **context)
        self.retry_after = retry_after


class LockLost(RedlockError):
    """A held lock expired or was taken by someone else while the work ran.

    Raised at the latest when the ``with`` block or decorated call ends (or by
    :meth:`Lock.release`), so the caller can roll the work back. Whatever was
    written while the lock was lost was not protected by it; only fencing
    (:class:`FencedWriteRejected`) protects the storage itself.
    """


class LockNotOwned(RedlockError):
    """Release or extend of a lock this object does not hold."""


class QuorumUnavailable(RedlockError):
    """Fewer than N // 2 + 1 nodes answered.

    ``answered`` and ``needed`` say how many; ``errors`` maps each failing node's
    masked name to a short reason. Raised within the configured node timeouts.
    ``round_seconds``: how long the acquire round that missed the quorum took,
    without the clean-up release that follows it (None when not an acquire's).
    """

    #: See the class docstring.
    round_seconds: float | None = None

    def __init__(self, message: str, *, lock_name: str | None = None, answered: int = 0,
                 needed: int = 0, errors: dict[str, str] | None = None, **context: Any) -> None:
        super().__init__(message, lock_name=lock_name, **context)
        self.answered = answered
        self.needed = needed
        self.errors = dict(errors or {})


class LockKindConflict(RedlockError):
    """One name used as two kinds of lock at once: a plain ``lock(name)`` while
    ``read_lock(name)`` / ``write_lock(name)`` holds it, or the other way round.

    Raised at the call, at once: the two kinds keep different state under one
    key and never exclude each other by waiting, so waiting would only end in
    a timeout. Give each kind its own name.
    """


class FencedWriteRejected(RedlockError):
    """A fenced write was refused: a newer lock holder (higher fence) already wrote.

    This is the storage layer doing its job: the caller's lease ran out (a pause, a
    slow request) and somebody else acquired the lock since. Do not retry the write
    with the same fence; acquire the lock again.
    """

    def __init__(self, message: str, *, lock_name: str | None = None, fence: int = 0,
                 **context: Any) -> None:
        super().__init__(message, lock_name=lock_name, **context)
        self.fence = fence
