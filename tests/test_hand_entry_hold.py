"""A plain lock entered by hand (``ExitStack.enter_context(L)``,
``AsyncExitStack.enter_async_context(L)``, ``L.__enter__()``) ends only the
hold it entered, as a ``with`` block does (tests/test_block_exit_hold.py).

Such an entry is made through a frame that returns at once, so the
statement's frame cannot tell its blocks apart; its exit ended whatever the
object held, and the two-holders timeline stayed open through it::

    thread A   stack.enter_context(LOCK): hold 1 ... its lease runs out
    thread B   with LOCK: hold 2 (the object acquires anew), writes
    thread A   stack.close(): ended hold 2
    rival      acquires: two holders, B still inside

Each entry by hand is now recorded for its entrant: the exit stack that
entered it, else the thread (the task) that called ``__enter__``
(``__aenter__``). Every test drives that schedule, or a neighbour of it, on
three real servers, with the lease run out for real (``auto_renew`` off).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from typing import Any, Callable, Iterator

import pytest

from django_redlock import LockLost
from django_redlock.testing import RedisNodes
from tests.holding import holders as _holders
from tests.holding import look_from_inside
from tests.holding import run_threads as _run_threads

MakeManager = Callable[..., Any]

_TTL = 0.3  # auto_renew off: a lease that runs out within the test


@contextlib.contextmanager
def _entered(lock: Any, how: str) -> Iterator[None]:
    """``lock`` entered and left the way ``how`` names."""
    if how == "with":
        with lock:
            yield
    elif how == "exit stack":
        with contextlib.ExitStack() as stack:
            stack.enter_context(lock)
            yield
    else:  # "by hand"
        lock.__enter__()
        try:
            yield
        finally:
            lock.__exit__(None, None, None)


@pytest.mark.parametrize("b_how", ["with", "exit stack", "by hand"])
@pytest.mark.parametrize("a_how", ["exit stack", "by hand"])
def test_an_entry_by_hand_whose_lease_ran_out_leaves_another_threads_new_hold_alone(
        a_how: str, b_how: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Thread A enters one module-level lock object by hand, its lease runs
    out, thread B enters it (a new hold), A's exit comes first: B's hold is
    kept on every node, A gets ``LockLost``, and no rival gets in while B
    is inside."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-threads", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("hand-threads", ttl=5)
    a_inside, b_inside, a_left = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def thread_a() -> None:
        try:
            with _entered(lock, a_how):
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
        with _entered(lock, b_how):
            lock.extend(5)  # a lease that outlasts the test's checks, under load too
            b_inside.set()
            assert a_left.wait(5)
            seen["B owned after A left"] = lock.owned()
            seen["held on after A left"] = _holders(nodes3, lock.key)
            seen["rival got in"] = rival.acquire(timeout=0)

    _run_threads(thread_a, thread_b)
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"A": "LockLost", "B owned after A left": True, "held on after A left": 3,
                    "rival got in": False}
    assert _holders(nodes3, lock.key) == 0  # B's exit released its own hold


@pytest.mark.parametrize("b_how", ["async with", "exit stack"])
@pytest.mark.parametrize("a_how", ["exit stack", "by hand"])
def test_an_async_entry_by_hand_whose_lease_ran_out_leaves_another_tasks_new_hold_alone(
        a_how: str, b_how: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """The asyncio flavour: task A enters one ``alock`` object by hand
    (``AsyncExitStack.enter_async_context``, ``await L.__aenter__()``), its
    lease runs out, task B enters: A's exit leaves B's hold alone and
    raises ``LockLost``."""
    mgr = make_manager(nodes3)
    rival = make_manager(nodes3).lock("hand-tasks", ttl=5)

    async def scenario() -> dict[str, Any]:
        lock = mgr.alock("hand-tasks", ttl=_TTL, auto_renew=False)
        a_inside, b_inside, a_left = asyncio.Event(), asyncio.Event(), asyncio.Event()
        seen: dict[str, Any] = {}

        async def task_a() -> None:
            try:
                if a_how == "exit stack":
                    async with contextlib.AsyncExitStack() as stack:
                        await stack.enter_async_context(lock)
                        a_inside.set()
                        await b_inside.wait()
                else:
                    await lock.__aenter__()
                    a_inside.set()
                    await b_inside.wait()
                    await lock.__aexit__(None, None, None)
            except LockLost:
                seen["A"] = "LockLost"
            else:
                seen["A"] = "left quietly"
            finally:
                a_left.set()

        async def task_b() -> None:
            await a_inside.wait()
            await asyncio.sleep(_TTL + 0.1)
            async with contextlib.AsyncExitStack() as stack:
                if b_how == "exit stack":
                    await stack.enter_async_context(lock)
                else:
                    await stack.enter_async_context(contextlib.nullcontext())
                    await lock.__aenter__()
                    stack.push_async_exit(lock)  # as the view decorator leaves it
                await lock.extend(5)  # a lease that outlasts the checks
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


def test_a_suspended_generators_exit_stack_leaves_its_threads_later_stack_alone(
        nodes3: RedisNodes, make_manager: MakeManager, caplog: pytest.LogCaptureFixture) -> None:
    """One thread, two exit stacks that do not nest: a generator suspended
    with ``L`` entered on its own stack, its lease runs out, the code goes
    on and enters ``L`` on a second stack; closing the generator ends only
    its own (lapsed) entry (its loss logged: the generator's body "raised"
    ``GeneratorExit``). Recorded for the thread alone, the generator's exit
    would have taken the second stack's entry for its own."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-generator", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("hand-generator", ttl=5)

    def worker() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(lock)
            yield

    gen = worker()
    next(gen)
    time.sleep(_TTL + 0.1)  # the generator's lease is out
    with contextlib.ExitStack() as second:
        second.enter_context(lock)
        lock.extend(5)
        with caplog.at_level(logging.WARNING, logger="django_redlock"):
            gen.close()
        assert "was lost while the body raised GeneratorExit" in caplog.text
        assert lock.owned()
        assert _holders(nodes3, lock.key) == 3
        assert rival.acquire(timeout=0) is False
    assert _holders(nodes3, lock.key) == 0


def test_an_exit_stack_closed_in_another_thread_releases_what_it_entered(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """A stack entered in one thread and closed in another (a worker hands
    its stack on): the record is the stack's, not the thread's, so the
    close releases the hold the stack entered, on every node."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-stack-thread", ttl=5)
    stack = contextlib.ExitStack()
    stack.enter_context(lock)
    assert _holders(nodes3, lock.key) == 3
    errors: list[BaseException] = []

    def closer() -> None:
        try:
            stack.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    _run_threads(closer)
    assert errors == []
    assert not lock.owned()
    assert _holders(nodes3, lock.key) == 0


@pytest.mark.parametrize("how", ["exit stack", "by hand"])
def test_an_entry_by_hand_leaves_a_hold_taken_by_acquire_inside_it_to_its_taker(
        how: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """``stack.enter_context(L)`` (``L.__enter__()``) in a
    ``@contextmanager`` helper, its lease runs out, then ``L.acquire()`` in
    the helper's caller: the entry's exit raises ``LockLost`` (its own hold
    lapsed) and leaves that hold, whole, to its taker, who releases it.
    (Taken for the entry's, as a ``with`` block's is, such a hold was ended
    under another job when a shared helper's frame stood where the entry
    was made: an entry by hand cannot prove the acquire ran inside it.)"""
    mgr = make_manager(nodes3)
    lock = mgr.lock(f"hand-retake-{how}", ttl=_TTL, auto_renew=False)
    with pytest.raises(LockLost):
        with _entered(lock, how):
            time.sleep(_TTL + 0.05)
            assert not lock.owned()
            assert lock.acquire(timeout=2)
            lock.extend(5)  # the exit must find it whole, under load too
    assert lock.owned()
    assert _holders(nodes3, lock.key) == 3
    lock.release()
    assert _holders(nodes3, lock.key) == 0


def _enter_in_helper(lock: Any) -> None:
    lock.__enter__()


def test_an_exit_by_hand_inside_a_with_block_leaves_its_hold_for_an_entry_made_elsewhere(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """A helper enters by hand and returns; its lease runs out; ``with L:``
    (a new hold); inside the body, ``L.__exit__()`` for the helper's entry:
    it raises ``LockLost`` and leaves the block's hold (it took the block's
    record, made in its frame, and ended the block's hold under its body)."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-helper-inside-with", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("hand-helper-inside-with", ttl=5)
    seen: dict[str, Any] = {}
    _enter_in_helper(lock)
    time.sleep(_TTL + 0.1)
    with lock:
        lock.extend(5)
        with pytest.raises(LockLost):
            lock.__exit__(None, None, None)
        seen["held on"] = _holders(nodes3, lock.key)
        seen["rival got in"] = rival.acquire(timeout=0)
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"held on": 3, "rival got in": False}
    assert _holders(nodes3, lock.key) == 0


