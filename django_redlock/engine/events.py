"""What the engine reports: the lock signals and how they are sent.

They live here, in the engine, because the locks send them: the drivers
(:mod:`.lock`, :mod:`.aio`) and the protocol (:mod:`.protocol`) would
otherwise import the Django layer above them. :mod:`django_redlock.signals`
is their documented place: it re-exports these very objects (and adds
``fenced_write_rejected``, which the Django layer's fenced writes send), so a
receiver connected there hears every lock.

Only ``django.dispatch`` is used, which needs no settings.
"""

from __future__ import annotations

import threading
from typing import Any

from django.dispatch import Signal

from ..transport.finalizers import get_logger

# use_caching: Django keeps each sender's receiver list until a receiver is
# connected or disconnected, instead of building it again on every send. The
# sender is always the Lock class; with the metrics connected, 10,000 held
# locks renew 10,000 times a second, and each renewal's signal built the list
# twice (has_listeners, then send_robust). The renewal thread's CPU with the
# metrics connected went from 12.2 % to 11.5 % of one core (6 fresh processes
# each, interleaved; without any receiver it is about 6 %: the signal and the
# counter cost about as much as the renewal itself).
lock_acquired = Signal(use_caching=True)
lock_released = Signal(use_caching=True)
lock_lost = Signal(use_caching=True)
lock_not_acquired = Signal(use_caching=True)
lock_extended = Signal(use_caching=True)
lock_waiter_woken = Signal(use_caching=True)

# Named after the public module, as before the signals moved here: log
# configurations that name "django_redlock.signals" still catch receiver failures.
logger = get_logger("django_redlock.signals")


def send(signal: Signal, sender: Any, **kwargs: Any) -> None:
    """Send ``signal``; a failing receiver is logged, never propagated into lock code."""
    if not signal.receivers:
        return  # free; send_robust() answers from its cache when none is for Lock
    for receiver, result in signal.send_robust(sender, **kwargs):
        if isinstance(result, Exception):
            logger.error("receiver %r of %s failed", receiver, kwargs.get("name"), exc_info=result)


#: The ``dispatch_uid`` of each receiver known never to block (the package's
#: own metrics and debug-toolbar panel: a counter, a record in memory), per
#: signal. When a signal has no other receiver, the asyncio flavour calls them
#: in the event loop's thread (:func:`only_loop_safe`) instead of through
#: Django's ``asend_robust``, which runs every sync receiver through
#: ``sync_to_async``: a hop to a worker thread and back for each signal. With
#: the metrics connected, an uncontended ``alock`` acquire + release took 924
#: µs against 271 µs without them, and turned the event loop 16 times instead
#: of 4.
_loop_safe: dict[Signal, set[str]] = {}
_loop_safe_guard = threading.Lock()


def mark_loop_safe(signal: Signal, dispatch_uid: str, safe: bool = True) -> None:
    """Say that the receiver connected to ``signal`` under ``dispatch_uid``
    never blocks (``safe=False``: forget it again, when it is disconnected)."""
    with _loop_safe_guard:
        uids = set(_loop_safe.get(signal, ()))
        if safe:
            uids.add(dispatch_uid)
        else:
            uids.discard(dispatch_uid)
        _loop_safe[signal] = uids  # a new set: readers iterate without the guard


def only_loop_safe(signal: Signal) -> bool:
    """Whether every receiver connected to ``signal`` was marked as never
    blocking. A receiver connected without a ``dispatch_uid``, or by anyone
    else, makes it False (so does a dead receiver Django has not swept yet),
    and the signal then goes through ``asend_robust`` as before."""
    uids = _loop_safe.get(signal)
    if not uids:
        return False
    try:
        # Django keeps each connection as a tuple whose first item is its
        # lookup key, (dispatch_uid, sender id) when a dispatch_uid was given.
        return all(entry[0][0] in uids for entry in signal.receivers)
    except (TypeError, IndexError, KeyError):  # another layout: not known to be safe
        return False
