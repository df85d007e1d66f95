"""The one set of rules for every time argument of the public API.

``lock(ttl=...)``, ``alock(...)``, ``Lock.acquire(timeout=...)``,
``Lock.extend(ttl)``, ``with_lock(...)`` and the manager's options all pass
through these functions, before anything is sent to a node, so one bad value
gets one clear message (naming the argument and its range) wherever it was
given. The ``REDLOCK`` setting and ``LockManager(...)``'s options are checked
by the same functions (:data:`SETTINGS`, used by
:mod:`django_redlock.core.config`), so a value that ``manage.py check``
accepts is one ``lock()`` accepts: ``LockManager(timeout=1e10)`` was once taken
while ``lock(timeout=1e10)`` was refused. The manager's own time options
(``retry_delay``, ``node_timeout``, ``connect_timeout``) live here too.

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
from typing import Any, Callable

__all__ = [
    "TTL_MIN",
    "TTL_MAX",
    "TIMEOUT_MAX",
    "check_ttl",
    "check_timeout",
    "check_max_hold",
    "check_retry_delay",
    "check_node_timeout",
    "check_connect_timeout",
    "is_seconds",
    "accepts",
    "SETTINGS",
]

#: Shortest lease accepted (seconds): a round on loopback takes about 0.2 ms,
#: the drift allowance is 2 ms, so 10 ms leaves a usable lease.
TTL_MIN = 0.01
#: Longest lease accepted (seconds): one day.
TTL_MAX = 86400.0
#: Longest finite wait accepted (seconds): a year; beyond that, say None.
#: Also the longest ``max_hold``.
TIMEOUT_MAX = 365 * 86400.0
#: ``retry_delay`` (seconds): below 1 ms a waiter is a hot loop; above a
#: minute a waiter misses a free lock for that long when no release notice comes.
RETRY_DELAY_MIN, RETRY_DELAY_MAX = 0.001, 60.0
#: ``node_timeout`` (seconds): a round's deadline per node; above 30 s one
#: slow node would stall every acquire.
NODE_TIMEOUT_MIN, NODE_TIMEOUT_MAX = 0.001, 30.0
#: ``connect_timeout`` (seconds): how long each step of a connection set-up to
#: a node may wait for it (transport.sync.NodeClient.connect).
CONNECT_TIMEOUT_MIN, CONNECT_TIMEOUT_MAX = 0.001, 60.0


def is_seconds(value: Any) -> bool:
    """A real, finite number of seconds (not a bool, not a string, not an int
    too large for a float: ``math.isfinite(10**400)`` raises OverflowError,
    which reached the caller bare)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


#: The most segments or permits of one name: each is a lock object, built
#: when the primitive is (10,000 take about 0.1 s; ten million took minutes
#: before anything was sent).
COUNT_MAX = 10_000

#: The longest owner label (``lock(..., label=...)``): it is stored with the
#: lock on every node and shown by ``manage.py locks``.
LABEL_MAX = 200


