"""Lock work that a finalizer runs: the exit of a generator suspended inside
``with lock`` when a garbage collection frees it, at whatever point of
whichever thread the collection runs.

A collection may run at any allocation (and, from Python 3.12, at any call)
of a thread: inside the library's own critical sections (a round under way
on the nodes, a connection taken under its node's lock; a reentrant lock's
tables under their guard) and inside the application's (a lock of its own;
prometheus_client's metric lock, in an update). The block's exit releases
the lock there, and a release takes locks: the node's for its round, the
receivers' of its signals. Taken by the thread that already held it, it
waited forever, and so did every later user of that lock. Seen on 3.13
(the stack, top first)::

    worker     with other: ... release -> round -> checkout: holds the
               node's lock, calls _take_owed
    gc         frees a cycle holding rows() (suspended inside with lock)
    rows' exit lock.release -> round -> checkout: waits for the node's
               lock its own thread holds: forever

and with a lock no section of the library's can cover::

    thread     with app_lock: ... allocates (or prometheus_client's
               observe(): its metric's lock held)
    gc         frees a cycle holding rows()
    rows' exit lock.release -> lock_released -> a receiver: with app_lock:
               waits for the lock its own thread holds: forever

So a release that a finalizer runs is sent by the thread it runs in, never
where it would wait for a lock that thread holds:

* inside one of the library's sections, where the thread holds a lock the
  round would take, it is put off until the thread's outermost section
  ends (a round takes at most its node timeout), and runs there, before
  the section's caller goes on;
* its signals, whose receivers are the application's and the metrics
  library's code, are handed to a thread of the library's own
  (``redlock-finalizer``, :func:`call_later`), which waits for whatever
  the collecting thread holds, never the other way round. The exit hook
  (``release_held_locks``) waits for what it has not sent yet.

Only signals go there: a round handed to another thread came after the
thread's next ``acquire()`` of the same object (found still held), after a
process that ended before that thread ran it (a forked worker leaves with
``os._exit``: the key stayed for a lease), and behind a receiver that
waited for a lock the application held while waiting for that very key.
The records such a release logs (a loss, a node that failed) go there
too (:func:`get_logger`): a handler takes locks of its own, and the
application's may be held by the collecting thread (a ``QueueHandler``'s
queue, in the middle of a put).

The sections are where the thread holds a lock that work would take: the
sync transport's rounds (any caller's: a lock's, ``force_release``, the
late sender's, an asyncio call run through the sync transport) and its
``forget``, a node's set-up thread's blocks under the node's lock, a
manager's run of a round's steps (around the transport's own), and every
:class:`Guard`: the reentrant locks' tables, the manager's lazy builds and
hand-over sweep, the debug panel's and the metrics' tables. A reentrant
block's exit inside one is put off whole (its count and its release), and
holds the block's frame until it runs.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import queue
import sys
import threading
import time
from typing import Any, Callable


class _HandOffFinalizersRecords(logging.Filter):
    """Hands a record logged by what a finalizer runs (:func:`finalizing`)
    to the library's thread, where the logger handles it again (this filter
    lets it through there); every other record goes on as usual. The first
    filter of the logger itself, so that it sees the record before any other
    filter or handler takes a lock."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not finalizing():
            return True
        # (at interpreter shutdown, with no thread to take it: logged here)
        return not hand_off(functools.partial(logging.getLogger(record.name).handle, record))


