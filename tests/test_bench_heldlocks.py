"""The held-locks benchmark judges its goal on the renewal thread's own CPU,
read from /proc (bench.heldlocks._thread_cpu): that reading must follow the
thread it names, not the process."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from bench.heldlocks import _thread_cpu
from bench.report import _held10k

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_the_cpu_of_a_busy_thread_grows_and_an_idle_one_does_not() -> None:
    stop = threading.Event()
    idle = threading.Thread(target=stop.wait, args=(10.0,))
    idle.start()
    try:
        busy_id = threading.get_native_id()
        busy0, idle0 = _thread_cpu(busy_id), _thread_cpu(idle.native_id)
        # Busy until this thread used 0.15 s of CPU by Python's own clock,
        # not for a fixed wall time: on a loaded machine 0.3 s of wall time
        # gave the thread 0.08 s (CI). Bounded in time and count.
        spent0 = time.thread_time()
        end = time.monotonic() + 20.0
        n = 0
        while (time.thread_time() - spent0 < 0.15 and time.monotonic() < end
               and n < 500_000_000):
            n += 1
        busy1, idle1 = _thread_cpu(busy_id), _thread_cpu(idle.native_id)
    finally:
        stop.set()
        idle.join(5.0)
    assert busy0 is not None and busy1 is not None and idle0 is not None and idle1 is not None
    assert busy1 - busy0 >= 0.1
    assert idle1 - idle0 <= 0.02


def test_an_unknown_thread_reads_as_none() -> None:
    assert _thread_cpu(None) is None
    assert _thread_cpu(2**31 - 2) is None


def test_the_goal_reads_the_renewal_thread_and_falls_back_to_the_process() -> None:
    row = {"held": 10000, "cpu_pct": 26.0, "renewal_cpu_pct": 8.0}
    assert _held10k({"heldlocks": {"rows": {"10000": row}}}) == 8.0
    old = {"held": 10000, "cpu_pct": 26.0}  # results recorded before the thread was read
    assert _held10k({"heldlocks": {"rows": {"10000": old}}}) == 26.0
    unreadable = {"held": 10000, "cpu_pct": 26.0, "renewal_cpu_pct": None}
    assert _held10k({"heldlocks": {"rows": {"10000": unreadable}}}) == 26.0
