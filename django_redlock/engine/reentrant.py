"""``lock(name, reentrant=True)``: the same thread (or asyncio task) may take it again.

(Why one module of 1,040 lines: who owns a hold (a thread, a task, the task
that awaits a release run by ``shield``), how long the hold lives (weakly
kept, ended with its owner) and the sync and asyncio objects that share both
are one model of ownership; split, each half would reach into the other.)

Why: a decorated view calls a decorated helper that locks the same row::

    @with_lock("stock:<pk>", reentrant=True)
    def buy(request, pk): ... reserve(pk) ...

    @with_lock("stock:<pk>", reentrant=True)
    def reserve(pk): ...

With a plain lock, ``reserve`` waits for the lock its own caller holds until
its timeout: a self-deadlock. A reentrant lock lets the holder's thread in at
once. The nodes see one hold: one key, one fence, one renewal; the holder's
thread counts how often it entered, and the lock is released on the nodes by
the matching last release, whichever object makes it.

How: each manager keeps a table ``owner -> key -> hold`` (owner: the thread,
or the asyncio task). The first acquisition makes a plain lock for the hold
and acquires it; the others join the hold while it is still owned. A hold whose
lease was lost is not joined: the caller acquires anew (and the holders of the
old hold learn about the loss at their release, as with any lost lock).

The owner is an object, never a number the runtime hands out again. Keyed by
``threading.get_ident()`` or ``id(asyncio.current_task())``, a hold outlived
its thread or task and was joined by whichever came next with the same
number::

    task 1   await asyncio.wait_for(lock.acquire(), 5)   # Python 3.11: the
             acquire runs in a child task, which ends; the hold stays
    task 2   (another request) gets the child's id: acquire(blocking=False)
             joins the hold at once, without asking the nodes: two holders

So a task is its own ``Task`` object, and a thread is an object kept in its
thread-local storage, which ends with the thread (a new thread with the old
thread's identifier gets a new one).

A hold lives no longer than its owner, nor than the lock objects that entered
it: like a plain ``Lock`` dropped without release, it then stops being renewed
and its key expires within one lease. The objects keep their owners' holds
(``owner -> holds``, weakly keyed by the owner), the table keeps them only
weakly, and nothing keeps an owner: when its thread ends (its thread-local
owner is freed), its task is done (a done callback of the task) or the
objects are dropped, the hold goes. The table used to keep every hold, and
with it its plain lock and its task, for the life of the process::

    t=0    a request's thread: lock("row:7", reentrant=True).acquire()
    t=0.1  the view fails before release(); the thread ends
    ...    the renewal thread kept renewing the hold the table kept
    t=4    four leases later, every other process still waits for row:7

A task of its own that runs only the ``acquire()`` (``asyncio.wait_for`` on
Python 3.11, ``ensure_future``, ``create_task``) is done as soon as the
acquire returns, so its hold would end at once, while the caller believes it
holds the lock: such an acquire raises ``RuntimeError`` before taking anything.

A release (or an ``extend()``) run in a task of its own is another matter:
``await asyncio.shield(lock.release())``, the usual way to release under
cancellation, and ``asyncio.wait_for(lock.release(), t)`` before Python 3.12
run it in a new task, which holds nothing. Asked about that task's own hold,
it raised ``LockNotOwned`` and the key stayed held and renewed::

    task A   lock.acquire() ... finally: await asyncio.shield(lock.release())
             the shield's task holds nothing: LockNotOwned
    ...      A's hold lives on, renewed, until A ends; then its key expires
             within a lease, never released

A release by a task that holds nothing through the object ends the hold of
the nearest task awaiting it through ``asyncio.shield`` or ``wait_for`` that
does (found through the done callbacks of the task and of the futures it
completes: ``shield``, ``wait_for``, a shielded clean-up coroutine, a chain of
them), as if that task had awaited it directly; awaited only by tasks that
hold nothing through the object, it is ``LockNotOwned`` as before. Those two
make a task to run the caller's own coroutine for it; any other await (``await
task``, ``gather``, a ``TaskGroup``) is of a child task, a task of its own with
its own holds, followed only when that task runs nothing but the release
(``gather(lock.release())``): a child whose ``acquire(blocking=False)`` said
False and whose ``finally`` released anyway ended its parent's hold, in the
middle of the parent's critical section. A task that acquired, or tried to,
through the object is never followed, however awaited: ``shield(task)``, and
``wait_for(task, t)`` before 3.12, cannot be told from ``shield(coroutine)``
and ``wait_for(coroutine, t)`` (since 3.12 ``wait_for`` runs a coroutine in
the caller's task), so a child task awaited so that never tried to acquire
is followed as a clean-up coroutine is.
A task started by an eager task factory (3.12+) runs its first step before
anyone awaits it, inside the call that made it: its maker's task is found on
the stack instead. A task of its own running only the release that no task is
found to await (not awaited at once) ends the hold of the object's only
holder; with several tasks holding through the object, whose hold is meant
cannot be known: ``RuntimeError``, and no hold is ended.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import threading
import weakref
from types import EllipsisType, TracebackType
from typing import TYPE_CHECKING, Any, Callable, cast

from ..core.arguments import check_timeout
from ..exceptions import LockLost, LockNotAcquired, LockNotOwned
from ..transport import finalizers
from .awaits import ASYNCIO_DIR as _ASYNCIO_DIR
from .awaits import awaiting_task as _awaiting_task
from .awaits import runs_alone as _runs_alone
from .blocks import statement_entry_offsets

if TYPE_CHECKING:
    from .protocol import LockHost

logger = finalizers.get_logger("django_redlock.lock")

_this_thread = threading.local()



class _Owner:
    """A thread's owner of reentrant holds (an object that can be referred to
    weakly: the holds go when it goes)."""

    __slots__ = ("__weakref__",)


def _thread_owner() -> object:
    """This thread's owner of reentrant holds: an object of its own for as
    long as the thread lives (its thread-local storage ends with it, and the
    thread's holds with it), never another thread's, unlike
    ``threading.get_ident()``, which the system hands to the next thread once
    this one ended."""
    try:
        return _this_thread.owner
    except AttributeError:
        owner = _this_thread.owner = _Owner()
        return owner


def _task_owner() -> asyncio.Task[Any] | None:
    """This asyncio task (None outside a task, or outside a running loop: no holds)."""
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running event loop: owned() asked from sync code
        return None


class Hold:
    """One reentrant hold on the nodes: the plain lock that took it, and how many
    acquisitions of its owner it serves. It refers to no owner (the owner is
    a weak key, which a value referring to it would keep alive)."""

    __slots__ = ("lock", "count", "__weakref__")

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self.count = 1


class HoldTable:
    """The manager's table of reentrant holds (``owner -> key -> Hold``), all
    weak: the lock objects that entered a hold keep it (see the module's
    docstring), the table only finds it for the owner's next acquisition."""

    def __init__(self) -> None:
        self._holds: weakref.WeakKeyDictionary[object, weakref.WeakValueDictionary[str, Hold]] = (
            weakref.WeakKeyDictionary())
        self._guard = finalizers.Guard()

    def __len__(self) -> int:
        """How many holds are alive (for tests and debugging)."""
        with self._guard:
            return sum(len(holds) for holds in list(self._holds.values()))

    def join(self, key: str, owner: object) -> Hold | None:
        """The owner's live hold on this key, its count raised; None if there is none."""
        with self._guard:
            holds = self._holds.get(owner)
            hold = holds.get(key) if holds is not None else None
            if hold is None or not hold.lock.owned():
                return None
            if hold.count <= 0 or holds is None or holds.get(key) is not hold:
                # A collection in owned() (3.12+: at any call) ran a
                # generator's release of this very hold, whose last count
                # ended it (its release on the nodes put off to this
                # section's end): joined, the key went at the end of the
                # section while the joining block ran.
                return None
            hold.count += 1
            return hold

    def add(self, key: str, owner: object, hold: Hold) -> None:
        with self._guard:
            holds = self._holds.get(owner)
            if holds is None:
                holds = self._holds[owner] = weakref.WeakValueDictionary()
            holds[key] = hold

    def leave(self, key: str, owner: object, hold: Hold) -> bool:
        """One acquisition of ``hold`` ends; True when it was the last (release it)."""
        with self._guard:
            hold.count -= 1
            if hold.count > 0:
                return False
            holds = self._holds.get(owner)
            if holds is not None and holds.get(key) is hold:
                del holds[key]
            return True


#: Frames of a coroutine (native, generator-based, async generator): a run of
#: them on the stack is one task's chain of awaits (see :func:`_started_by`).
_CO_ASYNC = inspect.CO_COROUTINE | inspect.CO_ITERABLE_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _started_by(top: Any) -> "tuple[Any, bool] | None":
    """For a task whose coroutine's frame is ``top``: the frame of the
    coroutine of the task that started it eagerly (Python 3.12+'s eager task
    factory: its first step runs inside the ``create_task()`` call, before
    anyone can await it), with whether through ``asyncio.shield``; None when
    it was started by the event loop (not eagerly).

    An eager task's first step runs on the stack of the task that made it:
    above its coroutine's frame, asyncio's own functions (``shield``,
    ``ensure_future``, ``create_task``, the factory), then the awaits of the
    maker's task up to that task's coroutine's frame. A task the loop steps
    has only the loop's functions above it."""
    frame, via_shield = getattr(top, "f_back", None), False
    for _ in range(64):  # a bounded walk
        if frame is None:
            return None
        if frame.f_code.co_flags & _CO_ASYNC:
            break
        if frame.f_code.co_filename.startswith(_ASYNCIO_DIR) and frame.f_code.co_name == "shield":
            via_shield = True
        frame = frame.f_back
    else:
        return None
    for _ in range(256):  # up the maker's chain of awaits, to its task's coroutine
        back = frame.f_back
        if back is None or not back.f_code.co_flags & _CO_ASYNC:
            return frame, via_shield
        frame = back
    return None


#: task -> the objects it entered a hold through, for its one done callback:
#: one callback per task, not one per object (``with_lock(reentrant=True)``
#: makes an object per call: a worker task's callbacks grew with every job,
#: never removed). Both weak: nothing here keeps a task or an object alive.
_watched: "weakref.WeakKeyDictionary[asyncio.Task[Any], weakref.WeakSet[ReentrantBase]]" = (
    weakref.WeakKeyDictionary())
_watched_guard = threading.Lock()  # loops may run in several threads

#: Guards the objects' tables of open ``with`` / ``async with`` blocks
#: (:attr:`ReentrantBase._enterers`): one object may be shared by threads
#: (and by loops in several threads). One for all, held for a few dict
#: operations, so that a fork resets it. A ``finalizers.Guard``: a collection
#: inside it that finalizes a generator suspended in ``with L`` in this
#: thread puts that block's exit off until the section ends (a plain lock
#: hung the thread, and every reentrant block after it); and what it guards
#: bears being changed under it by its own thread (an ``async with`` exit).
_enterers_guard = finalizers.Guard()


def _reset_watched_after_fork() -> None:
    """In a forked child: a parent thread inside ``_watch_task`` or
    ``_task_done`` (or a ``with``'s bookkeeping) at the fork left the guard
    held, with no thread here to let go of it (the child's first reentrant
    alock waited for ever); the parent's tasks do not exist here either."""
    global _watched, _watched_guard, _enterers_guard
    _watched = weakref.WeakKeyDictionary()
    _watched_guard = threading.Lock()
    _enterers_guard = finalizers.Guard()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_watched_after_fork)


