"""A chaos worker: one process doing locked read-modify-writes through the public API.

Each worker is a separate process (``multiprocessing`` with the *spawn* start
method: a fresh interpreter, its own ``LockManager``, watchdog thread and
connections, so a SIGSTOP of the process freezes its renewals too, as a real GC
pause or a frozen VM would). It configures Django from ``tests.settings`` with
the run's SQLite file and the proxies' URLs as ``REDLOCK_NODES``, then, until the
run's deadline, picks a resource at random and does::

    phase = ACQUIRING                        # <- a majority outage may start here
    with <lock on the resource>:             # LockNotAcquired / QuorumUnavailable
        claim(fence); value = read()         # claimed before it is read (db rows, ctr)
        if not lock.owned(): skip            # the careful client's last check
        phase = CRITICAL                     # <- the nemesis may SIGSTOP or SIGKILL us here
        sleep(think)                         #    (a GC pause between check and write)
        write(value + 1, fence)              # fenced (or not): accepted / refused
        phase = WRITTEN; sleep(think)        # <- or SIGKILL us here, after the write
    # release: LockLost if the lease ran out or was taken meanwhile

and appends one :class:`~tests.chaos.history.Op` per attempt to its JSONL file
(resources: :mod:`tests.chaos.resources`).

The ``family`` schedule's work items are the lock family instead
(:meth:`Worker.family_op`): ``rw-write:<n>`` (``write_lock``, the same fenced
read-modify-write of counter ``rw:<n>``), ``rw-read:<n>`` (``read_lock``, a
claim that raises the stored fence and two reads, which must agree),
``sem:<n>`` (a permit of ``semaphore("chaos-sem:<n>", permits)``),
``multi:<n>`` (``multi_lock`` over two of the counters ``mx:<n>a/b/c``, asked
in a random order, each written with its own name's fence) and ``seg:<n>`` (a
segment of ``segments("chaos-seg:<n>", 2)``, a purchase: the segment's counter
``seg:<n>.<i>`` written with the segment's fence). Each holder
checks ``owned()``, joins the resource's set of those inside (learning who was
already in), stays for the think time (``CRITICAL``: where the nemesis pauses
it), leaves the set, and asks ``owned()`` again: the checker counts who met whom
among the sections whose lease covered them.
The shared ``phase`` array tells the nemesis when a worker is between its last
check and its write, which is where a pause does harm.
"""

from __future__ import annotations

import logging
import os
import random
import time
from typing import Any

from .history import JsonlWriter, Op
from .resources import counter_keys as counter_keys_of

PHASE_STARTING, PHASE_READY, PHASE_IDLE, PHASE_CRITICAL, PHASE_DONE = 0, 1, 2, 3, 4
PHASE_ACQUIRING, PHASE_WRITTEN, PHASE_DEAD = 5, 6, 7

#: How long a worker waits for the start signal before giving up.
START_WAIT = 120.0


def _setup_django(cfg: dict[str, Any]) -> None:
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    os.environ["REDLOCK_TEST_DB"] = cfg["db_path"]
    from django.conf import settings

    # Several processes write one SQLite file: wait for its write lock rather than
    # fail at once (a worker SIGSTOPped inside a statement holds it for the pause).
    settings.DATABASES["default"]["OPTIONS"] = {"timeout": 10}
    settings.REDLOCK_NODES = list(cfg["node_urls"][cfg["index"]])  # this worker's own links
    settings.REDLOCK = {
        "KEY_PREFIX": "chaos",
        "TTL": cfg["ttl"],
        "TIMEOUT": cfg["timeout"],
        "NODE_TIMEOUT": cfg["node_timeout"],
        "RETRY_DELAY": cfg["retry_delay"],
        "AUTO_RENEW": True,
        # failover: this worker's setting (runner.failover_acks); 0 elsewhere.
        "REPLICA_ACKS": int((cfg.get("replica_acks") or [0] * (cfg["index"] + 1))[cfg["index"]]),
    }
    import django

    django.setup()
    # The engine logs each lost lock at WARNING; the history records them instead.
    logging.getLogger("django_redlock").setLevel(logging.CRITICAL)


