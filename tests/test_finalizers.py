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
