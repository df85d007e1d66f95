"""The counting semaphore: at most ``permits`` holders, on real nodes (1 and 3).

Holders run in several OS processes and count themselves inside the critical
section in a separate Redis (the *meter*) and in a database shared by the
processes; the highest count seen must never exceed ``permits``. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from django_redlock import LockLost, LockNotAcquired, QuorumUnavailable, RedlockError
from django_redlock.core.keys import lock_key, permits_key, waiters_key
from django_redlock.decorators import with_semaphore
from django_redlock.engine import semaphore as semaphore_module
from django_redlock.testing import RedisNodes
from tests.family_exclusion import assert_no_lost_update, run_workers
from tests.polling import run_in_threads, wait_until

MakeManager = Callable[..., Any]
NodesFactory = Callable[..., RedisNodes]

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent

#: Enter: count one more holder and keep the highest count seen; exit: one less.
ENTER = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
return n
"""


class Meter:
    """Counts the holders inside the critical section, in a Redis of its own."""

    def __init__(self, nodes: RedisNodes) -> None:
        self.url = nodes.urls[0]
        self.client = nodes[0].client()
        self.client.delete("inside", "most", "done")

    def enter(self) -> None:
        self.client.eval(ENTER, 2, "inside", "most")

    def leave(self) -> None:
        self.client.incr("done")
        self.client.decr("inside")

    @property
    def most(self) -> int:
        return int(self.client.get("most") or 0)

    @property
    def done(self) -> int:
        return int(self.client.get("done") or 0)


def _holders(nodes: RedisNodes, key: str) -> int:
    return sum(bool(server.client().exists(key)) for server in nodes)


# -- the bound, across processes ------------------------------------------------------

@pytest.mark.parametrize("count", [1, 3])
def test_never_more_than_permits_holders_across_processes(
        count: int, redis_nodes_factory: NodesFactory, tmp_path: Path) -> None:
    """Four processes, two permits: counted inside the hold in Redis and in the
    database (a holder count, and each permit's rows read-modify-written, the
    fenced one with the permit's fence)."""
    nodes = redis_nodes_factory(count)
    meter = redis_nodes_factory(1)
    procs, rounds, permits = 4, 6, 2
    outcome = run_workers("semaphore", nodes, meter, tmp_path, procs=procs, rounds=rounds,
                          permits=permits)
    slots = [f"permit:{i}" for i in range(permits)]
    assert sum(outcome.holds(slot) for slot in slots) == procs * rounds
    # Never more than permits; and more than one at a time (a semaphore, not a mutex).
    assert outcome.meter["most:procs"] == permits
    assert 1 <= outcome.counters["most"] <= permits and outcome.counters["inside"] == 0
    # One holder per permit at a time: no update of a permit's rows was lost.
    assert_no_lost_update(outcome, slots)


def test_async_semaphore_never_more_than_permits(
        nodes3: RedisNodes, redis_nodes_factory: NodesFactory,
        make_manager: MakeManager) -> None:
    meter = Meter(redis_nodes_factory(1))
    mgr = make_manager(nodes3)
    inside = [0]
    most = [0]

    async def worker(full: asyncio.Event) -> None:
        for turn in range(5):
            async with mgr.asemaphore("async-procs", 3, timeout=30) as held:
                assert held.owned() and 0 <= held.index < 3 and held.fence > 0
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                if inside[0] == 3:
                    full.set()
                meter.enter()
                if turn == 0:
                    # The first holders stay until the semaphore is full once, so
                    # the count is checked at its bound whatever the machine's
                    # load (CI once saw at most 2 inside with 10 ms holds).
                    await asyncio.wait_for(full.wait(), 20)
                await asyncio.sleep(0.01)
                meter.leave()
                inside[0] -= 1

    async def scenario() -> None:
        full = asyncio.Event()
        await asyncio.wait_for(asyncio.gather(*(worker(full) for _ in range(6))), 60)

    asyncio.run(scenario())
    assert meter.done == 30
    assert meter.most == most[0] == 3


# -- waiting: woken by a release, in arrival order ---------------------------------

@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_a_release_wakes_a_waiter_at_once(flavour: str, nodes3: RedisNodes,
                                          make_manager: MakeManager) -> None:
    """The holder's lease is 10 s: a waiter served well under that was woken by
    the release, not by a timer."""
    mgr = make_manager(nodes3)
    holder = mgr.semaphore("wake", 1, ttl=10)
    assert holder.acquire()
    released_at = [0.0]

    def release_later() -> None:
        time.sleep(0.3)
        released_at[0] = time.monotonic()
        holder.release()

    releaser = threading.Thread(target=release_later)
    releaser.start()
    if flavour == "sync":
        waiter = mgr.semaphore("wake", 1, timeout=10)
        assert waiter.acquire()
    else:
        async def wait() -> Any:
            waiter = mgr.asemaphore("wake", 1, timeout=10)
            assert await waiter.acquire()
            return waiter

        waiter = asyncio.run(wait())
    served = time.monotonic() - released_at[0]
    releaser.join(5)
    assert released_at[0] > 0
    assert served < 1.0, f"served {served:.3f} s after the release"
    assert waiter.owned() and waiter.index == 0
    if flavour == "sync":
        waiter.release()
    else:
        asyncio.run(waiter.release())


