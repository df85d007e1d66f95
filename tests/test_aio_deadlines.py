"""The asyncio transport's deadlines (``transport.aio._Deadlines``): one loop
timer for every exchange in flight, never later than the earliest deadline.

A deadline that passes aborts its connection's transport: that is what ends a
read from a node that stopped answering (tests/test_faults.py drives that on
real servers). These tests drive the bookkeeping itself, where a mistake would
be a deadline that fires late (a hung round) or one that fires after it was
ended (a healthy connection aborted): the timer moved by an entry ended
early, an entry added before the timer, many entries ended in random order.
Connections are stand-ins that record when they were aborted.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from django_redlock.transport.aio import _Deadline, _Deadlines

#: How late a deadline may fire on a loaded machine before the test says late.
SLACK = 0.4


class _Transport:
    def __init__(self) -> None:
        self.aborted_at: float | None = None
        self.aborts = 0

    def abort(self) -> None:
        self.aborts += 1
        self.aborted_at = time.monotonic()


class _Writer:
    def __init__(self) -> None:
        self.transport = _Transport()


class _Conn:
    """What a deadline touches of a redis-py asyncio connection: its writer."""

    def __init__(self) -> None:
        self._writer = _Writer()


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20))


def _two(first: float, second: float) -> tuple[float, list[_Conn], list[_Deadline]]:
    """Two deadlines of ``first`` and ``second`` seconds, set in that order
    in the running loop: (when they were set, their connections, them)."""
    watch = _Deadlines(asyncio.get_running_loop())
    conns = [_Conn(), _Conn()]
    start = time.monotonic()
    return start, conns, [_Deadline(conns[0], first, watch), _Deadline(conns[1], second, watch)]


async def _until_passed(deadline: _Deadline, within: float = 2.0) -> None:
    """Wait until ``deadline`` passed, ``within`` seconds at most (bounded)."""
    for _ in range(int(within / 0.01)):
        if deadline.passed:
            return
        await asyncio.sleep(0.01)


def test_a_deadline_ended_before_it_passes_never_aborts() -> None:
    async def main() -> None:
        watch = _Deadlines(asyncio.get_running_loop())
        conn = _Conn()
        deadline = _Deadline(conn, 0.05, watch)
        deadline.end()
        await asyncio.sleep(0.2)
        assert not deadline.passed
        assert conn._writer.transport.aborts == 0
        assert not watch.entries

    _run(main())


def test_a_deadline_fires_on_time_after_an_earlier_one_was_ended() -> None:
    """The timer was set for the first deadline; ending that one leaves the
    timer early, and the second still fires at its own time."""
    async def main() -> None:
        start, (first, second), (d1, d2) = _two(0.05, 0.15)
        d1.end()
        await _until_passed(d2)
        assert d2.passed and not d1.passed
        at = second._writer.transport.aborted_at
        assert at is not None and 0.15 <= at - start + 0.005 < 0.15 + SLACK
        assert first._writer.transport.aborts == 0

    _run(main())


def test_an_earlier_deadline_added_later_moves_the_timer() -> None:
    """A 1 s deadline set the timer; a 0.05 s one added after it must not wait
    for that timer."""
    async def main() -> None:
        start, (_, fast), (d_slow, d_fast) = _two(1.0, 0.05)
        await _until_passed(d_fast, within=1.0)
        at = fast._writer.transport.aborted_at
        assert d_fast.passed and at is not None and at - start < 0.05 + SLACK
        assert not d_slow.passed  # and the later one is still kept
        assert d_slow in d_slow._watch.entries
        d_slow.end()

    _run(main())


def test_a_deadline_already_passed_fires_on_the_next_turn() -> None:
    async def main() -> None:
        watch = _Deadlines(asyncio.get_running_loop())
        conn = _Conn()
        deadline = _Deadline(conn, -1.0, watch)
        assert not deadline.passed  # never inside the call that sets it
        for _ in range(50):
            if deadline.passed:
                break
            await asyncio.sleep(0)
        assert deadline.passed and conn._writer.transport.aborts == 1

    _run(main())


def test_many_deadlines_ended_at_random_none_late_none_after_its_end() -> None:
    """200 deadlines of 0-0.3 s, about half ended at random moments before
    they pass: every one left fires once, not before its time and not later
    than SLACK after it; no ended one ever fires."""
    rng = random.Random(11)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        watch = _Deadlines(loop)
        start = time.monotonic()
        items = []
        for _ in range(200):
            delay = rng.uniform(0.0, 0.3)
            conn = _Conn()
            items.append((delay, conn, _Deadline(conn, delay, watch)))
            if rng.random() < 0.3:
                await asyncio.sleep(0)
        ended = set()
        for delay, _, deadline in items:
            if rng.random() < 0.5 and delay > 0.1:
                end_at = rng.uniform(0.0, delay - 0.05)
                loop.call_at(loop.time() + end_at - (time.monotonic() - start), deadline.end)
                ended.add(id(deadline))
        for _ in range(100):  # bounded: at most about 5 s
            if not watch.entries:
                break
            await asyncio.sleep(0.05)
        assert not watch.entries
        for delay, conn, deadline in items:
            transport = conn._writer.transport
            if id(deadline) in ended:
                assert transport.aborts == 0 and not deadline.passed
            else:
                assert transport.aborts == 1 and deadline.passed
                assert transport.aborted_at is not None
                late = transport.aborted_at - start - delay
                assert -0.005 <= late < SLACK, (delay, late)

    _run(main())


def test_an_abort_that_fails_does_not_keep_the_other_deadlines_from_passing() -> None:
    """Two deadlines pass in the same firing and the first connection's abort
    raises: the second is still aborted (a round waiting on it would
    otherwise never end)."""
    class _Broken(_Transport):
        def abort(self) -> None:
            raise RuntimeError("transport gone")

    async def main() -> None:
        watch = _Deadlines(asyncio.get_running_loop())
        broken, fine = _Conn(), _Conn()
        broken._writer.transport = _Broken()
        first = _Deadline(broken, 0.0, watch)
        second = _Deadline(fine, 0.0, watch)
        await _until_passed(second, within=0.5)
        assert first.passed and second.passed
        assert fine._writer.transport.aborts == 1

    _run(main())


def test_a_reply_already_buffered_gets_one_short_grace() -> None:
    """A deadline that passes with its reply's bytes already in the stream's
    buffer (a loop blocked past it runs the read callback and this timer in
    one turn, the timer first) is not aborted then: the reading task runs
    first. If nothing reads them within LATE_GRACE, it passes all the same."""
    from django_redlock.transport.aio import LATE_GRACE

    class _Reader:
        _buffer = bytearray(b"+OK\r\n")  # come, not read yet

    async def scenario() -> tuple[float, _Conn]:
        watch = _Deadlines(asyncio.get_running_loop())
        conn = _Conn()
        conn._reader = _Reader()  # type: ignore[attr-defined]
        start = time.monotonic()
        _Deadline(conn, 0.05, watch)
        await asyncio.sleep(0.05 + LATE_GRACE / 2)
        assert conn._writer.transport.aborts == 0  # spared at its deadline
        await asyncio.sleep(LATE_GRACE + SLACK)
        return start, conn

    start, conn = _run(scenario())
    assert conn._writer.transport.aborts == 1  # unread after the grace: aborted, once
    assert conn._writer.transport.aborted_at is not None
    assert conn._writer.transport.aborted_at - start >= 0.05 + LATE_GRACE
