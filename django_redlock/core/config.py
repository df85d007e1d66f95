"""Validation of the ``REDLOCK_NODES`` and ``REDLOCK`` settings, without I/O.

(Why one module of 1,000 lines: it is the single place where a setting is
accepted or refused, for ``manage.py check`` and ``LockManager`` alike; one
table of rules per setting, every message with its ``redlock.E0xx`` id.)

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
E004     a node URL is malformed (scheme, host, port, database or an
         unencoded character of its password)
E005     the same node is listed twice
E006     a ``cache:<alias>`` node names an unknown or non-Redis cache
E007     ``REDLOCK`` is not a dict
E008     ``REDLOCK`` has an unknown key
E009     a ``REDLOCK`` value has the wrong type
E010     a ``REDLOCK`` value is out of range
E011     a node's ``OPTIONS`` or URL query has an unknown key or a bad value
E012     a Sentinel node (``SENTINELS``/``SERVICE``) has the wrong shape
E013     a Sentinel node's sentinel address is malformed
E014     a Cluster node (``CLUSTER``) has the wrong shape
E015     a Cluster node's start-up address is malformed
W001     an even number of nodes (no more fault tolerance than one fewer)
W002     TTL is not comfortably larger than the node timeout
W003     a node's socket timeouts are longer than ``NODE_TIMEOUT``
W004     two nodes are databases of one Redis server
======== ==================================================================
"""

from __future__ import annotations

import difflib
import ipaddress
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, TypeGuard
from urllib.parse import parse_qsl, quote, unquote, unquote_plus, urlsplit

from . import arguments
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
    "REPLICA_ACKS": 0,
}


#: The most replicas ``REPLICA_ACKS`` may ask for: far above any deployment;
#: a larger number is a typo (a timeout in ms?), and would refuse every lock.
REPLICA_ACKS_MAX = 64


def _number(v: Any) -> TypeGuard[float]:
    return arguments.is_seconds(v)  # finite, and an int that fits a float


def _time(key: str, none_ok: bool = False) -> tuple[str, Callable[[Any], bool],
                                                     Callable[[Any], bool], str]:
    """A time option's rule: the range test is the very check ``lock()`` and
    the manager's other calls use (:data:`core.arguments.SETTINGS`), so a
    setting and a per-call argument can never disagree."""
    check, range_desc = arguments.SETTINGS[key]
    if none_ok:
        return ("None or a number of seconds", lambda v: v is None or _number(v),
                lambda v: arguments.accepts(check, v), range_desc)
    return ("a number of seconds", _number, lambda v: arguments.accepts(check, v), range_desc)


# key -> (type description, type test, range test, range description)
_RULES: dict[str, tuple[str, Callable[[Any], bool], Callable[[Any], bool], str]] = {
    "KEY_PREFIX": ("a string", lambda v: isinstance(v, str), lambda v: True, ""),
    "TTL": _time("TTL"),
    "TIMEOUT": _time("TIMEOUT", none_ok=True),
    "AUTO_RENEW": ("a bool", lambda v: isinstance(v, bool), lambda v: True, ""),
    "RETRY_DELAY": _time("RETRY_DELAY"),
    "DRIFT_FACTOR": ("a number", _number, lambda v: 0 <= v < 0.5, "at least 0 and below 0.5"),
    "BUSY_STATUS": ("an int", lambda v: isinstance(v, int) and not isinstance(v, bool),
                    lambda v: 400 <= v <= 599, "an HTTP error status between 400 and 599"),
    "NODE_TIMEOUT": _time("NODE_TIMEOUT"),
    "CONNECT_TIMEOUT": _time("CONNECT_TIMEOUT"),
    "MAX_HOLD": _time("MAX_HOLD", none_ok=True),
    "REPLICA_ACKS": ("an int (replicas per node)",
                     lambda v: isinstance(v, int) and not isinstance(v, bool),
                     lambda v: 0 <= v <= REPLICA_ACKS_MAX,
                     f"between 0 (no check) and {REPLICA_ACKS_MAX} replicas"),
}


def _shown(value: Any) -> str:
    """A bad value as the message shows it: a number as itself (``nan``, ``inf``
    say more than "float"), anything else by its type (it may be long or secret)."""
    if isinstance(value, (int, float)):
        return arguments.describe(value)
    return type(value).__name__


def check_options(options: Any) -> list[Problem]:
    """Problems in a ``REDLOCK`` dict (upper-case keys)."""
    if options is None:
        return []
    if not isinstance(options, Mapping):
        return [Problem("E007", f"REDLOCK must be a dict, not {type(options).__name__}.")]
    problems: list[Problem] = []
    for key, value in options.items():
        if key not in _RULES:
            close = difflib.get_close_matches(key.upper(), list(_RULES), n=1) \
                if isinstance(key, str) else []
            problems.append(Problem(
                "E008", f"REDLOCK has an unknown key {arguments.describe(key)}.",
                hint=(f"Did you mean {close[0]!r}? " if close else "")
                + "Known keys: " + ", ".join(sorted(_RULES)) + "."))
            continue
        type_desc, type_ok, range_ok, range_desc = _RULES[key]
        if not type_ok(value):
            problems.append(Problem(
                "E009", f"REDLOCK[{key!r}] must be {type_desc}, not {_shown(value)}."))
        elif not range_ok(value):
            problems.append(Problem("E010", f"REDLOCK[{key!r}] is {arguments.describe(value)}; "
                                            f"it must be {range_desc}."))
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


