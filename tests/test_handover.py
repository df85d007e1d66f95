"""A release hands the key to the waiter it wakes (release.lua, acquire.lua).

For ``rounds.HANDOVER_MS`` after such a release the key reads
``>`` + the woken waiter's token + ``|``: that waiter's attempt takes it, every
other attempt is refused and queued. Without it, the releaser (awake, looping)
or any newcomer took the key while the woken waiter was still waking up, and
the waiter's attempt failed and went back to the line.

The woken waiter is held back by a gate on its manager's acquire rounds, so
what happens during the hand-over is seen, not raced. Every wait is bounded.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import pytest
import redis

from django_redlock import rounds
from django_redlock.inspection import scan_locks
from django_redlock.testing import RedisNodes
from tests.polling import wait_until
from tests.test_waiters import SLOW_RETRY, _queued

MakeManager = Callable[..., Any]


class _HeldBack:
    """Blocks a manager's acquire rounds of woken waiters until :meth:`go`."""

    def __init__(self, mgr: Any) -> None:
        self.woken = threading.Event()
        self._go = threading.Event()
        self.rounds_after_wake = 0
        real = mgr._acquire_round

        def gated(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("woken"):
                self.rounds_after_wake += 1
                self.woken.set()
                if not self._go.wait(10):
                    raise AssertionError("the test never let the woken waiter go")
            return real(*args, **kwargs)

        mgr._acquire_round = gated

    def go(self) -> None:
        self._go.set()


def _value(url: Any, key: str) -> tuple[bytes | None, int]:
    client = redis.Redis.from_url(str(url))
    try:
        return client.get(key), client.pttl(key)
    finally:
        client.close()


def _start_waiter(mgr: Any, name: str, got: list[str], tag: str, timeout: float = 10) -> threading.Thread:
    def run() -> None:
        lock = mgr.lock(name, timeout=timeout, auto_renew=False)
        if lock.acquire():
            got.append(tag)
            lock.release()

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.fixture
def long_handover(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hand-over long enough to look at on a slow machine (the default is 25 ms)."""
    monkeypatch.setattr(rounds, "_HANDOVER_B", b"5000")


def test_the_woken_waiter_gets_the_key_a_newcomer_is_refused(
        nodes3: RedisNodes, make_manager: MakeManager, long_handover: None) -> None:
    one = [str(nodes3.urls[0])]
    holder = make_manager(one)
    waiter = make_manager(one, retry_delay=SLOW_RETRY)
    newcomer = make_manager(one)
    held = _HeldBack(waiter)
    lock = holder.lock("handover")
    assert lock.acquire()
    got: list[str] = []
    t = _start_waiter(waiter, "handover", got, "waiter")
    assert wait_until(lambda: _queued(nodes3, holder, "handover") == 1), "not queued"
    lock.release()
    assert held.woken.wait(5), "the release did not wake the waiter"
    raw, pttl = _value(one[0], lock.key)
    assert raw is not None and raw.startswith(b">") and raw.endswith(b"|"), raw
    assert 0 < pttl <= 5000
    # While the woken waiter is away, the key is its own: nobody else gets it.
    assert newcomer.lock("handover").acquire(blocking=False) is False
    held.go()
    t.join(timeout=10)
    assert got == ["waiter"]
    assert held.rounds_after_wake == 1, "the woken waiter needed more than one attempt"


def test_the_releaser_goes_into_line_behind_the_waiter_it_woke(
        nodes3: RedisNodes, make_manager: MakeManager, long_handover: None) -> None:
    releaser = make_manager(nodes3, retry_delay=SLOW_RETRY)
    waiter = make_manager(nodes3, retry_delay=SLOW_RETRY)
    held = _HeldBack(waiter)
    lock = releaser.lock("line-up", auto_renew=False)
    assert lock.acquire()
    order: list[str] = []
    t = _start_waiter(waiter, "line-up", order, "waiter")
    assert wait_until(lambda: _queued(nodes3, releaser, "line-up") == 1), "not queued"
    lock.release()
    assert held.woken.wait(5), "the release did not wake the waiter"
    again = _start_waiter(releaser, "line-up", order, "releaser")
    # The releaser is refused at the gate node and queued, not served.
    assert wait_until(lambda: _queued(nodes3, releaser, "line-up") == 1), "releaser not queued"
    assert order == []
    held.go()
    t.join(timeout=10)
    again.join(timeout=10)
    assert order == ["waiter", "releaser"]


def test_a_handover_the_woken_waiter_never_takes_expires(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    one = [str(nodes3.urls[0])]
    holder = make_manager(one)
    waiter = make_manager(one, retry_delay=SLOW_RETRY)
    newcomer = make_manager(one)
    held = _HeldBack(waiter)
    lock = holder.lock("stuck")
    assert lock.acquire()
    got: list[str] = []
    t = _start_waiter(waiter, "stuck", got, "waiter")
    assert wait_until(lambda: _queued(nodes3, holder, "stuck") == 1), "not queued"
    released = time.monotonic()
    lock.release()
    assert held.woken.wait(5)
    # The waiter does not come back: after HANDOVER_MS the key is free again.
    other = newcomer.lock("stuck", auto_renew=False)
    assert wait_until(lambda: other.acquire(blocking=False), timeout=2.0, interval=0.005)
    assert time.monotonic() - released >= rounds.HANDOVER_MS / 1000.0 * 0.9
    held.go()  # late: its attempt is refused, it goes back to the front of the line
    assert wait_until(lambda: _queued(nodes3, holder, "stuck") == 1), "not back in line"
    other.release()  # wakes it by name
    t.join(timeout=SLOW_RETRY - 1)
    assert got == ["waiter"]


def test_the_lock_listing_does_not_count_a_handover_as_foreign(
        nodes3: RedisNodes, make_manager: MakeManager, long_handover: None) -> None:
    holder = make_manager(nodes3)
    waiter = make_manager(nodes3, retry_delay=SLOW_RETRY)
    held = _HeldBack(waiter)
    lock = holder.lock("listed")
    assert lock.acquire()
    got: list[str] = []
    t = _start_waiter(waiter, "listed", got, "waiter")
    assert wait_until(lambda: _queued(nodes3, holder, "listed") == 1), "not queued"
    lock.release()
    assert held.woken.wait(5)
    inventory = scan_locks(holder, "*")
    assert inventory.skipped == 0
    assert [info.name for info in inventory.locks] == []
    held.go()
    t.join(timeout=10)
    assert got == ["waiter"]
