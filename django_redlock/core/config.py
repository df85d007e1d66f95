"""Validation of the ``REDLOCK_NODES`` and ``REDLOCK`` settings, without I/O.

One function per setting returns a list of :class:`Problem` with stable ids. The
system checks (``django_redlock.checks``) report them through ``manage.py
check``; :class:`~django_redlock.LockManager` raises on the errors. One source
of truth, so the check and the runtime can never disagree about what is valid.

Check ids (documented in ``docs/settings.rst``):

======== ==================================================================
id       meaning
======== ==================================================================
E001     ``REDLOCK_NODES`` is missing or empty
E002     ``REDLOCK_NODES`` is not a list or tuple
E003     a node entry has the wrong type or shape
E004     a node URL is malformed (scheme, host, port or database)
E005     the same node is listed twice
E006     a ``cache:<alias>`` node names an unknown or non-Redis cache
E007     ``REDLOCK`` is not a dict
E008     ``REDLOCK`` has an unknown key
E009     a ``REDLOCK`` value has the wrong type
E010     a ``REDLOCK`` value is out of range
E011     a node's ``OPTIONS`` has an unknown key or a bad value
W001     an even number of nodes (no more fault tolerance than one fewer)
W002     TTL is not comfortably larger than the node timeout
======== ==================================================================
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping
from urllib.parse import unquote, urlsplit

from .keys import InvalidLockName, validate_prefix


@dataclass(frozen=True)
class Problem:
    id: str  # "E001" or "W001"; the checks add the "redlock." prefix
    msg: str
    hint: str | None = None

    @property
    def is_error(self) -> bool:
        return self.id.startswith("E")


#: Every ``REDLOCK`` key with its default. Documented in docs/settings.rst.
DEFAULTS: dict[str, Any] = {
    "KEY_PREFIX": "redlock",
    "TTL": 10.0,
    "TIMEOUT": 10.0,
    "AUTO_RENEW": True,
    "RETRY_DELAY": 0.2,
    "DRIFT_FACTOR": 0.01,
    "BUSY_STATUS": 423,
    "NODE_TIMEOUT": 0.1,
    "CONNECT_TIMEOUT": 1.0,
    "MAX_HOLD": None,
}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# key -> (type description, type test, range test, range description)
_RULES: dict[str, tuple[str, Callable[[Any], bool], Callable[[Any], bool], str]] = {
    "KEY_PREFIX": ("a string", lambda v: isinstance(v, str), lambda v: True, ""),
    "TTL": ("a number of seconds", _number, lambda v: 0.01 <= v <= 86400,
            "between 0.01 and 86400 seconds"),
    "TIMEOUT": ("None or a number of seconds", lambda v: v is None or _number(v),
                lambda v: v is None or v >= 0, "None (wait forever), 0 (try once) or > 0"),
    "AUTO_RENEW": ("a bool", lambda v: isinstance(v, bool), lambda v: True, ""),
    "RETRY_DELAY": ("a number of seconds", _number, lambda v: 0.001 <= v <= 60,
                    "between 0.001 and 60 seconds"),
    "DRIFT_FACTOR": ("a number", _number, lambda v: 0 <= v < 0.5, "at least 0 and below 0.5"),
    "BUSY_STATUS": ("an int", lambda v: isinstance(v, int) and not isinstance(v, bool),
                    lambda v: 400 <= v <= 599, "an HTTP error status between 400 and 599"),
    "NODE_TIMEOUT": ("a number of seconds", _number, lambda v: 0.001 <= v <= 30,
                     "between 0.001 and 30 seconds"),
    "CONNECT_TIMEOUT": ("a number of seconds", _number, lambda v: 0.001 <= v <= 60,
                        "between 0.001 and 60 seconds"),
    "MAX_HOLD": ("None or a number of seconds", lambda v: v is None or _number(v),
                 lambda v: v is None or v > 0, "None (no cap) or > 0"),
}


def check_options(options: Any) -> list[Problem]:
    """Problems in a ``REDLOCK`` dict (upper-case keys)."""
    if options is None:
        return []
    if not isinstance(options, Mapping):
        return [Problem("E007", f"REDLOCK must be a dict, not {type(options).__name__}.")]
    problems: list[Problem] = []
    for key, value in options.items():
        if key not in _RULES:
            close = difflib.get_close_matches(str(key).upper(), list(_RULES), n=1)
            problems.append(Problem(
                "E008", f"REDLOCK has an unknown key {key!r}.",
                hint=(f"Did you mean {close[0]!r}? " if close else "")
                + "Known keys: " + ", ".join(sorted(_RULES)) + "."))
            continue
        type_desc, type_ok, range_ok, range_desc = _RULES[key]
        if not type_ok(value):
            problems.append(Problem(
                "E009", f"REDLOCK[{key!r}] must be {type_desc}, not {type(value).__name__}."))
        elif not range_ok(value):
            problems.append(Problem("E010", f"REDLOCK[{key!r}] is {value!r}; it must be {range_desc}."))
        elif key == "KEY_PREFIX":
            try:
                validate_prefix(value)
            except InvalidLockName as e:
                problems.append(Problem("E010", str(e)))
    merged = {**DEFAULTS, **{k: v for k, v in options.items() if k in _RULES}}
    ttl, node_timeout = merged["TTL"], merged["NODE_TIMEOUT"]
    if _number(ttl) and _number(node_timeout) and ttl < 10 * node_timeout and not any(
            p.id in ("E009", "E010") for p in problems):
        problems.append(Problem(
            "W002", f"TTL ({ttl} s) is less than ten times NODE_TIMEOUT ({node_timeout} s).",
            hint="A round to the nodes may take up to NODE_TIMEOUT, which eats into the "
                 "lease; raise TTL or lower NODE_TIMEOUT."))
    return problems


# ---------------------------------------------------------------- nodes

_URL_SCHEMES = ("redis", "rediss", "unix")
#: Node OPTIONS we pass to the redis-py connection pool, with their type test.
NODE_OPTIONS: dict[str, Callable[[Any], bool]] = {
    "socket_timeout": lambda v: _number(v) and v > 0,
    "socket_connect_timeout": lambda v: _number(v) and v > 0,
    "password": lambda v: isinstance(v, str),
    "username": lambda v: isinstance(v, str),
    "ssl_cert_reqs": lambda v: isinstance(v, str) or v is None,
    "ssl_ca_certs": lambda v: isinstance(v, str) or v is None,
    "ssl_certfile": lambda v: isinstance(v, str) or v is None,
    "ssl_keyfile": lambda v: isinstance(v, str) or v is None,
    "ssl_check_hostname": lambda v: isinstance(v, bool),
    "max_connections": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
    "client_name": lambda v: isinstance(v, str),
    "health_check_interval": lambda v: _number(v) and v >= 0,
}


@dataclass(frozen=True)
class NodeSpec:
    """One configured node: a URL with options, or a django-redis cache alias."""

    kind: str  # "url" or "cache"
    url: str = ""
    alias: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def display(self) -> str:
        """A name safe to print: the password is masked."""
        return f"cache:{self.alias}" if self.kind == "cache" else mask_url(self.url)

    @property
    def identity(self) -> tuple[Any, ...]:
        """What makes two entries the same server (for the duplicate check)."""
        if self.kind == "cache":
            return ("cache", self.alias)
        parts = urlsplit(self.url)
        if parts.scheme == "unix":
            return ("unix", parts.path)
        db = (parts.path or "/0").strip("/") or "0"
        return ("tcp", (parts.hostname or "").lower(), parts.port or 6379, db)


def mask_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (also in query strings)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<malformed url>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostpart = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{hostpart}" if ":" in userinfo else f"***@{hostpart}"
    query = parts.query
    if "password=" in query:
        query = "&".join("password=***" if q.startswith("password=") else q
                         for q in query.split("&"))
    rebuilt = f"{parts.scheme}://{netloc}{parts.path}"
    return rebuilt + (f"?{query}" if query else "")


def _check_url(url: str, where: str) -> list[Problem]:
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError on a bad port
    except ValueError as e:
        return [Problem("E004", f"{where}: malformed URL {mask_url(url)!r} ({e}).")]
    if parts.scheme not in _URL_SCHEMES:
        return [Problem("E004", f"{where}: URL {mask_url(url)!r} must start with redis://, "
                                f"rediss:// or unix://.")]
    if parts.scheme == "unix":
        return [] if parts.path else [Problem("E004", f"{where}: unix URL has no socket path.")]
    if not parts.hostname:
        return [Problem("E004", f"{where}: URL {mask_url(url)!r} has no host.")]
    if port is not None and not 0 < port < 65536:
        return [Problem("E004", f"{where}: URL {mask_url(url)!r} has port {port}.")]
    db = (parts.path or "/").strip("/")
    if db and not db.isdigit():
        return [Problem("E004", f"{where}: URL {mask_url(url)!r} has database {unquote(db)!r}; "
                                f"it must be a number.")]
    return []


def parse_nodes(nodes: Any) -> tuple[list[NodeSpec], list[Problem]]:
    """Node specs from a ``REDLOCK_NODES`` value, and the problems found.

    ``cache:<alias>`` entries are not resolved here (that needs Django's CACHES);
    see :func:`check_cache_aliases`.
    """
    if nodes is None:
        return [], [Problem("E001", "REDLOCK_NODES is not set.",
                            hint='Set it to a list of Redis URLs, e.g. ["redis://127.0.0.1:6379/0"].')]
    if isinstance(nodes, (str, bytes)) or not isinstance(nodes, (list, tuple)):
        return [], [Problem("E002", f"REDLOCK_NODES must be a list or tuple, not "
                                    f"{type(nodes).__name__}.",
                            hint="Wrap a single URL in a list.")]
    if not nodes:
        return [], [Problem("E001", "REDLOCK_NODES is empty.",
                            hint="List at least one Redis master; 3 or 5 for Redlock.")]
    specs: list[NodeSpec] = []
    problems: list[Problem] = []
    for i, entry in enumerate(nodes):
        where = f"REDLOCK_NODES[{i}]"
        if isinstance(entry, str):
            if entry.startswith("cache:"):
                alias = entry[len("cache:"):]
                if not alias:
                    problems.append(Problem("E003", f"{where}: 'cache:' needs a cache alias."))
                    continue
                specs.append(NodeSpec(kind="cache", alias=alias))
                continue
            found = _check_url(entry, where)
            problems += found
            if not found:
                specs.append(NodeSpec(kind="url", url=entry))
        elif isinstance(entry, Mapping):
            unknown = set(entry) - {"URL", "OPTIONS"}
            if unknown or "URL" not in entry:
                problems.append(Problem(
                    "E003", f"{where}: a dict node needs a 'URL' and may have 'OPTIONS'"
                            + (f"; unknown keys {sorted(map(str, unknown))}" if unknown else "")
                            + "."))
                continue
            url, options = entry["URL"], entry.get("OPTIONS") or {}
            if not isinstance(url, str):
                problems.append(Problem("E003", f"{where}: 'URL' must be a string."))
                continue
            found = _check_url(url, where)
            if not isinstance(options, Mapping):
                found.append(Problem("E011", f"{where}: 'OPTIONS' must be a dict."))
            else:
                for k, v in options.items():
                    test = NODE_OPTIONS.get(k)
                    if test is None:
                        found.append(Problem(
                            "E011", f"{where}: unknown option {k!r}.",
                            hint="Known options: " + ", ".join(sorted(NODE_OPTIONS)) + "."))
                    elif not test(v):
                        shown = "***" if k == "password" else repr(v)
                        found.append(Problem("E011", f"{where}: option {k!r} has a bad value {shown}."))
            problems += found
            if not found:
                specs.append(NodeSpec(kind="url", url=url, options=dict(options)))
        else:
            problems.append(Problem(
                "E003", f"{where}: must be a URL string, 'cache:<alias>' or a dict with 'URL', "
                        f"not {type(entry).__name__}."))
    seen: dict[tuple[Any, ...], int] = {}
    for i, spec in enumerate(specs):
        if spec.identity in seen:
            problems.append(Problem(
                "E005", f"REDLOCK_NODES lists {spec.display} twice.",
                hint="Redlock needs independent nodes; a node listed twice counts twice "
                     "towards the quorum."))
        seen.setdefault(spec.identity, i)
    if specs and not problems and len(specs) % 2 == 0:
        problems.append(Problem(
            "W001", f"REDLOCK_NODES has {len(specs)} nodes, an even number.",
            hint=f"{len(specs)} nodes need {len(specs) // 2 + 1} to agree and tolerate "
                 f"{len(specs) - len(specs) // 2 - 1} failures, no more than {len(specs) - 1} "
                 f"nodes; use an odd number."))
    return specs, problems


def check_cache_aliases(specs: list[NodeSpec], caches: Mapping[str, Any]) -> list[Problem]:
    """E006 for each ``cache:<alias>`` node whose alias is not a Redis cache."""
    problems = []
    for spec in specs:
        if spec.kind != "cache":
            continue
        conf = caches.get(spec.alias)
        if conf is None:
            problems.append(Problem(
                "E006", f"REDLOCK_NODES names cache alias {spec.alias!r}, which is not in CACHES.",
                hint="Known aliases: " + (", ".join(sorted(caches)) or "none") + "."))
        elif "django_redis" not in str(conf.get("BACKEND", "")):
            problems.append(Problem(
                "E006", f"Cache {spec.alias!r} uses {conf.get('BACKEND')!r}, not django-redis.",
                hint="Only django-redis caches (django_redis.cache.RedisCache) can lend "
                     "their connection pool."))
    return problems


def resolve_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Defaults merged with ``options`` (upper-case keys), assumed valid."""
    return {**DEFAULTS, **(options or {})}
