"""Read-write locks: many readers or one writer, on real nodes (1 and 3).

Each guarantee of the docs is driven by its worst schedule: a writer waiting
while readers keep arriving (no starvation), a reader paused past its lease
(its loss is reported), a name used as a plain lock and a read-write lock at
once (an error at the call, not a timeout), several processes reading and
writing (no reader ever overlaps a writer), a node killed, paused and
restarted empty. Every wait is bounded.
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

from django_redlock import LockKindConflict, LockLost, QuorumUnavailable
from django_redlock.core.keys import waiters_key
from django_redlock.decorators import with_lock
from django_redlock.testing import RedisNodes
from tests.family_exclusion import assert_no_lost_update, run_workers
from tests.polling import wait_until

MakeManager = Callable[..., Any]

pytestmark = pytest.mark.slow


@pytest.fixture(params=[1, 3], ids=["1-node", "3-nodes"])
def nodes(request: pytest.FixtureRequest, redis_nodes_factory: Callable[..., RedisNodes]
          ) -> RedisNodes:
    return redis_nodes_factory(request.param)


def test_readers_share_and_the_writer_holds_alone(nodes: RedisNodes,
                                                  make_manager: MakeManager) -> None:
    mgr = make_manager(nodes)
    r1, r2 = mgr.read_lock("doc"), mgr.read_lock("doc")
    assert r1.acquire(timeout=1) and r2.acquire(timeout=1)
    assert r1.owned() and r2.owned() and r1.fence != r2.fence
    assert mgr.write_lock("doc").acquire(timeout=0) is False
    r1.release()
    assert mgr.write_lock("doc").acquire(timeout=0) is False  # r2 still reads
    r2.release()
    with mgr.write_lock("doc", timeout=1) as writer:
        assert writer.owned()
        assert mgr.read_lock("doc").acquire(timeout=0) is False
        assert mgr.write_lock("doc").acquire(timeout=0) is False
    # Gone from every node once the last holder left.
    assert not any(server.client().exists(mgr.key("doc")) for server in nodes)


def test_the_keys_expiry_covers_its_longest_holder(nodes: RedisNodes,
                                                  make_manager: MakeManager) -> None:
    """The hash's own expiry is its latest field's: a reader that joins with a
    short lease must not cut the key's expiry under a reader with a long one
    (rw_acquire computes it from the fields it read), and the release of one
    reader leaves the other's field, and the key, in place."""
    mgr = make_manager(nodes)
    long_reader = mgr.read_lock("cover", ttl=30, auto_renew=False)
    short_reader = mgr.read_lock("cover", ttl=2, auto_renew=False)
    assert long_reader.acquire(timeout=1) and short_reader.acquire(timeout=1)
    key = mgr.key("cover")
    for server in nodes:
        assert server.client().pttl(key) > 25_000  # the long reader's, not 2 s
    long_reader.release()
    for server in nodes:
        client = server.client()
        assert client.hlen(key) == 1 and client.pttl(key) > 0
    assert mgr.write_lock("cover").acquire(timeout=0) is False
    short_reader.release()
    assert not any(server.client().exists(key) for server in nodes)


def test_a_waiting_writer_stops_new_readers_and_is_woken_by_the_last_release(
        nodes: RedisNodes, make_manager: MakeManager) -> None:
    # Waiters poll every 3-6 s here: only a release notice serves them sooner.
    mgr = make_manager(nodes, retry_delay=6)
    reader = mgr.read_lock("doc", ttl=30)
    assert reader.acquire(timeout=1)
    got: dict[str, Any] = {}

    def writer() -> None:
        w = mgr.write_lock("doc", ttl=30)
        got["ok"] = w.acquire(timeout=10)
        got["at"] = time.monotonic()
        got["lock"] = w

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        # The writer stands in line: a new reader queues behind it, although
        # the reader holding the lock now would let a reader in.
        assert wait_until(lambda: any(server.client().llen(waiters_key(mgr.key("doc")))
                                      for server in nodes), timeout=5)
        assert mgr.read_lock("doc").acquire(timeout=0.3) is False
        released = time.monotonic()
        reader.release()
        thread.join(timeout=12)
        assert got["ok"], got
        # Woken by the release notice, not by a timer (the reader's lease was 30 s).
        assert got["at"] - released < 1.0, got["at"] - released
        assert got["lock"].fence > reader.fence
    finally:
        thread.join(timeout=12)
        if got.get("lock") is not None and got["lock"].owned():
            got["lock"].release()


