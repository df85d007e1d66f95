"""Releases a garbage collection runs (``transport/finalizers.py``): put
off until the library's own section ends, never lost, no section left open
for good; sent by the collecting thread, their signals by the library's
thread, so that nothing waits for a lock its own thread holds.

(The collections inside a reentrant lock's tables are in test_family.py:
``_GC_IN_GUARD_SCRIPT``, ``_GC_IN_HOLD_TABLE_SCRIPT``.)
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any, Callable

import pytest

from django_redlock.testing import RedisNodes
from django_redlock.transport import finalizers

MakeManager = Callable[..., Any]


def _holders(nodes: RedisNodes, key: str) -> int:
    return sum(bool(server.client().exists(key)) for server in nodes)


def _released_within(nodes: RedisNodes, key: str, seconds: float) -> bool:
    """Whether ``key`` is gone from every node within ``seconds`` (a release
    on its way through a slow proxy)."""
    deadline = time.monotonic() + seconds
    while _holders(nodes, key):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True

def _run_with_gc_off(target: Callable[[], None], seconds: float) -> None:
    """Run ``target`` in a thread of its own with the automatic collector
    off (the test places its collections), and fail if it is still running
    after ``seconds``."""
    import gc

    gc.disable()
    try:
        worker = threading.Thread(target=target)
        worker.start()
        worker.join(seconds)
    finally:
        gc.enable()
    assert not worker.is_alive()


def _abandon(gen: Any) -> None:
    """Leave ``gen`` (suspended) in a reference cycle: only a collection
    frees it, and runs its exit then."""
    cycle: list[Any] = [gen]
    cycle.append(cycle)



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
        # The proxy still open: the release to the slow node, settled without
        # its reply, may still be in it when the process ends (closed at once,
        # the proxy dropped it, and the key stayed there).
        assert _released_within(nodes3, "redlock:fin-gen", 5.0)


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
        _abandon(gen)
        del gen
        sys.settrace(tracer)
        try:
            with lock:
                sys.settrace(None)
                seen["owned"] = lock.owned()
                seen["holders"] = _holders(nodes3, lock.key)
                seen["rival"] = rival.acquire(timeout=0)
        finally:
            sys.settrace(None)

    _run_with_gc_off(thread, 20)
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
    nodes.stop()  # os._exit skips the with block's exit: the servers outlived the script
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
    arm(panels._record_of, "return _live.get(lock", fired)
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


_GC_UNDER_A_RECEIVERS_LOCK_SCRIPT = _TRACE_HELPER + r"""
import time
from django_redlock import LockManager, signals
from django_redlock.transport import finalizers

gc.disable()
mgr = LockManager(sys.argv[1:], node_timeout=0.5)
mine = threading.Lock()  # the application's: a receiver of lock_released takes it
heard = []

def receiver(sender, *, name, **kwargs):
    with mine:
        heard.append((name, threading.current_thread().name))

signals.lock_released.connect(receiver, weak=False)
out = {}

def worker():
    abandon(mgr.lock("fin-receiver-gen", ttl=30))
    with mine:  # the application's own critical section: a collection here
        out["collected"] = gc.collect() > 0
    with mgr.lock("fin-receiver-after", ttl=30):  # the thread goes on
        pass

hung = hangs(worker)
deadline = time.monotonic() + 10
while len(heard) < 2 and time.monotonic() < deadline:  # the collected release: soon after
    time.sleep(0.01)
gen_heard = [where for name, where in heard if name == "fin-receiver-gen"]
print("collected" if out.get("collected") else "no collection", "hung" if hung else "done",
      len(heard), "elsewhere" if gen_heard and gen_heard[0] != "Thread-1" else gen_heard,
      flush=True)
