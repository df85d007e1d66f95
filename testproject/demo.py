"""``make demo``: the race shown, then fixed, end to end; ``make serve``: the same stack, kept up.

::

    python -m testproject.demo            # full run, under two minutes on 2 cores
    python -m testproject.demo --quick    # smaller load, for a quick look or a test
    python -m testproject.demo --serve    # start everything, print the URL, wait for Ctrl-C

What it does, and undoes (always, also on Ctrl-C):

1. starts three Redis nodes on free loopback ports (``django_redlock.testing``:
   no Redis needs to be installed by hand);
2. migrates a fresh SQLite database in a temporary directory and seeds products;
3. serves the shop with gunicorn (4 sync worker processes) on 127.0.0.1;
4. runs ``manage.py load`` (protected / unprotected / striped purchases),
   ``manage.py racelab`` (no lock / WATCH-MULTI-EXEC / our lock), and one purchase
   that holds its lock longer than the lock's TTL (the renewal at work);
5. prints the tables; the LAST line of stdout is one JSON object for scripts::

       {"protected": {"requests": R, "sold": S, "stock_left": L, "oversold": O},
        "unprotected": {...}, "striped": {...}}

Exit status: 0 when the protected and striped purchases sold exactly the stock
(``sold + stock_left == initial``, nothing oversold), 1 otherwise, 130 on Ctrl-C.

SIGTERM and SIGHUP stop everything like Ctrl-C does (the Redis nodes and gunicorn
run in sessions of their own, so a signal to the demo alone would leave them
behind); ``--serve`` also stops when its parent goes away (``make serve`` killed:
make does not pass the signal on).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testproject.inventory.catalog import RENEWAL_SKU
from testproject.inventory.loadgen import ShopClient, wait_until_up

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Plan:
    """How big a run is."""

    requests: int
    concurrency: int
    processes: int
    stock: int
    stripes: int
    race_clients: int
    race_increments: int
    lock_ttl: float  # the lease of every lock the shop takes, seconds
    slow_delay: float  # how long the renewal showcase's purchase holds its lock
    followers: int  # purchases queued behind the slow one


FULL = Plan(requests=500, concurrency=32, processes=4, stock=200, stripes=8, race_clients=4,
            race_increments=200, lock_ttl=2.0, slow_delay=3.0, followers=3)
QUICK = Plan(requests=120, concurrency=16, processes=4, stock=50, stripes=4, race_clients=3,
             race_increments=50, lock_ttl=2.0, slow_delay=2.5, followers=2)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _say(text: str = "") -> None:
    print(text, flush=True)


class Stack:
    """Redis nodes + a migrated, seeded SQLite database + gunicorn, started and stopped together.

    ``nodes``: Redis URLs to use instead of starting three nodes (the tests pass
    their own). ``env``: extra environment for every process of the stack.
    ``stop()`` is safe to call at any point, also half-way through ``start()``.
    """

    def __init__(self, *, workers: int = 4, nodes: Sequence[str] | None = None,
                 stock: int = 200, stripes: int = 8, port: int = 0,
                 env: dict[str, str] | None = None, keep: bool = False,
                 log: Callable[[str], None] = _say) -> None:
        self.workers = workers
        self.stock = stock
        self.stripes = stripes
        self.requested_port = port
        self.keep = keep
        self.log = log
        self._given_nodes = list(nodes) if nodes is not None else None
        self._extra_env = dict(env or {})
        self._nodes: Any = None
        self.node_urls: list[str] = []
        self.workdir = ""
        self.env: dict[str, str] = {}
        self.server: subprocess.Popen[bytes] | None = None
        self.server_log = ""
        self.url = ""
        self.products: dict[str, int] = {}  # sku -> pk of every seeded product

    # -- start ---------------------------------------------------------------------
    def start(self) -> Stack:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.workdir = tempfile.mkdtemp(prefix="redlock-demo-")
        if self._given_nodes is None:
            from django_redlock.testing import RedisNodes

            self._nodes = RedisNodes(3)
            self._nodes.start()
            self.node_urls = list(self._nodes.urls)
            self.log(f"Redis: 3 nodes started ({', '.join(self.node_urls)})")
        else:
            self.node_urls = list(self._given_nodes)
        env = dict(os.environ)
        env.update({
            "DJANGO_SETTINGS_MODULE": "testproject.settings",
            "REDLOCK_NODES": ",".join(self.node_urls),
            "DEMO_DB": os.path.join(self.workdir, "demo.sqlite3"),
            "DEMO_VAR_DIR": self.workdir,
            "PYTHONUNBUFFERED": "1",
        })
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env.update(self._extra_env)
        self.env = env
        started = time.monotonic()
        self.manage("migrate", "--noinput", "-v", "0")
        seeded = self.manage("seed", "--stock", str(self.stock), "--stripes", str(self.stripes),
                             "--json", capture=True)
        self.products = json.loads(seeded.stdout.strip().splitlines()[-1])
        self.log(f"Database: {env['DEMO_DB']} migrated and seeded "
                 f"({time.monotonic() - started:.1f} s)")
        self._start_server()

    def _start_server(self) -> None:
        self.server_log = os.path.join(self.workdir, "gunicorn.log")
        attempts = 1 if self.requested_port else 3
        for attempt in range(attempts):
            port = self.requested_port or free_port()
            self.url = f"http://127.0.0.1:{port}"
            with open(self.server_log, "ab") as log:
                self.server = subprocess.Popen(
                    [sys.executable, "-m", "gunicorn", "testproject.wsgi:application",
                     "--workers", str(self.workers), "--worker-class", "sync",
                     "--bind", f"127.0.0.1:{port}", "--timeout", "60",
                     "--graceful-timeout", "5", "--log-level", "warning",
                     "--error-logfile", "-"],
                    cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True)  # stopped by us, in order, even on Ctrl-C
            try:
                wait_until_up(self.url, timeout=60,
                              alive=lambda proc=self.server: proc.poll() is None)
            except RuntimeError:
                if attempt + 1 < attempts:  # lost the free port to someone else: retry
                    self._stop_server()
                    continue
                raise RuntimeError(
                    f"gunicorn exited while starting:\n{self.server_log_tail()}") from None
            except TimeoutError as exc:
                raise RuntimeError(f"{exc}\n{self.server_log_tail()}") from None
            self.log(f"Server: gunicorn, {self.workers} sync workers, at {self.url}")
            return

    def server_log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.server_log, encoding="utf-8", errors="replace") as fh:
                return "".join(fh.readlines()[-lines:])
        except OSError:
            return "(no server log)"

    def manage(self, *args: str, capture: bool = False,
               timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Run ``manage.py ARGS`` against this stack (its database and Redis nodes)."""
        return subprocess.run(
            [sys.executable, str(REPO_ROOT / "manage.py"), *args], cwd=REPO_ROOT, env=self.env,
            check=True, timeout=timeout, text=True,
            stdout=subprocess.PIPE if capture else None, stdin=subprocess.DEVNULL)

    # -- stop ----------------------------------------------------------------------
    def _stop_server(self) -> None:
        server, self.server = self.server, None
        if server is None or server.poll() is not None:
            return
        server.send_signal(signal.SIGTERM)  # gunicorn: graceful stop of the workers
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)  # its own session: the workers too
            server.wait(timeout=5)

    def stop(self) -> None:
        """Stop gunicorn, then the Redis nodes, then remove the work directory."""
        try:
            self._stop_server()
        finally:
            nodes, self._nodes = self._nodes, None
            try:
                if nodes is not None:
                    nodes.stop()
            finally:
                if self.workdir and not self.keep:
                    shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# -- the renewal showcase ---------------------------------------------------------

