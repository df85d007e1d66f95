"""RESP command packing and the Lua scripts.

Commands are packed once into bytes by a small packer of our own: the hot path
(acquire + release) sends pre-packed ``EVALSHA`` commands straight to the socket.
Scripts are sent by SHA; a node that answers ``NOSCRIPT`` (it restarted empty, or
its script cache was flushed) gets the full ``EVAL`` once on the same connection.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Any, NamedTuple, Union

Arg = Union[bytes, str, int, float]


def _encode(arg: Arg) -> bytes:
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, str):
        return arg.encode("utf-8")
    if isinstance(arg, bool):
        raise TypeError("bool is not a Redis argument")
    if isinstance(arg, int):
        return b"%d" % arg
    if isinstance(arg, float):
        return repr(arg).encode("ascii")
    raise TypeError(f"cannot send {type(arg).__name__} to Redis")


#: ``$<len>`` for the lengths most arguments have, formatted once.
_LENGTHS = [b"$%d" % n for n in range(512)]


def _pack_args(args: tuple[Arg, ...]) -> bytes:
    """``$<len>\\r\\n<bytes>\\r\\n`` per argument (the exact types first: this runs
    for every argument of every request): the pieces are joined by ``\\r\\n``
    in one go, each length prefix taken from a table."""
    out = []
    # Any: mypy does not narrow on ``type(arg) is ...``, and isinstance() would
    # cost more on this path (and accept bool as an int)
    items: tuple[Any, ...] = args
    data: bytes
    lengths = _LENGTHS
    for arg in items:
        kind = type(arg)
        if kind is bytes:
            data = arg
        elif kind is str:
            data = arg.encode("utf-8")
        elif kind is int:
            data = b"%d" % arg
        else:
            data = _encode(arg)
        size = len(data)
        out.append(lengths[size] if size < 512 else b"$%d" % size)
        out.append(data)
    out.append(b"")
    return b"\r\n".join(out)


def pack(*args: Arg) -> bytes:
    """One command in RESP2: ``*<n>\\r\\n`` then ``$<len>\\r\\n<bytes>\\r\\n`` per argument."""
    return b"*%d\r\n" % len(args) + _pack_args(args)


#: Packed ``EVALSHA`` heads kept per script, at most (see :meth:`Script.evalsha`).
_HEADS_MAX = 1024


def _load_lua(name: str) -> str:
    """A script's source, with ``--#include <name>`` lines replaced by that file.

    Lua scripts sent to Redis cannot import each other; this lets two scripts
    share one function (the fence write-back) without two copies in the tree.
    """
    text = (resources.files("django_redlock") / "lua" / f"{name}.lua").read_text("utf-8")
    lines = []
    for line in text.splitlines():
        if line.startswith("--#include "):
            lines.append(_load_lua(line.split(None, 1)[1].strip()))
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


class Script:
    """A Lua script shipped with the package, addressed by its SHA1.

    ``releases``: a release of some kind of lock (a clean-up is never dropped
    for want of a connection: see ``NodeClient.deliver_later``)."""

    def __init__(self, name: str, *, releases: bool = False) -> None:
        self.name = name
        self.releases = releases
        self.source = _load_lua(name).encode("utf-8")
        self.sha = hashlib.sha1(self.source).hexdigest().encode("ascii")
        #: (keys, number of args) -> the packed command up to its args: one
        #: lock's requests repeat it, and packing it was a third of the cost
        #: of packing a request.
        self._heads: dict[tuple[tuple[Arg, ...], int], bytes] = {}

    def evalsha(self, keys: tuple[Arg, ...], args: tuple[Arg, ...]) -> bytes:
        head = self._heads.get((keys, len(args)))
        if head is None:
            if len(self._heads) >= _HEADS_MAX:
                self._heads.clear()  # many lock names: start over rather than grow
            head = self._heads[(keys, len(args))] = (
                b"*%d\r\n" % (3 + len(keys) + len(args))
                + _pack_args((b"EVALSHA", self.sha, len(keys), *keys)))
        return head + _pack_args(args)

    def eval(self, keys: tuple[Arg, ...], args: tuple[Arg, ...]) -> bytes:
        return pack(b"EVAL", self.source, len(keys), *keys, *args)


class Call:
    """One script invocation, packed both ways (EVALSHA first, EVAL on NOSCRIPT)."""

    __slots__ = ("script", "keys", "args", "_evalsha", "last_of_token")

    def __init__(self, script: Script, keys: tuple[Arg, ...], args: tuple[Arg, ...], *,
                 last_of_token: bool = False) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self._evalsha: bytes | None = None
        #: No request of the same lock token follows this one (a release), so
        #: it may be sent again after later requests on its connection.
        self.last_of_token = last_of_token

    @property
    def packed(self) -> bytes:
        if self._evalsha is None:
            self._evalsha = self.script.evalsha(self.keys, self.args)
        return self._evalsha

    @property
    def packed_eval(self) -> bytes:
        return self.script.eval(self.keys, self.args)


class Command:
    """A plain command (no script), for inspection and health checks."""

    __slots__ = ("packed",)
    packed_eval = None

    def __init__(self, *args: Arg) -> None:
        self.packed = pack(*args)


class Chain:
    """A request with a plain command pipelined right behind it on the same
    connection, as one request: the transports send both at once and give
    back a :class:`ChainReply` with both replies (each a reply or the error
    the node answered).

    Why one request and not two rounds: some commands only mean something on
    the connection that sent what they follow. ``WAIT numreplicas timeout``
    (``REDLOCK["REPLICA_ACKS"]``) waits for the replicas to acknowledge the
    writes *of its own connection*; in a round of its own it could go out on
    another connection (whichever is idle), and would then confirm nothing
    about the grant. Pipelined, it also costs no extra round trip to the node.
    The transports never read one reply without the other, so the second is
    never mistaken for the answer to a later command.

    ``lead``: commands sent right before ``first`` whose replies are read and
    dropped (``ASKING``, which must come right before the command it lets
    through, for a chain a Cluster redirected with ``ASK``: the ``WAIT``
    behind the script then runs on the master that ran it).
    """

    __slots__ = ("first", "then", "packed", "lead")
    #: Never sent as EVAL: a ``NOSCRIPT`` answer to ``first`` is its reply
    #: (the transport reloads the scripts for the next request).
    packed_eval = None
    last_of_token = False

    def __init__(self, first: "Call | Command", then: "Command",
                 lead: "tuple[Command, ...]" = ()) -> None:
        self.first = first
        self.then = then
        self.lead = lead
        self.packed = b"".join(c.packed for c in lead) + first.packed + then.packed


class ChainReply(NamedTuple):
    """The two replies of a :class:`Chain` (an error reply as its exception)."""

    first: Any
    then: Any


ACQUIRE = Script("acquire")
RELEASE = Script("release", releases=True)
EXTEND = Script("extend")
EXTEND_MANY = Script("extend_many")
FORCE_RELEASE = Script("force_release")
#: A semaphore's permits, read by the head of its line (engine/semaphore.py).
SEMAPHORE_PEEK = Script("semaphore_peek")

#: Sent ahead of the first request on every new connection: the engine's
#: scripts, so that a node never answers ``NOSCRIPT`` to a request whose reply
#: a settled round does not wait for (a server that restarted empty is reached
#: through new connections). ``EVALSHA`` then ``EVAL`` after ``NOSCRIPT``
#: remains for a script cache flushed under a live connection.
#: The read-write lock's (rw_common.lua says how its key is laid out).
RW_ACQUIRE = Script("rw_acquire")
RW_RELEASE = Script("rw_release", releases=True)
RW_EXTEND = Script("rw_extend")
PRELOAD_SCRIPTS = (ACQUIRE, RELEASE, EXTEND, EXTEND_MANY, RW_ACQUIRE, RW_RELEASE, RW_EXTEND)
PRELOAD = b"".join(pack(b"SCRIPT", b"LOAD", script.source) for script in PRELOAD_SCRIPTS)


class RespReader:
    """A minimal blocking RESP2 reply reader over a socket (with its timeout).

    The engine reads replies with redis-py's parser; this one serves the test
    harness (:mod:`django_redlock.testing`), which must work without redis-py.
    An error reply is returned as an ``error(message)`` instance, not raised.
    """

    def __init__(self, sock: Any, *, error: type[Exception] = RuntimeError) -> None:
        self._sock = sock
        self._buf = b""
        self._error = error

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
        data, self._buf = self._buf[:n], self._buf[n + 2:]
        return data

    def read(self) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return self._error(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            size = int(rest)
            return None if size < 0 else self._exact(size)
        if kind == b"*":
            size = int(rest)
            return None if size < 0 else [self.read() for _ in range(size)]
        raise ConnectionError(f"unexpected RESP reply {line[:40]!r}")
