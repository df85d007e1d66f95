"""Which ``with`` (``async with``) statement entered a lock: its blocks told
apart by the frame they run in.

A block's exit is a call of ``__exit__`` / ``__aexit__`` and says nothing of
the block: one lock object may have two open at once (a module-level lock
entered by two threads, a generator suspended inside ``with LOCK`` while
the code goes on), and the exit of one ended the other's hold. The frame
that runs the statement does tell them apart, for as long as the block is
open; the reentrant locks (``reentrant.py``) and the plain ones
(``protocol.LockBase._record_block``) record their blocks by it.

A statement's own entry is recorded by its frame. ``L.__enter__()`` called
by hand and ``ExitStack.enter_context(L)`` are left through another frame
(or by ``release()``), so their entry could never be claimed that way: the
plain locks record those for their entrant instead (the exit stack, else
the thread or task; see the end of this module).
"""

from __future__ import annotations

import collections
import contextlib
import dis
from typing import Any

#: The instructions a ``with`` / ``async with`` statement enters its context
#: manager with (3.10: ``SETUP_WITH``; 3.11-3.13: ``BEFORE_WITH``); an
#: ``async with`` awaits ``__aenter__`` in the few that follow
#: ``BEFORE_ASYNC_WITH`` (:func:`statement_entry_offsets`).
_WITH_OPS = frozenset({"SETUP_WITH", "BEFORE_WITH"})
_AWAIT_LOOP_OPS = frozenset({"GET_AWAITABLE", "LOAD_CONST", "YIELD_FROM", "SEND", "YIELD_VALUE",
                             "RESUME", "JUMP_BACKWARD_NO_INTERRUPT", "END_SEND", "EXTENDED_ARG"})
#: id(code) -> (the code, kept so that its id is not reused; its offsets).
_entry_offsets: dict[int, tuple[Any, frozenset[int]]] = {}


def statement_entry_offsets(code: Any) -> frozenset[int]:
    """The offsets in ``code`` where a frame stands while a ``with`` or
    ``async with`` statement enters its context manager: where the caller of
    ``__enter__`` / ``__aenter__`` is when the call comes from the statement
    itself, and never when it comes by hand (``L.__enter__()``,
    ``ExitStack.enter_context(L)``: a call instruction). Computed once per
    code object. On an interpreter whose instructions are not these, no
    offset: no entry is recorded, and every exit is its caller's own (as
    before entries were kept)."""
    cached = _entry_offsets.get(id(code))
    if cached is not None and cached[0] is code:
        return cached[1]
    offsets: set[int] = set()
    start: int | None = None
    prefix: list[int] = []  # the EXTENDED_ARGs just before an instruction
    for ins in dis.get_instructions(code):
        if start is not None:
            if ins.opname in _AWAIT_LOOP_OPS:
                continue
            offsets.update(range(start, ins.offset))  # with their inline caches
            start = None
        if ins.opname in _WITH_OPS:
            # 3.10's SETUP_WITH takes the block's length: past 255 (a body of
            # some 85 statements) an EXTENDED_ARG comes first, and the frame
            # stands there while __enter__ runs.
            offsets.update(prefix)
            offsets.add(ins.offset)
        elif ins.opname == "BEFORE_ASYNC_WITH":
            start = ins.offset
        prefix = prefix + [ins.offset] if ins.opname == "EXTENDED_ARG" else []
    if len(_entry_offsets) > 4096:
        _entry_offsets.clear()
    found = frozenset(offsets)
    _entry_offsets[id(code)] = (code, found)
    return found


def entered_by_statement(caller: Any) -> bool:
    """Whether ``caller`` (the frame that called ``__enter__``, or that
    awaits ``__aenter__``) stands at a ``with`` / ``async with`` statement's
    entry: the block is left through this frame's exit."""
    return caller.f_lasti in statement_entry_offsets(caller.f_code)


_CONTEXTLIB_FILE = contextlib.__file__
_HELPER_ENTRIES = frozenset({"__enter__", "__aenter__"})