def test_the_writers_release_wakes_every_reader_in_line(nodes: RedisNodes,
                                                        make_manager: MakeManager) -> None:
    # Waiters poll every 3-6 s here: only a release notice serves them sooner.
    mgr = make_manager(nodes, retry_delay=6)
    writer = mgr.write_lock("doc", ttl=30)
    assert writer.acquire(timeout=1)
    held: list[Any] = []
    waited: list[float] = []
    guard = threading.Lock()

    def reader() -> None:
        r = mgr.read_lock("doc", ttl=30)
        if r.acquire(timeout=10):
            with guard:
                held.append(r)
                waited.append(time.monotonic())

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    assert wait_until(lambda: max(server.client().llen(waiters_key(mgr.key("doc")))
                                  for server in nodes) == 3, timeout=5)
    released = time.monotonic()
    writer.release()
    for t in threads:
        t.join(timeout=12)
    try:
        assert len(held) == 3, "not every reader in line got the lock"
        assert all(r.owned() for r in held)  # all three at once
        assert max(waited) - released < 1.0, max(waited) - released  # notices, not timers
        assert min(r.fence for r in held) > writer.fence
    finally:
        for r in held:
            r.release()


def test_one_name_two_kinds_is_an_error_at_once(nodes: RedisNodes,
                                                make_manager: MakeManager) -> None:
    mgr = make_manager(nodes)
    with mgr.read_lock("both"):
        started = time.monotonic()
        with pytest.raises(LockKindConflict, match="read-write lock"):
            mgr.lock("both", timeout=10).acquire()
        assert time.monotonic() - started < 2.0  # at the call, not at its timeout
    with mgr.lock("both2"):
        started = time.monotonic()
        with pytest.raises(LockKindConflict, match="plain lock"):
            mgr.write_lock("both2", timeout=10).acquire()
        with pytest.raises(LockKindConflict, match="plain lock"):
            mgr.read_lock("both2", timeout=10).acquire()
        assert time.monotonic() - started < 4.0
    # Nothing of the refused kind was left behind: both names work afterwards.
    with mgr.lock("both"), mgr.write_lock("both2"):
        pass


@pytest.mark.parametrize("fields", [{"name": "alice", "visits": "12"},
                                    {"r.someone": "99999999999999"}],
                         ids=["user-hash", "number-field"])
def test_a_hash_no_lock_wrote_is_busy_and_named_never_taken(
        nodes: RedisNodes, make_manager: MakeManager, fields: dict[str, str]) -> None:
    """Other code's hash at the lock's name (``HSET redlock:profile:7 name alice
    visits 12``, no expiry). rw_acquire.lua took every field for an expired
    holder (a value with no leading expiry read as 0), deleted the user's data
    and granted the lock; a field holding a large number was a holder that
    never expires (busy forever, nothing said); a plain lock() called the hash
    a read-write lock (LockKindConflict). Each now finds the key busy with a
    value no lock wrote, says so, and leaves the hash as it was."""
    from django_redlock import LockNotAcquired

    mgr = make_manager(nodes, node_timeout=0.5, retry_delay=0.1)
    key = mgr.key("profile:7")
    for server in nodes:
        server.client().hset(key, mapping=fields)
    for make in (mgr.read_lock, mgr.write_lock, mgr.lock):
        assert make("profile:7").acquire(timeout=0) is False
        with pytest.raises(LockNotAcquired) as info:
            with make("profile:7", timeout=0.3):
                pass
        assert not isinstance(info.value, LockKindConflict)
        message = str(info.value)
        assert "held by something other than a lock" in message, message
        assert "hash no read-write lock wrote" in message, message
    expected = {k.encode(): v.encode() for k, v in fields.items()}
    for server in nodes:
        assert server.client().hgetall(key) == expected


