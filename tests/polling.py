"""Bounded waiting for tests: for a condition, or for threads; never forever."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

import pytest


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0,
               interval: float = 0.01) -> bool:
    """Poll ``predicate`` every ``interval`` s for at most ``timeout`` s; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def run_in_threads(work: Callable[[], None], count: int, timeout: float = 60.0) -> None:
    """Run ``work`` in ``count`` threads at once; wait for all, at most ``timeout``
    s in all, and fail the test if any is still running."""
    threads = [threading.Thread(target=work, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    stuck = sum(t.is_alive() for t in threads)
    assert not stuck, f"{stuck} of {count} threads still running after {timeout:g} s"


def child_exit_code(pid: int, within: float, what: str = "the forked child") -> int:
    """The exit code of forked child ``pid`` (``-N``: killed by signal N),
    waited for at most ``within`` seconds; then it is killed and the test
    fails: a child that hangs never hangs the suite."""
    started = time.monotonic()
    while time.monotonic() - started < within:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"{what} was still running after {within:g} s")