class Worker:
    def __init__(self, cfg: dict[str, Any], index: int, gen: int = 0) -> None:
        import redis

        import django_redlock
        from django_redlock import signals
        from tests.chaos.resources import (
            CLAIM_LUA,
            ENTER_LUA,
            EXIT_LUA,
            READ_CLAIM_LUA,
            WRITE_LUA,
        )
        from tests.testapp.models import Product

        self.cfg = cfg
        self.index = index
        self.gen = gen
        self.rng = random.Random(f"{cfg['seed']}:{cfg['schedule']}:worker{index}:{gen}")
        self.fenced: bool = cfg["fenced"]
        self.ttl: float = cfg["ttl"]
        self.timeout: float = cfg["timeout"]
        self.think: tuple[float, float] = tuple(cfg["think"])  # type: ignore[assignment]
        self.lock_fn = django_redlock.lock
        self.Product = Product
        self.resource_client = redis.Redis.from_url(cfg["resource_url"], socket_timeout=10,
                                                    socket_connect_timeout=10)
        self.write_script = self.resource_client.register_script(WRITE_LUA)
        self.claim_script = self.resource_client.register_script(CLAIM_LUA)
        self.read_claim_script = self.resource_client.register_script(READ_CLAIM_LUA)
        self.enter_script = self.resource_client.register_script(ENTER_LUA)
        self.exit_script = self.resource_client.register_script(EXIT_LUA)
        self.permits: int = int(cfg.get("permits", 2))
        self.permit_think: tuple[float, float] = tuple(  # type: ignore[assignment]
            cfg.get("permit_think", cfg["think"]))
        self.family = {"read": django_redlock.read_lock, "write": django_redlock.write_lock}
        self.semaphore_fn = django_redlock.semaphore
        self.multi_fn = django_redlock.multi_lock
        self.segments_fn = django_redlock.segments
        self.lost: set[tuple[str, int]] = set()
        signals.lock_lost.connect(self._on_lost, weak=False)

    def _on_lost(self, sender: Any, *, name: str, fence: int, **kwargs: Any) -> None:
        self.lost.add((name, fence))

    # -- one operation -------------------------------------------------------------
    def op(self, seq: int, resource: str, phase: Any) -> Op:
        from django.db import OperationalError
        from redis.exceptions import RedisError

        from django_redlock import (
            FencedWriteRejected,
            LockLost,
            LockNotAcquired,
            QuorumUnavailable,
            RedlockError,
        )

        kind, ident = resource.split(":", 1)
        lock_name = f"testapp.product:{ident}" if kind == "db" else f"chaos-{kind}:{ident}"
        op = Op(worker=self.index, seq=seq, resource=resource, lock=lock_name,
                start=time.monotonic(), start_wall=time.time(), gen=self.gen)
        read_fence = "0"
        phase[self.index] = PHASE_ACQUIRING
        try:
            if kind == "db":
                ctx: Any = self.Product.objects.locked(pk=int(ident), ttl=self.ttl,
                                                       timeout=self.timeout)
            else:
                ctx = self.lock_fn(lock_name, ttl=self.ttl, timeout=self.timeout,
                                   label=f"chaos-w{self.index}")
            with ctx as held:
                lock = held.held_lock if kind == "db" else held
                op.acquired = time.monotonic()
                op.lease_start = op.acquired + lock.validity - self.ttl
                phase[self.index] = PHASE_IDLE
                op.fence = lock.fence
                if kind == "db":
                    op.read = held.stock
                elif kind == "ctr" and self.fenced:
                    claimed, value = self.claim_script(
                        keys=[f"chaos:{resource}:value", f"chaos:{resource}:fence"],
                        args=[lock.fence])
                    if not claimed:  # a newer holder claimed it: we are the stale one
                        op.stored_fence = int(value)
                        raise FencedWriteRejected(
                            f"counter {resource} claimed by fence {int(value)}")
                    op.read = int(value)
                    read_fence = str(lock.fence)
                else:
                    value, fence_read = self.resource_client.mget(
                        f"chaos:{resource}:value", f"chaos:{resource}:fence")
                    op.read = int(value or 0)
                    read_fence = (fence_read or b"0").decode()
                op.owned_before_write = lock.owned()
                if op.owned_before_write:
                    phase[self.index] = PHASE_CRITICAL
                    try:
                        time.sleep(self.rng.uniform(*self.think))
                        op.write_start = time.monotonic()
                        if kind == "db":
                            op.write, op.stored_fence = self._write_db(held, lock, op.read + 1,
                                                                       FencedWriteRejected)
                        else:
                            op.write, op.stored_fence = self._write_counter(
                                resource, op, lock, "2" if kind == "cas" else "3", read_fence)
                        op.write_end = time.monotonic()
                        if op.write:
                            phase[self.index] = PHASE_WRITTEN  # a crash here: after the write
                            time.sleep(self.rng.uniform(*self.think))
                    finally:
                        phase[self.index] = PHASE_IDLE
                op.released = time.monotonic()
            if op.write is False:
                op.outcome = "refused-by-fence"
            elif op.write is None:
                op.outcome = "lost"  # owned() was false: the careful client did not write
                op.detail = "lease over before the write"
            else:
                op.outcome = "ok"
        except FencedWriteRejected as e:
            # locked() claims the row right after acquiring; a holder paused between
            # the acquire and the claim finds a newer holder's claim: refused, no write.
            op.write, op.fence = False, op.fence or getattr(e, "fence", 0)
            op.outcome, op.error, op.detail = "refused-by-fence", type(e).__name__, str(e)[:200]
        except LockNotAcquired as e:
            op.outcome, op.error, op.detail = "not-acquired", type(e).__name__, str(e)[:200]
        except QuorumUnavailable as e:
            op.outcome, op.error, op.detail = "quorum-unavailable", type(e).__name__, str(e)[:200]
        except LockLost as e:
            # Raised by release at the end of the block; a refused write stays "refused".
            op.outcome = "refused-by-fence" if op.write is False else "lost"
            op.error, op.detail = type(e).__name__, str(e)[:200]
        except (RedlockError, RedisError, OperationalError, OSError) as e:
            op.outcome, op.error, op.detail = "error", type(e).__name__, str(e)[:200]
        finally:
            phase[self.index] = PHASE_IDLE
        op.end = time.monotonic()
        op.end_wall = time.time()
        op.lost_signal = (lock_name, op.fence) in self.lost if op.fence else False
        return op

    # -- one operation of the lock family ------------------------------------------------
    def family_op(self, seq: int, item: str, phase: Any) -> Op:
        """One hold of a read lock, a write lock, a semaphore permit, a multi-lock
        or a segment (``item`` is ``rw-read:<n>``, ``rw-write:<n>``, ``sem:<n>``,
        ``multi:<n>`` or ``seg:<n>``), with its critical section logged on the
        resource server (see the module docstring)."""
        from django.db import OperationalError
        from redis.exceptions import RedisError

        from django_redlock import (
            FencedWriteRejected,
            LockLost,
            LockNotAcquired,
            QuorumUnavailable,
            RedlockError,
        )
        from tests.chaos.resources import (
            MULTI_NAMES,
            SEGMENTS,
            counter_keys,
            inside_key,
            multi_counter,
            segment_counter,
        )

        kind, ident = item.split(":", 1)
        mode = {"rw-read": "read", "rw-write": "write", "sem": "permit", "multi": "multi",
                "seg": "segment"}[kind]
        # The resource whose set of those inside the section joins.
        place = {"read": "rw", "write": "rw", "permit": "sem", "multi": "mx",
                 "segment": "seg"}[mode] + f":{ident}"
        resource = place
        names: list[str] = []
        if mode == "multi":
            # Two of three counters, in a random order: every two multi-locks share
            # a name (so no two may be inside at once), and callers ask in opposite
            # orders (which must not deadlock).
            names = [multi_counter(ident, n) for n in self.rng.sample(MULTI_NAMES, 2)]
            resource = min(names)
        base = f"chaos-{resource}"
        op = Op(worker=self.index, seq=seq, resource=resource, lock=base,
                start=time.monotonic(), start_wall=time.time(), gen=self.gen, mode=mode,
                names=sorted(names))
        section = f"w{self.index}.{seq}"
        phase[self.index] = PHASE_ACQUIRING
        try:
            options = {"ttl": self.ttl, "timeout": self.timeout, "label": f"chaos-w{self.index}"}
            if mode in ("multi", "segment"):
                op.before = [m.decode() for m in self.resource_client.smembers(inside_key(place))]
            if mode == "permit":
                ctx: Any = self.semaphore_fn(base, self.permits, **options)
            elif mode == "multi":
                ctx = self.multi_fn([f"chaos-{n}" for n in names], **options)
            elif mode == "segment":
                ctx = self.segments_fn(f"chaos-{place}", SEGMENTS, **options)
            else:
                ctx = self.family[mode](base, **options)
            with ctx as held:
                op.acquired = time.monotonic()
                op.lease_start = op.acquired + held.validity - self.ttl
                phase[self.index] = PHASE_IDLE
                op.fence = held.fence
                # The counters this hold writes, each with its own fence.
                writes: list[tuple[str, int]] = []
                if mode == "permit":
                    op.lock = f"{base}#{held.index}"  # the permit's own plain lock
                elif mode == "multi":
                    writes = [(n, held.fences[f"chaos-{n}"]) for n in op.names]
                    op.fence = writes[0][1]
                elif mode == "segment":
                    op.lock = f"chaos-{place}[{held.index}]"  # the segment's plain lock
                    op.resource = resource = segment_counter(ident, held.index)
                    writes = [(resource, held.fence)]
                elif mode == "write":
                    writes = [(resource, held.fence)]
                else:
                    value_key, fence_key, _ = counter_keys(resource)
                    op.read = int(self.read_claim_script(keys=[value_key, fence_key],
                                                         args=[held.fence]))
                reads: list[int] = []
                for counter, fence in writes:
                    value_key, fence_key, _ = counter_keys(counter)
                    claimed, value = self.claim_script(keys=[value_key, fence_key], args=[fence])
                    if not claimed:  # a newer holder (reader or writer) claimed it
                        op.stored_fence = int(value)
                        raise FencedWriteRejected(
                            f"counter {counter} claimed by fence {int(value)}")
                    reads.append(int(value))
                if reads:
                    op.read = reads[0]
                op.owned_before_write = held.owned()
                if op.owned_before_write:
                    op.enter = time.monotonic()
                    op.present = [m.decode() for m in self.enter_script(
                        keys=[inside_key(place)], args=[section])]
                    try:
                        phase[self.index] = PHASE_CRITICAL
                        think = self.permit_think if mode == "permit" else self.think
                        time.sleep(self.rng.uniform(*think))
                        if writes:
                            op.write_start = time.monotonic()
                            applied = []
                            for (counter, fence), read in zip(writes, reads, strict=True):
                                ok, stored = self._write_fenced(counter, op, fence, read)
                                applied.append(ok)
                                if counter == op.resource:
                                    op.stored_fence = stored
                            op.write = all(applied)
                            op.write_end = time.monotonic()
                            if op.write:
                                phase[self.index] = PHASE_WRITTEN
                                time.sleep(self.rng.uniform(*self.think))
                        elif mode == "read":
                            value_key, _, _ = counter_keys(resource)
                            op.read_again = int(self.resource_client.get(value_key) or 0)
                    finally:
                        phase[self.index] = PHASE_IDLE
                        self.exit_script(keys=[inside_key(place)], args=[section])
                        op.exit = time.monotonic()
                        op.valid = held.owned()  # after leaving: the lease covered it all
                op.released = time.monotonic()
            if op.write is False:
                op.outcome = "refused-by-fence"
            elif op.owned_before_write is False:
                op.outcome, op.detail = "lost", "lease over before the section"
            elif op.valid is False:
                op.outcome, op.detail = "lost", "lease over at the end of the section"
            else:
                op.outcome = "ok"
        except FencedWriteRejected as e:
            op.write = False
            op.outcome, op.error, op.detail = "refused-by-fence", type(e).__name__, str(e)[:200]
        except LockNotAcquired as e:
            op.outcome, op.error, op.detail = "not-acquired", type(e).__name__, str(e)[:200]
        except QuorumUnavailable as e:
            op.outcome, op.error, op.detail = "quorum-unavailable", type(e).__name__, str(e)[:200]
        except LockLost as e:
            op.outcome = "refused-by-fence" if op.write is False else "lost"
            op.error, op.detail = type(e).__name__, str(e)[:200]
        except (RedlockError, RedisError, OperationalError, OSError) as e:
            op.outcome, op.error, op.detail = "error", type(e).__name__, str(e)[:200]
        finally:
            phase[self.index] = PHASE_IDLE
        op.end = time.monotonic()
        op.end_wall = time.time()
        op.lost_signal = (op.lock, op.fence) in self.lost if op.fence else False
        return op

    def _write_fenced(self, counter: str, op: Op, fence: int, read: int
                      ) -> tuple[bool, int]:
        """Write ``read + 1`` to ``counter`` while it still carries our claim (``fence``)."""
        value_key, fence_key, log_key = counter_keys_of(counter)
        applied, stored = self.write_script(
            keys=[value_key, fence_key, log_key],
            args=[read + 1, fence, "3", f"w{self.index}.{op.seq}", str(fence)])
        return applied == 1, int(stored)

    def _write_db(self, row: Any, lock: Any, new: int, rejected: type[Exception]
                  ) -> tuple[bool, int | None]:
        if self.fenced:
            row.stock = new
            try:
                row.fenced_save(lock, update_fields=["stock"])
            except rejected as e:
                return False, getattr(e, "context", {}).get("stored_fence")
            return True, None
        # The resource does not check: the same columns, written unconditionally.
        n = self.Product.objects.filter(pk=row.pk).update(stock=new, fence=lock.fence)
        return n == 1, None

    def _write_counter(self, resource: str, op: Op, lock: Any, check: str, read_fence: str
                       ) -> tuple[bool, int | None]:
        value_key, fence_key, log_key = (f"chaos:{resource}:value", f"chaos:{resource}:fence",
                                         f"chaos:{resource}:log")
        assert op.read is not None
        applied, stored = self.write_script(
            keys=[value_key, fence_key, log_key],
            args=[op.read + 1, lock.fence, check if self.fenced else "0",
                  f"w{self.index}.{op.seq}", read_fence])
        return applied == 1, int(stored)


