"""This process's id, read without a system call.

``os.getpid()`` is a system call (the C library no longer caches it), and the
hot path asks several times per acquire + release whether it still runs in the
process that opened its connections and took its locks (a forked child must
never use its parent's sockets, nor release its parent's locks). The id is
read once here and read again in a forked child by an ``os.register_at_fork``
hook, which the interpreter runs in the child before any other Python code
(``os.fork``, ``multiprocessing`` and Celery's ``billiard`` all fork that way).
"""

from __future__ import annotations

import os

_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


if hasattr(os, "register_at_fork"):  # no fork() without it (Windows)
    os.register_at_fork(after_in_child=_forked)


def getpid() -> int:
    """``os.getpid()``, kept current across ``fork()``."""
    return _pid
