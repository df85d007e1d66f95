"""Lock names and the Redis keys derived from them.

Every key django-redlock writes, for a lock key ``K = {KEY_PREFIX}:{NAME}``:

* ``K``: the lock itself, a string ``token|fence|owner-json`` with a PX expiry
  (the contract fixes this name);
* the fencing counter (role ``fence``) and the waiter queue (role ``waiters``)
  of NAME, in one of three forms:

  - ``{K}:<role>`` when K has no hash tag and no ``}`` (most names:
    ``{redlock:orders:7}:fence``). The braces make K the Cluster hash tag, so the
    counter sits in K's slot;
  - ``{<tag>}:<role>:K`` when K has a hash tag (``redlock:{user1}:cart`` ->
    ``{user1}:fence:redlock:{user1}:cart``): same tag, same slot;
  - ``{}:<role>:K`` when K has no hash tag but contains a ``}``. No key can share
    the slot of such a K (Cluster hashes all of it, and a tag ends at the first
    ``}``), so on a Cluster node these names fail with ``CROSSSLOT`` as they
    always did; on the independent masters Redlock is made for they work.

  Every internal key starts with ``{`` and no lock key does (the prefix has no
  brace), and :func:`parse_internal_key` reads (K, role) back from each one, so
  no name can reach another name's counter or queue (the previous layout,
  ``K:fence`` for a name with a hash tag, made lock ``{x}:fence`` the counter of
  lock ``{x}``). Same slot as K: a script touches several keys, and Cluster
  refuses that across slots (python-redis-lock #59 broke on Cluster for want of
  this).

  The counter expires an hour after the node's clock passes it; see
  ``docs/safety.rst`` for why that keeps fences increasing. The queue is a list
  of holder tokens, first come first served; a release wakes only the first (see
  ``lua/release.lua``), so one release costs one retry, not one per waiter. It
  expires shortly after the lock does when nobody waits any more.

A semaphore named NAME (``engine.semaphore``) keeps its permit count under a
third role, ``permits``, of NAME's lock key (same three forms); its permits,
line and free channel are the plain lock names ``NAME#<i>``, ``NAME#line`` and
``NAME#free``.

Release notices are published on a channel named like the lock key (channels and
keys are separate namespaces in Redis).
"""

from __future__ import annotations

import re

#: Longest lock name accepted (characters). Long enough for any sensible
#: "app.model:pk" style name, short enough to keep keys and logs readable.
MAX_NAME_LENGTH = 200

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: Used with fullmatch: "^...$" let "x\n" through ("$" matches before a final newline).
_PREFIX_OK = re.compile(r"[A-Za-z0-9_.:\-]+")


class InvalidLockName(ValueError):
    """A lock name that would make an unsafe or ambiguous key.

    ``placeholder``: when a template's placeholder produced the bad value, that
    placeholder (so a view can tell the client's bad input from its own bug).
    """

    placeholder: object = None


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
    try:
        name.encode("utf-8")  # the key is sent as UTF-8
    except UnicodeEncodeError:
        raise InvalidLockName(f"lock name is not valid text (a lone surrogate): {name!r}") \
            from None
    return name


def validate_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or not _PREFIX_OK.fullmatch(prefix):
        raise InvalidLockName(
            f"KEY_PREFIX must be a non-empty string of letters, digits, '_', '.', ':', '-': "
            f"got {prefix!r}")
    return prefix


def lock_key(prefix: str, name: str) -> str:
    return f"{prefix}:{name}"


def segment_channel(prefix: str, name: str) -> bytes:
    """The free channel of segments ``base`` when ``name`` is ``"<base>[<i>]"``
    (segment ``i`` of ``segments(base, count)``), else ``b""``.

    The release script of such a lock publishes its key there, whoever holds
    it (a ``segments()`` object or a plain ``lock("<base>[<i>]")``), so a
    segments waiter listening there is woken by a release of any segment.
    """
    if not name.endswith("]"):
        return b""
    base, bracket, index = name[:-1].rpartition("[")
    if not bracket or not base or not index.isdigit():
        return b""
    return lock_key(prefix, f"{base}[free]").encode()


