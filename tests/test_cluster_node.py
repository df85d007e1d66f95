"""A Redis Cluster as one Redlock node (issue 21), on a real 3-master Cluster
(``RedisClusterGroup``): each lock goes to its slot's master, the wake-up
crosses the Cluster, renewals are batched per slot, and a hold survives its
slot's migration (finished, or half-way: ASK). Every wait is bounded."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable, Iterator

import pytest

from django_redlock import QuorumUnavailable
from django_redlock.testing import RedisClusterGroup, RedisServer
from django_redlock.testing.base import RedisReplyError, _raw_commands
from django_redlock.transport.nodekinds import ClusterNode

from .polling import child_exit_code, wait_until

pytestmark = pytest.mark.slow

MakeManager = Callable[..., Any]
SLOW_RETRY = 5.0  # longer than any wake-up below may take


@pytest.fixture(scope="module")
def shared() -> Iterator[RedisClusterGroup]:
    with RedisClusterGroup(3) as cluster:
        yield cluster


@pytest.fixture
def cluster(shared: RedisClusterGroup) -> RedisClusterGroup:
    shared.flushall()
    return shared


def owner(cluster: RedisClusterGroup, key: str) -> RedisServer:
    return cluster.master_for_slot(cluster.key_slot(key))


def names_on_each_master(cluster: RedisClusterGroup, mgr: Any, count: int = 1) -> list[str]:
    """Lock names whose keys live on each master in turn (``count`` per master)."""
    found: dict[int, list[str]] = {m.port: [] for m in cluster}
    for i in range(1000):
        name = f"n{i}"
        port = owner(cluster, mgr.key(name)).port
        if len(found[port]) < count:
            found[port].append(name)
        if all(len(v) == count for v in found.values()):
            break
    return [n for names in found.values() for n in names]


def node_of(mgr: Any) -> ClusterNode:
    (node,) = mgr.nodes
    assert isinstance(node, ClusterNode)
    return node


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_each_lock_lives_on_its_slots_master(cluster: RedisClusterGroup,
                                             make_manager: MakeManager, flavour: str) -> None:
    mgr = make_manager([cluster.node_setting()])
    for name in names_on_each_master(cluster, mgr):
        master = owner(cluster, mgr.key(name))
        if flavour == "sync":
            with mgr.lock(name, ttl=5, auto_renew=False) as lock:
                assert master.execute("EXISTS", lock.key) == 1
                assert master.execute("EXISTS", f"{{{lock.key}}}:fence") == 1  # same slot
                lock.extend(20)
                assert 5_000 < master.execute("PTTL", lock.key) <= 20_000
        else:
            async def scenario(name: str = name, master: RedisServer = master) -> None:
                async with mgr.alock(name, ttl=5, auto_renew=False) as lock:
                    assert master.execute("EXISTS", lock.key) == 1
                    await lock.extend(20)
                    assert 5_000 < master.execute("PTTL", lock.key) <= 20_000

            asyncio.run(scenario())
        assert master.execute("EXISTS", mgr.key(name)) == 0
    assert len(node_of(mgr).shards) == 3


def test_a_second_holder_is_refused_and_fences_grow(cluster: RedisClusterGroup,
                                                    make_manager: MakeManager) -> None:
    first = make_manager([cluster.node_setting()])
    second = make_manager([cluster.node_setting()])
    with first.lock("busy", auto_renew=False) as held:
        assert not second.lock("busy", timeout=0).acquire()
    with second.lock("busy", auto_renew=False) as later:
        assert later.fence > held.fence


def test_a_release_wakes_a_waiter_across_the_cluster(cluster: RedisClusterGroup,
                                                     make_manager: MakeManager) -> None:
    """The notice is published on the lock's master; the waiter listens on
    another master (a Cluster passes PUBLISH to every node)."""
    holder = make_manager([cluster.node_setting()])
    waiter = make_manager([cluster.node_setting()], retry_delay=SLOW_RETRY)
    listens_on = node_of(waiter).owner(0)
    name = next(n for n in names_on_each_master(cluster, holder)
                if owner(cluster, holder.key(n)).port != listens_on[1])
    lock = holder.lock(name, auto_renew=False)
    assert lock.acquire()
    served: list[float] = []

    def wait() -> None:
        mine = waiter.lock(name, timeout=10, auto_renew=False)
        if mine.acquire():
            at = time.monotonic()
            # Really held: the key is the waiter's (a lock "handed over" by a
            # notice whose PUBLISH counted nobody on the lock's master was
            # taken back by the release: its release raised LockLost).
            if master.execute("GET", mine.key).startswith(mine._token.encode()):
                served.append(at)
            mine.release()

    master = owner(cluster, lock.key)
    thread = threading.Thread(target=wait)
    thread.start()
    assert wait_until(lambda: master.execute("LLEN", f"{{{lock.key}}}:waiters") == 1,
                      timeout=5.0), "not queued"
    released = time.monotonic()
    lock.release()
    thread.join(timeout=SLOW_RETRY)
    assert served and served[0] - released < 1.0


def test_an_async_waiter_is_woken(cluster: RedisClusterGroup, make_manager: MakeManager) -> None:
    holder = make_manager([cluster.node_setting()])
    waiter = make_manager([cluster.node_setting()], retry_delay=SLOW_RETRY)

    async def scenario() -> float:
        lock = holder.lock("awake", auto_renew=False)
        assert lock.acquire()
        started = time.monotonic()
        asyncio.get_running_loop().call_later(0.3, lock.release)
        async with waiter.alock("awake", timeout=10, auto_renew=False):
            return time.monotonic() - started

    assert asyncio.run(scenario()) < 1.3  # 0.3 s held, then woken (retries are 5 s apart)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_renewals_of_locks_on_several_slots_are_batched_per_slot(
        cluster: RedisClusterGroup, make_manager: MakeManager, flavour: str) -> None:
    """The renewal batch (one script call per node) is split by slot: a call
    with keys of several slots would be refused (CROSSSLOT)."""
    mgr = make_manager([cluster.node_setting()])
    names = names_on_each_master(cluster, mgr, count=2)
    if flavour == "sync":
        locks = [mgr.lock(name, ttl=1.2) for name in names]
        for lock in locks:
            assert lock.acquire()
        time.sleep(2.6)  # two leases: only the renewals keep them
        assert all(lock.owned() for lock in locks)
        for lock in locks:
            lock.release()
    else:
        async def scenario() -> None:
            locks = [mgr.alock(name, ttl=1.2) for name in names]
            for lock in locks:
                assert await lock.acquire()
            await asyncio.sleep(2.6)
            assert all(lock.owned() for lock in locks)
            for lock in locks:
                await lock.release()

        asyncio.run(scenario())


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_hold_survives_the_migration_of_its_slot(cluster: RedisClusterGroup,
                                                   make_manager: MakeManager, flavour: str) -> None:
    holder = make_manager([cluster.node_setting()])
    other = make_manager([cluster.node_setting()])
    slot = cluster.key_slot(holder.key("moving"))
    source = cluster.master_for_slot(slot)
    target = next(m for m in cluster if m is not source)

    def migrate_and_check(key: str) -> None:
        cluster.migrate_slot(slot, to=target)  # MIGRATING/IMPORTING, MIGRATE, SETSLOT NODE
        assert target.execute("EXISTS", key) == 1
        # Both clients' maps still name the source: MOVED, then the target.
        assert not other.lock("moving", timeout=0).acquire()

    if flavour == "sync":
        lock = holder.lock("moving", ttl=20, auto_renew=False)
        assert lock.acquire()
        migrate_and_check(lock.key)
        lock.extend(20)
        assert 15_000 < target.execute("PTTL", lock.key) <= 20_000
        lock.release()
        fence = lock.fence
    else:
        async def scenario() -> int:
            alock = holder.alock("moving", ttl=20, auto_renew=False)
            assert await alock.acquire()
            migrate_and_check(alock.key)
            await alock.extend(20)
            assert 15_000 < target.execute("PTTL", alock.key) <= 20_000
            await alock.release()
            return int(alock.fence)

        fence = asyncio.run(scenario())
    assert target.execute("EXISTS", holder.key("moving")) == 0
    with other.lock("moving", auto_renew=False) as later:
        assert later.fence > fence
    cluster.migrate_slot(slot, to=source)  # back, for the other tests


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_release_settled_on_plain_nodes_still_follows_the_clusters_moved(
        cluster: RedisClusterGroup, make_manager: MakeManager, flavour: str) -> None:
    """A Cluster node and two plain nodes; the lock's slot moves after the
    grant (the manager's map now names the old master), and the old master
    is slow (paused 0.2 s) when the release comes. The release deletes the
    key on the new master too: it waits for the Cluster's MOVED and follows
    it. Settled on the two plain nodes' replies, it returned at once, the
    MOVED was read later and dropped, and the key stayed on the new master
    for its whole lease (that node busy for every other holder)."""
    with RedisServer() as a, RedisServer() as b:
        mgr = make_manager([cluster.node_setting(), a.url, b.url])
        slot = cluster.key_slot(mgr.key("moving-release"))
        source = cluster.master_for_slot(slot)
        target = next(m for m in cluster if m is not source)

        def migrate_and_slow_the_source(key: str) -> threading.Timer:
            # The grant may have settled on the plain nodes before the
            # Cluster's reply (a loaded CI's py313 leg): the key on the source
            # first, so that the slot moves it.
            assert wait_until(lambda: source.execute("EXISTS", key) == 1, timeout=5.0)
            cluster.migrate_slot(slot, to=target)  # finished: MOVED from the source
            assert target.execute("EXISTS", key) == 1
            source.pause()  # its MOVED comes after the plain nodes' replies
            timer = threading.Timer(0.2, source.resume)
            timer.start()
            return timer

        try:
            if flavour == "sync":
                lock = mgr.lock("moving-release", ttl=30, auto_renew=False)
                assert lock.acquire(timeout=2)
                timer = migrate_and_slow_the_source(lock.key)
                lock.release()
            else:
                async def scenario() -> threading.Timer:
                    alock = mgr.alock("moving-release", ttl=30, auto_renew=False)
                    assert await alock.acquire(timeout=2)
                    started = migrate_and_slow_the_source(alock.key)
                    await alock.release()
                    return started

                timer = asyncio.run(asyncio.wait_for(scenario(), 30))
            timer.join(5)
            key = mgr.key("moving-release")
            assert (a.execute("EXISTS", key), b.execute("EXISTS", key)) == (0, 0)
            assert target.execute("EXISTS", key) == 0, target.execute("PTTL", key)
        finally:
            source.resume()
            cluster.migrate_slot(slot, to=source)  # back, for the other tests


def test_a_hold_survives_a_slot_half_migrated(cluster: RedisClusterGroup,
                                              make_manager: MakeManager) -> None:
    """The keys moved, the slot not yet handed over: the source answers ASK,
    and the holder's extension goes to the target behind ASKING. A contender
    (whose script also names the waiter queue, which exists nowhere) is
    answered TRYAGAIN until the slot is handed over: refused (busy, not
    QuorumUnavailable), never granted."""
    holder = make_manager([cluster.node_setting()])
    other = make_manager([cluster.node_setting()])
    lock = holder.lock("half", ttl=20, auto_renew=False)
    assert lock.acquire()
    slot = cluster.key_slot(lock.key)
    source = cluster.master_for_slot(slot)
    target = next(m for m in cluster if m is not source)
    cluster.migrate_slot(slot, to=target, finish=False)
    try:
        assert cluster.move_keys(slot, source, target) == 2  # the lock and its fence counter
        # TRYAGAIN, the node's only reply: refused (busy), not an error
        assert other.lock("half", timeout=0).acquire() is False
        lock.extend(20)
        # (the target answers for the slot only behind ASKING until it is handed over)
        _, pttl = _raw_commands(target.host, target.port, None,
                                [("ASKING",), ("PTTL", lock.key)], 2.0)
        assert 15_000 < pttl <= 20_000
        with pytest.raises(RedisReplyError, match="^ASK"):  # not on the source any more
            source.execute("EXISTS", lock.key)
    finally:
        cluster.finish_migration()
    lock.release()
    assert target.execute("EXISTS", lock.key) == 0
    with other.lock("half", auto_renew=False) as later:
        assert later.fence > lock.fence
    cluster.migrate_slot(slot, to=source)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_replica_acks_are_asked_of_the_importing_master_behind_asking(
        make_manager: MakeManager, flavour: str) -> None:
    """REPLICA_ACKS=1 while the lock's slot is half-migrated (keys moved, slot
    not handed over): the source answers ASK, and the extension goes to the
    importing master behind ASKING with its WAIT, on the same connection, so
    that WAIT confirms the write of the master that made it. Proof: with the
    importing master's replica frozen the extension is not confirmed (the
    source's replica is fine, and a WAIT on the source, which wrote nothing,
    would have confirmed at once); with it running, the extension counts."""
    with RedisClusterGroup(3, replicas=1, node_timeout_ms=5000) as c:
        holder = make_manager([c.node_setting()], replica_acks=1)
        name = "acked-half"
        slot = c.key_slot(holder.key(name))
        source = c.master_for_slot(slot)
        target = next(m for m in c if m is not source)
        target_replica = c.replicas[c.masters.index(target)][0]

        def pttl() -> int:
            _, ms = _raw_commands(target.host, target.port, None,
                                  [("ASKING",), ("PTTL", holder.key(name))], 2.0)
            return int(ms)

        def half_migrate() -> None:
            c.migrate_slot(slot, to=target, finish=False)
            assert c.move_keys(slot, source, target) == 2  # the lock and its fence counter
            target_replica.pause()

        def replica_back() -> None:
            target_replica.resume()
            assert pttl() > 15_000  # the importing master ran it; its replica had not said so
            assert wait_until(lambda: b"master_link_status:up"
                              in target_replica.execute("INFO", "replication"), timeout=10.0)

        unconfirmed = pytest.raises(QuorumUnavailable, match="not confirmed by its replicas")
        try:
            if flavour == "sync":
                lock = holder.lock(name, ttl=10, auto_renew=False)
                assert lock.acquire()
                half_migrate()
                with unconfirmed:
                    lock.extend(20)
                replica_back()
                lock.extend(20)  # now confirmed by the importing master's replica
                assert pttl() > 15_000
                target.execute("SCRIPT", "FLUSH")  # NOSCRIPT: all three again, as EVAL
                lock.extend(20)
                assert pttl() > 15_000
                c.finish_migration()
                lock.release()
            else:
                async def scenario() -> None:
                    alock = holder.alock(name, ttl=10, auto_renew=False)
                    assert await alock.acquire()
                    half_migrate()
                    with unconfirmed:
                        await alock.extend(20)
                    replica_back()
                    await alock.extend(20)
                    assert pttl() > 15_000
                    target.execute("SCRIPT", "FLUSH")
                    await alock.extend(20)
                    assert pttl() > 15_000
                    c.finish_migration()
                    await alock.release()

                asyncio.run(scenario())
        finally:
            target_replica.resume()
        assert target.execute("EXISTS", holder.key(name)) == 0


def test_manage_py_locks_lists_and_shows_locks_on_every_master(
        cluster: RedisClusterGroup, make_manager: MakeManager, settings: Any) -> None:
    import io
    import json

    from django.core.management import call_command

    settings.REDLOCK_NODES = [cluster.node_setting()]
    mgr = make_manager([cluster.node_setting()])
    names = names_on_each_master(cluster, mgr)
    locks = [mgr.lock(name, ttl=30, auto_renew=False) for name in names]
    for lock in locks:
        assert lock.acquire()
    out = io.StringIO()
    call_command("locks", "list", "--json", stdout=out)
    listed = {item["name"]: item for item in json.loads(out.getvalue())}
    assert set(names) <= set(listed)  # one lock on each master, all found
    for lock in locks:
        shown = io.StringIO()
        call_command("locks", "show", lock.name, "--json", stdout=shown)
        (view,) = json.loads(shown.getvalue())["per_node"]
        assert view["state"] == "held"
        lock.release()


def retry_while_unavailable(call: Callable[[], Any], tries: int = 50) -> Any:
    """``call()`` until it does not raise QuorumUnavailable (bounded: ``tries``
    times, 0.2 s apart): the first calls after a master's death meet it."""
    for _ in range(tries - 1):
        try:
            return call()
        except QuorumUnavailable:
            time.sleep(0.2)
    return call()


