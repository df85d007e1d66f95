"""What is stored in a lock key, and how to read it back.

The value is ``token|fence|owner`` where ``token`` is 22 url-safe characters from
16 random bytes (``os.urandom``, where ``secrets`` draws them), ``fence`` the
decimal fencing token and ``owner`` a compact JSON object (host, pid, thread,
label, since, and ``n``: which attempt of the ``acquire()`` call wrote it, added
per attempt by the engine). Storing the owner in the lock value costs no extra
round trip and no extra key, and lets ``manage.py locks`` say who holds a lock.
The scripts compare the ``token|`` prefix, and ``n`` so that a late request of
an earlier attempt never undoes a later one's (``lua/attempt.lua``).
"""

from __future__ import annotations

import functools
import json
import socket
import threading
import time
from binascii import b2a_base64
from dataclasses import dataclass
from os import urandom
from typing import Any

from .pid import getpid

TOKEN_BYTES = 16
SEPARATOR = "|"


def new_token() -> str:
    """A fresh holder token: 128 random bits, url-safe, never containing '|'."""
    # secrets.token_urlsafe(TOKEN_BYTES), without its two layers of calls
    return b2a_base64(urandom(TOKEN_BYTES), newline=False).rstrip(b"=").translate(
        _URL_SAFE).decode("ascii")


#: base64's two characters that are not url-safe, as ``base64.urlsafe_b64encode`` maps them.
_URL_SAFE = bytes.maketrans(b"+/", b"-_")

_HOST = socket.gethostname()


@functools.lru_cache(maxsize=512)
def _owner_head(pid: int, thread: str, label: str | None) -> str:
    data: dict[str, Any] = {"host": _HOST, "pid": pid, "thread": thread}
    if label:
        data["label"] = label
    return json.dumps(data, separators=(",", ":"))[:-1]  # without the closing brace


def owner_json(label: str | None, *, since: float | None = None) -> str:
    """The owner metadata of the calling thread, as compact JSON.

    Built on every acquire, so the part that rarely changes (host, pid, thread,
    label) is encoded once and cached; only ``since`` is formatted each time.
    """
    when = time.time() if since is None else since
    return f'{_owner_head(getpid(), threading.current_thread().name, label)},"since":{when:.3f}}}'


@dataclass(frozen=True)
class StoredLock:
    """A lock value as found on one node."""

    token: str
    fence: int
    owner: dict[str, Any]


def parse_value(raw: bytes | str) -> StoredLock | None:
    """Parse a lock value; None when it is not one of ours (foreign data)."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    parts = text.split(SEPARATOR, 2)
    if len(parts) != 3:
        return None
    token, fence_text, owner_text = parts
    try:
        fence = int(fence_text)
    except ValueError:
        return None
    try:
        owner = json.loads(owner_text)
    except ValueError:
        owner = {}
    if not isinstance(owner, dict):
        owner = {}
    return StoredLock(token=token, fence=fence, owner=owner)