def _text_ok(v: Any) -> bool:
    return isinstance(v, str)


def _client_name_ok(v: Any) -> bool:
    # Redis refuses CLIENT SETNAME with spaces, newlines or other special
    # characters ("Client names cannot contain spaces..."); every connection
    # would then fail at connect time, so it is an error here.
    return isinstance(v, str) and all("!" <= c <= "~" for c in v)


#: Node OPTIONS we pass to the redis-py connection pool, with their type test.
#: The same rules apply to the same keys in a URL's query string.
NODE_OPTIONS: dict[str, Callable[[Any], bool]] = {
    "socket_timeout": lambda v: _number(v) and v > 0,
    "socket_connect_timeout": lambda v: _number(v) and v > 0,
    "password": _text_ok,
    "username": _text_ok,
    "ssl_cert_reqs": lambda v: v is None or v in ("none", "optional", "required"),
    "ssl_ca_certs": lambda v: isinstance(v, str) or v is None,
    "ssl_certfile": lambda v: isinstance(v, str) or v is None,
    "ssl_keyfile": lambda v: isinstance(v, str) or v is None,
    "ssl_check_hostname": lambda v: isinstance(v, bool),
    "max_connections": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
    "client_name": _client_name_ok,
    "health_check_interval": lambda v: _number(v) and v >= 0,
}

#: What a bad value must be, for the messages.
_NODE_OPTION_RULES = {
    "socket_timeout": "a number of seconds > 0",
    "socket_connect_timeout": "a number of seconds > 0",
    "password": "a str",
    "username": "a str",
    "ssl_cert_reqs": "'none', 'optional', 'required' or None",
    "ssl_ca_certs": "a path (str) or None",
    "ssl_certfile": "a path (str) or None",
    "ssl_keyfile": "a path (str) or None",
    "ssl_check_hostname": "a bool",
    "max_connections": "an int > 0",
    "client_name": "a str of printable ASCII without spaces",
    "health_check_interval": "a number of seconds >= 0",
}

#: Options only redis-py's TLS connection takes: with redis:// or unix:// the
#: first connection would fail with a TypeError.
_TLS_ONLY = frozenset(k for k in NODE_OPTIONS if k.startswith("ssl_"))

_BOOLS = {"true": True, "yes": True, "on": True, "1": True,
          "false": False, "no": False, "off": False, "0": False}
_DIGITS = re.compile(r"[0-9]{1,10}")


def _from_query(key: str, text: str) -> Any:
    """A URL query value as the Python value the same key takes in ``OPTIONS``.

    Returns ``_BAD`` when the text cannot be read as that type at all (the
    range is then checked by :data:`NODE_OPTIONS`, as for a dict node).
    """
    if key in ("socket_timeout", "socket_connect_timeout", "health_check_interval"):
        try:
            return float(text)
        except ValueError:
            return _BAD
    if key == "max_connections":
        return int(text) if _DIGITS.fullmatch(text) else _BAD
    if key == "ssl_check_hostname":
        return _BOOLS.get(text.lower(), _BAD)
    return text


_BAD: Any = object()


