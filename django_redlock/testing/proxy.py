"""A fault-injecting TCP proxy in front of one node."""

from __future__ import annotations

import atexit
import collections
import contextlib
import errno
import selectors
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from typing import Self  # only for type checkers: fine on Python 3.10



from .base import EXIT_TIMEOUT, LOCALHOST
from .servers import RedisServer

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
