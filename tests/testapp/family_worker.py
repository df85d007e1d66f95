"""A worker process for the lock family's exclusion tests: Redis and database counters.

    REDLOCK_TEST_DB=/tmp/x.sqlite3 python -m tests.testapp.family_worker migrate
    ... python -m tests.testapp.family_worker run KIND --nodes URL,URL --meter URL \\
            --rounds 10 [--permits 2] [--threads 1]

Each round takes one hold of ``KIND`` (``rw``, ``semaphore``, ``multi``,
``segments``, ``reentrant``, or ``none``: no lock at all, the control) and, inside
it, for every resource the hold covers:

* the Redis counter: counts the holders inside (a Lua ``INCR`` that keeps the
  highest count seen, in a Redis of its own, the *meter*) -- overlap shows at
  once, whatever the timing;
* the database counters, each a read-modify-write with a pause between the read
  and the write, on a SQLite file shared by every worker: a plain
  :class:`~tests.testapp.models.Counter` row (nothing but the hold keeps it
  exact: an overlap loses an update) and a fenced
  :class:`~tests.testapp.models.Product` row (``claim()``, read, then
  ``fenced_update()`` with the hold's fence for that resource; an overlap there
  is a refused write, counted as one).

Read holds write nothing: a reader reads both rows at the start and the end of
its hold and counts a change (a writer got in). The semaphore keeps a holder
count in the database too (one transaction: add one, read, raise the row of
the highest seen), beside its per-permit rows.

``run`` prints one JSON line: how many holds of each resource it made (what the
rows must add up to), refused fenced writes, and readers that saw a write.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

#: Enter: one more holder of KEYS[1]; keep the highest count seen in KEYS[2].
ENTER = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
return n
"""

#: The resources of each kind; a resource is one row of each model (by name).
RESOURCES = {
    "rw": ["doc"],
    "multi": ["acct:a", "acct:b"],
    "reentrant": ["re"],
    "none": ["bare"],
}
#: Between the read and the write of a database counter (s): long enough that an
#: overlapping holder reads the same value.
GAP = 0.004


def resources(kind: str, permits: int) -> list[str]:
    if kind == "semaphore":
        return [f"permit:{i}" for i in range(permits)]
    if kind == "segments":
        return [f"segment:{i}" for i in range(permits)]
    return RESOURCES[kind]


def _setup() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    from django.conf import settings

    if not os.environ.get("REDLOCK_TEST_DB"):
        sys.exit("REDLOCK_TEST_DB must name the shared SQLite file")
    # Several processes write one SQLite file: wait for its write lock instead of
    # failing with "database is locked" (WAL mode is set once by `migrate`).
    settings.DATABASES["default"]["OPTIONS"] = {"timeout": 30}

    import django

    django.setup()


def migrate(names: list[str]) -> None:
    from django.core.management import call_command
    from django.db import connection

    from tests.testapp.models import Counter, Product

    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode=WAL")
    call_command("migrate", verbosity=0)
    for name in [*names, "inside", "most"]:
        Counter.objects.get_or_create(name=name)
        Product.objects.get_or_create(name=name)