def test_a_hold_confirmed_by_a_replica_survives_its_masters_failover(
        make_manager: MakeManager) -> None:
    """A Cluster master dies; its replica (which confirmed the grant:
    REPLICA_ACKS=1) takes over the slot. The node follows the new map: the
    lock is still held, and the holder extends it once the new master has a
    replica again (the old one, back as its replica)."""
    with RedisClusterGroup(3, replicas=1, node_timeout_ms=1000) as c:
        holder = make_manager([c.node_setting()], replica_acks=1)
        other = make_manager([c.node_setting()], replica_acks=1)
        lock = holder.lock("fo", ttl=30, auto_renew=False)
        assert lock.acquire()
        owner_ = c.master_for_slot(c.key_slot(lock.key))
        replica = c.replicas[c.masters.index(owner_)][0]
        owner_.kill()
        assert wait_until(lambda: replica.execute("ROLE")[0] == b"master", timeout=15.0)
        assert replica.execute("EXISTS", lock.key) == 1
        assert retry_while_unavailable(lambda: other.lock("fo", timeout=0).acquire()) is False
        owner_.restart()  # back with its cluster config: a replica of the new master
        assert wait_until(lambda: b"master_link_status:up"
                          in owner_.execute("INFO", "replication"), timeout=15.0)
        retry_while_unavailable(lambda: lock.extend(30))
        assert replica.execute("PTTL", lock.key) > 25_000
        lock.release()


