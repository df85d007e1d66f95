"""Release notices: waking blocked acquirers when a lock is released.

One listener thread per lock manager holds one pub/sub connection per node.
It subscribes to the manager's own *inbox* channel, and to a channel named like
each lock key someone in this process waits for. A waiter queues on the nodes
as ``<inbox>|<token>``; a release pops the first entry and publishes the token
on that inbox, so only that waiter's process hears it and only that waiter
wakes (waking every waiter made each release cost one failed attempt per
waiter). ``force_release`` publishes on the key's channel, which wakes every
waiter of the key in every process.

A waiter subscribes *before* its final attempt and waits for the node's
confirmation, so a release that happens between its failed attempt and its wait
cannot be missed (Redisson's #1763 missed exactly that and slept out the
whole lease). Notices can still be lost (a node down, a connection reset): the
waiter's timed, jittered retry is the fallback, never the main mechanism.

All socket I/O of the listener happens on its own thread; waiters only queue
requests and wait on events, so no connection is ever used by two threads.
"""

from __future__ import annotations

import collections
import logging
import selectors
import socket
import ssl
import threading
import time
from typing import Any, Sequence

from ..core.owner import new_token
from .resp import pack
from .sync import NODE_DOWN_ERRORS, NodeClient

logger = logging.getLogger("django_redlock.notify")

#: Seconds a channel stays subscribed after its last waiter left.
LINGER = 5.0
RECONNECT_FIRST = 0.05
RECONNECT_MAX = 2.0
_POLL = 0.5
_DRAIN_MAX = 1000
_READ_SIZE = 65536


def _tls_pending(sock: Any) -> bool:
    """Whether a TLS socket holds decrypted bytes that select() cannot see."""
    pending = getattr(sock, "pending", None)
    return bool(pending and pending())


class Flag:
    """A ``threading.Event`` for one waiting thread (``set()`` from any thread),
    whose wake-up is one lock release and one acquire.

    ``threading.Event`` wakes its waiter through a condition variable: the
    woken thread must then take the condition's lock, which the setter may
    still hold, and on a busy machine the two threads ping-pong on it. Here the
    waiter sleeps on ``_wake``, a lock held exactly while the flag is clear,
    and ``set()`` releases it. ``_state`` (never held while sleeping) only
    orders ``set()`` against ``clear()``, so a set that races a clear is never
    lost.
    """

    __slots__ = ("_wake", "_state", "_set")

    def __init__(self) -> None:
        self._wake = threading.Lock()
        self._wake.acquire()
        self._state = threading.Lock()
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with self._state:
            if not self._set:
                self._set = True
                self._wake.release()

    def wait(self, timeout: float) -> bool:
        """From the waiting thread only."""
        if self._set:
            return True
        if self._wake.acquire(timeout=max(timeout, 0.0)):
            self._wake.release()  # set() released it: leave it so (still set)
            return True
        return False

    def clear(self) -> None:
        """From the waiting thread only."""
        with self._state:
            if self._set:
                self._wake.acquire()  # free while set: never blocks
                self._set = False


class Subscription:
    """A waiter's interest in one channel. Not thread-shared: one per waiting call."""

    def __init__(self, notifier: "ReleaseNotifier", channel: bytes, waiter: bytes) -> None:
        self.notifier = notifier
        self.channel = channel
        #: The token a release notice names to wake this waiter.
        self.waiter = waiter
        #: What the waiter puts in the lock's waiter queue: where to send the notice.
        self.entry = notifier.inbox + b"|" + waiter
        self.event: Any = Flag()
        self.closed = False

    def clear(self) -> None:
        self.event.clear()

    def wait(self, timeout: float) -> bool:
        """True when a release notice arrived (since the last :meth:`clear`)."""
        return self.event.wait(timeout)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.notifier._remove(self)

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PushParser:
    """Incremental parser for the replies a subscribed connection receives.

    The listener reads the raw socket itself (after redis-py did the connect,
    TLS and AUTH handshake) because redis-py versions differ in how they surface
    pub/sub messages (some hand them to an internal push handler). Handles the
    RESP2 and RESP3 types a pub/sub connection can see.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[Any]:
        self._buf += data
        out = []
        while self._buf:
            parsed = self._parse(0)
            if parsed is None:
                break
            value, pos = parsed
            self._buf = self._buf[pos:]
            out.append(value)
        return out

    def _parse(self, pos: int) -> tuple[Any, int] | None:
        end = self._buf.find(b"\r\n", pos)
        if end < 0:
            return None
        kind, line = self._buf[pos:pos + 1], self._buf[pos + 1:end]
        nxt = end + 2
        if kind in (b"+", b"-"):
            return line, nxt
        if kind == b":":
            return int(line), nxt
        if kind == b"_":
            return None, nxt
        if kind in (b"$", b"="):
            size = int(line)
            if size < 0:
                return None, nxt
            if len(self._buf) < nxt + size + 2:
                return None
            return self._buf[nxt:nxt + size], nxt + size + 2
        if kind in (b"*", b">", b"~", b"%"):
            count = int(line) * (2 if kind == b"%" else 1)
            items = []
            for _ in range(max(count, 0)):
                parsed = self._parse(nxt)
                if parsed is None:
                    return None
                item, nxt = parsed
                items.append(item)
            return items, nxt
        raise ValueError(f"unexpected RESP type {kind!r}")


class _Link:
    """The listener's pub/sub connection to one node."""

    def __init__(self, node: NodeClient) -> None:
        self.node = node
        self.conn: Any = None
        self.sock: Any = None
        self.parser = PushParser()
        self.next_connect = 0.0
        self.failures = 0


