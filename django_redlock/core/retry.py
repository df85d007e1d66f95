"""Retry schedules: a blocked acquire's (jittered, bounded by the deadline),
and the back-off of a node or a listener link that keeps failing.

Waiters are normally woken by the release notice (pub/sub); this schedule is the
fallback for a lost notice or a holder that died without releasing. Jitter keeps
clients that failed together from retrying together (the Redlock page asks for a
random delay for exactly this reason).
"""

from __future__ import annotations

import random
from typing import Protocol


class RandomSource(Protocol):
    def uniform(self, a: float, b: float) -> float: ...


#: Waiting less than this is pointless: the attempt itself costs about this much.
MIN_WAIT = 0.001


def backoff(failures: int, *, first: float, cap: float) -> float:
    """The pause after ``failures`` failures in a row: ``first``, doubling
    with each failure, never above ``cap``.

    The doubling stops once the cap is reached: ``2 ** 1024`` does not fit a
    float, and a node tried once a second while down got there after about
    17 minutes. From then on every round that asked it raised a bare
    ``OverflowError`` instead of counting it as down, and its connect
    thread died at each try (tests/test_faults.py has the long outage)."""
    doublings = max(0, failures - 1)
    if doublings >= 64:
        return cap
    pause: float = first * 2.0 ** doublings
    return min(pause, cap)


def jittered_delay(max_delay: float, rng: RandomSource = random) -> float:
    """A delay drawn uniformly from ``[max_delay / 2, max_delay]``."""
    if max_delay <= 0:
        return 0.0
    return rng.uniform(max_delay / 2, max_delay)


def next_wait(*, remaining: float | None, max_delay: float, holder_ttl: float | None,
              rng: RandomSource = random) -> float:
    """How long a waiter sleeps (unless woken) before its next attempt.

    * ``remaining``: seconds left until the caller's deadline (None: no deadline);
    * ``max_delay``: the RETRY_DELAY setting;
    * ``holder_ttl``: the current holder's lease left, as the nodes reported it
      (None: unknown). A holder that died without releasing costs waiters at most
      its remaining lease, never a fixed polling interval on top.
    """
    wait = jittered_delay(max_delay, rng)
    if holder_ttl is not None and holder_ttl >= 0:
        wait = min(wait, holder_ttl + MIN_WAIT)
    if remaining is not None:
        wait = min(wait, remaining)
    return max(wait, 0.0)
