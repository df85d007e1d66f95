"""``python -m bench.trace``: where a handoff's milliseconds go, step by step.

The handoff table gives one number per library: from ``release()`` in one
process to ``acquire()`` returning in another. This takes django-redlock's
apart on one node, with the waiting process instrumented, and measures in the
same run the two wake-ups it is made of:

``wake, direct``
    ``PUBLISH`` in one process, until a thread blocked in ``recv()`` on the
    subscribed socket in another process runs again: one idle process woken.
``wake, through a listener thread``
    the same notice read by a listener thread blocked in ``select()``, which
    sets a :class:`django_redlock.transport.notify.Flag` that the waiting
    thread sleeps on: one more thread woken. This was our mechanism until the
    waiting thread read its own notices; it stays as the yardstick of that hop.

Then the timeline of a real handoff (django-redlock, defaults, 1 node), each
mark counted from the holder calling ``release()``, p50 and p90 over the
samples, with python-redis-lock's total measured alternately in the same run.
The marks come from wrapping a few internal functions of the waiting process
(the notifier's read, the subscription's wait, the transport's send and round);
they are a diagnostic of the current code, not an API. A handoff in which the
release handed the lock over sends no acquire request: its two request rows
count only the handoffs that fell back to an attempt ("-" when none did).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from django_redlock.transport.resp import pack

from .libs import _connect
from .nodes import running_nodes
from .stats import percentile

GAP = (0.003, 0.013)  # the holder's random hold before release(): the waiter is idle
TIMEOUT = 10.0
HOLDER_SENT = "release request sent (holder)"
NOTICE_READ = "notice read"
WAITER_RUNS = "the wait returned"
ACQUIRE_SENT = "acquire request sent"
REPLY_READ = "acquire reply read"
RETURNED = "acquire() returned"
MARKS = [HOLDER_SENT, NOTICE_READ, WAITER_RUNS, ACQUIRE_SENT, REPLY_READ, RETURNED]


def _wrap(cls: Any, name: str, *, before: Callable[[], Any] | None = None,
          after: Callable[[], Any] | None = None) -> Any:
    """Replace ``cls.name`` by a wrapper that calls ``before``/``after`` around it;
    return the original (to put it back)."""
    original = getattr(cls, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before()
        result = original(*args, **kwargs)
        if after is not None:
            after()
        return result

    setattr(cls, name, wrapper)
    return original


# -- one idle wake-up, with and without the listener thread ------------------------
def _wake_subscriber(url: str, through_listener: bool, samples: int, ready: Any, out: Any) -> None:
    import selectors

    from django_redlock.transport.notify import Flag

    s = _connect(url)
    s.sendall(pack("SUBSCRIBE", "trace"))
    s.recv(1000)
    s.settimeout(TIMEOUT)  # every wait below is bounded
    woke: list[int] = []
    if through_listener:
        flag = Flag()

        def listener() -> None:
            sel = selectors.DefaultSelector()
            sel.register(s, selectors.EVENT_READ)
            for _ in range(samples):
                if not sel.select(TIMEOUT):
                    return  # the publisher is gone: the waiting thread times out too
                s.recv(1000)
                flag.set()

        threading.Thread(target=listener, daemon=True).start()
        ready.set()
        for _ in range(samples):
            if not flag.wait(TIMEOUT):
                break
            woke.append(time.monotonic_ns())
            flag.clear()
    else:
        ready.set()
        for _ in range(samples):
            s.recv(1000)
            woke.append(time.monotonic_ns())
    out.put(woke)


def _wake_us(url: str, through_listener: bool, samples: int, rng: random.Random) -> list[float]:
    ctx = mp.get_context("spawn")
    ready, out = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_wake_subscriber,
                       args=(url, through_listener, samples, ready, out), daemon=True)
    proc.start()
    try:
        if not ready.wait(TIMEOUT):
            raise RuntimeError("the subscriber did not start")
        pub = _connect(url)
        publish = pack("PUBLISH", "trace", "x")
        sent = []
        for _ in range(samples):
            time.sleep(rng.uniform(*GAP))
            sent.append(time.monotonic_ns())
            pub.sendall(publish)
            pub.recv(100)
        woke = out.get(timeout=TIMEOUT)
        pub.close()
        return [(b - a) / 1000 for a, b in zip(sent, woke)]
    finally:
        proc.join(timeout=TIMEOUT)


# -- the handoff, instrumented -----------------------------------------------------
def _instrument(marks: dict[str, int]) -> None:
    """Wrap the waiting process's notifier, flag and transport to stamp ``marks``."""
    from django_redlock.transport import notify, sync

    ns = time.monotonic_ns
    _wrap(notify.ReleaseNotifier, "_drain", before=lambda: marks.setdefault(NOTICE_READ, ns()))
    _wrap(notify.Subscription, "wait", after=lambda: marks.setdefault(WAITER_RUNS, ns()))
    # Only before acquire() returned: a handed-over lock sends no acquire
    # request, and the release that follows must not be stamped as one.
    _wrap(sync.SyncTransport, "_send",
          before=lambda: WAITER_RUNS in marks and RETURNED not in marks
          and marks.setdefault(ACQUIRE_SENT, ns()))
    _wrap(sync.SyncTransport, "round",
          after=lambda: ACQUIRE_SENT in marks and RETURNED not in marks
          and marks.setdefault(REPLY_READ, ns()))


