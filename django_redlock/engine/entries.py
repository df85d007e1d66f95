"""Which entry of a lock object ends which hold: the records of its blocks
(``with`` / ``async with``) and of its entries by hand (``ExitStack``,
``__enter__()``), read by the exit to tell which hold it ends.

(A mixin of :class:`~.protocol.LockBase`: the records live on the lock
object, beside its hold number, and nothing here does I/O.)

One object may have two entries open: a module-level lock entered by two
threads or tasks, a generator suspended inside ``with LOCK`` while the code
goes on. Once the first entry's lease ran out, the object may be acquired
again; that first entry's exit ended the new hold, and a rival got in while
its holder was inside::

    thread A   with LOCK: hold 1 ... its lease runs out (lock_lost)
    thread B   with LOCK: hold 2 (acquired anew), writes
    thread A   leaves: release() ended hold 2
    rival      acquires: two holders, B still inside

So each entry is recorded with the hold it ends, and its exit ends that
hold or none (``LockLost`` when it lapsed and a newer one began). A
statement's block is recorded by its frame (:mod:`.blocks` tells the
statement's frame); an entry by hand by its entrant (the exit stack, else
the thread or task). A hold taken by ``acquire()`` from inside an open
entry becomes that entry's to end.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
import weakref
from asyncio.events import _get_running_loop
from typing import Any

from .awaits import ASYNCIO_DIR
from .blocks import hand_entrant, hand_exit_stack, helper_callers, is_stack_key


class _Block:
    """A ``with`` block a statement entered on a lock object
    (``LockBase._record_block``): the code its frame runs, the hold its exit
    ends (0: released by hand, nothing to end), that hold's fence, and the
    statement frames of the callers of the ``@contextmanager`` helpers it
    runs in, as (id, code) pairs (``blocks.helper_callers``)."""

    __slots__ = ("code", "hold", "fence", "callers", "line")

    def __init__(self, code: Any, hold: int, fence: int,
                 callers: "tuple[tuple[int, Any], ...]", line: int = 0) -> None:
        self.code, self.hold, self.fence, self.callers = code, hold, fence, callers
        #: The line of the statement (its exit runs at that line, 3.10 to
        #: 3.13): an ``__exit__`` called by hand elsewhere in the frame is not it.
        self.line = line


class _HandEntry:
    """An entry no statement made (``ExitStack.enter_context(L)``,
    ``L.__enter__()``), passed to the acquire as its block: ``key`` what
    its record is kept for (the exit stack, else the thread or task),
    ``frame`` the frame that entered it."""

    __slots__ = ("key", "frame")

    def __init__(self, key: Any, frame: Any) -> None:
        self.key, self.frame = key, frame


class _HandRecord(_Block):
    """The record of an entry by hand: a block's, with ``code`` None and no
    ``callers`` (an entry by hand adopts nothing), and the frame that made
    the entry as (id, code) in ``made_in`` ((0, None): asyncio's own).

    The frame is not held: a record holding it kept its locals alive, and
    with them the object whose ``__del__`` or generator ``finally`` was to
    make the exit (a leak, renewed for good). Its address alone may be a
    later frame's, of the same code (``Job.start()`` returned, and another
    thread's ``start()``, or a shared ``call(fn)`` helper, stands there), so
    a match by address only ever chooses among entries the exit may take
    anyway (:meth:`EntryRecords._least`), never makes one takeable."""

    __slots__ = ("made_in",)

    def __init__(self, hold: int, fence: int, made_in: "tuple[int, Any]") -> None:
        super().__init__(None, hold, fence, ())
        self.made_in = made_in


#: Past this many entries by hand of one entrant of one object, the oldest
#: released by hand goes (a loop that enters by hand and releases by hand
#: keeps no more); an entry not released is kept (dropped, its exit took
#: another entry for its own), up to HAND_ENTRIES_MAX, past which the oldest goes.
HAND_ENTRIES_KEPT = 16
HAND_ENTRIES_MAX = 1024
#: Past this many entrants recorded on one object, those gone are dropped
#: when a new one comes (threads of a pool that ended, stacks collected).
HAND_ENTRANTS_KEPT = 64


def _nobody() -> None:
    """The entrant of entries whose entrant is gone (see _record_hand)."""
    return None


_orphans = itertools.count(-1, -1)


def _next_orphan() -> int:
    """A key for a gone entrant's entries: negative, never an id()."""
    return next(_orphans)


class EntryRecords:
    """The records of a lock object's open entries, and how an exit finds
    its own (:class:`~.protocol.LockBase` holds the state they refer to)."""

    _blocks: "dict[int, list[_Block]] | None"
    _hand: "dict[int, tuple[Any, list[_HandRecord]]] | None"
    _hold_no: int
    fence: int
    #: Entries by hand released by hand whose records were dropped (the
    #: bounds below), their exits still to come: each such exit takes one,
    #: as it took its record, and ends nothing. Dropped without a count,
    #: such an exit found no record of its own and took the live hold's
    #: (or, none left, ended the current hold): another holder's, while it
    #: was inside (review 8)::
    #:
    #:     thread A   17 x (L.__enter__(); L.release())  -> the oldest record goes
    #:     thread B   with L: a new hold
    #:     thread A   17 x L.__exit__(): the last one ended B's hold
    #:     rival      acquires: two holders, B still inside
    _dropped_released = 0

    def _record_block(self, block: Any) -> None:
        """The hold just entered (``_enter_hold``, in the same critical
        section: nothing runs between the grant and this) is the block's
        whose statement runs in frame ``block``; None: taken by hand, and
        it becomes the hold of the open blocks on the acquiring stack; a
        :class:`_HandEntry`: recorded for its entrant. An entry, by a
        statement or by hand, is its own exit's to end, never adopted by
        another block (``s1.enter_context(L)``, the lease ran out,
        ``s2.enter_context(L)`` in the same frame: closing ``s1`` ended
        ``s2``'s hold)."""
        blocks = self._blocks
        if block is None:
            if blocks:  # (entries by hand adopt nothing: see _adopt_on)
                self._adopt_blocks(sys._getframe(2))
        elif type(block) is _HandEntry:
            self._record_hand(block)
        else:
            if blocks is None:
                blocks = self._blocks = {}
            blocks.setdefault(id(block), []).append(
                _Block(block.f_code, self._hold_no, self.fence, helper_callers(block),
                       block.f_lineno))

    # -- entries by hand (engine/blocks.py has the timeline) ------------------
    def _entrant(self, own: Any = None) -> Any:
        """Who enters this object by hand when no exit stack does: the
        running asyncio task (a sync lock entered inside a coroutine: the
        tasks of one loop share its thread), else the calling thread
        (AsyncLock: the task; None when there is none)."""
        if _get_running_loop() is not None:
            try:
                task = asyncio.current_task()
            except RuntimeError:
                task = None
            if task is not None:
                return task
        return threading.current_thread()

    def _hand_entry(self, caller: Any, own: Any = None) -> "_HandEntry | None":
        """The block to pass the acquire of an entry no statement made, its
        ``__enter__`` called in frame ``caller``: recorded for its exit
        stack, or its thread or task (None: no entrant; the exit ends the
        current hold, as before entries by hand were kept). ``own``: the
        frame of ``__aenter__`` (see AsyncLock._entrant)."""
        found = hand_entrant(caller)
        if found is not None:
            return _HandEntry(found[0], found[1])
        entrant = self._entrant(own)
        if entrant is None:
            return None
        # A task that runs the entry alone (gather(L.__aenter__()), a task
        # made by wait_for / shield): its caller is asyncio's own frame,
        # shared by every task step and no frame of the entrant's.
        mine = caller is not None and not caller.f_code.co_filename.startswith(ASYNCIO_DIR)
        return _HandEntry(entrant, caller if mine else None)

    def _hand_entries(self, key: Any) -> "list[_HandRecord] | None":
        """Entrant ``key``'s open entries by hand (None: none recorded; an
        entry of a gone entrant whose id ``key`` reuses is not its)."""
        found = self._hand.get(id(key)) if self._hand else None
        return found[1] if found is not None and found[0]() is key else None

    def _record_hand(self, entry: "_HandEntry") -> None:
        hand = self._hand
        if hand is None:
            hand = self._hand = {}
        entries = self._hand_entries(entry.key)
        if entries is None:
            earlier = hand.pop(id(entry.key), None)
            if earlier is not None and earlier[1]:
                # A gone entrant's address, reused: its entries stay open, kept
                # apart (dropped, the exit of one of them found only the new
                # entrant's entry to take, and ended it under its holder).
                hand[_next_orphan()] = (_nobody, earlier[1])
            if len(hand) >= HAND_ENTRANTS_KEPT:  # gone entrants with nothing open go
                for at, (ref, records) in list(hand.items()):
                    if ref() is None and all(record.hold == 0 for record in records):
                        hand.pop(at, None)
                        self._count_dropped(len(records))
            entries = []
            hand[id(entry.key)] = (weakref.ref(entry.key), entries)
        frame = entry.frame
        made_in = (0, None) if frame is None else (id(frame), frame.f_code)
        entries.append(_HandRecord(self._hold_no, self.fence, made_in))
        if len(entries) > HAND_ENTRIES_KEPT:
            released = [i for i, record in enumerate(entries) if record.hold == 0]
            if released or len(entries) > HAND_ENTRIES_MAX:
                del entries[released[0] if released else 0]
                if released:
                    self._count_dropped(1)

    def _count_dropped(self, count: int) -> None:
        """``count`` records of entries released by hand were dropped (see
        ``_dropped_released``; bounded as the records are)."""
        self._dropped_released = min(self._dropped_released + count, HAND_ENTRIES_MAX)

    def _hand_block_of(self, caller: Any, own: Any = None) -> "tuple[int, int] | None":
        """For an exit no statement's record claimed, run in frame
        ``caller`` (``own``: the frame of ``__exit__`` / ``__aexit__``):
        (the hold it ends, its fence), taken off a record, None when no
        entry by hand is recorded (the exit ends the current hold, as before
        entries were kept). An exit stack's own exit takes the stack's
        innermost entry (a stack leaves its entries in reverse, exactly);
        any other exit, the entry whose exit ends the least
        (:meth:`_least`)."""
        stack = hand_exit_stack(caller)
        if stack is not None:
            found = self._hand_record_of(stack)
            if found is not None:
                return found
        return self._least(caller, self._entrant(own))

    def _least(self, caller: Any, entrant: Any) -> "tuple[int, int] | None":
        """The entry by hand (not an exit stack's) that an exit run in frame
        ``caller``, for ``entrant``, takes: the one whose exit ends the
        least, taken off the record. First an entry whose lease ran out
        (``LockLost``, nothing ended), then one released by hand (nothing
        to end), and only then one on the current hold; within each, one
        made in ``caller``, then one of ``entrant``'s, then any (the oldest;
        the innermost on the current hold).

        Why the least, before any match: an exit by hand says nothing of
        the entry it is for, and a frame's address or a thread is a guess
        (a worker of a pool leaves another worker's entry; a returned
        frame's address is the next frame's). Taking an entry on the
        current hold for a lapsed one ends a holder's hold while it is
        inside (two holders); taking a lapsed one for the live one only
        leaves the live hold held until the next exit, or its lease, ends
        it::

            worker 1   job A: L.__enter__() ... its lease runs out
            worker 2   job B: L.__enter__(), a new hold
            worker 2   job A's stop: L.__exit__(), worker 2's entry: B's
            rival      acquires: two holders, B still inside
        """
        here = (id(caller), caller.f_code) if caller is not None else None
        # Run under the lock's _io (Lock.__exit__): two exits of two threads
        # chose the same record and the second popped the live one beside
        # it, and a grant between the read of the hold number and the walk
        # made the new hold's record look lapsed (review 8). A garbage
        # collection inside the walk may run another exit of this object in
        # this thread (_io is reentrant): the record chosen is taken by
        # identity, and chosen again if that exit took it first.
        for _ in range(8):
            hold = self._hold_no
            best: "tuple[tuple[int, int, int], int, list[_HandRecord], _HandRecord] | None" = None
            for key, (ref, records) in list(self._hand.items()) if self._hand else ():
                owner = ref()  # None: gone (a child task done), its entries still open
                if is_stack_key(owner):
                    continue
                for i, record in enumerate(list(records)):
                    made_here = record.made_in == here
                    kind = 2 if record.hold == hold else 0 if record.hold not in (0, hold) else 1
                    near = 0 if made_here else 1 if owner is not None and owner is entrant else 2
                    # The oldest of a kind, but the innermost on the current hold.
                    rank = (kind, near, -i if kind == 2 else i)
                    if best is None or rank < best[0]:
                        best = (rank, key, records, record)
            if self._dropped_released and (best is None or best[0][0] == 2):
                # A record dropped by the bounds, released by hand: after every
                # record left of its kind, before the current hold's.
                self._dropped_released -= 1
                return 0, 0
            if best is None:
                return None
            _, key, records, record = best
            for at, kept in enumerate(records):
                if kept is record:
                    del records[at]
                    if not records and self._hand and self._hand.get(key, (None, None))[1] \
                            is records:
                        del self._hand[key]
                    return record.hold, record.fence
        return None

    def _exit_by_hand_in_block(self, caller: Any) -> bool:
        """Whether the exit run in frame ``caller`` is an ``__exit__`` called
        by hand while a ``with`` block of that frame is open: the
        statement's own exit runs at its line (3.10 to 3.13), a call by
        hand at another. Such an exit never takes the block's record: it
        took it, the statement's own exit later found none and ended the
        current hold, another's newer one (or, with an entry by hand open,
        the call by hand ended the block's hold under its body)."""
        if caller is None or not self._blocks:
            return False
        entries = self._blocks.get(id(caller))
        if not entries:
            return False
        return entries[-1].code is caller.f_code and entries[-1].line != caller.f_lineno

    def _hand_record_of(self, key: Any) -> "tuple[int, int] | None":
        """(hold, fence) of ``key``'s innermost entry by hand (an exit
        stack's), taken off the record; None when it has none."""
        entries = self._hand_entries(key)
        if not entries:
            return None
        entry = entries.pop()
        if not entries:
            self._hand.pop(id(key), None)  # type: ignore[union-attr]
        return entry.hold, entry.fence

    def _adopt_blocks(self, frame: Any) -> None:
        """A hold taken by hand in ``frame`` (or deeper): the open blocks of
        this object whose frames are on that stack end it at their exit, and
        so do those entered in a ``@contextmanager`` helper whose caller's
        ``with`` is on it (the helper's own frame is suspended meanwhile)."""
        on_stack: dict[int, Any] = {}
        for _ in range(1000):  # bounded: a deep stack adopts from its top 1000 frames
            if frame is None:
                break
            on_stack[id(frame)] = frame
            frame = frame.f_back
        self._adopt_on(on_stack)

    def _adopt_on(self, frames: "dict[int, Any]") -> None:
        """The current hold becomes the hold of the open blocks whose frame,
        or whose helper's caller, is one of ``frames`` (id -> the frame)."""
        hold = self._hold_no

        def runs(at: int, code: Any) -> bool:
            frame = frames.get(at)
            return frame is not None and frame.f_code is code

        for key, entries in list(self._blocks.items()) if self._blocks else ():
            for entry in entries:
                if entry.hold == hold:
                    continue
                if runs(key, entry.code) or any(runs(at, code) for at, code in entry.callers):
                    entry.hold, entry.fence = hold, self.fence
        # Entries by hand adopt nothing: the frame that made one may have
        # returned, and a frame of the same code at its address (a shared
        # ``call(fn)`` helper, in the same thread) is no proof that the
        # acquire runs inside the entry; adopted, the hold was ended by the
        # entry's exit under the job that took it. Such a hold is its
        # taker's to release (its entry's exit raises LockLost if lapsed).

    def _unrecord_block(self, block: Any, hold: int) -> None:
        """Drop the record ``_record_block`` made for hold ``hold``, granted
        to the block in frame ``block``: the acquire failed after it
        (interrupted, cancelled; the hold was taken back), and no exit will
        claim it (a module-level lock's records grew by one per cancelled
        request)."""
        if type(block) is _HandEntry:
            hand = self._hand_entries(block.key)
            if hand and hand[-1].hold == hold:
                hand.pop()
            return
        entries = self._blocks.get(id(block)) if self._blocks and block is not None else None
        if entries and entries[-1].code is block.f_code and entries[-1].hold == hold:
            entries.pop()
            if not entries:
                self._blocks.pop(id(block), None)  # type: ignore[union-attr]

    def _mark_released(self, hold: int) -> None:
        """Hold ``hold`` ends by a release: the open blocks on it have nothing
        left to end (0), and leave whatever the object holds later alone,
        without ``LockLost`` (released by hand inside the block: nothing was
        lost)."""
        hand = [entries for _, entries in list(self._hand.values())] if self._hand else []
        for entries in [*(self._blocks.values() if self._blocks else ()), *hand]:
            for entry in entries:
                if entry.hold == hold:
                    entry.hold = 0

    def _block_of(self, caller: Any) -> "tuple[int, int] | None":
        """For a block's exit run in frame ``caller``: (the hold it ends, its
        fence), taken off the record, the hold 0 when it was released by hand
        (nothing left to end); None when no statement entered it here
        (``ExitStack``, ``__enter__()`` by hand: see _hand_block_of)."""
        if type(caller) is _HandEntry:
            return self._hand_record_of(caller.key)
        blocks = self._blocks
        if not blocks or caller is None:
            return None
        key = id(caller)
        entries = blocks.get(key)
        if not entries:
            return None
        entry = entries.pop()
        if not entries:
            blocks.pop(key, None)
        if entry.code is not caller.f_code:
            return None  # an id reused
        return entry.hold, entry.fence

    def _exit_record(self, caller: Any, own: Any = None) -> "tuple[int, int] | None":
        """The (hold, fence) the exit run in frame ``caller`` ends, taken off
        its record (``own``: the frame of ``__exit__`` / ``__aexit__``); None
        when no record is found for it (the exit ends the current hold).
        A block's record first, unless the exit is an ``__exit__`` called by
        hand for an entry by hand of the same frame."""
        block = None
        if self._blocks and self._exit_by_hand_in_block(caller):
            # Never the block's own exit: its record stays for that exit.
            if self._hand or self._dropped_released:
                block = self._hand_block_of(caller, own)
            if block is None:
                entry = self._blocks[id(caller)][-1]
                block = (entry.hold, entry.fence)  # read, not taken
            return block
        if self._blocks:
            block = self._block_of(caller)
        if block is None and (self._hand or self._dropped_released):
            block = self._hand_block_of(caller, own)
        return block
