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

import logging
from typing import Any

from django.dispatch import Signal

lock_acquired = Signal()
lock_released = Signal()
lock_lost = Signal()
lock_not_acquired = Signal()
lock_extended = Signal()
lock_waiter_woken = Signal()

# Named after the public module, as before the signals moved here: log
# configurations that name "django_redlock.signals" still catch receiver failures.
logger = logging.getLogger("django_redlock.signals")


def send(signal: Signal, sender: Any, **kwargs: Any) -> None:
    """Send ``signal``; a failing receiver is logged, never propagated into lock code."""
    if not signal.receivers or not signal.has_listeners(sender):
        return  # the first test is free; has_listeners() walks the receivers
    for receiver, result in signal.send_robust(sender, **kwargs):
        if isinstance(result, Exception):
            logger.error("receiver %r of %s failed", receiver, kwargs.get("name"), exc_info=result)
