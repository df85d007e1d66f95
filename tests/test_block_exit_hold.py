"""A plain lock's ``with`` block ends only the hold it entered.

One lock object may be used by two blocks: a module-level ``LOCK`` entered
by two threads, or by a generator suspended inside ``with LOCK`` and the
code that goes on. Once the first block's lease ran out (``auto_renew``
off, or a renewal that failed), the object may be acquired again: a new
hold. The first block's exit then released that new hold, in the middle of
its holder's critical section, and a rival got in::

    thread A   with LOCK: hold 1 ... its lease runs out (lock_lost)
    thread B   with LOCK: hold 2 (the object acquires anew), writes
    thread A   leaves its block: release() ended hold 2
    rival      acquires: two holders, B still inside

The exit of a block whose hold is gone now leaves the newer hold alone and
raises ``LockLost`` (its own hold was lost), in both flavours. What stays:
``with L: L.release(); L.acquire()`` in one block, whose exit ends the
acquisition taken by hand.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from typing import Any, Callable

import pytest

from django_redlock import LockLost
from django_redlock.testing import RedisNodes

MakeManager = Callable[..., Any]

_TTL = 0.3  # auto_renew off: a lease that runs out within the test


def _holders(nodes: RedisNodes, key: str) -> int:
    return sum(bool(server.client().exists(key)) for server in nodes)


def test_a_block_in_another_thread_whose_lease_ran_out_leaves_the_new_hold_alone(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Two threads enter one module-level lock object; A's lease runs out,
    B enters (a new hold), A leaves first: B's hold is kept, A gets
    ``LockLost``, and no rival gets in while B is inside."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("block-threads", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("block-threads", ttl=5)
    a_inside, b_inside, a_left = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def thread_a() -> None:
        try:
            with lock:
                a_inside.set()
                assert b_inside.wait(5)
        except LockLost:
            seen["A"] = "LockLost"
        else:
            seen["A"] = "left quietly"
        finally:
            a_left.set()

    def thread_b() -> None:
        assert a_inside.wait(5)
        time.sleep(_TTL + 0.1)  # A's lease is out
        with lock:
            b_inside.set()
            assert a_left.wait(5)
            seen["B owned after A left"] = lock.owned()
            seen["held on after A left"] = _holders(nodes3, lock.key)
            seen["rival got in"] = rival.acquire(timeout=0)

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not any(thread.is_alive() for thread in threads)
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"A": "LockLost", "B owned after A left": True, "held on after A left": 3,
                    "rival got in": False}
    assert _holders(nodes3, lock.key) == 0  # B's exit released its own hold


def test_a_collected_generators_block_leaves_the_hold_taken_by_hand_after_its_lease(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """A generator suspended inside ``with LOCK`` is left in a reference
    cycle; its lease runs out and the code goes on with ``LOCK.acquire()``
    (a new hold); a collection then runs the generator's exit: the new hold
    is kept (it released it)."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("block-gen", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("block-gen", ttl=5)

    def rows() -> Any:
        with lock:
            yield 1

    gc.disable()
    try:
        gen = rows()
        next(gen)
        cycle: list[Any] = [gen]
        cycle.append(cycle)
        del gen, cycle
        time.sleep(_TTL + 0.05)
        assert lock.acquire(timeout=2)
        gc.collect()  # the generator's exit
    finally:
        gc.enable()
    try:
        assert lock.owned()
        assert _holders(nodes3, lock.key) == 3
        assert rival.acquire(timeout=0) is False
    finally:
        lock.release()


def test_a_block_that_released_and_acquired_by_hand_still_ends_that_acquisition(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """``with L: L.release(); L.acquire()``: the block's exit ends the
    acquisition taken by hand inside it, as before (nothing was lost)."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("block-by-hand", ttl=5)
    with lock:
        lock.release()
        assert lock.acquire()
    assert not lock.owned()
    assert _holders(nodes3, lock.key) == 0


def test_an_exit_stack_entered_lock_is_released_by_the_stack(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Entered by hand (``ExitStack.enter_context``): no block is recorded,
    the stack's exit releases it."""
    import contextlib

    lock = make_manager(nodes3).lock("block-stack", ttl=5)
    with contextlib.ExitStack() as stack:
        stack.enter_context(lock)
        assert _holders(nodes3, lock.key) == 3
    assert not lock.owned()
    assert _holders(nodes3, lock.key) == 0


def test_an_asyncio_block_whose_lease_ran_out_leaves_the_new_hold_alone(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """The asyncio flavour: two tasks enter one ``alock`` object; A's lease
    runs out, B enters, A leaves first: B's hold is kept, A gets
    ``LockLost``."""
    mgr = make_manager(nodes3)
    rival = make_manager(nodes3).lock("block-tasks", ttl=5)

    async def scenario() -> dict[str, Any]:
        lock = mgr.alock("block-tasks", ttl=_TTL, auto_renew=False)
        a_inside, b_inside, a_left = asyncio.Event(), asyncio.Event(), asyncio.Event()
        seen: dict[str, Any] = {}

        async def task_a() -> None:
            try:
                async with lock:
                    a_inside.set()
                    await b_inside.wait()
            except LockLost:
                seen["A"] = "LockLost"
            else:
                seen["A"] = "left quietly"
            finally:
                a_left.set()

        async def task_b() -> None:
            await a_inside.wait()
            await asyncio.sleep(_TTL + 0.1)
            async with lock:
                b_inside.set()
                await a_left.wait()
                seen["B owned after A left"] = lock.owned()
                seen["held on after A left"] = _holders(nodes3, lock.key)
                seen["rival got in"] = rival.acquire(timeout=0)
        await asyncio.gather(task_a(), task_b())
        seen["held on at the end"] = _holders(nodes3, lock.key)
        return seen

    seen = asyncio.run(asyncio.wait_for(scenario(), 20))
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"A": "LockLost", "B owned after A left": True, "held on after A left": 3,
                    "rival got in": False, "held on at the end": 0}


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_a_block_whose_own_hold_was_lost_still_raises_lock_lost(
        flavour: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Nothing acquired anew: the block's exit reports its own lost hold as
    before (``LockLost``), and the key is gone."""
    mgr = make_manager(nodes3)
    if flavour == "sync":
        lock = mgr.lock("block-own-lost", ttl=_TTL, auto_renew=False)
        with pytest.raises(LockLost):
            with lock:
                time.sleep(_TTL + 0.05)
    else:
        async def scenario() -> None:
            alock = mgr.alock("block-own-lost-a", ttl=_TTL, auto_renew=False)
            async with alock:
                await asyncio.sleep(_TTL + 0.05)
        with pytest.raises(LockLost):
            asyncio.run(asyncio.wait_for(scenario(), 10))