def test_a_redirection_parsed_as_a_bare_response_error_is_followed() -> None:
    """redis-py 5's plain connections parse MOVED/ASK/TRYAGAIN as a bare
    ``ResponseError`` (only its cluster client's parser knows them): the
    Cluster node reads them from the text, and leaves other errors alone.
    (The suite's Cluster tests follow real redirections this way when run
    with redis-py 5.)"""
    from redis.exceptions import AskError, MovedError, ResponseError, TryAgainError

    from django_redlock.transport.nodekinds import _cluster_error

    moved = _cluster_error(ResponseError("MOVED 7052 127.0.0.1:7001"))
    assert isinstance(moved, MovedError)
    assert (moved.slot_id, moved.host, moved.port) == (7052, "127.0.0.1", 7001)
    ask = _cluster_error(ResponseError("ASK 12 10.0.0.2:7002"))
    assert isinstance(ask, AskError) and (ask.slot_id, ask.port) == (12, 7002)
    assert isinstance(_cluster_error(ResponseError("TRYAGAIN Multiple keys request")),
                      TryAgainError)
    other = ResponseError("ERR unknown command")
    assert _cluster_error(other) is other
    garbled = ResponseError("MOVED soon")
    assert _cluster_error(garbled) is garbled
    already = MovedError("1 h:2")
    assert _cluster_error(already) is already


