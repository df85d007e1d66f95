"""``read_lock(name)`` / ``write_lock(name)``: many readers or one writer.

A read-write lock is a plain lock in every respect but one: its key on each
node is a hash with one field per holder (rw_common.lua), and the holder's
token starts with its mode, ``r.`` or ``w.``, which selects the scripts
(rw_acquire, rw_release, rw_extend, and the renewal batch's branch) in every
round. Quorum, validity minus drift, renewal with ``LockLost``, fencing,
waiting by release notice and the asyncio twins are the plain lock's own code.

Why a majority is enough: every node refuses a writer while another holder
has the key there, and a reader while a writer has it. A writer and any other
holder each need a majority, and two majorities share a node, which refused
one of them. (A counting semaphore is different: see the semaphore docs.)

Why readers queue behind a waiting writer: without it, readers arriving one
after the other keep the lock shared forever::

    R1 holds ---------- R2 joins ------- R1 leaves ---- R3 joins ---- ...
    W  waits ........................................................ forever

So a reader that finds a writer in line before it (the waiter queue of the
key, on that node) queues too, although the readers holding the lock would let
it in. When the last holder leaves, the first in line is woken; when that is a
reader, so are the readers right behind it, up to the first writer: they share
the lock. A reader woken by name goes ahead of the writers behind it.

A writer's fence exceeds every earlier reader's and writer's: all holders of
one name take their fences from the same counter (fence_issue.lua).

One name is one kind of lock: ``lock("x")`` while ``read_lock("x")`` holds it
(or the other way round) raises :class:`~django_redlock.LockKindConflict` at
once, instead of waiting for a lock that the other kind never frees for it.
"""

from __future__ import annotations

from .aio import AsyncLock
from .lock import Lock
from .rounds import READ_PREFIX, WRITE_PREFIX

__all__ = ["AsyncReadLock", "AsyncWriteLock", "ReadLock", "WriteLock"]


class ReadLock(Lock):
    """A shared hold of ``name``: other readers may hold it too, no writer."""

    token_prefix = READ_PREFIX


class WriteLock(Lock):
    """The exclusive hold of ``name``: no reader, no other writer."""

    token_prefix = WRITE_PREFIX


class AsyncReadLock(AsyncLock):
    """The asyncio twin of :class:`ReadLock`."""

    token_prefix = READ_PREFIX


class AsyncWriteLock(AsyncLock):
    """The asyncio twin of :class:`WriteLock`."""

    token_prefix = WRITE_PREFIX
