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
import inspect
import sys
import threading
import weakref
from asyncio.events import _get_running_loop
from typing import Any

from .awaits import ASYNCIO_DIR
from .blocks import hand_entrant, hand_exit_stack, helper_callers


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
    ``frame`` the frame that entered it, ``entrant`` the thread or task
    that did."""

    __slots__ = ("key", "frame", "entrant")

    def __init__(self, key: Any, frame: Any, entrant: Any) -> None:
        self.key, self.frame, self.entrant = key, frame, entrant


class _HandRecord(_Block):
    """The record of an entry by hand: a block's, with ``code`` None, its
    entering frame first among ``callers``, and a weak reference to the
    thread or task that entered (``entrant``): a hold taken by hand is
    adopted only by that entrant's entries (a frame of another thread may
    stand at the address and run the code of an entering frame that
    returned: ``Job.start()`` entered, ``Job.stop()`` leaves)."""

    __slots__ = ("entrant",)

    def __init__(self, hold: int, fence: int, callers: "tuple[tuple[int, Any], ...]",
                 entrant: Any) -> None:
        super().__init__(None, hold, fence, callers)
        self.entrant = entrant


#: Code flags of a frame that lives on while suspended (a generator, a
#: coroutine, an async generator): its address is not reused meanwhile.
_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _gone(entrant: Any) -> bool:
    """Whether the thread or task an entry by hand was made by (a weak
    reference to it) is gone: collected, ended, or done."""
    who = entrant() if entrant is not None else None
    if who is None:
        return True
    if isinstance(who, threading.Thread):
        return not who.is_alive()
    done = getattr(who, "done", None)
    return bool(done()) if done is not None else False


#: The most entries by hand kept for one entrant of one object (the oldest
#: go first: a loop that enters by hand and releases by hand keeps no more).
HAND_ENTRIES_KEPT = 16
#: Past this many entrants recorded on one object, those gone are dropped
#: when a new one comes (threads of a pool that ended, stacks collected).
HAND_ENTRANTS_KEPT = 64


class EntryRecords:
    """The records of a lock object's open entries, and how an exit finds
    its own (:class:`~.protocol.LockBase` holds the state they refer to)."""

    _blocks: "dict[int, list[_Block]] | None"
    _hand: "dict[int, tuple[Any, list[_HandRecord]]] | None"
    _hold_no: int
    fence: int

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
            if blocks or self._hand:
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
        entrant = self._entrant(own)
        found = hand_entrant(caller)
        if found is not None:
            return _HandEntry(found[0], found[1], entrant)
        if entrant is None:
            return None
        # A task that runs the entry alone (gather(L.__aenter__()), a task
        # made by wait_for / shield): its caller is asyncio's own frame,
        # shared by every task step and no frame of the entrant's.
        mine = caller is not None and not caller.f_code.co_filename.startswith(ASYNCIO_DIR)
        return _HandEntry(entrant, caller if mine else None, entrant)

    def _adopting_entrants(self) -> "tuple[Any, ...]":
        """Whose entries by hand may adopt a hold taken by ``acquire()`` now:
        the acquiring thread or task (AsyncLock: also the tasks awaiting it
        through ``wait_for`` / ``shield``)."""
        return (self._entrant(),)

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
            if len(hand) >= HAND_ENTRANTS_KEPT:  # entrants gone (threads, stacks) go
                for at, (ref, _) in list(hand.items()):
                    if ref() is None:
                        hand.pop(at, None)
            entries = []
            hand[id(entry.key)] = (weakref.ref(entry.key), entries)
        frame = entry.frame
        # The frame that entered it, and the statements that entered the
        # @contextmanager helpers it runs in (suspended while their callers run).
        callers = () if frame is None else ((id(frame), frame.f_code), *helper_callers(frame))
        entrant = None if entry.entrant is None else weakref.ref(entry.entrant)
        entries.append(_HandRecord(self._hold_no, self.fence, callers, entrant))
        if len(entries) > HAND_ENTRIES_KEPT:
            del entries[0]

    def _hand_block_of(self, caller: Any, own: Any = None) -> "tuple[int, int] | None":
        """For an exit no statement's record claimed, run in frame
        ``caller`` (``own``: the frame of ``__exit__`` / ``__aexit__``):
        (the hold it ends, its fence), taken off a record, None when no
        entry by hand is found for it (the exit ends the current hold, as
        before entries were kept). In order:

        - the innermost entry of its exit stack (if one entered it there);
        - an entry made in ``caller`` itself, whoever made it (a generator
          that entered by hand, closed by a collection in another thread:
          the collecting thread made no entry, and its exit ended another
          thread's newer hold);
        - the innermost entry of its thread or task;
        - an entry of another entrant: one whose hold lapsed, when the
          current hold is another block's or entry's (a task that entered
          through ``gather(L.__aenter__())`` and left from its parent,
          which made no entry: its exit ended the newer hold), else one on
          the current hold (an entry left from another thread).
        """
        stack = hand_exit_stack(caller)
        if stack is not None:
            found = self._hand_record_of(stack)
            if found is not None:
                return found
        found = self._hand_record_made_in(caller, own)
        if found is not None:
            return found
        found = self._hand_record_of(self._entrant(own), caller)
        if found is not None:
            return found
        return self._orphan_exit()

    def _made_in(self, caller: Any, own: Any) -> "Any":
        """A test of whether a record of an entry by hand was made in frame
        ``caller``: its entering frame's id and code, and made by the
        exit's own entrant, unless ``caller`` runs a generator or coroutine.
        An ordinary frame that made an entry may have returned, and its
        address gone to a frame of another thread running the same code (a
        shared ``call(fn)`` helper: another thread's exit there ended this
        thread's newer hold). A generator's frame lives while it is
        suspended, so its exit, run by a collection in any thread, is its
        own entry's."""
        mine = (id(caller), caller.f_code)
        if caller.f_code.co_flags & _SUSPENDABLE:
            return lambda record: record.callers[:1] == (mine,)
        entrant = self._entrant(own)
        return lambda record: (record.callers[:1] == (mine,) and record.entrant is not None
                               and record.entrant() is entrant)

    def _hand_record_made_in(self, caller: Any, own: Any = None) -> "tuple[int, int] | None":
        """(hold, fence) of the innermost entry by hand made in frame
        ``caller`` (see _made_in), taken off the record; None if none."""
        if caller is None or not self._hand:
            return None
        made_here = self._made_in(caller, own)
        for key, (_, records) in list(self._hand.items()):
            for i in range(len(records) - 1, -1, -1):
                if made_here(records[i]):
                    record = records.pop(i)
                    if not records:
                        self._hand.pop(key, None)
                    return record.hold, record.fence
        return None

    def _orphan_exit(self) -> "tuple[int, int] | None":
        """The entry by hand an exit that matched none of its own is taken
        for (see _hand_block_of), taken off the record; None if none (the
        exit ends the current hold). In order:

        - the oldest entry whose lease ran out and whose entrant is gone (a
          task done, a thread ended): ``gather(L.__aenter__())`` left by the
          parent, whose child task made the entry;
        - the innermost entry on the current hold: an entry left from
          another thread (it took a gone entrant's stale entry for its own,
          raised ``LockLost`` and left its hold held);
        - the oldest lapsed entry, while a ``with`` block is on the current
          hold (never this exit's: a statement's exit comes through its
          frame)."""
        hand = list(self._hand.items()) if self._hand else []
        if not hand:
            return None
        hold = self._hold_no
        lapsed = [(key, records, i) for key, (_, records) in hand
                  for i, record in enumerate(records) if record.hold not in (0, hold)]
        gone = [at for at in lapsed if _gone(at[1][at[2]].entrant)]
        on_hold = [(key, records, i) for key, (_, records) in hand
                   for i, record in enumerate(records) if record.hold == hold]
        blocks = list(self._blocks.values()) if self._blocks else []
        if gone:
            key, records, i = gone[0]
        elif on_hold:
            key, records, i = on_hold[-1]
        elif lapsed and any(entry.hold == hold for entries in blocks for entry in entries):
            key, records, i = lapsed[0]
        else:
            return None
        record = records.pop(i)
        if not records:
            self._hand.pop(key, None)  # type: ignore[union-attr]
        return record.hold, record.fence

    def _hand_exit_here(self, caller: Any, own: Any = None) -> bool:
        """Whether the exit run in frame ``caller`` is an ``__exit__`` called
        by hand for an entry by hand made in that frame, while a ``with``
        block of the same frame is open: the statement's exit runs at its
        own line, a call by hand at another (it took the block's record:
        ``L.__enter__()``, the lease ran out, ``with L:``, then
        ``L.__exit__()`` inside the body ended the block's hold)."""
        if caller is None or not self._hand:
            return False
        made_here = self._made_in(caller, own)
        if not any(made_here(record)
                   for _, records in list(self._hand.values()) for record in records):
            return False
        entries = self._blocks.get(id(caller)) if self._blocks else None
        return not (entries and entries[-1].code is caller.f_code
                    and entries[-1].line == caller.f_lineno)

    def _hand_record_of(self, key: Any, caller: Any = None) -> "tuple[int, int] | None":
        """(hold, fence) of an entry by hand of ``key``'s, taken off the
        record; None when it has none. The innermost entry made in frame
        ``caller`` if any (two generators of one thread, each entering by
        hand, left out of order: the innermost of the thread's was the
        other generator's), else the innermost."""
        entries = self._hand_entries(key)
        if not entries:
            return None
        at = len(entries) - 1
        if caller is not None:
            mine = (id(caller), caller.f_code)
            for i in range(at, -1, -1):
                if entries[i].callers[:1] == (mine,):
                    at = i
                    break
        entry = entries.pop(at)
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
            on_stack[id(frame)] = frame.f_code
            frame = frame.f_back
        self._adopt_on(on_stack)

    def _adopt_on(self, frames: "dict[int, Any]") -> None:
        """The current hold becomes the hold of the open blocks whose frame,
        or whose helper's caller, is one of ``frames`` (id -> its code)."""
        hold = self._hold_no
        for key, entries in list(self._blocks.items()) if self._blocks else ():
            for entry in entries:
                if entry.hold == hold:
                    continue
                if frames.get(key) is entry.code or any(
                        frames.get(at) is code for at, code in entry.callers):
                    entry.hold, entry.fence = hold, self.fence
        hand = list(self._hand.values()) if self._hand else ()
        entrants = self._adopting_entrants() if hand else ()
        for _, records in hand:
            for record in records:  # entered by hand: by this entrant, in a frame on the stack
                if (record.hold != hold and record.entrant is not None
                        and any(record.entrant() is e for e in entrants) and any(
                            frames.get(at) is code for at, code in record.callers)):
                    record.hold, record.fence = hold, self.fence

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
        if self._hand and self._hand_exit_here(caller, own):
            block = self._hand_record_made_in(caller, own)
        if block is None and self._blocks:
            block = self._block_of(caller)
        if block is None and self._hand:
            block = self._hand_block_of(caller, own)
        return block
