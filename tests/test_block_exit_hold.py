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
from tests.holding import holders as _holders
from tests.holding import run_threads as _run_threads

MakeManager = Callable[..., Any]

_TTL = 0.3  # auto_renew off: a lease that runs out within the test


def _second_block(lock: Any, inside: threading.Event, first_left: threading.Event,
                  seen: dict[str, Any]) -> Callable[[], None]:
    """Thread B: enters ``lock``, says so, and notes whether it still owns it
    once the first block has left."""
    def thread_b() -> None:
        with lock:
            inside.set()
            assert first_left.wait(5)
            seen["B owned at A's exit"] = lock.owned()
    return thread_b


def _assert_kept(nodes: RedisNodes, lock: Any, rival: Any) -> None:
    """``lock``'s current hold is whole: owned, on every node, a rival refused."""
    assert lock.owned()
    assert _holders(nodes, lock.key) == len(nodes)
    assert rival.acquire(timeout=0) is False


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
        lock.extend(5)  # a lease that outlasts the test's checks, under load too
        gc.collect()  # the generator's exit
    finally:
        gc.enable()
    try:
        _assert_kept(nodes3, lock, rival)
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


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_a_block_whose_lease_ran_out_inside_its_own_enter_leaves_the_new_hold_alone(
        flavour: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """A's ``lock_acquired`` receiver takes longer than the lease, inside A's
    ``with``'s entry; B enters the same object meanwhile (a new hold). The
    block is recorded with the hold its own acquire granted, in the same
    step: A's exit does not take B's hold for its own (recorded after the
    acquire returned, it read B's)."""
    from django_redlock import signals

    mgr = make_manager(nodes3)
    name = f"block-enter-window-{flavour}"
    rival = make_manager(nodes3).lock(name, ttl=5)
    slow_once = {"A": True}

    def slow_receiver(sender: Any, **kwargs: Any) -> None:
        if kwargs["name"] == name and slow_once.pop("A", False):
            time.sleep(_TTL + 0.15)

    signals.lock_acquired.connect(slow_receiver, weak=False, dispatch_uid="block-window")
    seen: dict[str, Any] = {}
    try:
        if flavour == "sync":
            lock = mgr.lock(name, ttl=_TTL, auto_renew=False)
            b_inside, a_left = threading.Event(), threading.Event()

            def thread_a() -> None:
                try:
                    with lock:
                        assert b_inside.wait(5)
                except LockLost:
                    seen["A"] = "LockLost"
                else:
                    seen["A"] = "left quietly"
                a_left.set()

            def thread_b() -> None:
                time.sleep(_TTL + 0.05)  # A's lease is out; A is still in its receiver
                with lock:
                    lock.extend(5)  # a lease that outlasts the checks
                    b_inside.set()
                    assert a_left.wait(5)
                    seen["B owned after A left"] = lock.owned()
                    seen["rival got in"] = rival.acquire(timeout=0)

            _run_threads(thread_a, thread_b)
        else:
            async def scenario() -> None:
                alock = mgr.alock(name, ttl=_TTL, auto_renew=False)
                b_inside, a_left = asyncio.Event(), asyncio.Event()

                async def task_a() -> None:
                    try:
                        async with alock:
                            await b_inside.wait()
                    except LockLost:
                        seen["A"] = "LockLost"
                    else:
                        seen["A"] = "left quietly"
                    a_left.set()

                async def task_b() -> None:
                    await asyncio.sleep(_TTL + 0.05)
                    async with alock:
                        await alock.extend(5)  # a lease that outlasts the checks
                        b_inside.set()
                        await a_left.wait()
                        seen["B owned after A left"] = alock.owned()
                        seen["rival got in"] = rival.acquire(timeout=0)

                await asyncio.gather(task_a(), task_b())
            asyncio.run(asyncio.wait_for(scenario(), 20))
    finally:
        signals.lock_acquired.disconnect(dispatch_uid="block-window")
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"A": "LockLost", "B owned after A left": True, "rival got in": False}
    assert _holders(nodes3, mgr.key(name)) == 0


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_a_block_that_takes_its_lapsed_lock_again_by_hand_ends_that_hold(
        flavour: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """``with L: ... if not L.owned(): L.acquire()``: the block's own lease
    ran out, and it took the lock again by hand inside its body; its exit
    ends that acquisition (it is the block's: acquired from inside it), so
    nothing is left held or renewed after the block."""
    mgr = make_manager(nodes3)
    name = f"block-retake-{flavour}"
    if flavour == "sync":
        lock = mgr.lock(name, ttl=_TTL, auto_renew=False)
        with lock:
            time.sleep(_TTL + 0.05)
            assert not lock.owned()
            assert lock.acquire(timeout=2)
            lock.extend(5)  # the exit must find it whole, under load too
        owned = lock.owned()
    else:
        async def scenario() -> bool:
            alock = mgr.alock(name, ttl=_TTL, auto_renew=False)
            async with alock:
                await asyncio.sleep(_TTL + 0.05)
                assert not alock.owned()
                assert await alock.acquire(timeout=2)
                await alock.extend(5)  # the exit must find it whole
            return alock.owned()
        owned = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert owned is False
    assert _holders(nodes3, mgr.key(name)) == 0


def test_nested_blocks_of_one_frame_each_end_their_own_hold(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """An outer ``with L`` whose lease ran out, an inner ``with L`` in the
    same frame (a new hold), then a generator's ``with L`` after the inner
    block (a third): the outer exit leaves the generator's hold alone (one
    record per frame: the inner's had overwritten the outer's, and the
    outer exit fell back to ending whatever was held)."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("block-nested", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("block-nested", ttl=5)

    def rows() -> Any:
        with lock:
            yield 1
            yield 2

    gen = rows()
    with pytest.raises(LockLost):
        with lock:
            time.sleep(_TTL + 0.05)
            with lock:  # the outer's lease is out: a new hold
                pass
            next(gen)  # the generator's block: a third hold
            lock.extend(5)  # a lease that outlasts the checks, under load too
    try:
        _assert_kept(nodes3, lock, rival)
    finally:
        gen.close()
    assert _holders(nodes3, lock.key) == 0


def test_a_release_put_off_to_a_sections_end_ends_only_its_own_hold(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """A collection inside one of the library's sections runs the exit of a
    generator inside ``with L``: its release is put off to the section's
    end. By then the object holds anew (the generator's lease ran out, the
    thread acquired): the put-off release is for the generator's hold, and
    leaves the new one alone (it ended it)."""
    from django_redlock.transport import finalizers

    mgr = make_manager(nodes3)
    lock = mgr.lock("block-put-off", ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock("block-put-off", ttl=5)
    seen: dict[str, Any] = {}

    def rows() -> Any:
        with lock:
            yield 1

    def thread() -> None:
        gen = rows()
        next(gen)
        cycle: list[Any] = [gen]
        cycle.append(cycle)
        del gen, cycle
        time.sleep(_TTL + 0.05)
        finalizers.enter()
        try:
            gc.collect()  # the generator's exit: its release put off
            seen["acquired"] = lock.acquire(timeout=2)  # a new hold, inside the section
            lock.extend(5)  # a lease that outlasts the checks
        finally:
            finalizers.leave()  # the put-off release runs here
        seen["owned after the section"] = lock.owned()
        seen["held on"] = _holders(nodes3, lock.key)
        seen["rival got in"] = rival.acquire(timeout=0)

    gc.disable()
    try:
        worker = threading.Thread(target=thread)
        worker.start()
        worker.join(20)
    finally:
        gc.enable()
    assert not worker.is_alive()
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"acquired": True, "owned after the section": True, "held on": 3,
                    "rival got in": False}
    lock.release()


def test_a_block_that_released_by_hand_leaves_the_next_blocks_hold_quietly(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """``with LOCK: LOCK.release(); ...`` in thread A, then thread B enters:
    A's exit leaves B's hold alone and raises nothing (A's hold was
    released, not lost; it said "lost" with no ``lock_lost`` sent)."""
    lock = make_manager(nodes3).lock("block-released-then-taken", ttl=5)
    a_released, b_inside = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def thread_a() -> None:
        try:
            with lock:
                lock.release()
                a_released.set()
                assert b_inside.wait(5)
        except LockLost:
            seen["A"] = "LockLost"
        else:
            seen["A"] = "left quietly"

    def thread_b() -> None:
        assert a_released.wait(5)
        with lock:
            b_inside.set()
            time.sleep(0.2)  # A leaves meanwhile
            seen["B owned"] = lock.owned()
            seen["held on"] = _holders(nodes3, lock.key)

    _run_threads(thread_a, thread_b)
    assert seen == {"A": "left quietly", "B owned": True, "held on": 3}
    assert _holders(nodes3, lock.key) == 0


@pytest.mark.parametrize("how", ["wait_for", "shield"])
def test_an_async_block_that_takes_its_lapsed_lock_again_through_a_task_ends_that_hold(
        how: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """``async with L: ... await asyncio.wait_for(L.acquire(), 3)`` after the
    block's lease ran out: ``wait_for`` (before 3.12) and ``shield`` run the
    acquire in a task of their own, awaited by the block's as if directly;
    the hold is the block's to end at its exit (left to nobody, it stayed
    held, renewed for the life of the process)."""
    mgr = make_manager(nodes3)
    name = f"block-retake-{how}"

    async def scenario() -> bool:
        alock = mgr.alock(name, ttl=_TTL, auto_renew=True)
        async with alock:
            alock._cancel_renewal_timer()  # as a renewal that failed: the lease lapses
            await asyncio.sleep(_TTL + 0.05)
            assert not alock.owned()
            if how == "wait_for":
                assert await asyncio.wait_for(alock.acquire(), 3)
            else:
                assert await asyncio.shield(alock.acquire(timeout=3))
        await asyncio.sleep(_TTL)  # past the lease: only a renewal would keep it
        return alock.owned()

    assert asyncio.run(asyncio.wait_for(scenario(), 20)) is False
    assert _holders(nodes3, mgr.key(name)) == 0


def test_an_async_block_cancelled_after_its_grant_leaves_no_record(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """A module-level ``alock`` entered by requests that are cancelled right
    after the grant (a client gone, during the ``lock_acquired`` signal):
    each hold is taken back and its block's record dropped (one was kept per
    cancellation, for good)."""
    from django_redlock import signals

    mgr = make_manager(nodes3)

    def receiver(sender: Any, **kwargs: Any) -> None:
        time.sleep(0.002)  # an application's receiver: runs in a worker thread

    signals.lock_acquired.connect(receiver, weak=False, dispatch_uid="block-cancel")
    try:
        async def scenario() -> tuple[int, int, str]:
            lock = mgr.alock("block-cancelled", ttl=5)

            async def request() -> None:
                async with lock:
                    await asyncio.sleep(0)

            cancelled = 0
            for _ in range(30):
                task = asyncio.ensure_future(request())
                for _ in range(10_000):
                    if lock._state == "held" or task.done():
                        break
                    await asyncio.sleep(0)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    cancelled += 1
            entries = sum(len(v) for v in (lock._blocks or {}).values())
            return cancelled, entries, lock._state

        cancelled, entries, state = asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        signals.lock_acquired.disconnect(dispatch_uid="block-cancel")
    assert cancelled > 0  # the schedule happened
    assert (entries, state) == (0, "unlocked")
    assert _holders(nodes3, mgr.key("block-cancelled")) == 0


def test_an_interrupt_in_the_acquires_clean_up_after_the_grant_leaves_nothing_held(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """A ``with`` that waited in line is granted; an interrupt (a signal
    handler's exception: Celery's soft time limit) lands in the acquire's
    clean-up of its subscription, after the grant: the hold is taken back
    (it stayed held, renewed, and "already held" for good)."""
    import sys as _sys

    class SoftTimeLimit(Exception):
        pass

    mgr = make_manager(nodes3)
    lock = mgr.lock("block-interrupt-cleanup", ttl=0.5, auto_renew=True)
    rival = make_manager(nodes3).lock("block-interrupt-cleanup", ttl=5)
    assert rival.acquire()
    threading.Timer(0.3, rival.release).start()  # the with waits in line, then is granted
    armed = [True]

    def prof(frame: Any, event: str, arg: Any) -> None:
        if (armed[0] and event == "call" and frame.f_code.co_name == "_remove"
                and lock._state == "held"):
            armed[0] = False
            raise SoftTimeLimit

    with pytest.raises(SoftTimeLimit):
        _sys.setprofile(prof)
        try:
            with lock:
                pass
        finally:
            _sys.setprofile(None)
    assert not armed[0]  # the interrupt landed where meant
    assert not lock.owned()
    assert not lock._blocks
    assert _holders(nodes3, lock.key) == 0
    with lock:  # free for the next block
        pass


@pytest.mark.parametrize("how", ["create_task", "gather"])
def test_a_hold_a_child_task_takes_by_hand_is_left_to_that_task(
        how: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """``async with L: await L.release(); await create_task(take())``: the
    child task's hold is its own; the block's exit leaves it (quietly: the
    block released its own), and the child releases it."""
    mgr = make_manager(nodes3)
    name = f"block-child-{how}"

    async def scenario() -> tuple[bool, int]:
        alock = mgr.alock(name, ttl=5)

        async def take() -> None:
            assert await alock.acquire(timeout=2)

        async with alock:
            await alock.release()
            if how == "create_task":
                await asyncio.create_task(take())
            else:
                await asyncio.gather(take())
        owned, held_on = alock.owned(), _holders(nodes3, mgr.key(name))
        await alock.release()
        return owned, held_on

    assert asyncio.run(asyncio.wait_for(scenario(), 20)) == (True, 3)
    assert _holders(nodes3, mgr.key(name)) == 0


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
@pytest.mark.parametrize("how", ["release", "lapse"])
def test_a_lock_entered_in_a_contextmanager_helper_ends_what_its_caller_retakes(
        how: str, flavour: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """``with critical(): ...`` where ``critical()`` is a ``@contextmanager``
    (``@asynccontextmanager``) doing ``with L: yield``: the caller releases
    by hand and takes the lock again, or takes it again after the lease ran
    out. The helper's frame is suspended, on no stack the acquire runs on;
    the hold was taken by hand by the block's own thread (task): the
    helper's exit ends it (left, it stayed held and renewed for good)."""
    import contextlib

    mgr = make_manager(nodes3)
    name = f"block-helper-{how}-{flavour}"
    if flavour == "sync":
        lock = mgr.lock(name, ttl=_TTL, auto_renew=False)

        @contextlib.contextmanager
        def critical() -> Any:
            with lock:
                yield

        try:
            with critical():
                if how == "release":
                    lock.release()
                else:
                    time.sleep(_TTL + 0.05)
                assert lock.acquire(timeout=2)
                lock.extend(5)  # the exit must find it whole, under load too
        except LockLost:
            pytest.fail("LockLost for a hold the block's own thread took")
        owned = lock.owned()
    else:
        async def scenario() -> bool:
            alock = mgr.alock(name, ttl=_TTL, auto_renew=False)

            @contextlib.asynccontextmanager
            async def critical() -> Any:
                async with alock:
                    yield

            async with critical():
                if how == "release":
                    await alock.release()
                else:
                    await asyncio.sleep(_TTL + 0.05)
                assert await alock.acquire(timeout=2)
                await alock.extend(5)  # the exit must find it whole
            return alock.owned()
        owned = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert owned is False
    assert _holders(nodes3, mgr.key(name)) == 0


