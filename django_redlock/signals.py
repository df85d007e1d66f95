"""Signals sent by every lock, whatever started it (API, decorator, ORM helper).

All are sent with ``sender=Lock`` (the class) and these keyword arguments:

``lock_acquired``
    ``lock``, ``name``, ``fence``, ``wait`` (seconds spent acquiring)
``lock_released``
    ``lock``, ``name``, ``fence``, ``held`` (seconds held), ``nodes`` (how many
    nodes confirmed the deletion). Sent only for a release that at least one node
    confirmed: a release that reached no node (all unreachable) is logged
    instead, since the lock then stays until its lease ends; none for a
    semaphore's line handed on without waiting for the replies.
``lock_lost``
    ``lock``, ``name``, ``fence``, ``held``, ``reason`` (str). Sent from the thread
    that noticed: the renewal thread, or the caller at release time. A database
    connection a receiver opens in the renewal thread is closed after that tick
    when it is past ``CONN_MAX_AGE`` (as at the end of a request), and when the
    thread ends in any case.
``lock_not_acquired``
    ``lock``, ``name``, ``wait`` (seconds spent), ``outcome``: ``"busy"`` (the wait
    ran out; ``acquire()`` returns False or ``LockNotAcquired`` follows) or
    ``"quorum_unavailable"`` (``QuorumUnavailable`` follows).
``lock_extended``
    ``lock``, ``name``, ``fence``, ``ttl`` (the new lease, seconds): a renewal by
    the watchdog or an ``extend()`` that a quorum applied.
``lock_waiter_woken``
    ``lock``, ``name``: a waiting acquirer was woken by a release notice (then it
    asks the nodes again).
``fenced_write_rejected``
    sent with ``sender=`` the model class: ``model``, ``lock_name``, ``fence``,
    ``stored_fence``; right before :class:`~django_redlock.FencedWriteRejected`
    is raised by a claim or a fenced write.

These are what :mod:`django_redlock.metrics` counts; an OpenTelemetry (or any
other) integration can connect to them the same way.

A receiver that raises does not break the lock: exceptions are logged.
"""

from __future__ import annotations

import logging
from typing import Any

from django.dispatch import Signal

lock_acquired = Signal()
lock_released = Signal()
lock_lost = Signal()
lock_not_acquired = Signal()
lock_extended = Signal()
lock_waiter_woken = Signal()
fenced_write_rejected = Signal()

logger = logging.getLogger("django_redlock.signals")


def send(signal: Signal, sender: Any, **kwargs: Any) -> None:
    """Send ``signal``; a failing receiver is logged, never propagated into lock code."""
    if not signal.receivers or not signal.has_listeners(sender):
        return  # the first test is free; has_listeners() walks the receivers
    for receiver, result in signal.send_robust(sender, **kwargs):
        if isinstance(result, Exception):
            logger.error("receiver %r of %s failed", receiver, kwargs.get("name"), exc_info=result)


def connect_receivers(receivers: Any, uid_prefix: str) -> None:
    """Connect ``(signal, receiver)`` pairs, idempotently (one ``dispatch_uid``
    per receiver: ``<uid_prefix>.<name>``); for metrics and the debug panel."""
    for signal, receiver in receivers:
        signal.connect(receiver, dispatch_uid=f"{uid_prefix}.{receiver.__name__}")


def disconnect_receivers(receivers: Any, uid_prefix: str) -> None:
    """Undo :func:`connect_receivers`."""
    for signal, receiver in receivers:
        signal.disconnect(receiver, dispatch_uid=f"{uid_prefix}.{receiver.__name__}")