def worker_main(cfg: dict[str, Any], index: int, phase: Any, go: Any, start_at: Any,
                gen: int = 0, ops_done: Any = None, current: Any = None) -> None:
    """Process entry point. Bounded: at most ``cfg['max_ops']`` operations, none
    started after ``start_at + cfg['duration']``. ``gen`` > 0: a restart after a
    crash (its own history file; sequence numbers from ``gen * 1_000_000``)."""
    phase[index] = PHASE_STARTING
    cfg = {**cfg, "index": index}
    _setup_django(cfg)
    worker = Worker(cfg, index, gen)
    out = JsonlWriter(os.path.join(cfg["out_dir"], f"worker-{index}.{gen}.jsonl"))
    phase[index] = PHASE_READY
    try:
        if not go.wait(START_WAIT):
            return
        deadline = start_at.value + cfg["duration"]
        everything: list[str] = list(cfg["resources"])
        # failover: each worker draws from its own REPLICA_ACKS half of the resources.
        own = (cfg.get("worker_resources") or [None] * (index + 1))[index]
        resources: list[str] = list(own) if own else everything
        pause = tuple(cfg["between"])
        for seq in range(gen * 1_000_000, gen * 1_000_000 + int(cfg["max_ops"])):
            if time.monotonic() >= deadline:
                break
            resource = worker.rng.choice(resources)
            if current is not None:
                current[index] = everything.index(resource)
            family = resource.startswith(("rw-", "sem:", "multi:", "seg:"))
            out.write(worker.family_op(seq, resource, phase) if family
                      else worker.op(seq, resource, phase))
            if ops_done is not None:
                ops_done[index] += 1
            time.sleep(worker.rng.uniform(*pause))
    finally:
        phase[index] = PHASE_DONE
        out.close()
        from django_redlock.conf import reset_manager

        reset_manager()
