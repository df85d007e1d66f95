"""``manage.py load``: concurrent purchases against the running shop, then the verdict.

For each mode (protected = ``@with_lock``, unprotected = no lock, striped = one
lock per stock segment) it resets that mode's product to ``--stock`` units, fires
``--requests`` purchases ``--concurrency`` at a time from ``--processes`` processes,
and reads what is left *from the database*. Then::

    sold        purchases answered 200 (the customer was told "bought")
    stock left  what the database still offers
    oversold    sold + stock left - initial stock, when positive: units promised
                to a customer that the stock never gave up (lost updates)

With a lock, ``sold + stock left == initial`` exactly. Without one, concurrent
workers read the same stock and each write "stock - 1": the shop sells more than
it had. ``--json`` ends the output with one JSON line for scripts.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ...catalog import MODES
from ...loadgen import ProgressBar, run_load


class Command(BaseCommand):
    help = ("Fire concurrent purchases at a running demo server (protected, unprotected, "
            "striped) and print sold / stock left / oversold / latency per mode.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--url", default="http://127.0.0.1:8000",
                            help="base URL of the running shop (default http://127.0.0.1:8000)")
        parser.add_argument("--modes", default="protected,unprotected,striped",
                            help="comma-separated: protected, unprotected, striped")
        parser.add_argument("--requests", type=int, default=500)
        parser.add_argument("--concurrency", type=int, default=32)
        parser.add_argument("--processes", type=int, default=4,
                            help="client processes sharing the concurrency (default 4)")
        parser.add_argument("--stock", type=int, default=200, help="initial stock per mode")
        parser.add_argument("--stripes", type=int, default=8,
                            help="segments of the striped product (default 8)")
        parser.add_argument("--timeout", type=float, default=30.0,
                            help="seconds one request may take (default 30)")
        parser.add_argument("--json", action="store_true",
                            help="end with one JSON line: {mode: {requests, sold, stock_left, "
                                 "oversold}}")
        parser.add_argument("--json-out", default="",
                            help="also write the full results (every column) to this file")
        parser.add_argument("--no-progress", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        names = [m.strip() for m in options["modes"].split(",") if m.strip()]
        unknown = [m for m in names if m not in MODES]
        if unknown or not names:
            raise CommandError(f"unknown mode(s) {', '.join(unknown) or '(none)'}; "
                               f"choose from {', '.join(MODES)}")
        for opt in ("requests", "concurrency", "processes", "stripes"):
            if options[opt] < 1:
                raise CommandError(f"--{opt} must be at least 1")
        if options["stock"] < 0:
            raise CommandError("--stock cannot be negative")
        initial = options["stock"]
        self.stdout.write(
            f"Load: {options['requests']} purchases per mode, {options['concurrency']} at a time "
            f"from {options['processes']} processes, against a stock of {initial} "
            f"({options['url']})")
        rows: dict[str, dict[str, Any]] = {}
        for name in names:
            mode = MODES[name]
            product = mode.product(stock=initial, stripes=options["stripes"])
            bar = None if options["no_progress"] else ProgressBar(name, sys.stderr)
            try:
                result = run_load(options["url"], mode.path(product),
                                  requests=options["requests"],
                                  concurrency=options["concurrency"],
                                  processes=options["processes"], timeout=options["timeout"],
                                  progress=bar)
            except (OSError, RuntimeError, TimeoutError) as exc:
                raise CommandError(f"{name}: {exc}") from exc
            except KeyboardInterrupt:
                raise CommandError(f"{name}: interrupted") from None
            product.refresh_from_db()
            left = product.available()
            sold = result.count(200)
            rows[name] = {
                "requests": result.requests,
                "sold": sold,
                "stock_left": left,
                "oversold": max(0, sold + left - initial),
                "sold_out": result.count(409),
                "busy": result.count(423),
                "errors": result.requests - result.count(200, 409, 423),
                "p50_ms": round(result.percentile_ms(50), 1),
                "p99_ms": round(result.percentile_ms(99), 1),
                "req_per_s": round(result.requests / result.elapsed, 1) if result.elapsed else 0.0,
                "sales_per_s": round(result.sales_per_second(), 1),
                "seconds": round(result.elapsed, 2),
            }
        self.stdout.write(format_table(rows, initial))
        if options["json_out"]:
            with open(options["json_out"], "w", encoding="utf-8") as fh:
                json.dump({"initial_stock": initial, "modes": rows}, fh, indent=2)
        if options["json"]:
            self.stdout.write(json.dumps(summary(rows)))


SUMMARY_KEYS = ("requests", "sold", "stock_left", "oversold")


def summary(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
    """The scripts' view: ``{mode: {requests, sold, stock_left, oversold}}``."""
    return {name: {key: row[key] for key in SUMMARY_KEYS} for name, row in rows.items()}


COLUMNS = [
    ("mode", "mode", "<"),
    ("requests", "requests", ">"),
    ("sold", "sold", ">"),
    ("sold out", "sold_out", ">"),
    ("busy", "busy", ">"),
    ("errors", "errors", ">"),
    ("stock left", "stock_left", ">"),
    ("oversold", "oversold", ">"),
    ("p50 ms", "p50_ms", ">"),
    ("p99 ms", "p99_ms", ">"),
    ("req/s", "req_per_s", ">"),
    ("sales/s", "sales_per_s", ">"),
]


def format_table(rows: dict[str, dict[str, Any]], initial: int) -> str:
    """The verdict table, with a line per mode saying what it means."""
    data = [[name if key == "mode" else str(row[key]) for _, key, _ in COLUMNS]
            for name, row in rows.items()]
    widths = [max(len(title), *(len(r[i]) for r in data)) for i, (title, _, _) in
              enumerate(COLUMNS)]

    def line(cells: list[str]) -> str:
        return "  ".join(f"{c:{align}{w}}" for c, w, (_, _, align) in zip(cells, widths, COLUMNS))

    out = [line([title for title, _, _ in COLUMNS]), line(["-" * w for w in widths])]
    out += [line(r) for r in data]
    out.append("")
    for name, row in rows.items():
        accounted = row["sold"] + row["stock_left"]
        if row["oversold"]:
            out.append(f"  {name}: sold {row['sold']} + {row['stock_left']} left = {accounted} "
                       f"units from a stock of {initial}: {row['oversold']} units sold twice "
                       f"(lost updates)")
        else:
            out.append(f"  {name}: sold {row['sold']} + {row['stock_left']} left = {accounted} "
                       f"= the initial stock: nothing oversold")
    if "protected" in rows and "striped" in rows and rows["protected"]["sales_per_s"]:
        gain = rows["striped"]["sales_per_s"] / rows["protected"]["sales_per_s"]
        out.append(f"  striping: {gain:.1f}x the sales/s of one lock per product")
    return "\n".join(out)
