"""Release notices: waking blocked acquirers when a lock is released.

(Why one module of 750 lines: the subscriptions, the read role that waiting
threads pass between them, and the housekeeping thread share one lock and one
set of connections; their hand-offs are the subtle part and are kept together.)

Each lock manager (one per process) holds one pub/sub connection per node,
subscribed to the manager's own *inbox* channel and to a channel named like
each lock key someone in this process waits for. A waiter queues on the nodes
as ``<inbox>|<token>``; a release pops the first entry and publishes the token
on that inbox, so only that waiter's process hears it and only that waiter
wakes (waking every waiter made each release cost one failed attempt per
waiter). On the hand-over node (the only node, or the gate of several:
``rounds.hand_over_node``) the release hands that waiter the lock and the
notice is ``<token>|<fence>|<node clock>``; the part after the token is kept on
the waiter's subscription (``Subscription.handed``) for it to use
(``rounds.handed_over``). ``force_release`` publishes on the key's channel,
which wakes every waiter of the key in every process.

Who reads the connections: one thread at a time holds the *read role*. It is a
waiting thread whenever one waits (the first to wait reads; the others sleep on
their flags, and the reader sets the flag of the one a notice names), so the
waiter a release names is, most of the time, the thread reading the notice: it
wakes straight from ``select()``, with no hop through a listener thread (one
more thread woken per handoff). A background *housekeeping* thread
connects and reconnects, drops channels nobody waited on for a while, and
reads only when no waiting thread does and someone still needs it: asyncio
waiters, whose event loop must not block in ``select()``.

A waiter subscribes *before* its final attempt and waits for the node's
confirmation, so a release that happens between its failed attempt and its wait
cannot be missed (Redisson's #1763 missed exactly that and slept out the
whole lease). Notices can still be lost (a node down, a connection reset): the
waiter's timed, jittered retry is the fallback, never the main mechanism.

Only the holder of the read role touches the connections' sockets (TLS sockets
must not be read and written from two threads); a connection is opened by the
housekeeping thread and put in use by the reader.
"""

from __future__ import annotations

import collections
import selectors
import socket
import ssl
import threading
import time
from typing import Any, Callable, Sequence

from redis.exceptions import RedisError

from ..core.owner import new_token
from ..core.retry import backoff
from .finalizers import get_logger
from .resp import pack
from .sync import NODE_DOWN_ERRORS, NodeClient, scrub

logger = get_logger("django_redlock.notify")

#: Seconds a channel stays subscribed after its last waiter left.
LINGER = 5.0
#: The start of every process's inbox channel. A lock's channel is its key,
#: ``<KEY_PREFIX>:<name>``, and a prefix holds no brace, so no lock name can
#: name an inbox (``redlock:inbox:<token>`` was lock ``inbox:<token>``'s
#: channel: waiting on that lock, then dropping its idle channel, unsubscribed
#: the process's inbox, and its waiters heard no notice any more). Entries
#: carry their whole inbox, so processes of either form wake each other.
INBOX_PREFIX = b"{redlock}:inbox:"
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

    def __init__(self, notifier: "ReleaseNotifier", channel: bytes, waiter: bytes,
                 hand_over: bytes = b"") -> None:
        self.notifier = notifier
        self.channel = channel
        #: The token a release notice names to wake this waiter.
        self.waiter = waiter
        #: What the waiter puts in the lock's waiter queue: where to send the
        #: notice; and on the hand-over node (``rounds.waiter_entries``),
        #: ``hand_over_entry``, with what a release needs to hand it the lock.
        self.entry = notifier.inbox + b"|" + waiter
        self.hand_over_entry = self.entry + b"|" + hand_over if hand_over else self.entry
        #: ``<fence>|<node clock ms>`` when a release handed this waiter the
        #: lock (set before ``notified``); the waiter takes it and clears it.
        self.handed: bytes | None = None
        #: What the last notice on a key channel said (a semaphore's free
        #: notice names the permit released); the waiter reads and clears it.
        self.payload: bytes | None = None
        #: Wakes the waiting thread: for a notice, a confirmation, or its turn to read.
        self.event: Any = Flag()
        #: A release notice (or a dropped link) came since the last :meth:`clear`.
        self.notified = False
        #: Waits on another thread's reads (an asyncio waiter): never reads itself.
        self.passive = False
        self.closed = False

    def clear(self) -> None:
        self.notified = False
        self.event.clear()

    def wait(self, timeout: float) -> bool:
        """True when a release notice arrived (since the last :meth:`clear`).

        The calling thread reads the nodes' notices itself while nobody else
        does, so its own notice wakes it without a thread hop.
        """
        return self.notifier._await(self, lambda: self.notified, time.monotonic() + timeout)

    def make_passive(self) -> None:
        """From now on another thread reads this waiter's notices (asyncio)."""
        self.notifier._make_passive(self)

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
    """One pub/sub connection to one node (used only by the thread holding the read role)."""

    def __init__(self, node: NodeClient) -> None:
        self.node = node
        self.conn: Any = None
        self.sock: Any = None
        self.parser = PushParser()
        self.next_connect = 0.0
        self.failures = 0
        #: Connected by the housekeeping thread, not yet in use (see ``_install``).
        self.pending: Any = None
        #: Channels this connection's node confirmed (reset on every connect).
        self.subscribed: set[bytes] = set()
        #: The last connect attempt failed (a dropped connection alone is not that).
        self.connect_failed = False

    def is_down(self) -> bool:
        """Known down: the last connect failed, and no new connection is open.

        A link whose connection just dropped is not down until a reconnect
        fails: a restarted node is usually back by then, and a waiter that
        queued there unconfirmed would lose its notice."""
        return self.sock is None and self.pending is None and self.connect_failed


