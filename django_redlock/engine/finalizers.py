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
the section's caller goes on. Only what a finalizer runs is put off: the
library never starts one of these sections inside another in one thread on
its own.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

logger = logging.getLogger("django_redlock")

#: Per thread: how deep it is in sections, and the work put off meanwhile.
_state = threading.local()


def inside() -> bool:
    """Whether this thread is inside a section (see the module's docstring)."""
    return bool(getattr(_state, "depth", 0))


def put_off(work: Callable[[], object]) -> None:
    """Run ``work`` when this thread's outermost section ends."""
    later = getattr(_state, "later", None)
    if later is None:
        later = _state.later = []
    later.append(work)


def enter() -> None:
    """A section begins (pair with :func:`leave`, in a ``finally``)."""
    _state.depth = getattr(_state, "depth", 0) + 1


def _reset_after_fork() -> None:
    """In a forked child: the forking thread's sections are not the child's
    (a fork inside one left the child's thread inside it for good: every
    release of the child put off, never run)."""
    _state.depth = 0
    _state.later = []


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def leave() -> None:
    """A section ends; the outermost runs the work put off meanwhile. Its
    failures are logged, as a finalizer's are printed: the code whose
    collection ran it is not the one to hear of them."""
    depth = _state.depth = _state.depth - 1
    if depth == 0 and getattr(_state, "later", None):
        later, _state.later = _state.later, []
        for work in later:
            try:
                work()
            except Exception:  # noqa: BLE001 - see the docstring
                logger.exception("lock work put off by a garbage collection failed")