def _watch_task(task: "asyncio.Task[Any]", lock: "ReentrantBase") -> None:
    """Drop ``task``'s holds through ``lock`` when ``task`` is done."""
    with _watched_guard:
        locks = _watched.get(task)
        if locks is None:
            locks = _watched[task] = weakref.WeakSet()
            task.add_done_callback(_task_done)
        locks.add(lock)


def _task_done(task: "asyncio.Task[Any]") -> None:
    """A task is done: the holds it entered go (they stop being renewed; their
    keys expire), though the task object may live on."""
    with _watched_guard:
        locks = _watched.pop(task, None)
    for lock in list(locks or ()):
        lock._forget(task)


class ReentrantBase:
    """The rules; :class:`ReentrantLock` and :class:`AsyncReentrantLock` run them.

    One object may be used by several threads (or tasks), as one would use a
    ``threading.RLock``: each owner's holds are kept apart, and a release, an
    ``extend()``, ``owned()`` and ``fence`` are about the caller's own hold.
    With one list for all, a thread whose lease ran out ended the other
    thread's hold at its ``with`` exit::

        t=0.00  T1  with L: takes the key (ttl 0.3, no renewal), pauses
        t=0.30  the lease runs out on the nodes
        t=0.31  T2  with L: (the same object) takes the key anew
        t=0.60  T1  leaves its block: popped T2's hold and released it
                    (no LockLost for T1, whose lease was lost)
        t=0.80  another process takes the key: T2 is still inside
        t=1.31  T2  leaves: LockLost
    """

    def __init__(self, manager: "LockHost", make: Callable[[], Any], timeout: float | None,
                 ) -> None:
        self.manager = manager
        self._make_plain = make  # a new plain lock with this lock's options
        self._proto = make()  # for name, key, ttl...: never acquired
        self.metrics_label: str | None = None
        self.name: str = self._proto.name
        self.key: str = self._proto.key
        self.ttl: float = self._proto.ttl
        self.timeout = timeout
        self.retry_after = 0.0
        #: owner -> the holds it entered through this object, innermost last;
        #: weakly keyed: the holds of an ended thread (or a freed task) go.
        self._holds: weakref.WeakKeyDictionary[object, list[Hold]] = (
            weakref.WeakKeyDictionary())
        #: id of the frame an open ``with`` (``async with``) is in -> its
        #: entries, innermost last (``with L, L:``, or two nested in one
        #: frame, is two): (the entering owner, weakly; the frame's code,
        #: against a reused id; the hold it entered, weakly: kept, it kept its
        #: plain lock, renewed after its owner ended; the statement's line).
        #: Whose exit an exit is, whatever thread or task runs it
        #: (:meth:`_claim_entry`).
        self._enterers: dict[int, list[tuple[weakref.ref[Any], Any, weakref.ref[Hold], int]]] \
            = {}
        #: owner -> for each ``with`` it is entering (between the acquisition
        #: and the record of the block), how many holds it had before: a
        #: hold pushed past that is the block's, not one taken by hand
        #: (:meth:`_unentered`).
        self._entering: dict[object, list[int]] = {}

    def __repr__(self) -> str:
        mine = self._mine()
        state = f"held x{len(mine)}" if mine else "unlocked"
        return f"<{type(self).__name__} {self.name!r} {state} fence={self.fence}>"

    @property
    def fence(self) -> int:
        mine = self._mine()
        return mine[-1].lock.fence if mine else 0

    @property
    def validity(self) -> float:
        mine = self._mine()
        return mine[-1].lock.validity if mine else 0.0

    def owned(self) -> bool:
        mine = self._mine()
        return bool(mine) and mine[-1].lock.owned()

    def _owner(self) -> object | None:
        """The caller's owner: its thread's, or its task (None: no task)."""
        raise NotImplementedError

    def _mine(self, owner: object | None | EllipsisType = ...) -> list[Hold]:
        """The caller's (or ``owner``'s) holds through this object, innermost
        last (none: empty)."""
        if owner is ...:
            owner = self._owner()
        return (self._holds.get(owner) or []) if owner is not None else []

    def _watch(self, owner: object) -> None:
        """Called once per owner that enters a hold through this object (the
        asyncio driver drops the task's holds when it is done)."""

    def _forget(self, owner: object) -> None:
        """The owner ended (its task is done): its holds through this object go."""
        self._holds.pop(owner, None)

    def _innermost(self, owner: object | None | EllipsisType = ...) -> Hold:
        mine = self._mine(owner)
        if not mine:
            raise LockNotOwned(f"lock {self.name!r} is not held by this {self._who} "
                               f"through this object", lock_name=self.name)
        return mine[-1]

    _who = "owner"

    def _make(self) -> Any:
        """The plain lock of a new hold, with this lock's metrics label (the
        plain lock sends the signals the metrics count: see
        ``compose.Composite.metrics_label``)."""
        lock = self._make_plain()
        if self.metrics_label is not None:
            lock.metrics_label = self.metrics_label
        return lock

    def _enter(self, blocking: bool, timeout: float | None | EllipsisType, owner: object,
               ) -> tuple[Hold | None, float | None]:
        """Join the owner's hold (no I/O), or say how long a new one may wait."""
        wait = self.timeout if timeout is ... else check_timeout(timeout)
        if not isinstance(blocking, bool):
            raise ValueError(f"blocking must be True or False, not {blocking!r}")
        hold = self.manager._reentrant.join(self.key, owner)
        if hold is not None:
            self._push(owner, hold)
        return hold, (0.0 if not blocking else wait)

    def _took(self, lock: Any, owner: object) -> None:
        hold = Hold(lock)
        self.manager._reentrant.add(self.key, owner, hold)
        self._push(owner, hold)

    def _push(self, owner: object, hold: Hold) -> None:
        with _enterers_guard:  # see _leave
            mine = self._holds.get(owner)
            if mine is None:
                # Kept (empty) while the owner lives: watched once per owner, not
                # once per acquisition (a task's done callbacks would pile up).
                mine = self._holds[owner] = []
                self._watch(owner)
            mine.append(hold)

    def _leave(self, owner: object | None | EllipsisType = ...,
               hold: Hold | None = None) -> Hold | None:
        """End one acquisition of the caller's (or ``owner``'s): of ``hold``
        (a ``with`` block's own) or else the innermost; the hold to release
        on the nodes when it was the last."""
        if owner is ...:
            owner = self._owner()
        left = self._leave_mine(owner, hold)
        return left if left is not None and self.manager._reentrant.leave(
            self.key, owner, left) else None

    def _leave_mine(self, owner: object | None, hold: Hold | None) -> Hold | None:
        """:meth:`_leave`'s part in this object: the acquisition taken off
        ``owner``'s list; the hold it was of (None: nothing to leave)."""
        # Under the guard: a block's exit run by another thread (a generator
        # closed there) takes from the enterer's list while the enterer may
        # push or pop on it; between its look and its pop the enterer ended
        # the hold, and the exit raised LockNotOwned out of ``close()``.
        with _enterers_guard:
            if hold is not None and not self._mine(owner):
                return None  # the block's hold ended meanwhile, with the owner's last
            innermost = self._innermost(owner)  # raises if it holds nothing through this object
            mine = self._holds[owner]
            if hold is None or mine[-1] is hold:
                hold = innermost
                mine.pop()
            else:  # a block left out of order (its generator closed late): its own hold
                places = [at for at, held in enumerate(mine) if held is hold]
                if not places:
                    return None  # ended meanwhile by its owner's thread
                del mine[places[-1]]
        return hold

    def _record_entry(self, frame: Any, owner: object) -> None:
        """A ``with`` (``async with``) block was entered by ``owner``, whose
        innermost hold is the one it entered: record it under the frame of the
        block (the caller of ``__enter__``, whose frame is ``frame``), so that
        its exit ends that hold, whichever thread or task runs the exit.

        One entry per frame, as the asyncio form kept, lost one of two blocks
        entered in one frame (``async with L, L:``, or nested): the inner
        enter overwrote the outer's, and the outer exit, in another task,
        found none::

            task A   rows() (inside async with L, L) abandoned across a yield
            loop     aclose() in a new task: the inner exit ends one; the
                     outer finds no entry, asks the closing task: nothing
            ...      the key stays held, renewed while A lives"""
        caller = frame.f_back if frame is not None else None
        if caller is None:
            return
        # The whole recording is one section of the guard: a collection in it
        # that finalizes a generator of this thread's, suspended in a block
        # whose hold went, puts its exit off until this block is recorded
        # (run at once, it saw the new hold with no block on it, took it for
        # one taken by hand, and ended it: this block ran without the lock).
        with _enterers_guard:
            if caller.f_lasti not in statement_entry_offsets(caller.f_code):
                # Entered by hand (``ExitStack.enter_context``, ``__enter__()``):
                # left through another frame, or by ``release()``, never through
                # this frame's exit, so the entry could never be claimed; under
                # one long outer block they piled up, one per job. Such an exit
                # is its caller's own.
                return
            mine = self._mine(owner)
            if not mine:
                return  # ended meanwhile (by an exit a collection ran): nothing to match
            # Kept until the block's exit claims it, whoever the owner was and
            # whatever it holds now: a statement's block is left through its
            # exit (a generator suspended inside, when it is closed or
            # collected, a coroutine when it is closed), so the entries are
            # as many as the blocks open. Pruning the entries of owners that
            # ended or held nothing dropped those of blocks still open in
            # generators, whose exits then took the closing thread's own
            # hold for theirs::
            #
            #     33 threads   rows() inside with L (its hold released by
            #                  hand, or gone with its thread); thread ends
            #     thread B     with L: its record pruned the 33 entries
            #     gc (in B)    each rows' exit: no entry: B's hold ended
            #     rival        acquires while B is inside
            entry = (weakref.ref(owner), caller.f_code, weakref.ref(mine[-1]), caller.f_lineno)
            self._enterers.setdefault(id(caller), []).append(entry)

    def _claim_entry(self, frame: Any) -> tuple[Any, Hold | None] | None:
        """For an exit (``__exit__`` / ``__aexit__``, whose frame is
        ``frame``): the innermost entry recorded in its block's frame, taken
        off, as (its enterer, None once gone; the hold it entered, None once
        gone); None when the frame has none (entered by hand:
        ``ExitStack.enter_context`` enters in another frame) or one of another
        code (a reused id)."""
        caller = frame.f_back if frame is not None else None
        if caller is None:
            return None
        return self._claim_entry_at(id(caller), caller.f_code, caller.f_lineno)

    def _claim_entry_at(self, frame_id: int, code: Any,
                        line: int | None = None) -> tuple[Any, Hold | None] | None:
        """:meth:`_claim_entry` for the block frame of id ``frame_id`` running
        ``code``, now at ``line``. An exit at another line than its
        innermost block's statement is an ``__exit__`` called by hand in
        that frame, never the statement's own (which runs at its line, 3.10
        to 3.13, as a plain lock's record tells them apart): it claims
        nothing, and the block's record stays for the block's exit. It took
        the record, and ended the block's new hold under its body, while the
        hand entry's own hold had lapsed (review 9)::

            R.__enter__()           # a job's start, by hand: H1, which lapses
            with R:                 # H2, recorded for this frame
                R.__exit__(...)     # the job's stop, same frame: ended H2
        """
        with _enterers_guard:
            entries = self._enterers.get(frame_id)
            if entries and line is not None and entries[-1][1] is code \
                    and entries[-1][3] != line:
                return None
            entry = entries.pop() if entries else None
            if entries is not None and not entries:
                self._enterers.pop(frame_id, None)
        if entry is None or entry[1] is not code:
            return None
        return entry[0](), entry[2]()

    def _unentered(self, owner: object) -> bool:
        """Whether ``owner`` holds through this object and no recorded open
        block of ``owner``'s is on its innermost hold: then that hold was
        taken by hand (``acquire()``), and the exit of a block whose own
        hold went ends it, as a plain lock's block does::

            with L:                  # H1, its block recorded
                L.release()          # H1 ends
                L.acquire()          # H2 by hand, no block on it
            # exit: H2 ended

        A block on it, it is left to that block, even when the hold was
        also taken by hand (a generator's ``with`` joining it: the by-hand
        acquisition then outlives both blocks, renewed while its owner
        lives). Counting the acquisitions against the blocks instead read
        a block's entry already claimed by a thread closing it whose
        acquisition was not yet left, and ended another open block's."""
        mine = self._mine(owner)
        if not mine:
            return False
        entering = self._entering.get(owner)
        if entering and len(mine) > entering[-1]:
            # The hold of a ``with`` its owner is entering, whose block is
            # not recorded yet: a collection ran this exit in between, and
            # ended the block's hold before its body ran::
            #
            #     thread A   with L: hold H2 taken (the generator's went)
            #     gc         the generator's exit: H2 had no block: ended
            #     thread A   the block recorded, its body run without L
            return False
        hold = mine[-1]
        with _enterers_guard:
            return not any(entry[0]() is owner and entry[2]() is hold
                           for entries in list(self._enterers.values()) for entry in entries)

    def _hand_hold(self, owner: object) -> Hold | None:
        """For an exit no block's record claimed (``__exit__`` called by hand):
        ``owner``'s innermost hold with an acquisition no open block of
        ``owner``'s made (``__enter__()`` by hand, ``acquire()``); None when
        each of its holds is only its open blocks' (the exit ends none).

        It took the innermost hold, a block's, and ended it under the
        block's body (review 8)::

            job A      R.__enter__(): H1 ... its lease runs out
            with R:    H2 (H1 lost: not joined), its block recorded
                job A's stop: R.__exit__() ended H2 under the body
            rival      acquires: two holders

        Now it takes H1 (``LockLost``: lapsed), and H2 stays the block's."""
        mine = self._mine(owner)
        if not mine:
            return None
        with _enterers_guard:
            blocks: dict[int, int] = {}
            for entries in list(self._enterers.values()):
                for entry in entries:
                    hold = entry[2]()
                    if hold is not None and entry[0]() is owner:
                        blocks[id(hold)] = blocks.get(id(hold), 0) + 1
        acquisitions: dict[int, int] = {}
        for held in mine:
            acquisitions[id(held)] = acquisitions.get(id(held), 0) + 1
        for hold in reversed(mine):
            if acquisitions[id(hold)] > blocks.get(id(hold), 0):
                return hold
        return None

    def _busy(self) -> LockNotAcquired:
        return LockNotAcquired(f"lock {self.name!r} is busy: not acquired within "
                               f"{'no' if self.timeout is None else format(self.timeout, 'g')} s",
                               lock_name=self.name, retry_after=self.retry_after)