@pytest.mark.parametrize("count", [1, 3])
def test_waiters_are_served_in_arrival_order(count: int, redis_nodes_factory: NodesFactory,
                                             make_manager: MakeManager) -> None:
    nodes = redis_nodes_factory(count)
    mgr = make_manager(nodes)
    holders = [mgr.semaphore("fifo", 2) for _ in range(2)]
    assert all(h.acquire() for h in holders)
    line_key = lock_key(mgr.key_prefix, "fifo#line")
    queue = waiters_key(line_key)
    served: list[tuple[float, int]] = []

    def waiter(i: int) -> None:
        with mgr.semaphore("fifo", 2, timeout=30) as held:
            # When its permit was granted (before it handed the line on), not
            # when this thread got to run again afterwards.
            served.append((held.lock._acquired_at, i))

    threads = []
    for i in range(6):
        t = threading.Thread(target=waiter, args=(i,), daemon=True)
        t.start()
        threads.append(t)
        # The first becomes the head (holds the line); each next one queues behind.
        assert wait_until(lambda i=i: _holders(nodes, line_key) == count if i == 0 else
                          max(s.client().llen(queue) for s in nodes) >= i, timeout=10)
    holders[0].release()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert [i for _, i in sorted(served)] == list(range(6))
    holders[1].release()


def test_a_try_does_not_queue_behind_the_line(nodes3: RedisNodes,
                                              make_manager: MakeManager) -> None:
    """timeout=0 takes a free permit even while another acquirer holds the line."""
    mgr = make_manager(nodes3)
    line = mgr.lock("try#line", fencing=False)
    assert line.acquire()
    first = mgr.semaphore("try", 2, timeout=0)
    second = mgr.semaphore("try", 2)
    assert first.acquire() and second.acquire(blocking=False)
    assert {first.index, second.index} == {0, 1}
    assert mgr.semaphore("try", 2).acquire(timeout=0) is False  # both taken
    waiting = mgr.semaphore("try", 2, timeout=0.2)
    assert waiting.acquire() is False  # a blocking acquire queues on the line
    line.release()
    first.release()
    second.release()


def _script_calls(server: Any) -> int:
    stats = server.client().info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


@pytest.mark.parametrize("count", [1, 3])
def test_an_uncontended_acquire_and_release_cost_one_script_call_each(
        count: int, redis_nodes_factory: NodesFactory, make_manager: MakeManager) -> None:
    """The count check and the look at the line go with the permit's acquire
    script, and the free notice with its release script: one round trip each,
    as for lock(). (Before: a count check, the line taken and given back around
    the permit, and a PUBLISH after the release.)"""
    nodes = redis_nodes_factory(count)
    mgr = make_manager(nodes)
    with mgr.semaphore("cheap", 3, timeout=1):  # connections and scripts loaded
        pass
    listener = nodes[0].client().pubsub()
    listener.subscribe(lock_key(mgr.key_prefix, "cheap#free"))
    assert listener.get_message(timeout=1)["type"] == "subscribe"
    before = [_script_calls(server) for server in nodes]
    held = mgr.semaphore("cheap", 3, timeout=1)
    assert held.acquire()
    assert [_script_calls(server) - b for server, b in zip(nodes, before)] == [1] * count
    held_index = held.index
    assert held_index is not None
    held.release()
    assert wait_until(lambda: [_script_calls(server) - b for server, b in zip(nodes, before)]
                      == [2] * count, timeout=2)
    notice = listener.get_message(timeout=2)
    # The release script's notice names the permit released (tried first by the head).
    assert notice is not None and notice["data"] == held._locks[held_index]._key_b
    listener.close()


