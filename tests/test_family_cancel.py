"""The lock family interrupted while it gives back, or while its body fails.

On real nodes (3), sync and asyncio. Two promises of a composite (multi-lock,
semaphore, segments), which plain locks already kept:

* a give-back, once begun, gives back every lock: an interrupt (a task's
  cancellation, ``KeyboardInterrupt``) in the middle of one lock's release
  goes on only after the others were released too (engine/compose.py,
  ``_HeldBack``);
* a lease lost while the body raised does not replace the body's exception
  (nor, under asyncio, its cancellation) by ``LockLost``: the loss is logged
  (docs/api.rst).

Interrupts are put exactly where they hurt: a ``KeyboardInterrupt`` raised by
a signal receiver (``lock_released`` is sent once a lock's release round is
over; ``lock_not_acquired`` when a wait ran out), or a task cancelled once the
release of a given name has begun (its state flips before its round is sent).
Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Iterator

import pytest

from django_redlock import LockLost, LockNotOwned, with_multi_lock, with_semaphore
from django_redlock.engine import events
from django_redlock.testing import RedisNodes

MakeManager = Callable[..., Any]

pytestmark = pytest.mark.slow


def _holders(nodes: RedisNodes, key: str) -> int:
    return sum(bool(server.client().exists(key)) for server in nodes)


def _left(nodes: RedisNodes, locks: list[Any]) -> dict[str, int]:
    """The names some node still holds, with how many nodes."""
    held = {lock.name: _holders(nodes, lock.key) for lock in locks}
    return {name: count for name, count in held.items() if count}


class _Interrupt:
    """A ``KeyboardInterrupt`` from a signal receiver, once per name in ``names``."""

    def __init__(self, signal: Any, *names: str) -> None:
        self.signal = signal
        self.names = set(names)
        self.raised: list[KeyboardInterrupt] = []

    def __call__(self, sender: Any, name: str = "", **kwargs: Any) -> None:
        if name in self.names:
            self.names.discard(name)
            self.raised.append(KeyboardInterrupt(f"interrupt at {name}"))
            raise self.raised[-1]


@pytest.fixture
def interrupt() -> Iterator[Callable[..., _Interrupt]]:
    connected: list[_Interrupt] = []

    def connect(signal: Any, *names: str) -> _Interrupt:
        receiver = _Interrupt(signal, *names)
        signal.connect(receiver, weak=False)
        connected.append(receiver)
        return receiver

    yield connect
    for receiver in connected:
        receiver.signal.disconnect(receiver)


async def _cancel_when(task: asyncio.Task[Any], ready: Callable[[], bool]) -> None:
    """Cancel ``task`` as soon as ``ready()`` (checked every loop turn, 5 s at most)."""
    deadline = time.monotonic() + 5
    while not ready() and not task.done():
        assert time.monotonic() < deadline, "the step to cancel in never came"
        await asyncio.sleep(0)
    assert not task.done()
    task.cancel()


# -- a give-back is not cut short -----------------------------------------------------

@pytest.mark.parametrize("cancel_at", [2, 1])
def test_a_cancelled_multi_lock_release_releases_every_name(
        nodes3: RedisNodes, make_manager: MakeManager, cancel_at: int) -> None:
    """The release of ``c`` (then of ``b``) is cancelled, e.g. by an
    ``asyncio.timeout()`` at the exit of ``async with``::

        t0  release(): the multi-lock counts itself released; Drop(c) sent
        t1  cancelled: c's round completes (AsyncLock.release)
        t2  b and a: released before the CancelledError goes on

    They were left held, renewed for ever (``auto_renew``), and a second
    ``release()`` raised ``LockNotOwned``: nothing could free them."""
    mgr = make_manager(nodes3)

    async def scenario() -> tuple[dict[str, int], list[bool]]:
        ml = mgr.amulti_lock(["a", "b", "c"], ttl=30, auto_renew=True)
        assert await ml.acquire()
        task = asyncio.ensure_future(ml.release())
        await _cancel_when(task, lambda: ml._locks[cancel_at]._state == "unlocked")
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()  # the cancellation went on
        left = _left(nodes3, ml._locks)  # at once: the give-back was over
        with pytest.raises(LockNotOwned):
            await ml.release()
        return left, [lock.owned() for lock in ml._locks]

    left, owned = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert left == {} and owned == [False, False, False]


def test_a_task_cancelled_at_the_exit_of_async_with_multi_lock_releases_every_name(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)

    async def scenario() -> dict[str, int]:
        ml = mgr.amulti_lock(["x", "y", "z"], ttl=30)
        go = asyncio.Event()

        async def body() -> None:
            async with ml:
                await go.wait()

        task = asyncio.ensure_future(body())
        deadline = time.monotonic() + 5
        while not ml._held:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        go.set()  # the body ends; __aexit__ starts the release ...
        await _cancel_when(task, lambda: not ml._held)  # ... and the task is cancelled
        with pytest.raises(asyncio.CancelledError):
            await task
        return _left(nodes3, ml._locks)

    assert asyncio.run(asyncio.wait_for(scenario(), 20)) == {}


def test_an_interrupted_multi_lock_release_releases_every_name(
        nodes3: RedisNodes, make_manager: MakeManager, interrupt: Any) -> None:
    """The sync flavour: ``KeyboardInterrupt`` once ``c`` is released."""
    mgr = make_manager(nodes3)
    ml = mgr.multi_lock(["a", "b", "c"], ttl=30, auto_renew=True)
    assert ml.acquire()
    receiver = interrupt(events.lock_released, "c")
    with pytest.raises(KeyboardInterrupt) as raised:
        ml.release()
    assert raised.value is receiver.raised[0]
    assert _left(nodes3, ml._locks) == {}
    assert not any(lock.owned() for lock in ml._locks)


def test_a_multi_lock_acquire_interrupted_twice_gives_back_every_name(
        nodes3: RedisNodes, make_manager: MakeManager, interrupt: Any) -> None:
    """All or none, sync: the wait for ``d3`` is interrupted, and the give-back
    of ``d2`` is interrupted again; ``d1`` is given back all the same, and
    the first interrupt goes on."""
    mgr = make_manager(nodes3)
    other = make_manager(nodes3).lock("d3", ttl=30)
    assert other.acquire()
    ml = mgr.multi_lock(["d1", "d2", "d3"], ttl=30, timeout=0)
    first = interrupt(events.lock_not_acquired, "d3")
    second = interrupt(events.lock_released, "d2")
    with pytest.raises(KeyboardInterrupt) as raised:
        ml.acquire()
    assert second.raised, "the give-back was not interrupted"
    assert raised.value is first.raised[0]
    assert _left(nodes3, ml._locks[:2]) == {}
    assert not ml._held and not any(lock.owned() for lock in ml._locks)


def test_an_async_multi_lock_acquire_cancelled_twice_gives_back_every_name(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """All or none, asyncio: an ``asyncio.timeout()`` ends the wait for
    ``d3``, then the request's task is cancelled while ``d2`` is given back."""
    mgr = make_manager(nodes3)

    async def scenario() -> dict[str, int]:
        other = make_manager(nodes3).alock("d3", ttl=30)
        assert await other.acquire()
        ml = mgr.amulti_lock(["d1", "d2", "d3"], ttl=30, timeout=None)
        task = asyncio.ensure_future(ml.acquire())
        deadline = time.monotonic() + 5
        while not ml._locks[1].owned():  # d1, d2 taken; then d3 is waited for
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)
        task.cancel()  # 1st: the wait for d3 ends, the give-back begins
        await _cancel_when(task, lambda: ml._locks[1]._state == "unlocked")  # 2nd: in d2's
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not ml._held and not any(lock.owned() for lock in ml._locks)
        return _left(nodes3, ml._locks[:2])

    assert asyncio.run(asyncio.wait_for(scenario(), 20)) == {}