class ReleaseNotifier:
    def __init__(self, nodes: Sequence[NodeClient]) -> None:
        self._links = [_Link(node) for node in nodes]
        self._lock = threading.Lock()
        #: This listener's own channel: release notices for its waiters.
        self.inbox = b"redlock:inbox:" + new_token().encode()
        self._subs: dict[bytes, set[Subscription]] = {}
        self._named: dict[bytes, Subscription] = {}
        self._confirmed: dict[bytes, threading.Event] = {}
        self._idle_since: dict[bytes, float] = {}
        self._ops: collections.deque[tuple[str, bytes]] = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stopping = False
        self._thread: threading.Thread | None = None
        #: Flags of the waiters the notices just read name (listener thread only).
        self._woken: list[Any] = []
        #: A link connected or dropped since the selector was last brought in line.
        self._links_changed = True

    # -- waiter side --------------------------------------------------------
    def subscribe(self, channel: bytes, confirm_timeout: float,
                  waiter: bytes | None = None) -> Subscription:
        """Register a waiter and wait (bounded) until a node confirmed the subscription.

        ``waiter`` is the token the waiter queues under (``Subscription.entry``);
        a notice naming it wakes this subscription only. The inbox is subscribed
        on each connection before any key channel, so a confirmed key channel
        means a confirmed inbox.
        """
        sub = Subscription(self, channel, waiter or new_token().encode())
        with self._lock:
            subs = self._subs.setdefault(channel, set())
            subs.add(sub)
            self._named[sub.waiter] = sub
            self._idle_since.pop(channel, None)
            confirmed = self._confirmed.get(channel)
            if confirmed is None:
                confirmed = self._confirmed[channel] = threading.Event()
                self._ops.append(("subscribe", channel))
                self._ensure_thread()
                self._wake()
        if not confirmed.wait(confirm_timeout):
            logger.debug("no node confirmed the subscription to %r in time; "
                         "the waiter falls back to timed retries", channel)
        return sub

    def _remove(self, sub: Subscription) -> None:
        with self._lock:
            if self._named.get(sub.waiter) is sub:
                del self._named[sub.waiter]
            subs = self._subs.get(sub.channel)
            if subs is None:
                return
            subs.discard(sub)
            if not subs:
                # Stay subscribed a while: a lock that had waiters will likely
                # have them again, and re-subscribing costs the next waiter a
                # round trip before its final attempt.
                self._idle_since[sub.channel] = time.monotonic()

    def _expire_idle(self) -> None:
        """Unsubscribe channels nobody waited on for LINGER seconds (listener thread)."""
        now = time.monotonic()
        with self._lock:
            expired = [ch for ch, since in self._idle_since.items() if now - since >= LINGER]
            for channel in expired:
                del self._idle_since[channel]
                if not self._subs.get(channel):
                    self._subs.pop(channel, None)
                    self._confirmed.pop(channel, None)
                    self._ops.append(("unsubscribe", channel))

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # buffer full: the listener is awake anyway
            pass

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="redlock-notify", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stopping = True
        self._wake()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)
        for link in self._links:
            self._drop(link, reconnect=False)
        self._wake_r.close()
        self._wake_w.close()

    # -- listener thread ----------------------------------------------------
    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._stopping:
                self._expire_idle()
                self._apply_ops()
                if self._connect_is_due():
                    self._wake_named()  # a connect may block: no wake-up waits for it
                    self._connect_due()
                if self._links_changed:
                    self._links_changed = False
                    self._sync_selector(sel)
                timeout = self._next_timeout()
                # Wake the waiters the last notices named only now, with this
                # thread's work done: a woken waiter needs the GIL at once, and
                # this thread gives it up in select() a few bytecodes later
                # instead of competing for it.
                self._wake_named()
                for key, _ in sel.select(timeout=timeout):
                    if key.data is None:
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except (BlockingIOError, InterruptedError):
                            pass
                    else:
                        self._drain(key.data)
        except Exception:  # noqa: BLE001 - the listener must never die silently
            logger.exception("release listener stopped; waiters fall back to timed retries")
        finally:
            sel.close()

    def _wake_named(self) -> None:
        woken, self._woken = self._woken, []
        for flag in woken:
            flag.set()

    def _connect_is_due(self) -> bool:
        now = time.monotonic()
        return any(link.sock is None and now >= link.next_connect for link in self._links)

    def _sync_selector(self, sel: selectors.BaseSelector) -> None:
        """Register the live links' sockets; forget the dropped ones."""
        desired = {link.sock: link for link in self._links if link.sock is not None}
        current = {key.fileobj: key.data for key in list(sel.get_map().values())
                   if key.data is not None}
        for sock in current.keys() - desired.keys():
            try:
                sel.unregister(sock)
            except (KeyError, ValueError):
                pass
        for sock in desired.keys() - current.keys():
            sel.register(sock, selectors.EVENT_READ, desired[sock])

    def _next_timeout(self) -> float:
        with self._lock:
            waiting = bool(self._subs)
        if not waiting:
            return _POLL  # nothing to (re)connect for: links connect when someone waits
        now = time.monotonic()
        due = [link.next_connect - now for link in self._links if link.sock is None]
        return max(0.0, min([_POLL, *due]))

    def _apply_ops(self) -> None:
        while True:
            with self._lock:
                if not self._ops:
                    return
                op, channel = self._ops.popleft()
                if op == "unsubscribe" and channel in self._subs:
                    continue  # re-subscribed meanwhile
            for link in self._links:
                if link.sock is not None:
                    self._send(link, op.upper(), channel)

    def _send(self, link: _Link, *args: Any) -> None:
        try:
            link.sock.sendall(pack(*args))
        except (BlockingIOError, *NODE_DOWN_ERRORS):
            self._drop(link)

    def _connect_due(self) -> None:
        now = time.monotonic()
        for link in self._links:
            if link.sock is not None or now < link.next_connect:
                continue
            with self._lock:
                channels = list(self._subs)
            if not channels:
                continue  # connect lazily, when someone waits
            try:
                conn = link.node.new_connection()
                conn.connect()  # TCP/TLS, AUTH, SELECT: redis-py's handshake
                sock = conn._sock
                sock.setblocking(True)
                sock.settimeout(link.node.timeout)
                sock.sendall(pack("SUBSCRIBE", self.inbox, *channels))
                sock.setblocking(False)
            except NODE_DOWN_ERRORS as e:
                link.failures += 1
                link.next_connect = now + min(RECONNECT_MAX, RECONNECT_FIRST * 2 ** link.failures)
                logger.debug("pub/sub connect to %s failed: %s", link.node.name, e)
                continue
            link.conn, link.sock, link.parser = conn, sock, PushParser()
            self._links_changed = True
            link.failures = 0

    def _drain(self, link: _Link) -> None:
        for _ in range(_DRAIN_MAX):
            try:
                data = link.sock.recv(_READ_SIZE)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                return
            except NODE_DOWN_ERRORS:
                self._drop(link)
                return
            if not data:
                self._drop(link)
                return
            try:
                replies = link.parser.feed(data)
            except ValueError:
                logger.warning("unexpected data on the pub/sub connection to %s", link.node.name)
                self._drop(link)
                return
            for reply in replies:
                self._handle(reply)
            if len(data) < _READ_SIZE and not _tls_pending(link.sock):
                # Drained for now; select() reports more. Reading on until
                # EAGAIN cost every notice one more system call.
                return

    def _handle(self, reply: Any) -> None:
        if not isinstance(reply, list) or len(reply) < 3:
            return
        kind, channel = reply[0], reply[1]
        if kind == b"message":
            with self._lock:
                if channel == self.inbox:
                    named = self._named.get(reply[2])
                    subs = [] if named is None else [named]
                else:  # a key channel: force_release wakes them all
                    subs = list(self._subs.get(channel, ()))
            self._woken.extend(sub.event for sub in subs)
        elif kind == b"subscribe":
            with self._lock:
                confirmed = self._confirmed.get(channel)
            if confirmed is not None:
                confirmed.set()

    def _drop(self, link: _Link, *, reconnect: bool = True) -> None:
        conn, link.conn, link.sock = link.conn, None, None
        self._links_changed = True
        if conn is not None:
            try:
                conn.disconnect()
            except NODE_DOWN_ERRORS:
                pass
        if reconnect:
            link.failures += 1
            link.next_connect = time.monotonic() + min(
                RECONNECT_MAX, RECONNECT_FIRST * 2 ** link.failures)
            # Waiters may have missed a notice while the link was down.
            with self._lock:
                subs = [s for group in self._subs.values() for s in group]
            for sub in subs:
                sub.event.set()