class Secret(str):
    """A password: a ``str`` wherever it is used, ``'***'`` wherever it is shown.

    ``repr()`` is what debug pages, ``pprint``, logging of containers and
    traceback locals show, so a password kept as a ``Secret`` in a node's
    options (and in the pool kwargs copied from them) never appears there.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "'***'"


def _masked_options(options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: ("***" if k == "password" and v is not None else v) for k, v in options.items()}


@dataclass(frozen=True, repr=False)
class NodeSpec:
    """One configured node: a URL with options, or a django-redis cache alias.

    ``url`` is exactly what the connection pool is built from: :func:`parse_nodes`
    writes it in one canonical form (lower-case scheme, explicit port and
    database, no user, password or query), and moves the user, the password
    and the query's options into ``options``, already converted and validated.
    So what ``manage.py check`` accepted is what connects, and the URL itself
    never carries a secret. ``name`` is how the node is shown (the configured
    URL with its password masked).
    """

    kind: str  # "url", "cache", "sentinel" or "cluster"
    url: str = ""
    alias: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)
    name: str = field(default="", compare=False)
    #: A Sentinel node's sentinels or a Cluster node's start-up nodes: canonical
    #: URLs (``redis://host:port/0``) without secrets.
    addresses: tuple[str, ...] = ()
    #: A Sentinel node's service (master) name.
    service: str = ""
    #: Each sentinel's own options (its URL's user and password), by position.
    address_options: tuple[Mapping[str, Any], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        password = self.options.get("password")
        if isinstance(password, str) and not isinstance(password, Secret):
            object.__setattr__(self, "options", {**self.options, "password": Secret(password)})

    def __repr__(self) -> str:
        if self.kind == "cache":
            return f"NodeSpec(cache:{self.alias})"
        return f"NodeSpec({self.display!r}, options={_masked_options(self.options)!r})"

    @property
    def is_group(self) -> bool:
        """A Sentinel or Cluster node: one vote, several servers behind it."""
        return self.kind in ("sentinel", "cluster")

    __str__ = __repr__

    @property
    def display(self) -> str:
        """A name safe to print: the password is masked."""
        if self.kind == "cache":
            return f"cache:{self.alias}"
        if self.kind == "sentinel":
            return f"sentinel:{self.service}@" + ",".join(
                a.split("://", 1)[1].rsplit("/", 1)[0] for a in self.addresses)
        if self.kind == "cluster":
            return "cluster:" + ",".join(
                a.split("://", 1)[1].rsplit("/", 1)[0] for a in self.addresses)
        return self.name or mask_url(self.url)

    @property
    def identity(self) -> tuple[Any, ...]:
        """What makes two entries the same server (for the duplicate check).

        ``localhost``, ``127.0.0.1`` and ``::1`` are one server (``localhost``
        may resolve to either address, and Redis listens on both by default);
        IP addresses compare by value (``::0:1`` is ``::1``); host names ignore
        case and a trailing dot; a missing port is 6379 and a missing database 0.
        """
        if self.kind == "cache":
            return ("cache", self.alias)
        if self.is_group:
            return self.identities[0]
        parsed = _parse_url(self.url)
        if isinstance(parsed, _Refused):  # built by hand, not by parse_nodes
            return ("raw", self.url)
        return parsed.identity

    @property
    def identities(self) -> list[tuple[Any, ...]]:
        """Every identity of the entry: a Sentinel or Cluster node has one per
        address (two entries sharing one sentinel of one service, or one
        Cluster start-up node, are the same node), with the service for a
        Sentinel node (a sentinel set may watch several masters)."""
        if not self.is_group:
            return [self.identity]
        found = []
        for address in self.addresses:
            parsed = _parse_url(address)
            ident = parsed.identity if isinstance(parsed, _URL) else ("raw", address)
            found.append((self.kind, self.service, *ident[:3]))
        return found


_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
_HOST_NAME = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
                        r"(?:\.[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?)*\.?")
_HOST_PORT = re.compile(r"(\[[^\]]*\]|[^:\[\]]*)(?::([^:]*))?")
_TCP_PATH = re.compile(r"/?([0-9]*)/?")
#: One part of an IPv4 address as the resolver reads it (BSD ``inet_aton``):
#: hexadecimal, octal (a leading 0), or decimal.
_IPV4_PART = re.compile(r"0x[0-9a-f]+|0[0-7]*|[1-9][0-9]*", re.IGNORECASE)
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_ENCODE_HINT = ("Percent-encode special characters in a password: / as %2F, ? as %3F, "
                "# as %23, @ as %40 (urllib.parse.quote(password, safe='')).")


@dataclass(frozen=True)
class _URL:
    """A node URL taken apart: what it connects to, and the options it carries."""

    scheme: str
    host: str  # as written in the canonical URL ([...] for IPv6); "" for unix
    port: int
    db: int
    path: str  # unix socket path
    options: dict[str, Any]  # username, password (a Secret) and query options

    @property
    def canonical(self) -> str:
        if self.scheme == "unix":
            return f"unix://{quote(self.path, safe='/')}" + (f"?db={self.db}" if self.db else "")
        return f"{self.scheme}://{self.host}:{self.port}/{self.db}"

    @property
    def identity(self) -> tuple[Any, ...]:
        if self.scheme == "unix":
            return ("unix", posixpath.normpath(self.path), self.db)
        host = self.host.strip("[]").rstrip(".")
        try:
            host = ipaddress.ip_address(host).compressed
        except ValueError:
            pass
        if host in _LOOPBACK:
            host = "loopback"
        return ("tcp", host, self.port, self.db)


def _ipv4_form(host: str) -> bool:
    """Whether the resolver reads ``host`` as an IPv4 address without a lookup:
    BSD ``inet_aton``'s forms (``127.0.0.1``, ``127.1``, ``2130706433``,
    ``0x7f.1``), which ``getaddrinfo`` tries before any name service. Pure
    parsing; tests/test_node_checks.py holds it to ``socket.inet_aton``."""
    parts = host.split(".")
    if not 1 <= len(parts) <= 4 or not all(_IPV4_PART.fullmatch(p) for p in parts):
        return False
    values = [int(p, 16) if p[1:2] in ("x", "X") else int(p, 8) if p[:1] == "0" else int(p)
              for p in parts]
    *leading, last = values
    return all(v <= 0xFF for v in leading) and last < 256 ** (5 - len(values))


def _unresolvable_host(host: str) -> str | None:
    """Why a host that passed the syntax check still cannot resolve, by its
    form alone (no lookup), or None. A host of digits and dots only is no DNS
    name (RFC 3696 2: a top-level domain is not all-numeric): the resolver
    connects to it only when it reads it as an IPv4 address::

        redis://127.0.0.1.:6379/0   the check passed it (a name may end with
                                    a dot); getaddrinfo, not reading it as an
                                    address, looked the name up: "Name or
                                    service not known" at every acquire

    A name with a trailing dot (``redis.example.com.``) is left alone: a
    fully qualified name, which resolves; so is one label of digits that is
    no address (``123456789012``): a short name, looked up as one."""
    name = host[:-1] if host.endswith(".") else host
    if _ipv4_form(name):
        if name != host:
            return (f"has host {host!r}: an IP address followed by a dot is looked up as "
                    f"a name, and is not found; write {name!r}")
        return None
    # Dotted only: one label of digits that is no address (a 12-digit Docker
    # container id, say) is looked up as a name, and such a name may resolve.
    if "." in name and all(label.isdigit() for label in name.split(".")):
        return (f"has host {host!r}, which is not an IPv4 address (a part above 255, more "
                f"than 4 parts, or an 8 or 9 after a leading 0), and a host name is not "
                f"all digits")
    return None


class _Refused(NamedTuple):
    """Why a URL cannot be used: a message part and a hint, both without secrets."""

    reason: str
    hint: str | None = None
    id: str = "E004"  # E011 for an option in the query string


def _parse_url(url: str) -> _URL | _Refused:
    """``url`` taken apart, or why it cannot be used (without secrets).

    Everything redis-py would choke on later (``ValueError``, ``TypeError`` when
    the first connection is made, a ``CLIENT SETNAME`` refused) is refused here:
    the check and the runtime read a URL the same way because the runtime only
    ever sees the canonical URL and options built here.
    """
    text = url.strip()
    if any(c < " " or c == "\x7f" for c in text):
        return _Refused("contains a control character (a line break or a tab?)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _Refused("is not valid text (a lone surrogate)")
    scheme_match = _SCHEME.match(text)
    if scheme_match is None or scheme_match.group(1).lower() not in _URL_SCHEMES:
        loose = _LOOSE_SCHEME.match(text)
        typo = loose.group().rstrip(":/").lower() if loose else ""
        if "sentinel" in typo:
            return _Refused("must start with redis://, rediss:// or unix://",
                            'A Sentinel-managed master is a node of its own: {"SENTINELS": '
                            '["redis://host:26379", ...], "SERVICE": "mymaster"}.')
        return _Refused("must start with redis://, rediss:// or unix://",
                        f"Did you mean {typo}://? " if typo in _URL_SCHEMES else None)
    scheme = scheme_match.group(1).lower()
    try:
        parts = urlsplit(text)
    except ValueError:  # e.g. an unbalanced [ in the host; its text may hold a password
        return _Refused("is malformed (an unbalanced '[' or ']' in the host?)")
    netloc = parts.netloc
    if parts.fragment or "#" in text:
        return _Refused("contains '#'", _ENCODE_HINT)
    if "@" in text[len(scheme) + 3 + len(netloc):]:
        return _Refused("has an '@' after the host", _ENCODE_HINT)
    options: dict[str, Any] = {}
    hostport = netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, has_pw, password = userinfo.partition(":")
        if user:
            options["username"] = unquote(user)
        if has_pw and password:
            options["password"] = Secret(unquote(password))
    try:
        query = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=True) \
            if parts.query else []
    except ValueError:
        return _Refused("has a malformed query string (expected ?key=value&key=value)")
    db_text: str | None = None
    seen: set[str] = set()
    for key, value in query:
        if key in seen:
            return _Refused(f"gives {key!r} twice in its query string",
                            id="E004" if key == "db" else "E011")
        seen.add(key)
        if key == "db":
            db_text = value
            continue
        if key not in NODE_OPTIONS:
            close = difflib.get_close_matches(key, [*NODE_OPTIONS, "db"], n=1)
            return _Refused(f"has an unknown option {key!r} in its query string",
                            (f"Did you mean {close[0]!r}? " if close else "")
                            + "Known: db, " + ", ".join(sorted(NODE_OPTIONS)) + ".", "E011")
        converted = _from_query(key, value)
        if converted is _BAD or not NODE_OPTIONS[key](converted):
            shown = "***" if key == "password" else arguments.describe(value)
            return _Refused(f"has a bad value {shown} for {key!r} in its query string; "
                            f"it must be {_NODE_OPTION_RULES[key]}", id="E011")
        options[key] = Secret(converted) if key == "password" else converted
    if scheme == "unix":
        if hostport:
            return _Refused("is a unix URL with a host", "Write unix:///path/to/redis.sock.")
        path = unquote(parts.path)
        if not path:
            return _Refused("is a unix URL without a socket path")
        if "\x00" in path:
            return _Refused("has a NUL character in its socket path")
        if db_text is not None and not _DIGITS.fullmatch(db_text):
            return _Refused(f"has database {db_text!r}; it must be a number")
        db = int(db_text or 0)
        host, port = "", 0
    else:
        hp = _HOST_PORT.fullmatch(hostport)
        if hp is None:
            return _Refused("has a malformed host or port")
        host_text, port_text = hp.group(1), hp.group(2)
        if host_text.startswith("["):
            try:
                ipaddress.IPv6Address(host_text[1:-1])
            except ValueError:
                return _Refused("has a malformed IPv6 address")
            host = host_text.lower()
        else:
            host = unquote(host_text).lower()
            if not host:
                return _Refused("has no host")
            if not _HOST_NAME.fullmatch(host) or len(host) > 253:
                return _Refused(f"has an invalid host name {host!r}")
            unresolvable = _unresolvable_host(host)
            if unresolvable:
                return _Refused(unresolvable)
        if port_text:
            if not _DIGITS.fullmatch(port_text):
                # Not shown: a URL whose '@host' went missing (an empty host
                # variable) reads the password as the port.
                return _Refused("has a port that is not a number; it must be a number "
                                "from 1 to 65535")
            if not 0 < int(port_text) < 65536:
                return _Refused(f"has port {port_text!r}; it must be a number from 1 to 65535")
        port = int(port_text) if port_text else 6379
        path_match = _TCP_PATH.fullmatch(unquote(parts.path))
        if path_match is None or (path_match.group(1) and not _DIGITS.fullmatch(
                path_match.group(1))):
            return _Refused(f"has database {unquote(parts.path).strip('/')!r}; it must be a number")
        if db_text is not None:
            if not _DIGITS.fullmatch(db_text):
                return _Refused(f"has database {db_text!r}; it must be a number")
            if path_match.group(1) and int(path_match.group(1)) != int(db_text):
                return _Refused("gives the database twice (in the path and as ?db=)")
        db = int(db_text if db_text is not None else (path_match.group(1) or 0))
        path = ""
    if db > 2 ** 31 - 1:
        return _Refused(f"has database {db}; it must be below 2**31")
    return _URL(scheme, host, port, db, path, options)


_LOOSE_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*(?::/*|/+)")


def mask_url(url: Any) -> str:
    """``url`` with any password replaced by ``***`` (also in query strings).

    A URL that :func:`parse_nodes` accepts is shown as written, password masked.
    Any other text (a mistyped scheme, an unencoded ``/``, ``?`` or ``#`` in the
    password, no scheme at all) may hold a password anywhere before its last
    ``@``: all of that is masked, and so is its whole query string (a password
    there may hold an ``@`` or stand under a mistyped key), everything after
    ``password=`` when there is no ``?``, and what follows a ``:`` that does
    not start a port.
    """
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    text = url.strip()
    if isinstance(_parse_url(text), _URL):
        parts = urlsplit(text)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, hostpart = netloc.rpartition("@")
            user = userinfo.split(":", 1)[0]
            netloc = f"{user}:***@{hostpart}" if ":" in userinfo else f"***@{hostpart}"
        query = "&".join(_mask_query_item(q) for q in parts.query.split("&")) \
            if parts.query else ""
        return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
    prefix_match = _LOOSE_SCHEME.match(text)
    prefix = prefix_match.group() if prefix_match else ""
    rest = text[len(prefix):]
    at = rest.rfind("@")
    question = rest.find("?")
    if 0 <= question < at and "=" in rest[question:at]:
        # The last '@' is in the query string (a password there may hold
        # one: masking up to it showed "?password=p@S3cret" as "***@S3cret").
        # A '?' with no '=' before the last '@' is a password's own.
        rest, at = rest[:question + 1] + "***", -1
    if at >= 0:
        rest = "***" + rest[at:]
    else:
        authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
        colon = authority.find(":")
        if colon >= 0 and not _DIGITS.fullmatch(authority[authority.rfind(":") + 1:]):
            rest = authority[:colon + 1] + "***"
    # None of what is left of the query string is shown: a password there
    # may stand under a mistyped key ("?passwd=S3cret").
    question = rest.find("?")
    if question >= 0:
        rest = rest[:question + 1] + "***"
    elif "password" in unquote_plus(rest).lower():  # also an encoded "pass%77ord="
        lowered = rest.lower()
        rest = rest[:lowered.index("password=") + len("password=")] + "***" \
            if "password=" in lowered else "***"
    return prefix + rest


def _mask_query_item(item: str) -> str:
    key, sep, _ = item.partition("=")
    return f"{key}=***" if sep and unquote_plus(key) == "password" else item


def _check_node_options(options: Any, where: str, scheme: str) -> list[Problem]:
    """E011 for each unknown key or bad value in a node's ``OPTIONS``."""
    if not isinstance(options, Mapping):
        return [Problem("E011", f"{where}: 'OPTIONS' must be a dict.")]
    found: list[Problem] = []
    for k, v in options.items():
        test = NODE_OPTIONS.get(k)
        if test is None:
            close = difflib.get_close_matches(k, list(NODE_OPTIONS), n=1) \
                if isinstance(k, str) else []
            found.append(Problem(
                "E011", f"{where}: unknown option {arguments.describe(k)}.",
                hint=(f"Did you mean {close[0]!r}? " if close else "")
                + "Known options: " + ", ".join(sorted(NODE_OPTIONS)) + "."))
        elif not test(v):
            shown = "***" if k == "password" else arguments.describe(v)
            found.append(Problem("E011", f"{where}: option {k!r} has a bad value {shown}; "
                                         f"it must be {_NODE_OPTION_RULES[k]}."))
        elif k in _TLS_ONLY and scheme != "rediss" and v is not None:
            found.append(Problem("E011", f"{where}: option {k!r} needs a rediss:// URL."))
    return found


