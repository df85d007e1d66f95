"""``with_segments`` and ``with_multi_lock``: the lock family's last two
decorators (issue 20), on real nodes, for functions, async functions and views.

They are ``with_lock`` with another lock kind behind it, so what is checked
here is what differs: which locks are held while the body runs (read on the
nodes and by a second manager that finds them busy), the object
``current_lock()`` and ``request.redlock`` give, the busy answers, and the
arguments refused at decoration time and at call time.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import RequestFactory

from django_redlock import LockNotAcquired, current_lock, with_multi_lock, with_segments
from django_redlock.testing import RedisNodes
from tests.polling import run_in_threads

MakeManager = Callable[..., Any]


def _held_on_nodes(nodes: RedisNodes, key: str) -> int:
    return sum(bool(server.client().exists(key)) for server in nodes)


# -- with_segments ---------------------------------------------------------------

def test_with_segments_holds_one_segment_while_the_body_runs(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    other = make_manager(nodes3)
    seen: list[tuple[str, int, int, int]] = []

    @with_segments("shelf:<sku>", 3, manager=mgr, timeout=0)
    def pick(sku: str) -> int:
        held = current_lock()
        index = int(held.index)
        key = mgr.key(f"shelf:{sku}[{index}]")
        seen.append((held.name, index, held.fence, _held_on_nodes(nodes3, key)))
        # Another process finds that segment busy, and the others free.
        assert other.lock(f"shelf:{sku}[{index}]").acquire(timeout=0) is False
        return index

    assert pick("A") in (0, 1, 2)
    name, index, fence, nodes_holding = seen[0]
    assert name == "shelf:A" and fence > 0 and nodes_holding == 3
    # Released after the body: the segment is free again.
    with other.lock(f"shelf:A[{index}]", timeout=0):
        pass


def test_with_segments_is_busy_when_every_segment_is_held(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)

    @with_segments("rack:<n>", 2, manager=mgr, timeout=0)
    def work(n: int) -> int:
        return int(current_lock().index)

    blockers = [mgr.lock(f"rack:1[{i}]") for i in range(2)]
    assert all(b.acquire(timeout=1) for b in blockers)
    try:
        with pytest.raises(LockNotAcquired):
            work(1)
        assert work(2) in (0, 1)  # another name, other segments
    finally:
        for b in blockers:
            b.release()
    assert work(1) in (0, 1)


def test_with_segments_async_and_view(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    from django.http import HttpResponse

    mgr = make_manager(nodes3)

    @with_segments("bin:<n>", 2, manager=mgr, timeout=0)
    async def awork(n: int) -> int:
        return int(current_lock().index)

    async def scenario() -> None:
        assert await awork(1) in (0, 1)
        async with mgr.asegments("bin:1", 2), mgr.asegments("bin:1", 2):
            with pytest.raises(LockNotAcquired):
                await awork(1)

    asyncio.run(scenario())

    @with_segments("item:<pk>", 1, manager=mgr, timeout=0)
    def view(request: Any, pk: int) -> Any:
        return HttpResponse(f"{request.redlock.name}#{request.redlock.index}")

    assert view(RequestFactory().post("/buy/5/"), pk=5).content == b"item:5#0"
    with mgr.lock("item:5[0]"):
        busy = view(RequestFactory().post("/buy/5/"), pk=5)
    assert busy.status_code == 423 and "Retry-After" in busy


@pytest.mark.parametrize("count", [0, -1, 1.5, "2", True, None])
def test_with_segments_refuses_a_bad_count_at_decoration(count: Any) -> None:
    with pytest.raises(ValueError, match="count"):
        with_segments("s:<x>", count)


# -- with_multi_lock -------------------------------------------------------------

def test_with_multi_lock_holds_every_name_while_the_body_runs(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    other = make_manager(nodes3)
    seen: dict[str, Any] = {}

    @with_multi_lock(["acct:<target>", "acct:<source>"], manager=mgr, timeout=0)
    def transfer(source: int, target: int) -> dict[str, int]:
        held = current_lock()
        seen["names"] = sorted(held.names)
        seen["on_nodes"] = [_held_on_nodes(nodes3, mgr.key(n)) for n in ("acct:1", "acct:2")]
        seen["busy"] = [other.lock(n).acquire(timeout=0) for n in ("acct:1", "acct:2")]
        return dict(held.fences)

    fences = transfer(1, 2)
    assert seen == {"names": ["acct:1", "acct:2"], "on_nodes": [3, 3], "busy": [False, False]}
    assert set(fences) == {"acct:1", "acct:2"} and min(fences.values()) > 0
    # Both released after the body.
    with other.multi_lock(["acct:1", "acct:2"], timeout=0):
        pass


def test_with_multi_lock_is_all_or_none(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """One name busy: the call is busy, and the name it could take is not left held."""
    mgr = make_manager(nodes3)
    ran: list[int] = []

    @with_multi_lock(["pair:<a>", "pair:<b>"], manager=mgr, timeout=0.2)
    def both(a: str, b: str) -> None:
        ran.append(1)

    with mgr.lock("pair:y"):
        with pytest.raises(LockNotAcquired):
            both("x", "y")
        assert _held_on_nodes(nodes3, mgr.key("pair:x")) == 0
    assert ran == []
    both("x", "y")
    assert ran == [1]


def test_with_multi_lock_in_opposite_orders_never_deadlocks_nor_overlaps(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Callers name the two accounts in opposite orders, with no timeout: all of
    them finish (no deadlock), and no two are ever inside at once (a
    read-sleep-write counter loses no update)."""
    mgr = make_manager(nodes3)
    state = {"balance": 0, "inside": 0, "most": 0}
    guard = threading.Lock()

    @with_multi_lock(["ledger:<a>", "ledger:<b>"], manager=mgr, timeout=None)
    def move(a: str, b: str) -> None:
        with guard:
            state["inside"] += 1
            state["most"] = max(state["most"], state["inside"])
        value = state["balance"]
        time.sleep(0.002)
        state["balance"] = value + 1
        with guard:
            state["inside"] -= 1

    rounds = 15
    calls = iter(range(10**6))

    def worker() -> None:
        first = next(calls) % 2 == 0
        for _ in range(rounds):
            move("p", "q") if first else move("q", "p")

    run_in_threads(worker, 4, timeout=60)
    assert state == {"balance": 4 * rounds, "inside": 0, "most": 1}


