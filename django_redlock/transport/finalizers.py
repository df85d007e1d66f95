"""Lock work a garbage collection runs inside the library's own critical
sections, put off until they end.

A collection may run at any allocation (and, from Python 3.12, at any call)
of a thread, also inside the library's sections: a round under way on the
nodes (a connection taken under its node's lock), a reentrant lock's tables
under their guard. It may finalize a generator suspended inside
``with lock`` in that very thread, and the block's exit releases the lock
there: a second round of the same thread inside the first, which waited for
a lock its own thread held (every later call of the process on that node,
or on the manager's reentrant locks, hung with it) or changed state the
first was in the middle of. Seen on 3.13 (the stack, top first)::

    worker     with other: ... release -> round -> checkout: holds the
               node's lock, calls _take_owed
    gc         frees a cycle holding rows() (suspended inside with lock)
    rows' exit lock.release -> round -> checkout: waits for the node's
               lock its own thread holds: forever

Such work is put off until the thread's outermost section ends (a round
takes at most its node timeout), and runs there, in the same thread, before
the section's caller goes on. Only what a finalizer runs is put off. The
sections are where the thread holds a lock a release (or its signals)
would take: the sync transport's rounds (any caller's: a lock's,
``force_release``, the late sender's, an asyncio call run through the sync
transport) and its ``forget``, a node's set-up thread's blocks under the
node's lock, a manager's run of a round's steps (around the transport's
own), and every :class:`Guard`: the reentrant locks' tables, the manager's
lazy builds and hand-over sweep, the debug panel's and the metrics' tables.
A lock of someone else's that a release's signal reaches (a receiver's, a
metrics library's) is not covered.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, Callable

logger = logging.getLogger("django_redlock")

#: Per thread: the frames its open sections were entered from (``frames``,
#: outermost first), and the work put off meanwhile (``later``).
_state = threading.local()


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
    frames = getattr(_state, "frames", None)
    if not frames:
        return False
    _drop_ended(frames)
    if frames:
        return True
    _run_later()  # the sections that put it off ended without their leave()
    return False


def put_off(work: Callable[[], object]) -> None:
    """Run ``work`` when this thread's outermost section ends."""
    later = getattr(_state, "later", None)
    if later is None:
        later = _state.later = []
    later.append(work)


def enter(up: int = 1) -> None:
    """A section begins in the frame ``up`` levels above this call (1: the
    caller's); pair with :func:`leave` from the same frame, in a ``finally``."""
    frames = getattr(_state, "frames", None)
    if frames is None:
        frames = _state.frames = []
    frames.append(sys._getframe(up))


def _reset_after_fork() -> None:
    """In a forked child: the forking thread's sections are not the child's
    (a fork inside one left the child's thread inside it for good: every
    release of the child put off, never run)."""
    _state.frames = []
    _state.later = []
    _state.running = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def leave(up: int = 1) -> None:
    """The section entered from the frame ``up`` levels above this call ends;
    when it was the outermost, the work put off meanwhile runs."""
    frames = getattr(_state, "frames", None)
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
    if not frames and getattr(_state, "later", None):
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
    if getattr(_state, "running", False):
        return
    _state.running = True
    try:
        while True:
            later = getattr(_state, "later", None)
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
