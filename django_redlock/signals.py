"""Signals sent by every lock, whatever started it (API, decorator, ORM helper).

All are sent with ``sender=Lock`` (the class) and these keyword arguments:

``lock_acquired``
    ``lock``, ``name``, ``fence``, ``hold``, ``wait`` (seconds spent acquiring)
``lock_released``
    ``lock``, ``name``, ``fence``, ``hold``, ``held`` (seconds held), ``nodes`` (how many
    nodes confirmed the deletion). Sent only for a release that at least one node
    confirmed: a release that reached no node (all unreachable) is logged
    instead, since the lock then stays until its lease ends; none for a
    semaphore's line handed on without waiting for the replies.
``lock_lost``
    ``lock``, ``name``, ``fence``, ``hold``, ``held``, ``reason`` (str). Sent once per
    hold at most, from the thread that noticed first: the renewal thread, or
    the caller at release time (see below for a release a garbage collection
    ran, which may run while the renewal reports). A database
    connection a receiver opens in the renewal thread is closed after that tick
    when it is past ``CONN_MAX_AGE`` (as at the end of a request), and when the
    thread ends in any case.
``lock_not_acquired``
    ``lock``, ``name``, ``wait`` (seconds spent), ``outcome``: ``"busy"`` (the wait
    ran out; ``acquire()`` returns False or ``LockNotAcquired`` follows) or
    ``"quorum_unavailable"`` (``QuorumUnavailable`` follows).
``lock_extended``
    ``lock``, ``name``, ``fence``, ``hold``, ``ttl`` (the new lease, seconds): a renewal by
    the watchdog or an ``extend()`` that a quorum applied.
``lock_waiter_woken``
    ``lock``, ``name``: a waiting acquirer was woken by a release notice (then it
    asks the nodes again).
``fenced_write_rejected``
    sent with ``sender=`` the model class: ``model``, ``lock_name``, ``fence``,
    ``stored_fence``; right before :class:`~django_redlock.FencedWriteRejected`
    is raised by a claim or a fenced write.

``hold`` is the lock object's acquisition number (1 for its first hold, 2
for the next...): with ``lock``, it tells which hold a signal is about, with
fencing off too (where every ``fence`` is 0).

These are what :mod:`django_redlock.metrics` counts; an OpenTelemetry (or any
other) integration can connect to them the same way.

A receiver that raises does not break the lock: exceptions are logged.

The signals of a release that a garbage collection ran (a generator left
inside ``with lock`` and freed from a reference cycle, an asyncio task
destroyed while pending) are sent from a thread of the library's own
(``redlock-finalizer``), in order, shortly after the release: the
collection may have run while the collecting thread held a lock that a
receiver takes. Match such a signal to its hold by ``lock`` and ``hold``,
not by the ``lock`` object alone: the object may already hold again.

From an :class:`~django_redlock.AsyncLock` the signals go through Django's
``asend_robust``: an ``async def`` receiver is awaited, a plain one runs in a
worker thread (``sync_to_async``), so a receiver that blocks (the ORM, a
file) never stalls the event loop. While the package's own receivers are the
only ones connected (:mod:`django_redlock.metrics`, the debug-toolbar panel:
a counter, a record in memory), they are called in the loop's thread
instead, with no thread hop (``connect_receivers(..., loop_safe=True)``).

The engine sends every signal but ``fenced_write_rejected``, so they are
defined below it, in ``django_redlock/engine/events.py`` (the engine imports
nothing above it); this module is their public place and re-exports the very
same objects.
"""

from __future__ import annotations

from typing import Any

from django.dispatch import Signal

# The engine sends these (the locks report from below this layer), so they are
# defined in engine/events.py and are the very same objects here.
from .engine.events import (
    lock_acquired,
    lock_extended,
    lock_lost,
    lock_not_acquired,
    lock_released,
    lock_waiter_woken,
    logger,
    mark_loop_safe,
    send,
)

__all__ = [
    "lock_acquired",
    "lock_released",
    "lock_lost",
    "lock_not_acquired",
    "lock_extended",
    "lock_waiter_woken",
    "fenced_write_rejected",
    "send",
    "logger",
    "connect_receivers",
    "disconnect_receivers",
]

# Sent by the fenced writes of this layer (models.py), not by the engine.
fenced_write_rejected = Signal()


def connect_receivers(receivers: Any, uid_prefix: str, *, loop_safe: bool = False) -> None:
    """Connect ``(signal, receiver)`` pairs, idempotently (one ``dispatch_uid``
    per receiver: ``<uid_prefix>.<name>``); for metrics and the debug panel.

    ``loop_safe``: the receivers never block, so the asyncio flavour may call
    them in the event loop's thread while no other receiver listens
    (``engine.events.only_loop_safe``)."""
    for signal, receiver in receivers:
        uid = f"{uid_prefix}.{receiver.__name__}"
        signal.connect(receiver, dispatch_uid=uid)
        if loop_safe:
            mark_loop_safe(signal, uid)


def disconnect_receivers(receivers: Any, uid_prefix: str) -> None:
    """Undo :func:`connect_receivers`."""
    for signal, receiver in receivers:
        uid = f"{uid_prefix}.{receiver.__name__}"
        signal.disconnect(receiver, dispatch_uid=uid)
        mark_loop_safe(signal, uid, safe=False)
