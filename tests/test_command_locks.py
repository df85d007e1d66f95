"""``manage.py locks``: driven by ``call_command`` and by ``python -m django`` in a
subprocess, against real password-protected nodes, with locks held by *other*
processes, a node killed, a majority killed, and a lock left on a minority.

Every wait is bounded; every holder process is killed at teardown.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_redlock import LockManager
from django_redlock.core.keys import fence_key, waiters_key
from django_redlock.core.owner import new_token, owner_json, parse_value
from django_redlock.engine.inspection import (
    PatternError,
    group_semaphores,
    merge,
    validate_pattern,
)
from django_redlock.management.commands.locks import CLEAR
from django_redlock.testing import RedisNodes
from tests.polling import wait_until

PASSWORD = "s3cret-Pa55word"
ROOT = Path(__file__).resolve().parent.parent
LIST_KEYS = {"name", "nodes", "quorum", "ttl_ms", "owner", "fence"}
HEALTH_KEYS = {"node", "ok", "rtt_ms", "version"}

HOLDER = textwrap.dedent("""
    import os, sys, threading
    from django_redlock import LockManager
    urls, name, ttl = sys.argv[1].split(","), sys.argv[2], float(sys.argv[3])
    threading.Timer(30, os._exit, args=(3,)).start()   # never outlive a broken test
    manager = LockManager(urls, ttl=ttl, auto_renew=False, node_timeout=0.5)
    lock = manager.lock(name, label="holder-proc")
    if not lock.acquire(timeout=5):
        sys.exit(2)
    print(lock.fence, flush=True)
    sys.stdin.readline()                                # until the test closes stdin
    os._exit(0)
""")


class TTY(io.StringIO):
    """A StringIO that says it is a terminal (to test colours and redraws)."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisNodes]:
    with RedisNodes(3, password=PASSWORD) as nodes:
        yield nodes


@pytest.fixture
def nodes(cluster: RedisNodes, settings: Any) -> RedisNodes:
    cluster.flushall()
    settings.REDLOCK_NODES = list(cluster.urls)
    return cluster