def renewal_showcase(url: str, product_pk: int, *, delay: float, ttl: float,
                     followers: int) -> dict[str, Any]:
    """One purchase that holds ``stock:<pk>`` for ``delay`` s (> the TTL), others behind it.

    Without renewal its lease would run out after ``ttl`` seconds and a follower
    would get the lock while it still works; with renewal the followers wait,
    and their fences are all higher than the slow purchase's.
    """
    client = ShopClient(url, timeout=delay + 30)
    client.fetch_csrf()
    path = f"/products/{product_pk}/decrement/"
    answers: dict[str, Any] = {}

    def buy(name: str, **fields: Any) -> None:
        began = time.monotonic()
        try:
            status, body = client.post(path, **fields)
        except OSError as exc:
            status, body = 0, {"error": str(exc)}
        answers[name] = (status, body or {}, time.monotonic() - began)

    slow = threading.Thread(target=buy, args=("slow",), kwargs={"delay": delay})
    slow.start()
    time.sleep(min(0.3, ttl / 3))  # let the slow one take the lock first
    queued = [threading.Thread(target=buy, args=(f"f{i}",)) for i in range(followers)]
    for thread in queued:
        thread.start()
    for thread in [slow, *queued]:
        thread.join(timeout=delay + 60)
    s_status, s_body, _ = answers.get("slow", (0, {}, 0.0))
    rest = [answers.get(f"f{i}", (0, {}, 0.0)) for i in range(followers)]
    slow_fence = int(s_body.get("fence", 0))
    ok = (s_status == 200 and float(s_body.get("held", 0)) > ttl
          and all(status == 200 and int(body.get("fence", 0)) > slow_fence
                  for status, body, _ in rest))
    return {"ok": ok, "ttl": ttl, "delay": delay, "slow": [s_status, s_body],
            "followers": [[status, body.get("fence"), round(waited, 2)]
                          for status, body, waited in rest]}


def print_renewal(result: dict[str, Any]) -> None:
    status, body = result["slow"]
    _say(f"Renewal: one purchase holds its lock for {result['delay']:g} s; the lock's TTL is "
         f"{result['ttl']:g} s")
    if status == 200:
        _say(f"  slow purchase: 200, held {body.get('held')} s, fence {body.get('fence')}, "
             f"lease left at the end {body.get('lease_left')} s -> renewed, never lost")
    else:
        _say(f"  slow purchase: HTTP {status} {body}")
    fences = [f for s, f, _ in result["followers"] if s == 200]
    waits = [w for _, _, w in result["followers"]]
    _say(f"  {len(result['followers'])} purchases queued behind it: answers "
         f"{[s for s, _, _ in result['followers']]}, fences {fences}, waited {waits} s")
    _say("  verdict: " + ("nobody got in while the slow purchase held the lock" if result["ok"]
                          else "UNEXPECTED: see the answers above"))