@pytest.mark.parametrize("how", ["wait_for", "shield"])
def test_an_async_generators_block_ends_a_hold_retaken_through_a_task(
        how: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """``async with L`` inside an async generator, released by hand and
    taken again through ``wait_for`` / ``shield`` (a task of their own): the
    chain of awaits from the awaiting task runs through the generator's
    ``asend`` object, which leads to no frame; the generator is found among
    what it refers to, the block adopts the hold, and its exit ends it (it
    stayed held, renewed)."""
    mgr = make_manager(nodes3)
    name = f"block-agen-{how}"

    async def scenario() -> bool:
        alock = mgr.alock(name, ttl=5)

        async def rows() -> Any:
            async with alock:
                await alock.release()
                if how == "wait_for":
                    assert await asyncio.wait_for(alock.acquire(), 3)
                else:
                    assert await asyncio.shield(alock.acquire(timeout=3))
                yield 1

        async for _ in rows():
            pass
        return alock.owned()

    assert asyncio.run(asyncio.wait_for(scenario(), 20)) is False
    assert _holders(nodes3, mgr.key(name)) == 0


def test_an_async_task_cancelled_after_its_grant_leaves_another_tasks_hold_alone(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Task A's ``async with`` is granted, then its slow ``lock_acquired``
    receiver outlasts the lease; task B enters the same object (a new hold);
    A is cancelled: A's take-back releases A's own hold, not B's (it
    released the object's current hold, B's, while B was inside)."""
    from django_redlock import signals

    mgr = make_manager(nodes3)
    rival = make_manager(nodes3).lock("block-cancel-other", ttl=5)
    first = [True]

    async def slow(sender: Any, **kwargs: Any) -> None:
        if kwargs["name"] == "block-cancel-other" and first:
            first.clear()
            await asyncio.sleep(1.0)

    signals.lock_acquired.connect(slow, weak=False, dispatch_uid="block-cancel-other")
    try:
        async def scenario() -> dict[str, Any]:
            lock = mgr.alock("block-cancel-other", ttl=_TTL, auto_renew=False)
            seen: dict[str, Any] = {}

            async def a() -> None:
                async with lock:
                    await asyncio.sleep(5)

            async def b() -> None:
                async with lock:
                    await lock.extend(5)  # a lease that outlasts the checks
                    await asyncio.sleep(0.15)  # A is cancelled meanwhile
                    seen["B owned"] = lock.owned()
                    seen["held on"] = _holders(nodes3, lock.key)
                    seen["rival got in"] = await asyncio.to_thread(rival.acquire, timeout=0)

            task_a = asyncio.create_task(a())
            await asyncio.sleep(_TTL + 0.1)  # A's lease ran out; A is in the receiver
            task_b = asyncio.create_task(b())
            await asyncio.sleep(0.05)  # B holds
            task_a.cancel()
            results = await asyncio.gather(task_a, task_b, return_exceptions=True)
            seen["A, B"] = [type(r).__name__ for r in results]
            seen["records"] = sum(len(v) for v in (lock._blocks or {}).values())
            return seen

        seen = asyncio.run(asyncio.wait_for(scenario(), 20))
    finally:
        signals.lock_acquired.disconnect(dispatch_uid="block-cancel-other")
    if seen.get("rival got in"):
        rival.release()
    assert seen == {"B owned": True, "held on": 3, "rival got in": False,
                    "A, B": ["CancelledError", "NoneType"], "records": 0}


def test_a_retake_interrupted_after_its_grant_inside_a_block_is_no_loss(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Inside ``with LOCK``: released by hand, taken again by hand (the block
    adopts it), and that acquire is interrupted after its grant (a signal
    handler's exception in its clean-up): the hold is taken back as a
    release; another thread then enters; the block's exit is quiet (it
    raised ``LockLost``, "its lease ran out", though nothing was lost)."""
    import sys as _sys

    class SoftTimeLimit(Exception):
        pass

    mgr = make_manager(nodes3)
    lock = mgr.lock("block-retake-interrupted", ttl=5)
    rival = make_manager(nodes3).lock("block-retake-interrupted", ttl=5)
    armed = [True]
    b_inside, a_left = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def prof(frame: Any, event: str, arg: Any) -> None:
        if (armed[0] and event == "call" and frame.f_code.co_name == "_remove"
                and lock._state == "held"):
            armed[0] = False
            raise SoftTimeLimit

    worker = threading.Thread(target=_second_block(lock, b_inside, a_left, seen))
    try:
        with lock:
            lock.release()
            assert rival.acquire()
            threading.Timer(0.3, rival.release).start()  # the retake waits in line
            _sys.setprofile(prof)
            try:
                lock.acquire(timeout=3)
            except SoftTimeLimit:
                seen["retake"] = "interrupted"
            finally:
                _sys.setprofile(None)
            worker.start()
            assert b_inside.wait(5)
        seen["A"] = "left quietly"
    except LockLost:
        seen["A"] = "LockLost"
    finally:
        a_left.set()
        worker.join(10)
    assert seen == {"retake": "interrupted", "A": "left quietly", "B owned at A's exit": True}
    assert _holders(nodes3, lock.key) == 0


@pytest.mark.parametrize("how", ["close", "run to its end", "dropped", "released, then close"])
def test_a_generators_block_ending_leaves_the_threads_own_later_hold(
        how: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """A generator suspended inside ``with LOCK``; its hold lapses (or it
    released it by hand); the same thread then takes LOCK by hand for a
    critical section of its own (not from inside the generator), and the
    generator ends meanwhile (``close()``, run to its end, dropped): the
    thread's hold is kept (a rule that gave the block any hold its own
    thread took ended it: a rival got in while the thread was inside)."""
    mgr = make_manager(nodes3)
    name = f"block-own-later-{how}"
    lock = mgr.lock(name, ttl=_TTL, auto_renew=False)
    rival = make_manager(nodes3).lock(name, ttl=5)

    def rows() -> Any:
        with lock:
            yield 1
            yield 2

    gen = rows()
    next(gen)
    if how == "released, then close":
        lock.release()
    else:
        time.sleep(_TTL + 0.05)
    assert lock.acquire(timeout=2)  # the thread's own section
    lock.extend(5)  # a lease that outlasts the checks
    try:
        if how == "run to its end":
            with pytest.raises(LockLost):  # the generator's own hold lapsed
                for _ in gen:
                    pass
        elif how == "dropped":
            del gen  # refcount: finalized at once, no collection
        else:
            gen.close()
        _assert_kept(nodes3, lock, rival)
    finally:
        lock.release()


def test_a_helper_entered_through_an_exit_stack_takes_no_later_stacks_hold(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """``s1.enter_context(helper())`` (a ``@contextmanager`` doing ``with L:
    yield``), its hold released by hand, then ``s2.enter_context(L)`` (a
    hold of ``s2``'s): closing ``s1`` leaves ``s2``'s hold alone. The
    helper's caller was ``enter_context``'s frame, which returned at once;
    the next one, at the same address, took ``s2``'s hold for the helper's
    block (two holders, about one run in three). 20 tries."""
    import contextlib

    mgr = make_manager(nodes3)
    rival_mgr = make_manager(nodes3)
    for i in range(20):
        lock = mgr.lock(f"block-stack-{i}", ttl=5)

        @contextlib.contextmanager
        def helper(lock: Any = lock) -> Any:
            with lock:
                yield

        first = contextlib.ExitStack()
        first.enter_context(helper())
        lock.release()
        second = contextlib.ExitStack()
        second.enter_context(lock)
        first.close()
        try:
            assert lock.owned(), i
            assert _holders(nodes3, lock.key) == 3, i
            assert rival_mgr.lock(f"block-stack-{i}").acquire(timeout=0) is False, i
        finally:
            second.close()
        assert _holders(nodes3, lock.key) == 0


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_a_lock_entered_in_a_helper_within_a_helper_ends_what_the_caller_retakes(
        flavour: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """``outer()`` does ``with inner(): yield``, ``inner()`` does ``with L:
    yield``; the caller of ``with outer():`` releases by hand and takes L
    again: the innermost helper's block ends that hold (both helpers'
    frames are suspended meanwhile; it stayed held, renewed)."""
    import contextlib

    mgr = make_manager(nodes3)
    name = f"block-nested-helper-{flavour}"
    if flavour == "sync":
        lock = mgr.lock(name, ttl=5)

        @contextlib.contextmanager
        def inner() -> Any:
            with lock:
                yield

        @contextlib.contextmanager
        def outer() -> Any:
            with inner():
                yield

        with outer():
            lock.release()
            assert lock.acquire(timeout=2)
        owned = lock.owned()
    else:
        async def scenario() -> bool:
            alock = mgr.alock(name, ttl=5)

            @contextlib.asynccontextmanager
            async def inner() -> Any:
                async with alock:
                    yield

            @contextlib.asynccontextmanager
            async def outer() -> Any:
                async with inner():
                    yield

            async with outer():
                await alock.release()
                assert await alock.acquire(timeout=2)
            return alock.owned()
        owned = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert owned is False
    assert _holders(nodes3, mgr.key(name)) == 0


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_a_block_whose_hold_lapsed_raises_lock_lost_after_a_newer_hold_came_and_went(
        flavour: str, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """A's lease runs out inside its block; B enters the same object and
    leaves before A does: A's exit still raises ``LockLost`` (it left
    quietly, the object being unlocked by then, as after a release by
    hand)."""
    mgr = make_manager(nodes3)
    name = f"block-came-and-went-{flavour}"
    seen: dict[str, Any] = {}
    if flavour == "sync":
        lock = mgr.lock(name, ttl=_TTL, auto_renew=False)
        b_left = threading.Event()

        def thread_b() -> None:
            time.sleep(_TTL + 0.05)
            with lock:
                pass
            b_left.set()

        worker = threading.Thread(target=thread_b)
        worker.start()
        try:
            with lock:
                assert b_left.wait(5)
        except LockLost:
            seen["A"] = "LockLost"
        else:
            seen["A"] = "left quietly"
        worker.join(10)
    else:
        async def scenario() -> None:
            alock = mgr.alock(name, ttl=_TTL, auto_renew=False)
            b_left = asyncio.Event()

            async def task_b() -> None:
                await asyncio.sleep(_TTL + 0.05)
                async with alock:
                    pass
                b_left.set()

            other = asyncio.create_task(task_b())
            try:
                async with alock:
                    await b_left.wait()
            except LockLost:
                seen["A"] = "LockLost"
            else:
                seen["A"] = "left quietly"
            await other
        asyncio.run(asyncio.wait_for(scenario(), 20))
    assert seen == {"A": "LockLost"}
    assert _holders(nodes3, mgr.key(name)) == 0


def test_a_block_whose_hold_the_exit_hook_released_leaves_a_later_hold_quietly(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """``release_held_locks()`` (a SIGTERM handler's, the process going on)
    releases A's hold while A is inside its block; B then takes the object:
    A's exit is quiet and leaves B's hold (it raised "lost before this
    block ended", though the hold was released, not lost)."""
    from django_redlock import release_held_locks

    lock = make_manager(nodes3).lock("block-exit-hook", ttl=5)
    b_inside, a_left = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    worker = threading.Thread(target=_second_block(lock, b_inside, a_left, seen))
    try:
        with lock:
            release_held_locks()
            worker.start()
            assert b_inside.wait(5)
        seen["A"] = "left quietly"
    except LockLost:
        seen["A"] = "LockLost"
    finally:
        a_left.set()
        worker.join(10)
    assert seen == {"A": "left quietly", "B owned at A's exit": True}
    assert _holders(nodes3, lock.key) == 0