def test_with_multi_lock_async_and_view(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    from django.http import HttpResponse

    mgr = make_manager(nodes3)

    @with_multi_lock(["seat:<a>", "seat:<b>"], manager=mgr, timeout=0)
    async def abook(a: int, b: int) -> list[str]:
        return sorted(current_lock().fences)

    async def scenario() -> None:
        assert await abook(1, 2) == ["seat:1", "seat:2"]
        async with mgr.alock("seat:2"):
            with pytest.raises(LockNotAcquired):
                await abook(1, 2)

    asyncio.run(scenario())

    @with_multi_lock(["room:<pk>", "desk:<pk>"], manager=mgr, timeout=0)
    def view(request: Any, pk: int) -> Any:
        return HttpResponse(",".join(sorted(request.redlock.fences)))

    assert view(RequestFactory().post("/book/3/"), pk=3).content == b"desk:3,room:3"
    with mgr.lock("desk:3"):
        busy = view(RequestFactory().post("/book/3/"), pk=3)
    assert busy.status_code == 423 and "Retry-After" in busy


def test_with_multi_lock_bad_input(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    for bad in ("acct:<a>", [], None, 3):
        with pytest.raises(ValueError, match="with_multi_lock"):
            with_multi_lock(bad)  # type: ignore[arg-type]
    with pytest.raises(ImproperlyConfigured, match="acct:<b"):
        with_multi_lock(["acct:<a>", "acct:<b"])
    with pytest.raises(ValueError, match="timeout"):
        with_multi_lock(["acct:<a>"], timeout=-1)

    @with_multi_lock(["acct:<a>", "acct:<b>"], manager=mgr, timeout=0)
    def transfer(a: int, b: int) -> None:
        raise AssertionError("not reached")

    # Two templates that render one name in this call: multi_lock's own rule.
    with pytest.raises(ValueError, match="named twice"):
        transfer(1, 1)
    with pytest.raises(ImproperlyConfigured, match="<b>"):
        with_multi_lock(["acct:<a>", "acct:<b>"], manager=mgr)(lambda a: None)(1)
