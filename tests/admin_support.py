"""Helpers for the admin "Locks" page tests: a lock held by another process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager

HOLDER = textwrap.dedent("""
    import os, sys, threading
    from django_redlock import LockManager
    urls, name = sys.argv[1].split(","), sys.argv[2]
    threading.Timer(60, os._exit, args=(3,)).start()   # never outlive a broken test
    manager = LockManager(urls, ttl=60, auto_renew=False, node_timeout=0.5)
    lock = manager.lock(name, label="nightly-import")
    if not lock.acquire(timeout=5):
        sys.exit(2)
    print(lock.fence, flush=True)
    sys.stdin.readline()                                # until the test closes stdin
    os._exit(0)
""")


@contextmanager
def held_elsewhere(urls: list[str]) -> Iterator[Callable[[str], int]]:
    """``hold(name) -> fence``: the lock is taken by a separate process (killed at exit)."""
    procs: list[subprocess.Popen[str]] = []

    def hold(name: str) -> int:
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, ",".join(urls), name],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.strip().isdigit():
            proc.kill()
            raise AssertionError(f"holder did not get {name!r}: {proc.communicate(timeout=10)}")
        return int(line)

    try:
        yield hold
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate(timeout=10)