def _call_acquire(lock: Any) -> bool:
    return bool(lock.acquire(timeout=2))


def test_a_hold_taken_through_a_shared_helper_is_not_a_lapsed_entrys(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """One thread: job 1 enters through a helper (``_call(L.__enter__)``),
    its lease runs out; job 2 acquires through a helper of the same shape at
    that frame's address; job 1's exit raises ``LockLost`` and leaves job 2's
    hold, which job 2 releases. (Adopted by job 1's entry, the hold was
    ended by job 1's exit under job 2.)"""
    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-adopt-helper", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("hand-adopt-helper", ttl=5)
    _call(lock.__enter__)
    time.sleep(_TTL + 0.1)
    assert _call(_call_acquire, lock)
    lock.extend(5)
    with pytest.raises(LockLost):
        lock.__exit__(None, None, None)
    assert lock.owned()
    assert _holders(nodes3, lock.key) == 3
    assert rival.acquire(timeout=0) is False
    lock.release()
    assert _holders(nodes3, lock.key) == 0


def test_an_entry_by_hand_released_by_hand_leaves_a_later_hold_quietly(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """``L.__enter__()``, ``L.release()`` by hand, then another thread
    enters ``L``: the first thread's ``__exit__`` has nothing left to end,
    raises nothing, and the other thread keeps its hold."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-released", ttl=5)
    lock.__enter__()
    lock.release()
    inside, leave = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def other() -> None:
        with lock:
            inside.set()
            assert leave.wait(5)
            seen["owned"] = lock.owned()

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert inside.wait(5)
        lock.__exit__(None, None, None)  # quiet: released by hand already
        assert _holders(nodes3, lock.key) == 3
    finally:
        leave.set()
        thread.join(20)
    assert seen == {"owned": True}
    assert _holders(nodes3, lock.key) == 0


def test_entries_by_hand_released_by_hand_keep_a_bounded_record(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """A loop of ``L.__enter__()`` and ``L.release()`` never exits its
    entries: the records kept for the thread stay bounded."""
    from django_redlock.engine.entries import HAND_ENTRIES_KEPT

    lock = make_manager(nodes3).lock("hand-bounded", ttl=5)
    for _ in range(HAND_ENTRIES_KEPT + 10):
        lock.__enter__()
        lock.release()
    assert lock._hand is not None
    assert sum(len(entries) for _, entries in lock._hand.values()) == HAND_ENTRIES_KEPT
    assert _holders(nodes3, lock.key) == 0


def test_a_sync_lock_entered_by_hand_in_two_tasks_of_one_loop_keeps_them_apart(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """A sync lock entered by hand inside coroutines: two tasks of one loop
    share its thread, so the entry is recorded for the task. Task A enters,
    its lease runs out, task B enters (a new hold), A leaves first: B's hold
    is kept, A gets ``LockLost``."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-sync-tasks", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("hand-sync-tasks", ttl=5)

    async def scenario() -> dict[str, Any]:
        a_inside, b_inside, a_left = asyncio.Event(), asyncio.Event(), asyncio.Event()
        seen: dict[str, Any] = {}

        async def task_a() -> None:
            lock.__enter__()
            a_inside.set()
            await b_inside.wait()
            try:
                lock.__exit__(None, None, None)
            except LockLost:
                seen["A"] = "LockLost"
            else:
                seen["A"] = "left quietly"
            a_left.set()

        async def task_b() -> None:
            await a_inside.wait()
            await asyncio.sleep(_TTL + 0.1)
            lock.__enter__()
            lock.extend(5)
            b_inside.set()
            await a_left.wait()
            seen["B owned after A left"] = lock.owned()
            seen["rival got in"] = rival.acquire(timeout=0)
            lock.__exit__(None, None, None)
        await asyncio.gather(task_a(), task_b())
        return seen

    seen = asyncio.run(asyncio.wait_for(scenario(), 20))
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"A": "LockLost", "B owned after A left": True, "rival got in": False}
    assert _holders(nodes3, lock.key) == 0


def test_an_entry_handed_on_by_pop_all_is_left_by_the_new_stack(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """``return stack.pop_all()`` hands an entered lock on to a new stack.
    Its entry's lease runs out, another thread enters (a new hold), then
    the new stack closes: it leaves that entry (``LockLost``), not the other
    thread's hold."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-pop-all", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("hand-pop-all", ttl=5)

    def entered() -> contextlib.ExitStack:
        with contextlib.ExitStack() as stack:
            stack.enter_context(lock)
            return stack.pop_all()

    handed = entered()
    time.sleep(_TTL + 0.1)  # its lease is out
    inside, leave = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def other() -> None:
        with lock:
            lock.extend(5)
            inside.set()
            assert leave.wait(5)
            seen["owned"] = lock.owned()

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert inside.wait(5)
        with pytest.raises(LockLost):
            handed.close()
        assert _holders(nodes3, lock.key) == 3
        assert rival.acquire(timeout=0) is False
    finally:
        leave.set()
        thread.join(20)
    assert seen == {"owned": True}
    assert _holders(nodes3, lock.key) == 0


class _Job:
    """Enters a module-level lock when it starts and leaves it when it
    stops: the frame that made the entry has returned by the exit."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock

    def start(self, by_hand: bool = False) -> None:
        if by_hand:
            assert self.lock.acquire(timeout=2)
        else:
            self.lock.__enter__()

    def stop(self) -> None:
        self.lock.__exit__(None, None, None)


def _job_round(lock: Any, rival: Any, nodes: RedisNodes, b_by_hand: bool) -> dict[str, Any]:
    """One round of the test below: thread A's job enters and waits, thread
    B's job takes the lock once A's lease ran out, A's job stops."""
    a_in, b_in, a_left = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def thread_a() -> None:
        job = _Job(lock)
        job.start()
        a_in.set()
        assert b_in.wait(5)
        try:
            job.stop()
        except LockLost:
            seen["A"] = "LockLost"
        else:
            seen["A"] = "left quietly"
        a_left.set()

    def thread_b() -> None:
        assert a_in.wait(5)
        time.sleep(_TTL + 0.1)
        job = _Job(lock)
        job.start(by_hand=b_by_hand)
        lock.extend(5)
        b_in.set()
        assert a_left.wait(5)
        seen["B owned"] = lock.owned()
        seen["held on"] = _holders(nodes, lock.key)
        seen["rival got in"] = rival.acquire(timeout=0)
        lock.release()

    _run_threads(thread_a, thread_b)
    return seen


@pytest.mark.parametrize("b_takes", ["an entry", "acquire()"])
def test_an_entry_whose_frame_returned_takes_no_other_threads_hold_at_that_address(
        b_takes: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Thread A's ``job.start()`` enters by hand and returns; its lease runs
    out; thread B's ``start()`` (the same code, very often at the address of
    A's frame, which is gone) takes the lock, by an entry or by
    ``acquire()``; A's ``stop()`` leaves: ``LockLost``, and B's hold is
    kept. Taken by A's record for one made inside A's entry, B's hold was
    ended (two holders). Five rounds, a fresh name each."""
    mgr = make_manager(nodes3)
    rival_mgr = make_manager(nodes3)
    for i in range(5):
        name = f"hand-job-{i}"
        seen = _job_round(mgr.lock(name, ttl=_TTL, auto_renew=False),
                          rival_mgr.lock(name, ttl=5), nodes3, b_takes == "acquire()")
        assert seen == {"A": "LockLost", "B owned": True, "held on": 3,
                        "rival got in": False}, i


def test_an_entry_on_a_second_stack_is_that_stacks_not_the_firsts(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """In one frame: ``s1.enter_context(L)``, its lease runs out,
    ``s2.enter_context(L)``; closing ``s1`` raises ``LockLost`` and leaves
    ``s2``'s hold (the second entry was adopted by the first as if taken by
    hand inside it, and ended)."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-two-stacks", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("hand-two-stacks", ttl=5)
    first, second = contextlib.ExitStack(), contextlib.ExitStack()
    first.enter_context(lock)
    time.sleep(_TTL + 0.1)
    second.enter_context(lock)
    lock.extend(5)
    with pytest.raises(LockLost):
        first.close()
    assert lock.owned()
    assert _holders(nodes3, lock.key) == 3
    assert rival.acquire(timeout=0) is False
    second.close()
    assert _holders(nodes3, lock.key) == 0


def test_two_generators_entering_by_hand_in_one_thread_each_leave_their_own(
        nodes3: RedisNodes, make_manager: MakeManager,
        caplog: pytest.LogCaptureFixture) -> None:
    """One thread, two generators that each call ``L.__enter__()`` and, in
    their ``finally``, ``L.__exit__()``: the first's lease runs out, the
    second enters, the first is closed first. Its exit leaves its own entry
    (the loss logged), not the thread's innermost one, the second's."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-generators", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("hand-generators", ttl=5)

    def worker() -> Iterator[None]:
        lock.__enter__()
        try:
            yield
        finally:
            lock.__exit__(None, None, None)

    first = worker()
    next(first)
    time.sleep(_TTL + 0.1)
    second = worker()
    next(second)
    lock.extend(5)
    with pytest.raises(LockLost):
        first.close()  # its __exit__ runs with no exception: LockLost goes out
    assert lock.owned()
    assert _holders(nodes3, lock.key) == 3
    assert rival.acquire(timeout=0) is False
    second.close()
    assert _holders(nodes3, lock.key) == 0


@pytest.mark.parametrize("how", ["wait_for", "shield"])
def test_an_async_entry_made_through_a_task_of_its_own_is_the_awaiting_tasks(
        how: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """``await asyncio.wait_for(L.__aenter__(), 5)`` (a task of its own
    before 3.12) or ``asyncio.shield``: the entry is the awaiting task's.
    Recorded for the inner task, which ends at once, it was taken by
    another task's exit for its own: that exit ended a newer hold."""
    mgr = make_manager(nodes3)
    rival = make_manager(nodes3).lock(f"hand-task-{how}", ttl=5)

    async def scenario() -> dict[str, Any]:
        lock = mgr.alock(f"hand-task-{how}", ttl=_TTL, auto_renew=False)
        a_in, b_in, a_left = asyncio.Event(), asyncio.Event(), asyncio.Event()
        seen: dict[str, Any] = {}

        async def task_a() -> None:
            if how == "wait_for":
                await asyncio.wait_for(lock.__aenter__(), 5)
            else:
                await asyncio.shield(lock.__aenter__())
            a_in.set()
            await b_in.wait()
            try:
                await lock.__aexit__(None, None, None)
            except LockLost:
                seen["A"] = "LockLost"
            else:
                seen["A"] = "left quietly"
            a_left.set()

        async def task_b() -> None:
            await a_in.wait()
            await asyncio.sleep(_TTL + 0.1)
            await lock.__aenter__()  # by hand too: each task's own record
            await lock.extend(5)
            b_in.set()
            await a_left.wait()
            seen["B owned"] = lock.owned()
            seen["held on"] = _holders(nodes3, lock.key)
            seen["rival got in"] = rival.acquire(timeout=0)
            await lock.__aexit__(None, None, None)
        await asyncio.gather(task_a(), task_b())
        seen["held on at the end"] = _holders(nodes3, lock.key)
        return seen

    seen = asyncio.run(asyncio.wait_for(scenario(), 20))
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"A": "LockLost", "B owned": True, "held on": 3, "rival got in": False,
                    "held on at the end": 0}


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_an_exit_by_hand_inside_a_with_of_the_same_frame_leaves_the_with_blocks_hold(
        flavour: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """In one frame: ``L.__enter__()``, its lease runs out, ``with L:`` (a
    new hold), and inside the body ``L.__exit__()`` for the entry by hand:
    that exit raises ``LockLost`` and leaves the block's hold (it took the
    block's record, whose frame it runs in, and ended the block's hold);
    the block's exit then ends its own."""
    mgr = make_manager(nodes3)
    name = f"hand-inside-with-{flavour}"
    rival = make_manager(nodes3).lock(name, ttl=5)
    seen: dict[str, Any] = {}
    if flavour == "sync":
        lock = mgr.lock(name, ttl=_TTL, auto_renew=False)
        lock.__enter__()
        time.sleep(_TTL + 0.1)
        with lock:
            lock.extend(5)
            with pytest.raises(LockLost):
                lock.__exit__(None, None, None)
            seen["owned"] = lock.owned()
            seen["held on"] = _holders(nodes3, lock.key)
            seen["rival got in"] = rival.acquire(timeout=0)
    else:
        async def scenario() -> None:
            alock = mgr.alock(name, ttl=_TTL, auto_renew=False)
            await alock.__aenter__()
            await asyncio.sleep(_TTL + 0.1)
            async with alock:
                await alock.extend(5)
                with pytest.raises(LockLost):
                    await alock.__aexit__(None, None, None)
                seen["owned"] = alock.owned()
                seen["held on"] = _holders(nodes3, alock.key)
                seen["rival got in"] = rival.acquire(timeout=0)
        asyncio.run(asyncio.wait_for(scenario(), 20))
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"owned": True, "held on": 3, "rival got in": False}
    assert _holders(nodes3, mgr.key(name)) == 0


@pytest.mark.parametrize("collector", ["a third thread", "the new holder's thread"])
def test_a_generator_that_entered_by_hand_collected_in_another_thread_leaves_the_new_hold(
        collector: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Thread A's generator enters by hand (``L.__enter__()``, ``L.__exit__()``
    in its ``finally``) and is dropped in a reference cycle; its lease runs
    out; thread B enters (a new hold); a garbage collection in another
    thread runs the generator's exit, in a thread that made no entry: it
    ends the generator's own entry (lapsed: ``LockLost``), not B's hold."""
    import gc

    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-gc-thread", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("hand-gc-thread", ttl=5)
    seen: dict[str, Any] = {}
    a_in, b_in, collected = threading.Event(), threading.Event(), threading.Event()

    def worker() -> Iterator[int]:
        lock.__enter__()
        try:
            yield 1
        finally:
            try:
                lock.__exit__(None, None, None)
                seen["generator's exit"] = "quiet"
            except LockLost:
                seen["generator's exit"] = "LockLost"

    def thread_a() -> None:
        gen = worker()
        next(gen)
        cycle: list[Any] = [gen]
        cycle.append(cycle)  # reachable from nowhere but itself
        del gen, cycle
        a_in.set()

    def thread_b() -> None:
        assert a_in.wait(5)
        time.sleep(_TTL + 0.1)
        with lock:
            lock.extend(5)
            b_in.set()
            if collector == "the new holder's thread":
                gc.collect()
                collected.set()
            assert collected.wait(5)
            seen["B owned"] = lock.owned()
            seen["held on"] = _holders(nodes3, lock.key)
            seen["rival got in"] = rival.acquire(timeout=0)

    def thread_c() -> None:
        assert b_in.wait(5)
        if collector == "a third thread":
            gc.collect()
            collected.set()

    gc.disable()
    try:
        _run_threads(thread_a, thread_b, thread_c)
    finally:
        gc.enable()
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"generator's exit": "LockLost", "B owned": True, "held on": 3,
                    "rival got in": False}
    assert _holders(nodes3, lock.key) == 0


@pytest.mark.parametrize("how", ["gather", "create_task", "shield a worker"])
def test_an_async_entry_by_a_child_task_left_by_another_task_leaves_the_new_hold(
        how: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """An entry by hand made in one task and left from another that made
    none: ``gather(L.__aenter__(), ...)`` or ``create_task(L.__aenter__())``
    left by the parent; or a worker task, running code of its own, that
    entered before the main task awaits it through ``shield`` and leaves
    while awaited (its exit is its own, not the awaiting task's). The entry's lease runs out,
    task B enters (a new hold), then the exit: ``LockLost``, B's hold kept."""
    mgr = make_manager(nodes3)
    rival = make_manager(nodes3).lock(f"hand-child-{how}", ttl=5)

    async def scenario() -> dict[str, Any]:
        lock = mgr.alock(f"hand-child-{how}", ttl=_TTL, auto_renew=False)
        p_in, b_in, p_left = asyncio.Event(), asyncio.Event(), asyncio.Event()
        seen: dict[str, Any] = {}

        async def leave() -> None:
            try:
                await lock.__aexit__(None, None, None)
            except LockLost:
                seen["first exit"] = "LockLost"
            else:
                seen["first exit"] = "quiet"
            p_left.set()

        async def worker() -> None:
            await lock.__aenter__()
            p_in.set()
            await b_in.wait()
            await leave()

        async def first() -> None:
            if how == "shield a worker":
                task = asyncio.ensure_future(worker())
                await p_in.wait()  # entered (for itself) before anyone awaits it
                await asyncio.shield(task)
                return
            if how == "gather":
                await asyncio.gather(lock.__aenter__(), asyncio.sleep(0.01))
            else:
                await asyncio.create_task(lock.__aenter__())
            p_in.set()
            await b_in.wait()
            await leave()

        async def task_b() -> None:
            await p_in.wait()
            await asyncio.sleep(_TTL + 0.1)
            async with lock:
                await lock.extend(5)
                b_in.set()
                await p_left.wait()
                seen["B owned"] = lock.owned()
                seen["held on"] = _holders(nodes3, lock.key)
                seen["rival got in"] = rival.acquire(timeout=0)
        await asyncio.gather(first(), task_b())
        seen["held on at the end"] = _holders(nodes3, lock.key)
        return seen

    seen = asyncio.run(asyncio.wait_for(scenario(), 20))
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"first exit": "LockLost", "B owned": True, "held on": 3,
                    "rival got in": False, "held on at the end": 0}


def test_an_exit_from_a_thread_that_made_no_entry_takes_a_lapsed_entry_before_a_live_one(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Thread A enters by hand and its lease runs out; thread B enters by
    hand (a new hold); thread C, which made no entry, calls ``__exit__``.
    C's exit cannot tell whose it is: it takes A's lapsed entry
    (``LockLost``, nothing ended) before B's live one, so B's hold stays,
    whole, until the next exit (A's) ends it. Taking B's (the live entry,
    for an exit meant for it) would end it under B when the exit was A's
    (a pool worker leaving A's entry: two holders)."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-third-thread", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("hand-third-thread", ttl=5)
    seen: dict[str, Any] = {}
    a_in, b_in, c_done = threading.Event(), threading.Event(), threading.Event()

    def thread_a() -> None:
        lock.__enter__()
        a_in.set()
        assert c_done.wait(10)
        try:
            lock.__exit__(None, None, None)
            seen["A's exit"] = "quiet"
        except LockLost:
            seen["A's exit"] = "LockLost"
        seen["held on after A"] = _holders(nodes3, lock.key)

    def thread_b() -> None:
        assert a_in.wait(5)
        time.sleep(_TTL + 0.1)
        lock.__enter__()
        lock.extend(5)
        b_in.set()

    def thread_c() -> None:
        assert b_in.wait(5)
        try:
            lock.__exit__(None, None, None)
            seen["C's exit"] = "quiet"
        except LockLost:
            seen["C's exit"] = "LockLost"
        seen["held on after C"] = _holders(nodes3, lock.key)
        seen["rival got in after C"] = rival.acquire(timeout=0)
        c_done.set()

    _run_threads(thread_a, thread_b, thread_c)
    if seen.get("rival got in after C"):
        rival.release()
    assert seen == {"C's exit": "LockLost", "held on after C": 3, "rival got in after C": False,
                    "A's exit": "quiet", "held on after A": 0}
    assert not lock.owned()


def _call(function: Callable[..., Any], *args: Any) -> Any:
    """A helper every thread calls through (an executor's work item, a
    dispatcher): its frames, one per call, reuse one address."""
    return function(*args)


def test_an_exit_through_a_shared_helper_takes_no_other_threads_entry(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Thread A enters by hand, its lease runs out; thread B enters through
    ``_call(lock.__enter__)`` (the helper's frame returns, B stays inside);
    A leaves through ``_call(lock.__exit__, ...)``: its exit frame stands
    where B's entering frame stood, with the same code, but it is A's:
    ``LockLost``, and B's hold kept. Three rounds."""
    mgr = make_manager(nodes3)
    rival_mgr = make_manager(nodes3)
    for i in range(3):
        seen = _shared_helper_round(mgr.lock(f"hand-helper-{i}", ttl=_TTL, auto_renew=False),
                                    rival_mgr.lock(f"hand-helper-{i}", ttl=5), nodes3)
        assert seen == {"A's exit": "LockLost", "B owned": True, "held on": 3,
                        "rival got in": False, "held on at the end": 0}, i


def _shared_helper_round(lock: Any, rival: Any, nodes: RedisNodes) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    a_in, b_in, a_left = threading.Event(), threading.Event(), threading.Event()

    def thread_a() -> None:
        lock.__enter__()
        a_in.set()
        assert b_in.wait(5)
        try:
            _call(lock.__exit__, None, None, None)
            seen["A's exit"] = "quiet"
        except LockLost:
            seen["A's exit"] = "LockLost"
        a_left.set()

    def thread_b() -> None:
        assert a_in.wait(5)
        time.sleep(_TTL + 0.1)
        _call(lock.__enter__)
        lock.extend(5)
        b_in.set()
        assert a_left.wait(5)
        seen["B owned"] = lock.owned()
        seen["held on"] = _holders(nodes, lock.key)
        seen["rival got in"] = rival.acquire(timeout=0)
        lock.__exit__(None, None, None)
        seen["held on at the end"] = _holders(nodes, lock.key)

    _run_threads(thread_a, thread_b)
    return seen


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_two_jobs_of_one_thread_stopped_out_of_order_end_their_own(
        flavour: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """One thread (one task): job A's ``start()`` enters by hand and its lease
    runs out, job B's ``start()`` enters (a new hold), then A's ``stop()``
    leaves from a frame that made no entry. It takes A's lapsed entry
    (``LockLost``), not the thread's innermost, B's: B's hold kept, then
    ended by B's ``stop()``."""
    mgr = make_manager(nodes3)
    name = f"hand-jobs-{flavour}"
    rival = make_manager(nodes3).lock(name, ttl=5)
    seen: dict[str, Any] = {}
    if flavour == "sync":
        lock = mgr.lock(name, ttl=_TTL, auto_renew=False)
        job_a, job_b = _Job(lock), _Job(lock)
        job_a.start()
        time.sleep(_TTL + 0.1)
        job_b.start()
        lock.extend(5)
        with pytest.raises(LockLost):
            job_a.stop()
        seen["held on"] = _holders(nodes3, lock.key)
        seen["rival got in"] = rival.acquire(timeout=0)
        job_b.stop()
    else:
        async def scenario() -> None:
            alock = mgr.alock(name, ttl=_TTL, auto_renew=False)

            async def start() -> None:
                await alock.__aenter__()

            async def stop() -> None:
                await alock.__aexit__(None, None, None)

            await start()
            await asyncio.sleep(_TTL + 0.1)
            await start()
            await alock.extend(5)
            with pytest.raises(LockLost):
                await stop()
            seen["held on"] = _holders(nodes3, alock.key)
            seen["rival got in"] = rival.acquire(timeout=0)
            await stop()
        asyncio.run(asyncio.wait_for(scenario(), 20))
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"held on": 3, "rival got in": False}
    assert _holders(nodes3, mgr.key(name)) == 0


def test_an_entry_left_from_another_pool_worker_leaves_a_hold_taken_since(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """A thread pool: ``start()`` enters by hand on one worker, its lease
    runs out, thread B enters by hand (a new hold), and ``stop()`` runs on
    the other worker, which made no entry: it takes the lapsed entry
    (``LockLost``), and B's hold is kept until B leaves."""
    from concurrent.futures import ThreadPoolExecutor

    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-pool", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("hand-pool", ttl=5)
    seen: dict[str, Any] = {}
    release_worker, b_in, b_leave = threading.Event(), threading.Event(), threading.Event()

    def start() -> int:
        lock.__enter__()
        return threading.get_ident()

    def stop() -> str:
        seen["stopped on another worker"] = threading.get_ident() != first
        try:
            lock.__exit__(None, None, None)
        except LockLost:
            return "LockLost"
        return "quiet"

    first_busy = threading.Event()

    def occupy() -> None:
        if threading.get_ident() == first:
            first_busy.set()
            assert release_worker.wait(10)

    def thread_b() -> None:
        time.sleep(_TTL + 0.1)
        lock.__enter__()
        lock.extend(5)
        b_in.set()
        assert b_leave.wait(10)
        lock.__exit__(None, None, None)

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(start).result(5)
        other = threading.Thread(target=thread_b)
        other.start()
        try:
            assert b_in.wait(5)
            occupied = []
            for _ in range(50):  # until one lands on `first` and holds it (bounded)
                occupied.append(pool.submit(occupy))
                if first_busy.wait(0.1):
                    break
            assert first_busy.is_set()
            seen["stop"] = pool.submit(stop).result(5)
            seen["held on"] = _holders(nodes3, lock.key)
            seen["rival got in"] = rival.acquire(timeout=0)
        finally:
            release_worker.set()
            b_leave.set()
            other.join(10)
        for future in occupied:
            future.result(5)
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"stopped on another worker": True, "stop": "LockLost", "held on": 3,
                    "rival got in": False}
    assert _holders(nodes3, lock.key) == 0


def test_more_lapsed_entries_of_one_thread_than_kept_whole_each_leave_their_own(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """One thread enters by hand more times than its entries are kept whole
    (each lease runs out, none released), then another thread enters (a new
    hold) and the first leaves them all: every exit raises ``LockLost``,
    and the other thread's hold is kept (the oldest entry, dropped past the
    bound, let one exit take that hold)."""
    from django_redlock.engine.entries import HAND_ENTRIES_KEPT

    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-many-lapsed", ttl=0.05, auto_renew=False)
    rival = make_manager(nodes3).lock("hand-many-lapsed", ttl=5)
    count = HAND_ENTRIES_KEPT + 1
    for _ in range(count):
        lock.__enter__()
        time.sleep(0.08)  # its lease runs out
    inside, leave = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def other() -> None:
        lock.__enter__()
        lock.extend(5)
        inside.set()
        assert leave.wait(10)
        lock.__exit__(None, None, None)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert inside.wait(5)
        outcomes = []
        for _ in range(count):
            try:
                lock.__exit__(None, None, None)
                outcomes.append("quiet")
            except LockLost:
                outcomes.append("LockLost")
        seen["exits"] = outcomes
        seen["held on"] = _holders(nodes3, lock.key)
        seen["rival got in"] = rival.acquire(timeout=0)
    finally:
        leave.set()
        thread.join(10)
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"exits": ["LockLost"] * count, "held on": 3, "rival got in": False}


async def _acall(method: Callable[..., Any], *args: Any) -> Any:
    """A coroutine helper every task awaits through: its frames, one per
    call, reuse one address once returned."""
    return await method(*args)


def test_an_async_exit_through_a_shared_helper_takes_no_other_tasks_entry(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Task X enters by hand and its lease runs out; task Y enters through
    ``await _acall(L.__aenter__)`` (the helper's coroutine returns); X
    leaves through ``await _acall(L.__aexit__, ...)``: a frame of the same
    code at the address where Y's entering frame stood, but not it:
    ``LockLost``, Y's hold kept. Three rounds."""
    mgr = make_manager(nodes3)
    rival_mgr = make_manager(nodes3)

    async def one_round(i: int) -> dict[str, Any]:
        lock = mgr.alock(f"hand-ahelper-{i}", ttl=_TTL, auto_renew=False)
        rival = rival_mgr.lock(f"hand-ahelper-{i}", ttl=5)
        seen: dict[str, Any] = {}
        x_in, y_in, x_done = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def task_x() -> None:
            await lock.__aenter__()
            x_in.set()
            await y_in.wait()
            try:
                await _acall(lock.__aexit__, None, None, None)
                seen["X's exit"] = "quiet"
            except LockLost:
                seen["X's exit"] = "LockLost"
            seen["held on"] = _holders(nodes3, lock.key)
            seen["rival got in"] = rival.acquire(timeout=0)
            if seen["rival got in"]:
                rival.release()
            x_done.set()

        async def task_y() -> None:
            await x_in.wait()
            await asyncio.sleep(_TTL + 0.1)
            await _acall(lock.__aenter__)
            await lock.extend(5)
            y_in.set()
            await x_done.wait()
            await lock.__aexit__(None, None, None)
        await asyncio.gather(task_x(), task_y())
        seen["held on at the end"] = _holders(nodes3, lock.key)
        return seen

    async def rounds() -> list[dict[str, Any]]:
        return [await one_round(i) for i in range(3)]

    for seen in asyncio.run(asyncio.wait_for(rounds(), 30)):
        assert seen == {"X's exit": "LockLost", "held on": 3, "rival got in": False,
                        "held on at the end": 0}


def test_a_dispatcher_leaving_another_jobs_lapsed_entry_keeps_the_live_one(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """One dispatcher thread runs every queued call in one loop frame: job
    A's ``__enter__`` (its lease runs out), job B's ``__enter__`` (a new
    hold), then job A's ``__exit__``. Both entries were made in that frame
    and by that thread, so nothing tells them apart: the exit takes the
    lapsed one (``LockLost``), and B's hold is kept until B's exit."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-dispatcher", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("hand-dispatcher", ttl=5)
    seen: dict[str, Any] = {}

    def a_stopped() -> None:
        seen["held on"] = _holders(nodes3, lock.key)
        seen["rival got in"] = rival.acquire(timeout=0)

    calls: list[Callable[[], Any]] = [
        lock.__enter__,
        lambda: time.sleep(_TTL + 0.1),
        lock.__enter__,
        lambda: lock.extend(5),
        functools.partial(lock.__exit__, None, None, None),  # job A's stop
        a_stopped,
        functools.partial(lock.__exit__, None, None, None),  # job B's stop
    ]
    outcomes = []
    for call in calls:  # the dispatcher's one frame makes every call
        try:
            call()
            outcomes.append("ok")
        except LockLost:
            outcomes.append("LockLost")
    if seen.get("rival got in"):
        rival.release()
    assert outcomes[4] == "LockLost", outcomes
    assert seen == {"held on": 3, "rival got in": False}
    assert outcomes[6] == "ok"
    assert _holders(nodes3, lock.key) == 0


def test_an_exit_on_a_worker_with_a_live_entry_of_its_own_takes_the_lapsed_one(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Job A enters on one worker (its lease runs out), job B enters on a
    second worker (a new hold), and job A's stop lands on the second
    worker, whose only entry is B's live one: the exit takes A's lapsed
    entry (``LockLost``), and B's hold is kept."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-worker-live", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("hand-worker-live", ttl=5)
    seen: dict[str, Any] = {}
    a_in, b_in, a_stop, a_stopped = (threading.Event(), threading.Event(), threading.Event(),
                                     threading.Event())

    def worker_1() -> None:
        lock.__enter__()  # job A
        a_in.set()

    def worker_2() -> None:
        assert a_in.wait(5)
        time.sleep(_TTL + 0.1)
        lock.__enter__()  # job B
        lock.extend(5)
        b_in.set()
        assert a_stop.wait(5)
        try:
            lock.__exit__(None, None, None)  # job A's stop, run here
            seen["A's stop"] = "quiet"
        except LockLost:
            seen["A's stop"] = "LockLost"
        a_stopped.set()

    def check() -> None:
        assert b_in.wait(5)
        a_stop.set()
        assert a_stopped.wait(5)
        seen["held on"] = _holders(nodes3, lock.key)
        seen["rival got in"] = rival.acquire(timeout=0)

    _run_threads(worker_1, worker_2, check)
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"A's stop": "LockLost", "held on": 3, "rival got in": False}
    lock.__exit__(None, None, None)  # job B's stop
    assert _holders(nodes3, lock.key) == 0


@pytest.mark.parametrize("how", ["__del__", "a generator's finally"])
def test_an_entry_by_hand_keeps_nothing_alive_that_would_make_its_exit(
        how: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """An object entering by hand whose exit runs when it is collected
    (``__del__``, or its generator's ``finally``) is collected, and its exit
    runs: the record keeps no frame (a frame kept its locals, the object
    among them, for as long as the lock lived: the exit never ran, and the
    hold was renewed for good)."""
    import gc
    import weakref

    mgr = make_manager(nodes3)
    lock = mgr.lock(f"hand-kept-{how}", ttl=2)  # auto_renew on: a leak never ends
    exits: list[str] = []

    class Job:
        def __init__(self) -> None:
            self.lock = lock
            if how == "__del__":
                lock.__enter__()
            else:
                self.rows = self._rows()
                next(self.rows)

        def _rows(self) -> Iterator[None]:
            self.lock.__enter__()
            try:
                yield
            finally:
                self.lock.__exit__(None, None, None)
                exits.append("exited")

        def __del__(self) -> None:
            if how == "__del__":
                self.lock.__exit__(None, None, None)
                exits.append("exited")

    job = Job()
    alive = weakref.ref(job)
    del job
    for _ in range(3):
        gc.collect()
    assert alive() is None
    assert exits == ["exited"]
    assert not lock.owned()
    assert _holders(nodes3, lock.key) == 0


def test_an_entry_of_a_finished_task_stays_open_when_a_new_task_takes_its_address(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """A sync lock entered by hand in a child task that ends (its lease then
    runs out); later child tasks run until one lands at the ended task's
    address and enters (a new hold); the parent leaves the first entry:
    ``LockLost``, and the new hold is kept. The new entrant's record
    replaced the ended one's, whose entry was lost: the parent's exit took
    the new one and ended it under its holder. Up to 25 rounds of 60 tasks
    to meet the reuse (it comes in the first, on every version seen)."""
    mgr = make_manager(nodes3)
    rival_mgr = make_manager(nodes3)

    async def scenario() -> dict[str, Any]:
        seen: dict[str, Any] = {"reused": False}
        for trial in range(25):
            lock = mgr.lock(f"hand-task-address-{trial}", ttl=_TTL, auto_renew=False)

            async def start_a(lock: Any = lock) -> int:
                lock.__enter__()
                return id(asyncio.current_task())

            first = await asyncio.create_task(start_a())
            await asyncio.sleep(_TTL + 0.1)

            async def request(lock: Any = lock, first: int = first) -> None:
                if id(asyncio.current_task()) == first:
                    lock.__enter__()  # job B's start, at the ended task's address

            for _ in range(60):
                await asyncio.create_task(request())
                if lock.owned():
                    break
            if not lock.owned():
                continue
            seen["reused"] = True
            lock.extend(5)
            try:
                lock.__exit__(None, None, None)  # job A's stop, by the parent
                seen["A's stop"] = "quiet"
            except LockLost:
                seen["A's stop"] = "LockLost"
            seen["held on"] = _holders(nodes3, lock.key)
            rival = rival_mgr.lock(f"hand-task-address-{trial}", ttl=5)
            seen["rival got in"] = rival.acquire(timeout=0)
            if seen["rival got in"]:
                rival.release()
            lock.release()
            break
        return seen

    seen = asyncio.run(asyncio.wait_for(scenario(), 60))
    if not seen["reused"]:
        pytest.skip("no task landed at the ended task's address in 25 x 60 tries")
    assert seen == {"reused": True, "A's stop": "LockLost", "held on": 3, "rival got in": False}


def test_an_exit_by_hand_inside_its_own_with_block_leaves_the_blocks_record(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Thread A, inside ``with L:`` whose lease ran out, calls
    ``L.__exit__()`` by hand (no entry by hand open anywhere) while thread B
    holds anew: that call raises ``LockLost`` and takes nothing, so the
    statement's own exit still finds its record (``LockLost``) and leaves
    B's hold. (Taken by the call, the record was missing at the statement's
    exit, which then ended B's hold.)"""
    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-exit-own-with", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("hand-exit-own-with", ttl=5)
    seen: dict[str, Any] = {}
    a_in, b_in, a_left = threading.Event(), threading.Event(), threading.Event()

    def thread_a() -> None:
        try:
            with lock:
                a_in.set()
                assert b_in.wait(5)
                try:
                    lock.__exit__(None, None, None)
                    seen["A's call"] = "quiet"
                except LockLost:
                    seen["A's call"] = "LockLost"
        except LockLost:
            seen["A's with"] = "LockLost"
        else:
            seen["A's with"] = "quiet"
        a_left.set()

    def thread_b() -> None:
        assert a_in.wait(5)
        time.sleep(_TTL + 0.1)
        with lock:
            lock.extend(5)
            b_in.set()
            assert a_left.wait(5)
            seen["held on"] = _holders(nodes3, lock.key)
            seen["rival got in"] = rival.acquire(timeout=0)

    _run_threads(thread_a, thread_b)
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"A's call": "LockLost", "A's with": "LockLost", "held on": 3,
                    "rival got in": False}
    assert _holders(nodes3, lock.key) == 0


# -- review 8: records dropped by their bounds, and exits that race ----------------------------
def test_the_exits_of_entries_whose_released_records_were_dropped_end_nothing(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Thread A makes more entries by hand than its records keep, each
    released by hand, so the oldest records go; thread B enters ``with L``;
    A's exits then come, one per entry. Each ends nothing: a dropped record
    is counted, and its exit takes the count. Without the count, the last
    exit found no record of its own, took B's, and ended B's hold while B
    was inside: a rival got in."""
    from django_redlock.engine.entries import HAND_ENTRIES_KEPT

    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-dropped-released", ttl=5)
    rival = make_manager(nodes3).lock("hand-dropped-released", ttl=5)
    count = HAND_ENTRIES_KEPT + 1
    seen: dict[str, Any] = {}
    a_ready, b_in, a_done = threading.Event(), threading.Event(), threading.Event()

    def thread_a() -> None:
        for _ in range(count):
            lock.__enter__()
            lock.release()
        a_ready.set()
        assert b_in.wait(10)
        exits = []
        for _ in range(count):
            try:
                lock.__exit__(None, None, None)
                exits.append("quiet")
            except LockLost:
                exits.append("LockLost")
        seen["A's exits"] = exits
        a_done.set()

    def thread_b() -> None:
        assert a_ready.wait(10)
        with lock:
            b_in.set()
            assert a_done.wait(10)
            seen["B owns"] = lock.owned()
            seen["held on"] = _holders(nodes3, lock.key)
            seen["rival got in"] = rival.acquire(timeout=0)

    _run_threads(thread_a, thread_b)
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"A's exits": ["quiet"] * count, "B owns": True, "held on": 3,
                    "rival got in": False}
    assert _holders(nodes3, lock.key) == 0


def test_the_exits_of_entries_of_ended_threads_swept_from_the_records_end_nothing(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """As many threads as the records keep entrants each enter by hand,
    release by hand and end; a new entrant (thread B, entering by hand)
    sweeps their records away. Their exits, made later (a dispatcher
    stopping their jobs), end nothing: the records swept are counted.
    Without the count, the first of those exits took B's entry and ended
    B's hold under it."""
    from django_redlock.engine.entries import HAND_ENTRANTS_KEPT

    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-swept", ttl=5)
    rival = make_manager(nodes3).lock("hand-swept", ttl=5)

    def job() -> None:
        lock.__enter__()
        lock.release()

    for _ in range(HAND_ENTRANTS_KEPT):
        thread = threading.Thread(target=job)
        thread.start()
        thread.join(10)
        assert not thread.is_alive()
    seen: dict[str, Any] = {}
    b_in, stopped = threading.Event(), threading.Event()

    def thread_b() -> None:
        lock.__enter__()
        b_in.set()
        assert stopped.wait(10)
        seen["B owns"] = lock.owned()
        seen["held on"] = _holders(nodes3, lock.key)
        seen["rival got in"] = rival.acquire(timeout=0)
        lock.__exit__(None, None, None)

    def dispatcher() -> None:
        assert b_in.wait(10)
        exits = []
        for _ in range(HAND_ENTRANTS_KEPT):
            try:
                lock.__exit__(None, None, None)
                exits.append("quiet")
            except LockLost:
                exits.append("LockLost")
        seen["stops"] = exits
        stopped.set()

    _run_threads(thread_b, dispatcher)
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"stops": ["quiet"] * HAND_ENTRANTS_KEPT, "B owns": True, "held on": 3,
                    "rival got in": False}
    assert _holders(nodes3, lock.key) == 0


@contextlib.contextmanager
def _walk_paused(monkeypatch: pytest.MonkeyPatch, pause_in: threading.Thread,
                 until: threading.Event, at: int = 1) -> Iterator[threading.Event]:
    """The walk of an exit by hand over the records (``EntryRecords._least``)
    pauses in thread ``pause_in``, once, at its ``at``-th entrant, until
    ``until`` is set or 1 s passed; the event yielded is set once it paused.
    Another thread's work that the walk must not overlap (an exit, a grant)
    sets ``until`` when it ran: with the records guarded, it cannot run
    before the walk ends, and the pause ends after 1 s."""
    from django_redlock.engine import entries

    real = entries.is_stack_key
    paused = threading.Event()
    calls = 0

    def is_stack_key(owner: Any) -> bool:
        nonlocal calls
        if threading.current_thread() is pause_in and not paused.is_set():
            calls += 1
            if calls == at:
                paused.set()
                until.wait(1.0)
        return real(owner)

    monkeypatch.setattr(entries, "is_stack_key", is_stack_key)
    yield paused


def test_two_exits_by_hand_at_once_take_two_records_not_the_live_one(
        nodes3: RedisNodes, make_manager: MakeManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """Thread A's first entry by hand lapsed, thread C's too, and A holds a
    live entry (hold 3). Two pool workers leave the two lapsed entries at
    the same moment. Each must get ``LockLost`` and A's live hold must stay.
    The walks ran unguarded: both chose A's first record, the second took
    what slid into its place, A's live entry, and ended hold 3 under A (a
    rival got in; 5 of 216 runs in review 8). The first walk is paused here,
    A's first record chosen, before it looks at C's, while the second exit
    tries to run."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-two-exits", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("hand-two-exits", ttl=5)
    seen: dict[str, Any] = {}
    a_first, c_in, a_live, stops_done = (threading.Event() for _ in range(4))

    def thread_a() -> None:
        lock.__enter__()  # job 1: its lease runs out
        a_first.set()
        assert c_in.wait(10)
        time.sleep(_TTL + 0.1)
        lock.__enter__()  # job 3: a new hold, kept
        lock.extend(5)
        a_live.set()
        assert stops_done.wait(10)
        seen["A owns"] = lock.owned()
        seen["held on"] = _holders(nodes3, lock.key)
        seen["rival got in"] = rival.acquire(timeout=0)

    def thread_c() -> None:
        assert a_first.wait(10)
        time.sleep(_TTL + 0.1)
        lock.__enter__()  # job 2: a new hold, whose lease runs out too
        c_in.set()

    def stop(name: str, after: threading.Event | None, done: threading.Event) -> None:
        if after is not None:
            assert after.wait(10)
        try:
            lock.__exit__(None, None, None)
            seen[name] = "quiet"
        except LockLost:
            seen[name] = "LockLost"
        done.set()

    workers_go = threading.Event()
    first_done, second_done = threading.Event(), threading.Event()
    first = threading.Thread(target=lambda: (workers_go.wait(10),
                                             stop("first stop", None, first_done)))
    with _walk_paused(monkeypatch, first, second_done, at=2) as paused:
        second = threading.Thread(target=lambda: stop("second stop", paused, second_done))
        a = threading.Thread(target=thread_a)
        c = threading.Thread(target=thread_c)
        for thread in (a, c, first, second):
            thread.start()
        assert a_live.wait(10)
        workers_go.set()
        assert first_done.wait(10) and second_done.wait(10)
        stops_done.set()
        for thread in (a, c, first, second):
            thread.join(20)
        assert not any(thread.is_alive() for thread in (a, c, first, second))
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"first stop": "LockLost", "second stop": "LockLost", "A owns": True,
                    "held on": 3, "rival got in": False}
    lock.__exit__(None, None, None)
    assert _holders(nodes3, lock.key) == 0


def test_a_grant_during_an_exits_walk_is_not_taken_for_a_lapsed_entry(
        nodes3: RedisNodes, make_manager: MakeManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """Thread X leaves its own lapsed entry while thread B, which has a
    record already (an entry released by hand), enters anew. The walk read
    the hold number once: B's new record, granted during the walk, looked
    lapsed (neither released nor the hold it read), the least to end, and
    X's exit ended B's hold while B was inside (review 8, at the default
    switch interval too). X's walk is paused here while B enters."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("hand-grant-in-walk", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("hand-grant-in-walk", ttl=5)
    seen: dict[str, Any] = {}
    b_ready, x_lapsed, b_granted, checked = (threading.Event() for _ in range(4))

    def thread_x() -> None:
        assert b_ready.wait(10)
        lock.__enter__()
        time.sleep(_TTL + 0.1)
        x_lapsed.set()
        try:
            lock.__exit__(None, None, None)
            seen["X's exit"] = "quiet"
        except LockLost:
            seen["X's exit"] = "LockLost"

    x = threading.Thread(target=thread_x)
    with _walk_paused(monkeypatch, x, b_granted) as paused:
        def thread_b() -> None:
            lock.__enter__()  # a record of B's: released by hand
            lock.release()
            b_ready.set()
            assert x_lapsed.wait(10) and paused.wait(10)
            lock.__enter__()  # a new hold, granted while X's walk runs (or after it)
            lock.extend(5)
            b_granted.set()
            assert checked.wait(10)
            for _ in range(2):  # two entries of B's, and X's lapsed one may be left
                with contextlib.suppress(LockLost):  # (which exit gets it is a guess)
                    lock.__exit__(None, None, None)

        b = threading.Thread(target=thread_b)
        x.start()
        b.start()
        x.join(20)
        assert b_granted.wait(10)
        seen["B owns"] = lock.owned()
        seen["held on"] = _holders(nodes3, lock.key)
        seen["rival got in"] = rival.acquire(timeout=0)
        checked.set()
        b.join(20)
        assert not x.is_alive() and not b.is_alive()
    if seen.get("rival got in"):
        rival.release()
    assert seen["B owns"] and seen["held on"] == 3 and not seen["rival got in"], seen
    assert _holders(nodes3, lock.key) == 0


# -- review 8: a reentrant lock's exit by hand -------------------------------------------------
class _StartStop:
    """A job that enters the lock when it starts and leaves it when it stops."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock

    def start(self) -> None:
        self.lock.__enter__()

    def stop(self) -> None:
        self.lock.__exit__(None, None, None)


def test_a_reentrant_exit_by_hand_leaves_a_with_blocks_new_hold_alone(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """One thread: a job's start enters a reentrant lock by hand (H1) and
    its lease runs out; ``with R:`` takes H2 (a lapsed hold is not joined);
    inside the block, the job's stop calls ``R.__exit__()``. It took the
    thread's innermost hold, the block's H2, and ended it under the body (a
    rival got in); it now takes H1, a hold no open block is on, and raises
    ``LockLost`` for it."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("re-hand-exit", ttl=_TTL, auto_renew=False, reentrant=True)
    rival = make_manager(nodes3).lock("re-hand-exit", ttl=5)
    job = _StartStop(lock)
    job.start()
    time.sleep(_TTL + 0.1)
    seen: dict[str, Any] = {}
    with lock:
        lock.extend(5)
        try:
            job.stop()
            seen["stop"] = "quiet"
        except LockLost:
            seen["stop"] = "LockLost"
        seen.update(look_from_inside(nodes3, lock.key, rival))
    assert seen == {"stop": "LockLost", "held on": 3, "rival got in": False}
    assert _holders(nodes3, lock.key) == 0  # the block's exit released H2


def test_an_async_reentrant_exit_by_hand_leaves_an_async_with_blocks_new_hold_alone(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """The asyncio twin: ``await R.__aenter__()`` by hand (H1), its lease
    runs out, ``async with R:`` takes H2, and ``await R.__aexit__()`` by
    hand inside the block ends H1 (``LockLost``), not H2."""
    mgr = make_manager(nodes3)
    rival = make_manager(nodes3).lock("re-hand-aexit", ttl=5)
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        lock = mgr.alock("re-hand-aexit", ttl=_TTL, auto_renew=False, reentrant=True)

        async def start() -> None:
            await lock.__aenter__()

        async def stop() -> None:
            await lock.__aexit__(None, None, None)

        await start()
        await asyncio.sleep(_TTL + 0.1)
        async with lock:
            await lock.extend(5)
            try:
                await stop()
                seen["stop"] = "quiet"
            except LockLost:
                seen["stop"] = "LockLost"
            seen.update(look_from_inside(nodes3, lock.key, rival))

    asyncio.run(scenario())
    assert seen == {"stop": "LockLost", "held on": 3, "rival got in": False}
    assert _holders(nodes3, mgr.key("re-hand-aexit")) == 0


def test_a_reentrant_entry_by_hand_joined_by_a_with_block_is_released_by_the_last_exit(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """``R.__enter__()`` by hand, then ``with R:`` joins that hold; the exit
    by hand, inside the block, ends the entry by hand's acquisition (the
    hold has one more acquisition than open blocks), and the block's exit
    the last: the hold is released, not left renewed."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("re-hand-joined", ttl=5, reentrant=True)
    job = _StartStop(lock)
    job.start()
    with lock:
        job.stop()
        assert _holders(nodes3, lock.key) == 3  # the block's acquisition is left
    assert _holders(nodes3, lock.key) == 0
    assert not lock.owned()


def test_a_reentrant_exit_by_hand_in_a_with_blocks_own_frame_leaves_the_block_its_hold(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """As above, but the job's stop runs in the block's own frame: the
    ``__exit__`` by hand found the block's record in its frame, claimed it,
    and ended H2 under the body (review 9). The statement's own exit runs at
    its line; a call by hand at another line claims no record."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("re-hand-same-frame", ttl=_TTL, auto_renew=False, reentrant=True)
    rival = make_manager(nodes3).lock("re-hand-same-frame", ttl=5)
    lock.__enter__()  # a job's start, by hand: H1
    time.sleep(_TTL + 0.1)
    seen: dict[str, Any] = {}
    with lock:  # H2
        lock.extend(5)
        try:
            lock.__exit__(None, None, None)  # the job's stop, in this frame
            seen["stop"] = "quiet"
        except LockLost:
            seen["stop"] = "LockLost"
        seen.update(look_from_inside(nodes3, lock.key, rival))
    assert seen == {"stop": "LockLost", "held on": 3, "rival got in": False}
    assert _holders(nodes3, lock.key) == 0


def test_an_async_reentrant_exit_by_hand_in_an_async_with_blocks_own_frame_leaves_its_hold(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """The asyncio twin of the test above."""
    mgr = make_manager(nodes3)
    rival = make_manager(nodes3).lock("re-hand-same-aframe", ttl=5)
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        lock = mgr.alock("re-hand-same-aframe", ttl=_TTL, auto_renew=False, reentrant=True)
        await lock.__aenter__()
        await asyncio.sleep(_TTL + 0.1)
        async with lock:
            await lock.extend(5)
            try:
                await lock.__aexit__(None, None, None)
                seen["stop"] = "quiet"
            except LockLost:
                seen["stop"] = "LockLost"
            seen.update(look_from_inside(nodes3, lock.key, rival))

    asyncio.run(scenario())
    assert seen == {"stop": "LockLost", "held on": 3, "rival got in": False}
    assert _holders(nodes3, mgr.key("re-hand-same-aframe")) == 0


def test_a_reentrant_exit_by_hand_during_another_threads_claim_leaves_the_block_its_hold(
        nodes3: RedisNodes, make_manager: MakeManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """H1 entered by hand lapses; a generator's ``with R:`` takes H2, and
    this thread's ``with R:`` joins it. Thread B closes the generator: its
    exit claims the generator's record, and before it ends that acquisition
    this thread's job stop (``__exit__`` by hand) counts H2's blocks: one
    claimed looked gone, so H2 looked to have an acquisition by hand, the
    stop took it instead of the lapsed H1, and B's end then released H2
    under this thread's open block (review 9). The claim and the end are one
    section now; B pauses between them here."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("re-claim-race", ttl=_TTL, auto_renew=False, reentrant=True)
    rival = make_manager(nodes3).lock("re-claim-race", ttl=5)
    claimed, close_now = threading.Event(), threading.Event()
    real = lock._claim_entry_at

    def claim_then_pause(*args: Any) -> Any:
        found = real(*args)
        if threading.current_thread().name == "closer" and found is not None:
            claimed.set()
            time.sleep(0.3)  # the stop below runs now, unless it waits for this exit
        return found

    monkeypatch.setattr(lock, "_claim_entry_at", claim_then_pause)

    def rows() -> Iterator[int]:
        with lock:
            yield 1

    def stop() -> str:  # the job's stop, from a helper frame
        try:
            lock.__exit__(None, None, None)
            return "quiet"
        except LockLost:
            return "LockLost"

    generator = rows()

    def closer() -> None:
        assert close_now.wait(10)
        generator.close()

    thread = threading.Thread(target=closer, name="closer")
    thread.start()
    seen: dict[str, Any] = {}
    try:
        lock.__enter__()  # H1, by hand
        time.sleep(_TTL + 0.1)
        next(generator)  # H2, the generator's block
        lock.extend(5)
        with lock:  # joins H2
            close_now.set()
            assert claimed.wait(10)
            seen["stop"] = stop()
            thread.join(20)
            seen.update(look_from_inside(nodes3, lock.key, rival))
    finally:
        close_now.set()
        thread.join(20)
    assert seen == {"stop": "LockLost", "held on": 3, "rival got in": False}
    assert _holders(nodes3, lock.key) == 0
