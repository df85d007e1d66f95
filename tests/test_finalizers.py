"""Releases a garbage collection runs inside the library's own sections
(``transport/finalizers.py``): put off until the section ends, never lost,
and no section left open for good.

(The collections inside a reentrant lock's tables are in test_family.py:
``_GC_IN_GUARD_SCRIPT``, ``_GC_IN_HOLD_TABLE_SCRIPT``.)
"""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any, Callable

from django_redlock.testing import RedisNodes
from django_redlock.transport import finalizers

MakeManager = Callable[..., Any]


def _holders(nodes: RedisNodes, key: str) -> int:
    return sum(bool(server.client().exists(key)) for server in nodes)


def test_a_section_its_leave_never_ran_for_puts_no_release_off_for_good(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """An exception raised between a section's start and its ``leave()`` (a
    signal handler's: Celery's soft time limit, ``KeyboardInterrupt``, at the
    first instruction of ``leave()``) ends the section with its frame: the
    thread's next ``release()`` releases on the nodes, and a release put off
    in that section runs then. With a bare counter the thread stayed
    "inside" for good: every release of the thread was put off and never
    run, the keys held and renewed while the lock objects lived."""
    mgr = make_manager(nodes3)
    put_off = mgr.lock("fin-put-off", ttl=30)
    held = mgr.lock("fin-held", ttl=30)
    seen: dict[str, Any] = {}

    def interrupted_section() -> None:
        finalizers.enter()
        # What a collection here runs: a release, put off until the end.
        assert finalizers.inside()
        put_off.release()
        seen["put off held on"] = _holders(nodes3, put_off.key)
        raise KeyboardInterrupt  # as a signal raised at leave()'s entry: no leave()

    def thread() -> None:
        assert put_off.acquire() and held.acquire()
        try:
            interrupted_section()
        except KeyboardInterrupt:
            pass
        seen["inside after"] = finalizers.inside()  # the put-off release runs here
        held.release()
        seen["held on"] = _holders(nodes3, held.key)
        seen["put off held on after"] = _holders(nodes3, put_off.key)

    worker = threading.Thread(target=thread)
    worker.start()
    worker.join(20)
    assert not worker.is_alive()
    assert seen == {"put off held on": 3, "inside after": False, "held on": 0,
                    "put off held on after": 0}


def test_an_interrupt_in_one_piece_of_put_off_work_keeps_the_rest(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Two releases put off in one section and an interrupt raised by the
    first piece of work: the second is not dropped with it; it runs at the
    thread's next check (it was swapped out with the whole list, and its key
    stayed for a lease)."""
    mgr = make_manager(nodes3)
    second = mgr.lock("fin-second", ttl=30)
    seen: dict[str, Any] = {}

    def interrupt() -> None:
        raise KeyboardInterrupt

    def thread() -> None:
        assert second.acquire()
        finalizers.enter()
        finalizers.put_off(interrupt)
        finalizers.put_off(second.release)
        try:
            finalizers.leave()
        except KeyboardInterrupt:
            seen["interrupted"] = True
        seen["held on after the interrupt"] = _holders(nodes3, second.key)
        seen["inside"] = finalizers.inside()
        finalizers.enter()
        finalizers.leave()  # the next section's end runs what is left
        seen["held on after the next section"] = _holders(nodes3, second.key)

    worker = threading.Thread(target=thread)
    worker.start()
    worker.join(20)
    assert not worker.is_alive()
    assert seen == {"interrupted": True, "held on after the interrupt": 3, "inside": False,
                    "held on after the next section": 0}


_GC_IN_FORGET_SCRIPT = r"""
import gc, sys, threading
from django_redlock import LockManager
from django_redlock.transport import sync

urls, slow_url = sys.argv[1:4], sys.argv[4]
mgr = LockManager(urls[:2] + [slow_url], node_timeout=0.5)
rival = LockManager(urls[:2] + [slow_url], node_timeout=0.5).lock("fin-busy", ttl=30)
assert rival.acquire()

def rows(lock):
    with lock:
        yield 1

def worker():
    gen = rows(mgr.lock("fin-gen", ttl=30))
    next(gen)
    cycle = [gen]
    cycle.append(cycle)             # only a collection frees it: its exit runs then
    del gen, cycle
    code = sync.NodeClient.forget.__code__

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return None

        def line(frame, event, arg):
            # Inside `with self._owed_lock`, where an allocation may collect.
            if event == "line" and frame.f_locals.get("entry") is not None:
                sys.settrace(None)
                frame.f_trace = None
                gc.collect()
            return line
        return line

    sys.settrace(tracer)
    try:
        busy = mgr.lock("fin-busy", ttl=30)
        got = busy.acquire(timeout=0)   # refused; the slow node's reply owed: forget()
    finally:
        sys.settrace(None)
    print("refused" if not got else "granted", flush=True)

thread = threading.Thread(target=worker, daemon=True)
thread.start()
thread.join(20)
print("hung" if thread.is_alive() else "done", flush=True)
rival.release()
sys.exit(3 if thread.is_alive() else 0)
"""


def test_a_collection_inside_a_refused_acquires_forget_hangs_nothing(
        nodes3: RedisNodes) -> None:
    """A refused ``acquire(timeout=0)`` with one node slow leaves that node's
    reply owed; its clean-up (``forget``) takes the node's owed-reply lock,
    and a collection there finalizes a generator suspended inside ``with
    other``: its release waited for that lock its own thread held, and the
    thread, and every later round on that node, hung for good. It is put off
    until ``forget`` ends, and the other lock is released."""
    from django_redlock.testing import FaultProxy

    with FaultProxy(nodes3[2].host, nodes3[2].port) as slow:
        slow.set_latency(0.03)
        proc = subprocess.run(
            [sys.executable, "-c", _GC_IN_FORGET_SCRIPT, *nodes3.urls, slow.url],
            capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["refused", "done"], (proc.stdout, proc.stderr[-2000:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _holders(nodes3, "redlock:fin-gen") == 0


#: Places a collection where a line of ``function`` containing ``marker``
#: runs (what an allocation there does when the collector's count is full),
#: in the threads started after ``arm()`` and in the caller's.
_TRACE_HELPER = r"""
import gc, inspect, sys, threading

def arm(function, marker, fired):
    lines, first = inspect.getsourcelines(function)
    (at,) = [first + k for k, text in enumerate(lines) if marker in text][:1]
    code = function.__code__

    def tracer(frame, event, arg):
        if frame.f_code is not code or fired:
            return None

        def line(frame, event, arg):
            if event == "line" and frame.f_lineno == at and not fired:
                fired.append(threading.current_thread().name)
                gc.collect()
            return line
        return line
    threading.settrace(tracer)
    sys.settrace(tracer)

def disarm():
    threading.settrace(None)
    sys.settrace(None)

def hangs(worker):
    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    thread.join(10)
    return thread.is_alive()

def rows(lock):
    with lock:
        yield 1
        yield 2

def abandon(lock):
    gen = rows(lock)
    next(gen)
    cycle = [gen]
    cycle.append(cycle)  # only a collection frees it: its exit runs then
"""

_GC_IN_SET_UP_SCRIPT = _TRACE_HELPER + r"""
import time
from django_redlock import LockManager
from django_redlock.transport import sync

gc.disable()
mgr = LockManager([sys.argv[1]], node_timeout=0.5)
abandon(mgr.lock("fin-setup-gen", ttl=30))
for node in mgr.transport.nodes:  # no idle connection: the next round sets one up, in a thread
    idle, node._idle = node._idle, []
    for conn in idle:
        conn.disconnect()
fired = []
arm(sync.NodeClient._send_later, "later, self._later = self._later, []", fired)
out = {}
hangs(lambda: out.update(first=mgr.lock("fin-setup-other", ttl=5).acquire(timeout=2)))
disarm()
hangs(lambda: out.update(later=mgr.lock("fin-setup-later", ttl=5).acquire(timeout=1)))
print(fired[0].split()[0] if fired else "no collection", out.get("first"), out.get("later"),
      flush=True)
sys.exit(0 if out.get("later") else 3)
"""


def test_a_collection_in_a_connection_set_up_thread_hangs_nothing(
        nodes3: RedisNodes) -> None:
    """A node's connection set-up thread holds the node's lock while it
    hands the set-up the releases to send; a collection there finalizes a
    generator inside ``with lock``, whose release (a round on the same node)
    waited for that lock its own thread held: every round on the node, and
    every renewal, hung from then on. The set-up thread is a section: the
    release runs once the set-up is done, and the node goes on."""
    proc = subprocess.run([sys.executable, "-c", _GC_IN_SET_UP_SCRIPT, nodes3[0].url],
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["redlock-connect", "True", "True"], \
        (proc.stdout, proc.stderr[-2000:])
    assert _holders(nodes3, "redlock:fin-setup-gen") == 0


_GC_UNDER_THE_HANDOFF_SWEEP_SCRIPT = _TRACE_HELPER + r"""
from django_redlock import LockManager
from django_redlock.engine import manager as manager_mod

gc.disable()
urls = sys.argv[1:]
mgr = LockManager(urls, node_timeout=0.5)
waiters = LockManager(urls, node_timeout=0.5)
first, other = mgr.lock("fin-sweep-a", ttl=30), mgr.lock("fin-sweep-b", ttl=30)
assert first.acquire()
abandon(other)
now = mgr.clock()
for k in range(manager_mod._HANDOFF_KEYS_MAX + 10):  # earlier releases' pauses, long over
    mgr._handoff[b"old:%d" % k] = now - 60
out = {}
blocked = [threading.Thread(target=lambda n=n: out.update(
    {n: waiters.lock(n, ttl=30).acquire(timeout=8)}), daemon=True)
    for n in ("fin-sweep-a", "fin-sweep-b")]
for thread in blocked:
    thread.start()
import time
time.sleep(1.0)  # both stand in line
fired = []
arm(manager_mod.LockManager._note_release, "for stale in", fired)
hung = hangs(first.release)  # wakes a waiter: the sweep
disarm()
for thread in blocked:
    thread.join(10)
print("swept" if fired else "no collection", "hung" if hung else "done",
      out.get("fin-sweep-a"), out.get("fin-sweep-b"), flush=True)
sys.exit(3 if hung else 0)
"""


def test_a_collection_under_the_hand_over_sweep_hangs_nothing(nodes3: RedisNodes) -> None:
    """A release that woke a waiter sweeps the manager's old hand-over
    pauses under a lock (1,024 kept); a collection there finalizes a
    generator inside ``with other`` whose release wakes a waiter too, and
    waited for that lock its own thread held: that release, and every later
    one that woke a waiter, hung. The sweep is a section: the other release
    runs after it, and both waiters get their locks."""
    proc = subprocess.run([sys.executable, "-c", _GC_UNDER_THE_HANDOFF_SWEEP_SCRIPT,
                           *nodes3.urls], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["swept", "done", "True", "True"], \
        (proc.stdout, proc.stderr[-2000:])


def test_a_reentrant_with_never_joins_a_hold_a_collection_ended_meanwhile(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """A thread's generator took a reentrant lock by hand and releases it in
    its ``finally``; the thread enters ``with L`` and, while its hold is
    looked up (on 3.12+ a collection may run at any call: here at
    ``owned()``), a collection ends the generator: its release ends the hold
    (count 1 -> 0) and puts the key's release off to the lookup's end. The
    block takes the lock anew: it joined that ended hold, whose key went at
    the end of the lookup while the block ran (a rival got in)."""
    import gc
    import inspect

    from django_redlock.engine import reentrant

    lock, rival = (make_manager(nodes3).lock("fin-join", ttl=30, reentrant=True),
                   make_manager(nodes3).lock("fin-join"))
    join = reentrant.HoldTable.join
    lines, first = inspect.getsourcelines(join)
    at = first + next(k for k, text in enumerate(lines) if "hold.lock.owned()" in text)
    seen: dict[str, Any] = {}

    def rows() -> Any:
        lock.acquire()
        try:
            yield 1
            yield 2
        finally:
            lock.release()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not join.__code__ or "fired" in seen:
            return None

        def line(frame: Any, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_lineno == at and "fired" not in seen:
                seen["fired"] = True
                gc.collect()
            return line
        return line

    def thread() -> None:
        gen = rows()
        next(gen)
        cycle: list[Any] = [gen]
        cycle.append(cycle)
        del gen, cycle
        sys.settrace(tracer)
        try:
            with lock:
                sys.settrace(None)
                seen["owned"] = lock.owned()
                seen["holders"] = _holders(nodes3, lock.key)
                seen["rival"] = rival.acquire(timeout=0)
        finally:
            sys.settrace(None)

    gc.disable()
    try:
        worker = threading.Thread(target=thread)
        worker.start()
        worker.join(20)
        assert not worker.is_alive()
    finally:
        gc.enable()
    if seen.get("rival"):
        rival.release()
    assert seen == {"fired": True, "owned": True, "holders": 3, "rival": False}
    assert _holders(nodes3, lock.key) == 0


def test_hundreds_of_releases_put_off_in_one_section_all_run(
        make_manager: MakeManager) -> None:
    """One collection inside a round may free hundreds of generators, each
    inside ``with`` its own lock: their releases are put off to the
    section's end, and every one runs there, one after the other. Each ran
    the next from its own round's end, one level deeper: past the recursion
    limit the deepest failed with ``RecursionError`` and their keys stayed
    for a lease (300 put off: about 100 left)."""
    from django_redlock.testing import RedisServer

    with RedisServer() as server:
        mgr = make_manager([server.url])
        locks = [mgr.lock(f"fin-many:{k}", ttl=30, auto_renew=False) for k in range(300)]
        seen: dict[str, Any] = {}

        def thread() -> None:
            for lock in locks:
                assert lock.acquire()
            finalizers.enter()
            try:
                for lock in locks:  # what the collection's finalizers run here
                    lock.release()
                seen["held inside"] = int(server.execute("DBSIZE"))
            finally:
                finalizers.leave()
            seen["keys after"] = sum(bool(server.execute("EXISTS", lock.key)) for lock in locks)

        worker = threading.Thread(target=thread)
        worker.start()
        worker.join(60)
        assert not worker.is_alive()
        assert seen["held inside"] >= 300
        assert seen["keys after"] == 0


_GC_UNDER_THE_LAZY_BUILD_SCRIPT = _TRACE_HELPER + r"""
from django_redlock import LockManager
from django_redlock.engine.manager import LockManager as Manager
from django_redlock.testing import RedisNodes

gc.disable()
with RedisNodes(3) as nodes:
    mgr = LockManager(nodes.urls, node_timeout=0.5)
    abandon(mgr.lock("fin-lazy-gen", ttl=30, auto_renew=False))
    nodes[2].stop()  # its release misses node 3: handed to the late sender, built lazily
    out = {}
    fired = []

    def worker():
        arm(Manager.watchdog.fget, "self._watchdog = Watchdog(", fired)
        try:  # the first renewed hold builds the watchdog under the manager's lazy lock
            out["acquired"] = mgr.lock("fin-lazy-renewed", ttl=30).acquire(timeout=2)
        finally:
            disarm()

    hung = hangs(worker)
    print("collected" if fired else "no collection", "hung" if hung else "done",
          out.get("acquired"), flush=True)
    import os
    os._exit(3 if hung else 0)
"""


def test_a_collection_while_the_manager_builds_a_lazy_part_hangs_nothing() -> None:
    """The manager builds its renewal thread (and its late sender, its
    listener) on first use, under one lock; a collection there finalizes a
    generator inside ``with lock`` whose release a node missed: handed to
    the late sender, made under that same lock, it waited for the lock its
    own thread held, and so did every release a node missed after it."""
    proc = subprocess.run([sys.executable, "-c", _GC_UNDER_THE_LAZY_BUILD_SCRIPT],
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["collected", "done", "True"], \
        (proc.stdout, proc.stderr[-2000:])


_GC_IN_THE_PANELS_RECEIVER_SCRIPT = r"""
import django
from django.conf import settings
settings.configure(DEBUG=True, INSTALLED_APPS=["django.contrib.staticfiles", "debug_toolbar"],
                   STATIC_URL="/static/")
django.setup()
""" + _TRACE_HELPER + r"""
from django_redlock import LockManager
import django_redlock.panels as panels  # what DEBUG_TOOLBAR_PANELS loads: receivers connected

gc.disable()
mgr = LockManager(sys.argv[1:], node_timeout=0.5)
first = mgr.lock("fin-panel-a", ttl=30)
fired = []

def worker():
    assert first.acquire()
    abandon(mgr.lock("fin-panel-gen", ttl=30))
    arm(panels._record_of, "return _live.get(lock)", fired)
    try:
        first.release()  # lock_released: the panel's receiver looks the lock up
    finally:
        disarm()

hung = hangs(worker)
print("collected" if fired else "no collection", "hung" if hung else "done", flush=True)
import os
os._exit(3 if hung else 0)
"""


def test_a_collection_in_the_debug_panels_receiver_hangs_nothing(nodes3: RedisNodes) -> None:
    """The debug-toolbar panel's receivers look each lock up under a lock; a
    collection there finalizes a generator inside ``with lock``, whose
    release's signal came back to the panel and waited for that lock its own
    thread held: that thread, and every release of the process after it."""
    proc = subprocess.run([sys.executable, "-c", _GC_IN_THE_PANELS_RECEIVER_SCRIPT,
                           *nodes3.urls], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["collected", "done"], (proc.stdout, proc.stderr[-2000:])
    assert _holders(nodes3, "redlock:fin-panel-gen") == 0