class ReentrantLock(ReentrantBase):
    """A lock its own thread may take again; from ``lock(name, reentrant=True)``."""

    _who = "thread"

    def _owner(self) -> object | None:
        return _thread_owner()

    def locked(self) -> bool:
        return bool(self._proto.locked())

    def acquire(self, blocking: bool = True, timeout: float | None | EllipsisType = ...) -> bool:
        """Join this thread's hold at once, or acquire like :meth:`Lock.acquire`."""
        owner = self._owner()
        hold, wait = self._enter(blocking, timeout, owner)
        if hold is not None:
            return True
        lock = self._make()
        if not lock.acquire(timeout=wait):
            self.retry_after = lock.retry_after
            return False
        self._took(lock, owner)
        return True

    def release(self) -> None:
        """End one acquisition; the last one releases on the nodes (and may raise
        ``LockLost``, as :meth:`Lock.release` does)."""
        hold = self._leave()
        if hold is not None:
            hold.lock.release()

    def extend(self, ttl: float | EllipsisType = ...) -> None:
        """Extend this thread's hold, as :meth:`Lock.extend` does."""
        self._innermost().lock.extend(ttl)

    def __enter__(self) -> "ReentrantLock":
        owner = self._owner()
        entering = self._entering.setdefault(owner, [])  # see _unentered
        entering.append(len(self._mine(owner)))
        try:
            if not self.acquire():
                raise self._busy()
            self._record_entry(inspect.currentframe(), owner)
        finally:
            entering.pop()
            if not entering:
                self._entering.pop(owner, None)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if caller is None:
            return self._exit_at(None, None, exc_type)
        if finalizers.inside():  # run by a collection inside a section: later
            finalizers.put_off(functools.partial(self._exit_of, caller, exc_type,
                                                 caller.f_lineno))
            return None
        return self._exit_at(id(caller), caller.f_code, exc_type, caller.f_lineno)

    def _exit_of(self, frame: Any, exc_type: type[BaseException] | None, line: int) -> None:
        """The exit of the ``with`` block in ``frame``, put off until the
        section ends: the frame is held until then, so its id is not another
        block's meanwhile (by id alone, a block entered since in a new frame
        at the same address could be ended in its place). A collection
        outside any section runs the exit at once: the tables' counts stay in
        the thread's order (only the signals of the key's release,
        :meth:`Lock.release`, go to the library's thread)."""
        self._exit_at(id(frame), frame.f_code, exc_type, line)  # (its line at the exit)

    def _exit_at(self, frame_id: int | None, code: Any,
                 exc_type: type[BaseException] | None, line: int | None = None) -> None:
        """The exit of the ``with`` block in the frame of id ``frame_id``
        running ``code``, now at ``line`` (None: unknown).

        The record's claim and the acquisition's end are one section of the
        guard: between them, another thread's exit by hand counted the
        claimed block as gone (``_hand_hold``), took the block's hold for a
        hand entry's, and the claim's own end then released it under the
        block still open on it (review 9)."""
        with _enterers_guard:
            owner, hold = self._exiting_at(frame_id, code, line)
            if owner is None:
                return  # released inside the block already (or its thread ended: its holds went)
            left = self._leave_mine(owner, hold)
        # (The hold table's own guard outside this section: a collection
        # inside the table runs exits that take this guard.)
        try:
            if left is not None and self.manager._reentrant.leave(self.key, owner, left):
                left.lock.release()
        except LockLost:
            if exc_type is None:
                raise

    def _exiting_at(self, frame_id: int | None, code: Any,
                    line: int | None = None) -> tuple[object | None, Hold | None]:
        """Whose ``with`` this exit ends, and its hold (the block's frame: of
        id ``frame_id``, running ``code``; None: unknown): the thread's that
        entered it in this very frame (recorded by ``__enter__``), whatever
        thread runs the exit; else the caller's own innermost hold (a
        ``__enter__`` called by hand). (None, None): nothing to end.

        A generator holding the lock across a ``yield`` is closed where it is
        let go of: ``gen.close()`` in another thread, or the garbage collector
        in whichever thread it runs (a reference cycle). Asked about its own
        holds, that thread's exit returned at once and the enterer's hold
        lived on, renewed for as long as its thread did; or, holding through
        the same object itself, it ended its own hold, in the middle of its
        block::

            thread A   for row in rows(): break   # rows() inside with L
            thread A   lives on (a worker): its hold is renewed, never released
            thread B   (A's lease ran out) with L: takes the key anew
            thread B   gen.close() (or a gc pass frees A's generator): the exit
                       ended B's hold; another process got in while B was inside

        The asyncio twin is matched the same way
        (:meth:`AsyncReentrantLock._exiting_owner`)."""
        claimed = self._claim_entry_at(frame_id, code, line) if frame_id is not None else None
        owner = self._owner()
        if claimed is not None:
            enterer, hold = claimed
            if enterer is None:
                return None, None
            if hold is None or not any(held is hold for held in self._mine(enterer)):
                # Released inside the block. Re-acquired there too, by hand
                # (no block of its own is on it), the block's exit ends that,
                # as a plain lock's does; a hold another open block of the
                # enterer's entered is that block's to end, and an exit run
                # by another thread ends none of the enterer's later holds::
                #
                #     with L:                # hold H1
                #         L.release()        # H1 ends
                #         L.acquire()        # H2: ended by nothing before,
                #                            # renewed while the thread lived
                if enterer is owner and self._unentered(owner):
                    return owner, None
                return None, None
            return enterer, hold
        hand = self._hand_hold(owner)
        return (owner, hand) if hand is not None else (None, None)


