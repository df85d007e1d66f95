"""A semaphore, a multi-lock or a set of segments entered (``with``, or
``__enter__()`` by hand) ends only the hold it entered, as a plain lock's
entry does (tests/test_hand_entry_hold.py).

Its exit released whatever the object held. Released by hand before its
exit, the object was free to be entered by another thread, and the late
exit released that thread's hold (review 8)::

    thread A   sem.__enter__(); sem.release()
    thread B   with sem: a permit, anew
    thread A   sem.__exit__(): released B's permit
    rival      acquires: two holders, B still inside

Each test drives that schedule on three real servers and checks, from B's
side, that B still holds, on every node, and that a rival is refused.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

import pytest

from django_redlock.testing import RedisNodes
from tests.holding import holders, run_threads

MakeManager = Callable[..., Any]


def _make(kind: str, mgr: Any, name: str, flavour: str = "sync") -> Any:
    prefix = "a" if flavour == "asyncio" else ""
    if kind == "semaphore":
        return getattr(mgr, prefix + "semaphore")(name, 1, ttl=5)
    if kind == "multi-lock":
        return getattr(mgr, prefix + "multi_lock")([name + ":x", name + ":y"], ttl=5)
    return getattr(mgr, prefix + "segments")(name, 1, ttl=5)


def _keys(kind: str, mgr: Any, name: str) -> list[str]:
    """The plain lock keys the object holds while held."""
    if kind == "multi-lock":
        return [mgr.key(name + ":x"), mgr.key(name + ":y")]
    obj = _make(kind, mgr, name)
    return [lock.key for lock in obj._locks][:1]


@pytest.mark.parametrize("a_how", ["by hand", "with"])
@pytest.mark.parametrize("kind", ["semaphore", "multi-lock", "segments"])
def test_an_entry_released_by_hand_leaves_another_threads_later_hold_alone(
        kind: str, a_how: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    name = f"composite-{kind}-{a_how.replace(' ', '-')}"
    obj = _make(kind, mgr, name)
    rival = _make(kind, make_manager(nodes3), name)
    seen: dict[str, Any] = {}
    a_released, b_in, a_left = threading.Event(), threading.Event(), threading.Event()

    def thread_a() -> None:
        if a_how == "with":
            with obj:
                obj.release()
                a_released.set()
                assert b_in.wait(10)
        else:
            obj.__enter__()
            obj.release()
            a_released.set()
            assert b_in.wait(10)
            obj.__exit__(None, None, None)
        seen["A left"] = "quiet"
        a_left.set()

    def thread_b() -> None:
        assert a_released.wait(10)
        with obj:
            b_in.set()
            assert a_left.wait(10)
            seen["B holds"] = obj._holding()
            seen["held on"] = [holders(nodes3, key) for key in _keys(kind, mgr, name)]
            seen["rival got in"] = rival.acquire(timeout=0)
            if seen["rival got in"]:
                rival.release()

    run_threads(thread_a, thread_b)
    keys = _keys(kind, mgr, name)
    assert seen == {"A left": "quiet", "B holds": True, "held on": [3] * len(keys),
                    "rival got in": False}
    assert [holders(nodes3, key) for key in keys] == [0] * len(keys)  # B's exit released


@pytest.mark.parametrize("kind", ["semaphore", "multi-lock", "segments"])
def test_an_async_entry_released_by_hand_leaves_another_tasks_later_hold_alone(
        kind: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    name = f"acomposite-{kind}"
    rival = _make(kind, make_manager(nodes3), name)
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        obj = _make(kind, mgr, name, "asyncio")
        a_released, b_in, a_left = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def task_a() -> None:
            await obj.__aenter__()
            await obj.release()
            a_released.set()
            await asyncio.wait_for(b_in.wait(), 10)
            await obj.__aexit__(None, None, None)
            a_left.set()

        async def task_b() -> None:
            await asyncio.wait_for(a_released.wait(), 10)
            async with obj:
                b_in.set()
                await asyncio.wait_for(a_left.wait(), 10)
                seen["B holds"] = obj._holding()
                seen["held on"] = [holders(nodes3, key) for key in _keys(kind, mgr, name)]
                seen["rival got in"] = rival.acquire(timeout=0)
                if seen["rival got in"]:
                    rival.release()

        await asyncio.gather(task_a(), task_b())

    asyncio.run(scenario())
    keys = _keys(kind, mgr, name)
    assert seen == {"B holds": True, "held on": [3] * len(keys), "rival got in": False}
    assert [holders(nodes3, key) for key in keys] == [0] * len(keys)


@pytest.mark.parametrize("kind", ["semaphore", "multi-lock", "segments"])
def test_a_with_block_still_releases_what_it_entered(
        kind: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """The plain case, entered and left in order, several times: each exit
    releases its own hold, and an exit with no entry (``__exit__`` called
    on an object entered by ``acquire()``) releases the current hold, as
    before."""
    mgr = make_manager(nodes3)
    name = f"composite-plain-{kind}"
    obj = _make(kind, mgr, name)
    keys = _keys(kind, mgr, name)
    for _ in range(3):
        with obj:
            assert [holders(nodes3, key) for key in keys] == [3] * len(keys)
        assert [holders(nodes3, key) for key in keys] == [0] * len(keys)
    assert obj.acquire()
    obj.__exit__(None, None, None)
    assert [holders(nodes3, key) for key in keys] == [0] * len(keys)


@pytest.mark.parametrize("window", ["_push_entry", "_take_entry"])
@pytest.mark.parametrize("kind", ["semaphore", "multi-lock", "segments"])
def test_a_release_by_another_thread_around_an_entry_leaves_a_third_threads_hold_alone(
        kind: str, window: str, nodes3: RedisNodes, make_manager: MakeManager,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Thread A's ``with obj:`` pauses between its grant and its record
    (``_push_entry``), or between its exit's choice and its release
    (``_take_entry``); meanwhile thread C releases A's hold by hand and
    thread D enters. A's entry recorded D's grant, or A's exit found the
    object held and released, and D's hold went under it (review 9). The
    entry records the number its grant returned, and a release checks that
    number with the held state, in one section."""
    mgr = make_manager(nodes3)
    name = f"composite-window-{kind}-{window}"
    obj = _make(kind, mgr, name)
    rival = _make(kind, make_manager(nodes3), name)
    paused, go, d_in, a_left = (threading.Event() for _ in range(4))
    real = getattr(obj, window)

    def pausing(*args: Any) -> Any:
        if threading.current_thread().name != "A":
            return real(*args)
        if window == "_push_entry":
            paused.set()
            assert go.wait(10)
            return real(*args)
        result = real(*args)
        paused.set()
        assert go.wait(10)
        return result

    monkeypatch.setattr(obj, window, pausing)
    seen: dict[str, Any] = {}

    def thread_a() -> None:
        with obj:
            pass
        a_left.set()

    def thread_d() -> None:
        with obj:
            d_in.set()
            assert a_left.wait(10)
            seen["D holds"] = obj._holding()
            seen["held on"] = [holders(nodes3, key) for key in _keys(kind, mgr, name)]
            seen["rival got in"] = rival.acquire(timeout=0)
            if seen["rival got in"]:
                rival.release()

    a = threading.Thread(target=thread_a, name="A")
    a.start()
    try:
        assert paused.wait(10)
        obj.release()  # thread C (this one): A's hold, by hand
        d = threading.Thread(target=thread_d, name="D")
        d.start()
        assert d_in.wait(10)
    finally:
        go.set()
    a.join(20)
    d.join(20)
    assert not a.is_alive() and not d.is_alive()
    keys = _keys(kind, mgr, name)
    assert seen == {"D holds": True, "held on": [3] * len(keys), "rival got in": False}
    assert [holders(nodes3, key) for key in keys] == [0] * len(keys)