@pytest.fixture
def holders() -> Iterator[Callable[..., tuple[subprocess.Popen[str], int]]]:
    """Start a process that acquires a lock and holds it until the test ends."""
    procs: list[subprocess.Popen[str]] = []

    def start(urls: list[str], name: str, ttl: float = 30.0) -> tuple[subprocess.Popen[str], int]:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, ",".join(urls), name, str(ttl)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded: the holder exits within 30 s at worst
        if not line.strip().isdigit():
            proc.kill()
            raise AssertionError(f"holder failed: {line!r} {proc.communicate(timeout=5)[1]}")
        return proc, int(line)

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=5)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def run(*args: str, stdout: io.StringIO | None = None) -> tuple[str, str]:
    out, err = stdout or io.StringIO(), io.StringIO()
    call_command("locks", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


@pytest.fixture
def manage(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``python -m django locks ...`` with settings pointing at the given nodes."""

    def invoke(urls: list[str], *args: str) -> subprocess.CompletedProcess[str]:
        settings = tmp_path / "locks_settings.py"
        text = f"from tests.settings import *  # noqa\nREDLOCK_NODES = {urls!r}\n"
        if not settings.exists() or settings.read_text() != text:
            settings.write_text(text)  # (not rewritten: concurrent calls may read it)
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "locks_settings",
               "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
        return subprocess.run([sys.executable, "-m", "django", "locks", *args], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=30, check=False)

    return invoke


def cell(out: str, row_start: str, column: str) -> str:
    """The text of ``column`` in the table row starting with ``row_start`` (columns are
    aligned, and every column but the last is at least as wide as its header)."""
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith(("NAME ", "NODE ")))
    start = header.index(column)
    row = next(line for line in lines if line.startswith(row_start))
    return row[start:].split("  ")[0].strip()


#: Poll every 20 ms for at most ``timeout`` seconds.
wait_for = functools.partial(wait_until, interval=0.02)


def listed_waiters(name: str) -> int | None:
    """``waiters`` of lock ``name`` in ``locks list --json`` (None: not listed)."""
    found = [d for d in json.loads(run("list", "--json")[0]) if d["name"] == name]
    return found[0]["waiters"] if found else None


def put_minority_lock(nodes: RedisNodes, name: str, *, index: int = 0, fence: int = 7) -> None:
    """A lock value written directly on one node, as a failed attempt leaves it."""
    value = f"{new_token()}|{fence}|{owner_json('leftover')}"
    assert parse_value(value) is not None
    nodes[index].client().set(f"redlock:{name}", value, px=60_000)


# ------------------------------------------------------------- pure logic

def test_pattern_validation() -> None:
    for good in ["*", "orders:*", "a?c", "[ab]*", r"x\[1\]", "[^a-z]x"]:
        assert validate_pattern(good) == good
    for bad in ["", "a[b", "a]b", "x\\", "[]", "a\x01"]:
        with pytest.raises(PatternError):
            validate_pattern(bad)


def test_merge_counts_the_largest_agreeing_group_and_its_quorum_ttl() -> None:
    a = parse_value(f"tokA|5|{owner_json('a')}")
    b = parse_value(f"tokB|9|{owner_json('b')}")
    names = ["n1", "n2", "n3", "n4", "n5"]
    views = [("", a, 9000), ("", a, 7000), ("", b, 8000), ("", a, 8000), None]
    info = merge("x", "redlock:x", views, names, 3, now=time.time())
    assert info is not None
    assert (info.nodes, info.others, info.quorum, info.state) == (3, 1, True, "quorum")
    assert info.ttl_ms == 7000  # the 3rd largest of 9000, 8000, 7000
    assert info.owner["label"] == "a" and info.fence == 5
    assert [v.agrees for v in info.per_node] == [True, True, False, True, False]
    assert info.waiters is None and info.as_json()["waiters"] is None  # queues not read
    # Waiters: the longest queue among the nodes read; a node that did not answer
    # contributes nothing, even if a stale count is passed for it.
    queued = merge("x", "redlock:x", views, names, 3, now=time.time(),
                   errors=[None, None, None, None, "down"], waiters=[2, 3, 0, None, 9])
    assert queued is not None and queued.waiters == 3
    assert [v.waiters for v in queued.per_node] == [2, 3, 0, None, None]
    assert queued.as_json()["waiters"] == 3
    assert [v["waiters"] for v in queued.as_json(per_node=True)["per_node"]] == [2, 3, 0, None,
                                                                                  None]
    minority = merge("x", "redlock:x", [("", a, 500), None, None], names[:3], 2, now=time.time())
    assert minority is not None and minority.state == "minority" and minority.ttl_ms == 500
    uncertain = merge("x", "redlock:x", [("", a, 500), None, None], names[:3], 2,
                      now=time.time(), errors=[None, "down", None])
    assert uncertain is not None and uncertain.state == "uncertain" and not uncertain.quorum
    assert merge("x", "redlock:x", [None, None, None], names[:3], 2, now=time.time()) is None


# -------------------------------------------------------- list and show

def test_list_show_a_lock_held_by_another_process(nodes: RedisNodes, holders: Any,
                                                  manage: Any) -> None:
    proc, fence = holders(nodes.urls, "orders:42", 30.0)
    put_minority_lock(nodes, "stale:1")
    out, err = run()  # no subcommand: list
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "NODES", "STATE", "TTL", "FENCE", "AGE", "WAITERS",
                                "OWNER"]
    held = next(line for line in lines if line.startswith("orders:42"))
    # The holder's fence is the highest of the grants that made its quorum (a
    # settled round); the list shows the highest any node stored, its own
    # fence or a node's a few ms later.
    shown_fence = json.loads(run("list", "--json")[0])[0]["fence"]
    assert "3/3" in held and "quorum" in held and str(shown_fence) in held
    assert shown_fence >= fence
    assert f":{proc.pid} " in held and '"holder-proc"' in held
    stale = next(line for line in lines if line.startswith("stale:1"))
    assert "1/3" in stale and "minority" in stale
    assert held.index("3/3") == stale.index("1/3")  # aligned columns
    assert "\x1b[" not in out  # not a terminal: no colour
    assert "2 locks" in out and "(1 below quorum)" in out
    assert err == ""

    data = json.loads(run("list", "--json")[0])
    assert [d["name"] for d in data] == ["orders:42", "stale:1"]
    for item in data:
        assert LIST_KEYS <= set(item)
        assert {"host", "pid"} <= set(item["owner"])
    orders, stale_j = data
    assert (orders["nodes"], orders["quorum"], orders["fence"]) == (3, True, shown_fence)
    assert (orders["waiters"], stale_j["waiters"]) == (0, 0)
    assert orders["owner"]["pid"] == proc.pid and orders["owner"]["label"] == "holder-proc"
    assert 20_000 < orders["ttl_ms"] <= 30_000 and isinstance(orders["ttl_ms"], int)
    assert (stale_j["nodes"], stale_j["quorum"], stale_j["fence"]) == (1, False, 7)

    assert [d["name"] for d in json.loads(run("list", "--json", "--pattern", "st*")[0])] \
        == ["stale:1"]

    shown = json.loads(run("show", "orders:42", "--json")[0])
    assert shown["name"] == "orders:42" and len(shown["per_node"]) == 3
    assert all(v["state"] == "held" and v["agrees"] for v in shown["per_node"])
    assert max(v["fence"] for v in shown["per_node"]) == shown_fence
    assert fence in {v["fence"] for v in shown["per_node"]}  # one node issued it
    assert all(v["fence_counter"] >= v["fence"] for v in shown["per_node"])
    text = run("show", "stale:1")[0]
    assert "minority: held on 1 of 3 nodes" in text and "absent" in text

    # The same through manage.py in a subprocess.
    result = manage(nodes.urls, "list", "--json")
    assert result.returncode == 0, result.stderr
    assert [d["name"] for d in json.loads(result.stdout)] == ["orders:42", "stale:1"]
    result = manage(nodes.urls, "show", "orders:42")
    assert result.returncode == 0 and "quorum: held on 3 of 3 nodes" in result.stdout
    assert PASSWORD not in result.stdout + result.stderr
    assert "redis://:***@127.0.0.1:" in result.stdout


def test_colour_only_on_a_terminal(nodes: RedisNodes) -> None:
    put_minority_lock(nodes, "c")
    assert "\x1b[" in run(stdout=TTY())[0]
    assert "\x1b[" not in run("list", "--no-color", stdout=TTY())[0]


# -------------------------------------------------------- waiters

def test_waiters_are_counted_until_they_are_served(nodes: RedisNodes) -> None:
    holder = LockManager(nodes.urls, node_timeout=0.5)
    # A long fallback retry: the waiters stay queued until a release wakes them.
    waiters = [LockManager(nodes.urls, node_timeout=0.5, retry_delay=30.0) for _ in range(2)]
    lock = holder.lock("queue", ttl=30, auto_renew=False)
    assert lock.acquire(timeout=0)
    served: list[int] = []

    def wait(i: int, mgr: LockManager) -> None:
        mine = mgr.lock("queue", ttl=5, auto_renew=False)
        if mine.acquire(timeout=15):
            served.append(i)
            mine.release()

    threads = [threading.Thread(target=wait, args=(i, mgr), daemon=True)
               for i, mgr in enumerate(waiters)]
    try:
        for n, thread in enumerate(threads, 1):
            thread.start()
            assert wait_for(lambda n=n: listed_waiters("queue") == n), f"waiter {n} not queued"

        (item,) = json.loads(run("list", "--json")[0])
        assert (item["name"], item["nodes"], item["waiters"]) == ("queue", 3, 2)
        out = run("list")[0]
        assert out.splitlines()[0].split()[6] == "WAITERS"
        assert cell(out, "queue ", "WAITERS") == "2"
        assert cell(out, "queue ", "NODES") == "3/3"  # the other columns are unchanged
        # Per node: what each node's queue holds. A waiter's retry asks the lock's
        # gate node first and queues there alone while it is busy, so the lock's
        # count is the longest queue, not a sum over the nodes.
        key = waiters_key(holder.key("queue"))
        lengths = [nodes[i].client().llen(key) for i in range(3)]
        assert max(lengths) == 2
        shown = json.loads(run("show", "queue", "--json")[0])
        assert shown["waiters"] == 2
        assert [v["waiters"] for v in shown["per_node"]] == lengths
        text = run("show", "queue")[0]
        assert "  waiters 2 queued" in text
        assert [cell(text, url.replace(PASSWORD, "***"), "WAITERS") for url in nodes.urls] \
            == [str(n) for n in lengths]

        lock.release()  # wakes the first waiter; its release wakes the second
        for thread in threads:
            thread.join(15)
        assert not any(t.is_alive() for t in threads) and sorted(served) == [0, 1]
    finally:
        for thread in threads:
            if thread.ident is not None:  # started
                thread.join(15)
        for mgr in waiters:
            mgr.close()

    try:
        # Served: no queue is left on any node, and none is shown.
        assert [nodes[i].client().llen(key) for i in range(3)] == [0, 0, 0]
        assert listed_waiters("queue") in (None, 0)  # (None: no node holds it any more)
        assert lock.acquire(timeout=0)  # held again, with an empty line
        assert listed_waiters("queue") == 0
        assert cell(run("list")[0], "queue ", "WAITERS") == "0"
        assert json.loads(run("show", "queue", "--json")[0])["waiters"] == 0
        lock.release()
    finally:
        holder.close()


def test_scan_lists_neither_waiter_queues_nor_fence_counters(nodes: RedisNodes) -> None:
    """Internal keys start with ``{`` and never match the scan's pattern, also for a
    name with its own hash tag; the keys where the previous layout kept that name's
    counter and queue are named as such, not listed as locks."""
    holder = LockManager(nodes.urls, node_timeout=0.5)
    try:
        locks = [holder.lock(name, ttl=30, auto_renew=False) for name in ("plain", "{t}:job")]
        assert all(lock.acquire(timeout=0) for lock in locks)
        # Two waiters in line on every node (acquire.lua queues a waiter on every
        # busy node it asks), and a third entry on one node only.
        entry = b"redlock:inbox:gone|"
        for name in ("plain", "{t}:job"):
            key = waiters_key(holder.key(name))
            for i in range(3):
                nodes[i].client().rpush(key, entry + b"a", entry + b"b")
                nodes[i].client().pexpire(key, 60_000)
        nodes[0].client().rpush(waiters_key(holder.key("{t}:job")), entry + b"c")

        stored = sorted(k.decode() for k in nodes[1].client().scan_iter(match="redlock:*"))
        assert stored == ["redlock:plain", "redlock:{t}:job"]
        assert waiters_key(holder.key("plain")) == "{redlock:plain}:waiters"
        assert fence_key(holder.key("plain")) == "{redlock:plain}:fence"
        assert fence_key(holder.key("{t}:job")) == "{t}:fence:redlock:{t}:job"

        data = json.loads(run("list", "--json")[0])
        assert [(d["name"], d["waiters"]) for d in data] == [("plain", 2), ("{t}:job", 3)]
        out = run("list")[0]
        assert "2 locks" in out and ":waiters" not in out and ":fence" not in out
        assert [v["waiters"] for v in json.loads(run("show", "{t}:job", "--json")[0])
                ["per_node"]] == [3, 2, 2]
        with pytest.raises(CommandError, match="no lock"):
            run("show", "{t}:job:waiters")
        with pytest.raises(CommandError, match="no lock"):
            run("show", "{t}:job:fence")

        # A process of an older version keeps the old layout's keys for a while.
        for i in range(3):
            nodes[i].client().set("redlock:{t}:job:fence", b"1795542295932", px=60_000)
            nodes[i].client().rpush("redlock:{t}:job:waiters", entry + b"d")
        out = run("list")[0]
        assert "2 locks" in out
        assert ("fencing counter of lock '{t}:job' in the previous key layout" in out), out
        assert "waiter queue of lock '{t}:job' in the previous key layout" in out
        data = json.loads(run("list", "--json")[0])
        legacy = {d["name"]: d["legacy_of"] for d in data if d["state"] == "foreign"}
        assert legacy == {"{t}:job:fence": {"name": "{t}:job", "role": "fence"},
                          "{t}:job:waiters": {"name": "{t}:job", "role": "waiters"}}
        for lock in locks:
            lock.release()
    finally:
        holder.close()


# -------------------------------------------------------- nodes down

def test_node_down_then_majority_down(redis_nodes_factory: Any, holders: Any, manage: Any,
                                      settings: Any) -> None:
    nodes = redis_nodes_factory(3, password=PASSWORD)
    settings.REDLOCK_NODES = list(nodes.urls)
    proc, _ = holders(nodes.urls, "job:1", 30.0)
    nodes[2].kill()
    dead = nodes.urls[2].replace(PASSWORD, "***")

    started = time.monotonic()
    out, _ = run("list")
    assert time.monotonic() - started < 5
    row = next(line for line in out.splitlines() if line.startswith("job:1"))
    assert "2/3" in row and "quorum" in row
    assert "2 of 3 nodes read" in out and dead in out
    data = json.loads(run("list", "--json")[0])
    assert data[0]["nodes"] == 2 and data[0]["quorum"] is True
    shown = json.loads(run("show", "job:1", "--json")[0])
    assert [v["state"] for v in shown["per_node"]] == ["held", "held", "unreachable"]
    assert shown["per_node"][2]["error"]

    health = json.loads(run("health", "--json")[0])
    assert [h["ok"] for h in health] == [True, True, False]
    for item in health:
        assert HEALTH_KEYS <= set(item)
    assert health[2]["node"] == dead and health[2]["error"]
    assert health[0]["version"] and health[0]["rtt_ms"] >= 0
    assert any("no AOF persistence" in w for w in health[0]["warnings"])  # test servers
    text = run("health")[0]
    assert "2 of 3 nodes healthy, quorum 2: OK" in text

    nodes[1].kill()
    with pytest.raises(CommandError) as raised:
        run("health")
    assert raised.value.returncode == 1
    result = manage(nodes.urls, "health")
    assert result.returncode == 1
    assert "NO QUORUM" in result.stdout and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert PASSWORD not in result.stdout + result.stderr
    # One node read, fewer than a quorum: the lock is shown (uncertain), the nodes
    # not read are named, and the exit status says the list may be incomplete.
    result = manage(nodes.urls, "list", "--json")
    assert result.returncode == 1
    (item,) = json.loads(result.stdout)
    assert (item["nodes"], item["quorum"], item["state"]) == (1, False, "uncertain")
    assert PASSWORD not in result.stdout + result.stderr
    assert "only 1 of 3 nodes read (2 needed" in result.stderr
    assert "Traceback" not in result.stderr
    holder_gone = nodes.urls[1].replace(PASSWORD, "***")
    assert dead in result.stderr and holder_gone in result.stderr
    assert proc.poll() is None


def test_list_without_a_quorum_read_is_not_no_locks_held(redis_nodes_factory: Any,
                                                          settings: Any) -> None:
    """Two of three nodes down: the one node read holds nothing, but that does not
    mean no lock is held. Say which nodes were not read, exit non-zero."""
    nodes = redis_nodes_factory(3, password=PASSWORD)
    settings.REDLOCK_NODES = list(nodes.urls)
    out, _ = run("list")
    assert "No locks held under prefix 'redlock'." in out  # all read: a true answer
    nodes[2].kill()
    out, err = run("list")  # a quorum read: a lock held on a quorum would show
    assert "No locks found under prefix 'redlock' on the nodes read" in out
    assert "2 of 3 nodes read" in out and nodes.urls[2].replace(PASSWORD, "***") in out
    nodes[1].kill()
    stdout = io.StringIO()
    with pytest.raises(CommandError) as raised:
        call_command("locks", "list", stdout=stdout, stderr=io.StringIO())
    assert raised.value.returncode == 1
    assert "No locks held" not in stdout.getvalue()
    assert "No locks found" in stdout.getvalue()
    message = str(raised.value)
    assert "only 1 of 3 nodes read (2 needed" in message
    for url in nodes.urls[1:]:
        assert url.replace(PASSWORD, "***") in message
    assert PASSWORD not in message + stdout.getvalue()


def test_paused_node_costs_at_most_its_timeout(redis_nodes_factory: Any, settings: Any) -> None:
    nodes = redis_nodes_factory(3)
    settings.REDLOCK_NODES = list(nodes.urls)
    put_minority_lock(nodes, "p", index=1)
    nodes[0].pause()  # connects still succeed; nothing answers
    for args in (["list"], ["show", "p"], ["health"]):
        started = time.monotonic()
        out, _ = run(*args)
        assert time.monotonic() - started < 4, args  # NODE_TIMEOUT is 0.5 s in tests
        assert "Timeout" in out or "no answer" in out, out
    nodes[0].resume()


def test_wrong_password_is_reported_without_it(nodes: RedisNodes, settings: Any) -> None:
    wrong = "not-the-" + PASSWORD
    settings.REDLOCK_NODES = [nodes.urls[0], nodes.urls[1],
                              nodes.urls[2].replace(PASSWORD, wrong)]
    out, _ = run("health")
    assert "2 of 3 nodes healthy" in out
    assert wrong not in out and PASSWORD not in out
    out, err = run("list")
    assert wrong not in out + err and PASSWORD not in out + err


# -------------------------------------------------------- release

def test_release_refuses_without_force(nodes: RedisNodes, holders: Any, manage: Any) -> None:
    holders(nodes.urls, "keep", 30.0)
    with pytest.raises(CommandError, match="without --force"):
        run("release", "keep")
    result = manage(nodes.urls, "release", "keep")
    assert result.returncode != 0 and "without --force" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert json.loads(run("list", "--json")[0])[0]["nodes"] == 3  # still held


def test_release_with_a_holder_spares_a_lock_that_changed_hands(nodes: RedisNodes) -> None:
    """``locks release NAME --force --holder TOKEN``: only while the holder
    the operator saw (``locks show``'s TOKEN) still holds it."""
    mgr = LockManager(nodes.urls, node_timeout=0.5)
    try:
        first = mgr.lock("handed", ttl=30, auto_renew=False)
        assert first.acquire()
        seen = json.loads(run("show", "handed", "--json")[0])["token"]
        first.release()
        second = mgr.lock("handed", ttl=30, auto_renew=False)
        assert second.acquire()
        with pytest.raises(CommandError, match="another holder"):
            # "=": a token may start with "-" (argparse took it for an option)
            run("release", "handed", "--force", f"--holder={seen}")
        assert second.owned() and mgr.lock("handed").acquire(blocking=False) is False
        now = json.loads(run("show", "handed", "--json")[0])["token"]
        out, _ = run("release", "handed", "--force", f"--holder={now}")
        assert "Released lock 'handed'" in out
        with pytest.raises(CommandError, match="--holder"):
            run("release", "handed", "--force", "--holder=a|b")
        # A token that starts with "-" (a url-safe base64 one may), written with "=".
        dashed = mgr.lock("dashed", ttl=30, auto_renew=False)
        assert dashed.acquire()
        for server in nodes:  # the same hold under a token of that shape
            client = server.client()
            value = client.get(dashed.key)
            client.set(dashed.key, b"-" + value[1:], px=30_000)
        shown = json.loads(run("show", "dashed", "--json")[0])["token"]
        assert shown.startswith("-")
        out, _ = run("release", "dashed", "--force", f"--holder={shown}")
        assert "Released lock 'dashed'" in out
    finally:
        mgr.close()


def test_release_with_a_readers_token_releases_that_reader_only(nodes: RedisNodes) -> None:
    """``locks release NAME --force --holder=TOKEN`` on a read-write lock held
    by two readers: the stuck one goes, the healthy one keeps reading (the
    whole hash was deleted), and the command does not claim waiters were woken."""
    mgr = LockManager(nodes.urls, node_timeout=0.5)
    try:
        stuck = mgr.read_lock("shared", ttl=30, auto_renew=False)
        healthy = mgr.read_lock("shared", ttl=30, auto_renew=False)
        assert stuck.acquire(timeout=0) and healthy.acquire(timeout=0)
        out, _ = run("release", "shared", "--force", f"--holder={stuck._token}")
        assert "Released lock 'shared': deleted on 3 of 3 nodes" in out, out
        assert "other holders of this read-write lock still hold it" in out, out
        assert "waiters were woken" not in out, out
        assert healthy.owned() and mgr.write_lock("shared").acquire(timeout=0) is False
        for server in nodes:
            assert server.client().hkeys(healthy.key) == [healthy._token.encode()]
        out, _ = run("release", "shared", "--force", f"--holder={healthy._token}")
        assert "waiters were woken" in out, out
        assert not any(server.client().exists(healthy.key) for server in nodes)
    finally:
        mgr.close()


def test_release_force_wakes_a_blocked_waiter(nodes: RedisNodes, holders: Any) -> None:
    proc, fence = holders(nodes.urls, "job", 30.0)
    # A long fallback retry: only the release notice can wake the waiter early.
    waiter = LockManager(nodes.urls, node_timeout=0.5, retry_delay=30.0)
    got: dict[str, float] = {}

    def wait() -> None:
        lock = waiter.lock("job", ttl=5, auto_renew=False)
        if lock.acquire(timeout=20):
            got["at"] = time.monotonic()
            got["fence"] = lock.fence
            lock.release()

    thread = threading.Thread(target=wait, daemon=True)
    try:
        thread.start()
        time.sleep(0.6)  # the waiter has tried, subscribed and sleeps
        assert "at" not in got
        released_at = time.monotonic()
        out, _ = run("release", "job", "--force")
        thread.join(10)
        assert "at" in got, "the waiter was not woken"
        assert got["at"] - released_at < 5  # the holder's TTL is 30 s
        assert got["fence"] > fence
    finally:
        thread.join(10)
        waiter.close()
    assert "Released lock 'job': deleted on 3 of 3 nodes" in out
    assert f":{proc.pid} " in out and '"holder-proc"' in out
    assert int(re.search(r"fence (\d+)", out).group(1)) >= fence  # the highest stored
    assert "not held on any node" in run("release", "job", "--force")[0]


# -------------------------------------------------------- watch

def test_watch_frames(nodes: RedisNodes) -> None:
    put_minority_lock(nodes, "w")
    out, _ = run("watch", "--count", "2", "--interval", "0.1")
    assert out.count("django-redlock locks at") == 2 and CLEAR not in out
    assert out.count("\nw ") == 2
    tty = run("watch", "--count", "2", "--interval", "0.1", stdout=TTY())[0]
    assert tty.count(CLEAR) == 2


# -------------------------------------------------------- bad input

@pytest.mark.parametrize("args, message", [
    (["bogus"], "invalid choice"),
    (["list", "--pattern", "a[b"], "bad --pattern"),
    (["list", "--pattern", ""], "bad --pattern"),
    (["show", "nothere"], "no lock 'nothere'"),
    (["show", " spaced"], "bad lock name"),
    (["watch", "--interval", "0"], "--interval"),
    (["watch", "--count", "0"], "--count"),
])
def test_bad_input_is_a_one_line_error(nodes: RedisNodes, args: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=message.replace("[", r"\[")):
        run(*args)


def test_bad_input_from_the_command_line(nodes: RedisNodes, manage: Any) -> None:
    for args in (["bogus"], ["show", "nothere"], ["list", "--pattern", "x\\"]):
        result = manage(nodes.urls, *args)
        assert result.returncode != 0
        assert "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# ------------------------------------------------ what is at a lock key

def test_foreign_and_non_expiring_values_are_named(nodes: RedisNodes) -> None:
    """A raw SET, a PERSIST, a key of another type: each blocks the lock (the acquire
    script's SET NX sees a key there), so list and show name it instead of skipping it."""
    for node in nodes:
        client = node.client()
        client.set("redlock:raw", b"hello")  # a raw SET, no expiry
        client.hset("redlock:hashy", "a", "1")
        client.expire("redlock:hashy", 600)
    forever = f"{new_token()}|11|{owner_json('persisted')}"
    for i in range(2):
        nodes[i].client().set("redlock:forever", forever)  # no expiry, as after a PERSIST
    out, _ = run("list")
    assert "1 lock under prefix 'redlock'" in out
    assert ("Key redlock:raw (lock 'raw') holds no django-redlock lock but string 'hello', "
            "no expiry on 3 of 3 node(s)") in out
    assert "Key redlock:hashy (lock 'hashy') holds no django-redlock lock but hash" in out
    assert "Lock 'forever' has no expiry" in out and "never frees itself" in out
    assert cell(out, "forever", "TTL") == "no expiry"
    data = {d["name"]: d for d in json.loads(run("list", "--json")[0])}
    assert data["raw"]["state"] == "foreign" and data["raw"]["nodes"] == 3
    assert {v["type"] for v in data["hashy"]["foreign"]} == {"hash"}
    assert data["raw"]["foreign"][0] == {"node": nodes.urls[0].replace(PASSWORD, "***"),
                                         "type": "string", "ttl_ms": -1, "preview": "hello"}
    assert data["forever"]["ttl_ms"] == -1 and data["forever"]["state"] == "quorum"

    text = run("show", "raw")[0]
    assert "holds no django-redlock lock but string 'hello', no expiry" in text
    text = run("show", "hashy")[0]
    assert "but hash" in text
    shown = json.loads(run("show", "hashy", "--json")[0])
    assert shown["state"] == "foreign" and len(shown["foreign"]) == 3
    text = run("show", "forever")[0]
    assert "no expiry" in text and "never frees itself" in text
    # A lock on some nodes, something else on another: the node is 'foreign'.
    nodes[2].client().set("redlock:forever", b"\x00binary")
    shown = json.loads(run("show", "forever", "--json")[0])
    assert [v["state"] for v in shown["per_node"]] == ["held", "held", "foreign"]
    assert shown["per_node"][2]["foreign"]["type"] == "string"
    assert "not a lock value: string" in run("show", "forever")[0]


def test_control_characters_are_escaped(nodes: RedisNodes) -> None:
    """Names found by SCAN and owner labels are whatever somebody wrote: no raw ESC
    (or other control character) reaches the terminal."""
    evil_label = "\x1b[2J\x1b]0;pwned\x07label"
    value = f"{new_token()}|9|{owner_json(evil_label)}"
    assert parse_value(value) is not None and "\x1b" in parse_value(value).owner["label"]
    for node in nodes:
        node.client().set("redlock:ok-name", value, px=60_000)
        node.client().set("redlock:evil\x1b[31mred\u202e", value, px=60_000)
        node.client().set("redlock:junk", b"\x1b[2Jfake output\r\n", px=60_000)
    for args in (["list"], ["show", "ok-name"], ["show", "junk"], ["watch", "--count", "1"]):
        out, err = run(*args, stdout=TTY()) if args[0] == "list" else run(*args)
        text = out + err
        assert "\x1b[2J" not in text and "\x1b]0" not in text and "\x07" not in text, args
        assert "\x1b[31mred" not in text and "\u202e" not in text and "\r" not in text, args
    out = run("list")[0]
    assert "\x1b" not in out
    assert "evil\\x1b[31mred\\u202e" in out and "\\x1b[2J\\x1b]0;pwned\\x07label" in out
    assert "'\\x1b[2Jfake output\\r\\n'" in out


# ------------------------------------------------ Django's conventions

def test_django_common_options_in_every_position(nodes: RedisNodes, manage: Any,
                                                 tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    put_minority_lock(nodes, "opts")
    reading = [
        ["list", "--settings=locks_settings", "-v", "2", "--traceback"],
        ["--settings=locks_settings", "list", "-v2"],
        ["list", "--json", "--verbosity=3", "--no-color", f"--pythonpath={tmp_path}"],
        ["show", "opts", "--settings", "locks_settings", "--traceback"],
        ["show", "--traceback", "opts", "-v", "0"],
        ["health", "--force-color", "-v", "1", "--settings=locks_settings"],
        ["watch", "--count", "1", "--interval", "0.1", "--traceback"],
        # --traceback after the subcommand is honoured, not just accepted.
        ["show", "nothere", "--traceback"],
        ["show", "nothere"],
        # A --settings after the subcommand is the one used.
        ["list", "--settings=no_such_settings_module"],
        # The subcommand's help shows them too.
        ["list", "--help"],
    ]
    manage(nodes.urls, "list")  # writes the settings module the others read
    # Each call is a process of its own that only reads: run side by side.
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda args: manage(nodes.urls, *args), reading))
    for args, result in zip(reading[:7], results):
        assert result.returncode == 0, (args, result.stderr)
        assert "unrecognized arguments" not in result.stderr
    traced, plain, elsewhere, helped = results[7:]
    assert traced.returncode == 1 and "Traceback (most recent call last)" in traced.stderr
    assert plain.returncode == 1 and "Traceback" not in plain.stderr
    assert elsewhere.returncode != 0 and "no_such_settings_module" in elsewhere.stderr
    assert "--settings" in helped.stdout and "--traceback" in helped.stdout
    result = manage(nodes.urls, "release", "opts", "--force", "--settings=locks_settings",
                    "-v", "2")  # last: the calls above read the lock
    assert result.returncode == 0, result.stderr
    assert "unrecognized arguments" not in result.stderr


# --------------------------------------------- a port that is not Redis

@pytest.fixture
def http_port() -> Iterator[int]:
    """A tiny HTTP server on a loopback port, in a thread."""
    import http.server

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_a_node_that_is_not_redis_is_a_node_down(nodes: RedisNodes, http_port: int,
                                                 settings: Any, manage: Any) -> None:
    urls = [*nodes.urls[:2], f"redis://:{PASSWORD}@127.0.0.1:{http_port}/0"]
    settings.REDLOCK_NODES = urls
    shown = f"redis://:***@127.0.0.1:{http_port}/0"
    health = json.loads(run("health", "--json")[0])
    assert [h["ok"] for h in health] == [True, True, False]
    assert health[2]["node"] == shown and health[2]["status"] == "down"
    assert "not a Redis server: an HTTP server answered" in health[2]["error"]
    text = run("health")[0]
    assert "2 of 3 nodes healthy, quorum 2: OK" in text and "an HTTP server answered" in text
    out, _ = run("list")
    assert f"node {shown} not read: not a Redis server: an HTTP server" in out
    result = manage(urls, "health")
    assert result.returncode == 0 and "Traceback" not in result.stderr
    assert "an HTTP server answered" in result.stdout and PASSWORD not in result.stdout


@pytest.fixture
def hang_up_port() -> Iterator[int]:
    """A service that reads a request and closes the connection without a reply
    (what PostgreSQL does with a Redis command: a bad startup packet)."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.05)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    conn.recv(1024)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(5)
    server.close()


def test_a_service_that_hangs_up_is_a_node_down(nodes: RedisNodes, hang_up_port: int,
                                                settings: Any) -> None:
    settings.REDLOCK_NODES = [*nodes.urls[:2], f"redis://127.0.0.1:{hang_up_port}/0"]
    health = json.loads(run("health", "--json")[0])
    assert [h["status"] for h in health] == ["ok", "ok", "down"]
    assert "closes connections without a Redis reply: not a Redis server?" in health[2]["error"]


def test_a_semaphore_is_listed_as_one_entry(nodes: RedisNodes, manage: Any) -> None:
    """Its permit count, who holds which permit, and how many wait in its line:
    one entry, not its permit and line locks one by one. A lock that is only
    named like a permit (no count recorded for its base name) stays a lock."""
    holder = LockManager(nodes.urls, node_timeout=0.5)
    waiters = [LockManager(nodes.urls, node_timeout=0.5) for _ in range(2)]
    held = [holder.semaphore("jobs", 3, ttl=30, auto_renew=False, label=f"job-{i}")
            for i in range(3)]
    lookalike = holder.lock("other#0", ttl=30, auto_renew=False)
    served: list[int] = []

    def wait(i: int, mgr: LockManager) -> None:
        mine = mgr.semaphore("jobs", 3, ttl=5, auto_renew=False, label=f"waiter-{i}")
        if mine.acquire(timeout=15):
            served.append(i)
            mine.release()

    def listed() -> dict[str, Any]:
        (item,) = [d for d in json.loads(run("list", "--json")[0]) if d["name"] == "jobs"]
        return item

    threads = [threading.Thread(target=wait, args=(i, mgr), daemon=True)
               for i, mgr in enumerate(waiters)]
    try:
        assert lookalike.acquire(timeout=0)
        assert held[0].acquire(timeout=5) and held[1].acquire(timeout=5)
        item = listed()
        assert (item["state"], item["permits"], item["held"], item["waiters"]) \
            == ("semaphore", 3, 2, 0)
        assert item["recorded"] == {"3": 3} and item["line"] is None
        assert [h["index"] for h in item["holders"]] == sorted(s.index for s in held[:2])
        by_index = {h["index"]: h for h in item["holders"]}
        for sem in held[:2]:
            permit = by_index[sem.index]
            assert permit["name"] == f"jobs#{sem.index}" and permit["quorum"]
            assert permit["owner"]["label"] == sem.lock.label
            assert permit["fence"] >= sem.fence  # the highest any node stored
        names = [d["name"] for d in json.loads(run("list", "--json")[0])]
        assert names == ["other#0", "jobs"]  # the locks, then the semaphores

        assert held[2].acquire(timeout=5)  # all three held: the next ones wait
        for n, thread in enumerate(threads, 1):
            thread.start()
            assert wait_for(lambda n=n: listed()["waiters"] == n), f"waiter {n} not counted"
        item = listed()
        assert (item["held"], item["waiters"]) == (3, 2)
        assert item["line"]["owner"]["label"] in ("waiter-0", "waiter-1")  # the first in line
        assert item["line"]["waiters"] == 1  # and one queued behind it

        out = run("list")[0]
        lines = out.splitlines()
        assert lines[0].split()[0] == "NAME"
        assert [line.split()[0] for line in lines[1:2]] == ["other#0"]
        assert not any(line.startswith("jobs#") for line in lines)
        head = next(line for line in lines if line.startswith("Semaphore 'jobs'"))
        assert "3 of 3 permits held, 2 waiting" in head and "1 queued behind" in head
        rows = {line.split()[0]: line for line in lines if line.startswith("  #")}
        assert sorted(rows) == ["#0", "#1", "#2"]
        for sem in held:
            assert f'"{sem.lock.label}"' in rows[f"#{sem.index}"]
            assert "3/3" in rows[f"#{sem.index}"] and "quorum" in rows[f"#{sem.index}"]
        assert "1 lock and 1 semaphore under prefix 'redlock'" in out

        text = run("show", "jobs")[0]  # the semaphore's name: the same entry
        assert text.splitlines()[0] == head
        assert json.loads(run("show", "jobs", "--json")[0])["held"] == 3
        result = manage(nodes.urls, "list", "--json")  # and in a subprocess
        assert result.returncode == 0, result.stderr
        assert [d["name"] for d in json.loads(result.stdout)] == ["other#0", "jobs"]

        held[0].release()  # the first in line takes it; the other becomes first
        assert wait_for(lambda: listed()["waiters"] <= 1)
        for sem in held[1:]:
            sem.release()
        for thread in threads:
            thread.join(15)
        assert sorted(served) == [0, 1]
        assert wait_for(lambda: [d["name"] for d in json.loads(run("list", "--json")[0])]
                        == ["other#0"])
        with pytest.raises(CommandError, match="no lock 'jobs' is held"):
            run("show", "jobs")
    finally:
        for thread in threads:
            if thread.ident is not None:
                thread.join(15)
        for mgr in [holder, *waiters]:
            mgr.close()


def test_semaphore_grouping_needs_a_count_record_and_names_a_disagreement() -> None:
    def info(name: str, nodes: int = 3) -> Any:
        views = [(f"t{name}|5|{{}}", parse_value(f"t{name}-token|5|{{}}"), 9000)] * nodes \
            + [None] * (3 - nodes)
        return merge(name, f"redlock:{name}", views, ["a", "b", "c"], 2, now=0.0)

    locks = [info(n) for n in ("a#0", "a#1", "a#line", "a#01", "b#0", "c#7", "plain")]
    keys = {"a": "redlock:a", "c": "redlock:c"}
    plain, sems = group_semaphores(locks, {"a": [2, 2, 2], "c": [4, 5]}, keys, 3, 2)
    # "a#01" is no permit name (a permit index has no leading zero); "b" has no record.
    assert [lock.name for lock in plain] == ["a#01", "b#0", "plain"]
    a, c = sems
    assert (a.name, a.permits, a.held, a.waiters) == ("a", 2, 2, 1)
    assert [i for i, _ in a.holders] == [0, 1] and a.line is not None
    assert (c.name, c.permits, c.recorded) == ("c", None, {4: 1, 5: 1})  # a tie: unknown
    out = render_semaphore(c)
    assert "of ? permits held" in out and "4 on 1 node(s), 5 on 1 node(s)" in out


def render_semaphore(sem: Any) -> str:
    from django.core.management.color import no_style

    from django_redlock.management.commands.locks import Command

    command = Command()
    command.style = no_style()
    return "\n".join(command.render_semaphore(sem))