import os
os._exit(3 if hung else 0)
"""


def test_a_collection_under_a_lock_of_a_signal_receivers_hangs_nothing(
        nodes3: RedisNodes) -> None:
    """A receiver of ``lock_released`` takes a lock of the application's; a
    collection while the application holds that lock finalizes a generator
    inside ``with lock``, whose release's signal reached the receiver: it
    waited for the lock its own thread held, and that thread hung for good
    (no section of the library's covers a lock it cannot see). The release
    is sent at once, and its signals go to the library's own thread: the
    collecting thread goes on, the key is released, the receiver hears of
    it there once the application lets its lock go."""
    proc = subprocess.run([sys.executable, "-c", _GC_UNDER_A_RECEIVERS_LOCK_SCRIPT,
                           *nodes3.urls], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["collected", "done", "2", "elsewhere"], \
        (proc.stdout, proc.stderr[-2000:])
    assert _holders(nodes3, "redlock:fin-receiver-gen") == 0


_GC_WHILE_A_LOG_QUEUE_IS_HELD_SCRIPT = _TRACE_HELPER + r"""
import logging, logging.handlers, queue, time
from django_redlock import LockManager

# The application logs through a QueueHandler (as logging.config's "queue"
# handlers and many services do): its queue.Queue puts under a plain lock.
records = queue.Queue()
logging.getLogger().addHandler(logging.handlers.QueueHandler(records))
logging.getLogger().setLevel(logging.INFO)
gc.disable()
mgr = LockManager(sys.argv[1:], node_timeout=0.5)
out = {}

def worker():
    abandon(mgr.lock("fin-log-gen", ttl=0.2, auto_renew=False))
    time.sleep(0.3)  # its lease is out: the release logs the loss (a warning)
    # An allocation inside the application's own put (the queue's lock held:
    # another record on its way) runs a collection when the count is full.
    with records.mutex:
        out["collected"] = gc.collect() > 0
    logging.getLogger("app").info("after")  # the thread goes on, and logs

hung = hangs(worker)
seen = []
deadline = time.monotonic() + 10
while not hung and time.monotonic() < deadline and not any("lost after" in m for m, _ in seen):
    try:
        record = records.get(timeout=0.05)
    except queue.Empty:
        continue
    seen.append((record.getMessage(), record.threadName))
lost = [where for message, where in seen if "lost after" in message]
print("collected" if out.get("collected") else "no collection", "hung" if hung else "done",
      "logged" if lost else "not-logged", flush=True)
import os
os._exit(3 if hung else 0)
"""


def test_a_collection_while_the_logging_queues_lock_is_held_hangs_nothing(
        nodes3: RedisNodes) -> None:
    """The application logs through a ``QueueHandler``, whose ``queue.Queue``
    puts under a plain lock; a collection inside a put finalizes a
    generator inside ``with lock`` whose lease ran out, and the release
    logs the loss: its record's put waited for the lock its own thread held,
    for good. A record logged by what a finalizer runs is handed to the
    library's thread, and logged there once the put is over."""
    proc = subprocess.run([sys.executable, "-c", _GC_WHILE_A_LOG_QUEUE_IS_HELD_SCRIPT,
                           *nodes3.urls], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["collected", "done", "logged"], \
        (proc.stdout, proc.stderr[-2000:])
    assert _holders(nodes3, "redlock:fin-log-gen") == 0


_GC_IN_AN_APPLICATION_LOG_FILTER_SCRIPT = r"""
import logging, threading

class OncePerMessage(logging.Filter):
    # An application's filter on the library's logger, as Django's LOGGING
    # sets it before the library is imported: a dedupe under a plain lock.
    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()
        self.seen = set()
        self.runs = []

    def filter(self, record):
        with self.lock:
            self.runs.append((record.getMessage()[:20], threading.current_thread().name))
            if record.msg in self.seen:
                return False
            self.seen.add(record.msg)
            return True

dedupe = OncePerMessage()
logging.getLogger("django_redlock.lock").addFilter(dedupe)
handled = []

class Keep(logging.Handler):
    def emit(self, record):
        handled.append(record.getMessage())

logging.getLogger().addHandler(Keep())
logging.getLogger().setLevel(logging.INFO)
""" + _TRACE_HELPER + r"""
import time
from django_redlock import LockManager

gc.disable()
mgr = LockManager(sys.argv[1:], node_timeout=0.5)

def worker():
    abandon(mgr.lock("fin-filter-gen", ttl=0.2, auto_renew=False))
    time.sleep(0.3)  # its lease is out: the release logs the loss
    with dedupe.lock:  # a collection while the filter runs (its lock held)
        gc.collect()

hung = hangs(worker)
deadline = time.monotonic() + 10
while not hung and time.monotonic() < deadline and not any("lost after" in m for m in handled):
    time.sleep(0.01)
lost_runs = [where for message, where in dedupe.runs if message.startswith("lock 'fin-filter-gen")]
print("hung" if hung else "done", sum("lost after" in m for m in handled),
      len([w for w in lost_runs]), flush=True)
import os
os._exit(3 if hung else 0)
"""


def test_an_application_filter_on_the_librarys_logger_runs_once_and_hangs_nothing(
        nodes3: RedisNodes) -> None:
    """An application's filter on a ``django_redlock`` logger (Django's
    ``LOGGING`` adds it before the library's own): a record logged by a
    collection's release went through it in the collecting thread, where it
    waited for the filter's lock that thread held, for good; and, handed
    off after it, through it a second time in the library's thread, where
    a dedupe dropped it. The library's filter comes first: the
    application's runs once, in the library's thread, and the record is
    logged."""
    proc = subprocess.run([sys.executable, "-c", _GC_IN_AN_APPLICATION_LOG_FILTER_SCRIPT,
                           *nodes3.urls], capture_output=True, text=True, timeout=60)
    # "lost after" logged once; the filter saw the release's two records (the
    # loss, and the block's "lost while the body raised") once each
    assert proc.stdout.split() == ["done", "1", "2"], (proc.stdout, proc.stderr[-2000:])
    assert _holders(nodes3, "redlock:fin-filter-gen") == 0


_GC_IN_A_METRIC_UPDATE_SCRIPT = r"""
import django
from django.conf import settings
settings.configure(INSTALLED_APPS=[])
django.setup()
""" + _TRACE_HELPER + r"""
import time
from django_redlock import LockManager
from django_redlock import metrics

metrics._connect()
gc.disable()
mgr = LockManager(sys.argv[1:], node_timeout=0.5)
out = {}

def worker():
    abandon(mgr.lock("finmetric:gen", ttl=30, auto_renew=False))
    child = metrics.HOLD.labels("finmetric")
    # What an allocation inside prometheus_client's observe() (the sum's lock
    # held: ``self._value += amount``) runs when the collector's count is
    # full: a collection.
    with child._sum._lock:
        out["collected"] = gc.collect() > 0

hung = hangs(worker)
observed = False
deadline = time.monotonic() + 10
while not hung and not observed and time.monotonic() < deadline:  # (hung: the lock is held)
    observed = metrics.HOLD.labels("finmetric")._sum.get() > 0
    time.sleep(0.01)
print("collected" if out.get("collected") else "no collection", "hung" if hung else "done",
      "observed" if observed else "not observed", flush=True)
import os
os._exit(3 if hung else 0)
"""


def test_a_collection_inside_a_metric_update_hangs_nothing(nodes3: RedisNodes) -> None:
    """prometheus_client guards each metric with a plain lock; a collection
    inside an update of the hold-time histogram finalizes a generator inside
    ``with lock``, whose release is observed by that same histogram: it
    waited for the lock its own thread held, and every later observation of
    that label hung with it. The release is sent at once; the histogram
    observes it in the library's own thread, once the update is over."""
    proc = subprocess.run([sys.executable, "-c", _GC_IN_A_METRIC_UPDATE_SCRIPT,
                           *nodes3.urls], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["collected", "done", "observed"], \
        (proc.stdout, proc.stderr[-2000:])
    assert _holders(nodes3, "redlock:finmetric:gen") == 0


def test_an_object_a_collection_released_is_free_at_once_and_its_new_hold_kept(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """One lock object, as a module-level one is: a generator left inside
    ``with LOCK`` in a cycle, freed by a collection (its release's round
    slow: two nodes 0.3 s away), and the same thread at ``with LOCK`` right
    after. The object holds nothing after the collection: the block is not
    told "already held by this object"; the release ended only the old hold
    (its token), never the block's: the block keeps a quorum, a rival is
    refused while it is inside, also after the release's signals are sent.
    (Handed whole to another thread, the release came after the block's
    acquire: "already held".)"""
    import gc

    from django_redlock.testing import FaultProxy

    with FaultProxy(nodes3[1].host, nodes3[1].port) as p1, \
            FaultProxy(nodes3[2].host, nodes3[2].port) as p2:
        urls = [nodes3[0].url, p1.url, p2.url]
        lock = make_manager(urls, node_timeout=2.0).lock("fin-same-object", ttl=30)
        rival = make_manager(nodes3.urls).lock("fin-same-object")
        seen: dict[str, Any] = {}

        def rows() -> Any:
            with lock:
                yield 1
                yield 2

        def thread() -> None:
            gen = rows()
            next(gen)
            _abandon(gen)
            del gen
            p1.set_latency(0.3)
            p2.set_latency(0.3)
            gc.collect()  # the generator's exit: the release
            seen["owned after the collection"] = lock.owned()
            with lock:
                seen["holders inside"] = _holders(nodes3, lock.key)
                seen["rival inside"] = rival.acquire(timeout=0)
                seen["drained"] = finalizers.drain(10.0)  # the old release's signals: sent
                seen["holders after the old release"] = _holders(nodes3, lock.key)
                seen["rival after the old release"] = rival.acquire(timeout=0)
                seen["owned"] = lock.owned()

        _run_with_gc_off(thread, 30)
        for key in ("rival inside", "rival after the old release"):
            if seen.get(key):
                rival.release()
        assert seen.pop("holders inside") >= 2, seen
        assert seen.pop("holders after the old release") >= 2, seen
        assert seen == {"owned after the collection": False, "rival inside": False,
                        "drained": True, "rival after the old release": False,
                        "owned": True}
        assert _released_within(nodes3, lock.key, 5.0)


_EXIT_AFTER_A_COLLECTION_SCRIPT = r"""
import gc, sys, time
from django_redlock import LockManager, signals

gc.disable()
mgr = LockManager(sys.argv[1:], node_timeout=2.0)

def receiver(sender, *, name, **kwargs):  # slow: 20 of them take 0.4 s
    time.sleep(0.02)
    print("heard", name, flush=True)

signals.lock_released.connect(receiver, weak=False)

def rows(lock):
    with lock:
        yield 1

for k in range(20):
    gen = rows(mgr.lock(f"fin-exit:{k}", ttl=30, auto_renew=False))
    next(gen)
    cycle = [gen]
    cycle.append(cycle)
    del gen, cycle
gc.collect()  # 20 releases: sent here; their signals handed to the library's thread
print("collected", flush=True)
sys.exit(0)   # the exit hook waits for the signals
"""


def test_the_exit_hook_waits_for_the_signals_of_a_collections_releases(
        nodes3: RedisNodes) -> None:
    """A collection releases 20 locks just before the program exits: the
    releases are sent at once, their ``lock_released`` signals go to the
    library's thread (a daemon, gone with the process), behind a slow
    receiver. The exit hook waits for them: every one is heard."""
    proc = subprocess.run([sys.executable, "-c", _EXIT_AFTER_A_COLLECTION_SCRIPT,
                           *nodes3.urls], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "collected", (proc.stdout, proc.stderr[-2000:])
    assert sorted(lines[1:]) == sorted(f"heard fin-exit:{k}" for k in range(20)), proc.stdout
    assert all(_holders(nodes3, f"redlock:fin-exit:{k}") == 0 for k in range(20))


def _forked_job(urls: list[str]) -> None:
    """A multiprocessing job (fork): a collection near its end frees a
    generator inside ``with lock``; the job returns, and multiprocessing
    ends the child with ``os._exit`` (no exit hook)."""
    import gc

    from django_redlock import LockManager

    mgr = LockManager(urls, node_timeout=2.0)
    gen = _inside(mgr.lock("fin-mp-job", ttl=30, auto_renew=False))
    next(gen)
    _abandon(gen)
    del gen
    gc.collect()


def _inside(lock: Any) -> Any:
    with lock:
        yield 1


def test_a_collections_release_in_a_worker_that_leaves_with_os_exit_is_sent(
        nodes3: RedisNodes) -> None:
    """A release a collection runs is sent by the collecting thread: a
    multiprocessing worker that leaves with ``os._exit`` right after does
    not take it with it (handed to a daemon thread, it was lost: the key
    stayed on every node for its lease)."""
    import multiprocessing

    from django_redlock.testing import FaultProxy

    with FaultProxy(nodes3[1].host, nodes3[1].port) as p1, \
            FaultProxy(nodes3[2].host, nodes3[2].port) as p2:
        p1.set_latency(0.1)
        p2.set_latency(0.1)
        child = multiprocessing.get_context("fork").Process(
            target=_forked_job, args=([nodes3[0].url, p1.url, p2.url],))
        child.start()
        child.join(30)
        assert child.exitcode == 0
        assert _released_within(nodes3, "redlock:fin-mp-job", 5.0)


def test_a_receiver_that_waits_holds_up_no_release_of_a_collection(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Two generators inside ``with x`` and ``with y``, collected; a
    ``lock_released`` receiver takes a lock of the application's, which the
    thread then holds while it takes x and y again. The releases were sent
    at the collection: the thread gets both at once, and the receivers run
    once it lets its lock go. (Queued behind the first receiver, y's
    release waited for the application's lock, held by a thread waiting for
    y: for good.)"""
    import gc

    from django_redlock import signals

    mgr = make_manager(nodes3, node_timeout=0.5)
    mine = threading.RLock()
    heard: list[str] = []

    def receiver(sender: Any, *, name: str, **kwargs: Any) -> None:
        if name.startswith("fin-hol-"):
            with mine:
                heard.append(name)

    signals.lock_released.connect(receiver, weak=False)
    seen: dict[str, Any] = {}

    def thread() -> None:
        for name in ("fin-hol-x", "fin-hol-y"):
            gen = _inside(mgr.lock(name, ttl=30))
            next(gen)
            _abandon(gen)
            del gen
        gc.collect()
        with mine:
            with mgr.lock("fin-hol-x", ttl=30, timeout=6), \
                    mgr.lock("fin-hol-y", ttl=30, timeout=6):
                seen["both"] = True

    gc.disable()
    try:
        worker = threading.Thread(target=thread)
        worker.start()
        worker.join(20)
        seen["drained"] = finalizers.drain(5.0)  # (before the receiver is disconnected)
    finally:
        gc.enable()
        signals.lock_released.disconnect(receiver)
    assert not worker.is_alive()
    assert seen == {"both": True, "drained": True}
    assert sorted(heard) == ["fin-hol-x", "fin-hol-x", "fin-hol-y", "fin-hol-y"]


def test_a_collection_during_the_locks_renewal_frees_the_object_at_once(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """One lock object (a module-level one), renewed: while its renewal
    round is on the wire (two nodes 0.4 s away: the renewal holds the
    object's ``_io``), a collection frees a generator inside ``with LOCK``,
    and the same thread enters ``with LOCK`` at once. The release does not
    wait for ``_io``, and the object stops holding at the collection: the
    block is not told "already held by this object", and keeps its hold to
    the end (a rival is refused inside)."""
    import gc

    from django_redlock.testing import FaultProxy

    with FaultProxy(nodes3[1].host, nodes3[1].port) as p1, \
            FaultProxy(nodes3[2].host, nodes3[2].port) as p2:
        lock = make_manager([nodes3[0].url, p1.url, p2.url], node_timeout=2.0).lock(
            "fin-renewed-object", ttl=1.5)  # renewed every 0.5 s
        rival = make_manager(nodes3.urls).lock("fin-renewed-object")
        seen: dict[str, Any] = {}

        def thread() -> None:
            gen = _holds(lock)
            next(gen)
            _abandon(gen)
            del gen
            p1.set_latency(0.4)
            p2.set_latency(0.4)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # until the renewal holds _io
                if not lock._io.acquire(blocking=False):
                    break
                lock._io.release()
                time.sleep(0.005)
            seen["renewal under way"] = time.monotonic() < deadline
            gc.collect()
            seen["owned after the collection"] = lock.owned()
            p1.set_latency(0)
            p2.set_latency(0)
            with lock:
                seen["rival inside"] = rival.acquire(timeout=0)
                seen["owned inside"] = lock.owned()

        _run_with_gc_off(thread, 30)
        if seen.get("rival inside"):
            rival.release()
        assert seen == {"renewal under way": True, "owned after the collection": False,
                        "rival inside": False, "owned inside": True}
        assert _released_within(nodes3, lock.key, 5.0)


def _holds(lock: Any) -> Any:
    with lock:
        yield 1
        yield 2


_FORKED_CHILD_SCRIPT = r"""
import gc, os, sys, threading, time
from django_redlock import LockManager, signals
from django_redlock.transport import finalizers

gc.disable()
urls = sys.argv[1:]
parent = LockManager(urls, node_timeout=1.0)
with parent.lock("fin-fork-parent", ttl=30):  # the parent's thread for collections runs
    pass
finalizers._starting.acquire()  # as a parent thread starting that thread at the fork
pid = os.fork()
if pid == 0:
    heard = threading.Event()
    signals.lock_released.connect(lambda sender, **kwargs: heard.set(), weak=False)
    mgr = LockManager(urls, node_timeout=1.0)

    def rows(lock):
        with lock:
            yield 1

    gen = rows(mgr.lock("fin-fork-child", ttl=30, auto_renew=False))
    next(gen)
    cycle = [gen]
    cycle.append(cycle)
    del gen, cycle
    gc.collect()
    # (not drain(): without a thread, it sends the signals itself)
    os._exit(0 if heard.wait(5) else 3)
finalizers._starting.release()
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), flush=True)
"""


def test_a_forked_child_sends_its_collections_signals_in_a_thread_of_its_own(
        nodes3: RedisNodes) -> None:
    """After ``fork()`` the parent's thread for the signals of the releases
    collections run is not in the child: the child starts its own, and the
    ``lock_released`` of its collection's release is sent there, also when
    a parent thread was starting that thread at the fork (its start lock,
    held for good in the child, kept the child from starting one: the
    signal waited in the queue)."""
    proc = subprocess.run([sys.executable, "-c", _FORKED_CHILD_SCRIPT, *nodes3.urls],
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["child", "0"], (proc.stdout, proc.stderr[-2000:])


_GC_WHILE_A_RENEWAL_WAITS_SCRIPT = r"""
import gc, sys, threading, time
from django_redlock import LockManager, signals
from django_redlock.transport import finalizers

gc.disable()
mgr = LockManager(sys.argv[1:], node_timeout=0.5)
lock = mgr.lock("fin-renewing", ttl=1.5)   # renewed every 0.5 s
mine = threading.Lock()                    # the application's
in_receiver = threading.Event()

def receiver(sender, **kwargs):            # runs in the renewal thread, under the lock's _io
    in_receiver.set()
    with mine:
        pass

signals.lock_extended.connect(receiver, weak=False)

def rows():
    with lock:
        yield 1

out = {}

def worker():
    gen = rows()
    next(gen)
    cycle = [gen]
    cycle.append(cycle)
    del gen, cycle
    with mine:
        out["renewal waits"] = in_receiver.wait(5)  # the renewal: in the receiver, for mine
        gc.collect()                                # the generator's exit: lock.release()

thread = threading.Thread(target=worker, daemon=True)
thread.start()
thread.join(10)
hung = thread.is_alive()
done = finalizers.drain(5) if not hung else False
print("hung" if hung else "done", out.get("renewal waits"), done, flush=True)
import os
os._exit(3 if hung else 0)
"""


def test_a_collection_while_the_locks_renewal_waits_for_the_collecting_thread_hangs_nothing(
        nodes3: RedisNodes) -> None:
    """The collected block's lock is being renewed: the renewal thread holds
    the lock's ``_io`` and its ``lock_extended`` receiver waits for a lock
    of the application's, which the collecting thread holds. The release
    does not wait for ``_io`` (each would have waited for the other, for
    good): the state changes without it (the renewal, back with its round,
    finds the hold released and stops), and the key goes."""
    proc = subprocess.run([sys.executable, "-c", _GC_WHILE_A_RENEWAL_WAITS_SCRIPT,
                           *nodes3.urls], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["done", "True", "True"], (proc.stdout, proc.stderr[-2000:])
    assert _holders(nodes3, "redlock:fin-renewing") == 0


_TASK_DESTROYED_PENDING_SCRIPT = r"""
import asyncio, gc, sys, time
from django_redlock import LockManager
from django_redlock.transport import finalizers

gc.disable()
how = sys.argv[1]
mgr = LockManager(sys.argv[2:], node_timeout=0.5)
alock = mgr.alock("fin-task-" + how, ttl=30)

async def holder(started):
    async with alock:
        started.set()
        await asyncio.get_running_loop().create_future()  # forever: only it refers to it

async def loop_ends():
    started = asyncio.Event()
    task = asyncio.ensure_future(holder(started))
    await started.wait()
    return task

async def collected_meanwhile():
    started = asyncio.Event()
    task = asyncio.ensure_future(holder(started))
    await started.wait()
    del task       # unreferenced: the task and its future are a cycle
    gc.collect()   # here, inside the running loop: its coroutine is closed
    await asyncio.sleep(0)

loop = asyncio.new_event_loop()
if how == "loop-closed":
    task = loop.run_until_complete(loop_ends())  # returns with the holder still pending
    loop.close()
    del task
    gc.collect()
else:
    loop.run_until_complete(collected_meanwhile())
    loop.close()
owned = alock.owned()
print("owned" if owned else "not owned", "drained" if finalizers.drain(5) else "still going",
      flush=True)
import os
os._exit(0)   # (not the exit hook's release)
"""


@pytest.mark.parametrize("how", ["loop-closed", "collected-meanwhile"])
def test_a_task_destroyed_pending_inside_async_with_releases_its_lock(
        how: str, nodes3: RedisNodes) -> None:
    """A task destroyed while pending inside ``async with lock`` (its loop
    closed with it pending, or the task collected while its loop runs,
    unreferenced): its coroutine is closed, and the block's exit releases
    the lock where nothing can be awaited. The release's first await
    failed (no running loop; "coroutine ignored GeneratorExit"), the lock
    no longer counted as held, and its key stayed on every node for its
    whole lease. The round goes through the manager's sync transport, at
    once: the key goes."""
    proc = subprocess.run([sys.executable, "-c", _TASK_DESTROYED_PENDING_SCRIPT, how,
                           *nodes3.urls], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["not", "owned", "drained"], (proc.stdout, proc.stderr[-2000:])
    assert "Task was destroyed but it is pending" in proc.stderr  # (the case, as Python says)
    assert "Exception ignored" not in proc.stderr, proc.stderr[-2000:]
    assert _holders(nodes3, f"redlock:fin-task-{how}") == 0


def test_a_collections_release_reports_the_loss_of_its_own_hold(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """A lock object whose lease ran out (no renewal) while a generator was
    inside ``with LOCK``; a collection frees the generator, and the same
    object is taken again at once, while the library's thread is still busy
    with an earlier collection's slow receiver. ``lock_lost`` reports the
    old hold, with its fence: not the new hold's (read when the rest of the
    release ran in that thread, after the new acquisition)."""
    import gc

    from django_redlock import signals

    mgr = make_manager(nodes3, node_timeout=2.0)
    lock = mgr.lock("fin-lost-fence", ttl=1, auto_renew=False)
    other = mgr.lock("fin-lost-other", ttl=30)
    heard: list[int] = []

    def slow(sender: Any, *, name: str, **kwargs: Any) -> None:
        if name == "fin-lost-other":
            time.sleep(1.0)  # the library's thread, busy a while

    def lost(sender: Any, *, name: str, fence: int, **kwargs: Any) -> None:
        if name == "fin-lost-fence":
            heard.append(fence)

    signals.lock_released.connect(slow, weak=False)
    signals.lock_lost.connect(lost, weak=False)
    seen: dict[str, Any] = {}

    def thread() -> None:
        first = _inside(other)
        next(first)
        gen = _inside(lock)
        next(gen)
        seen["old fence"] = lock.fence
        time.sleep(1.1)  # the lock's lease runs out
        _abandon(first)
        del first
        gc.collect()  # other's release: its signal keeps the thread busy 1 s
        _abandon(gen)
        del gen
        gc.collect()  # the lock's release: lost
        with lock:  # (its lease is 1 s: the block ends before the signals are sent)
            seen["new fence"] = lock.fence
        seen["drained"] = finalizers.drain(10.0)

    gc.disable()
    try:
        worker = threading.Thread(target=thread)
        worker.start()
        worker.join(30)
    finally:
        gc.enable()
        signals.lock_released.disconnect(slow)
        signals.lock_lost.disconnect(lost)
    assert not worker.is_alive()
    assert seen["new fence"] > seen["old fence"]
    assert heard == [seen["old fence"]], (heard, seen)
    assert seen["drained"]


_EXIT_WITH_A_SLOW_RECEIVER_SCRIPT = r"""
import gc, sys, time
from django_redlock import LockManager, signals

def ship(sender, **kwargs):  # a receiver posting to an endpoint that does not answer
    time.sleep(8)

signals.lock_released.connect(ship, weak=False)
gc.disable()
mgr = LockManager(sys.argv[1:], node_timeout=0.5)
held = mgr.lock("fin-exit-held", ttl=60)
assert held.acquire()  # still held at exit: the exit hook releases it

def rows(lock):
    with lock:
        yield 1

gen = rows(mgr.lock("fin-exit-gen", ttl=60))
next(gen)
cycle = [gen]
cycle.append(cycle)
del gen, cycle
gc.collect()  # the generator's release: its lock_released handed off, to ship()
print("collected", flush=True)
sys.exit(0)
"""


def test_a_slow_receiver_at_exit_costs_the_held_locks_nothing(nodes3: RedisNodes) -> None:
    """A receiver of ``lock_released`` that takes 8 s is sending a
    collection's signal when the program exits, a lock still held. The exit
    hook releases the held lock first, and then waits for the signals at
    most 1 s: waiting for them first took the whole budget, and the held
    lock was skipped ("nodes that do not answer"), its key left 60 s."""
    proc = subprocess.run([sys.executable, "-c", _EXIT_WITH_A_SLOW_RECEIVER_SCRIPT,
                           *nodes3.urls], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["collected"], (proc.stdout, proc.stderr[-2000:])
    assert _holders(nodes3, "redlock:fin-exit-gen") == 0
    assert _holders(nodes3, "redlock:fin-exit-held") == 0, proc.stderr[-2000:]


def test_drain_with_nothing_handed_off_is_done_at_once() -> None:
    """``drain(0)`` with the thread running and nothing handed off: done
    (the exit hook, its budget spent by slow nodes, warned that signals
    were dropped when none were waiting)."""
    finalizers.prepare()
    assert finalizers.drain(0.0)
    assert finalizers.drain(0.0)
