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

The rows a hold *claimed* are kept here too, for the claim's own rule: a row
that already carries this hold's fence is ours only if this hold claimed it.
Fences are unique per hold while the nodes keep their data, but not after a
node lost it (docs/safety.rst, "Two holders with one fence")::

    t0  A is granted by nodes 1, 2 (node 3 out of reach): fence 501 (node 1's
        counter was 500); A claims row 7 (fence 501), reads stock 5
    t1  node 2 loses its data (FLUSHALL, eviction, a restart empty)
    t2  B is granted by nodes 2, 3: node 3's counter was also 500: fence 501
    t3  B's claim finds row 7 at fence 501: "already ours" would let B read
        stock 5 too, and both writes (WHERE fence = 501) land: one sale lost

So a claim that changes no row, and finds the row at its own fence, is
refused unless this hold claimed that row before.
"""

from __future__ import annotations

from typing import Any

__all__ = ["claimed_rows", "fenced_write_accepted", "note_claimed_rows", "note_fenced_write"]

_ATTR = "_redlock_fenced_writes"
_CLAIMS = "_redlock_claimed_rows"


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


def note_claimed_rows(lock: Any, fence: int, rows: Any) -> None:
    """Record that ``lock``'s hold at ``fence`` claimed ``rows`` (``(model
    label, primary key)`` pairs)."""
    held = getattr(lock, _CLAIMS, None)
    if held is None or held[0] != fence:  # a new hold: the old one's rows are not its own
        held = (fence, set())
        try:
            setattr(lock, _CLAIMS, held)
        except AttributeError:  # an object that takes no attributes: no row is ours again
            return
    held[1].update(rows)


def claimed_rows(lock: Any, fence: int) -> "set[Any]":
    """The rows ``lock``'s hold at ``fence`` claimed (empty for another hold)."""
    held = getattr(lock, _CLAIMS, None)
    return held[1] if held is not None and held[0] == fence else set()