def _url_node(url: str, options: Mapping[str, Any], where: str) -> tuple[NodeSpec | None,
                                                                         list[Problem]]:
    parsed = _parse_url(url)
    if isinstance(parsed, _Refused):
        return None, [Problem(parsed.id, f"{where}: URL {mask_url(url)!r} {parsed.reason}.",
                              hint=parsed.hint)]
    problems = _check_node_options(options, where, parsed.scheme)
    for k in parsed.options:
        if k in _TLS_ONLY and parsed.scheme != "rediss":
            problems.append(Problem("E011", f"{where}: option {k!r} in the URL needs a "
                                            f"rediss:// URL."))
    if problems:
        return None, problems
    # The URL wins over OPTIONS, as in redis-py's from_url (query, then user:password).
    # A TLS option left at None on a plain URL (accepted above: it asks for nothing)
    # is dropped: redis-py's plain Connection refuses any ssl_* keyword.
    merged = {k: v for k, v in {**options, **parsed.options}.items()
              if parsed.scheme == "rediss" or k not in _TLS_ONLY}
    return NodeSpec(kind="url", url=parsed.canonical, options=merged, name=mask_url(url)), []


_GROUP_KEYS = {"sentinel": ("SENTINELS", "SERVICE", "OPTIONS"), "cluster": ("CLUSTER", "OPTIONS")}
#: (shape id, address id) of each group kind.
_GROUP_IDS = {"sentinel": ("E012", "E013"), "cluster": ("E014", "E015")}