def test_a_string_no_lock_wrote_is_not_called_a_plain_lock(
        nodes: RedisNodes, make_manager: MakeManager) -> None:
    """rw_acquire.lua called any string at the key a plain lock's
    (LockKindConflict: "give each kind its own name"); a string not in a
    lock's format is a value no lock wrote, busy and named as such."""
    from django_redlock import LockNotAcquired

    mgr = make_manager(nodes, node_timeout=0.5, retry_delay=0.1)
    for server in nodes:
        server.client().set(mgr.key("raw"), "someone else's")
    for make in (mgr.read_lock, mgr.write_lock):
        with pytest.raises(LockNotAcquired) as info:
            with make("raw", timeout=0.3):
                pass
        assert not isinstance(info.value, LockKindConflict)
        assert "a string not written by a lock" in str(info.value), str(info.value)
    assert all(server.client().get(mgr.key("raw")) == b"someone else's" for server in nodes)


def test_a_reader_paused_past_its_lease_is_told_its_lock_was_lost(
        nodes: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes)
    reader = mgr.read_lock("doc", ttl=0.5, auto_renew=False)
    assert reader.acquire(timeout=1)
    time.sleep(0.8)  # "paused": its lease ran out meanwhile
    writer = mgr.write_lock("doc", ttl=30)
    assert writer.acquire(timeout=1)  # the writer does not wait for the dead reader
    with pytest.raises(LockLost):
        reader.release()
    assert writer.owned()
    writer.release()


def test_renewal_keeps_readers_and_writers_held(nodes: RedisNodes,
                                                make_manager: MakeManager) -> None:
    mgr = make_manager(nodes)
    r1, r2 = mgr.read_lock("long", ttl=1), mgr.read_lock("long", ttl=1)
    w = mgr.write_lock("long-w", ttl=1)
    assert r1.acquire(timeout=1) and r2.acquire(timeout=1) and w.acquire(timeout=1)
    time.sleep(2.5)  # more than two leases: the renewal thread (batched) kept them
    assert r1.owned() and r2.owned() and w.owned()
    assert mgr.write_lock("long").acquire(timeout=0) is False
    assert mgr.read_lock("long-w").acquire(timeout=0) is False
    r1.release()
    r2.release()
    w.release()


def test_asyncio_twins(nodes: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes)

    async def scenario() -> None:
        async with mgr.aread_lock("adoc") as r1, mgr.aread_lock("adoc") as r2:
            assert r1.owned() and r2.owned()
            assert await mgr.awrite_lock("adoc").acquire(timeout=0) is False
        async with mgr.awrite_lock("adoc") as w:
            assert w.owned()
            assert await mgr.aread_lock("adoc").acquire(timeout=0) is False
            with pytest.raises(LockKindConflict):
                await mgr.alock("adoc", timeout=5).acquire()

    asyncio.run(scenario())


def test_with_lock_modes(nodes: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes)
    inside: list[tuple[str, bool]] = []

    @with_lock("report:<day>", mode="read", manager=mgr, timeout=0)
    def read(day: str) -> None:
        # Another reader may join; a writer may not.
        inside.append(("read", mgr.read_lock(f"report:{day}").acquire(timeout=0)))
        inside.append(("write", mgr.write_lock(f"report:{day}").acquire(timeout=0)))

    @with_lock("report:<day>", mode="write", manager=mgr, timeout=0)
    def write(day: str) -> None:
        inside.append(("read-in-write", mgr.read_lock(f"report:{day}").acquire(timeout=0)))

    read("mon")
    write("tue")
    assert inside == [("read", True), ("write", False), ("read-in-write", False)]

    with pytest.raises(ValueError, match="mode"):
        with_lock("x", mode="shared")
    with pytest.raises(ValueError, match="reentrant"):
        with_lock("x", mode="read", reentrant=True)


def test_force_release_frees_a_read_write_lock(nodes: RedisNodes,
                                               make_manager: MakeManager) -> None:
    mgr = make_manager(nodes)
    reader = mgr.read_lock("stuck", ttl=30)
    assert reader.acquire(timeout=1)
    mgr.force_release("stuck")
    with mgr.write_lock("stuck", timeout=1):
        pass
    with pytest.raises(LockLost):
        reader.release()


