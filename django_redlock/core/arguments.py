"""The one set of rules for every time argument of the public API.

``lock(ttl=...)``, ``alock(...)``, ``Lock.acquire(timeout=...)``,
``Lock.extend(ttl)``, ``with_lock(...)`` and the manager's options all pass
through these functions, before anything is sent to a node, so one bad value
gets one clear message (naming the argument and its range) wherever it was
given. The ``REDLOCK`` setting is checked against the same bounds
(:mod:`django_redlock.core.config`), so a value that ``manage.py check``
accepts is one these accept.

Why each bound, by the failure it stops:

* ``ttl`` below :data:`TTL_MIN`: the lease is gone before the round that
  grants it returns (``ttl=0.001`` could never be acquired, and ``extend(0)``
  sent a 1 ms expiry that deleted the key on every node while ``owned()``
  stayed true: two owners).
* ``ttl`` above :data:`TTL_MAX`, ``inf``, ``nan``: a lease of days is an
  abandoned lock nobody can recover from but an operator; ``inf`` overflowed
  deep inside the packing of the request.
* ``timeout`` of ``nan`` never compared as elapsed (a wait that never ends);
  ``-1`` silently meant "try once"; ``"0.3"`` silently waited 0.3 s. None
  is the one spelling of "wait forever".
* ``True``/``False`` are ints in Python: ``ttl=True`` was a one-second lease.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "TTL_MIN",
    "TTL_MAX",
    "TIMEOUT_MAX",
    "check_ttl",
    "check_timeout",
    "check_max_hold",
    "is_seconds",
]

#: Shortest lease accepted (seconds): a round on loopback takes about 0.2 ms,
#: the drift allowance is 2 ms, so 10 ms leaves a usable lease.
TTL_MIN = 0.01
#: Longest lease accepted (seconds): one day.
TTL_MAX = 86400.0
#: Longest finite wait accepted (seconds): a year; beyond that, say None.
TIMEOUT_MAX = 365 * 86400.0


def is_seconds(value: Any) -> bool:
    """A real, finite number of seconds (not a bool, not a string)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def check_count_of(value: Any, call: str, what: str) -> int:
    """An int of at least 1 (``segments``' count, a semaphore's permits), or
    ``ValueError`` naming the call and the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{call}: {what} must be an int of at least 1, not {value!r}")
    return value


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_ttl(value: Any, what: str = "ttl") -> float:
    """``value`` as a lease in seconds, or ``ValueError`` naming ``what`` and the range."""
    if not is_seconds(value) or not TTL_MIN <= value <= TTL_MAX:
        raise ValueError(
            f"{what} must be a number of seconds between {TTL_MIN:g} and {TTL_MAX:g}, "
            f"not {_describe(value)}")
    return float(value)


def check_timeout(value: Any, what: str = "timeout") -> float | None:
    """``value`` as a wait: None (forever), 0 (try once) or seconds; else ``ValueError``."""
    if value is None:
        return None
    if not is_seconds(value) or not 0 <= value <= TIMEOUT_MAX:
        raise ValueError(
            f"{what} must be None (wait forever), 0 (try once) or a number of seconds up to "
            f"{TIMEOUT_MAX:g}, not {_describe(value)}")
    return float(value)


def check_max_hold(value: Any, what: str = "max_hold") -> float | None:
    """``value`` as a cap on the total hold time: None (no cap) or seconds > 0."""
    if value is None:
        return None
    if not is_seconds(value) or not 0 < value <= TIMEOUT_MAX:
        raise ValueError(
            f"{what} must be None (no cap) or a number of seconds above 0, "
            f"not {_describe(value)}")
    return float(value)
