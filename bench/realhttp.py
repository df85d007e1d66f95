"""Real HTTP: the demo shop under gunicorn, driven by wrk (issue 23).

The demo (``testproject``, the stack ``make demo`` runs: 3 Redis nodes of
:class:`django_redlock.testing.RedisNodes`, a migrated SQLite file in WAL mode,
gunicorn with 4 sync workers) takes purchases from ``wrk``, an existing load
generator (Debian's ``wrk``; ``make bench`` installs it when run as root), on
the protected endpoint (``@with_lock("stock:<pk>")``, one lock per product)
and on the striped one (``segments("stock:<pk>", 8)``). ``DEMO_WORK`` is 0:
what a purchase costs is the lock, the claim and the fenced write, no
simulated payment call.

Per endpoint and round, two runs in a shuffled order: every node up, and one
node killed (``kill -9``) half-way through the run (restarted, empty, after
it). Reported: requests/s, p50/p99 latency (wrk's own histogram, read by the
Lua script's ``done()``), the answers by status, and the check that matters:
the stock the database gave up during the run against the purchases answered
200. ``oversold`` counts customers told "bought" beyond what the stock gave
up (a lost update): the goal is 0. The opposite (the stock went down without
a 200 reaching wrk) happens when wrk stops with requests in flight; it is
reported as ``unanswered`` and is at most the connections open.

CSRF stays on: the script sends a token in the ``csrftoken`` cookie and the
``X-CSRFToken`` header, as the demo's own load generator does.
"""

from __future__ import annotations

import os
import random
import re
import secrets
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from typing import Any

from .stats import median

#: (row id, the mode's SKU in testproject.inventory.catalog, the URL name's path tail)
ENDPOINTS = (("protected", "DEMO-LOCKED", "decrement"),
             ("striped", "DEMO-STRIPED", "decrement-striped"))
CASES = tuple((ep, kill) for ep, _, _ in ENDPOINTS for kill in (False, True))
STOCK = 1_000_000  # never sold out during a run: every request is a real purchase
STRIPES = 8
CONNECTIONS = 16
THREADS = 2
#: Seconds per run (a row): a few seconds in a quick run.
DURATION = {"quick": 3.0, "full": 8.0}
#: Rounds measured at most (each is four runs plus the restarts).
MAX_ROUNDS = {"quick": 2, "full": 3}

LUA = r"""
-- Purchases: POST with a CSRF token in the cookie and the header (Django's
-- check stays on), answers counted by status, wrk's latency percentiles.
wrk.method = "POST"
wrk.body = ""
wrk.headers["Content-Type"] = "application/x-www-form-urlencoded"
wrk.headers["Accept"] = "application/json"
wrk.headers["Cookie"] = "csrftoken=__TOKEN__"
wrk.headers["X-CSRFToken"] = "__TOKEN__"

local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) s200 = 0; s409 = 0; s5xx = 0; sother = 0 end
function response(status, headers, body)
  if status == 200 then s200 = s200 + 1
  elseif status == 409 then s409 = s409 + 1
  elseif status >= 500 then s5xx = s5xx + 1
  else sother = sother + 1 end
end
function done(summary, latency, requests)
  local t = {s200 = 0, s409 = 0, s5xx = 0, sother = 0}
  for _, th in ipairs(threads) do
    for k, _ in pairs(t) do t[k] = t[k] + th:get(k) end
  end
  io.write(string.format(
    "BENCH requests=%d s200=%d s409=%d s5xx=%d sother=%d p50_us=%d p99_us=%d\n",
    summary.requests, t.s200, t.s409, t.s5xx, t.sother,
    latency:percentile(50), latency:percentile(99)))
end
"""

_UNITS = {"us": 1.0, "ms": 1000.0, "s": 1_000_000.0, "m": 60_000_000.0}


