"""Bursts of first acquisitions under load never see a false outage (issue 25).

A freshly started process meeting a burst used to open one connection per
acquisition and node at once, each bounded by the node timeout; under load the
handshakes timed out and a healthy quorum answered ``QuorumUnavailable``. The
guard below runs 200 concurrent acquisitions (asyncio tasks and threads), on a
cold manager and then warm, with a CPU hog on every core, all nodes up and with
one node of three down, and counts:

* ``QuorumUnavailable`` (must be 0: a quorum is up),
* overlaps, by a counter on a separate Redis incremented inside the critical
  section (must be 0),
* locks lost before their lease (must be 0).

With a majority down, every call gets the typed error within its bound.
Bounded: 200 acquisitions of 20 names, each held ~1 ms, each with a finite
timeout; the hogs are killed at teardown.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Iterator

import pytest
import redis

from django_redlock import LockManager
from django_redlock.exceptions import LockLost, LockNotAcquired, QuorumUnavailable
from django_redlock.testing import RedisNodes, _free_port

pytestmark = pytest.mark.slow

BURST = 200
NAMES = 20
#: Each acquisition's own wait: generous, the locks are contended 10 to 1.
WAIT = 30.0


@pytest.fixture(scope="module")
def counter_node() -> Iterator[RedisNodes]:
    with RedisNodes(1) as nodes:
        yield nodes


@pytest.fixture
def cpu_hogs() -> Iterator[None]:
    """A busy process on every core for the duration of the test."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=10)


def _down_url() -> str:
    """A loopback port nobody listens on: a node that is down."""
    return f"redis://127.0.0.1:{_free_port()}/0"


class Tally:
    def __init__(self, counter_url: str) -> None:
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self.client = redis.Redis.from_url(counter_url)
        self.client.flushall()

    def note(self, what: str, detail: str = "") -> None:
        with self._lock:
            self.counts[what] += 1
            if detail and len(self.errors) < 5:
                self.errors.append(detail)

    def inside(self, name: str) -> None:
        """The critical section: nobody else may be in it meanwhile."""
        if self.client.incr(f"in:{name}") != 1:
            self.note("overlap")
        time.sleep(0.001)
        self.client.decr(f"in:{name}")


async def _async_burst(manager: LockManager, tally: Tally) -> None:
    async def one(k: int) -> None:
        name = f"burst:{k % NAMES}"
        try:
            async with manager.alock(name, ttl=10, timeout=WAIT):
                await asyncio.to_thread(tally.inside, name)
            tally.note("ok")
        except QuorumUnavailable as e:
            tally.note("quorum", str(e))
        except LockLost as e:
            tally.note("lost", str(e))
        except LockNotAcquired as e:
            tally.note("busy", str(e))

    await asyncio.gather(*(one(k) for k in range(BURST)))


def _thread_burst(manager: LockManager, tally: Tally) -> None:
    start = threading.Barrier(BURST)

    def one(k: int) -> None:
        name = f"burst:{k % NAMES}"
        start.wait(timeout=30)
        try:
            with manager.lock(name, ttl=10, timeout=WAIT):
                tally.inside(name)
            tally.note("ok")
        except QuorumUnavailable as e:
            tally.note("quorum", str(e))
        except LockLost as e:
            tally.note("lost", str(e))
        except LockNotAcquired as e:
            tally.note("busy", str(e))

    threads = [threading.Thread(target=one, args=(k,)) for k in range(BURST)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=WAIT + 30)
    assert not any(thread.is_alive() for thread in threads)


def _run(flavour: str, manager: LockManager, tally: Tally) -> None:
    if flavour == "asyncio":
        asyncio.run(_async_burst(manager, tally))
    else:
        _thread_burst(manager, tally)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("down", [0, 1], ids=["all-up", "one-down"])
@pytest.mark.parametrize("flavour", ["asyncio", "threads"])
def test_burst_of_first_acquisitions_under_load(flavour: str, down: int, nodes3: RedisNodes,
                                                counter_node: RedisNodes, cpu_hogs: None) -> None:
    urls = list(nodes3.urls)
    for i in range(down):
        urls[i] = _down_url()
    manager = LockManager(urls)  # the defaults: NODE_TIMEOUT 0.1 s
    try:
        for phase in ("cold", "warm"):
            tally = Tally(counter_node.urls[0])
            _run(flavour, manager, tally)
            assert tally.counts == Counter(ok=BURST), (phase, dict(tally.counts), tally.errors)
    finally:
        manager.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flavour", ["asyncio", "threads"])
def test_majority_down_gives_the_typed_error_within_the_bound(
        flavour: str, nodes3: RedisNodes) -> None:
    urls = [_down_url(), _down_url(), nodes3.urls[2]]
    manager = LockManager(urls, node_timeout=0.1)
    bound = 0.3
    slow: list[float] = []
    errors: list[BaseException] = []

    def check(started: float, error: BaseException | None) -> None:
        took = time.monotonic() - started
        if not isinstance(error, QuorumUnavailable):
            errors.append(error or AssertionError("acquired without a quorum"))
        if took > bound + manager.node_timeout + 0.5:  # slack: the shared machine
            slow.append(took)

    async def one_async() -> None:
        started = time.monotonic()
        try:
            async with manager.alock("burst:down", timeout=bound):
                pass
        except QuorumUnavailable as e:
            check(started, e)
            return
        check(started, None)

    def one_sync() -> None:
        started = time.monotonic()
        try:
            with manager.lock("burst:down", timeout=bound):
                pass
        except QuorumUnavailable as e:
            check(started, e)
            return
        check(started, None)

    async def burst() -> None:
        await asyncio.gather(*(one_async() for _ in range(50)))

    try:
        if flavour == "asyncio":
            asyncio.run(burst())
        else:
            threads = [threading.Thread(target=one_sync) for _ in range(50)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=30)
        assert not errors, errors[:3]
        assert not slow, sorted(slow)[-3:]
        # Every node that did not count is named, with its reason.
        with pytest.raises(QuorumUnavailable) as info:
            manager.lock("burst:down", timeout=0).acquire()
        assert set(info.value.errors) == {manager.nodes[0].name, manager.nodes[1].name}
        assert "refused" in str(info.value).lower()
    finally:
        manager.close()

