"""A worker process for the concurrency tests: Django's test Client against a file DB.

    REDLOCK_TEST_DB=/tmp/x.sqlite3 REDLOCK_TEST_NODES=redis://...,redis://... \\
        python -m tests.testapp.hammer migrate --counter c
    ... python -m tests.testapp.hammer run --path /counter/c/incr/ --requests 10

``run`` prints one JSON line: the list of ``[value, fence]`` its requests got
back. Nothing here is shared with the other workers but the database file and
the Redis nodes: the lock is the only thing keeping the read-modify-write exact.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _setup() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    from django.conf import settings

    if not os.environ.get("REDLOCK_TEST_DB"):
        sys.exit("REDLOCK_TEST_DB must name the shared SQLite file")
    # Several processes write one SQLite file: wait for its write lock instead of
    # failing with "database is locked" (WAL mode is set once by `migrate`).
    settings.DATABASES["default"]["OPTIONS"] = {"timeout": 30}
    nodes = os.environ.get("REDLOCK_TEST_NODES")
    if nodes:
        settings.REDLOCK_NODES = nodes.split(",")

    import django

    django.setup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    mig = sub.add_parser("migrate")
    mig.add_argument("--counter", action="append", default=[])
    run = sub.add_parser("run")
    run.add_argument("--path", action="append", required=True)
    run.add_argument("--requests", type=int, default=10)
    run.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args(argv)
    _setup()

    if args.cmd == "migrate":
        from django.core.management import call_command
        from django.db import connection

        from tests.testapp.models import Counter

        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode=WAL")
        call_command("migrate", verbosity=0)
        for name in args.counter:
            Counter.objects.get_or_create(name=name)
        return 0

    from django.test import Client

    client = Client()
    results: dict[str, list[list[int]]] = {path: [] for path in args.path}
    for _ in range(args.requests):
        for path in args.path:
            response = client.post(f"{path}?delay={args.delay}")
            if response.status_code != 200:
                print(f"{path}: HTTP {response.status_code}: {response.content[:200]!r}",
                      file=sys.stderr)
                return 1
            body = response.json()
            results[path].append([body["value"], body.get("fence", 0)])
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
