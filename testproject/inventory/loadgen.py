"""Concurrent purchases against a running shop, from several processes.

Standard library only, and no Django: the worker processes are *spawned* (not
forked: the parent may hold Redis connections and a renewal thread), and each
imports just this module. Every worker process fetches the shop's CSRF cookie
once, like a browser would, then its threads post purchases with the token in
``X-CSRFToken``; the CSRF protection stays on for the load too.

Latencies are measured with ``time.monotonic()``, which on Linux is one clock for
every process, so the parent can compare the finish times its workers report.
"""

from __future__ import annotations

import http.client
import itertools
import json
import math
import multiprocessing
import queue as queue_module
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import urlencode, urlsplit

#: Status recorded for a request that got no HTTP answer (refused, reset, timed out).
NO_ANSWER = 0


class ShopClient:
    """A tiny HTTP client for the shop: JSON answers, CSRF token handled.

    Stateless apart from the token, so threads may share one. A new connection per
    request, as gunicorn's sync workers close them anyway.
    """

    def __init__(self, base_url: str, timeout: float = 30.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected an http://host:port URL, got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.timeout = timeout
        self.csrf_token = ""

    def request(self, method: str, path: str, fields: dict[str, Any] | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, Any, http.client.HTTPResponse]:
        """(status, parsed JSON body or None, response) of one request."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            all_headers = {"Accept": "application/json", "Connection": "close"}
            body = None
            if method == "POST":
                body = urlencode(fields or {})
                all_headers["Content-Type"] = "application/x-www-form-urlencoded"
                if self.csrf_token:
                    all_headers["X-CSRFToken"] = self.csrf_token
                    all_headers["Cookie"] = f"csrftoken={self.csrf_token}"
            all_headers.update(headers or {})
            conn.request(method, path, body=body, headers=all_headers)
            response = conn.getresponse()
            raw = response.read()
        finally:
            conn.close()
        data: Any = None
        if response.getheader("Content-Type", "").startswith("application/json"):
            try:
                data = json.loads(raw)
            except ValueError:
                data = None
        return response.status, data, response

    def fetch_csrf(self) -> str:
        """GET the product page and keep its ``csrftoken`` cookie."""
        status, _, response = self.request("GET", "/", headers={"Accept": "text/html"})
        if status != 200:
            raise RuntimeError(f"GET / answered {status}; cannot get a CSRF token")
        cookie = SimpleCookie()
        for header in response.msg.get_all("Set-Cookie") or []:
            cookie.load(header)
        if "csrftoken" not in cookie:
            raise RuntimeError("GET / set no csrftoken cookie")
        self.csrf_token = cookie["csrftoken"].value
        return self.csrf_token

    def post(self, path: str, **fields: Any) -> tuple[int, Any]:
        status, data, _ = self.request("POST", path, fields)
        return status, data

    def get_json(self, path: str) -> Any:
        status, data, _ = self.request("GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path} answered {status}")
        return data


def wait_until_up(base_url: str, *, timeout: float = 30.0,
                  alive: Callable[[], bool] | None = None) -> None:
    """Poll ``/health/`` until it answers 200; raise ``TimeoutError`` after ``timeout`` s."""
    client = ShopClient(base_url, timeout=2.0)
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise RuntimeError("the server exited while starting")
        try:
            status, _, _ = client.request("GET", "/health/")
            if status == 200:
                return
            last = f"HTTP {status}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.1)
    raise TimeoutError(f"{base_url} did not come up within {timeout:g} s ({last})")


# -- the load ------------------------------------------------------------------------

@dataclass
class LoadResult:
    """Every request's (status, latency s, finish time) and the run's start time."""

    started: float
    samples: list[tuple[int, float, float]] = field(default_factory=list)

    def count(self, *statuses: int) -> int:
        return sum(1 for s, _, _ in self.samples if s in statuses)

    @property
    def requests(self) -> int:
        return len(self.samples)

    @property
    def elapsed(self) -> float:
        if not self.samples:
            return 0.0
        return max(done for _, _, done in self.samples) - self.started

    def percentile_ms(self, pct: float) -> float:
        latencies = sorted(lat for _, lat, _ in self.samples)
        if not latencies:
            return 0.0
        rank = max(0, math.ceil(pct / 100.0 * len(latencies)) - 1)
        return latencies[rank] * 1000.0

    def sales_per_second(self) -> float:
        """Successful purchases per second until the last one."""
        done = [finished for s, _, finished in self.samples if s == 200]
        if not done:
            return 0.0
        span = max(done) - self.started
        return len(done) / span if span > 0 else 0.0


def _worker(base_url: str, path: str, count: int, threads: int, fields: dict[str, Any],
            timeout: float, results: Any, go: Any) -> None:
    """One load process: ``threads`` threads sharing ``count`` purchases."""
    # Ctrl-C reaches the whole process group: the parent decides, and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    client = ShopClient(base_url, timeout=timeout)
    try:
        client.fetch_csrf()
    except (OSError, RuntimeError) as exc:
        results.put(("failed", str(exc)))
        return
    results.put(("ready", None))
    if not go.wait(120):
        return
    numbers = itertools.count()
    numbers_lock = threading.Lock()

    def run() -> None:
        while True:
            with numbers_lock:
                if next(numbers) >= count:
                    return
            began = time.monotonic()
            try:
                status, _ = client.post(path, **fields)
            except (OSError, http.client.HTTPException):
                status = NO_ANSWER
            finished = time.monotonic()
            results.put((status, finished - began, finished))

    pool = [threading.Thread(target=run, daemon=True) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()


def split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal non-negative integers."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def run_load(base_url: str, path: str, *, requests: int, concurrency: int, processes: int,
             fields: dict[str, Any] | None = None, timeout: float = 30.0,
             progress: Callable[[int, int], None] | None = None) -> LoadResult:
    """Fire ``requests`` POSTs at ``path``, ``concurrency`` at a time, from ``processes``
    spawned processes; return every answer. Bounded: a worker that stops answering
    costs at most ``timeout`` seconds per missing request before it is given up."""
    if requests < 1 or concurrency < 1:
        raise ValueError("requests and concurrency must be at least 1")
    processes = max(1, min(processes, concurrency, requests))
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    go = ctx.Event()
    counts = split(requests, processes)
    threads = split(concurrency, processes)
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(base_url, path, counts[i], max(1, threads[i]), fields or {},
                               timeout, results, go), name=f"load-{i}")
             for i in range(processes)]
    for proc in procs:
        proc.start()
    try:
        ready = 0
        deadline = time.monotonic() + 60
        while ready < processes:
            try:
                kind, detail = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_module.Empty:
                raise TimeoutError("load processes did not start within 60 s") from None
            if kind == "failed":
                raise RuntimeError(f"a load process could not reach {base_url}: {detail}")
            ready += 1
        result = LoadResult(started=time.monotonic())
        go.set()
        last_answer = time.monotonic()
        while len(result.samples) < requests:
            try:
                sample = results.get(timeout=1.0)
            except queue_module.Empty:
                if time.monotonic() - last_answer > timeout + 5 or \
                        not any(p.is_alive() for p in procs):
                    missing = requests - len(result.samples)
                    now = time.monotonic()
                    result.samples += [(NO_ANSWER, now - result.started, now)] * missing
                    break
                continue
            last_answer = time.monotonic()
            result.samples.append(sample)
            if progress is not None:
                progress(len(result.samples), requests)
        return result
    except BaseException:  # Ctrl-C or a failure: do not let the workers finish the load
        terminate_workers(procs)
        raise
    finally:
        go.set()
        stop_workers(procs, results)


def terminate_workers(procs: list[Any]) -> None:
    """Stop every worker now (Ctrl-C, or one failed): nobody finishes the run."""
    for proc in procs:
        proc.terminate()


def stop_workers(procs: list[Any], results: Any) -> None:
    """Join worker processes (bounded), terminate stragglers, close their queue."""
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
    results.close()
    results.join_thread()


class ProgressBar:
    """``[#####-----] 250/500`` on a terminal; a line per quarter otherwise (logs, CI)."""

    def __init__(self, label: str, stream: Any, width: int = 30) -> None:
        self.label = label
        self.stream = stream
        self.width = width
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._shown = 0

    def __call__(self, done: int, total: int) -> None:
        if self.tty:
            filled = self.width * done // total
            self.stream.write(f"\r  {self.label:<12} [{'#' * filled}{'-' * (self.width - filled)}]"
                              f" {done}/{total}")
            if done == total:
                self.stream.write("\n")
            self.stream.flush()
            return
        quarter = 4 * done // total
        if quarter > self._shown:
            self._shown = quarter
            self.stream.write(f"  {self.label:<12} {done}/{total} ({25 * quarter}%)\n")
            self.stream.flush()