def test_a_first_try_steps_aside_when_any_node_has_someone_in_line(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """One node with a waiter queued on the line is enough: the permit the other
    two granted is given back, and the acquire goes through the line."""
    mgr = make_manager(nodes3)
    sem = mgr.semaphore("aside", 1, timeout=1)
    line_queue = waiters_key(lock_key(mgr.key_prefix, "aside#line"))
    nodes3[0].client().rpush(line_queue, b"nobody|listens")
    permit = sem._locks[0]
    permit._guard = sem._guard(True)
    try:
        assert permit.acquire(timeout=0) is False
    finally:
        permit._guard = None
    assert [code for code, _ in permit._guard_refusal.values()] == [6]
    assert wait_until(lambda: _holders(nodes3, permit.key) == 0, timeout=2)
    # A try does not step aside; a blocking acquire gets its permit through the line.
    assert mgr.semaphore("aside", 1, timeout=0).acquire()
    mgr.force_release("aside#0")
    assert sem.acquire() and sem.index == 0
    sem.release()


def test_a_caller_with_another_count_takes_no_permit_anywhere(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    with mgr.semaphore("nocount", 2, timeout=1):
        pass
    # The release returned once a quorum deleted; the last node's may still run.
    assert wait_until(lambda: not any(
        server.client().exists(lock_key(mgr.key_prefix, f"nocount#{i}"))
        for server in nodes3 for i in range(2)), timeout=2)
    before = [_script_calls(server) for server in nodes3]
    with pytest.raises(semaphore_module.PermitsMismatch):
        mgr.semaphore("nocount", 3, timeout=1).acquire()
    # One script call per node: refused before any permit was set. (A node
    # whose refusal came after the round was decided also gets the clean-up
    # of a reply not waited for: one call more there, which finds nothing.)
    calls = [_script_calls(server) - b for server, b in zip(nodes3, before)]
    assert all(1 <= c <= 2 for c in calls) and sum(calls) <= 4, calls
    assert not any(server.client().exists(lock_key(mgr.key_prefix, f"nocount#{i}"))
                   for server in nodes3 for i in range(3))


def _permit_keys(nodes: RedisNodes, mgr: Any, name: str, permits: int) -> list[list[int]]:
    """Per node, the permits of ``name`` (0 to ``permits`` - 1) whose key it holds."""
    return [[i for i in range(permits)
             if server.client().exists(lock_key(mgr.key_prefix, f"{name}#{i}"))]
            for server in nodes]


def test_another_count_gets_no_permit_while_one_node_at_a_time_is_out(
        redis_nodes_factory: NodesFactory, make_manager: MakeManager) -> None:
    """The reviewers' schedule, never more than one node out at a time:

        node 3 paused; A1..A3 (permits=3) take #0..#2 on nodes 1, 2: node 3 never records 3
        node 3 resumed, node 1 paused; B (permits=5): node 2 says "3", node 3 records 5

    B's first try counted only the nodes that disagreed (one: not enough to
    refuse) and went on to the line, whose head took #3 on nodes 2 and 3 with
    no count check: four holders of a 3-permit semaphore. Now every try
    carries the count check, so B gets no permit while node 1 is out (which
    count is right is undecided then: B is refused like a busy permit), and
    PermitsMismatch once node 1 is back (two nodes of three record 3)."""
    nodes = redis_nodes_factory(3)
    a = make_manager(nodes, node_timeout=0.3)
    b = make_manager(nodes, node_timeout=0.3)
    held = []
    nodes[2].pause()
    try:
        for _ in range(3):
            sem = a.semaphore("mix", 3, timeout=2, ttl=30)
            assert sem.acquire()
            held.append(sem)
    finally:
        nodes[2].resume()
    assert sorted(sem.index for sem in held) == [0, 1, 2]
    nodes[0].pause()
    try:
        other = b.semaphore("mix", 5, timeout=1.5, ttl=30)
        assert not other.acquire()  # no fourth holder
        assert other.index is None and not other.owned()
    finally:
        nodes[0].resume()
    fresh = make_manager(nodes, node_timeout=0.3)  # b's node 1 may still be in back-off
    late = fresh.semaphore("mix", 5, timeout=0, ttl=30)
    with pytest.raises(semaphore_module.PermitsMismatch) as info:
        late.acquire()
    assert info.value.permits == 5 and info.value.recorded == 3
    assert all(sem.owned() for sem in held)
    # Nothing of B's anywhere: no fourth permit, and the line given back.
    assert wait_until(lambda: all(keys == [0, 1, 2] or keys == []
                                  for keys in _permit_keys(nodes, a, "mix", 5)), timeout=3)
    assert wait_until(lambda: _holders(nodes, lock_key(a.key_prefix, "mix#line")) == 0,
                      timeout=3)
    for sem in held:
        sem.release()


def test_the_right_count_is_not_blamed_while_a_node_is_out(
        redis_nodes_factory: NodesFactory, make_manager: MakeManager) -> None:
    """Node 3 records a stray count (restarted empty, a caller with another
    count got there first) and node 1 is out: a caller with the holders'
    own count got PermitsMismatch ("its holders use permits=5"), at once,
    for the whole outage. Undecided is a refused try: it waits, and gets its
    permit once node 1 is back."""
    nodes = redis_nodes_factory(3)
    mgr = make_manager(nodes, node_timeout=0.3)
    held = [mgr.semaphore("stray", 3, ttl=30) for _ in range(2)]
    for sem in held:
        assert sem.acquire(timeout=0)
    nodes[2].client().set(held[0]._count_key, "5", px=3_600_000)
    nodes[0].pause()
    try:
        assert not mgr.semaphore("stray", 3, ttl=30).acquire(timeout=0)
        assert not mgr.semaphore("stray", 3, ttl=30).acquire(timeout=1)
    finally:
        nodes[0].resume()
    third = mgr.semaphore("stray", 3, ttl=30)
    assert third.acquire(timeout=2)
    for sem in (*held, third):
        sem.release()


def test_the_head_of_the_line_checks_the_count_with_every_try(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Every try of a permit carries the count check, the head's too. The head
    waits (permits=5, all held); meanwhile nodes 1 and 2 came to record
    permits=3 (written here by hand: the record of another count's users,
    say after this one's lease ran out) and permit #3 is released. The head's
    try of #3 used to carry no check and took it on all three nodes; now
    nodes 1 and 2 refuse it and the head gets PermitsMismatch, holding
    nothing and leaving the line."""
    mgr = make_manager(nodes3)
    holders = [mgr.semaphore("headcount", 5, timeout=2) for _ in range(5)]
    assert all(sem.acquire() for sem in holders)
    outcome: list[Any] = []
    head = mgr.semaphore("headcount", 5, timeout=5)

    def wait() -> None:
        try:
            outcome.append(head.acquire())
        except RedlockError as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    line_key = lock_key(mgr.key_prefix, "headcount#line")
    assert wait_until(lambda: _holders(nodes3, line_key) == 3, timeout=5)  # it is the head
    count_key = permits_key(lock_key(mgr.key_prefix, "headcount"))
    for server in nodes3[:2]:
        server.client().set(count_key, b"3", px=60_000)
    third = next(sem for sem in holders if sem.index == 3)
    third.release()
    waiter.join(10)
    assert not waiter.is_alive()
    assert isinstance(outcome[0], semaphore_module.PermitsMismatch), outcome
    assert head.index is None
    assert wait_until(lambda: all(3 not in keys
                                  for keys in _permit_keys(nodes3, mgr, "headcount", 5)),
                      timeout=3)
    assert wait_until(lambda: _holders(nodes3, line_key) == 0, timeout=3)
    for sem in holders:
        if sem is not third:
            sem.release()


# -- leases: a crashed holder, a paused one ------------------------------------------

CRASHING = textwrap.dedent("""
    import sys, time
    from django.conf import settings
    settings.configure()
    from django_redlock import LockManager
    mgr = LockManager(sys.argv[1].split(","), node_timeout=0.2)
    held = mgr.semaphore("crash", 1, ttl=1.0)
    assert held.acquire()
    print("ACQUIRED", flush=True)
    time.sleep(60)
""")


def test_a_crashed_holders_permit_comes_back_after_its_lease(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    proc = subprocess.Popen([sys.executable, "-c", CRASHING, ",".join(nodes3.urls)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("ACQUIRED")
        proc.kill()  # SIGKILL: no release, no notice
        proc.wait(10)
        killed = time.monotonic()
        mgr = make_manager(nodes3)
        waiter = mgr.semaphore("crash", 1, timeout=10)
        assert waiter.acquire()
        back = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)
    assert back < 1.0 + 1.5, f"the permit came back after {back:.3f} s"
    waiter.release()


PAUSED = textwrap.dedent("""
    import sys, time
    from django.conf import settings
    settings.configure()
    from django_redlock import LockManager, LockLost
    mgr = LockManager(sys.argv[1].split(","), node_timeout=0.2)
    held = mgr.semaphore("paused", 1, ttl=0.8)
    assert held.acquire()
    print("ACQUIRED", held.fence, flush=True)
    time.sleep(1.5)   # SIGSTOP lands here
    print("OWNED", held.owned(), flush=True)
    for what in (held.extend, held.release):
        try:
            what()
            print("NO-ERROR", flush=True)
        except LockLost:
            print("LOCKLOST", flush=True)
    mgr.close()
""")


def test_a_holder_paused_past_its_lease_loses_its_permit(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    proc = subprocess.Popen([sys.executable, "-c", PAUSED, ",".join(nodes3.urls)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("ACQUIRED"), line
        old_fence = int(line.split()[1])
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            mgr = make_manager(nodes3)
            newer = mgr.semaphore("paused", 1, timeout=5)
            assert newer.acquire()  # the paused holder's lease ran out
            assert newer.fence > old_fence
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "OWNED False" in out
    assert out.count("LOCKLOST") == 2 and "NO-ERROR" not in out
    assert newer.owned()  # the stale release left the new holder's permit alone
    newer.release()


def test_a_lease_that_ran_out_in_process_is_reported(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3, auto_renew=False)
    stale = mgr.semaphore("ran-out", 1, ttl=0.3)
    assert stale.acquire()
    time.sleep(0.5)
    assert not stale.owned()
    other = mgr.semaphore("ran-out", 1, timeout=1)
    assert other.acquire()
    with pytest.raises(LockLost):
        stale.extend()
    with pytest.raises(LockLost):
        stale.release()
    assert other.owned()
    other.release()


# -- node faults -------------------------------------------------------------------

@pytest.mark.parametrize("fault", ["kill", "pause", "restart-empty"])
def test_a_node_fault_keeps_the_bound(fault: str, redis_nodes_factory: NodesFactory,
                                      make_manager: MakeManager) -> None:
    nodes = redis_nodes_factory(3)
    meter = Meter(redis_nodes_factory(1))
    managers = [make_manager(nodes) for _ in range(3)]
    failures: list[BaseException] = []
    faulted = threading.Event()

    def work() -> None:
        mgr = managers[threading.get_ident() % len(managers)]
        for _ in range(12):
            try:
                with mgr.semaphore("faults", 2, timeout=20, ttl=3.0):
                    meter.enter()
                    time.sleep(0.01)
                    meter.leave()
            except (QuorumUnavailable, LockLost) as exc:  # pragma: no cover - reported
                failures.append(exc)

    def nemesis() -> None:
        wait_until(lambda: meter.done >= 8, timeout=30)
        if fault == "kill":
            nodes[0].kill()
        elif fault == "pause":
            nodes[0].pause()
        else:
            nodes[0].restart(empty=True)
        faulted.set()

    chaos = threading.Thread(target=nemesis, daemon=True)
    chaos.start()
    try:
        run_in_threads(work, 5, timeout=120)
    finally:
        chaos.join(30)
        if fault == "pause":
            nodes[0].resume()
    assert faulted.is_set()
    assert not failures, failures
    assert meter.done == 60
    assert 1 <= meter.most <= 2


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_a_try_with_a_paused_node_settles_on_a_quorum(
        flavour: str, redis_nodes_factory: NodesFactory, make_manager: MakeManager) -> None:
    """One node of three paused (SIGSTOP: it takes connections and never
    answers). A try of a permit that does not step aside (``timeout=0``,
    ``blocking=False``) is decided by the two others: two grants with the
    count check passed, or two busy answers that passed it too. It used to
    hear every node out, so each permit tried waited the node timeout for
    the paused node, and the clean-up of each lost try waited for a new
    connection to it (its own had been dropped at the timeout): about 1.5 s
    for a try of a full 4-permit semaphore with a 0.5 s node timeout, until
    the node's back-off began. Now a try costs at most one node timeout (a
    connection set-up to the paused node, when none is idle), not one per
    permit tried, and the bound still holds."""
    nodes = redis_nodes_factory(3)
    holders, trier = make_manager(nodes), make_manager(nodes)
    bound = trier.node_timeout + 0.35
    name = "paused-try"

    def make(mgr: Any) -> Any:
        return (mgr.semaphore if flavour == "sync" else mgr.asemaphore)(name, 4, ttl=30)

    async def call(result: Any) -> Any:
        return await result if asyncio.iscoroutine(result) else result

    async def timed(sem: Any, **options: Any) -> tuple[bool, float]:
        started = time.monotonic()
        got = await call(sem.acquire(**options))
        return got, time.monotonic() - started

    def permits_on(server: Any) -> list[int]:
        return [i for i in range(5)
                if server.client().exists(lock_key(trier.key_prefix, f"{name}#{i}"))]

    async def scenario() -> None:
        warm = make(trier)  # its connections are set up before the pause
        assert await call(warm.acquire(timeout=0))
        await call(warm.release())
        held = [make(holders) for _ in range(4)]
        for sem in held:
            assert await call(sem.acquire(timeout=0))
        nodes[2].pause()
        try:
            for options in ({"timeout": 0}, {"blocking": False}):
                extra = make(trier)
                got, took = await timed(extra, **options)  # every permit is tried
                assert not got and took < bound, (options, took)
                assert extra.index is None and not extra.owned()
            freed = held.pop(0)
            freed_index = freed.index
            await call(freed.release())
            last = make(trier)
            got, took = await timed(last, timeout=0)
            assert got and took < bound, (got, took)
            assert last.index == freed_index
            held.append(last)
            # Never more holders than permits, on the nodes that answer too.
            assert sorted(sem.index for sem in held) == [0, 1, 2, 3]
            assert all(sem.owned() for sem in held)
            assert permits_on(nodes[0]) == permits_on(nodes[1]) == [0, 1, 2, 3]
        finally:
            nodes[2].resume()
        for sem in held:
            await call(sem.release())

    asyncio.run(scenario())
    # The late node ran the clean-ups it was sent: nothing is left for a lease.
    assert wait_until(lambda: all(permits_on(server) == [] for server in nodes), timeout=5)


def test_majority_down_is_quorum_unavailable_within_the_timeout(
        redis_nodes_factory: NodesFactory, make_manager: MakeManager) -> None:
    nodes = redis_nodes_factory(3)
    mgr = make_manager(nodes)
    with mgr.semaphore("down", 2, timeout=1):
        pass
    nodes[0].kill()
    nodes[1].kill()
    started = time.monotonic()
    with pytest.raises(QuorumUnavailable):
        mgr.semaphore("down", 2, timeout=1).acquire()
    assert time.monotonic() - started < 1.0 + 1.0


def test_majority_lost_while_waiting_is_quorum_unavailable_by_the_timeout(
        redis_nodes_factory: NodesFactory, make_manager: MakeManager) -> None:
    nodes = redis_nodes_factory(3)
    mgr = make_manager(nodes)
    holder = mgr.semaphore("lost-quorum", 1)
    assert holder.acquire()
    outcome: list[Any] = []

    def wait() -> None:
        started = time.monotonic()
        try:
            outcome.append(mgr.semaphore("lost-quorum", 1, timeout=2).acquire())
        except QuorumUnavailable as exc:
            outcome.append(exc)
        outcome.append(time.monotonic() - started)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    line_key = lock_key(mgr.key_prefix, "lost-quorum#line")
    assert wait_until(lambda: _holders(nodes, line_key) == 3, timeout=5)  # it is the head
    nodes[0].kill()
    nodes[1].kill()
    waiter.join(10)
    assert not waiter.is_alive()
    assert isinstance(outcome[0], QuorumUnavailable), outcome
    assert outcome[1] < 2 + 1.0


# -- the permit count ------------------------------------------------------------

def test_disagreeing_permits_are_an_error(nodes3: RedisNodes, make_manager: MakeManager,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = make_manager(nodes3)
    first = mgr.semaphore("count", 3, ttl=0.2)
    assert first.acquire()
    other = mgr.semaphore("count", 2, timeout=1)
    with pytest.raises(RedlockError, match=r"permits=2.*permits=3") as info:
        other.acquire()
    assert isinstance(info.value, semaphore_module.PermitsMismatch)
    assert info.value.permits == 2 and info.value.recorded == 3
    assert other.index is None
    assert _holders(nodes3, lock_key(mgr.key_prefix, "count#line")) == 0  # line given back
    count_key = permits_key(lock_key(mgr.key_prefix, "count"))
    assert all(s.client().get(count_key) == b"3" for s in nodes3)
    first.release()
    # After the record's lease (an hour by default, short here) a new count may be used.
    monkeypatch.setattr(semaphore_module, "COUNT_LEASE", 0.3)
    for server in nodes3:
        server.client().pexpire(count_key, 300)
    assert wait_until(lambda: _holders(nodes3, count_key) == 0, timeout=5)
    with mgr.semaphore("count", 2, timeout=1) as held:
        assert held.permits == 2
    assert all(s.client().get(count_key) == b"2" for s in nodes3)


def _used_then_a_node_emptied(redis_nodes_factory: NodesFactory, make_manager: MakeManager,
                              name: str, permits: int) -> tuple[Any, Any, str]:
    """Three nodes, ``name`` used once with ``permits``, then node 3 restarted
    empty: the nodes, the manager and the name's count key."""
    nodes = redis_nodes_factory(3)
    mgr = make_manager(nodes)
    with mgr.semaphore(name, permits, timeout=1):
        pass
    nodes[2].restart(empty=True)
    return nodes, mgr, permits_key(lock_key(mgr.key_prefix, name))


def test_a_node_restarted_empty_learns_the_count_again(
        redis_nodes_factory: NodesFactory, make_manager: MakeManager) -> None:
    nodes, mgr, count_key = _used_then_a_node_emptied(redis_nodes_factory, make_manager,
                                                      "relearn", 4)

    def relearned() -> bool:
        with mgr.semaphore("relearn", 4, timeout=5):  # writes it where it is missing
            pass
        return bool(nodes[2].client().get(count_key) == b"4")

    assert wait_until(relearned, timeout=5, interval=0.1)
    with pytest.raises(RedlockError, match="permits"):
        mgr.semaphore("relearn", 5, timeout=1).acquire()


def test_a_stray_count_on_a_node_restarted_empty_is_outvoted(
        redis_nodes_factory: NodesFactory, make_manager: MakeManager) -> None:
    """The name is used with permits=2; node 3 restarts empty, and a caller
    with a wrong count (3) reaches it first: refused, as it must be, but its
    count stays recorded on node 3 for the record's hour. Every right caller
    used to get PermitsMismatch from that one node although nodes 1 and 2
    agree: now the quorum's count decides, and the stray is still refused."""
    nodes, mgr, count_key = _used_then_a_node_emptied(redis_nodes_factory, make_manager,
                                                      "outvoted", 2)
    stray = make_manager(nodes)
    with pytest.raises(semaphore_module.PermitsMismatch):
        stray.semaphore("outvoted", 3, timeout=0).acquire()
    assert [server.client().get(count_key) for server in nodes] == [b"2", b"2", b"3"]
    for timeout in (0, 1):  # a try and a waiting acquire
        held = mgr.semaphore("outvoted", 2, timeout=timeout)
        assert held.acquire()
        held.release()
    both = [mgr.semaphore("outvoted", 2, timeout=1) for _ in range(2)]
    assert all(s.acquire() for s in both)  # two permits, no more
    assert mgr.semaphore("outvoted", 2, timeout=0).acquire() is False
    for s in both:
        s.release()
    with pytest.raises(semaphore_module.PermitsMismatch):
        stray.semaphore("outvoted", 3, timeout=0).acquire()


@pytest.mark.parametrize("name", ["plain", "{tag}x", "odd}name"])
def test_the_count_key_reads_back(name: str) -> None:
    from django_redlock.core.keys import fence_key, parse_internal_key

    key = lock_key("redlock", name)
    assert parse_internal_key(permits_key(key)) == (key, "permits")
    assert permits_key(key) not in (fence_key(key), waiters_key(key))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_bad_permits_are_a_clear_error_before_anything_is_sent(
        bad: Any, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    with pytest.raises(ValueError, match=r"permits.*" + repr(bad).replace(".", r"\.")):
        mgr.semaphore("bad", bad)
    with pytest.raises(ValueError, match="permits"):
        mgr.asemaphore("bad", bad)
    with pytest.raises(ValueError, match="permits"):
        with_semaphore("bad:<x>", bad)
    assert all(s.client().dbsize() == 0 for s in nodes3)


@pytest.mark.parametrize("option", [{"ttl": 0}, {"ttl": "1"}, {"timeout": -1},
                                    {"auto_renew": "yes"}, {"max_hold": -2}])
def test_bad_options_are_rejected_as_for_lock(option: dict[str, Any], nodes3: RedisNodes,
                                              make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    with pytest.raises(ValueError):
        mgr.lock("bad", **option)
    with pytest.raises(ValueError):
        mgr.semaphore("bad", 2, **option)
    sem = mgr.semaphore("bad", 2)
    with pytest.raises(ValueError, match="timeout"):
        sem.acquire(timeout=-1)
    with pytest.raises(ValueError, match="blocking"):
        sem.acquire(blocking="no")  # type: ignore[arg-type]
    assert all(s.client().dbsize() == 0 for s in nodes3)


def test_release_without_a_permit_and_acquire_twice(nodes3: RedisNodes,
                                                     make_manager: MakeManager) -> None:
    from django_redlock import LockNotOwned

    mgr = make_manager(nodes3)
    sem = mgr.semaphore("twice", 2)
    with pytest.raises(LockNotOwned):
        sem.release()
    assert sem.acquire()
    with pytest.raises(LockNotOwned, match="already holds"):
        sem.acquire()
    assert sem.fence > 0 and sem.validity > 0 and sem.lock is not None
    sem.release()
    assert sem.index is None and not sem.owned() and sem.fence == 0


# -- the decorator ---------------------------------------------------------------

def test_with_semaphore_sync_and_async(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    from django_redlock import current_lock

    mgr = make_manager(nodes3)
    seen: list[Any] = []

    @with_semaphore("report:<day>", 2, manager=mgr, timeout=0)
    def build(day: str) -> int:
        held = current_lock()
        seen.append((held.name, held.permits))
        return int(held.index)

    blockers = [mgr.semaphore("report:mon", 2) for _ in range(2)]
    assert build("mon") in (0, 1)
    assert seen == [("report:mon", 2)]
    assert all(b.acquire() for b in blockers)
    with pytest.raises(LockNotAcquired, match="report:mon"):
        build("mon")
    assert build("tue") in (0, 1)  # another name, another semaphore

    @with_semaphore("areport:<day>", 1, manager=mgr, timeout=0)
    async def abuild(day: str) -> int:
        return int(current_lock().index)

    async def scenario() -> None:
        assert await abuild("mon") == 0
        async with mgr.asemaphore("areport:mon", 1):
            with pytest.raises(LockNotAcquired):
                await abuild("mon")

    asyncio.run(scenario())
    for b in blockers:
        b.release()


def test_with_semaphore_busy_view_answers_like_with_lock(
        session_nodes: RedisNodes) -> None:
    from django.test import RequestFactory

    from django_redlock.conf import get_manager

    @with_semaphore("export:<pk>", 1, timeout=0)
    def export(request: Any, pk: int) -> Any:
        from django.http import HttpResponse

        return HttpResponse(f"{request.redlock.name}#{request.redlock.index}")

    request = RequestFactory().get("/export/5/")
    assert export(request, pk=5).content == b"export:5#0"
    with get_manager().semaphore("export:5", 1):
        busy = export(RequestFactory().get("/export/5/"), pk=5)
    assert busy.status_code == 423 and "Retry-After" in busy


def test_top_level_functions_use_the_default_manager(session_nodes: RedisNodes) -> None:
    import django_redlock

    with django_redlock.semaphore("top", 2, timeout=1) as held:
        assert held.owned() and held.permits == 2

    async def scenario() -> None:
        async with django_redlock.asemaphore("atop", 1, timeout=1) as aheld:
            assert aheld.owned()

    asyncio.run(scenario())


def test_the_docs_examples_run(session_nodes: RedisNodes) -> None:
    """The semaphore section of the family how-to, executed on the session's nodes
    (tests/test_family.py runs every block of the page too)."""
    import re

    text = (ROOT / "docs/howto/lock-family.rst").read_text()
    section = text[text.index("At most N at once"):]
    blocks = re.findall(r"\.\. code-block:: python\n\n((?:   .*\n|\n)+)", section)
    assert len(blocks) == 2
    for block in blocks:
        code = "\n".join(line[3:] for line in block.splitlines())
        exec(compile(code, "lock-family.rst", "exec"), {})  # noqa: S102 - our own docs


def test_the_head_of_the_line_tries_the_permit_the_notice_named_first(
        nodes3: RedisNodes, make_manager: Callable[..., Any]) -> None:
    """A released permit's notice names it, and the waiter at the head of the
    line asks for that permit first: one round trip for the handoff instead of
    one per busy permit it would try before it (the handoff goal, issue 20)."""
    mgr = make_manager(nodes3.urls[:1])
    holders = [mgr.semaphore("named", 4, timeout=1) for _ in range(4)]
    for holder in holders:
        assert holder.acquire()
    waiter = mgr.semaphore("named", 4, timeout=10)
    asked: list[int] = []
    for index, lock in enumerate(waiter._locks[:4]):
        original = lock.acquire

        def counting(*args: Any, _index: int = index, _original: Any = original,
                     **kwargs: Any) -> Any:
            asked.append(_index)
            return _original(*args, **kwargs)

        lock.acquire = counting  # type: ignore[method-assign]
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire()))
    thread.start()
    try:
        # The waiter holds the line, read every permit busy and listens (its
        # first try asked one permit; the reads of the head ask none).
        assert wait_until(lambda: len(asked) >= 1 and mgr.notifier._subs, timeout=5)
        time.sleep(0.2)
        swept = len(asked)
        # No attempt on a busy permit: one read told the head they all were.
        assert swept == 1, asked
        freed = holders[2]
        assert freed.index is not None
        freed_index = freed.index
        freed.release()
        thread.join(timeout=5)
        assert got == [True] and waiter.index == freed_index
        # After the notice: exactly one try, of the permit it named.
        assert asked[swept:] == [freed_index], asked
    finally:
        thread.join(timeout=5)
        if waiter.index is not None:
            waiter.release()
        for holder in holders:
            if holder.index is not None:
                holder.release()


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_a_new_head_drops_the_notices_heard_while_in_line(
        flavour: str, nodes3: RedisNodes, make_manager: Callable[..., Any]) -> None:
    """Waiters listen while in line, so the one behind the head hears the free
    notice the head is served by. Once it is the head itself, its read of the
    permits covers that notice: it must not wake on it and ask for a permit the
    head before took (one lost round trip and one more read per handoff)."""
    mgr = make_manager(nodes3.urls[:1])
    holder = mgr.semaphore("stale", 1, timeout=1)
    assert holder.acquire()
    first = mgr.semaphore("stale", 1, timeout=10)
    asked: list[int] = []
    line_key = lock_key(mgr.key_prefix, "stale#line")
    queue = waiters_key(line_key)
    server = nodes3[0].client()
    got: list[bool] = []
    threads = [threading.Thread(target=lambda: got.append(first.acquire()), daemon=True)]
    threads[0].start()
    assert wait_until(lambda: server.exists(line_key) == 1, timeout=5)  # the head

    if flavour == "sync":
        second = mgr.semaphore("stale", 1, timeout=10)
        original = second._locks[0].acquire

        def counting(*args: Any, **kwargs: Any) -> Any:
            asked.append(0)
            return original(*args, **kwargs)

        second._locks[0].acquire = counting  # type: ignore[method-assign]

        def acquire_second() -> None:
            got.append(second.acquire())
            second.release()
    else:
        def acquire_second() -> None:
            async def run() -> None:
                second = mgr.asemaphore("stale", 1, timeout=10)
                original = second._locks[0].acquire

                async def counting(*args: Any, **kwargs: Any) -> Any:
                    asked.append(0)
                    return await original(*args, **kwargs)

                second._locks[0].acquire = counting
                got.append(await second.acquire())
                await second.release()

            asyncio.run(run())

    threads.append(threading.Thread(target=acquire_second, daemon=True))
    threads[1].start()
    try:
        # Queued behind the head (its first try asked the permit once).
        assert wait_until(lambda: server.llen(queue) == 1 and len(asked) == 1, timeout=5)
        holder.release()  # the head takes the permit; the second becomes the head
        assert wait_until(lambda: got == [True], timeout=5)
        assert wait_until(lambda: server.exists(line_key) == 1, timeout=5)
        time.sleep(0.3)
        assert asked == [0], "the new head asked for the permit the head before took"
        first.release()
        threads[1].join(timeout=5)
        assert got == [True, True]
        assert asked == [0, 0]  # woken by this release: one try, granted
    finally:
        for thread in threads:
            thread.join(timeout=5)
        for sem in (holder, first):
            if sem.index is not None:
                sem.release()


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_the_head_hands_the_line_on_without_waiting_for_the_reply(
        flavour: str, nodes3: RedisNodes, make_manager: Callable[..., Any]) -> None:
    """Once the head holds its permit, it releases the line and returns without
    waiting for that release's replies: its acquire() costs one round trip
    less, and the next in line is woken by the release script all the same.
    The permit was granted before that release left, so the grants keep the
    order of the line."""
    from django_redlock.engine.rounds import NO_WAIT

    mgr = make_manager(nodes3)
    holder = mgr.semaphore("handon", 1, timeout=1)
    assert holder.acquire()
    line_key = lock_key(mgr.key_prefix, "handon#line").encode()
    releases: list[Any] = []  # the settle of each release round of the line

    def note(requests: Any, settle: Any) -> None:
        calls = [r for r in requests if r is not None]
        # A release of the line (token, fence, grace, b"1"): not the clean-up
        # of a lost attempt to take it (b"0", or numbered), which never waits.
        if calls and getattr(calls[0], "script", None) is not None \
                and calls[0].script.name == "release" and calls[0].keys[0] == line_key \
                and len(calls[0].args) == 4 and calls[0].args[3] == b"1":
            releases.append(settle)

    got: list[bool] = []
    second_got: list[bool] = []
    second = mgr.semaphore("handon", 1, timeout=10)

    if flavour == "sync":
        original = mgr.transport.round

        def recording(requests: Any, **kwargs: Any) -> Any:
            note(requests, kwargs.get("settle"))
            return original(requests, **kwargs)

        mgr.transport.round = recording
        first = mgr.semaphore("handon", 1, timeout=10)

        def acquire_first() -> None:
            got.append(first.acquire())
            first.release()
    else:
        def acquire_first() -> None:
            async def run() -> None:
                first = mgr.asemaphore("handon", 1, timeout=10)
                transport = first._locks[0].transport
                original = transport.round

                async def recording(requests: Any, **kwargs: Any) -> Any:
                    note(requests, kwargs.get("settle"))
                    return await original(requests, **kwargs)

                transport.round = recording
                try:
                    got.append(await first.acquire())
                    await first.release()
                finally:
                    del transport.round

            asyncio.run(run())

    threads = [threading.Thread(target=acquire_first, daemon=True)]
    threads[0].start()
    server = nodes3[0].client()
    try:
        assert wait_until(lambda: server.exists(line_key) == 1, timeout=5)  # the head
        threads.append(threading.Thread(
            target=lambda: second_got.append(second.acquire()) or second.release(),
            daemon=True))
        threads[1].start()
        queue = waiters_key(line_key.decode())
        assert wait_until(lambda: max(s.client().llen(queue) for s in nodes3) >= 1, timeout=5)
        holder.release()  # the head takes the permit and hands the line on
        for thread in threads:
            thread.join(timeout=10)
        assert got == [True] and second_got == [True]  # the next in line was woken
        assert releases, "the head released no line"
        assert releases[0] is NO_WAIT, "the head waited for the line's release replies"
        assert wait_until(lambda: _holders(nodes3, line_key.decode()) == 0, timeout=5)
    finally:
        if flavour == "sync":
            del mgr.transport.round
        for thread in threads:
            thread.join(timeout=5)
        if holder.index is not None:
            holder.release()