def helper_callers(block: Any) -> "tuple[tuple[int, Any], ...]":
    """For a block in a ``@contextmanager`` (``@asynccontextmanager``)
    helper (``with L: yield``) entered by its caller's ``with helper():``:
    the frames of those callers' statements, innermost first, as (id,
    code) pairs (a helper inside a helper: each level), else ``()``.

    While the caller's block runs, the helper's frame is suspended, on no
    stack; a hold its caller takes by hand is the helper's block's to end
    all the same (``LockBase._adopt_blocks``). Only callers that entered
    the helper by a statement count: a frame that entered it by hand
    (``ExitStack.enter_context``) returns at once, and its id went to the
    next frame made, of the same code (another stack's ``enter_context``),
    whose hold the helper's block then took for its own."""
    callers: list[tuple[int, Any]] = []
    frame = block
    for _ in range(16):  # helpers within helpers, bounded
        entry = frame.f_back
        if entry is None:
            break
        code = entry.f_code
        if code.co_name not in _HELPER_ENTRIES or code.co_filename != _CONTEXTLIB_FILE:
            break
        caller = entry.f_back
        if caller is None or not entered_by_statement(caller):
            break
        callers.append((id(caller), caller.f_code))
        frame = caller
    return tuple(callers)


# -- entries by hand: told apart by who entered them ------------------------
# ``ExitStack.enter_context(L)`` and ``L.__enter__()`` enter through a frame
# that returns at once, so the statement rule above cannot record them; their
# exit ended whatever the object held, and the two-holders timeline of
# ``protocol.LockBase._record_block`` stayed open through them:
#
#     thread A   stack.enter_context(LOCK): hold 1 ... its lease runs out
#     thread B   with LOCK: hold 2 (acquired anew), writes
#     thread A   stack.close(): ended hold 2
#     rival      acquires: two holders, B still inside
#
# So such an entry is recorded for its entrant: the exit stack that entered
# it (its exit comes through that stack, in whatever thread closes it), else
# the thread (the task, in asyncio) that entered it by hand. Its exit, from
# the same entrant, ends that hold or none.

_STACK_ENTRIES = frozenset({"enter_context", "enter_async_context"})
_STACK_EXITS = frozenset({"__exit__", "__aexit__"})
_STACKS = (contextlib.ExitStack, contextlib.AsyncExitStack)


def _stack_of(frame: Any, names: frozenset[str]) -> Any:
    """What stands for the ``contextlib`` exit stack whose method ``names``
    runs in ``frame`` (None: none runs there): its queue of exit callbacks,
    which ``pop_all()`` moves to the new stack it returns (the idiom that
    hands an entered lock on: ``return stack.pop_all()``), so an entry made
    on one is left by the other; the stack itself on a ``contextlib``
    without that queue."""
    code = frame.f_code
    if code.co_name not in names or code.co_filename != _CONTEXTLIB_FILE:
        return None
    stack = frame.f_locals.get("self")
    if not isinstance(stack, _STACKS):
        return None
    callbacks = getattr(stack, "_exit_callbacks", None)
    return stack if callbacks is None else callbacks


def hand_entrant(caller: Any) -> "tuple[Any, Any] | None":
    """For an entry no statement made, ``caller`` the frame that called
    ``__enter__`` (awaits ``__aenter__``): ``(the exit stack (see
    _stack_of), the frame that called its enter_context)`` when an exit
    stack entered it, else
    None (the caller's thread or task is the entrant, and ``caller`` the
    frame)."""
    stack = _stack_of(caller, _STACK_ENTRIES)
    if stack is None:
        return None
    return stack, caller.f_back


def hand_exit_stack(caller: Any) -> Any:
    """For an exit no statement's record claimed, ``caller`` the frame that
    called ``__exit__`` (awaits ``__aexit__``): the exit stack leaving it
    (see _stack_of), else None (the caller's thread or task leaves it)."""
    return _stack_of(caller, _STACK_EXITS)


def is_stack_key(key: Any) -> bool:
    """Whether an entrant key stands for an exit stack (see _stack_of)."""
    return isinstance(key, (collections.deque, *_STACKS))
