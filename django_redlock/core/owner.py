"""What is stored in a lock key, and how to read it back.

The value is ``token|fence|owner`` where ``token`` is 22 url-safe characters from
16 random bytes (``secrets``), ``fence`` the decimal fencing token and ``owner`` a
compact JSON object (host, pid, thread, label, since). Storing the owner in the
lock value costs no extra round trip and no extra key, and lets ``manage.py
locks`` say who holds a lock. The scripts compare only the ``token|`` prefix.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

TOKEN_BYTES = 16
SEPARATOR = "|"


def new_token() -> str:
    """A fresh holder token: 128 random bits, url-safe, never containing '|'."""
    return secrets.token_urlsafe(TOKEN_BYTES)


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
    return f'{_owner_head(os.getpid(), threading.current_thread().name, label)},"since":{when:.3f}}}'


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
