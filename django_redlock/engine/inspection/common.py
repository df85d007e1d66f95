"""What the read model's two halves share: patterns, secrets, asking every node
against one deadline (see the package docstring)."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from redis.exceptions import InvalidResponse, ResponseError

from ...core.keys import (
    MAX_NAME_LENGTH,
)
from ...transport.sync import NODE_DOWN_ERRORS, remember_secrets, scrub, secrets_of

if TYPE_CHECKING:
    from ...transport.sync import NodeClient

#: Keys asked per ``SCAN`` call (a hint to Redis; it bounds the work per call).
SCAN_COUNT = 500
#: Stop collecting after this many lock keys per node: the command is for
#: people and scripts, not for exporting millions of keys. Reported as truncated.
MAX_KEYS_PER_NODE = 100_000
#: Seconds a whole scan of one node may take before it is reported as failed.
SCAN_DEADLINE = 10.0
#: A node whose clock differs from the median of the nodes by more than this
#: (milliseconds) gets a warning in ``locks health``. Redis expires keys by its own
#: clock, so a node ahead by more than the drift allowance drops leases early.
CLOCK_OFFSET_WARN_MS = 100.0
#: Pings per node in ``locks health``; the fastest one is the round trip.
PINGS = 3

_GLOB_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

T = TypeVar("T")


# ----------------------------------------------------------------- helpers

class PatternError(ValueError):
    """A ``--pattern`` that Redis would not match the way the user meant."""


def glob_escape(text: str) -> str:
    """``text`` as a Redis glob that matches only itself."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def validate_pattern(pattern: str) -> str:
    """Return ``pattern`` if it is a usable glob over lock names, else raise :class:`PatternError`.

    Redis glob syntax: ``*``, ``?``, ``[abc]``, ``[^a]``, ``[a-z]``, ``\\x`` escapes.
    Redis silently accepts an unclosed ``[`` or a trailing ``\\`` and then matches
    nothing useful; refusing them gives the operator an error instead of an
    empty list.
    """
    if not pattern:
        raise PatternError("the pattern is empty; use '*' for every lock")
    if len(pattern) > MAX_NAME_LENGTH:
        raise PatternError(f"the pattern is longer than {MAX_NAME_LENGTH} characters")
    if _GLOB_CONTROL.search(pattern):
        raise PatternError(f"the pattern contains a control character: {pattern!r}")
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 >= n:
                raise PatternError(f"the pattern ends with a lone backslash: {pattern!r}")
            i += 2
            continue
        if c == "[":
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                raise PatternError(f"the pattern has an empty '[]' class: {pattern!r}")
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            if j >= n:
                raise PatternError(f"the pattern has an unclosed '[': {pattern!r}")
            i = j + 1
            continue
        if c == "]":
            raise PatternError(f"the pattern has a ']' without '[': {pattern!r}")
        i += 1
    return pattern


def short_reason(node: NodeClient, exc: BaseException) -> str:
    """A one-line, password-free reason for a node's failure (the transport's
    :func:`~django_redlock.transport.sync.scrub`, with ``node``'s passwords
    remembered)."""
    remember_secrets(*secrets_of(node.spec))
    text = scrub(" ".join((str(exc) or type(exc).__name__).split()))
    return text if len(text) <= 160 else text[:157] + "..."


def _client(node: NodeClient, key: bytes | None = None) -> redis.Redis:
    """A redis-py client on the manager's pool for ``node`` (bounded by its
    timeouts); on a Cluster node, on the master serving ``key``."""
    if key is not None and hasattr(node, "pool_for"):
        return redis.Redis(connection_pool=node.pool_for(key))
    return redis.Redis(connection_pool=node.pool)


def _clients(node: NodeClient) -> list[redis.Redis]:
    """A client per server holding some of ``node``'s keys: each master of a
    Cluster node, else the node's one."""
    if hasattr(node, "master_pools"):
        return [redis.Redis(connection_pool=pool) for pool in node.master_pools()]
    return [_client(node)]


#: Bytes read from a service that answered something other than Redis' protocol.
_PEEK_BYTES = 64


