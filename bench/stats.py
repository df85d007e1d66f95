"""Percentiles and medians (no numpy: the bench installs nothing heavy)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear interpolation between closest ranks."""
    if not values:
        return float("nan")
    data = sorted(values)
    if len(data) == 1:
        return float(data[0])
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float:
    data = [v for v in values if not math.isnan(v)]
    return statistics.median(data) if data else float("nan")


def out_of_order(served: Iterable[tuple[float, int]], expected: int) -> int:
    """Grants out of arrival order: ``served`` holds (grant time, arrival
    index) pairs; a grant counts when a waiter that arrived later was served
    before it, and each of the ``expected`` waiters never served counts too."""
    most, late, seen = -1, 0, 0
    for _, index in sorted(served):
        seen += 1
        if index < most:
            late += 1
        most = max(most, index)
    return late + (expected - seen)