class Worker:
    """One thread's holds; every count it makes goes to ``report``."""

    def __init__(self, args: argparse.Namespace, report: dict[str, Any], manager: Any,
                 guard: threading.Lock) -> None:
        import redis

        self.args = args
        self.report = report
        self.rng = random.Random()
        self.meter = redis.Redis.from_url(args.meter)
        self.enter = self.meter.register_script(ENTER)
        # One manager for the process's threads, as in a web server: its
        # reentrant holds are per thread, not per manager.
        self.manager = manager
        self.guard = guard

    def count(self, what: str, n: int = 1) -> None:
        with self.guard:
            self.report[what] = self.report.get(what, 0) + n

    # -- inside a hold ---------------------------------------------------------------
    def inside(self, resource: str, fence_holder: Any) -> None:
        """One exclusive hold of ``resource``: meter it, then both database counters."""
        from django_redlock import FencedWriteRejected
        from tests.testapp.models import Counter, Product

        if int(self.enter(keys=[f"in:{resource}", f"most:{resource}"])) != 1:
            self.count("redis_overlaps")
        try:
            row = Counter.objects.get(name=resource)
            time.sleep(GAP)
            Counter.objects.filter(pk=row.pk).update(value=row.value + 1)
            if fence_holder is not None:
                product = Product.objects.filter(name=resource)
                try:
                    product.claim(fence_holder)
                    stock = product.get().stock
                    time.sleep(GAP)
                    product.fenced_update(fence_holder, stock=stock + 1)
                except FencedWriteRejected:
                    self.count("rejected")
            self.count(f"holds:{resource}")
        finally:
            self.meter.decr(f"in:{resource}")

    def reading(self, resource: str) -> None:
        """One shared hold: no writer inside, and neither row changes under it."""
        from tests.testapp.models import Counter, Product

        readers = int(self.meter.incr(f"readers:{resource}"))
        try:
            self.meter.incr(f"readers-seen:{min(readers, 2)}")
            if int(self.meter.get(f"in:{resource}") or 0):
                self.count("redis_overlaps")
            before = (Counter.objects.get(name=resource).value,
                      Product.objects.get(name=resource).stock)
            time.sleep(GAP)
            after = (Counter.objects.get(name=resource).value,
                     Product.objects.get(name=resource).stock)
            if before != after:
                self.count("reader_saw_write")
            self.count("reads")
        finally:
            self.meter.decr(f"readers:{resource}")

    def semaphore_count(self, delta: int) -> None:
        """The holders inside, counted in the database (one transaction)."""
        from django.db import transaction
        from django.db.models import F

        from tests.testapp.models import Counter

        with transaction.atomic():
            Counter.objects.filter(name="inside").update(value=F("value") + delta)
            if delta > 0:
                now = Counter.objects.get(name="inside").value
                Counter.objects.filter(name="most", value__lt=now).update(value=now)

    # -- one round of each kind ------------------------------------------------------
    def round(self) -> None:
        kind, mgr = self.args.kind, self.manager
        if kind == "rw":
            if self.rng.random() < 0.3:
                with mgr.write_lock("doc", ttl=10, timeout=30) as held:
                    # A writer must also find no reader inside.
                    if int(self.meter.get("readers:doc") or 0):
                        self.count("redis_overlaps")
                    self.inside("doc", held)
            else:
                with mgr.read_lock("doc", ttl=10, timeout=30):
                    self.reading("doc")
        elif kind == "semaphore":
            with mgr.semaphore("procs", self.args.permits, ttl=10, timeout=30) as held:
                if int(self.enter(keys=["in:procs", "most:procs"])) > self.args.permits:
                    self.count("redis_overlaps")
                self.semaphore_count(+1)
                try:
                    # Permits fence apart: the permit's own rows, with its fence.
                    self.inside(f"permit:{held.index}", held)
                finally:
                    self.semaphore_count(-1)
                    self.meter.decr("in:procs")
        elif kind == "multi":
            names = ["acct:a", "acct:b"]
            self.rng.shuffle(names)  # any order: deadlock-free all the same
            with mgr.multi_lock(names, ttl=10, timeout=30) as held:
                for name in names:
                    self.inside(name, SimpleNamespace(name=name, fence=held.fences[name]))
        elif kind == "segments":
            with mgr.segments("stock", self.args.permits, ttl=10, timeout=30) as seg:
                self.inside(f"segment:{seg.index}", seg)
        elif kind == "reentrant":
            with mgr.lock("re", reentrant=True, ttl=10, timeout=30) as outer:
                # Nested on the same name, as nested decorated functions do: no
                # wait, one fence for the whole hold (the inner write uses it).
                with mgr.lock("re", reentrant=True, timeout=0) as inner:
                    assert inner.fence == outer.fence
                    self.inside("re", inner)
        elif kind == "none":
            self.inside("bare", None)
        else:  # pragma: no cover - argparse's choices
            raise ValueError(kind)

    def run(self, rounds: int) -> None:
        from django.db import connection

        try:
            for _ in range(rounds):
                self.round()
        finally:
            connection.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    mig = sub.add_parser("migrate")
    mig.add_argument("--permits", type=int, default=2)
    run = sub.add_parser("run")
    run.add_argument("kind", choices=["rw", "semaphore", "multi", "segments", "reentrant",
                                      "none"])
    run.add_argument("--nodes", required=True)
    run.add_argument("--meter", required=True)
    run.add_argument("--rounds", type=int, default=10)
    run.add_argument("--permits", type=int, default=2)
    run.add_argument("--threads", type=int, default=1)
    run.add_argument("--start-at", type=float, default=0.0,
                     help="wall-clock time to start at, so that the workers overlap")
    args = parser.parse_args(argv)
    _setup()
    # Never outlive a broken test (every wait of a round is bounded by 30 s).
    threading.Timer(150, os._exit, args=(3,)).start()

    if args.cmd == "migrate":
        names = sorted({name for kind in ("rw", "multi", "reentrant", "none", "semaphore",
                                          "segments")
                        for name in resources(kind, args.permits)})
        migrate(names)
        os._exit(0)

    from django_redlock import LockManager

    report: dict[str, Any] = {}
    failures: list[BaseException] = []
    manager = LockManager(args.nodes.split(","), node_timeout=0.5)
    guard = threading.Lock()

    def work() -> None:
        try:
            Worker(args, report, manager, guard).run(args.rounds)
        except BaseException as e:  # noqa: BLE001 - reported below, the exit says it failed
            failures.append(e)

    time.sleep(min(10.0, max(0.0, args.start_at - time.time())))
    threads = [threading.Thread(target=work) for _ in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    manager.close()
    print(json.dumps(report), flush=True)
    if failures:
        print(f"worker failed: {failures[0]!r}", file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