def check_count_of(value: Any, call: str, what: str) -> int:
    """An int from 1 to :data:`COUNT_MAX` (``segments``' count, a semaphore's
    permits), or ``ValueError`` naming the call and the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= COUNT_MAX:
        raise ValueError(f"{call}: {what} must be an int from 1 to {COUNT_MAX:,}, "
                         f"not {describe(value)}")
    return value


def check_label(value: Any) -> str | None:
    """None or a str of at most :data:`LABEL_MAX` characters that is valid
    text, or ``ValueError`` (a list failed deep in the owner's JSON cache as
    "unhashable type", a 100 KB label was stored on every node)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"label must be a str or None, not {type(value).__name__}")
    if len(value) > LABEL_MAX:
        raise ValueError(f"label is {len(value)} characters long; the limit is {LABEL_MAX}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"label is not valid text (a lone surrogate): {describe(value)}") \
            from None
    return value


def describe(value: Any) -> str:
    """A bad value as a message shows it: its repr, cut at 60 characters; an
    int of more than 38 digits by its size (``repr`` of an int past 4,300
    digits raises ValueError, and no one reads such a number)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"{'-' if value < 0 else ''}an int of about {value.bit_length() * 3 // 10} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."




#: Each rule's range as the messages say it (the per-call ``ValueError`` and
#: ``manage.py check``'s ``redlock.E010`` alike).
TTL_RANGE = f"a number of seconds between {TTL_MIN:g} and {TTL_MAX:g}"
TIMEOUT_RANGE = (f"None (wait forever), 0 (try once) or a number of seconds up to "
                 f"{TIMEOUT_MAX:.0f} (a year)")
MAX_HOLD_RANGE = (f"None (no cap) or a number of seconds above 0 and up to "
                  f"{TIMEOUT_MAX:.0f} (a year)")


def _between(value: Any, what: str, low: float, high: float) -> float:
    if not is_seconds(value) or not low <= value <= high:
        raise ValueError(
            f"{what} must be a number of seconds between {low:g} and {high:g}, "
            f"not {describe(value)}")
    return float(value)


def check_ttl(value: Any, what: str = "ttl") -> float:
    """``value`` as a lease in seconds, or ``ValueError`` naming ``what`` and the range."""
    if not is_seconds(value) or not TTL_MIN <= value <= TTL_MAX:
        raise ValueError(f"{what} must be {TTL_RANGE}, not {describe(value)}")
    return float(value)


def check_timeout(value: Any, what: str = "timeout") -> float | None:
    """``value`` as a wait: None (forever), 0 (try once) or seconds; else ``ValueError``."""
    if value is None:
        return None
    if not is_seconds(value) or not 0 <= value <= TIMEOUT_MAX:
        raise ValueError(f"{what} must be {TIMEOUT_RANGE}, not {describe(value)}")
    return float(value)


def check_max_hold(value: Any, what: str = "max_hold") -> float | None:
    """``value`` as a cap on the total hold time: None (no cap) or seconds > 0."""
    if value is None:
        return None
    if not is_seconds(value) or not 0 < value <= TIMEOUT_MAX:
        raise ValueError(f"{what} must be {MAX_HOLD_RANGE}, not {describe(value)}")
    return float(value)


def check_retry_delay(value: Any, what: str = "retry_delay") -> float:
    """The longest sleep between a waiter's attempts (a manager option)."""
    return _between(value, what, RETRY_DELAY_MIN, RETRY_DELAY_MAX)


def check_node_timeout(value: Any, what: str = "node_timeout") -> float:
    """Each node's deadline per round (a manager option)."""
    return _between(value, what, NODE_TIMEOUT_MIN, NODE_TIMEOUT_MAX)


def check_connect_timeout(value: Any, what: str = "connect_timeout") -> float:
    """One connection set-up's bound (a manager option)."""
    return _between(value, what, CONNECT_TIMEOUT_MIN, CONNECT_TIMEOUT_MAX)


def accepts(check: Callable[[Any], Any], value: Any) -> bool:
    """Whether ``check`` takes ``value`` (no ``ValueError``)."""
    try:
        check(value)
    except ValueError:
        return False
    return True


#: Every time option of ``REDLOCK`` / ``LockManager(...)``: its check (the very
#: function ``lock()`` and friends call) and its range as messages say it.
SETTINGS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "TTL": (check_ttl, TTL_RANGE),
    "TIMEOUT": (check_timeout, TIMEOUT_RANGE),
    "MAX_HOLD": (check_max_hold, MAX_HOLD_RANGE),
    "RETRY_DELAY": (check_retry_delay, f"between {RETRY_DELAY_MIN:g} and "
                                       f"{RETRY_DELAY_MAX:g} seconds"),
    "NODE_TIMEOUT": (check_node_timeout, f"between {NODE_TIMEOUT_MIN:g} and "
                                         f"{NODE_TIMEOUT_MAX:g} seconds"),
    "CONNECT_TIMEOUT": (check_connect_timeout, f"between {CONNECT_TIMEOUT_MIN:g} and "
                                               f"{CONNECT_TIMEOUT_MAX:g} seconds"),
}