def _duration_us(text: str) -> float:
    """wrk's ``1.23ms`` / ``812.00us`` / ``1.02s`` as microseconds."""
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text.strip())
    if not m:
        raise ValueError(f"not a wrk duration: {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_wrk(output: str) -> dict[str, Any]:
    """The figures of one wrk run, from its standard output.

    wrk's own lines give requests/s, the total, the non-2xx count, socket
    errors and (with ``--latency``) the latency distribution; the script's
    ``BENCH`` line, when present, gives the answers by status and the p50/p99
    in whole microseconds, which win over the rounded distribution lines.
    """
    out: dict[str, Any] = {"errors": {"connect": 0, "read": 0, "write": 0, "timeout": 0},
                           "non_2xx": 0}
    m = re.search(r"Requests/sec:\s+([\d.]+)", output)
    if not m:
        raise ValueError("no 'Requests/sec' line in wrk's output")
    out["rps"] = float(m.group(1))
    m = re.search(r"(\d+) requests in ([\d.]+\w+),", output)
    if m:
        out["requests"] = int(m.group(1))
        out["seconds"] = _duration_us(m.group(2)) / 1e6
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", output)
    if m:
        out["non_2xx"] = int(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                  output)
    if m:
        out["errors"] = dict(zip(("connect", "read", "write", "timeout"),
                                 (int(g) for g in m.groups())))
    dist = output.split("Latency Distribution", 1)
    if len(dist) == 2:
        for pct, value in re.findall(r"^\s+(\d+)%\s+(\S+)\s*$", dist[1], re.MULTILINE):
            if pct in ("50", "99"):
                out[f"p{pct}_us"] = _duration_us(value)
    m = re.search(r"^BENCH (.*)$", output, re.MULTILINE)
    if m:
        fields = dict(item.split("=", 1) for item in m.group(1).split())
        for key in ("s200", "s409", "s5xx", "sother"):
            out[key] = int(fields[key])
        out["requests"] = int(fields["requests"])
        out["p50_us"] = float(fields["p50_us"])
        out["p99_us"] = float(fields["p99_us"])
    return out


def sale_check(ok: int, stock_before: int, stock_after: int) -> dict[str, int]:
    """The purchases answered 200 against the stock the database gave up.

    ``oversold``: 200s beyond the units that left the stock (a customer told
    "bought" for a unit another customer also got: must be 0).
    ``unanswered``: units that left the stock without a 200 reaching the load
    generator (requests in flight when it stopped, or a client timeout)."""
    sold = stock_before - stock_after
    return {"sold_db": sold, "oversold": max(0, ok - sold), "unanswered": max(0, sold - ok)}


def ratio(top: float | None, bottom: float | None) -> float | None:
    """``top / bottom``, or None when either is missing or ``bottom`` is 0."""
    if top is None or not bottom:
        return None
    return float(top) / float(bottom)


def missing_tools() -> str | None:
    """Why this section cannot run here (None: it can)."""
    if shutil.which("wrk") is None:
        return ("wrk is not installed: apt-get install wrk (make bench installs it when run "
                "as root); the real-HTTP section is skipped")
    try:
        import gunicorn  # noqa: F401
    except ImportError:
        return "gunicorn is not installed (pip install -e .[bench]); the real-HTTP section is " \
               "skipped"
    return None


class RealHttp:
    def __init__(self, *, quick: bool) -> None:
        self.profile = "quick" if quick else "full"
        self.duration = DURATION[self.profile]
        self.rounds: list[dict[tuple[str, bool], dict[str, Any]]] = []
        self.skipped = missing_tools()
        self.stack: Any = None
        self.nodes: Any = None
        self.script = ""
        if self.skipped:
            print(f"bench: {self.skipped}", file=sys.stderr, flush=True)
            return
        try:
            self._start()
        except Exception as e:  # noqa: BLE001 - the section is skipped, the bench goes on
            self.close()
            self.skipped = f"the demo stack did not start: {type(e).__name__}: {e}"[:400]
            print(f"bench: {self.skipped}", file=sys.stderr, flush=True)

    def _start(self) -> None:
        from django_redlock.testing import RedisNodes
        from testproject.demo import Stack

        self.nodes = RedisNodes(3).start()
        self.stack = Stack(workers=4, nodes=list(self.nodes.urls), stock=STOCK,
                           stripes=STRIPES, env={"DEMO_WORK": "0", "DEMO_DELAY": "0"},
                           log=lambda text: print(f"bench: http: {text}", file=sys.stderr,
                                                  flush=True)).start()
        fd, self.script = tempfile.mkstemp(prefix="bench-wrk-", suffix=".lua")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(LUA.replace("__TOKEN__", secrets.token_hex(16)))  # 32 characters
        for _, sku, tail in ENDPOINTS:  # warm-up, not measured: every worker's first requests
            subprocess.run(["wrk", f"-t{THREADS}", f"-c{CONNECTIONS}", "-d1s", "-s", self.script,
                            self._url(sku, tail)], capture_output=True, timeout=30, check=False)

    def close(self) -> None:
        stack, self.stack = self.stack, None
        nodes, self.nodes = self.nodes, None
        try:
            if stack is not None:
                stack.stop()
        finally:
            if nodes is not None:
                nodes.stop()
            if self.script:
                os.unlink(self.script)
                self.script = ""

    # -- one run ----------------------------------------------------------------
    def _url(self, sku: str, tail: str) -> str:
        return f"{self.stack.url}/products/{self.stack.products[sku]}/{tail}/"

    def _stock(self, sku: str) -> int:
        db = sqlite3.connect(f"file:{self.stack.env['DEMO_DB']}?mode=ro", uri=True, timeout=30)
        try:
            row = db.execute(
                "SELECT p.stock + COALESCE((SELECT SUM(s.stock) FROM inventory_productsegment s "
                "WHERE s.product_id = p.id), 0) FROM inventory_product p WHERE p.sku = ?",
                (sku,)).fetchone()
        finally:
            db.close()
        return int(row[0])

    def _settled_stock(self, sku: str) -> int:
        """The stock once the purchases still in the workers are done (bounded)."""
        last = self._stock(sku)
        for _ in range(20):
            time.sleep(0.25)
            now = self._stock(sku)
            if now == last:
                return now
            last = now
        return last

    def _run(self, endpoint: str, kill: bool) -> dict[str, Any]:
        sku, tail = next((s, t) for e, s, t in ENDPOINTS if e == endpoint)
        url = self._url(sku, tail)
        before = self._settled_stock(sku)
        cmd = ["wrk", f"-t{THREADS}", f"-c{CONNECTIONS}", f"-d{self.duration:g}s",
               "--timeout", "10s", "--latency", "-s", self.script, url]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        killed_at = None
        if kill:
            time.sleep(self.duration / 2)
            self.nodes.servers[0].kill()
            killed_at = self.duration / 2
        try:
            output, _ = proc.communicate(timeout=self.duration + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        finally:
            if kill:
                self.nodes.servers[0].restart()  # back, empty, for the next run
        try:
            res = parse_wrk(output)
        except ValueError as e:
            return {"error": f"{e}: {output[-300:]!r}"}
        after = self._settled_stock(sku)
        res.update(sale_check(res.get("s200", 0), before, after))
        res["killed_at_s"] = killed_at
        return res

    def run_round(self, rng: random.Random) -> None:
        if self.skipped or len(self.rounds) >= MAX_ROUNDS[self.profile]:
            return
        order = list(CASES)
        rng.shuffle(order)
        res = {case: self._run(*case) for case in order}
        for endpoint, _, _ in ENDPOINTS:  # ratios inside the round
            up, down = res[(endpoint, False)], res[(endpoint, True)]
            x = ratio(down.get("rps"), up.get("rps"))
            if x is not None:
                down["x_up"] = x  # one node killed half-way, against every node up
        striped, protected = res[("striped", False)], res[("protected", False)]
        x = ratio(striped.get("rps"), protected.get("rps"))
        if x is not None:
            striped["x_protected"] = x
        self.rounds.append(res)

    def summary(self) -> dict[str, Any]:
        if self.skipped:
            return {"skipped": self.skipped}
        rows: dict[str, Any] = {}
        for endpoint, kill in CASES:
            per = [r[(endpoint, kill)] for r in self.rounds if (endpoint, kill) in r]
            ok = [p for p in per if "rps" in p]
            row: dict[str, Any] = {"endpoint": endpoint, "node_killed": kill, "rounds": len(ok)}
            for field in ("rps", "p50_us", "p99_us", "x_up", "x_protected"):
                vals = [p[field] for p in ok if p.get(field) is not None]
                if vals:
                    row[field] = median(vals)
            for field in ("s200", "s409", "s5xx", "sother", "sold_db", "oversold",
                          "unanswered"):
                row[field] = sum(p.get(field, 0) for p in ok)
            row["socket_errors"] = sum(sum(p["errors"].values()) for p in ok)
            errors = [p["error"] for p in per if "error" in p]
            if errors:
                row["error_sample"] = errors[:2]
            rows[f"{endpoint}{'-killed' if kill else ''}"] = row
        return {"rows": rows, "seconds_per_run": self.duration, "connections": CONNECTIONS,
                "gunicorn_workers": 4, "nodes": 3, "stripes": STRIPES}
