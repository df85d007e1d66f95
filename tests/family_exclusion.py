"""Run the lock family's exclusion workers (``tests.testapp.family_worker``) in
several processes and read what they counted: the Redis meter and the rows of
the shared SQLite file. Used by the exclusion tests of each family member."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from django_redlock.testing import RedisNodes

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Outcome:
    """What the workers counted, summed over them, and what the stores hold."""

    report: dict[str, int]  # summed over the workers' JSON lines
    counters: dict[str, int]  # Counter rows (plain read-modify-write), by name
    stock: dict[str, int]  # Product rows (fenced read-modify-write), by name
    fences: dict[str, int]  # the fence each Product row carries
    meter: dict[str, int]  # the meter's keys

    def holds(self, resource: str) -> int:
        return self.report.get(f"holds:{resource}", 0)


def run_workers(kind: str, nodes: RedisNodes, meter: RedisNodes, tmp_path: Path, *,
                procs: int = 4, rounds: int = 8, permits: int = 2, threads: int = 1,
                timeout: float = 120.0) -> Outcome:
    """``procs`` worker processes of ``kind`` on ``nodes``, started together."""
    db = tmp_path / f"family-{kind}.sqlite3"
    env = dict(os.environ)
    env.update({"DJANGO_SETTINGS_MODULE": "tests.settings", "REDLOCK_TEST_DB": str(db),
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    env.pop("DATABASE_URL", None)  # the workers only need the SQLite file
    meter_client = redis.Redis.from_url(meter.urls[0])
    meter_client.flushall()

    def start(*args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "tests.testapp.family_worker", *args],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    setup = start("migrate", "--permits", str(permits))
    _, err = setup.communicate(timeout=60)
    assert setup.returncode == 0, err
    # Started together once every process has set Django up (about a second).
    start_at = time.time() + 3.0
    workers = [start("run", kind, "--nodes", ",".join(nodes.urls), "--meter", meter.urls[0],
                     "--rounds", str(rounds), "--permits", str(permits),
                     "--threads", str(threads), "--start-at", str(start_at))
               for _ in range(procs)]
    report: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert worker.returncode == 0, err
            for key, value in json.loads(out.strip().splitlines()[-1]).items():
                report[key] = report.get(key, 0) + value
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.communicate(timeout=5)
    with contextlib.closing(sqlite3.connect(db)) as conn:
        counters = dict(conn.execute("SELECT name, value FROM testapp_counter").fetchall())
        rows = conn.execute("SELECT name, stock, fence FROM testapp_product").fetchall()
    meter_values: dict[str, int] = {}
    for key in meter_client.scan_iter(count=500):
        value = meter_client.get(key)
        if value is not None and value.lstrip(b"-").isdigit():
            meter_values[key.decode()] = int(value)
    return Outcome(report=report, counters=counters,
                   stock={name: stock for name, stock, _ in rows},
                   fences={name: fence for name, _, fence in rows}, meter=meter_values)


def assert_no_lost_update(outcome: Outcome, resources: list[str]) -> None:
    """Every exclusive hold of each resource counted once in Redis and both rows."""
    report = outcome.report
    assert report.get("redis_overlaps", 0) == 0, report
    assert report.get("rejected", 0) == 0, report  # no newer holder claimed a row under us
    for resource in resources:
        holds = outcome.holds(resource)
        assert outcome.counters[resource] == holds, (resource, outcome.counters, report)
        assert outcome.stock[resource] == holds, (resource, outcome.stock, report)
        assert outcome.meter.get(f"most:{resource}", 0) == (1 if holds else 0), outcome.meter