class AsyncReentrantLock(ReentrantBase):
    """A lock its own asyncio task may take again; from ``alock(name, reentrant=True)``."""

    _who = "task"

    def __init__(self, manager: "LockHost", make: Callable[[], Any], timeout: float | None,
                 ) -> None:
        super().__init__(manager, make, timeout)
        #: task -> how many of its ``async with`` through this object are open
        #: (see :meth:`_exiting_owner`); weakly keyed, dropped when it is done.
        self._entered: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
        #: the tasks that acquired, or tried to, through this object (weakly):
        #: tasks of their own, whose release is never another task's
        #: (see :meth:`_releasing_owner`).
        self._acquirers: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()

    def _owner(self) -> object | None:
        return _task_owner()

    def _forget(self, owner: object) -> None:
        super()._forget(owner)
        self._entered.pop(owner, None)

    def _watch(self, owner: object) -> None:
        _watch_task(cast("asyncio.Task[Any]", owner), self)

    def _acquiring_owner(self, frame: Any) -> "asyncio.Task[Any]":
        """The task that will own the hold; refused when it runs only this
        acquire (see the module's docstring)."""
        task = _task_owner()
        if task is None:
            raise RuntimeError(f"lock {self.name!r}: a reentrant alock is acquired in an "
                               f"asyncio task (its owner)")
        if _runs_alone(task, frame):
            raise RuntimeError(
                f"lock {self.name!r}: acquire() runs in a task of its own (asyncio.wait_for "
                f"before Python 3.12, ensure_future, create_task), which is done as soon as "
                f"it returns, and a reentrant hold ends with its task: await acquire() "
                f"directly (with its timeout=)")
        return task

    def _awaited_by(self, task: "asyncio.Task[Any]", alone: bool,
                    ) -> tuple["asyncio.Task[Any] | None", bool]:
        """For a release (or extend) in ``task``, which holds nothing through
        this object: the task whose hold it is for, found through the tasks
        awaiting it or the tasks that started it eagerly (None if none is
        found, or none that holds through this object), and whether any task
        was found to await or start it.

        Only the calls asyncio makes a task for on the caller's behalf are
        followed: ``asyncio.shield`` and ``wait_for`` (before 3.12), whose
        task runs the caller's coroutine for it (the release itself, a
        clean-up coroutine around it, a chain of them), as if awaited
        directly (``wait_for`` runs it in the caller's task since 3.12
        anyway). A child task awaited otherwise (``gather``, ``await
        create_task(...)``, a ``TaskGroup``) is a task of its own, with its own
        holds: its release ends none of its parent's. Only when ``task``
        runs nothing but the release (``alone``: ``gather(lock.release())``,
        ``await ensure_future(lock.release())``) is it its awaiting task's,
        however awaited. Following every await, a child that held nothing
        (its ``acquire(blocking=False)`` said False, its ``finally`` released
        anyway) ended its parent's hold::

            task A   lock.acquire() ... await asyncio.gather(child())
            child    lock.release(): A's hold ended, the key deleted
            task A   still in its critical section; another process gets in
        """
        found, waiter = False, _awaiting_task(task, alone)
        for _ in range(8):  # shield(wait_for(release())) on 3.11: two tasks up
            if waiter is None:
                break
            if self._mine(waiter):
                return waiter, True
            found, waiter = True, _awaiting_task(waiter, False)
        if found:
            return None, True
        # Not awaited yet: an eager task (3.12+) is started inside the call
        # that makes it, before its maker awaits it; the maker is on the stack.
        by_frame = {id(getattr(owner.get_coro(), "cr_frame", None)): owner
                    for owner, mine in list(self._holds.items())
                    if mine and isinstance(owner, asyncio.Task)}
        any_await, maker = alone, _started_by(getattr(task.get_coro(), "cr_frame", None))
        for _ in range(8):
            if maker is None:
                break
            top, via_shield = maker
            if not (any_await or via_shield):
                return None, True
            holder = by_frame.get(id(top))
            if holder is not None:
                return holder, True
            found, any_await, maker = True, False, _started_by(top)
        return None, found

    def _releasing_owner(self, frame: Any, what: str) -> object | None:
        """Whose hold a release (or an extend) ends: the caller's task's; for a
        task that holds nothing through this object, the task that awaits it
        through ``asyncio.shield`` or ``wait_for`` and holds (see
        :meth:`_awaited_by`); for a task of its own running only the release
        that no task is found to await, the object's only holder's (see the
        module's docstring). Otherwise the caller's: ``LockNotOwned``.

        A task that acquired, or tried to, through this object is a task of
        its own whatever awaits it: its release is its own. Between a parent
        and a child task it awaits through ``shield(task)`` (or ``wait_for``
        before 3.12) only asyncio's own callbacks are seen, as for a clean-up
        coroutine that ``shield`` runs in a task for its caller, and the
        child's release ended the parent's hold::

            task A   lock.acquire() ... await asyncio.shield(create_task(child()))
            child    lock.acquire(blocking=False) -> False; finally: release()
                     ended A's hold: the key deleted, A still inside

        (A child that never tried to acquire through the object cannot be
        told from such a clean-up coroutine: its release is still its
        awaiting task's, as documented.)"""
        task = _task_owner()
        if task is None or self._mine(task) or task in self._acquirers:
            return task
        alone = _runs_alone(task, frame)
        holder, found = self._awaited_by(task, alone)
        if holder is not None:
            return holder
        if found or not alone:
            # The caller, and the tasks awaiting it, hold nothing through this
            # object: LockNotOwned, as for any release by a non-holder.
            return task
        holders = [owner for owner, mine in list(self._holds.items()) if mine]
        if len(holders) > 1:
            raise RuntimeError(
                f"lock {self.name!r}: {what}() runs in a task of its own which no task "
                f"is found to await (not awaited at once), and {len(holders)} tasks "
                f"hold it through this object: whose hold it is for cannot be known, "
                f"nothing was {'released' if what == 'release' else 'extended'}. Await "
                f"{what}() directly in the task that holds it (or await the task running "
                f"it at once, as asyncio.shield(lock.{what}()) does)")
        return holders[0] if holders else task

    async def locked(self) -> bool:
        return bool(await self._proto.locked())

    async def acquire(self, blocking: bool = True,
                      timeout: float | None | EllipsisType = ...) -> bool:
        owner = self._acquiring_owner(inspect.currentframe())
        self._acquirers.add(owner)
        hold, wait = self._enter(blocking, timeout, owner)
        if hold is not None:
            return True
        lock = self._make()
        if not await lock.acquire(timeout=wait):
            self.retry_after = lock.retry_after
            return False
        self._took(lock, owner)
        return True

    async def release(self) -> None:
        """End one acquisition of this task's (see :meth:`_releasing_owner` for
        a release run in a task of its own); the last one releases on the
        nodes (and may raise ``LockLost``, as :meth:`AsyncLock.release` does)."""
        await self._release(self._releasing_owner(inspect.currentframe(), "release"))

    async def _release(self, owner: object | None, hold: Hold | None = None) -> None:
        """End one acquisition of ``owner``'s: of ``hold`` (an ``async
        with``'s own) or else the innermost; release on the nodes if last."""
        released = self._leave(owner, hold)
        if released is not None:
            await released.lock.release()

    async def extend(self, ttl: float | EllipsisType = ...) -> None:
        """Extend this task's hold, as :meth:`AsyncLock.extend` does."""
        owner = self._releasing_owner(inspect.currentframe(), "extend")
        await self._innermost(owner).lock.extend(ttl)

    async def __aenter__(self) -> "AsyncReentrantLock":
        if not await self.acquire():
            raise self._busy()
        task = _task_owner()  # acquire() refuses outside a task
        if task is not None:
            self._entered[task] = self._entered.get(task, 0) + 1
            self._record_entry(inspect.currentframe(), task)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        owner, hold = self._exiting_owner(inspect.currentframe())
        if owner is None or not self._mine(owner):
            return  # released inside the block already (or its task is done: its holds went)
        try:
            await self._release(owner, hold)
        except LockLost:
            if exc_type is None:
                raise

    def _left(self, owner: object) -> object:
        count = self._entered.get(owner, 0)
        if count > 1:
            self._entered[owner] = count - 1
        else:
            self._entered.pop(owner, None)
        return owner

    def _exiting_owner(self, frame: Any) -> tuple[object | None, Hold | None]:
        """Whose ``async with`` this exit ends, and its hold: the task that
        entered it in this very frame (recorded by ``__aenter__``, innermost
        first: see :meth:`_record_entry`), whatever task runs the exit, and
        the hold it entered, nothing else; else the caller's task's innermost
        when it entered one (or holds through this object); else, as for a
        release, the task awaiting it through ``shield`` or ``wait_for`` that
        entered one. (None, None): nothing to end.

        An async generator holding the lock across a ``yield`` and abandoned
        is closed by the event loop's finalizer hook, whose ``aclose()`` runs in
        a new task holding nothing: the exit returned at once, nothing was
        released, and the key stayed held (renewed while the enterer's task
        lived, then expiring within a lease), where a plain alock releases::

            task A   async for row in rows(): break     # rows() inside async with
            loop     aclose() in a new task: __aexit__ holds nothing: returned
            ...      the key stays held while A lives

        The exit is matched to its enterer by the frame, never guessed: "the
        only task inside" (an earlier form) ended another task's hold when a
        generator was finalized late::

            task A   iterates rows(), breaks; the generator is kept by a cycle
            task A   ends: its hold goes with it
            task B   enters async with (the key expired: B's now)
            gc       frees the generator: aclose() in a new task; its exit
                     took "the only task inside", B, and ended B's hold
                     while B was inside: two holders

        An enterer that is done (its holds went with it) has nothing to end."""
        claimed = self._claim_entry(frame)
        if claimed is not None:
            enterer, hold = claimed
            if enterer is None or enterer.done():
                return None, None
            self._left(enterer)
            if hold is None or not any(held is hold for held in self._mine(enterer)):
                # Released inside the block; re-acquired there by hand by its
                # own task, the exit ends that (see ReentrantLock._exiting_at).
                if enterer is _task_owner() and self._unentered(enterer):
                    return enterer, None
                return None, None
            return enterer, hold
        task = _task_owner()
        if task is None:
            return None, None
        if self._entered.get(task) or self._mine(task):
            # An ``__aexit__`` called by hand (or a block's whose record went):
            # a hold of the task's that no open block of its is on, never
            # a block's (see ReentrantLock._hand_hold).
            hand = self._hand_hold(task)
            if self._entered.get(task):
                self._left(task)
            return (task, hand) if hand is not None else (None, None)
        if task in self._acquirers:  # a task of its own (see :meth:`_releasing_owner`)
            return None, None
        holder, _ = self._awaited_by(task, _runs_alone(task, frame))
        if holder is not None and self._entered.get(holder):
            return self._left(holder), None
        return None, None
