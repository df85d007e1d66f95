"""Bounded polling for tests: wait for a condition, never forever."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0,
               interval: float = 0.01) -> bool:
    """Poll ``predicate`` every ``interval`` s for at most ``timeout`` s; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