def test_force_release_of_one_reader_spares_the_others(nodes: RedisNodes,
                                                      make_manager: MakeManager) -> None:
    """``force_release(name, holder=<one reader's token>)``: the operator saw a
    stuck reader and must not delete the healthy ones. The script deleted the
    whole hash once one field matched: the healthy reader went on reading
    (``owned()`` true) while a writer got in beside it. Only that reader's
    field goes; the key, and the wake-up of its waiters, only with the last
    holder."""
    mgr = make_manager(nodes, node_timeout=0.5, retry_delay=30)
    stuck = mgr.read_lock("doc", ttl=30, auto_renew=False)
    healthy = mgr.read_lock("doc", ttl=30, auto_renew=False)
    assert stuck.acquire(timeout=0) and healthy.acquire(timeout=0)
    got: dict[str, Any] = {}

    def writer() -> None:  # waits in line: only a release notice wakes it early
        w = mgr.write_lock("doc", ttl=30, auto_renew=False)
        got["ok"] = w.acquire(timeout=10)
        got["at"] = time.monotonic()
        got["lock"] = w

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert wait_until(lambda: any(server.client().llen(waiters_key(mgr.key("doc")))
                                      for server in nodes), timeout=5)
        replies = mgr.force_release("doc", holder=stuck._token)
        assert all(isinstance(r, list) and r[0] == 1 and r[1].startswith(stuck._token.encode())
                   for r in replies), replies
        for server in nodes:
            assert server.client().hkeys(mgr.key("doc")) == [healthy._token.encode()]
        assert healthy.owned()
        assert mgr.write_lock("doc").acquire(timeout=0) is False
        time.sleep(0.3)
        assert "ok" not in got  # nobody was woken: the healthy reader still reads
        with pytest.raises(LockLost):
            stuck.release()
        # The last holder, force-released by its token: the key goes, the
        # writer in line is woken at once (its retry delay is 30 s).
        released = time.monotonic()
        replies = mgr.force_release("doc", holder=healthy._token)
        assert all(isinstance(r, bytes) for r in replies), replies
        thread.join(timeout=12)
        assert got.get("ok") and got["at"] - released < 5, got
        with pytest.raises(LockLost):
            healthy.release()
    finally:
        thread.join(timeout=12)
        if got.get("lock") is not None and got["lock"].owned():
            got["lock"].release()


def test_a_plain_holder_whose_name_a_reader_took_since_is_told_it_lost_the_lock(
        nodes: RedisNodes, make_manager: MakeManager, caplog: pytest.LogCaptureFixture) -> None:
    """The operator force-releases a plain lock; a reader then takes the name
    (the key is now a hash). The former holder learns it at its next renewal
    or release, as after any force release: extend.lua and release.lua read
    the key with a GET, whose WRONGTYPE error made the extend a
    QuorumUnavailable with ``owned()`` still true, and the release a warning
    about a foreign value, with resends, instead of LockLost."""
    mgr = make_manager(nodes, node_timeout=0.5)
    extended = mgr.lock("taken", ttl=30, auto_renew=False)
    released = mgr.lock("taken2", ttl=30, auto_renew=False)
    assert extended.acquire(timeout=0) and released.acquire(timeout=0)
    readers = []
    for name in ("taken", "taken2"):
        mgr.force_release(name)
        reader = mgr.read_lock(name, ttl=30, auto_renew=False)
        assert reader.acquire(timeout=0)
        readers.append(reader)
    with pytest.raises(LockLost):
        extended.extend(30)
    assert not extended.owned()
    with caplog.at_level("WARNING", logger="django_redlock"):
        with pytest.raises(LockLost):
            released.release()
    assert "WRONGTYPE" not in caplog.text and "did not confirm" not in caplog.text, caplog.text
    for reader in readers:  # the readers' hold untouched
        assert reader.owned()
        reader.release()