def _group_node(entry: Mapping[str, Any], where: str) -> tuple[NodeSpec | None, list[Problem]]:
    """A ``{"SENTINELS": [...], "SERVICE": ...}`` or ``{"CLUSTER": [...]}`` entry.

    Each address is a ``redis://`` or ``rediss://`` URL of one sentinel (or
    start-up node) with a port, and no database or option (the master's
    connection takes ``OPTIONS``, and a Cluster has database 0 only). A
    sentinel's URL may carry the sentinel's own user and password (they
    often differ from the master's, which go in ``OPTIONS``); a Cluster
    node's password is its ``OPTIONS``' (every node of a Cluster shares it).
    """
    kind = "sentinel" if "SENTINELS" in entry else "cluster"
    shape_id, address_id = _GROUP_IDS[kind]
    list_key = "SENTINELS" if kind == "sentinel" else "CLUSTER"
    allowed = _GROUP_KEYS[kind]
    problems: list[Problem] = []
    unknown = sorted(map(str, set(entry) - set(allowed)))
    if unknown:
        problems.append(Problem(
            shape_id, f"{where}: a {'Sentinel' if kind == 'sentinel' else 'Cluster'} node has "
                      f"unknown keys {unknown}.",
            hint="Known keys: " + ", ".join(allowed) + "."))
    addresses = entry[list_key]
    if isinstance(addresses, str):
        addresses = [a.strip() for a in addresses.split(",")] if "," in addresses else [addresses]
    if not isinstance(addresses, (list, tuple)) or not addresses or not all(
            isinstance(a, str) for a in addresses):
        problems.append(Problem(
            shape_id, f"{where}: {list_key!r} must be a non-empty list of URL strings.",
            hint='e.g. ["redis://10.0.0.5:26379", "redis://10.0.0.6:26379"]'
                 if kind == "sentinel" else 'e.g. ["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"]'))
        addresses = []
    service = entry.get("SERVICE")
    if kind == "sentinel" and (not isinstance(service, str) or not service.strip()
                               or any(c <= " " or c == "\x7f" for c in service)):
        problems.append(Problem(
            shape_id, f"{where}: 'SERVICE' must be the master's name as the sentinels know it "
                      "(a non-empty string without spaces).",
            hint="The name in the sentinels' 'sentinel monitor <name> ...' line, e.g. 'mymaster'."))
    options = entry.get("OPTIONS") or {}
    canonical: list[str] = []
    own_options: list[Mapping[str, Any]] = []
    schemes = set()
    for k, address in enumerate(addresses):
        at = f"{where}[{list_key!r}][{k}]"
        parsed = _parse_url(address)
        reason = None
        if isinstance(parsed, _Refused):
            reason, hint = parsed.reason, parsed.hint
        elif parsed.scheme == "unix":
            reason, hint = "is a unix socket; it must be redis:// or rediss://", None
        elif parsed.db or parsed.path or set(parsed.options) - {"username", "password"}:
            reason, hint = "may have a host, a port and a password, nothing else", (
                "Options for the connections go in the node's 'OPTIONS'.")
        elif kind == "cluster" and parsed.options:
            reason, hint = "carries a user or password; give it in 'OPTIONS'", None
        if reason is not None:
            problems.append(Problem(address_id, f"{at}: URL {mask_url(address)!r} {reason}.",
                                    hint=hint))
            continue
        assert isinstance(parsed, _URL)
        schemes.add(parsed.scheme)
        canonical.append(parsed.canonical)
        own_options.append(dict(parsed.options))
    if len(schemes) > 1:
        problems.append(Problem(address_id, f"{where}: {list_key!r} mixes redis:// and rediss://."))
    with_password = [k for k, own in enumerate(own_options) if own.get("password") is not None]
    if kind == "sentinel" and with_password and len(with_password) < len(own_options):
        without = [k for k in range(len(own_options)) if k not in with_password]
        problems.append(Problem(
            address_id, f"{where}: sentinel URL(s) {with_password} carry a password and "
                        f"{without} do not.",
            hint="Each sentinel is asked with its own URL's user and password only (one "
                 "URL's are not used for the others): give every sentinel URL its "
                 "credentials, e.g. redis://:PASSWORD@10.0.0.5:26379. The master's "
                 "password goes in 'OPTIONS'."))
    scheme = schemes.pop() if len(schemes) == 1 else "redis"
    problems += _check_node_options(options, where, scheme)
    if problems:
        return None, problems
    merged = {k: v for k, v in options.items() if scheme == "rediss" or k not in _TLS_ONLY}
    return NodeSpec(kind=kind, options=merged, addresses=tuple(canonical),
                    service=str(service).strip() if kind == "sentinel" else "",
                    address_options=tuple(own_options)), []


