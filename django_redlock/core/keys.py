"""Lock names and the Redis keys derived from them.

Every key django-redlock writes:

* ``{KEY_PREFIX}:{NAME}``: the lock itself, a string ``token|fence|owner-json``
  with a PX expiry (the contract fixes this name);
* ``{{KEY_PREFIX}:{NAME}}:fence``: the fencing counter of NAME. The lock key in
  braces is a Redis Cluster hash tag, so both keys a script touches live in the
  same slot (python-redis-lock #59 broke on Cluster for want of this). When the
  lock key already contains a hash tag, the counter reuses it. The counter
  expires an hour after its last use; see ``docs/safety.rst`` for why that keeps
  fences increasing.

* ``{{KEY_PREFIX}:{NAME}}:waiters``: the queue of NAME's waiting acquirers (a
  list of holder tokens, first come first served), in the same slot for the
  same reason. A release wakes only the first (see ``lua/release.lua``), so one
  release costs one retry, not one per waiter. It expires shortly after the
  lock does when nobody waits any more.

Release notices are published on a channel named like the lock key (channels and
keys are separate namespaces in Redis).
"""

from __future__ import annotations

import re

#: Longest lock name accepted (characters). Long enough for any sensible
#: "app.model:pk" style name, short enough to keep keys and logs readable.
MAX_NAME_LENGTH = 200

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_PREFIX_OK = re.compile(r"^[A-Za-z0-9_.:\-]+$")


class InvalidLockName(ValueError):
    """A lock name that would make an unsafe or ambiguous key."""


def validate_name(name: object) -> str:
    """Return ``name`` if it is a usable lock name, else raise :class:`InvalidLockName`.

    Names are rejected rather than mangled: a silently "cleaned" name could make
    two different resources share one lock, or one resource use two.
    """
    if not isinstance(name, str):
        raise InvalidLockName(f"lock name must be a str, got {type(name).__name__}")
    if not name:
        raise InvalidLockName("lock name must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidLockName(
            f"lock name is {len(name)} characters long; the limit is {MAX_NAME_LENGTH}: "
            f"{name[:40]!r}...")
    if _CONTROL.search(name):
        raise InvalidLockName(f"lock name contains a control character: {name!r}")
    if name != name.strip():
        raise InvalidLockName(f"lock name has leading or trailing whitespace: {name!r}")
    return name


def validate_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or not _PREFIX_OK.match(prefix):
        raise InvalidLockName(
            f"KEY_PREFIX must be a non-empty string of letters, digits, '_', '.', ':', '-': "
            f"got {prefix!r}")
    return prefix


def lock_key(prefix: str, name: str) -> str:
    return f"{prefix}:{name}"


def name_from_key(prefix: str, key: str) -> str | None:
    """The lock name of a lock key, or None for a key that is not a lock key."""
    head = prefix + ":"
    return key[len(head):] if key.startswith(head) else None


def _has_hash_tag(key: str) -> bool:
    start = key.find("{")
    if start < 0:
        return False
    end = key.find("}", start + 1)
    return end > start + 1


def fence_key(lock_key_: str) -> str:
    """The fencing counter key of a lock key, in the same Cluster slot."""
    if _has_hash_tag(lock_key_):
        return lock_key_ + ":fence"
    return "{" + lock_key_ + "}:fence"


def waiters_key(lock_key_: str) -> str:
    """The waiter queue key of a lock key, in the same Cluster slot."""
    if _has_hash_tag(lock_key_):
        return lock_key_ + ":waiters"
    return "{" + lock_key_ + "}:waiters"