@pytest.mark.timeout(180)
def test_processes_never_overlap_a_writer(redis_nodes_factory: Callable[..., RedisNodes],
                                          tmp_path: Path) -> None:
    """Four processes reading (70 %) and writing (30 %) one name, counted in Redis
    and in a database: a writer read-modify-writes a plain row and a fenced one
    (its write lock's fence), a reader checks that neither changes under it."""
    nodes = redis_nodes_factory(3)
    meter = redis_nodes_factory(1)
    outcome = run_workers("rw", nodes, meter, tmp_path, procs=4, rounds=25)
    report = outcome.report
    assert report.get("reads", 0) + outcome.holds("doc") == 4 * 25
    assert outcome.holds("doc") > 0 and report.get("reads", 0) > 0
    assert report.get("reader_saw_write", 0) == 0, report
    # No writer beside a reader or a writer (Redis); no lost write (both rows).
    assert_no_lost_update(outcome, ["doc"])
    assert outcome.meter["readers:doc"] == 0 and outcome.meter["in:doc"] == 0
    # The readers did share: some saw another reader inside with them.
    assert outcome.meter.get("readers-seen:2", 0) > 0, "no two readers ever held it together"


# -- faults ---------------------------------------------------------------------------

def test_a_node_killed_or_paused_keeps_the_quorum(
        redis_nodes_factory: Callable[..., RedisNodes], make_manager: MakeManager) -> None:
    nodes = redis_nodes_factory(3)
    mgr = make_manager(nodes, node_timeout=0.2)
    nodes.servers[0].kill()
    with mgr.read_lock("f1") as r1, mgr.read_lock("f1") as r2:
        assert r1.owned() and r2.owned()
        assert mgr.write_lock("f1").acquire(timeout=0.2) is False
    nodes.servers[1].pause()
    try:
        # Two of three gone: no quorum, a clear error within the bound.
        started = time.monotonic()
        with pytest.raises(QuorumUnavailable):
            mgr.write_lock("f1").acquire(timeout=0.5)
        assert time.monotonic() - started < 3.0
    finally:
        nodes.servers[1].resume()
    with mgr.write_lock("f1", timeout=5) as w:  # one node down still leaves a quorum
        assert w.owned()


def test_a_node_restarted_empty_does_not_let_a_writer_in_beside_a_reader(
        redis_nodes_factory: Callable[..., RedisNodes], make_manager: MakeManager) -> None:
    nodes = redis_nodes_factory(3)
    mgr = make_manager(nodes, node_timeout=0.2)
    reader = mgr.read_lock("f2", ttl=30)
    assert reader.acquire(timeout=1)
    nodes.servers[0].restart(empty=True)  # forgets the reader there
    # Two nodes still have the reader: the writer cannot get a majority.
    assert mgr.write_lock("f2").acquire(timeout=0.5) is False
    reader.release()
    with mgr.write_lock("f2", timeout=5) as w:
        assert w.owned()


def test_manage_py_locks_lists_a_read_write_lock(nodes: RedisNodes,
                                                 make_manager: MakeManager) -> None:
    from django_redlock.engine.inspection.locks import scan_locks

    mgr = make_manager(nodes)
    with mgr.read_lock("listed:r", label="reader-job"), mgr.write_lock("listed:w"):
        found = {info.name: info for info in scan_locks(mgr, "listed:*").locks}
    assert set(found) == {"listed:r", "listed:w"}, found
    assert found["listed:r"].token.startswith("r.") and found["listed:r"].nodes == len(nodes.urls)
    assert found["listed:r"].owner.get("label") == "reader-job"
    assert found["listed:w"].token.startswith("w.")