_HAND_OFF_FINALIZERS_RECORDS = _HandOffFinalizersRecords()


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)``, for a module of the library's: what a
    finalizer runs logs through the library's thread (:func:`hand_off`).

    A release that a garbage collection runs may log (the lock was lost, a
    node failed); a handler it reaches takes its own lock, and may take the
    application's. With the collection inside that lock's section, the
    record waited for the lock its own thread held, forever::

        thread   logs a record: QueueHandler -> queue.put, its lock held
        gc       frees a cycle holding rows() (suspended inside with lock)
        thread   rows' exit -> release -> "lock ... lost" -> queue.put:
                 waits for the lock its own thread holds: forever

    Such a record is logged by the library's thread instead, shortly after
    (with the collecting thread's name and time in it: made where it
    happened)."""
    log = logging.getLogger(name)
    if _HAND_OFF_FINALIZERS_RECORDS not in log.filters:
        # First, before the filters the application set on this logger
        # (Django's LOGGING runs before the library is imported): after
        # them, a filter of theirs ran in the collecting thread (its lock
        # there) and again in the library's (a dedupe dropped the record).
        log.filters.insert(0, _HAND_OFF_FINALIZERS_RECORDS)
    return log

class _ThreadState(threading.local):
    """Per thread: the frames its open sections were entered from
    (``frames``, outermost first), the work put off meanwhile (``later``),
    and whether that work is running (``running``). The class attributes are
    every thread's defaults: read on every release, a missing attribute
    cost ``getattr`` an exception (some 250 ns) in each thread that never
    entered a section."""

    frames: "list[Any] | None" = None
    later: "list[Callable[[], object]] | None" = None
    running = False


_state = _ThreadState()


#: The thread running a garbage collection now (its ident), else None: one
#: collection runs at a time in a process, in the thread that started it.
_collector: int | None = None


def _on_collection(phase: str, info: dict[str, int]) -> None:
    global _collector
    _collector = threading.get_ident() if phase == "start" else None


gc.callbacks.append(_on_collection)


logger = get_logger("django_redlock")


def held_up() -> bool:
    """Whether lock work about to run in this thread must not run as usual:
    the thread is running a garbage collection, or work put off until a
    section's end, or is inside a section (:func:`finalizing`,
    :func:`inside`). The common case reads a global and two thread-local
    attributes."""
    collector = _collector
    if collector is not None and collector == threading.get_ident():
        return True
    if _state.running:
        return True
    return bool(_state.frames) and inside()  # (no call: the common case)


def finalizing() -> bool:
    """Whether this thread runs what a finalizer started: a garbage
    collection, or work put off until a section's end. Such work may run
    under any lock this thread holds, the application's too: what would
    take one (a round, a signal) goes to the library's thread
    (:func:`hand_off`)."""
    collector = _collector
    if collector is not None and collector == threading.get_ident():
        return True
    return _state.running


def inside() -> bool:
    """Whether this thread is inside a section (see the module's docstring).

    A section is known by the frame it was entered from, and a frame no
    longer on the thread's stack ends its section: an exception raised at
    the wrong instruction (a signal handler's, such as Celery's soft time
    limit or ``KeyboardInterrupt``, at the entry of :func:`leave`) left a
    bare counter raised for good, and from then on every release of that
    thread was put off and never run (the key held, renewed, while the lock
    object lived)::

        thread     a round ends: finally -> leave()
        signal     raised at leave()'s first instruction: the count stays 1
        later      every release() "inside a section": put off, never run

    Checked only while a section is recorded, so the common case, a release
    outside any, reads one attribute."""
    frames = _state.frames
    if not frames:
        return False
    _drop_ended(frames)
    if frames:
        return True
    _run_later()  # the sections that put it off ended without their leave()
    return False


def put_off(work: Callable[[], object]) -> None:
    """Run ``work`` when this thread's outermost section ends."""
    later = _state.later
    if later is None:
        later = _state.later = []
    later.append(work)


def enter(up: int = 1) -> None:
    """A section begins in the frame ``up`` levels above this call (1: the
    caller's); pair with :func:`leave` from the same frame, in a ``finally``."""
    frames = _state.frames
    if frames is None:
        frames = _state.frames = []
    frames.append(sys._getframe(up))


def _reset_after_fork() -> None:
    """In a forked child: the forking thread's sections are not the child's
    (a fork inside one left the child's thread inside it for good: every
    release of the child put off, never run); nor are the parent's signals
    waiting to be sent, nor its thread for them."""
    global _queue, _worker, _starting, _collector
    _collector = None  # (another thread's collection, at the fork)
    _state.frames = []
    _state.later = []
    _state.running = False
    _queue = queue.SimpleQueue()
    _worker = None
    _starting = threading.Lock()  # (held at the fork by a parent thread: for good)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def leave(up: int = 1) -> None:
    """The section entered from the frame ``up`` levels above this call ends;
    when it was the outermost, the work put off meanwhile runs."""
    frames = _state.frames
    if not frames:
        return  # reset by a fork inside it, or never recorded
    me = sys._getframe(up)
    if frames[-1] is me:
        frames.pop()
    else:  # sections above it ended without their leave(): dropped with it
        for at in range(len(frames) - 1, -1, -1):
            if frames[at] is me:
                del frames[at]
                break
        _drop_ended(frames)
    if not frames and _state.later:
        _run_later()


def _drop_ended(frames: list[Any]) -> None:
    """Forget the sections whose frame is no longer on this thread's stack."""
    live = set()
    frame: Any = sys._getframe(1)
    while frame is not None:
        live.add(id(frame))
        frame = frame.f_back
    frames[:] = [f for f in frames if id(f) in live]  # held: their ids are not reused


def _run_later() -> None:
    """Run the work put off, one at a time: an interrupt in one leaves the
    rest for the next section's end (swapped out as a whole, the rest was
    dropped with it, and their keys stayed for a lease). Failures are
    logged, as a finalizer's are printed: the code whose collection ran it
    is not the one to hear of them.

    Not again from inside a piece: a piece's own round ends a section of its
    own, and each such end ran the next piece one level deeper; with a few
    hundred releases put off by one collection, the deepest failed with
    ``RecursionError`` and their keys stayed for a lease (300 put off: 103
    left). The outermost loop takes them all, one after the other."""
    if _state.running:
        return
    _state.running = True
    try:
        while True:
            later = _state.later
            if not later:
                return
            work = later.pop(0)
            try:
                work()
            except Exception:  # noqa: BLE001 - see the docstring
                logger.exception("lock work put off by a garbage collection failed")
    finally:
        _state.running = False


class Section:
    """``with SECTION:`` (or ``with SECTION, lock:``): a section for the
    ``with`` statement's frame. For a lock that is also taken elsewhere
    without one (a node's condition, whose ``wait`` releases it), the
    section is around the block only."""

    __slots__ = ()

    def __enter__(self) -> None:
        enter(2)  # the with statement's frame

    def __exit__(self, *exc: object) -> None:
        leave(2)


SECTION = Section()


class Guard:
    """A reentrant lock whose every ``with`` block is a section: a
    collection inside it that finalizes a generator suspended inside
    ``with L`` puts that block's release off until the outermost section
    ends. The library's own locks that a release (or its signals) may take
    are these: with a plain lock, the release waited for the lock its own
    thread held, and that thread, and every thread after it, hung::

        thread A   holds the lock, allocates
        gc         frees a cycle holding rows() (suspended inside with L)
        thread A   rows' exit -> L.release() -> waits for that lock: forever
        now        rows' exit is put off: it runs when A's section ends

    Only for ``with`` blocks (the frame is the statement's)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def __enter__(self) -> None:
        enter(2)  # the with statement's frame
        try:
            self._lock.acquire()
        except BaseException:  # interrupted (KeyboardInterrupt): no section after all
            leave(2)
            raise

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        leave(2)


# ------------------------------------------------- the collections' own thread
#: Work handed off (signals to send), in the order handed. ``SimpleQueue.put``
#: takes no lock a collection could have interrupted (it is reentrant: made
#: for finalizers and signal handlers).
_queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
_worker: threading.Thread | None = None
_starting = threading.Lock()


def prepare() -> None:
    """Start the thread that runs what is handed off (:func:`call_later`), if
    it is not running in this process. Called when a node's connection is made, so
    that it is there before a collection needs it: started from inside a
    collection, ``Thread.start`` takes locks of the threading module that
    the collecting thread may hold (a collection inside its own
    ``Thread.start``), and waited for itself."""
    worker = _worker
    if worker is not None and worker.is_alive():
        return
    if not _starting.acquire(blocking=False):
        return  # being started (by this thread, under a collection, or another)
    try:
        worker = _worker
        if worker is None or not worker.is_alive():
            _start()
    finally:
        _starting.release()


def _start() -> None:
    global _worker
    worker = threading.Thread(target=_serve, args=(_queue,), name="redlock-finalizer",
                              daemon=True)
    worker.start()  # RuntimeError at interpreter shutdown: the caller's to handle
    _worker = worker


def call_later(function: Callable[..., object], *args: Any, **kwargs: Any) -> None:
    """Call ``function`` in the library's thread, after what was handed to it
    before; here and now when there is none and none can be started
    (interpreter shutdown)."""
    work = functools.partial(function, *args, **kwargs)
    if not hand_off(work):
        work()


def hand_off(work: Callable[[], object]) -> bool:
    """Queue ``work`` for the library's thread; False when there is none and
    none can be started (interpreter shutdown)."""
    worker = _worker
    if worker is None or not worker.is_alive():
        try:
            prepare()  # not there yet (the first connection is being made): rare
        except RuntimeError:
            return False
        if _worker is None and not _starting.locked():
            return False  # (locked: being started, by another thread or under this collection)
    _queue.put(work)
    return True


#: Whether the thread is running a piece of work (else it waits for one).
_working = False


def _serve(work_queue: "queue.SimpleQueue[Any]") -> None:
    """The thread's loop: run each piece of work handed off, in order.
    Failures are logged, as a finalizer's are printed; a receiver's
    ``SystemExit`` does not end the thread (the signals after it wait)."""
    global _working
    while True:
        work = work_queue.get()
        _working = True
        try:
            work()
        except BaseException:  # noqa: BLE001 - see the docstring; the thread goes on
            logger.exception("lock work run after a garbage collection failed")
        finally:
            _working = False
        del work


def drain(timeout: float) -> bool:
    """Wait until the work handed off so far has run, at most ``timeout`` s
    (the exit hook: the thread is a daemon, and dies with the process).
    Without a running thread the work runs here. True when none is left."""
    worker = _worker
    if worker is threading.current_thread():
        return _queue.empty()  # (the thread's own work: it cannot wait for itself)
    if _queue.empty() and not _working:
        return True  # nothing handed off waits (whatever the timeout, 0 too)
    if worker is None or not worker.is_alive():
        deadline = time.monotonic() + timeout
        while True:
            if time.monotonic() >= deadline:
                return _queue.empty()
            try:
                work = _queue.get_nowait()
            except queue.Empty:
                return True
            try:
                work()
            except Exception:  # noqa: BLE001
                logger.exception("lock work run after a garbage collection failed")
    reached = threading.Event()
    _queue.put(reached.set)
    return reached.wait(timeout)