# -- a semaphore: its keys must share one slot ---------------------------------------

def _script_calls(server: RedisServer) -> int:
    stats = server.client().info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


@pytest.mark.parametrize("mixed", [False, True])
def test_a_semaphore_name_without_a_hash_tag_is_refused_before_anything_is_sent(
        cluster: RedisClusterGroup, make_manager: MakeManager, mixed: bool,
        redis_nodes_factory: Callable[..., Any]) -> None:
    """A semaphore's script touches its permit's keys, its count key and its
    line's: in several slots unless the name has a hash tag, and a Cluster
    answers CROSSSLOT to every try. Alone, the Cluster node made every
    acquire QuorumUnavailable; beside plain nodes (``mixed``) it silently
    never voted (one fault from no quorum). Refused at construction now."""
    plain = redis_nodes_factory(2) if mixed else None
    nodes = [*plain.urls, cluster.node_setting()] if plain else [cluster.node_setting()]
    mgr = make_manager(nodes)
    servers = [*cluster, *(plain or [])]
    before = [_script_calls(server) for server in servers]
    for make in (mgr.semaphore, mgr.asemaphore):
        for name in ("exports", "odd}name", "{}x"):
            with pytest.raises(ValueError, match=r"hash tag.*\{pool\}"):
                make(name, 3)
    assert [_script_calls(server) for server in servers] == before
    assert all(server.client().dbsize() == 0 for server in servers)