_HOUSEKEEPER = object()  # the read role's holder when the housekeeping thread reads


class ReleaseNotifier:
    def __init__(self, nodes: Sequence[NodeClient]) -> None:
        self._links = [_Link(node) for node in nodes]
        self._lock = threading.Lock()
        #: This process's own channel: release notices for its waiters.
        self.inbox = INBOX_PREFIX + new_token().encode()
        self._subs: dict[bytes, set[Subscription]] = {}
        self._named: dict[bytes, Subscription] = {}
        #: Called (node index, lock key, token) for a lock a release handed to
        #: a waiter of this process that no longer waits: it won on the other
        #: nodes or gave up before that release came. Left alone, that key
        #: would stand on the node for the waiter's whole lease, and the next
        #: in line behind it would wait as long (the manager hands it on).
        self.on_orphan: Callable[[int, bytes, bytes], None] | None = None
        #: Channels whose SUBSCRIBE was queued (and not since unsubscribed):
        #: the next waiter of one sends none of its own.
        self._requested: set[bytes] = set()
        self._idle_since: dict[bytes, float] = {}
        self._ops: collections.deque[tuple[str, bytes]] = collections.deque()
        #: Held by the one thread that does the links' socket I/O (the reader).
        self._role = threading.Lock()
        #: Who holds the read role: a Subscription, ``_HOUSEKEEPER`` or None.
        self._reader: Any = None
        #: Sync waiters inside ``_await``, in arrival order (under ``_lock``).
        self._followers: dict[Subscription, None] = {}
        self._passive = 0  # open passive (asyncio) subscriptions
        #: A sync waiter asked the housekeeping thread to hand the read role over.
        self._yield_wanted = False
        #: Interrupts the reader's select(): new work for the links.
        self._kick_r, self._kick_w = socket.socketpair()
        #: Wakes the housekeeping thread.
        self._wake_r, self._wake_w = socket.socketpair()
        # All four non-blocking: a poke into a full buffer is dropped (the
        # other side has wake-ups enough to read). A blocking write end froze
        # a burst of asyncio waiters: the housekeeping thread, reading for
        # them, did not empty its wake-up socket, and the event loop's next
        # poke blocked in send() for good (issue 25's burst test).
        for sock in (self._kick_r, self._kick_w, self._wake_r, self._wake_w):
            sock.setblocking(False)
        self._sel: selectors.BaseSelector | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        #: Flags of the waiters the notices just read name (reader only).
        self._woken: list[Any] = []
        #: A link connected or dropped since the selector was last brought in line.
        self._links_changed = True

    # -- waiter side --------------------------------------------------------
    def subscribe(self, channel: bytes, confirm_timeout: float,
                  waiter: bytes | None = None, hand_over: bytes = b"") -> Subscription:
        """Register a waiter and wait (bounded) until the subscription is confirmed
        by every node not known to be down.

        Every node, not the first: the waiter's next attempt may queue it on
        one node only (the gate node, see ``rounds.gate_node``), and a release
        there skips an entry whose inbox has no listener, so a node that had
        not confirmed yet would swallow the waiter's notice. ``waiter`` is the
        token the waiter queues under (``Subscription.entry``); a notice naming
        it wakes this subscription only. The inbox is subscribed on each
        connection before any key channel, so a confirmed key channel means a
        confirmed inbox. ``hand_over``: see :class:`Subscription`.
        """
        sub = Subscription(self, channel, waiter or new_token().encode(), hand_over)
        with self._lock:
            subs = self._subs.setdefault(channel, set())
            subs.add(sub)
            self._named[sub.waiter] = sub
            self._idle_since.pop(channel, None)
            if channel not in self._requested:
                self._requested.add(channel)
                self._ops.append(("subscribe", channel))
                self._ensure_thread()
                self._nudge()
        if not self._is_confirmed(channel) and not self._await(
                sub, lambda: self._is_confirmed(channel), time.monotonic() + confirm_timeout):
            logger.debug("no node confirmed the subscription to %r in time; "
                         "the waiter falls back to timed retries", channel)
        return sub

    def _await(self, sub: Subscription, done: Callable[[], bool], deadline: float) -> bool:
        """Wait until ``done()`` or ``deadline``, reading the links while nobody else does.

        Leader/follower: the first waiting thread takes the read role and
        select()s on the links itself, so its own notice wakes it at once (no
        hop through another thread: one more wake-up, 55-200 µs of every
        handoff on the machines ``bench.trace`` ran on). Notices
        it reads for others set their flags. The others sleep on their flags;
        a reader that leaves hands the role to the longest waiting of them.
        """
        with self._lock:
            self._followers[sub] = None
        try:
            while True:
                if done():
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping:
                    return done()
                if self._role.acquire(blocking=False):
                    self._reader = sub
                    try:
                        while not done() and not self._stopping:
                            left = deadline - time.monotonic()
                            if left <= 0:
                                break
                            self._read(min(left, _POLL))
                    finally:
                        self._resign(sub)
                    continue
                if not isinstance(self._reader, Subscription):
                    # The housekeeping thread reads (or is about to): ask for a turn.
                    self._yield_wanted = True
                    self._kick()
                sub.event.wait(left)
                sub.event.clear()
        finally:
            with self._lock:
                self._followers.pop(sub, None)
                # Woken for a turn it did not take (its notice came first): pass it on.
                nxt = None if self._role.locked() else next(iter(self._followers), None)
            if nxt is not None:
                nxt.event.set()

    def _is_confirmed(self, channel: bytes) -> bool:
        """Whether every node not known to be down confirmed ``channel`` on the
        connection in use now (a reconnected link must confirm again)."""
        with self._lock:
            return all(link.is_down() or channel in link.subscribed for link in self._links)

    def _resign(self, me: Any) -> bool:
        """Give the read role up and wake a waiting thread to take it over
        (holder of the role only). True when one was woken for it."""
        woken, self._woken = self._woken, []
        self._reader = None
        if me is _HOUSEKEEPER:
            self._yield_wanted = False
        self._role.release()
        for flag in woken:
            flag.set()
        with self._lock:
            nxt = next((s for s in self._followers if s is not me), None)
            passive = self._passive
        if nxt is not None:
            nxt.event.set()  # its turn to read (it re-checks its own condition first)
            return True
        if passive and me is not _HOUSEKEEPER and not self._stopping:
            self._wake()  # asyncio waiters are left: the housekeeping thread reads for them
        return False

    def _make_passive(self, sub: Subscription) -> None:
        with self._lock:
            if sub.passive or sub.closed:
                return
            sub.passive = True
            self._passive += 1
        self._wake()

    def _remove(self, sub: Subscription) -> None:
        with self._lock:
            if sub.passive:
                sub.passive = False
                self._passive -= 1
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
        """Unsubscribe channels nobody waited on for LINGER seconds."""
        now = time.monotonic()
        with self._lock:
            expired = [ch for ch, since in self._idle_since.items() if now - since >= LINGER]
            for channel in expired:
                del self._idle_since[channel]
                if not self._subs.get(channel):
                    self._subs.pop(channel, None)
                    self._requested.discard(channel)
                    self._ops.append(("unsubscribe", channel))

    @staticmethod
    def _poke(sock: socket.socket) -> None:
        try:
            sock.send(b"x")
        except OSError:  # buffer full (the other side is awake anyway) or closed
            pass

    @staticmethod
    def _empty(sock: socket.socket) -> None:
        """Read a non-blocking wake-up socket (written by ``_poke``) until it is empty."""
        try:
            while sock.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _kick(self) -> None:
        """Interrupt the reader's select(), if someone reads."""
        self._poke(self._kick_w)

    def _wake(self) -> None:
        """Wake the housekeeping thread."""
        self._poke(self._wake_w)

    def _nudge(self) -> None:
        """There is work for the links (a channel to subscribe, a link to put in use)."""
        self._kick()
        self._wake()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="redlock-notify", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stopping = True
        self._nudge()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)
        got_role = self._role.acquire(timeout=2.0)  # a reader leaves within _POLL
        try:
            for link in self._links:
                self._drop(link, reconnect=False)
                pending, link.pending = link.pending, None
                if pending is not None:
                    self._disconnect(pending)
            if self._sel is not None:
                self._sel.close()
                self._sel = None
            for sock in (self._kick_r, self._kick_w, self._wake_r, self._wake_w):
                sock.close()
        finally:
            if got_role:
                self._role.release()

    # -- reading (holder of the read role only) -----------------------------
    def _read(self, timeout: float) -> None:
        """One turn of the reader: send what is queued, then read what arrives."""
        for link in self._links:
            if link.conn is not None and link.node.moves and not link.node.accepts(link.conn):
                self._drop(link)  # a Sentinel node's master moved: subscribe on the new one
        self._apply_ops()
        self._install()
        sel = self._sel
        if sel is None:
            sel = self._sel = selectors.DefaultSelector()
            sel.register(self._kick_r, selectors.EVENT_READ, None)
            self._links_changed = True
        if self._links_changed:
            self._links_changed = False
            self._sync_selector(sel)
        # Wake the waiters the last notices named only now, with this turn's
        # work done: a woken waiter needs the GIL at once, and this thread
        # gives it up in select() a few bytecodes later instead of competing.
        self._wake_named()
        for key, _ in sel.select(timeout=timeout):
            if key.data is None:
                self._empty(self._kick_r)
            else:
                self._drain(key.data)

    def _wake_named(self) -> None:
        woken, self._woken = self._woken, []
        for flag in woken:
            flag.set()

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

    def _apply_ops(self) -> None:
        while True:
            with self._lock:
                if not self._ops:
                    return
                op, channel = self._ops.popleft()
                if op == "unsubscribe":
                    if channel in self._subs:
                        continue  # re-subscribed meanwhile
                    for link in self._links:
                        link.subscribed.discard(channel)
            for link in self._links:
                if link.sock is not None:
                    self._send(link, op.upper(), channel)

    def _install(self) -> None:
        """Put the links the housekeeping thread connected in use, subscribed to
        the inbox and to every channel someone waits on now."""
        for link in self._links:
            conn = link.pending
            if conn is None:
                continue
            if self._stopping:
                link.pending = None
                self._disconnect(conn)
                continue
            with self._lock:
                channels = list(self._subs)
            # In use before no longer pending: the housekeeping thread connects
            # a link that is neither, and must never see this one so.
            link.conn, link.sock, link.parser = conn, conn._sock, PushParser()
            link.subscribed = set()
            link.pending = None
            self._links_changed = True
            self._send(link, "SUBSCRIBE", self.inbox, *channels)

    def _send(self, link: _Link, *args: Any) -> None:
        try:
            link.sock.settimeout(link.node.timeout)  # blocking, bounded, for the send
            link.sock.sendall(pack(*args))
            link.sock.setblocking(False)
        except NODE_DOWN_ERRORS:
            self._drop(link)

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
                self._handle(reply, link)
            if len(data) < _READ_SIZE and not _tls_pending(link.sock):
                # Drained for now; select() reports more. Reading on until
                # EAGAIN cost every notice one more system call.
                return

    def _handle(self, reply: Any, link: _Link) -> None:
        if not isinstance(reply, list) or len(reply) < 3:
            return
        kind, channel = reply[0], reply[1]
        if kind == b"message":
            orphan = b""
            with self._lock:
                if channel == self.inbox:
                    # '<token>', or '<token>|<fence>|<clock>|<key>': the lock handed over
                    name, _, handed = reply[2].partition(b"|")
                    named = self._named.get(name)
                    subs = [] if named is None else [named]
                    if handed and named is not None:
                        named.handed = handed
                    elif handed:
                        orphan = handed.split(b"|", 2)[-1] if handed.count(b"|") >= 2 else b""
                else:  # a key channel: force_release wakes them all
                    subs = list(self._subs.get(channel, ()))
                    for sub in subs:
                        sub.payload = reply[2]
            if orphan and self.on_orphan is not None:
                try:
                    self.on_orphan(self._links.index(link), orphan, name)
                except Exception:  # noqa: BLE001 - the reader thread must go on
                    logger.exception("handing on a lock handed to a waiter that is gone failed")
            for sub in subs:
                sub.notified = True
                if sub is not self._reader:  # the reader sees it when this turn ends
                    self._woken.append(sub.event)
        elif kind == b"subscribe":
            with self._lock:
                link.subscribed.add(channel)
                subs = list(self._subs.get(channel, ()))
            if subs and self._is_confirmed(channel):
                # Subscribers waiting for this confirmation sleep on their flags
                # (a waiter woken for nothing checks its notice and sleeps on).
                self._woken.extend(s.event for s in subs
                                   if s is not self._reader and not s.passive)

    def _drop(self, link: _Link, *, reconnect: bool = True) -> None:
        conn, link.conn, link.sock = link.conn, None, None
        with self._lock:
            link.subscribed = set()
        self._links_changed = True
        if conn is not None:
            self._disconnect(conn)
        if reconnect:
            link.failures += 1
            link.next_connect = time.monotonic() + backoff(
                link.failures + 1, first=RECONNECT_FIRST, cap=RECONNECT_MAX)
            # Waiters may have missed a notice while the link was down.
            with self._lock:
                subs = [s for group in self._subs.values() for s in group]
            for sub in subs:
                sub.notified = True
                if sub is not self._reader:
                    sub.event.set()
            self._wake()  # the housekeeping thread reconnects

    @staticmethod
    def _disconnect(conn: Any) -> None:
        try:
            conn.disconnect()
        except NODE_DOWN_ERRORS:
            pass

    # -- housekeeping thread ------------------------------------------------
    def _run(self) -> None:
        """Connect and reconnect the links, expire idle channels, and read for
        asyncio waiters (and for queued work) when no waiting thread reads."""
        try:
            while not self._stopping:
                self._expire_idle()
                self._connect_due()
                with self._lock:
                    reads_for = self._passive > 0
                    work = bool(self._ops) or any(link.pending for link in self._links)
                if self._role.acquire(blocking=False):
                    self._reader = _HOUSEKEEPER
                    handed_over = False
                    try:
                        # One turn: a waiting thread that wants to read asks
                        # through _yield_wanted and gets the role at its end.
                        self._read(self._next_timeout() if reads_for and not self._yield_wanted
                                   else 0.0)
                    finally:
                        handed_over = self._resign(_HOUSEKEEPER)
                    if reads_for and not handed_over:
                        continue  # read on for the asyncio waiters
                elif work:
                    self._kick()  # the reader sends it
                self._sleep(self._next_timeout())
        except Exception:  # noqa: BLE001 - the listener must never die silently
            logger.exception("release listener stopped; waiters fall back to timed retries")

    def _sleep(self, timeout: float) -> None:
        sel = selectors.DefaultSelector()
        try:
            sel.register(self._wake_r, selectors.EVENT_READ)
            if sel.select(timeout=timeout):
                self._empty(self._wake_r)
        finally:
            sel.close()

    def _next_timeout(self) -> float:
        with self._lock:
            waiting = bool(self._subs)
        if not waiting:
            return _POLL  # nothing to (re)connect for: links connect when someone waits
        now = time.monotonic()
        due = [link.next_connect - now for link in self._links
               if link.sock is None and link.pending is None]
        return max(0.0, min([_POLL, *due]))

    def _connect_due(self) -> None:
        """Connect the links that are down and due, outside the read role (a
        connect may block up to the connect timeout); the reader puts them in use."""
        now = time.monotonic()
        for link in self._links:
            if link.sock is not None or link.pending is not None or now < link.next_connect:
                continue
            with self._lock:
                if not self._subs:
                    return  # connect lazily, when someone waits
            try:
                conn = link.node.new_connection()
                conn.connect()  # TCP/TLS, AUTH, SELECT: redis-py's handshake
            except (*NODE_DOWN_ERRORS, RedisError) as e:
                # RedisError: a protocol error (not Redis there, issue 26) or
                # NOAUTH is this node down, never the listener's end.
                link.failures += 1
                link.next_connect = now + backoff(link.failures + 1, first=RECONNECT_FIRST,
                                                  cap=RECONNECT_MAX)
                logger.debug("pub/sub connect to %s failed: %s", link.node.name, scrub(str(e)))
                link.connect_failed = True
                # Down now: no subscriber waits for its confirmation any more
                # (the reader re-checks after a kick, the others when woken).
                with self._lock:
                    awaiting = list(self._followers)
                for sub in awaiting:
                    sub.event.set()
                self._kick()
                continue
            link.failures = 0
            link.connect_failed = False
            link.pending = conn
            self._kick()
