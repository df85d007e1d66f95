"""The contestants: the two floors, django-redlock and the peers, behind one interface.

Every lock library is used the way its README shows: a new lock object per critical
section, a blocking ``acquire()`` and a ``release()``, lease 10 s. Each has
``op()`` (one uncontended acquire + release, what the latency table measures) and
``acquire(lock, timeout)`` / ``release(lock)`` for the multi-process measurements.

The floors are not locks: the least a Python client can do for one acquire and one
release (``SET key token NX PX`` then an ``EVALSHA`` compare-and-delete), once
hand-encoded over raw sockets and once through redis-py.
"""

from __future__ import annotations

import collections
import inspect
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import redis

TTL = 10.0
TTL_MS = int(TTL * 1000)
#: Bound on an uncontended acquire (pottery's blocking acquire never gives up).
OP_TIMEOUT = 5.0

#: The compare-and-delete every lock library's release boils down to.
CAD_SCRIPT = b"if redis.call('get', KEYS[1]) == ARGV[1] then " \
             b"return redis.call('del', KEYS[1]) else return 0 end"

_GET_NEEDS_NAME = (
    inspect.signature(redis.ConnectionPool.get_connection).parameters["command_name"].default
    is inspect.Parameter.empty)


class BenchError(RuntimeError):
    """A contestant misbehaved (an uncontended acquire failed, a reply was wrong)."""