@pytest.mark.parametrize("mixed", [False, True])
def test_a_semaphore_with_a_hash_tag_works_on_a_cluster_node(
        cluster: RedisClusterGroup, make_manager: MakeManager, mixed: bool,
        redis_nodes_factory: Callable[..., Any]) -> None:
    """Its keys share the tag's slot: the permits, the line, the count check
    and the read of the permits all run there, and the Cluster votes."""
    from django_redlock.engine.semaphore import PermitsMismatch

    plain = redis_nodes_factory(2) if mixed else None
    nodes = [*plain.urls, cluster.node_setting()] if plain else [cluster.node_setting()]
    mgr = make_manager(nodes)
    name = "{pool}exports"
    held = [mgr.semaphore(name, 2, timeout=1) for _ in range(2)]
    assert all(sem.acquire() for sem in held)
    master = owner(cluster, mgr.key(name))
    assert sorted(master.execute("EXISTS", mgr.key(f"{name}#{sem.index}"))
                  for sem in held) == [1, 1]  # the Cluster granted both
    assert mgr.semaphore(name, 2, timeout=0).acquire() is False  # two permits, no more
    with pytest.raises(PermitsMismatch):
        mgr.semaphore(name, 3, timeout=0).acquire()
    # A waiter goes through the line (on the tag's slot too) and is woken.
    waiter = mgr.semaphore(name, 2, timeout=5)
    outcome: list[Any] = []
    thread = threading.Thread(target=lambda: outcome.append(waiter.acquire()), daemon=True)
    thread.start()
    line_key = mgr.key(f"{name}#line")
    assert wait_until(lambda: master.execute("EXISTS", line_key) == 1, timeout=5)
    freed = held.pop()
    index = freed.index
    freed.release()
    thread.join(10)
    assert outcome == [True] and waiter.index == index

    async def try_async() -> bool:
        return bool(await mgr.asemaphore(name, 2, timeout=0).acquire())

    assert asyncio.run(try_async()) is False  # the asyncio flavour: the same permits
    for sem in (*held, waiter):
        sem.release()
    assert wait_until(lambda: all(master.execute("EXISTS", mgr.key(f"{name}#{i}")) == 0
                                  for i in range(2)), timeout=3)


