"""The waiter queue: a release wakes the first waiter in line, and only that one.

Each manager stands for a process: it has its own listener and inbox channel.
The retry delay is long (5 s) wherever a test measures a handoff, so a waiter
that the release did not wake by name would show up as a slow handoff instead
of being rescued by its timer. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import threading
import time
import zlib
from typing import Any, Callable

import redis

from django_redlock.core.keys import waiters_key
from django_redlock.core.owner import new_token, owner_json
from django_redlock.testing import RedisNodes
from tests.polling import wait_until

MakeManager = Callable[..., Any]
SLOW_RETRY = 5.0  # longer than any handoff below may take


def _queues(nodes: RedisNodes, mgr: Any, name: str) -> list[list[bytes]]:
    key = waiters_key(mgr.key(name))
    out = []
    for url in nodes.urls:
        client = redis.Redis.from_url(str(url))
        try:
            out.append(client.lrange(key, 0, -1))
        finally:
            client.close()
    return out


def _queued(nodes: RedisNodes, mgr: Any, name: str) -> int:
    return max(len(q) for q in _queues(nodes, mgr, name))


class WaitingThread:
    """A thread that waits for ``name`` through ``mgr`` and keeps it once served,
    noting when its ``acquire()`` returned."""

    def __init__(self, mgr: Any, name: str, *, timeout: float = 10.0,
                 thread_name: str | None = None) -> None:
        self._lock = mgr.lock(name, timeout=timeout)
        self.served_at: float | None = None
        self.thread = threading.Thread(target=self._run, name=thread_name)
        self.thread.start()

    def _run(self) -> None:
        if self._lock.acquire():
            self.served_at = time.monotonic()

    def seconds_after(self, released: float, join: float = SLOW_RETRY) -> float:
        """Join (at most ``join`` s); the seconds from ``released`` until it was
        served. Fails the test when it was not served."""
        self.thread.join(timeout=join)
        assert self.served_at is not None, "the waiter was not served"
        return self.served_at - released


def one_waiting(nodes: Any, make_manager: MakeManager, name: str, *, timeout: float = 10.0,
                **waiter_options: Any) -> tuple[Any, Any, WaitingThread]:
    """A holder holds ``name`` and one waiter (its own manager: its own process,
    retry delay ``SLOW_RETRY`` unless given) stands in line for it, for at most
    ``timeout`` s. Returns (holder manager, held lock, the waiting thread)."""
    waiter_options.setdefault("retry_delay", SLOW_RETRY)
    holder = make_manager(nodes)
    waiter = make_manager(nodes, **waiter_options)
    lock = holder.lock(name)
    assert lock.acquire()
    waiting = WaitingThread(waiter, name, timeout=timeout)
    assert wait_until(lambda: _queued(nodes, holder, name) == 1), "not queued"
    return holder, lock, waiting


def _count_rounds(mgr: Any) -> list[int]:
    """Count the manager's acquire rounds (each is one attempt on the nodes)."""
    calls = [0]
    real = mgr._acquire_round

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    mgr._acquire_round = counting
    return calls


class Line:
    """One thread per manager waits for ``name`` (held by ``holder``), each
    started once the one before it stands in line; each, when served, holds
    for 50 ms and releases. ``served``: (manager, fence) in the order served."""

    def __init__(self, nodes: Any, holder: Any, managers: list[Any], name: str) -> None:
        self.name = name
        self.served: list[tuple[Any, int]] = []
        self.threads: list[threading.Thread] = []
        for i, mgr in enumerate(managers):
            t = threading.Thread(target=self._wait_then_hold, args=(mgr,))
            t.start()
            self.threads.append(t)
            assert wait_until(lambda n=i + 1: _queued(nodes, holder, name) == n), "not queued"

    def _wait_then_hold(self, mgr: Any) -> None:
        mine = mgr.lock(self.name, timeout=10, auto_renew=False)
        if mine.acquire():
            self.served.append((mgr, mine.fence))
            time.sleep(0.05)
            mine.release()

    def join(self, timeout: float = 10.0) -> None:
        """Wait for every thread, at most ``timeout`` s in all."""
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))


