"""``manage.py racelab``: lost updates without a lock, aborts with WATCH, none with ours.

Replays the classic experiment against the demo's Redis: ``--clients`` processes
each increment one key ``--increments`` times, with each strategy of
:mod:`testproject.inventory.race`, and prints how many increments were lost and
how many optimistic transactions were aborted.
"""

from __future__ import annotations

import json
import multiprocessing
import queue as queue_module
import time
import uuid
from typing import Any

import redis
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_redlock.core.config import parse_nodes

from ...loadgen import stop_workers, terminate_workers
from ...race import STRATEGIES, client_main


def _node_url(entry: Any) -> str:
    if isinstance(entry, dict):
        entry = entry.get("URL", "")
    if not isinstance(entry, str) or not entry.startswith(("redis://", "rediss://", "unix://")):
        raise CommandError("racelab needs REDLOCK_NODES given as redis:// URLs")
    return entry


class Command(BaseCommand):
    help = ("N clients x M increments of one Redis key: no lock, WATCH/MULTI/EXEC, "
            "django-redlock; prints lost updates and aborted transactions.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--clients", type=int, default=4)
        parser.add_argument("--increments", type=int, default=200,
                            help="increments per client (default 200)")
        parser.add_argument("--gap", type=float, default=0.0005,
                            help="seconds between the read and the write (default 0.0005)")
        parser.add_argument("--strategies", default=",".join(STRATEGIES),
                            help=f"comma-separated subset of: {', '.join(STRATEGIES)}")
        parser.add_argument("--json", action="store_true", help="end with one JSON line")

    def handle(self, *args: Any, **options: Any) -> None:
        clients, increments = options["clients"], options["increments"]
        if clients < 1 or increments < 1:
            raise CommandError("--clients and --increments must be at least 1")
        strategies = [s.strip() for s in options["strategies"].split(",") if s.strip()]
        unknown = [s for s in strategies if s not in STRATEGIES]
        if unknown:
            raise CommandError(f"unknown strategies: {', '.join(unknown)}")
        nodes = list(settings.REDLOCK_NODES)
        specs, problems = parse_nodes(nodes)
        if any(p.is_error for p in problems):
            raise CommandError("REDLOCK_NODES is invalid; run manage.py check")
        counter_url = _node_url(nodes[0])
        expected = clients * increments
        self.stdout.write(f"Race lab: {clients} clients x {increments} increments of one Redis "
                          f"key (expected {expected}), {len(nodes)} lock nodes")
        rows: dict[str, dict[str, Any]] = {}
        run = uuid.uuid4().hex[:8]
        for strategy in strategies:
            key = f"racelab:{run}:{strategy.replace('/', '-').replace(' ', '-')}"
            rows[strategy] = self._run(strategy, counter_url, nodes, key, clients, increments,
                                       options["gap"])
        self.stdout.write(format_table(rows))
        if options["json"]:
            self.stdout.write(json.dumps(rows))

    def _run(self, strategy: str, counter_url: str, nodes: list[Any], key: str, clients: int,
             increments: int, gap: float) -> dict[str, Any]:
        r = redis.Redis.from_url(counter_url, socket_timeout=5.0)
        try:
            r.set(key, 0)
            ctx = multiprocessing.get_context("spawn")
            results = ctx.Queue()
            go = ctx.Event()
            procs = [ctx.Process(target=client_main, daemon=True,
                                 args=(strategy, counter_url, nodes, key, increments, gap,
                                       results, go)) for _ in range(clients)]
            for proc in procs:
                proc.start()
            try:
                self._collect(results, clients, "ready", 60)
                started = time.monotonic()
                go.set()
                finished = self._collect(results, clients, "done", 120)
                elapsed = time.monotonic() - started
            except BaseException:  # Ctrl-C or a failed client: stop the others now
                terminate_workers(procs)
                raise
            finally:
                go.set()
                stop_workers(procs, results)
            final = int(r.get(key) or 0)
            r.delete(key)
        except redis.RedisError as exc:
            raise CommandError(f"racelab: Redis error: {exc}") from exc
        finally:
            r.close()
        expected = clients * increments
        return {
            "expected": expected,
            "final": final,
            "lost_updates": expected - final,
            "aborts": sum(a for a, _, _ in finished),
            "gave_up": sum(g for _, g, _ in finished),
            "seconds": round(elapsed, 2),
            "incr_per_s": round(final / elapsed, 1) if elapsed > 0 else 0.0,
        }

    @staticmethod
    def _collect(results: Any, count: int, kind: str, timeout: float) -> list[Any]:
        got: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            try:
                what, detail = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_module.Empty:
                raise CommandError(f"racelab: clients not {kind} within {timeout:g} s") from None
            if what == "error":
                raise CommandError(f"racelab: a client failed: {detail}")
            got.append(detail)
        return got


def format_table(rows: dict[str, dict[str, Any]]) -> str:
    header = ("strategy", "final", "lost updates", "aborted txns", "seconds", "incr/s")
    data = [(name, str(r["final"]), str(r["lost_updates"]), str(r["aborts"]), str(r["seconds"]),
             str(r["incr_per_s"])) for name, r in rows.items()]
    widths = [max(len(h), *(len(d[i]) for d in data)) for i, h in enumerate(header)]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(header), line(tuple("-" * w for w in widths))] + [line(d) for d in data]
    out.append("")
    for name, r in rows.items():
        if r["lost_updates"]:
            out.append(f"  {name}: {r['lost_updates']} of {r['expected']} increments lost "
                       f"(two clients read the same value, both wrote value + 1)")
        elif r["aborts"]:
            out.append(f"  {name}: exact, but {r['aborts']} transactions were aborted and "
                       f"retried ({r['aborts'] / r['expected']:.1f} per increment)")
        else:
            out.append(f"  {name}: exact, no retries: the clients took turns")
        if r["gave_up"]:
            out.append(f"    ({r['gave_up']} increments gave up after too many aborts)")
    return "\n".join(out)