def free_channels(prefix: str, name: str) -> list[bytes]:
    """The channels a forced release of lock ``name`` publishes its key on, to
    wake the waiters of a family that listen there rather than on the key: the
    segments' free channel for ``"<base>[<i>]"`` (:func:`segment_channel`), the
    semaphore's for a permit ``"<base>#<i>"``. A plain lock that only looks like
    one costs a notice nobody hears."""
    channels = [segment_channel(prefix, name)] if segment_channel(prefix, name) else []
    base, hash_sign, index = name.rpartition("#")
    if hash_sign and base and index.isdigit():
        channels.append(lock_key(prefix, f"{base}#free").encode())
    return channels


def name_from_key(prefix: str, key: str) -> str | None:
    """The lock name of a lock key, or None for a key that is not a lock key."""
    head = prefix + ":"
    return key[len(head):] if key.startswith(head) else None


def hash_tag(key: str) -> str | None:
    """The Redis Cluster hash tag of ``key``, or None when Cluster hashes the whole key.

    Cluster's rule: the text between the first ``{`` and the first ``}`` after
    it, when that text is not empty.
    """
    start = key.find("{")
    if start < 0:
        return None
    end = key.find("}", start + 1)
    if end < 0 or end == start + 1:
        return None
    return key[start + 1:end]


#: The roles of the keys kept beside a lock key.
ROLES = ("fence", "waiters")
#: Roles added after the layout change that ``legacy_internal_role`` is about
#: (no release ever kept these under the old layout): ``permits``, the
#: permit count of a semaphore, kept beside the lock key of its name.
EXTRA_ROLES = ("permits",)


def _internal_key(lock_key_: str, role: str) -> str:
    """The ``role`` key of a lock key: see the module docstring for the three forms.

    Every form starts with ``{`` and a lock key never does (it starts with the
    prefix, which has no brace), so no lock name reaches an internal key; and
    :func:`parse_internal_key` reads the lock key and role back from any of
    them, so no two (lock key, role) pairs share one.
    """
    tag = hash_tag(lock_key_)
    if tag is not None:
        return "{" + tag + "}:" + role + ":" + lock_key_
    if "}" not in lock_key_:
        return "{" + lock_key_ + "}:" + role
    return "{}:" + role + ":" + lock_key_


def parse_internal_key(key: str) -> tuple[str, str] | None:
    """``(lock key, role)`` of a fencing counter or waiter queue key, None for other keys.

    The inverse of :func:`fence_key` / :func:`waiters_key`; it exists to show
    (and to test) that the layout is unambiguous.
    """
    if not key.startswith("{"):
        return None
    close = key.find("}")
    if close < 0:
        return None
    tag, rest = key[1:close], key[close + 1:]
    for role in ROLES + EXTRA_ROLES:
        if rest == ":" + role:
            if tag and hash_tag(tag) is None and "}" not in tag:
                return tag, role
            return None
        head = ":" + role + ":"
        if rest.startswith(head):
            lock = rest[len(head):]
            if tag and hash_tag(lock) == tag:
                return lock, role
            if not tag and hash_tag(lock) is None and "}" in lock:
                return lock, role
            return None
    return None


def fence_key(lock_key_: str) -> str:
    """The fencing counter key of a lock key, in the same Cluster slot."""
    return _internal_key(lock_key_, "fence")


def waiters_key(lock_key_: str) -> str:
    """The waiter queue key of a lock key, in the same Cluster slot."""
    return _internal_key(lock_key_, "waiters")


def permits_key(lock_key_: str) -> str:
    """The permit count key of a semaphore whose name has lock key ``lock_key_``
    (``engine.semaphore``), in the same Cluster slot."""
    return _internal_key(lock_key_, "permits")


def legacy_internal_role(name: str) -> tuple[str, str] | None:
    """``(owning name, role)`` when the lock key of ``name`` is where releases up to
    0.x kept the fencing counter or waiter queue of another name, else None.

    That layout appended ``:fence`` / ``:waiters`` to the lock key of a name with
    a hash tag, so ``{x}:fence`` was both a name and the counter of ``{x}``. Such
    keys are left by a running older release (or for up to an hour after the
    upgrade); ``manage.py locks`` names them instead of calling them foreign.
    """
    for role in ROLES:
        suffix = ":" + role
        if name.endswith(suffix):
            owner = name[:-len(suffix)]
            if owner and hash_tag(owner) is not None:
                return owner, role
    return None
