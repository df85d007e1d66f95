"""What the harness's parts share: ports, bounds, errors, raw commands.

Standard library only (and :mod:`django_redlock.transport.resp`, which is too).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only

    pass


from ..transport.resp import RespReader, pack

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
# Raw RESP (transport/resp.py): enough to PING, AUTH, FLUSHALL without redis-py
# --------------------------------------------------------------------------


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
        sock.sendall(b"".join(pack(*c) for c in all_commands))
        reader = RespReader(sock, error=RedisReplyError)
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
