"""How often an asyncio event loop turns around uncontended ``alock()`` calls
(issue 23's cost tests): a turn is one ``select()`` of the loop's selector."""

from __future__ import annotations

import asyncio
import selectors
from typing import Any


class _CountingSelector(selectors.DefaultSelector):  # type: ignore[misc, valid-type]
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def select(self, timeout: float | None = None) -> Any:
        self.calls += 1
        return super().select(timeout)


def alock_turns(manager: Any, name: str, count: int = 20, warm: int = 5) -> int:
    """The turns of a fresh loop over ``count`` uncontended acquire + release
    of ``manager.alock(name)``, after ``warm`` that open the connections and
    load the scripts."""
    async def ops(times: int) -> None:
        for _ in range(times):
            lock = manager.alock(name, ttl=5)
            assert await lock.acquire(timeout=1)
            await lock.release()

    selector = _CountingSelector()
    loop = asyncio.SelectorEventLoop(selector)
    try:
        loop.run_until_complete(ops(warm))
        before = selector.calls
        loop.run_until_complete(ops(count))
        return selector.calls - before
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def turns_per_op() -> int:
    """The most an uncontended acquire + release on 1 node may turn the loop:
    two round trips, and two turns each (the reply's read event, then the
    task's wake-up). The check of an idle connection taken for a round
    (transport/aio.py's ``_stale_now``) looks at the buffers without
    awaiting; redis-py's own before ``can_read`` (5.0) reads under a zero
    timeout, one more turn per round, so 6 there meant it was used."""
    return 4