def quiet_loggers() -> None:
    """Failures are counted in the results; one log line per failed request would
    drown the progress lines on a machine where nodes time out under load."""
    for name in ("django_redlock", "pottery", "redis_lock"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


# -- floors ---------------------------------------------------------------------
def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read_reply(sock: socket.socket) -> bytes:
    """One short single-line reply (``+OK``, ``:1``, ``$-1``): enough for the floor."""
    data = sock.recv(256)
    while not data.endswith(b"\r\n"):
        more = sock.recv(256)
        if not more:
            raise BenchError("connection closed")
        data += more
    return data


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


class RawFloor:
    """The physical floor: hand-encoded RESP on raw sockets, all nodes in parallel.

    Per operation: a fresh token, ``SET key token NX PX 10000`` sent to every node
    before any reply is read, then ``EVALSHA <cad> 1 key token`` the same way.
    """

    def __init__(self, urls: list[str], key: str) -> None:
        self.socks = [_connect(u) for u in urls]
        self.key = key.encode()
        self.prefix = os.urandom(8).hex().encode()
        self.count = 0
        load = b"*3\r\n$6\r\nSCRIPT\r\n$4\r\nLOAD\r\n" + _bulk(CAD_SCRIPT)
        for s in self.socks:
            s.sendall(load)
        for s in self.socks:
            reply = _read_reply(s)
            sha = reply.split(b"\r\n")[1]
        self.sha = sha
        self._set_head = b"*6\r\n$3\r\nSET\r\n" + _bulk(self.key)
        self._set_tail = b"$2\r\nNX\r\n$2\r\nPX\r\n" + _bulk(b"%d" % TTL_MS)
        self._del_head = b"*5\r\n$7\r\nEVALSHA\r\n" + _bulk(self.sha) + b"$1\r\n1\r\n" + _bulk(self.key)

    def commands(self) -> tuple[bytes, bytes]:
        """A fresh token's ``SET NX PX`` and compare-and-delete, encoded (the
        asyncio floors send the same bytes)."""
        self.count += 1
        token = _bulk(b"%s%d" % (self.prefix, self.count))
        return self._set_head + token + self._set_tail, self._del_head + token

    def op(self) -> None:
        socks = self.socks
        cmd, release = self.commands()
        for s in socks:
            s.sendall(cmd)
        for s in socks:
            if _read_reply(s) != b"+OK\r\n":
                raise BenchError("raw floor: SET NX failed")
        cmd = release
        for s in socks:
            s.sendall(cmd)
        for s in socks:
            if _read_reply(s) != b":1\r\n":
                raise BenchError("raw floor: compare-and-delete failed")

    def close(self) -> None:
        for s in self.socks:
            s.close()


class ScriptsFloor:
    """Our own floor: django-redlock's acquire and release scripts, with the
    arguments the engine sends (fencing and owner on), over raw sockets with a
    ``hiredis`` reader, every node sent to before any reply is read. What the
    scripts cost with no client code at all: issue 23's uncontended goal is
    within 1.15x of it (``bench.layers`` takes the rest apart)."""

    def __init__(self, urls: list[str], name: str) -> None:
        import hiredis

        from django_redlock.core.keys import fence_key, lock_key, waiters_key
        from django_redlock.core.owner import owner_json
        from django_redlock.transport.resp import PRELOAD, PRELOAD_SCRIPTS

        key = lock_key("redlock", name)
        self.keys = (key.encode(), fence_key(key).encode(), waiters_key(key).encode())
        self.owner = owner_json(None)
        self.socks = []
        self.readers = []
        for url in urls:
            sock = _connect(url)
            self.socks.append(sock)
            self.readers.append(hiredis.Reader())
        self.buf = bytearray(65536)
        for i, sock in enumerate(self.socks):
            sock.sendall(PRELOAD)
            for _ in PRELOAD_SCRIPTS:
                self._reply(i)

    def _reply(self, i: int) -> Any:
        reader, sock, buf = self.readers[i], self.socks[i], self.buf
        while True:
            reply = reader.gets()
            if reply is not False:
                return reply
            n = sock.recv_into(buf)
            if not n:
                raise ConnectionError("closed")
            reader.feed(buf, 0, n)

    def _round(self, packed: bytes) -> list[Any]:
        for sock in self.socks:
            sock.sendall(packed)
        return [self._reply(i) for i in range(len(self.socks))]

    def op(self) -> None:
        from django_redlock.core.owner import new_token
        from django_redlock.engine import rounds

        key, fkey, wkey = self.keys
        token = new_token()
        replies = self._round(
            rounds.acquire_call(key, fkey, wkey, token, TTL_MS, self.owner, True).packed)
        if not all(isinstance(r, list) and r[0] == 1 for r in replies):
            raise BenchError(f"scripts floor: not granted: {replies!r}")
        fence = max(int(r[1]) for r in replies)
        released = self._round(
            rounds.release_requests(1, key, fkey, wkey, token, fence, None)[0].packed)
        if not all(r == 1 for r in released):
            raise BenchError(f"scripts floor: not released: {released!r}")

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


def loop_op(loop: Any, once: Callable[[], Any]) -> Callable[[], None]:
    """``op()`` running coroutine ``once()`` in ``loop``, carrying
    ``timed_chunk(count, warmup, lat, on_error)``, which times a batch inside
    the running loop, as an ASGI server's one long-lived loop runs them (see
    ``bench.uncontended.timed_chunk``)."""
    run = loop.run_until_complete

    def op() -> None:
        run(once())

    async def batch(count: int, warmup: int, lat: list[int],
                    on_error: Callable[[Exception], None]) -> None:
        clock = time.perf_counter_ns
        for i in range(warmup + count):
            t0 = clock()
            try:
                await once()
            except Exception as e:  # noqa: BLE001 - counted and reported, not fatal
                on_error(e)
                continue
            if i >= warmup:
                lat.append(clock() - t0)

    def timed_chunk(count: int, warmup: int, lat: list[int],
                    on_error: Callable[[Exception], None]) -> int:
        begin = time.perf_counter_ns()
        run(batch(count, warmup, lat, on_error))
        return time.perf_counter_ns() - begin

    op.timed_chunk = timed_chunk  # type: ignore[attr-defined]
    return op


class AsyncRawFloor:
    """The asyncio floor (issue 23's "asyncio within 1.1x of sync"): the raw
    floor's two commands, hand-encoded, on asyncio streams, timed inside one
    running loop as ``drl-async-1`` is. Its ratio to ``raw-1`` is what asyncio
    itself costs per round trip on this machine (the event loop's wake-up
    and a task step per reply), which no asyncio client can go below."""

    def __init__(self, urls: list[str], key: str) -> None:
        import asyncio

        sync = RawFloor(urls, key)  # the script's SHA and the encodings
        sync.close()
        self.enc = sync
        self.loop = asyncio.new_event_loop()

        async def connect() -> list[tuple[Any, Any]]:
            streams = []
            for url in urls:
                parts = urlsplit(url)
                reader, writer = await asyncio.open_connection(
                    parts.hostname or "127.0.0.1", parts.port or 6379)
                writer.get_extra_info("socket").setsockopt(
                    socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                streams.append((reader, writer))
            return streams

        self.streams = self.loop.run_until_complete(connect())

    def make_op(self) -> Callable[[], None]:
        enc, streams = self.enc, self.streams

        async def once() -> None:
            cmd, release = enc.commands()
            for _, writer in streams:
                writer.write(cmd)
            for reader, _ in streams:
                if await reader.readuntil(b"\r\n") != b"+OK\r\n":
                    raise BenchError("asyncio floor: SET NX failed")
            cmd = release
            for _, writer in streams:
                writer.write(cmd)
            for reader, _ in streams:
                if await reader.readuntil(b"\r\n") != b":1\r\n":
                    raise BenchError("asyncio floor: compare-and-delete failed")

        return loop_op(self.loop, once)

    def close(self) -> None:
        async def closed() -> None:
            for _, writer in self.streams:
                writer.close()
                await writer.wait_closed()

        self.loop.run_until_complete(closed())
        self.loop.close()


class AsyncProtocolFloor:
    """The same two commands through an ``asyncio.Protocol`` of our own: each
    request gets a future, which ``data_received`` sets with its reply line;
    timed inside one running loop as ``raw-async-1`` is.

    What a transport of our own built on a protocol instead of redis-py's
    streams could reach at best: set beside ``raw-async-1``, it says whether
    the stream or the loop's wake-up is what asyncio costs per round trip."""

    def __init__(self, urls: list[str], key: str) -> None:
        import asyncio

        sync = RawFloor(urls[:1], key)  # the script's SHA and the encodings
        sync.close()
        self.enc = sync
        self.loop = loop = asyncio.new_event_loop()

        class LineProtocol(asyncio.Protocol):
            """Replies of one line each (+OK, :1), matched to requests in order."""

            def __init__(self) -> None:
                self.buffer = b""
                self.waiting: collections.deque[Any] = collections.deque()
                self.transport: Any = None

            def connection_made(self, transport: Any) -> None:
                self.transport = transport
                transport.get_extra_info("socket").setsockopt(
                    socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def data_received(self, data: bytes) -> None:
                buffer = self.buffer + data
                start = 0
                while self.waiting:
                    end = buffer.find(b"\r\n", start)
                    if end < 0:
                        break
                    self.waiting.popleft().set_result(buffer[start:end + 2])
                    start = end + 2
                self.buffer = buffer[start:]

            def ask(self, request: bytes) -> Any:
                reply = loop.create_future()
                self.waiting.append(reply)
                self.transport.write(request)
                return reply

        parts = urlsplit(urls[0])
        _, self.protocol = loop.run_until_complete(loop.create_connection(
            LineProtocol, parts.hostname or "127.0.0.1", parts.port or 6379))

    def make_op(self) -> Callable[[], None]:
        enc, protocol = self.enc, self.protocol

        async def once() -> None:
            acquire, release = enc.commands()
            if await protocol.ask(acquire) != b"+OK\r\n":
                raise BenchError("asyncio protocol floor: SET NX failed")
            if await protocol.ask(release) != b":1\r\n":
                raise BenchError("asyncio protocol floor: compare-and-delete failed")

        return loop_op(self.loop, once)

    def close(self) -> None:
        import asyncio

        self.protocol.transport.close()
        self.loop.run_until_complete(asyncio.sleep(0))  # its connection_lost runs
        self.loop.close()


class RedisPyFloor:
    """The same two commands through redis-py (hiredis parser when installed).

    One node: the client's ``set()`` and ``evalsha()``. Several nodes: a
    connection checked out of each node's pool, every ``SET`` sent before any
    reply is read, then every ``EVALSHA`` the same way (what a parallel Redlock
    client built on redis-py can do without threads).
    """

    def __init__(self, urls: list[str], key: str) -> None:
        self.clients = [redis.Redis.from_url(u) for u in urls]
        self.pools = [c.connection_pool for c in self.clients]
        self.key = key
        self.prefix = os.urandom(8).hex()
        self.count = 0
        self.sha = self.clients[0].script_load(CAD_SCRIPT)
        for c in self.clients[1:]:
            c.script_load(CAD_SCRIPT)
        self.op = self._op_one if len(urls) == 1 else self._op_many

    def _op_one(self) -> None:
        self.count += 1
        token = f"{self.prefix}{self.count}"
        client = self.clients[0]
        if not client.set(self.key, token, nx=True, px=TTL_MS):
            raise BenchError("redis-py floor: SET NX failed")
        if client.evalsha(self.sha, 1, self.key, token) != 1:
            raise BenchError("redis-py floor: compare-and-delete failed")

    def _get(self, pool: Any) -> Any:
        return pool.get_connection("_") if _GET_NEEDS_NAME else pool.get_connection()

    def _op_many(self) -> None:
        self.count += 1
        token = f"{self.prefix}{self.count}"
        conns = [self._get(p) for p in self.pools]
        try:
            for c in conns:
                c.send_command("SET", self.key, token, "NX", "PX", TTL_MS)
            for c in conns:
                if c.read_response() != b"OK":
                    raise BenchError("redis-py floor: SET NX failed")
            for c in conns:
                c.send_command("EVALSHA", self.sha, 1, self.key, token)
            for c in conns:
                if c.read_response() != 1:
                    raise BenchError("redis-py floor: compare-and-delete failed")
        finally:
            for p, c in zip(self.pools, conns):
                p.release(c)

    def close(self) -> None:
        for c in self.clients:
            c.close()


# -- lock libraries ---------------------------------------------------------------
class Contestant:
    """A lock library on a set of nodes."""

    label = ""
    nodes = 1

    def new(self, name: str) -> Any:
        raise NotImplementedError

    def acquire(self, lock: Any, timeout: float) -> bool:
        raise NotImplementedError

    def release(self, lock: Any) -> None:
        lock.release()

    def make_op(self, name: str) -> Callable[[], None]:
        """One blocking acquire (bounded, so a dead node cannot hang the run) + release."""
        new, acquire, release = self.new, self.acquire, self.release

        def op() -> None:
            lock = new(name)
            if not acquire(lock, OP_TIMEOUT):
                raise BenchError(f"{self.label}: uncontended acquire failed")
            release(lock)
        return op

    def close(self) -> None:
        pass


class DjangoRedlock(Contestant):
    """django-redlock with fencing and owner metadata (always stored), lease 10 s."""

    def __init__(self, urls: list[str], *, auto_renew: bool, kind: str = "lock") -> None:
        from django_redlock import LockManager

        self.manager = LockManager(urls, ttl=TTL, auto_renew=auto_renew)
        self.auto_renew = auto_renew
        self.nodes = len(urls)
        #: "lock", "read_lock" or "write_lock": the family member measured.
        self.factory = getattr(self.manager, kind)

    def new(self, name: str) -> Any:
        return self.factory(name, fencing=True)

    def acquire(self, lock: Any, timeout: float) -> bool:
        return bool(lock.acquire(timeout=timeout))

    def close(self) -> None:
        self.manager.close()


class DjangoRedlockAsync(DjangoRedlock):
    """django-redlock's asyncio flavour (``alock``), driven from one event loop
    that lives as long as the contestant.

    Timed inside the running loop (``per_call=False``): a batch of operations
    runs in one ``run_until_complete``, each acquire + release timed within it,
    as an ASGI server's one long-lived loop runs them. With ``per_call=True``,
    each operation is one ``run_until_complete`` of an acquire + release: the
    loop's own start and stop (about 20 µs here) are paid per operation, as an
    async view run by ``async_to_sync`` pays them per request."""

    def __init__(self, urls: list[str], *, per_call: bool = False) -> None:
        import asyncio

        super().__init__(urls, auto_renew=False)
        self.loop = asyncio.new_event_loop()
        self.factory = self.manager.alock
        self.per_call = per_call

    def make_op(self, name: str) -> Callable[[], None]:
        """One operation per call; unless ``per_call``, the op also carries
        ``timed_chunk(count, warmup, lat, on_error)``, which times a batch
        inside the running loop (see ``bench.uncontended.timed_chunk``)."""
        new, run = self.new, self.loop.run_until_complete

        async def once() -> None:
            lock = new(name)
            if not await lock.acquire(timeout=OP_TIMEOUT):
                raise BenchError(f"{self.label}: uncontended acquire failed")
            await lock.release()

        if self.per_call:
            def op() -> None:
                run(once())
            return op
        return loop_op(self.loop, once)

    def close(self) -> None:
        transport = getattr(self.manager, "_async_transport", None)
        if transport is not None:
            self.loop.run_until_complete(transport.aclose())
        self.loop.close()
        self.manager.close()


class RedisPyLock(Contestant):
    """redis-py's ``Lock`` (SET NX PX, Lua release, 0.1 s sleep loop when busy)."""

    def __init__(self, urls: list[str]) -> None:
        self.client = redis.Redis.from_url(urls[0])

    def new(self, name: str) -> Any:
        return self.client.lock(name, timeout=TTL)

    def acquire(self, lock: Any, timeout: float) -> bool:
        return bool(lock.acquire(blocking=True, blocking_timeout=timeout))

    def close(self) -> None:
        self.client.close()


class PythonRedisLock(Contestant):
    """python-redis-lock (GET + SET NX EX, BLPOP on a signal list when busy)."""

    def __init__(self, urls: list[str]) -> None:
        import redis_lock

        self.module = redis_lock
        self.client = redis.StrictRedis.from_url(urls[0])

    def new(self, name: str) -> Any:
        return self.module.Lock(self.client, name, expire=int(TTL))

    def acquire(self, lock: Any, timeout: float) -> bool:
        # Whole seconds only (it truncates), and at least 1 (0 means "the lease").
        return bool(lock.acquire(blocking=True, timeout=max(1, math.ceil(timeout))))

    def close(self) -> None:
        self.client.close()


class PotteryRedlock(Contestant):
    """pottery's ``Redlock`` (a thread pool per call, random 0-0.2 s retry sleep)."""

    def __init__(self, urls: list[str]) -> None:
        from pottery import Redlock

        self.cls = Redlock
        self.masters = {redis.Redis.from_url(u) for u in urls}
        self.nodes = len(urls)

    def new(self, name: str) -> Any:
        return self.cls(key=name, masters=self.masters, auto_release_time=TTL)

    def acquire(self, lock: Any, timeout: float) -> bool:
        return bool(lock.acquire(timeout=timeout))

    def close(self) -> None:
        for m in self.masters:
            m.close()


#: id -> (label, builder(urls1, urls5)). The ids are the keys of results.json.
LIBRARIES: dict[str, tuple[str, Callable[[list[str], list[str]], Contestant]]] = {
    "drl-1": ("django-redlock, 1 node", lambda u1, u5: DjangoRedlock(u1, auto_renew=False)),
    "drl-renew-1": ("django-redlock, 1 node, auto_renew on",
                    lambda u1, u5: DjangoRedlock(u1, auto_renew=True)),
    "drl-5": ("django-redlock, 5 nodes", lambda u1, u5: DjangoRedlock(u5, auto_renew=False)),
    "drl-renew-5": ("django-redlock, 5 nodes, auto_renew on",
                    lambda u1, u5: DjangoRedlock(u5, auto_renew=True)),
    "drl-async-1": ("django-redlock asyncio, 1 node", lambda u1, u5: DjangoRedlockAsync(u1)),
    "drl-async-5": ("django-redlock asyncio, 5 nodes", lambda u1, u5: DjangoRedlockAsync(u5)),
    "drl-async-call-1": ("django-redlock asyncio, 1 node, a loop run per operation",
                         lambda u1, u5: DjangoRedlockAsync(u1, per_call=True)),
    "drl-async-call-5": ("django-redlock asyncio, 5 nodes, a loop run per operation",
                         lambda u1, u5: DjangoRedlockAsync(u5, per_call=True)),
    "drl-read-1": ("django-redlock read_lock, 1 node",
                   lambda u1, u5: DjangoRedlock(u1, auto_renew=False, kind="read_lock")),
    "drl-write-1": ("django-redlock write_lock, 1 node",
                    lambda u1, u5: DjangoRedlock(u1, auto_renew=False, kind="write_lock")),
    "redispy-1": ("redis-py Lock, 1 node", lambda u1, u5: RedisPyLock(u1)),
    "prl-1": ("python-redis-lock, 1 node", lambda u1, u5: PythonRedisLock(u1)),
    "pottery-1": ("pottery Redlock, 1 node", lambda u1, u5: PotteryRedlock(u1)),
    "pottery-5": ("pottery Redlock, 5 nodes", lambda u1, u5: PotteryRedlock(u5)),
}


#: Seconds between a blocked waiter's polls, for the libraries that poll (pottery
#: sleeps uniform(0, 0.2) s: 0.1 s on average). The handoff spreads its release
#: instants over this period so the waiter is caught at a random phase.
POLL_PERIOD = {"redispy-1": 0.1, "pottery-1": 0.1, "pottery-5": 0.1}


def build(lib_id: str, urls1: list[str], urls5: list[str]) -> Contestant:
    label, builder = LIBRARIES[lib_id]
    contestant = builder(urls1, urls5)
    contestant.label = label
    return contestant


def contestant_op(cid: str, urls: list[str], key: str) -> tuple[Callable[[], None],
                                                                Callable[[], None]]:
    """One acquire + release (or floor operation) of contestant ``cid`` on the
    nodes ``urls``, and how to close it: a floor (``raw-*``, ``redispy-floor-*``)
    or a library of :data:`LIBRARIES`."""
    if cid.startswith("raw-async-"):
        async_floor = AsyncRawFloor(urls, key)
        return async_floor.make_op(), async_floor.close
    if cid.startswith("raw-protocol-"):
        protocol_floor = AsyncProtocolFloor(urls, key)
        return protocol_floor.make_op(), protocol_floor.close
    if cid.startswith("raw-"):
        floor: RawFloor | RedisPyFloor | ScriptsFloor = RawFloor(urls, key)
        return floor.op, floor.close
    if cid.startswith("scripts-raw-"):
        floor = ScriptsFloor(urls, key)
        return floor.op, floor.close
    if cid.startswith("redispy-floor-"):
        floor = RedisPyFloor(urls, key)
        return floor.op, floor.close
    lib = build(cid, urls, urls)
    return lib.make_op(key), lib.close