def test_a_writer_that_gives_up_its_place_lets_the_readers_behind_it_in(
        nodes: RedisNodes, make_manager: MakeManager) -> None:
    # Waiters poll every 3-6 s here: only a release notice serves them sooner.
    mgr = make_manager(nodes, retry_delay=6)
    reader = mgr.read_lock("gave-up", ttl=30)
    assert reader.acquire(timeout=1)
    got: dict[str, Any] = {}

    def writer() -> None:
        got["writer"] = mgr.write_lock("gave-up", ttl=30).acquire(timeout=1.0)

    def late_reader() -> None:
        r = mgr.read_lock("gave-up", ttl=30)
        got["reader"] = r.acquire(timeout=10)
        got["at"] = time.monotonic()
        got["lock"] = r

    w = threading.Thread(target=writer)
    w.start()
    assert wait_until(lambda: any(server.client().llen(waiters_key(mgr.key("gave-up")))
                                  for server in nodes), timeout=5)
    r = threading.Thread(target=late_reader)
    r.start()  # queues behind the writer, although a reader holds the lock
    w.join(timeout=5)
    gave_up = time.monotonic()
    r.join(timeout=12)
    try:
        assert got["writer"] is False
        assert got["reader"], got
        # Woken when the writer left the line, not by its timer (the holder's 30 s).
        assert got["at"] - gave_up < 1.5, got["at"] - gave_up
    finally:
        reader.release()
        if got.get("lock") is not None and got["lock"].owned():
            got["lock"].release()


_HOLD_OR_QUEUE = textwrap.dedent("""
    import sys, time
    from django_redlock import LockManager
    urls, role = sys.argv[1].split(","), sys.argv[2]
    mgr = LockManager(urls, node_timeout=0.5, ttl=1.0)
    if role == "reader":
        assert mgr.read_lock("dead-writer", auto_renew=True).acquire(timeout=5)
        print("holds", flush=True)
    else:
        print("queues", flush=True)
        mgr.write_lock("dead-writer").acquire(timeout=30)
    time.sleep(30)
""")


def test_a_writer_killed_in_line_does_not_keep_readers_out_of_a_free_lock(
        nodes: RedisNodes, make_manager: MakeManager) -> None:
    """A reader holds, a writer queues behind it, and both processes are
    killed (no release ever runs). Once the reader's lease ran out the lock
    was free, but every reader yielded to the dead writer's entry, and each
    reader's retry kept the line alive: no reader got in until some writer
    came (a review saw 45 s). The dead writer's entry is dropped (nobody
    listens on its inbox)."""
    urls = ",".join(nodes.urls)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = []
    try:
        for role, says in (("reader", "holds"), ("writer", "queues")):
            proc = subprocess.Popen([sys.executable, "-c", _HOLD_OR_QUEUE, urls, role],
                                    stdout=subprocess.PIPE, text=True, env=env)
            procs.append(proc)
            assert proc.stdout is not None and proc.stdout.readline().strip() == says
        mgr = make_manager(nodes)
        line = waiters_key(mgr.key("dead-writer"))
        assert wait_until(lambda: all(server.client().llen(line) for server in nodes),
                          timeout=5), "the writer never stood in line"
    finally:
        for proc in procs:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
    time.sleep(1.2)  # the killed reader's lease (1 s) runs out: the lock is free
    reader = mgr.read_lock("dead-writer")
    started = time.monotonic()
    assert reader.acquire(timeout=5)
    assert time.monotonic() - started < 2.0
    reader.release()


def test_a_reader_behind_a_writer_never_keeps_the_line_alive(
        nodes: RedisNodes, make_manager: MakeManager) -> None:
    """Where a node cannot tell whether a writer still listens (a Cluster or
    Sentinel node), a dead writer's entry is waited for only until the line
    expires: a reader's retries never prolong it, only the writer's own
    attempts do. Here a dead writer's entry with 1.5 s left: the reader,
    retrying every 0.1 s, gets the free lock once it expired (each retry
    used to add 30 s)."""
    mgr = make_manager(nodes, retry_delay=0.1)
    for node in mgr.nodes:
        node.hands_over = False  # as a Cluster or Sentinel node says
    line = waiters_key(mgr.key("expiring-writer"))
    for server in nodes:
        client = server.client()
        client.rpush(line, b"{redlock}:inbox:gone|w.dead-writer")
        client.pexpire(line, 1500)
    reader = mgr.read_lock("expiring-writer")
    started = time.monotonic()
    assert reader.acquire(timeout=6)
    took = time.monotonic() - started
    assert 1.0 < took < 4.0, took  # behind the writer until its line expired
    reader.release()