def parse_nodes(nodes: Any) -> tuple[list[NodeSpec], list[Problem]]:
    """Node specs from a ``REDLOCK_NODES`` value, and the problems found.

    Each spec's ``url`` and ``options`` are what the connection pool is built
    from (see :class:`NodeSpec`). ``cache:<alias>`` entries are not resolved here
    (that needs Django's CACHES); see :func:`check_cache_aliases`.
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
    positions: list[int] = []
    problems: list[Problem] = []
    for i, entry in enumerate(nodes):
        where = f"REDLOCK_NODES[{i}]"
        spec: NodeSpec | None = None
        if isinstance(entry, str):
            if entry.startswith("cache:"):
                alias = entry[len("cache:"):]
                if not alias:
                    problems.append(Problem("E003", f"{where}: 'cache:' needs a cache alias."))
                    continue
                spec = NodeSpec(kind="cache", alias=alias)
            else:
                spec, found = _url_node(entry, {}, where)
                problems += found
        elif isinstance(entry, Mapping) and ("SENTINELS" in entry or "CLUSTER" in entry):
            spec, found = _group_node(entry, where)
            problems += found
        elif isinstance(entry, Mapping):
            unknown = set(entry) - {"URL", "OPTIONS"}
            if unknown or "URL" not in entry:
                problems.append(Problem(
                    "E003", f"{where}: a dict node needs a 'URL' (or 'SENTINELS' and 'SERVICE', "
                            f"or 'CLUSTER') and may have 'OPTIONS'"
                            + (f"; unknown keys {sorted(map(str, unknown))}" if unknown else "")
                            + "."))
                continue
            url, options = entry["URL"], entry.get("OPTIONS") or {}
            if not isinstance(url, str):
                problems.append(Problem("E003", f"{where}: 'URL' must be a string."))
                continue
            spec, found = _url_node(url, options, where)
            problems += found
        else:
            problems.append(Problem(
                "E003", f"{where}: must be a URL string, 'cache:<alias>' or a dict with 'URL', "
                        f"'SENTINELS' or 'CLUSTER', not {type(entry).__name__}."))
        if spec is not None:
            specs.append(spec)
            positions.append(i)
    problems += _duplicates(specs, positions)
    if specs and not problems and len(specs) % 2 == 0:
        problems.append(Problem(
            "W001", f"REDLOCK_NODES has {len(specs)} nodes, an even number.",
            hint=f"{len(specs)} nodes need {len(specs) // 2 + 1} to agree and tolerate "
                 f"{len(specs) - len(specs) // 2 - 1} failures, no more than {len(specs) - 1} "
                 f"nodes; use an odd number."))
    problems += _shared_servers(specs, positions)
    return specs, problems


def _shared_servers(specs: list[NodeSpec], positions: list[int]) -> list[Problem]:
    """W004 for entries that are databases of one Redis server (``/0`` and
    ``/1`` of one host and port): not a duplicate (E005 compares the database
    too), but one server's restart or failure takes them all, so a quorum of
    them on one server is no quorum of independent nodes."""
    problems = []
    seen: dict[tuple[Any, ...], int] = {}
    for spec, i in zip(specs, positions):
        ident = spec.identity
        if spec.kind != "url" or spec.is_group or ident[0] not in ("tcp", "unix"):
            continue
        first = seen.setdefault(ident[:-1], i)
        if first != i and specs[positions.index(first)].identity != ident:
            problems.append(Problem(
                "W004", f"REDLOCK_NODES [{first}] {specs[positions.index(first)].display} and "
                        f"[{i}] {spec.display} are two databases of one Redis server.",
                hint="A restart or failure of that server takes both: Redlock needs a "
                     "majority of independent servers."))
    return problems


def _duplicates(specs: list[NodeSpec], positions: list[int]) -> list[Problem]:
    problems = []
    seen: dict[tuple[Any, ...], int] = {}
    for spec, i in zip(specs, positions):
        firsts = {seen.setdefault(ident, i) for ident in spec.identities} - {i}
        if not firsts:
            continue
        first = min(firsts)
        other = specs[positions.index(first)]
        shown = (f"{spec.display} twice" if other.display == spec.display
                 else f"one server twice: [{first}] {other.display} and [{i}] {spec.display}")
        problems.append(Problem(
            "E005", f"REDLOCK_NODES lists {shown}.",
            hint="Redlock needs independent nodes; a node listed twice counts twice "
                 "towards the quorum."))
    return problems


def _cache_location(conf: Mapping[str, Any]) -> str | None:
    """The URL of the server a django-redis cache writes to (its first LOCATION)."""
    location = conf.get("LOCATION")
    if isinstance(location, str):
        location = location.split(",")
    if isinstance(location, (list, tuple)) and location and isinstance(location[0], str):
        return location[0].strip()
    return None


def check_cache_aliases(specs: list[NodeSpec], caches: Any) -> list[Problem]:
    """E006 for each ``cache:<alias>`` node whose alias is not a Redis cache.

    Also E005 when a cache writes to a server that another node already is.
    """
    problems = []
    seen = {spec.identity: spec.display for spec in specs if spec.kind == "url"}
    if not isinstance(caches, Mapping):
        caches = {}  # Django's own check reports CACHES itself; here no alias is found
    for spec in specs:
        if spec.kind != "cache":
            continue
        conf = caches.get(spec.alias)
        if conf is not None and not isinstance(conf, Mapping):
            problems.append(Problem(
                "E006", f"CACHES[{spec.alias!r}] is a {type(conf).__name__}, not a dict: "
                        f"REDLOCK_NODES cannot borrow its connection pool.",
                hint='A django-redis cache: {"BACKEND": "django_redis.cache.RedisCache", '
                     '"LOCATION": "redis://..."}.'))
            continue
        if conf is None:
            problems.append(Problem(
                "E006", f"REDLOCK_NODES names cache alias {spec.alias!r}, which is not in CACHES.",
                hint="Known aliases: " + (", ".join(sorted(caches)) or "none") + "."))
        elif "django_redis" not in str(conf.get("BACKEND", "")):
            problems.append(Problem(
                "E006", f"Cache {spec.alias!r} uses {conf.get('BACKEND')!r}, not django-redis.",
                hint="Only django-redis caches (django_redis.cache.RedisCache) can lend "
                     "their connection pool."))
        else:
            location = _cache_location(conf)
            parsed = _parse_url(location) if location else None
            if isinstance(parsed, _URL):
                if parsed.identity in seen:
                    problems.append(Problem(
                        "E005", f"REDLOCK_NODES lists one server twice: {seen[parsed.identity]} "
                                f"and cache:{spec.alias} ({mask_url(location)}).",
                        hint="Redlock needs independent nodes; a node listed twice counts "
                             "twice towards the quorum."))
                seen.setdefault(parsed.identity, spec.display)
    return problems


def _cache_timeouts(conf: Mapping[str, Any]) -> dict[str, Any]:
    """The socket timeouts a django-redis cache's pool gets, by redis-py name.

    django-redis builds the pool with ``from_url(LOCATION, socket_timeout=
    OPTIONS["SOCKET_TIMEOUT"], ..., **OPTIONS["CONNECTION_POOL_KWARGS"])``, and
    the URL's query wins in ``from_url``: later sources here override earlier ones.
    """
    opts = conf.get("OPTIONS") or {}
    if not isinstance(opts, Mapping):
        return {}
    found: dict[str, Any] = {}
    for key in ("socket_timeout", "socket_connect_timeout"):
        if opts.get(key.upper()) is not None:
            found[key] = opts[key.upper()]
    pool_kwargs = opts.get("CONNECTION_POOL_KWARGS") or {}
    if isinstance(pool_kwargs, Mapping):
        found.update({k: pool_kwargs[k] for k in ("socket_timeout", "socket_connect_timeout")
                      if pool_kwargs.get(k) is not None})
    location = _cache_location(conf)
    if location:
        try:
            query = dict(parse_qsl(urlsplit(location).query))
        except ValueError:
            query = {}
        for key in ("socket_timeout", "socket_connect_timeout"):
            if key in query:
                try:
                    found[key] = float(query[key])
                except ValueError:
                    pass
    return found


def check_node_timeouts(specs: list[NodeSpec], options: Any,
                        caches: Mapping[str, Any]) -> list[Problem]:
    """W003 for each node whose socket timeouts exceed ``NODE_TIMEOUT``.

    ``NODE_TIMEOUT`` is how long a round waits for one node; a node whose own
    connection may wait longer (its URL's ``?socket_timeout=``, its
    ``OPTIONS``, or the socket timeouts of the cache whose pool it borrows)
    stretches every round it is slow in.
    """
    merged = resolve_options(options if isinstance(options, Mapping) else None)
    node_timeout = merged.get("NODE_TIMEOUT")
    if not _number(node_timeout) or node_timeout <= 0:
        return []
    problems = []
    for spec in specs:
        if spec.kind == "cache":
            conf = caches.get(spec.alias)
            timeouts = _cache_timeouts(conf) if isinstance(conf, Mapping) else {}
            hint = (f"Lower the cache's SOCKET_TIMEOUT / SOCKET_CONNECT_TIMEOUT to "
                    f"{node_timeout} s or less, give the locks their own URL node, or raise "
                    f"NODE_TIMEOUT.")
        else:
            timeouts = {k: spec.options[k] for k in ("socket_timeout", "socket_connect_timeout")
                        if k in spec.options}
            hint = ("Lower it, or remove it so that NODE_TIMEOUT applies; silence "
                    "redlock.W003 if this node is meant to be slower.")
        over = {k: v for k, v in timeouts.items() if _number(v) and v > node_timeout}
        if over:
            shown = ", ".join(f"{k} {v} s" for k, v in over.items())
            problems.append(Problem(
                "W003", f"REDLOCK_NODES: {spec.display} waits up to {shown}, longer than "
                        f"NODE_TIMEOUT ({node_timeout} s).",
                hint=hint))
    return problems


def resolve_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Defaults merged with ``options`` (upper-case keys), assumed valid."""
    return {**DEFAULTS, **(options or {})}