def _waiter(lib_id: str, urls: list[str], samples: int, barrier: Any, out: Any) -> None:
    from .libs import build, quiet_loggers

    quiet_loggers()
    marks: dict[str, int] = {}
    if lib_id.startswith("drl"):
        _instrument(marks)
    lib = build(lib_id, urls, urls)
    rows = []
    try:
        for _ in range(samples):
            lock = lib.new("bench:trace")
            barrier.wait(TIMEOUT)  # the holder has it
            marks.clear()
            ok = lib.acquire(lock, TIMEOUT)
            marks[RETURNED] = time.monotonic_ns()
            if ok:
                lib.release(lock)
            rows.append(dict(marks) if ok else None)
            barrier.wait(TIMEOUT)  # the holder may take it again
    finally:
        lib.close()
    out.put(rows)


def _handoff(lib_id: str, urls: list[str], samples: int, rng: random.Random) -> list[dict[str, float]]:
    from django_redlock.transport import sync

    from .libs import build

    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    proc = ctx.Process(target=_waiter, args=(lib_id, urls, samples, barrier, out), daemon=True)
    proc.start()
    holder = build(lib_id, urls, urls)
    released = []
    holder_sent: list[int] = []

    def stamp_release() -> None:
        if len(holder_sent) < len(released):  # the first request after release() was called
            holder_sent.append(time.monotonic_ns())

    send = sync.SyncTransport._send
    if lib_id.startswith("drl"):
        _wrap(sync.SyncTransport, "_send", before=stamp_release)
    try:
        for _ in range(samples):
            lock = holder.new("bench:trace")
            if not holder.acquire(lock, TIMEOUT):
                raise RuntimeError(f"{lib_id}: the holder could not acquire")
            barrier.wait(TIMEOUT)
            time.sleep(rng.uniform(*GAP))  # the waiter is blocked (and its CPU idle)
            released.append(time.monotonic_ns())
            holder.release(lock)
            barrier.wait(TIMEOUT)
        rows = out.get(timeout=TIMEOUT)
    finally:
        sync.SyncTransport._send = send  # type: ignore[method-assign]
        holder.close()
        proc.join(timeout=TIMEOUT)
    for row, sent in zip(rows, holder_sent):
        if row is not None:
            row[HOLDER_SENT] = sent
    return [{k: (v - t0) / 1000 for k, v in row.items()}
            for t0, row in zip(released, rows) if row is not None]


def _line(label: str, values: list[float]) -> str:
    if not values:
        return f"{label:42s} {'-':>8s} {'-':>8s}"
    return f"{label:42s} {percentile(values, 50):8.0f} {percentile(values, 90):8.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.trace", description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=60, help="handoffs per batch")
    ap.add_argument("--batches", type=int, default=3)
    args = ap.parse_args(argv)
    rng = random.Random(7)
    wake: dict[bool, list[float]] = {False: [], True: []}
    drl: list[dict[str, float]] = []
    prl: list[dict[str, float]] = []
    with running_nodes(1) as urls:
        for _ in range(args.batches):
            for through in rng.sample([False, True], 2):
                wake[through] += _wake_us(urls[0], through, args.samples, rng)
            for lib in rng.sample(["drl-renew-1", "prl-1"], 2):
                (drl if lib.startswith("drl") else prl).extend(
                    _handoff(lib, urls, args.samples, rng))
    print(f"=== one idle wake-up, 1 node ({args.batches} x {args.samples} samples)")
    print(f"{'':42s} {'p50 µs':>8s} {'p90 µs':>8s}")
    print(_line("wake, direct (a thread in recv)", wake[False]))
    print(_line("wake, through a listener thread and Flag", wake[True]))
    print("=== handoff timeline, django-redlock (defaults), 1 node: µs after release()")
    print(f"{'':42s} {'p50 µs':>8s} {'p90 µs':>8s}")
    for mark in MARKS:
        print(_line(mark, [row[mark] for row in drl if mark in row]))
    print(_line("python-redis-lock: acquire() returned", [row[RETURNED] for row in prl]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