def _describe_answer(data: bytes) -> str:
    """What a service's first bytes say it is, for an operator."""
    if not data:
        return "the service there closed the connection without a reply"
    first = data.split(b"\r\n", 1)[0].split(b"\n", 1)[0]
    text = first.decode("latin-1")
    shown = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)[:60]
    if data.startswith(b"HTTP/") or data.lstrip()[:14].lower() in (b"<!doctype html", b"<html>"):
        return f"an HTTP server answered {shown!r}"
    if data[:1] in (b"E", b"N", b"R") and len(data) >= 5 and data[1:2] == b"\x00":
        return f"a PostgreSQL-like service answered {shown!r}"
    return f"something answered {shown!r}"


def what_answered(node: NodeClient) -> str:
    """Ask the node's address with a bare ``PING`` and describe the raw reply.

    Used when redis-py could not parse a reply (``InvalidResponse``): its own
    message says nothing about *what* answered. Plain TCP and Unix sockets only
    (under TLS the bytes are not readable without a handshake we would have to
    repeat); bounded by the node timeout.
    """
    kwargs = node.pool.connection_kwargs
    timeout = float(kwargs.get("socket_timeout") or node.timeout or 1.0)
    if issubclass(node.pool.connection_class, redis.SSLConnection):
        return "not a Redis reply (over TLS)"
    try:
        if kwargs.get("path"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(kwargs["path"])
        else:
            sock = socket.create_connection((kwargs.get("host", "localhost"),
                                             int(kwargs.get("port", 6379))), timeout=timeout)
    except OSError as e:
        return f"not a Redis reply, and no second look ({e})"
    data = b""
    try:
        sock.sendall(b"PING\r\n")
        while len(data) < _PEEK_BYTES:
            chunk = sock.recv(_PEEK_BYTES - len(data))
            if not chunk:
                break
            data += chunk
            if b"\n" in data:
                break
    except OSError:
        if not data:
            return "no Redis reply"
    finally:
        sock.close()
    return _describe_answer(data)


@dataclass
class _Outcome:
    value: Any = None
    error: str | None = None
    done: bool = False


def _each_node(nodes: Sequence[NodeClient], job: Callable[[NodeClient], T],
               deadline: float) -> list[_Outcome]:
    """Run ``job(node)`` for every node in parallel; give up on a node after ``deadline`` s.

    Daemon threads, so a node stuck past the deadline can never keep the
    process alive; its outcome is reported as "no answer". Only the Redis
    errors that mean "this node is not usable" are caught; anything else is a
    bug and propagates.
    """
    outcomes = [_Outcome() for _ in nodes]
    failures: list[BaseException] = []

    def run(i: int, node: NodeClient) -> None:
        try:
            outcomes[i].value = job(node)
        except NODE_DOWN_ERRORS as e:
            reason = short_reason(node, e)
            if "closed by server" in reason:
                # What a PostgreSQL server does with a Redis command: reads it as
                # a bad startup packet and hangs up without a word. redis-py's
                # pure-Python parser also says this (where hiredis raises
                # InvalidResponse) when a service wrote something else and hung
                # up, e.g. an HTTP server's HTML error page: look at what it says.
                answered = what_answered(node)
                if answered.startswith(("an HTTP server", "a PostgreSQL-like", "something")):
                    reason = short_reason(node, Exception(f"not a Redis server: {answered}"))
                else:
                    reason += (" (the service there closes connections without a Redis "
                               "reply: not a Redis server?)")
            outcomes[i].error = reason
        except ResponseError as e:
            outcomes[i].error = short_reason(node, e)
        except InvalidResponse:
            # A port that reaches another service (HTTP, PostgreSQL...): a node
            # down, said plainly, not a traceback.
            outcomes[i].error = short_reason(
                node, Exception(f"not a Redis server: {what_answered(node)}"))
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread below
            failures.append(e)
        finally:
            outcomes[i].done = True

    threads = [threading.Thread(target=run, args=(i, node), daemon=True,
                                name=f"redlock-inspect-{i}")
               for i, node in enumerate(nodes)]
    for t in threads:
        t.start()
    end = time.monotonic() + deadline
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    if failures:
        raise failures[0]
    for outcome in outcomes:
        if not outcome.done:
            outcome.error = f"no answer within {deadline:g} s"
    return outcomes