def test_a_child_forked_while_the_slot_map_loads_loads_its_own(
        cluster: RedisClusterGroup, make_manager: MakeManager) -> None:
    """A fork while a background thread reloads the slot map (every master
    slow to answer: paused). The child inherited ``_refreshing`` set, and
    redis-py's map with its ``_initialization_lock`` held, by a thread that
    does not exist in it: it never loaded a map again (a slot whose master
    failed over was never found there; a reload would have blocked for
    good). Now the child's node loads a map of its own, and serves locks."""
    import os

    if not hasattr(os, "fork"):
        pytest.skip("needs fork()")
    mgr = make_manager([cluster.node_setting()], node_timeout=0.5, connect_timeout=0.5)
    node = node_of(mgr)
    with mgr.lock("forked-while-loading", timeout=5, auto_renew=False):
        pass  # a map is loaded
    assert wait_until(lambda: node._manager is not None and not node._refreshing, timeout=5.0)
    loaded = node.refreshes
    try:
        for master in cluster.masters:
            master.pause()
        time.sleep(0.15)  # past REFRESH_MIN
        node.refresh()
        # The worst moment: the load is under way, redis-py's lock held.
        assert wait_until(lambda: node._refreshing, timeout=2.0)
        time.sleep(0.1)
        assert node._refreshing
        pid = os.fork()
        if pid == 0:  # child: no pytest here; the code says what went wrong
            code = 0
            try:
                # (Threads of the child first: a reload's thread reusing the
                # dead loader's stack, and so its thread id, would take
                # redis-py's RLock as its own.)
                started = [threading.Thread(target=time.sleep, args=(0.5,), daemon=True)
                           for _ in range(4)]
                for thread in started:
                    thread.start()
                deadline = time.monotonic() + 10.0
                while node.refreshes <= loaded and time.monotonic() < deadline:
                    node.refresh()
                    time.sleep(0.1)
                if node.refreshes <= loaded:
                    code = 2
                lock = mgr.lock("forked-while-loading", timeout=5, auto_renew=False)
                if lock.acquire():
                    lock.release()
                else:
                    code = code or 3
            except BaseException:  # noqa: BLE001 - anything: not a pass
                code = code or 4
            finally:
                os._exit(code)
    finally:
        for master in cluster.masters:
            master.resume()
    assert child_exit_code(pid, 30.0) == 0  # 2: no map loaded, 3: not acquired, 4: raised
    with mgr.lock("forked-while-loading", timeout=5, auto_renew=False):
        pass  # the parent's node still serves


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_free_lock_in_a_slot_being_migrated_is_waited_for(
        cluster: RedisClusterGroup, make_manager: MakeManager, flavour: str) -> None:
    """A free lock whose slot is being migrated (MIGRATING/IMPORTING, the
    move ending 1 s later): its keys exist on neither side, so the source
    answers ASK and the target, behind ASKING, TRYAGAIN for as long as the
    move lasts. A Cluster node alone: a try is refused (False), and a
    blocking acquire waits for the move to end and is granted. Before, both
    raised QuorumUnavailable at once (the node's only reply an error)."""
    mgr = make_manager([cluster.node_setting()])
    name = "migrating-free"
    slot = cluster.key_slot(mgr.key(name))
    source = cluster.master_for_slot(slot)
    target = next(m for m in cluster if m is not source)
    cluster.migrate_slot(slot, to=target, finish=False)
    finisher = threading.Thread(target=lambda: (time.sleep(1.0), cluster.finish_migration()))
    try:
        if flavour == "sync":
            assert mgr.lock(name, timeout=0, auto_renew=False).acquire() is False
            finisher.start()
            started = time.monotonic()
            lock = mgr.lock(name, timeout=5, auto_renew=False)
            assert lock.acquire() is True
            took = time.monotonic() - started
            lock.release()
        else:
            async def scenario() -> float:
                assert await mgr.alock(name, timeout=0, auto_renew=False).acquire() is False
                finisher.start()
                started = time.monotonic()
                lock = mgr.alock(name, timeout=5, auto_renew=False)
                assert await lock.acquire() is True
                took = time.monotonic() - started
                await lock.release()
                return took

            took = asyncio.run(scenario())
        assert 0.5 < took < 5.0, took  # granted once the move ended, not before
        assert cluster.master_for_slot(slot) is target
    finally:
        if finisher.is_alive() or finisher.ident is not None:
            finisher.join(15.0)
        else:
            cluster.finish_migration()
    cluster.migrate_slot(slot, to=source)  # back, for the other tests


