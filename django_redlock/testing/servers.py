"""One Redis server process, and a group of independent nodes.

(Why one module of 650 lines: ``RedisNodes`` is a list of ``RedisServer`` and
its faults (pause, kill, restart, flush, clock steps) are the server's own,
applied to several; the proxy and the binaries live apart.)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from typing import Self  # only for type checkers: fine on Python 3.10

    import redis


from .base import (
    _ADDRESS_IN_USE_MARKERS,
    _POLL_INTERVAL,
    EXIT_TIMEOUT,
    LOCALHOST,
    PORT_ATTEMPTS,
    SAME_PORT_ATTEMPTS,
    RedisReplyError,
    _free_port,
    _raw_commands,
)
from .binaries import find_server_binary

# --------------------------------------------------------------------------
# One server
# --------------------------------------------------------------------------


class _ProcessState:
    """What must be cleaned up for one server, kept apart from the server object.

    The :func:`weakref.finalize` callback must not reference the
    :class:`RedisServer` itself (or it would keep it alive forever), so the
    process handle and temp dir live here, shared by both.
    """

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmpdir: str | None = None


def _terminate(proc: subprocess.Popen[bytes], *, hard: bool) -> None:
    """Stop ``proc``: SIGCONT (a stopped process cannot act on SIGTERM), then
    SIGTERM (or SIGKILL if ``hard``), then SIGKILL if it has not exited within
    :data:`EXIT_TIMEOUT`. Never waits more than about twice that."""
    if proc.poll() is not None:
        return
    try:
        if hard:
            proc.send_signal(signal.SIGKILL)
        else:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=EXIT_TIMEOUT)
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=EXIT_TIMEOUT)
    except subprocess.TimeoutExpired:  # pragma: no cover - unkillable process
        pass


def _cleanup_state(state: _ProcessState) -> None:
    """Finalizer / atexit hook: kill the process and remove its temp dir."""
    proc, state.proc = state.proc, None
    if proc is not None:
        _terminate(proc, hard=True)
    tmpdir, state.tmpdir = state.tmpdir, None
    if tmpdir:
        shutil.rmtree(tmpdir, ignore_errors=True)


class RedisServer:
    """One independent ``redis-server``/``valkey-server`` process for tests.

    It binds 127.0.0.1 only (so ``protected-mode`` can be off), on a free
    port, without persistence (``--save "" --appendonly no``), in its own
    temporary directory which also holds its log file (``server.log``,
    shown in the error when it fails to start).

    The process is started in its own session so that a Ctrl-C in the test
    run reaches pytest, not the servers; a :func:`weakref.finalize` (which
    also runs at interpreter exit, through :mod:`atexit`) kills it if the
    test forgets :meth:`stop`.

    ``env`` entries are added to (and override) the current environment, e.g.
    ``{"LD_PRELOAD": ".../libfaketime.so.1", "FAKETIME": "+1h"}``.
    """

    host: str
    port: int
    password: str | None

    def __init__(
        self,
        *,
        binary: str | None = None,
        port: int | None = None,
        password: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 10.0,
    ) -> None:
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535, got {port!r}")
        if startup_timeout <= 0:
            raise ValueError("startup_timeout must be positive")
        self.binary = binary
        self.host = LOCALHOST
        self._fixed_port = port is not None
        self.port = port if port is not None else 0
        self.password = password
        self.extra_args: tuple[str, ...] = tuple(extra_args)
        self.env: dict[str, str] = dict(env or {})
        self.startup_timeout = float(startup_timeout)
        self._state = _ProcessState()
        self._paused = False
        self._finalizer = weakref.finalize(self, _cleanup_state, self._state)

    # -- addresses --------------------------------------------------------

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``, with ``:PASSWORD@`` when set."""
        auth = f":{self.password}@" if self.password is not None else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The server's pid while its process is alive, else ``None``."""
        proc = self._state.proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def tmpdir(self) -> str | None:
        """The server's working directory (holds ``server.log``)."""
        return self._state.tmpdir

    @property
    def log_path(self) -> str | None:
        """Path of the server's log file, once started."""
        return os.path.join(self._state.tmpdir, "server.log") if self._state.tmpdir else None

    @property
    def paused(self) -> bool:
        """True between :meth:`pause` and :meth:`resume` (or stop/kill)."""
        return self._paused and self.is_running()

    def __repr__(self) -> str:
        state = "paused" if self.paused else ("running" if self.is_running() else "stopped")
        return f"<RedisServer {self.host}:{self.port} {state}>"

    # -- lifecycle --------------------------------------------------------

    def is_running(self) -> bool:
        """True while the server process exists (even when paused)."""
        proc = self._state.proc
        return proc is not None and proc.poll() is None

    def start(self) -> Self:
        """Start the server and wait until it answers ``PING``.

        A port picked by binding to port 0 can be taken by someone else before
        the server binds it; then a fresh port is tried, up to
        :data:`PORT_ATTEMPTS` times. A fixed port (the constructor's, or the
        one kept by :meth:`restart`) is retried up to
        :data:`SAME_PORT_ATTEMPTS` times with short sleeps, for a port still
        held by the process just killed. Any other failure raises
        :class:`RuntimeError` with the tail of the server log.

        Calling ``start()`` on a running server is a no-op.
        """
        if self.is_running():
            return self
        binary = self.binary or find_server_binary()
        self.binary = binary
        if self._state.tmpdir is None:
            self._state.tmpdir = tempfile.mkdtemp(prefix="redlock-test-redis-")
        attempts = SAME_PORT_ATTEMPTS if self._fixed_port else PORT_ATTEMPTS
        last_error = ""
        for attempt in range(attempts):
            if not self._fixed_port:
                self.port = _free_port()
            outcome, detail = self._spawn_and_wait(binary)
            if outcome == "ok":
                return self
            last_error = detail
            if outcome != "port-busy":
                break
            if self._fixed_port and attempt + 1 < attempts:
                time.sleep(0.1)
        raise RuntimeError(
            f"redis server {binary} failed to start on {self.host}:{self.port}.\n{last_error}"
        )

    def _command_line(self, binary: str) -> list[str]:
        tmpdir = self._state.tmpdir
        assert tmpdir is not None
        args = [
            binary,
            "--port", str(self.port),
            "--bind", self.host,
            "--protected-mode", "no",
            "--save", "",
            "--appendonly", "no",
            "--dir", tmpdir,
            "--logfile", os.path.join(tmpdir, "server.log"),
            "--daemonize", "no",
        ]  # fmt: skip
        if self.password is not None:
            args += ["--requirepass", self.password]
        args += list(self.extra_args)
        return args

    def _spawn_and_wait(self, binary: str) -> tuple[str, str]:
        """Spawn once; return ("ok"|"port-busy"|"failed", log tail)."""
        tmpdir = self._state.tmpdir
        assert tmpdir is not None
        log_path = os.path.join(tmpdir, "server.log")
        # A fresh log per attempt, so "Address already in use" is about *this* try.
        with open(log_path, "wb"):
            pass
        env = os.environ.copy()
        env.update(self.env)
        # stdout/stderr go to a file: errors before the log file is opened
        # (bad arguments, a missing library) land there, and a pipe nobody
        # reads could fill up and block the server.
        with open(os.path.join(tmpdir, "stdio.log"), "wb") as stdio:
            proc = subprocess.Popen(
                self._command_line(binary),
                stdin=subprocess.DEVNULL,
                stdout=stdio,
                stderr=subprocess.STDOUT,
                cwd=tmpdir,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        self._state.proc = proc
        self._paused = False
        deadline = time.monotonic() + self.startup_timeout
        max_polls = int(self.startup_timeout / _POLL_INTERVAL) + 1
        for _ in range(max_polls):
            if proc.poll() is not None:
                break
            if self._answers_as(proc.pid):
                return "ok", ""
            if time.monotonic() >= deadline:
                break
            time.sleep(_POLL_INTERVAL)
        timed_out = proc.poll() is None
        _terminate(proc, hard=True)
        self._state.proc = None
        tail = self.log_tail()
        if any(marker in tail for marker in _ADDRESS_IN_USE_MARKERS):
            return "port-busy", tail
        if timed_out:
            reason = f"not ready within {self.startup_timeout:.1f}s"
        else:
            reason = f"exited with {proc.returncode}"
        return "failed", f"({reason})\n{tail}"

    def _answers_as(self, pid: int) -> bool:
        """True when the server on our port answers AND is our process.

        Checking the pid in ``INFO server`` matters: if another process won
        the race for the port, a bare PING would get its PONG and we would
        happily hand out a foreign server (which our own process, about to
        exit with "Address already in use", is not).
        """
        try:
            (info,) = _raw_commands(self.host, self.port, self.password, [("INFO", "server")], 0.2)
        except (OSError, ConnectionError, RedisReplyError, ValueError):
            return False
        if not isinstance(info, bytes):
            return False
        return f"process_id:{pid}\r\n".encode() in info

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server log and of its stdout/stderr."""
        tmpdir = self._state.tmpdir
        if not tmpdir:
            return ""
        out: list[str] = []
        for name in ("stdio.log", "server.log"):
            try:
                with open(os.path.join(tmpdir, name), "rb") as fh:
                    text = fh.read()[-16384:].decode(errors="replace")
            except OSError:
                continue
            if text.strip():
                out.append(f"--- {name} ---")
                out.extend(text.splitlines()[-lines:])
        return "\n".join(out)

    def stop(self) -> None:
        """Stop the server (``kill -9``, paused or not) and remove its temp
        dir. Idempotent. Not SIGTERM: the data goes with the temp dir anyway,
        and on SIGTERM a Redis 7 master with replicas waits up to its
        ``shutdown-timeout`` (10 s) for them to catch up; a test's teardown
        spent 5 s (EXIT_TIMEOUT) on that, three times a run."""
        proc, self._state.proc = self._state.proc, None
        self._paused = False
        if proc is not None:
            _terminate(proc, hard=True)
        tmpdir, self._state.tmpdir = self._state.tmpdir, None
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)

    def kill(self) -> None:
        """``kill -9`` the server and wait for it to exit. Its data is lost;
        clients get "connection refused" until :meth:`start`/:meth:`restart`.
        The port and temp dir are kept so the node can come back at the same
        address."""
        proc, self._state.proc = self._state.proc, None
        self._paused = False
        if proc is not None:
            _terminate(proc, hard=True)

    def _signal(self, sig: int) -> None:
        proc = self._state.proc
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"{self!r} is not running")
        proc.send_signal(sig)

    def pause(self) -> None:
        """SIGSTOP the server: the process stays alive, TCP connects still
        complete (the kernel fills the listen backlog) but nothing answers,
        like a node stuck in a long GC or VM freeze. Waits (bounded) until the
        kernel reports the process stopped, so the fault is in place on return."""
        self._signal(signal.SIGSTOP)
        self._paused = True
        self._wait_proc_state(stopped=True)

    def resume(self) -> None:
        """SIGCONT a paused server; it answers again, including requests that
        were queued while it was paused."""
        self._signal(signal.SIGCONT)
        self._paused = False
        self._wait_proc_state(stopped=False)

    def _wait_proc_state(self, *, stopped: bool) -> None:
        """On Linux, poll /proc/PID/stat until the state is (not) 'T'. Bounded
        to about one second; elsewhere a no-op (signals are delivered fast)."""
        pid = self.pid
        if pid is None:
            return
        path = f"/proc/{pid}/stat"
        deadline = time.monotonic() + 1.0
        for _ in range(200):
            try:
                with open(path, "rb") as fh:
                    # Format: "pid (comm) S ..."; comm may contain spaces/parens.
                    state = fh.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                return
            if (state in (b"T", b"t")) == stopped:
                return
            if time.monotonic() >= deadline:
                return
            time.sleep(0.005)

    def restart(self, *, empty: bool = True) -> None:
        """Bring the node back on the SAME port.

        ``empty=True`` (the default) is ``kill -9`` and a fresh start with no
        data: the crash-and-restart-without-persistence case that lets a
        second client take a lock the first still believes it holds.

        ``empty=False`` instead asks the server to ``SHUTDOWN SAVE`` (writing
        ``dump.rdb`` into its temp dir) and starts it again from that file,
        i.e. a clean restart that keeps the data. It needs a running,
        non-paused server.
        """
        if self.port == 0:
            raise RuntimeError("restart() needs a server that was started at least once")
        if empty:
            self.kill()
            if self._state.tmpdir:
                for name in ("dump.rdb", "appendonly.aof"):
                    path = os.path.join(self._state.tmpdir, name)
                    if os.path.isfile(path):
                        os.unlink(path)
                    elif os.path.isdir(path):
                        shutil.rmtree(path, ignore_errors=True)
        else:
            if self.paused:
                raise RuntimeError("restart(empty=False) needs a server that is not paused")
            proc = self._state.proc
            if proc is not None and proc.poll() is None:
                try:
                    self.execute("SHUTDOWN", "SAVE", timeout=EXIT_TIMEOUT)
                except (OSError, ConnectionError, RedisReplyError):
                    pass  # the connection is closed by the shutdown itself
                try:
                    proc.wait(timeout=EXIT_TIMEOUT)
                except subprocess.TimeoutExpired:
                    pass
            self.kill()
        was_fixed = self._fixed_port
        self._fixed_port = True
        try:
            self.start()
        finally:
            self._fixed_port = was_fixed

    # -- talking to it ------------------------------------------------------

    def ping(self, timeout: float = 0.5) -> bool:
        """``PING`` over a raw socket (no redis-py needed), ``AUTH`` first if
        a password is set. True only for a ``PONG`` within ``timeout`` seconds
        (connect and reply each bounded by it); False on refusal, timeout,
        error reply or a closed connection."""
        try:
            reply = _raw_commands(self.host, self.port, self.password, [("PING",)], timeout)
        except (OSError, ConnectionError, RedisReplyError, ValueError):
            return False
        return reply == ["PONG"]

    def execute(self, *args: Any, timeout: float = 2.0) -> Any:
        """Run one command over a raw socket and return its decoded RESP2 reply
        (``str`` for simple strings, ``bytes`` for bulk strings, ``int``,
        ``list`` or ``None``). An error reply raises :class:`RedisReplyError`;
        socket problems raise :class:`OSError`. For tests that must not depend
        on redis-py, e.g. ``server.execute("DEBUG", "SLEEP", 1)``."""
        (reply,) = _raw_commands(self.host, self.port, self.password, [args], timeout)
        if isinstance(reply, RedisReplyError):
            raise reply
        return reply

    def client(self, **kwargs: Any) -> redis.Redis:
        """A redis-py client for this node (redis-py is imported here, lazily,
        so the rest of the module works without it).

        Defaults: this node's host/port/password, ``decode_responses=False``,
        and 5 s socket/connect timeouts so a test against a paused node fails
        instead of hanging; every default can be overridden via ``kwargs``.
        """
        import redis

        options: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "password": self.password,
            "decode_responses": False,
            "socket_timeout": 5.0,
            "socket_connect_timeout": 5.0,
        }
        options.update(kwargs)
        return redis.Redis(**options)

    # -- context manager ----------------------------------------------------

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# --------------------------------------------------------------------------
# N independent masters
# --------------------------------------------------------------------------


#: The key :meth:`RedisNodes.wait_replicated` writes (and deletes at once) to
#: see the replicas follow.
_PROBE_KEY = "redlock-testing:replication-probe"


def replicas_following(master: RedisServer, live: int, deadline: float,
                       key: str = _PROBE_KEY) -> int:
    """How many of ``master``'s replicas confirm a fresh write (``WAIT``),
    asked again until ``live`` do or ``deadline`` (a ``time.monotonic()``
    value) has passed.

    "online" in ``INFO replication`` is not yet "applying": right after its
    first sync a replica may take up to a second (its first ACK) before it
    follows the stream, and a ``WAIT`` then confirms nothing. A write that
    ``WAIT`` confirms on every replica is. ``key`` is written and deleted at
    once; on a Cluster master it must hash to a slot that master serves."""
    acked = 0
    for _ in range(int(max(0.0, deadline - time.monotonic()) / 0.1) + 1):  # WAIT ... 100
        try:
            *_, reply = _raw_commands(
                master.host, master.port, master.password,
                [("SET", key, "1"), ("DEL", key), ("WAIT", str(live), "100")], 1.0)
        except (OSError, ConnectionError, RedisReplyError):
            reply = 0
        acked = reply if isinstance(reply, int) else 0
        if acked >= live or time.monotonic() >= deadline:
            break
    return acked


class RedisNodes:
    """``n`` independent Redis masters (NOT a Redis Cluster): what Redlock
    runs against. Each is a :class:`RedisServer` built with the same
    ``server_kwargs`` (``port`` is refused for ``n > 1``: they would clash).

    ``replicas=k`` gives each master ``k`` replicas of its own (real servers
    started with ``--replicaof``, on loopback, with the same ``server_kwargs``
    but a port of their own): ``self.replicas[i]`` lists master ``i``'s, each
    a :class:`RedisServer` with the same faults (``kill()``, ``pause()``,
    ``restart()``). What ``REDLOCK["REPLICA_ACKS"]`` is about::

        with RedisNodes(1, replicas=1) as nodes:
            nodes.replicas[0][0].pause()   # the master grants; no replica has it

    :meth:`start` returns once every replica has finished its first sync
    (:meth:`wait_replicated`). The servers sync without a disk and without
    delay (``repl-diskless-sync-delay 0``, the replicas too, since a failover
    may make one the master): Redis waits 5 s by default for more replicas
    to share one transfer.
    """

    def __init__(self, n: int, *, replicas: int = 0, **server_kwargs: Any) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n!r}")
        count: Any = replicas  # checked at run time: True is an int to a type checker
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"replicas must be an int >= 0, got {replicas!r}")
        if n > 1 and server_kwargs.get("port") is not None:
            raise ValueError("a fixed port cannot be shared by several nodes")
        if replicas and server_kwargs.get("port") is not None:
            raise ValueError("a fixed port cannot be shared by a master and its replicas")
        # Every server of a group with replicas syncs without delay, the
        # replicas too: a replica promoted by a failover (Sentinel, a test's
        # REPLICAOF NO ONE) is then the master its old master resyncs from, and
        # with Redis's default 5 s delay that resync could outlast a test's wait.
        group_kwargs = dict(server_kwargs)
        if replicas:
            group_kwargs["extra_args"] = (*server_kwargs.get("extra_args", ()),
                                          "--repl-diskless-sync-delay", "0")
        self.servers: list[RedisServer] = [RedisServer(**group_kwargs) for _ in range(n)]
        #: ``replicas[i]``: the replicas of master ``i`` (empty lists without replicas).
        self.replicas: list[list[RedisServer]] = [
            [RedisServer(**group_kwargs) for _ in range(replicas)] for _ in range(n)]

    @property
    def urls(self) -> list[str]:
        """Each node's ``redis://`` URL, in order (ready for ``REDLOCK_NODES``)."""
        return [server.url for server in self.servers]

    def start(self) -> Self:
        """Start every node (and its replicas, then wait for their first sync).
        If one fails, those already started are stopped and the error is
        re-raised: no half-started set is left behind."""
        try:
            for server in self.servers:
                server.start()
            for master, replicas in zip(self.servers, self.replicas):
                for replica in replicas:
                    self._follow(replica, master)
                    replica.start()
            self.wait_replicated()
        except BaseException:
            self._stop_all(suppress=True)
            raise
        return self

    @staticmethod
    def _follow(replica: RedisServer, master: RedisServer) -> None:
        """Point ``replica``'s command line at ``master`` (whose port is known
        once it started; it keeps it across restarts)."""
        args = list(replica.extra_args)
        if "--replicaof" in args:
            at = args.index("--replicaof")
            del args[at:at + 3]
        args += ["--replicaof", master.host, str(master.port)]
        if master.password is not None and "--masterauth" not in args:
            args += ["--masterauth", master.password]
        replica.extra_args = tuple(args)

    def wait_replicated(self, timeout: float = 10.0) -> None:
        """Wait until every master reports all its replicas online (bounded by
        ``timeout`` seconds in all); ``RuntimeError`` naming the first that
        is not. A paused or killed replica is left out: it cannot be online."""
        deadline = time.monotonic() + timeout
        for master, replicas in zip(self.servers, self.replicas):
            live = sum(1 for r in replicas if r.is_running() and not r.paused)
            if not live or not master.is_running() or master.paused:
                continue
            online = 0
            for _ in range(int(timeout / 0.02) + 1):
                try:
                    info = master.execute("INFO", "replication", timeout=1.0)
                except (OSError, ConnectionError, RedisReplyError):
                    info = b""
                online = info.count(b"state=online") if isinstance(info, bytes) else 0
                if online >= live or time.monotonic() >= deadline:
                    break
                time.sleep(0.02)
            if online < live:
                raise RuntimeError(f"{master!r}: {online} of {live} replicas online after "
                                   f"{timeout:g} s")
            acked = replicas_following(master, live, deadline)
            if acked < live:
                raise RuntimeError(f"{master!r}: {acked} of {live} replicas follow its writes "
                                   f"after {timeout:g} s")

    def stop(self) -> None:
        """Stop every node, even if stopping one of them raises; the first
        such error is re-raised after all have been tried."""
        self._stop_all(suppress=False)

    def _stop_all(self, *, suppress: bool) -> None:
        first: BaseException | None = None
        for server in [r for replicas in self.replicas for r in replicas] + self.servers:
            try:
                server.stop()
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                if first is None:
                    first = exc
        if first is not None and not suppress:
            raise first

    def flushall(self) -> None:
        """``FLUSHALL`` on every running, non-paused master, for test
        isolation (replicas follow their master; they refuse writes)."""
        for server in self.servers:
            if server.is_running() and not server.paused:
                server.execute("FLUSHALL")

    def __getitem__(self, index: int) -> RedisServer:
        return self.servers[index]

    def __len__(self) -> int:
        return len(self.servers)

    def __iter__(self) -> Iterator[RedisServer]:
        return iter(self.servers)

    def __repr__(self) -> str:
        return f"<RedisNodes {self.servers!r}>"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