def test_a_cancelled_release_that_found_a_loss_still_ends_cancelled(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """``l1`` was taken from us (force-released on the nodes), and the release
    is cancelled in ``l3``'s round: ``l2`` is released all the same, and the
    cancellation goes on, not the ``LockLost`` of ``l1`` (its context)."""
    mgr = make_manager(nodes3)

    async def scenario() -> None:
        ml = mgr.amulti_lock(["l1", "l2", "l3"], ttl=30, auto_renew=False)
        assert await ml.acquire()
        for server in nodes3:
            server.client().delete(ml._locks[0].key)
        task = asyncio.ensure_future(ml.release())
        await _cancel_when(task, lambda: ml._locks[2]._state == "unlocked")
        with pytest.raises(asyncio.CancelledError) as raised:
            await task
        assert task.cancelled()
        # The LockLost is the cancellation's context: one link down, or two on
        # Python 3.10, whose await of a cancelled task raises a new
        # CancelledError with the task's own as its context.
        chain = [raised.value.__context__, getattr(raised.value.__context__, "__context__", None)]
        assert any(isinstance(e, LockLost) for e in chain), chain
        assert _left(nodes3, ml._locks) == {}

    asyncio.run(asyncio.wait_for(scenario(), 20))


# -- a loss does not replace the body's exception -------------------------------------

_KINDS = ["semaphore", "segments", "multi_lock"]


def _make(mgr: Any, kind: str, prefix: str = "") -> Any:
    options = dict(ttl=0.2, auto_renew=False, timeout=1)
    if kind == "semaphore":
        return getattr(mgr, prefix + "semaphore")("body-s", 2, **options)
    if kind == "segments":
        return getattr(mgr, prefix + "segments")("body-g", 2, **options)
    return getattr(mgr, prefix + "multi_lock")(["body-a", "body-b"], **options)


@pytest.mark.parametrize("kind", _KINDS)
@pytest.mark.parametrize("body_error", [ValueError, KeyboardInterrupt])
def test_a_loss_does_not_replace_the_exception_of_the_body(
        nodes3: RedisNodes, make_manager: MakeManager, kind: str, body_error: type,
        caplog: pytest.LogCaptureFixture) -> None:
    mgr = make_manager(nodes3)
    caplog.set_level(logging.WARNING, logger="django_redlock.engine")
    with pytest.raises(body_error, match="the body failed"):
        with _make(mgr, kind):
            time.sleep(0.3)  # the lease (0.2 s) runs out
            raise body_error("the body failed")
    assert f"while the body raised {body_error.__name__}" in caplog.text
    # A body that ended well still hears of the loss.
    with pytest.raises(LockLost):
        with _make(mgr, kind):
            time.sleep(0.3)


@pytest.mark.parametrize("kind", _KINDS)
def test_a_loss_does_not_swallow_the_cancellation_of_the_body(
        nodes3: RedisNodes, make_manager: MakeManager, kind: str) -> None:
    """A deadline (``asyncio.timeout()``, ``wait_for``) cancels the body after
    the lease ran out: the caller gets ``TimeoutError``, not ``LockLost``
    (which swallowed the cancellation: the deadline never fired, and a
    cancelled task ended with ``LockLost``)."""
    mgr = make_manager(nodes3)

    async def body() -> None:
        async with _make(mgr, kind, "a"):
            await asyncio.sleep(5)

    async def scenario() -> None:
        with pytest.raises(asyncio.TimeoutError):  # asyncio.timeout() is 3.11+
            await asyncio.wait_for(body(), 0.5)
        with pytest.raises(LockLost):  # a body that ended well still hears of it
            async with _make(mgr, kind, "a"):
                await asyncio.sleep(0.3)

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_a_loss_does_not_replace_the_exception_of_a_decorated_body(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)

    @with_semaphore("deco-<pk>", 2, ttl=0.2, auto_renew=False, timeout=1, manager=mgr)
    def work(pk: int) -> None:
        time.sleep(0.3)
        raise ValueError("the body failed")

    @with_multi_lock(["deco-a-<pk>", "deco-b-<pk>"], ttl=0.2, auto_renew=False, timeout=1,
                     manager=mgr)
    async def awork(pk: int) -> None:
        await asyncio.sleep(5)

    with pytest.raises(ValueError, match="the body failed"):
        work(1)

    async def scenario() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(awork(1), 0.5)

    asyncio.run(asyncio.wait_for(scenario(), 20))