def test_a_tryagain_reply_counts_as_busy_in_an_acquire_round() -> None:
    """However redis-py parsed it (a bare ResponseError in redis-py 5, a
    TryAgainError with the code taken off in later ones), a TRYAGAIN reply
    counts as the node busy: answered, nothing of ours there, no error."""
    from redis.exceptions import ResponseError, TryAgainError

    from django_redlock.engine.rounds import retry_later, tally_acquire

    for reply in (ResponseError("TRYAGAIN Multiple keys request during rehashing of slot"),
                  TryAgainError("Multiple keys request during rehashing of slot")):
        assert retry_later(reply)
        tally = tally_acquire([reply], ["cluster"])
        assert (tally.answered, tally.ok, tally.error_replies, tally.errors) == (1, 0, 0, {})
        assert tally.maybe_ours == [False] and tally.queued_at == [False]
    assert not retry_later(ResponseError("READONLY You can't write against a read only replica"))
    assert not retry_later(1)


def _tryagain_replies(server: RedisServer) -> int:
    """How many TRYAGAIN error replies ``server`` has given (``INFO errorstats``)."""
    stats = server.client().info("errorstats")
    return int(stats.get("errorstat_TRYAGAIN", {}).get("count", 0))


def test_an_async_acquire_meeting_tryagain_does_not_stop_the_event_loop(
        cluster: RedisClusterGroup, make_manager: MakeManager) -> None:
    """A free lock in a slot being migrated: every round of a blocking
    acquire meets ASK from the source, then TRYAGAIN from the target behind
    ASKING, and goes again after a short pause. Under asyncio that pause was
    a ``time.sleep`` in the routing code: 5 ms of a stopped event loop for
    every TRYAGAIN, every other task of the loop held up with it. A ticker
    task beside the acquire counts how often it was held up 5 ms or more:
    before, about once per acquire round (some 70 times in a second, for
    some 140 TRYAGAIN replies: the two of a round come back to back);
    now the pause is awaited and the ticker runs on (a loaded machine may
    still hold it up now and then: a few times, against some 140 replies)."""
    mgr = make_manager([cluster.node_setting()], retry_delay=0.01)
    name = "tryagain-loop"
    slot = cluster.key_slot(mgr.key(name))
    source = cluster.master_for_slot(slot)
    target = next(m for m in cluster if m is not source)
    cluster.migrate_slot(slot, to=target, finish=False)
    try:
        before = _tryagain_replies(target)

        async def scenario() -> tuple[bool, list[float]]:
            loop = asyncio.get_running_loop()
            gaps: list[float] = []
            done = asyncio.Event()

            async def ticker() -> None:
                last = loop.time()
                for _ in range(10_000):  # bounded: about 1 ms a turn, the acquire 1 s
                    if done.is_set():
                        return
                    await asyncio.sleep(0.001)
                    now = loop.time()
                    gaps.append(now - last)
                    last = now

            ticking = asyncio.create_task(ticker())
            await asyncio.sleep(0.01)  # the ticker runs first
            try:
                got = await mgr.alock(name, timeout=1.0, auto_renew=False).acquire()
            finally:
                done.set()
                await asyncio.wait_for(ticking, timeout=5.0)
            return bool(got), gaps

        got, gaps = asyncio.run(scenario())
        tryagains = _tryagain_replies(target) - before
    finally:
        cluster.finish_migration()
    cluster.migrate_slot(slot, to=source)  # back, for the other tests
    assert got is False  # the move lasted longer than the acquire's timeout
    assert tryagains >= 20, tryagains  # the acquire met TRYAGAIN round after round
    held_up = [gap for gap in gaps if gap >= 0.005]
    assert len(held_up) < tryagains / 4, (
        f"the event loop stopped {len(held_up)} times for 5 ms or more "
        f"(longest {max(gaps) * 1000:.1f} ms) while the acquire met {tryagains} "
        f"TRYAGAIN replies, {len(gaps)} ticks")
