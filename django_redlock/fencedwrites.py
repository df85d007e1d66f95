"""Which fenced writes the storage accepted, per lock hold.

A view decorated with ``with_lock`` learns at its end that its lock was lost
(``LockLost`` from the release). Whether that makes its answer wrong depends on
what it wrote: a write the database accepted *conditionally on the holder's
fence* (:meth:`~django_redlock.models.LockableModel.fenced_save`,
:meth:`~django_redlock.models.LockingQuerySet.fenced_update`) was protected by the
storage itself, whatever happened to the lease afterwards::

    t0  view claims row 7 with fence 41, reads stock 5
    t1  view writes stock 4 WHERE fence = 41: accepted (the storage vouches)
    t2  the nodes lose their data (FLUSHALL, a restart); renewal fails
    t3  the view returns 200; the release raises LockLost

Answering 500 at t3 would tell the client that a recorded sale failed. The ORM
helpers note each accepted fenced write here, keyed by the lock object and its
fence, and the decorator asks before turning a late ``LockLost`` into an error.
(No import of Django models here: the decorator module imports this one.)
"""

from __future__ import annotations

from typing import Any

__all__ = ["fenced_write_accepted", "note_fenced_write"]

_ATTR = "_redlock_fenced_writes"


def note_fenced_write(lock: Any, fence: int) -> None:
    """Record that the storage accepted a write fenced with ``lock`` at ``fence``."""
    marks = getattr(lock, _ATTR, None)
    if marks is None:
        marks = set()
        try:
            setattr(lock, _ATTR, marks)
        except AttributeError:  # an object that takes no attributes: nothing to vouch with
            return
    marks.add(fence)


def fenced_write_accepted(lock: Any, fence: int) -> bool:
    """Whether a fenced write with ``lock`` at ``fence`` was accepted (``fence > 0``)."""
    return fence > 0 and fence in getattr(lock, _ATTR, ())
