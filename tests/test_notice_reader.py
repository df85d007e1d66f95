"""Who reads the release notices: a waiting thread, in turn, and never nobody.

A process's waiting threads take turns reading its pub/sub connections (the
*read role*); the housekeeping thread reads only for asyncio waiters. These
tests pin down the hand-overs: a reader that is served or gives up passes the
role on, and no waiter is left without someone reading for it. The retry delay
is long (5 s) wherever a handoff is timed, so a waiter nobody read for would
show up as a slow handoff, not be rescued by its timer. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable

import pytest
import redis

from django_redlock.testing import RedisNodes
from tests.polling import wait_until
from tests.test_waiters import SLOW_RETRY, WaitingThread, _count_rounds, _queued, one_waiting

MakeManager = Callable[..., Any]
BY_NOTICE = 1.0  # a handoff by notice takes milliseconds; a missed one takes SLOW_RETRY


def _record_readers(mgr: Any) -> list[str]:
    """The names of the threads that read release notices for ``mgr``."""
    readers: list[str] = []
    notifier = mgr.notifier
    real = notifier._handle

    def recording(reply: Any, link: Any) -> None:
        if isinstance(reply, list) and reply and reply[0] == b"message":
            readers.append(threading.current_thread().name)
        real(reply, link)

    notifier._handle = recording
    return readers


def test_the_waiting_thread_reads_its_own_notice(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    holder = make_manager(nodes3)
    waiter = make_manager(nodes3, retry_delay=SLOW_RETRY)
    readers = _record_readers(waiter)
    lock = holder.lock("self-read")
    assert lock.acquire()
    waiting = WaitingThread(waiter, "self-read", thread_name="the-waiter")
    assert wait_until(lambda: _queued(nodes3, holder, "self-read") == 1)
    released = time.monotonic()
    lock.release()
    assert waiting.seconds_after(released) < BY_NOTICE, readers
    # No hop through another thread: the notice woke the waiter in select().
    assert readers == ["the-waiter"]


def test_waiting_threads_of_one_process_take_turns_reading(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    holder = make_manager(nodes3, retry_delay=SLOW_RETRY)
    waiters = make_manager(nodes3, retry_delay=SLOW_RETRY)  # one process, three threads
    readers = _record_readers(waiters)
    lock = holder.lock("turns")
    assert lock.acquire()
    order: list[int] = []

    def wait_then_hold(i: int) -> None:
        mine = waiters.lock("turns", timeout=10, auto_renew=False)
        if mine.acquire():
            order.append(i)
            time.sleep(0.05)
            mine.release()

    threads = []
    for i in range(3):
        t = threading.Thread(target=wait_then_hold, args=(i,), name=f"waiter-{i}")
        t.start()
        threads.append(t)
        assert wait_until(lambda n=i + 1: _queued(nodes3, holder, "turns") == n)
    assert sum(s.closed is False for group in waiters.notifier._subs.values()
               for s in group) == 3
    started = time.monotonic()
    lock.release()
    for t in threads:
        t.join(timeout=SLOW_RETRY)
    assert order == [0, 1, 2]
    # Three handoffs by notice, although the first two readers left the line.
    assert time.monotonic() - started < SLOW_RETRY
    assert readers and all(name.startswith("waiter-") for name in readers)
    assert waiters.notifier._reader is None and not waiters.notifier._followers


def test_a_reader_that_gives_up_hands_the_role_on(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    holder = make_manager(nodes3)
    waiters = make_manager(nodes3, retry_delay=SLOW_RETRY)
    lock = holder.lock("impatient-reader")
    assert lock.acquire()
    impatient = threading.Thread(
        target=lambda: waiters.lock("impatient-reader", timeout=0.6).acquire())
    impatient.start()  # first to wait: it reads
    assert wait_until(lambda: _queued(nodes3, holder, "impatient-reader") == 1)
    assert wait_until(lambda: waiters.notifier._reader is not None)
    patient = WaitingThread(waiters, "impatient-reader")
    impatient.join(timeout=SLOW_RETRY)
    assert not impatient.is_alive()
    assert wait_until(lambda: _queued(nodes3, holder, "impatient-reader") == 1)
    released = time.monotonic()
    lock.release()
    assert patient.seconds_after(released) < BY_NOTICE


@pytest.mark.parametrize("first", ["sync", "async"])
def test_sync_and_async_waiters_in_one_process_are_both_woken(
        nodes3: RedisNodes, make_manager: MakeManager, first: str) -> None:
    """The sync waiter reads for the asyncio one while it waits, and once it
    left, the housekeeping thread does (the event loop cannot block to read)."""
    holder = make_manager(nodes3)
    both = make_manager(nodes3, retry_delay=SLOW_RETRY)
    lock = holder.lock("mixed")
    assert lock.acquire()
    served: dict[str, float] = {}
    loop_ready = threading.Event()

    def sync_waiter() -> None:
        mine = both.lock("mixed", timeout=10, auto_renew=False)
        if mine.acquire():
            served["sync"] = time.monotonic()
            time.sleep(0.05)
            mine.release()

    async def async_waiter() -> None:
        mine = both.alock("mixed", timeout=10, auto_renew=False)
        loop_ready.set()
        if await mine.acquire():
            served["async"] = time.monotonic()
            await asyncio.sleep(0.05)
            await mine.release()

    def run_loop() -> None:
        asyncio.run(asyncio.wait_for(async_waiter(), 15))

    starters = {"sync": sync_waiter, "async": run_loop}
    second = "async" if first == "sync" else "sync"
    threads = [threading.Thread(target=starters[first]), threading.Thread(target=starters[second])]
    threads[0].start()
    assert wait_until(lambda: _queued(nodes3, holder, "mixed") == 1)
    threads[1].start()
    assert wait_until(lambda: _queued(nodes3, holder, "mixed") == 2)
    released = time.monotonic()
    lock.release()
    for t in threads:
        t.join(timeout=2 * SLOW_RETRY)
    assert loop_ready.is_set()
    assert set(served) == {"sync", "async"}
    assert served[first] < served[second]
    # Both handoffs by notice: no timer rescued either waiter.
    assert served[second] - released < 2 * BY_NOTICE


def test_a_subscription_is_confirmed_by_every_live_node_before_it_returns(
        redis_nodes_factory: Callable[..., RedisNodes], make_manager: MakeManager) -> None:
    """A waiter may queue on the gate node alone, and a release there skips an
    entry nobody listens for: so every node must deliver before the waiter queues."""
    nodes = redis_nodes_factory(5)
    nodes[4].kill()  # known down after one refused connect: not waited for
    mgr = make_manager(nodes)
    notifier = mgr.notifier
    started = time.monotonic()
    sub = notifier.subscribe(b"redlock:everywhere", confirm_timeout=3.0)
    took = time.monotonic() - started
    try:
        assert took < 2.0, f"waited {took:.2f} s for the dead node"
        for url in nodes.urls[:4]:
            client = redis.Redis.from_url(str(url))
            try:
                assert client.publish(notifier.inbox, b"probe") == 1, url
                assert client.publish(b"redlock:everywhere", b"probe") == 1, url
            finally:
                client.close()
    finally:
        sub.close()


def test_a_reader_whose_connections_drop_is_woken_and_then_served_by_notice(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    holder, lock, waiting = one_waiting(nodes3, make_manager, "dropped", timeout=15)
    waiter = waiting._lock.manager
    rounds = _count_rounds(waiter)  # counted from here: the test reads differences
    assert wait_until(lambda: waiter.notifier._reader is not None)  # the waiter reads
    before = rounds[0]
    for url in nodes3.urls:  # the server closes every pub/sub connection
        client = redis.Redis.from_url(str(url))
        try:
            client.client_kill_filter(_type="pubsub")
        finally:
            client.close()
    # The drop wakes the reader (a notice may have been missed): it retries at
    # once instead of sleeping out its 5 s timer.
    assert wait_until(lambda: rounds[0] > before, timeout=2.0)
    links = waiter.notifier._links
    assert wait_until(lambda: all(link.sock is not None
                                  and waiter.notifier.inbox in link.subscribed
                                  for link in links), timeout=3.0), "not resubscribed"
    released = time.monotonic()
    lock.release()
    assert waiting.seconds_after(released) < BY_NOTICE


def test_a_subscription_waits_for_a_reconnected_node_to_confirm_again(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    notifier = mgr.notifier
    first = notifier.subscribe(b"redlock:again", confirm_timeout=3.0)  # keeps it subscribed
    try:
        node0 = redis.Redis.from_url(str(nodes3.urls[0]))
        try:
            node0.client_kill_filter(_type="pubsub")
            link = notifier._links[0]
            # Nobody waits, so the housekeeping thread notices the drop on its round.
            assert wait_until(lambda: b"redlock:again" not in link.subscribed, timeout=3.0)
            second = notifier.subscribe(b"redlock:again", confirm_timeout=3.0)
            try:
                # Node 0 delivers again before the new waiter could queue there.
                assert node0.publish(notifier.inbox, b"probe") == 1
                assert node0.publish(b"redlock:again", b"probe") == 1
            finally:
                second.close()
        finally:
            node0.close()
    finally:
        first.close()