def test_waiters_are_served_one_at_a_time_in_arrival_order(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    holder = make_manager(nodes3, retry_delay=SLOW_RETRY)
    waiters = [make_manager(nodes3, retry_delay=SLOW_RETRY) for _ in range(3)]
    lock = holder.lock("line")
    assert lock.acquire()
    line = Line(nodes3, holder, waiters, "line")
    started = time.monotonic()
    lock.release()
    line.join()
    assert [mgr for mgr, _ in line.served] == waiters
    # Three handoffs, each by notice: far below one retry delay in all.
    assert time.monotonic() - started < SLOW_RETRY
    assert _queued(nodes3, holder, "line") == 0


def test_a_release_wakes_only_the_waiter_it_names(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    holder = make_manager(nodes3, retry_delay=SLOW_RETRY)
    first, second = (make_manager(nodes3, retry_delay=SLOW_RETRY) for _ in range(2))
    second_rounds = _count_rounds(second)
    lock = holder.lock("one-at-a-time")
    assert lock.acquire()
    got: dict[str, Any] = {}

    def wait(label: str, mgr: Any) -> None:
        mine = mgr.lock("one-at-a-time", timeout=10, auto_renew=False)
        if mine.acquire():
            got[label] = time.monotonic()
            time.sleep(1.0)  # hold: the second waiter must sleep through this
            mine.release()

    t1 = threading.Thread(target=wait, args=("first", first))
    t1.start()
    assert wait_until(lambda: _queued(nodes3, holder, "one-at-a-time") == 1)
    t2 = threading.Thread(target=wait, args=("second", second))
    t2.start()
    assert wait_until(lambda: _queued(nodes3, holder, "one-at-a-time") == 2)
    rounds_before = second_rounds[0]
    released = time.monotonic()
    lock.release()
    assert wait_until(lambda: "first" in got, timeout=3.0)
    assert got["first"] - released < 1.0
    time.sleep(0.3)  # the first holds; a broadcast notice would have made the second retry
    assert second_rounds[0] == rounds_before
    t1.join(timeout=10)
    t2.join(timeout=10)
    assert "second" in got  # and its turn came with the first's release


def test_a_waiter_that_gives_up_leaves_the_line(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    holder, waiter = make_manager(nodes3), make_manager(nodes3, retry_delay=0.05)
    lock = holder.lock("impatient")
    assert lock.acquire()
    assert waiter.lock("impatient", timeout=0.3).acquire() is False
    assert _queued(nodes3, holder, "impatient") == 0
    lock.release()


def test_an_entry_whose_inbox_nobody_listens_to_is_skipped(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    holder, lock, live = one_waiting(nodes3, make_manager, "ghost-line")
    key = waiters_key(holder.key("ghost-line"))
    for url in nodes3.urls:  # dead processes' waiters stand first in line everywhere
        client = redis.Redis.from_url(str(url))
        for i in range(3):
            client.lpush(key, b"redlock:inbox:gone-%d|token-of-a-dead-process" % i)
        client.close()
    released = time.monotonic()
    lock.release()
    # By name, not by its 5 s timer.
    assert live.seconds_after(released, join=SLOW_RETRY - 1) < 1.0
    assert _queued(nodes3, holder, "ghost-line") == 0


def test_a_lock_named_like_a_process_inbox_does_not_take_its_notices(
        nodes3: RedisNodes, make_manager: MakeManager, monkeypatch: Any) -> None:
    """A lock's release channel is its key, ``<prefix>:<name>``; a process's
    inbox must be a channel no lock key can be. It was ``redlock:inbox:<token>``,
    the channel of lock ``inbox:<token>`` under the default prefix: waiting on
    that lock (a name from a query string, say) and giving up made the process
    unsubscribe its own inbox once the channel had lingered, and from then on
    every release skipped its waiters' entries (nobody listening) and they
    waited for their retry timer."""
    from django_redlock.transport import notify

    monkeypatch.setattr(notify, "LINGER", 0.2)
    holder = make_manager(nodes3)
    waiter = make_manager(nodes3, retry_delay=SLOW_RETRY)
    # The name whose key was the inbox: 'inbox:<the inbox's token>'.
    name = "inbox:" + waiter.notifier.inbox.decode().rsplit(":", 1)[1]
    busy = holder.lock(name)
    assert busy.acquire()
    assert waiter.lock(name, timeout=0.2).acquire() is False
    # Its channel lingers, then is dropped: that must not be the inbox.
    assert wait_until(lambda: waiter.key(name).encode() not in waiter.notifier._requested,
                      timeout=3.0)
    time.sleep(0.3)  # the UNSUBSCRIBE went out
    busy.release()
    lock = holder.lock("after-the-inbox-name")
    assert lock.acquire()
    waiting = WaitingThread(waiter, "after-the-inbox-name", timeout=10)
    assert wait_until(lambda: _queued(nodes3, holder, "after-the-inbox-name") == 1), "not queued"
    released = time.monotonic()
    lock.release()
    # By name, not by its 5 s timer.
    assert waiting.seconds_after(released, join=SLOW_RETRY + 2) < 1.0


def test_the_waiter_queue_expires(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    holder, waiter = make_manager(nodes3, ttl=2.0), make_manager(nodes3, retry_delay=SLOW_RETRY)
    lock = holder.lock("tidy")
    assert lock.acquire()
    t = threading.Thread(target=lambda: waiter.lock("tidy", timeout=1.0).acquire())
    t.start()
    assert wait_until(lambda: _queued(nodes3, holder, "tidy") == 1)
    key = waiters_key(holder.key("tidy"))
    ttls = []
    for url in nodes3.urls:
        client = redis.Redis.from_url(str(url))
        if client.exists(key):
            ttls.append(client.pttl(key))
        client.close()
    assert ttls and all(0 < ttl <= 2_000 + 30_000 for ttl in ttls)
    t.join(timeout=5)
    lock.release()


def async_handoff_seconds(nodes: Any, holder: Any, waiter: Any, name: str) -> float:
    """Hold ``name`` with ``holder``, let an asyncio waiter of ``waiter`` queue
    for it, release: the seconds from that release to the waiter's ``acquire()``
    returning (a handoff by notice takes milliseconds, one by timer seconds)."""
    lock = holder.lock(name)
    assert lock.acquire()

    async def wait() -> float:
        mine = waiter.alock(name, timeout=10, auto_renew=False)
        try:
            assert await mine.acquire()
            took = time.monotonic()
            await mine.release()
            return took
        finally:
            await waiter.aclose()

    def release_when_queued() -> None:
        if wait_until(lambda: _queued(nodes, holder, name) == 1):
            times.append(time.monotonic())
        lock.release()

    times: list[float] = []
    releaser = threading.Thread(target=release_when_queued)
    releaser.start()
    took = asyncio.run(asyncio.wait_for(wait(), 15))
    releaser.join(timeout=10)
    assert times, "the async waiter never queued"
    return took - times[0]


def test_an_async_waiter_is_woken_by_name(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    holder = make_manager(nodes3)
    waiter = make_manager(nodes3, retry_delay=SLOW_RETRY)
    assert async_handoff_seconds(nodes3, holder, waiter, "async-line") < 1.0


def test_a_waiter_served_without_a_notice_leaves_the_line(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    # The holder never releases: its lease runs out, and the waiter's timer
    # finds the lock free. Its entry must not stay behind to swallow a notice.
    holder = make_manager(nodes3, ttl=0.5, auto_renew=False)
    waiter = make_manager(nodes3, retry_delay=0.1)
    assert holder.lock("expired").acquire()
    mine = waiter.lock("expired", timeout=5, auto_renew=False)
    assert mine.acquire()
    assert _queued(nodes3, holder, "expired") == 0
    mine.release()


def test_a_cancelled_async_waiter_leaves_the_line(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    holder, waiter = make_manager(nodes3), make_manager(nodes3, retry_delay=SLOW_RETRY)
    lock = holder.lock("cancelled")
    assert lock.acquire()

    async def wait_then_cancel() -> int:
        task = asyncio.ensure_future(waiter.alock("cancelled", timeout=None).acquire())
        for _ in range(200):  # bounded: 2 s
            if _queued(nodes3, holder, "cancelled") == 1:
                break
            await asyncio.sleep(0.01)
        queued = _queued(nodes3, holder, "cancelled")
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        await waiter.aclose()
        return queued

    assert asyncio.run(asyncio.wait_for(wait_then_cancel(), 15)) == 1
    assert _queued(nodes3, holder, "cancelled") == 0
    assert lock.release() is None


def test_a_waiter_served_while_a_node_is_busy_leaves_that_nodes_line(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    # One node keeps a stray copy of someone else's lock, so it answers busy in
    # the round that serves the waiter, and puts the waiter in its line. The
    # waiter, served by the other two, must leave that line too: else that
    # node's next release would wake it in vain while others wait.
    holder = make_manager(nodes3, retry_delay=SLOW_RETRY)
    waiter = make_manager(nodes3, retry_delay=SLOW_RETRY)
    key = holder.key("split")
    stray = (zlib.crc32(key.encode()) % 3 + 1) % 3  # not the gate node
    nodes3[stray].client().set(key, f"{new_token()}|7|{owner_json('stray')}", px=30_000)
    lock = holder.lock("split")
    assert lock.acquire()  # on the other two nodes: a quorum
    served: list[bool] = []

    def wait() -> None:
        mine = waiter.lock("split", timeout=10, auto_renew=False)
        if mine.acquire():
            served.append(True)
            mine.release()

    thread = threading.Thread(target=wait)
    thread.start()
    assert wait_until(lambda: _queued(nodes3, holder, "split") == 1), "not queued"
    lock.release()
    thread.join(timeout=10)
    assert served == [True]
    assert wait_until(lambda: _queued(nodes3, holder, "split") == 0, timeout=2.0), \
        _queues(nodes3, holder, "split")


def _stale_copy_on_the_gate(nodes: RedisNodes, holder: Any, name: str) -> float:
    """The holder's release reached every node but the lock's gate node (a cut
    link, say): its copy there lives until its lease ends. Returns when."""
    key = holder.key(name)
    gate = zlib.crc32(key.encode()) % len(nodes.urls)
    for i, server in enumerate(nodes):
        if i != gate:
            server.client().delete(key)
    return time.monotonic()


def test_a_stale_copy_on_the_gate_node_does_not_stall_the_waiters(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    # Waiters' retries ask the gate node first. When it holds a stale copy and
    # no notice comes, they must still get the lock, which a majority has free,
    # within a few retry delays, not when that copy expires 30 s later.
    holder = make_manager(nodes3, ttl=30, auto_renew=False)
    waiter = make_manager(nodes3, retry_delay=0.2)
    assert holder.lock("stale-gate").acquire()
    got: dict[str, float] = {}

    def wait() -> None:
        mine = waiter.lock("stale-gate", timeout=10, auto_renew=False)
        if mine.acquire():
            got["at"] = time.monotonic()
            mine.release()

    thread = threading.Thread(target=wait)
    thread.start()
    assert wait_until(lambda: _queued(nodes3, holder, "stale-gate") == 1), "not queued"
    freed = _stale_copy_on_the_gate(nodes3, holder, "stale-gate")
    thread.join(timeout=15)
    assert "at" in got, "the waiter stalled behind the gate node's stale copy"
    assert got["at"] - freed < 2.0


def test_a_stale_copy_on_the_gate_node_does_not_stall_an_async_waiter(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    holder = make_manager(nodes3, ttl=30, auto_renew=False)
    waiter = make_manager(nodes3, retry_delay=0.2)
    assert holder.lock("stale-gate-a").acquire()

    async def scenario() -> float:
        task = asyncio.ensure_future(
            waiter.alock("stale-gate-a", timeout=10, auto_renew=False).acquire())
        for _ in range(200):  # bounded: 2 s
            if _queued(nodes3, holder, "stale-gate-a") == 1:
                break
            await asyncio.sleep(0.01)
        freed = _stale_copy_on_the_gate(nodes3, holder, "stale-gate-a")
        assert await asyncio.wait_for(task, 15)
        took = time.monotonic() - freed
        await waiter.aclose()
        return took

    assert asyncio.run(scenario()) < 2.0


def _take_turns(urls: list[str], name: str, start: Any, seconds: float, out: Any) -> None:
    """One process of the test below: once every process is ready (``start``, a
    barrier), acquire, GET/SET a counter, release, in a loop for ``seconds``, at
    most 5,000 turns; puts (turns, error or None) on ``out``."""
    from django_redlock import LockManager

    mgr = LockManager(urls, retry_delay=0.5, node_timeout=2.0)
    counter = redis.Redis.from_url(urls[0])
    turns, error = 0, None
    try:
        counter.ping()
        start.wait(timeout=30)
        end = time.monotonic() + seconds
        while time.monotonic() < end and turns < 5000:
            lock = mgr.lock(name, timeout=5)
            if not lock.acquire():
                error = "not acquired within 5 s"
                break
            try:
                counter.set(name + ":n", int(counter.get(name + ":n") or 0) + 1)
                turns += 1
            finally:
                lock.release()
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = f"{type(e).__name__}: {e}"
    finally:
        counter.close()
        mgr.close()
    out.put((turns, error))


def test_processes_looping_on_one_lock_all_get_their_turns(nodes3: RedisNodes) -> None:
    """Three processes acquire, update a plain GET/SET counter and release in a
    loop. Each gets a fair share: a release hands the lock to the first in
    line and wakes it, and the releaser steps back (manager.HANDOFF_YIELD). Its
    smallest share measured 0.90-0.98 of the mean; with releases that wake
    nobody (waiters left to their retry timers), one process got 1 turn in the
    2 s while another got over 3,000. No two holds overlap: the counter equals
    the turns taken. Bounded: 2 s and 5,000 turns per process."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    urls = [str(url) for url in nodes3.urls]
    start = ctx.Barrier(3)  # spawned children import and connect first
    procs = [ctx.Process(target=_take_turns, args=(urls, "turns", start, 2.0, out),
                         daemon=True) for _ in range(3)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    turns = [t for t, _ in results]
    assert not [e for _, e in results if e], results
    counter = redis.Redis.from_url(urls[0])
    try:
        assert int(counter.get("turns:n") or 0) == sum(turns)
    finally:
        counter.close()
    mean = sum(turns) / len(turns)
    assert mean > 50, turns
    assert min(turns) >= 0.6 * mean, f"a process was starved of turns: {turns}"
