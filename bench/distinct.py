"""Distinct names: many processes, each locking names nobody else uses (issue 23).

1, 2, 4 and 8 processes (spawned once, reused) on 1 node, each acquiring and
releasing a new name every time (``bench:dn:<round>:<process>:<i>``, fencing
on, as ``lock()`` always is) for a fixed time, all starting at one agreed
instant: total acquisitions per second, against the server's own ceiling for
the same work. The ceiling is ``redis-benchmark`` (Debian's redis-tools, or
valkey's) sending the very script calls a lock sends (the acquire script with
its keys and arguments, then the release script), from as many connections as
there are processes, on fresh random names (``__rand_int__``): the pair rate
is ``1 / (1/acquire rate + 1/release rate)``. redis-benchmark's release runs
on names not held (the script's read path), so the ceiling is a little
optimistic and the ratio a little low. The server time per pair
(``INFO commandstats`` over the 8-process run) gives a second ceiling: one
server core's worth of those calls.

Memory per name: on a node of its own, 2,000 names (10,000 in a full run)
acquired and released once; ``INFO memory``'s ``used_memory`` over the
baseline, per name, right after (each name leaves its fencing counter
behind) and once the counters expired. A counter expires an hour after the
node's clock passes it (``FENCE_GRACE_MS`` in ``django_redlock.engine.rounds``,
a constant, not a setting); this bench shortens it to 2 s in its own process
only, so "an hour after use" is measured in seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import shutil
import subprocess
import time
from multiprocessing.connection import Connection
from typing import Any

import redis

from .libs import quiet_loggers
from .procs import stop_workers
from .stats import median

COUNTS = (1, 2, 4, 8)
SECONDS = {"quick": 1.0, "full": 2.0}
BENCH_REQUESTS = {"quick": 20_000, "full": 100_000}
MEMORY_NAMES = {"quick": 2_000, "full": 10_000}
GRACE_MS = 2_000
KEYSPACE = 100_000_000


# -- worker processes ---------------------------------------------------------
def _worker_main(conn: Connection, url: str, index: int) -> None:
    from django_redlock import LockManager

    quiet_loggers()
    mgr = LockManager([url], ttl=10.0, auto_renew=False)
    clock = time.monotonic
    while True:
        msg = conn.recv()
        if msg is None:
            break
        prefix, start_at, seconds = msg
        delay = start_at - clock()
        if delay > 0:
            time.sleep(delay)
        deadline = start_at + seconds
        done = errors = 0
        while clock() < deadline:
            lock = mgr.lock(f"{prefix}:{index}:{done}")
            try:
                if lock.acquire(timeout=1.0):
                    lock.release()
                    done += 1
                else:
                    errors += 1
            except Exception:  # noqa: BLE001 - counted, never stops the bench
                errors += 1
        conn.send((done, errors))
    mgr.close()


# -- the ceiling --------------------------------------------------------------
def benchmark_commands(token: str = "0123456789abcdef") -> list[list[str]]:
    """The acquire and the release a lock sends, as redis-benchmark arguments,
    on a random name each (``__rand_int__``)."""
    from django_redlock.core import keys
    from django_redlock.core.owner import owner_json
    from django_redlock.engine import rounds

    key = keys.lock_key("redlock", "bench:dn:__rand_int__")
    kb, fk, wk = (k.encode() for k in (key, keys.fence_key(key), keys.waiters_key(key)))
    acquire = rounds.acquire_call(kb, fk, wk, token, 10_000,
                                  rounds.attempt_owner(owner_json(None), 1), True)
    release = rounds.release_requests(1, kb, fk, wk, token, 1, None)[0]
    assert release is not None
    out = []
    for call in (acquire, release):
        args = [b"EVALSHA", call.script.sha, str(len(call.keys)).encode(), *call.keys,
                *(a if isinstance(a, bytes) else str(a).encode() for a in call.args)]
        out.append([a.decode() for a in args])
    return out


def parse_benchmark_csv(text: str) -> float:
    """Requests per second from ``redis-benchmark --csv`` (one test).

    The test's name is the command line, quotes unescaped (the owner JSON has
    some), so a row is read from its end: ``"<name>","rps",`` then six latency
    columns. An error reply (``Error from server: ...``) raises ValueError."""
    if "Error from server" in text or "ERR" in text.split("\n", 1)[0]:
        raise ValueError(f"redis-benchmark got an error: {text.strip()[-300:]!r}")
    for line in reversed(text.strip().splitlines()):
        fields = line.rsplit(",", 7)
        if len(fields) == 8 and not line.startswith('"test"'):
            return float(fields[1].strip('"'))
    raise ValueError(f"no result in redis-benchmark's output: {text[-200:]!r}")


def pair_rate(acquire_rps: float, release_rps: float) -> float:
    """Acquire + release pairs per second from the two separate rates."""
    if acquire_rps <= 0 or release_rps <= 0:
        return 0.0
    return 1.0 / (1.0 / acquire_rps + 1.0 / release_rps)


def _benchmark_binary() -> str | None:
    return shutil.which("redis-benchmark") or shutil.which("valkey-benchmark")


class DistinctNames:
    def __init__(self, urls1: list[str], *, quick: bool) -> None:
        self.profile = "quick" if quick else "full"
        self.url = urls1[0]
        self.client = redis.Redis.from_url(self.url)
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for i in range(max(COUNTS)):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(child, self.url, i), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.rounds: list[dict[int, dict[str, float]]] = []
        self.ceilings: list[dict[str, float]] = []
        self.memory: dict[str, Any] = {}
        self.errors = 0
        self.binary = _benchmark_binary()

    def close(self) -> None:
        stop_workers(self.conns, self.procs)
        self.client.close()

    def _server_usec(self) -> tuple[int, int]:
        stats = self.client.info("commandstats")
        calls = usec = 0
        for name in ("cmdstat_evalsha", "cmdstat_eval"):
            if name in stats:
                calls += int(stats[name]["calls"])
                usec += int(stats[name]["usec"])
        return calls, usec

    def _procs(self, n: int, rnd: int) -> dict[str, float]:
        seconds = SECONDS[self.profile]
        start_at = time.monotonic() + 0.2
        calls0, usec0 = self._server_usec()
        for conn in self.conns[:n]:
            conn.send((f"bench:dn:{rnd}:{n}", start_at, seconds))
        done = 0
        for conn in self.conns[:n]:
            if not conn.poll(seconds + 30):
                raise RuntimeError("a distinct-names worker did not answer")
            got, errors = conn.recv()
            done += got
            self.errors += errors
        calls, usec = (a - b for a, b in zip(self._server_usec(), (calls0, usec0)))
        return {"acq_s": done / seconds,
                "server_us_per_pair": usec / max(1, done)}

    def _ceiling(self, clients: int) -> dict[str, float]:
        if self.binary is None:
            return {}
        port = self.client.connection_pool.connection_kwargs.get("port", 6379)
        host = self.client.connection_pool.connection_kwargs.get("host", "127.0.0.1")
        acquire, release = benchmark_commands()
        # The scripts are loaded once (a lock loads them on its first NOSCRIPT).
        from django_redlock.engine import rounds

        for script in (rounds.ACQUIRE, rounds.RELEASE):
            self.client.script_load(script.source)
        rates = []
        for args in (acquire, release):
            out = subprocess.run(
                [self.binary, "-h", str(host), "-p", str(port), "-c", str(clients),
                 "-n", str(BENCH_REQUESTS[self.profile]), "-r", str(KEYSPACE), "--csv", *args],
                capture_output=True, text=True, timeout=120, check=True)
            rates.append(parse_benchmark_csv(out.stdout))
        return {"acquire_rps": rates[0], "release_rps": rates[1],
                "pair_s": pair_rate(rates[0], rates[1])}

    def _memory(self) -> dict[str, Any]:
        """Bytes per name after use and after the fence counters expired, on a node
        of its own, with the counters' grace cut to GRACE_MS in this process."""
        from django_redlock import LockManager
        from django_redlock.engine import rounds
        from django_redlock.testing import RedisNodes

        names = MEMORY_NAMES[self.profile]
        saved = rounds._FENCE_GRACE_B
        rounds._FENCE_GRACE_B = b"%d" % GRACE_MS
        try:
            with RedisNodes(1) as nodes:
                client = redis.Redis.from_url(nodes.urls[0])
                mgr = LockManager(nodes.urls, ttl=10.0, auto_renew=False)
                try:
                    warm = mgr.lock("bench:mem:warm")  # scripts loaded, connection up
                    warm.acquire(timeout=5)
                    warm.release()
                    time.sleep(GRACE_MS / 1000 + 1.5)
                    base = client.info("memory")["used_memory"]
                    base_keys = client.dbsize()
                    for i in range(names):
                        lock = mgr.lock(f"bench:mem:{i}")
                        lock.acquire(timeout=5)
                        lock.release()
                    used = client.info("memory")["used_memory"]
                    keys_used = client.dbsize() - base_keys
                    sample = client.memory_usage("{redlock:bench:mem:0}:fence")
                    deadline = time.monotonic() + GRACE_MS / 1000 + 20
                    while client.dbsize() > base_keys and time.monotonic() < deadline:
                        time.sleep(0.25)  # the server's own expiry cycle, no reads
                    time.sleep(1.0)  # a cron tick to shrink what it can
                    after = client.info("memory")["used_memory"]
                    keys_after = client.dbsize() - base_keys
                finally:
                    mgr.close()
                    client.close()
        finally:
            rounds._FENCE_GRACE_B = saved
        return {"names": names, "grace_ms": GRACE_MS, "keys_after_use": keys_used,
                "keys_after_expiry": keys_after, "fence_key_bytes": sample,
                "bytes_per_name_used": (used - base) / names,
                "bytes_per_name_expired": (after - base) / names}

    def run_round(self, rng: random.Random) -> None:
        rnd = len(self.rounds)
        order = list(COUNTS)
        rng.shuffle(order)
        row = {n: self._procs(n, rnd) for n in order}
        ceiling = self._ceiling(max(COUNTS))
        if ceiling:
            self.ceilings.append(ceiling)
            for n in order:
                row[n]["x_ceiling"] = row[n]["acq_s"] / ceiling["pair_s"]
        self.rounds.append(row)
        if not self.memory:
            self.memory = self._memory()

    def summary(self) -> dict[str, Any]:
        rows: dict[str, Any] = {}
        for n in COUNTS:
            per = [r[n] for r in self.rounds if n in r]
            rows[str(n)] = {"processes": n,
                            "acq_s": median(p["acq_s"] for p in per),
                            "x_ceiling": median(p["x_ceiling"] for p in per
                                                if "x_ceiling" in p),
                            "server_us_per_pair": median(p["server_us_per_pair"]
                                                         for p in per)}
        ceiling: dict[str, Any] = {}
        if self.ceilings:
            ceiling = {k: median(c[k] for c in self.ceilings)
                       for k in ("acquire_rps", "release_rps", "pair_s")}
        else:
            ceiling = {"skipped": "redis-benchmark not found (Debian: redis-tools)"}
        top = rows[str(max(COUNTS))]
        if top["server_us_per_pair"]:
            ceiling["server_time_pair_s"] = 1e6 / top["server_us_per_pair"]
        return {"rows": rows, "ceiling": ceiling, "memory": self.memory,
                "errors": self.errors, "seconds": SECONDS[self.profile]}