# -- main -------------------------------------------------------------------------

def _section(title: str) -> None:
    _say("")
    _say(f"== {title} " + "=" * max(0, 70 - len(title)))


def run_demo(plan: Plan, *, workers: int) -> int:
    t0 = time.monotonic()
    _section("Starting")
    with Stack(workers=workers, stock=plan.stock, stripes=plan.stripes,
               env={"DEMO_LOCK_TTL": str(plan.lock_ttl), "DEMO_DELAY": "0"}) as stack:
        _section("Load: purchases from several processes against 4 gunicorn workers")
        results_file = os.path.join(stack.workdir, "load.json")
        stack.manage("load", "--url", stack.url, "--requests", str(plan.requests),
                     "--concurrency", str(plan.concurrency), "--processes", str(plan.processes),
                     "--stock", str(plan.stock), "--stripes", str(plan.stripes),
                     "--json-out", results_file)
        with open(results_file, encoding="utf-8") as fh:
            load = json.load(fh)["modes"]

        _section("Race lab: the classic experiment on the demo's Redis")
        stack.manage("racelab", "--clients", str(plan.race_clients),
                     "--increments", str(plan.race_increments))

        _section("Renewal: a critical section longer than the lock's TTL")
        renewal = renewal_showcase(stack.url, stack.products[RENEWAL_SKU], delay=plan.slow_delay,
                                   ttl=plan.lock_ttl, followers=plan.followers)
        print_renewal(renewal)
        _section("Stopping")
    exact = all(load[m]["oversold"] == 0 and load[m]["sold"] + load[m]["stock_left"] == plan.stock
                for m in ("protected", "striped"))
    _say(f"Everything stopped; the demo took {time.monotonic() - t0:.0f} s.")
    if exact:
        _say(f"Verdict: with django-redlock, sold + stock left == {plan.stock} (protected and "
             f"striped); without a lock, {load['unprotected']['oversold']} units were sold twice.")
    else:
        _say("Verdict: UNEXPECTED, a protected mode did not account for every unit (see above).")
    if not renewal["ok"]:
        _say("Note: the renewal showcase did not go as expected (see above).")
    _say(json.dumps({m: {k: load[m][k] for k in ("requests", "sold", "stock_left", "oversold")}
                     for m in ("protected", "unprotected", "striped")}))
    return 0 if exact else 1


class Stopped(Exception):
    """SIGTERM or SIGHUP arrived: unwind, so every ``with Stack`` stops what it started."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, frame: Any) -> None:
    # Once: a second signal must not interrupt the stopping itself.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


def install_stop_signals() -> None:
    """Turn SIGTERM/SIGHUP into :class:`Stopped` (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return  # main() called from a thread: signals are the caller's business
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_stopped)


def run_serve(*, workers: int, port: int) -> int:
    parent = os.getppid()
    env = {}
    if "DEMO_LOCK_TTL" not in os.environ:
        env["DEMO_LOCK_TTL"] = "5"
    with Stack(workers=workers, port=port, env=env) as stack:
        _say("")
        _say(f"The shop is at {stack.url}/  (Ctrl-C stops everything)")
        _say("Held locks, from another terminal:")
        _say(f"  REDLOCK_NODES={','.join(stack.node_urls)} DEMO_DB={stack.env['DEMO_DB']} "
             f"{sys.executable} manage.py locks")
        _say("Slow purchases (renewal at work): DEMO_DELAY=8 make serve (TTL "
             f"{stack.env.get('DEMO_LOCK_TTL', '10')} s).")
        while stack.server is not None and stack.server.poll() is None:
            time.sleep(0.5)
            if os.getppid() != parent:  # our parent (make, a shell) is gone: so are we
                _say("The parent process went away; stopping everything.")
                return 0
        _say("gunicorn exited:")
        _say(stack.server_log_tail())
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testproject.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true",
                        help="start the stack and keep it running until Ctrl-C")
    parser.add_argument("--quick", action="store_true", help="a smaller load")
    parser.add_argument("--workers", type=int, default=4, help="gunicorn workers (default 4)")
    parser.add_argument("--port", type=int, default=0,
                        help="port for --serve (default: a free one)")
    args = parser.parse_args(argv)
    install_stop_signals()
    try:
        if args.serve:
            return run_serve(workers=args.workers, port=args.port)
        return run_demo(QUICK if args.quick else FULL, workers=args.workers)
    except KeyboardInterrupt:
        _say("")
        _say("Stopped (Ctrl-C); everything the demo started was stopped.")
        return 0 if args.serve else 130
    except Stopped as exc:
        _say("")
        _say(f"Stopped ({exc}); everything the demo started was stopped.")
        return 0 if args.serve else 128 + exc.signum
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, RuntimeError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
