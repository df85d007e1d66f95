"""A Sentinel group and a Redis Cluster, real processes on loopback, for tests.

(Why one module of 840 lines: both are groups of RedisServer processes set up
and broken with plain commands, sharing the bounded waits and reply parsing.)

A Redlock node may be a Sentinel-managed master or a whole Redis Cluster
(issue 21). Both fail in ways a plain server does not: a failover moves the
master to another address, replication is asynchronous so a grant may not
survive it, and a Cluster moves hash slots between masters. Tests of those
node kinds need the real thing, started and broken from the test:

>>> with SentinelGroup(replicas=1) as group:            # doctest: +SKIP
...     old = group.master
...     new = group.failover()           # SENTINEL FAILOVER, waits until done
...     group.kill_master(); group.wait_master(other_than=new)
>>> with RedisClusterGroup(3) as cluster:                # doctest: +SKIP
...     cluster.migrate_slot(cluster.key_slot("k"), to=1)

Everything is built from :class:`RedisServer` (same binary discovery, same
``kill()``/``pause()``/``restart()`` faults on every process) and set up
with plain commands (``SENTINEL``, ``CLUSTER ADDSLOTSRANGE``, ``CLUSTER
MEET``, ``MIGRATE``) over raw sockets: no external script, no redis-py.
Every wait is bounded in count and time.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from typing import Self

from .base import LOCALHOST, RedisReplyError, _free_port
from .servers import RedisNodes, RedisServer, replicas_following

#: Hash slots of a Redis Cluster.
SLOTS = 16384

_DOWN = (OSError, ConnectionError, RedisReplyError)


def _wait(what: str, test: Any, timeout: float, interval: float = 0.05) -> Any:
    """Call ``test()`` until it returns something truthy (returned), at most
    ``timeout`` seconds; ``RuntimeError`` naming ``what`` otherwise. A test that
    raises a socket or reply error counts as not yet."""
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / interval) + 2):
        try:
            got = test()
        except _DOWN:
            got = None
        if got:
            return got
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    raise RuntimeError(f"{what}: not within {timeout:g} s")


#: A cluster node's bus listens on its port + 10000, so its port is at most this.
CLUSTER_PORT_MAX = 65535 - 10000


def _is_master(server: RedisServer) -> bool:
    """Whether ``server`` answers ``ROLE`` as a master (a server that does not
    answer counts as one: it is stopped last, and stopping it costs nothing)."""
    if not server.is_running() or server.paused:
        return True
    try:
        role = server.execute("ROLE", timeout=1.0)
    except _DOWN:
        return True
    return not (role and _text(role[0]) == "slave")


def _cluster_port(taken: set[int]) -> int:
    """A free port for a cluster node whose bus port (+10000) is free too
    (bounded: 200 tries)."""
    import socket

    for _ in range(200):
        port = _free_port()
        if port > CLUSTER_PORT_MAX or port in taken or port + 10000 in taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((LOCALHOST, port + 10000))
            except OSError:
                continue
        taken.update((port, port + 10000))
        return port
    raise RuntimeError("no free port pair for a cluster node")


def _text(reply: Any) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def _fields(reply: Any) -> dict[str, str]:
    """A flat ``[k, v, k, v...]`` reply (``SENTINEL MASTER``) as a dict."""
    items = [_text(x) for x in reply or ()]
    return dict(zip(items[::2], items[1::2]))


# --------------------------------------------------------------------------
# Sentinel
# --------------------------------------------------------------------------


class SentinelServer(RedisServer):
    """One ``redis-server --sentinel`` process watching ``service``.

    Sentinel needs a config file it may rewrite (it records what it learns:
    replicas, the other sentinels, the current master). It is written once in
    the server's temp dir; a restart keeps it, so a restarted sentinel knows
    the master after a failover, as a real one would.
    """

    def __init__(self, *, master: RedisServer, service: str = "mymaster", quorum: int = 2,
                 down_after_ms: int = 1000, failover_timeout_ms: int = 4000,
                 **server_kwargs: Any) -> None:
        super().__init__(**server_kwargs)
        self.master_server = master
        self.service = service
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms

    def _command_line(self, binary: str) -> list[str]:
        tmpdir = self.tmpdir
        assert tmpdir is not None
        conf = os.path.join(tmpdir, "sentinel.conf")
        if not os.path.exists(conf):
            m, s = self.master_server, self.service
            lines = [f"sentinel monitor {s} {m.host} {m.port} {self.quorum}",
                     f"sentinel down-after-milliseconds {s} {self.down_after_ms}",
                     f"sentinel failover-timeout {s} {self.failover_timeout_ms}",
                     f"sentinel parallel-syncs {s} 1"]
            if m.password is not None:
                lines.append(f"sentinel auth-pass {s} {m.password}")
            if self.password is not None:  # what it asks of the other sentinels
                lines.append(f"sentinel sentinel-pass {self.password}")
            with open(conf, "w") as fh:
                fh.write("\n".join(lines) + "\n")
        # The plain server's options (port, bind, dir, log...) after the file.
        return [binary, conf, "--sentinel", *super()._command_line(binary)[1:]]

    def master_address(self) -> tuple[str, int] | None:
        """What this sentinel says the master is (``None``: it does not know)."""
        reply = self.execute("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service, timeout=1.0)
        if not reply:
            return None
        return _text(reply[0]), int(reply[1])


class SentinelGroup:
    """A master, ``replicas`` replicas and ``sentinels`` sentinels (quorum a
    majority of them), all on loopback: what a ``{"SENTINELS": [...],
    "SERVICE": ...}`` node is.

    Faults: each process is a :class:`RedisServer` (``servers`` holds the data
    servers, master first at start; ``sentinels`` the sentinels), so every
    plain fault applies; :meth:`failover` forces one (``SENTINEL FAILOVER``),
    :meth:`kill_master` crashes the current master and :meth:`wait_master`
    waits for the sentinels to elect another.

    ``down_after_ms`` is how long the sentinels wait before they call a silent
    master down (Redis's default is 30 s; 1 s here, so a test sees a failover
    within a few seconds). ``sentinel_password``: the sentinels require it
    (``requirepass``, and ``sentinel-pass`` among themselves), and
    :attr:`sentinel_urls` carry it.
    """

    def __init__(self, *, replicas: int = 1, sentinels: int = 3, service: str = "mymaster",
                 down_after_ms: int = 1000, failover_timeout_ms: int = 4000,
                 sentinel_password: str | None = None, **server_kwargs: Any) -> None:
        if replicas < 1:
            raise ValueError("a Sentinel group needs at least one replica to fail over to")
        if sentinels < 1:
            raise ValueError("a Sentinel group needs at least one sentinel")
        self.service = service
        self._data = RedisNodes(1, replicas=replicas, **server_kwargs)
        #: The data servers: the first master, then its replicas.
        self.servers: list[RedisServer] = [self._data[0], *self._data.replicas[0]]
        quorum = sentinels // 2 + 1
        self.sentinels: list[SentinelServer] = [
            SentinelServer(master=self._data[0], service=service, quorum=quorum,
                           down_after_ms=down_after_ms, failover_timeout_ms=failover_timeout_ms,
                           password=sentinel_password)
            for _ in range(sentinels)]

    # -- addresses ----------------------------------------------------------

    @property
    def sentinel_urls(self) -> list[str]:
        """``redis://127.0.0.1:PORT`` of each sentinel (``redis://:PASSWORD@...``
        with a ``sentinel_password``)."""
        return [f"redis://{'' if s.password is None else f':{s.password}@'}{s.host}:{s.port}"
                for s in self.sentinels]

    def node_setting(self, **options: Any) -> dict[str, Any]:
        """This group as one ``REDLOCK_NODES`` entry."""
        entry: dict[str, Any] = {"SENTINELS": self.sentinel_urls, "SERVICE": self.service}
        password = self.servers[0].password
        if password is not None:
            options = {"password": password, **options}
        if options:
            entry["OPTIONS"] = options
        return entry

    def _by_address(self, address: tuple[str, int] | None) -> RedisServer | None:
        if address is None:
            return None
        return next((s for s in self.servers if s.port == address[1]), None)

    @property
    def master(self) -> RedisServer:
        """The data server a majority of the live sentinels call master."""
        votes: dict[int, int] = {}
        for sentinel in self.sentinels:
            if not sentinel.is_running() or sentinel.paused:
                continue
            try:
                address = sentinel.master_address()
            except _DOWN:
                continue
            if address is not None:
                votes[address[1]] = votes.get(address[1], 0) + 1
        if not votes:
            raise RuntimeError("no sentinel names a master")
        port = max(votes, key=lambda p: votes[p])
        server = self._by_address(("", port))
        if server is None:  # pragma: no cover - a sentinel knows only ours
            raise RuntimeError(f"the sentinels name an unknown master on port {port}")
        return server

    @property
    def replicas(self) -> list[RedisServer]:
        """The data servers other than the current master."""
        master = self.master
        return [s for s in self.servers if s is not master]

    # -- lifecycle ----------------------------------------------------------

    def start(self, timeout: float = 20.0) -> Self:
        """Start the data servers (replicas synced), then the sentinels, and
        wait until every sentinel knows the replicas and the other sentinels
        (sentinels find each other through the master's hello channel, every
        2 s: a failover needs them to). Nothing is left running on failure."""
        try:
            self._data.start()
            for sentinel in self.sentinels:
                sentinel.start()
            self.wait_ready(timeout)
        except BaseException:
            self._stop_all(suppress=True)
            raise
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Wait until every live sentinel agrees on a master that answers as
        master, and knows every live replica and the other sentinels."""
        live_sentinels = [s for s in self.sentinels if s.is_running() and not s.paused]
        master = _wait("a master the sentinels agree on", self._agreed_master, timeout)
        live_replicas = sum(1 for s in self.servers
                            if s is not master and s.is_running() and not s.paused)

        def known() -> bool:
            for sentinel in live_sentinels:
                info = _fields(sentinel.execute("SENTINEL", "MASTER", self.service))
                if int(info.get("num-other-sentinels", 0)) < len(live_sentinels) - 1:
                    return False
                replicas = sentinel.execute("SENTINEL", "REPLICAS", self.service)
                up = [r for r in map(_fields, replicas or ())
                      if "s_down" not in r.get("flags", "") and "disconnected"
                      not in r.get("flags", "") and r.get("master-link-status") == "ok"]
                if len(up) < live_replicas:
                    return False
            return True

        _wait("sentinels that know each other and the replicas", known, timeout, 0.1)

    def _agreed_master(self, *, majority: bool = False) -> RedisServer | None:
        """The master every live sentinel names (``majority``: that a majority
        of all the sentinels name), if it answers as master; else None."""
        named = [sentinel.master_address() for sentinel in self.sentinels
                 if sentinel.is_running() and not sentinel.paused]
        if majority:
            top = max(set(named), key=named.count, default=None)
            address = top if named.count(top) > len(self.sentinels) // 2 else None
        else:
            address = named[0] if named and named.count(named[0]) == len(named) else None
        if address is None:
            return None
        server = self._by_address(address)
        if server is None or not server.is_running() or server.paused:
            return None
        role = server.execute("ROLE", timeout=1.0)
        return server if role and _text(role[0]) == "master" else None

    def failover(self, timeout: float = 20.0, *, demote: bool = True) -> RedisServer:
        """Force a failover (``SENTINEL FAILOVER``: no agreement needed, the
        replica is promoted at once) and wait until every sentinel names the
        new master and it answers as master. Returns the new master.

        The sentinels turn the old master into a replica only once its next
        ``INFO`` shows it still claims to be master and the failover timeout
        has passed (about 10 s here); until then it accepts writes that the
        new master never sees, a split brain. ``demote=True`` (the default)
        ends that at once (``REPLICAOF`` the new master, what the sentinels
        will do anyway); ``demote=False`` leaves the window open.
        """
        old = self.master
        sentinel = next(s for s in self.sentinels if s.is_running() and not s.paused)
        # A forced failover is refused while another is under way ("INPROG").
        _wait("SENTINEL FAILOVER accepted",
              lambda: sentinel.execute("SENTINEL", "FAILOVER", self.service) == "OK", timeout, 0.2)
        new = self.wait_master(other_than=old, timeout=timeout)
        if demote and old.is_running() and not old.paused:
            old.execute("REPLICAOF", new.host, new.port)
        return new

    def kill_master(self) -> RedisServer:
        """``kill -9`` the current master; returns it (``restart()`` brings it
        back, empty: the sentinels then make it a replica of the new master)."""
        master = self.master
        master.kill()
        return master

    def wait_master(self, *, other_than: RedisServer, timeout: float = 20.0,
                    majority: bool = False) -> RedisServer:
        """Wait until the sentinels agree on a master other than ``other_than``
        and it answers as master; return it.

        ``majority``: a majority of the sentinels is enough. A sentinel that led
        a failover whose promoted replica died before that failover ended stays
        in it, naming the dead replica, until the replica is back, while its
        peers elect another master (Redis Sentinel's own behaviour, seen in
        the chaos run's failover schedule): waiting for every sentinel then
        waits for the dead server's restart."""
        def moved() -> RedisServer | None:
            server = self._agreed_master(majority=majority)
            return server if server is not None and server is not other_than else None

        found: RedisServer = _wait("a new master", moved, timeout, 0.05)
        return found

    def stop(self) -> None:
        self._stop_all(suppress=False)

    def _stop_all(self, *, suppress: bool) -> None:
        first: BaseException | None = None
        for sentinel in self.sentinels:
            try:
                sentinel.stop()
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                first = first or exc
        # Replicas before masters, by the role each has NOW: after a failover
        # the configured order is wrong, and a master stopped before a replica
        # that is still syncing waits for it (Redis 7's shutdown-timeout, up to
        # 10 s; about 5 s per test seen here).
        for server in sorted(self.servers, key=_is_master):
            try:
                server.stop()
            except Exception as exc:  # noqa: BLE001
                first = first or exc
        try:
            self._data.stop()
        except Exception as exc:  # noqa: BLE001
            first = first or exc
        if first is not None and not suppress:
            raise first

    def flushall(self) -> None:
        """``FLUSHALL`` on the current master (the replicas follow)."""
        self.master.execute("FLUSHALL")

    def __repr__(self) -> str:
        return f"<SentinelGroup {self.servers!r} sentinels={self.sentinels!r}>"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# --------------------------------------------------------------------------
# Cluster
# --------------------------------------------------------------------------


def _key_in_slot(slot: int) -> str:
    """A probe key that hashes to ``slot`` (bounded search: CRC16 spreads
    the candidates over all 16384 slots, so some ``{n}`` tag lands in each)."""
    from redis.crc import key_slot  # redis-py's CRC16, as RedisCluster computes it

    for n in range(1_000_000):
        key = f"redlock-testing:probe{{{n}}}"
        if key_slot(key.encode()) == slot:
            return key
    raise RuntimeError(f"no probe key found for slot {slot}")


def _cluster_info(server: RedisServer) -> dict[str, str]:
    text = _text(server.execute("CLUSTER", "INFO", timeout=1.0))
    return dict(line.split(":", 1) for line in text.split("\r\n") if ":" in line)


def _my_epoch(server: RedisServer) -> int:
    """``server``'s own config epoch (the epoch its slot claims carry)."""
    return int(_cluster_info(server).get("cluster_my_epoch", 0))


def _config_epochs(server: RedisServer) -> dict[int, int]:
    """The config epoch ``server`` records for each master, by port (``CLUSTER
    NODES``: ``id host:port@bus[,hostname] flags master ping pong epoch ...``)."""
    out = {}
    for line in _text(server.execute("CLUSTER", "NODES", timeout=1.0)).splitlines():
        fields = line.split()
        if len(fields) >= 8 and "master" in fields[2].split(","):
            port = fields[1].split("@", 1)[0].rsplit(":", 1)[1]
            out[int(port)] = int(fields[6])
    return out


#: The channel :meth:`RedisClusterGroup._share_epochs` publishes on (nobody listens).
EPOCH_CHANNEL = "redlock-testing:epochs"


#: Seconds after which :meth:`RedisClusterGroup.failover` asks again (the
#: server drops a manual failover not done within 5 s).
MANUAL_FAILOVER_RETRY = 6.0


class RedisClusterGroup:
    """A real Redis Cluster of ``masters`` masters (each with ``replicas``
    replicas), on loopback: what a ``{"CLUSTER": [...]}`` node is.

    The slots are split evenly (``CLUSTER ADDSLOTSRANGE``), the nodes
    introduced with ``CLUSTER MEET`` and the replicas attached with ``CLUSTER
    REPLICATE``; :meth:`start` returns once every node reports
    ``cluster_state:ok`` and agrees on who serves every slot. ``masters[i]``
    is each master as started (:meth:`master_for_slot` says who serves a slot
    now), each a :class:`RedisServer` with the usual faults.
    :meth:`migrate_slot` moves one slot with its keys (``MIGRATING`` /
    ``IMPORTING``, ``MIGRATE``, ``SETSLOT NODE``), or only starts the move.

    ``node_timeout_ms`` is the cluster's node timeout: a node silent that long
    is suspected, and a master a majority suspects is failed (promoted over
    when it has a replica, else the cluster stops serving for at least twice
    the timeout). 5 s by default, so a loaded test machine that starves a node
    for a second or two does not fail it; a test of failure detection passes
    a shorter one.
    """

    def __init__(self, masters: int = 3, *, replicas: int = 0, node_timeout_ms: int = 5000,
                 **server_kwargs: Any) -> None:
        if masters < 1:
            raise ValueError(f"masters must be >= 1, got {masters!r}")
        if server_kwargs.get("port") is not None:
            raise ValueError("a fixed port cannot be shared by the nodes of a cluster")
        args = (*server_kwargs.pop("extra_args", ()),
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms),
                "--repl-diskless-sync-delay", "0")
        taken: set[int] = set()

        def node() -> RedisServer:
            # A fixed port: a random one may be above CLUSTER_PORT_MAX.
            return RedisServer(port=_cluster_port(taken), extra_args=args, **server_kwargs)

        self.masters: list[RedisServer] = [node() for _ in range(masters)]
        #: ``replicas[i]``: master ``i``'s replicas.
        self.replicas: list[list[RedisServer]] = [
            [node() for _ in range(replicas)] for _ in range(masters)]
        self.ids: dict[int, str] = {}  # port -> cluster node id
        self._pending: tuple[int, RedisServer, RedisServer] | None = None

    @property
    def servers(self) -> list[RedisServer]:
        return [*self.masters, *(r for rs in self.replicas for r in rs)]

    @property
    def urls(self) -> list[str]:
        """``redis://127.0.0.1:PORT`` of each master as started (start-up nodes)."""
        return [f"redis://{s.host}:{s.port}" for s in self.masters]

    def node_setting(self, **options: Any) -> dict[str, Any]:
        """This cluster as one ``REDLOCK_NODES`` entry."""
        entry: dict[str, Any] = {"CLUSTER": self.urls}
        password = self.masters[0].password
        if password is not None:
            options = {"password": password, **options}
        if options:
            entry["OPTIONS"] = options
        return entry

    # -- lifecycle ------------------------------------------------------------

    def start(self, timeout: float = 20.0) -> Self:
        try:
            for server in self.servers:
                server.start()
            for epoch, server in enumerate(self.servers, start=1):
                self.ids[server.port] = _text(server.execute("CLUSTER", "MYID"))
                # A config epoch of its own for each node before they meet (as
                # ``redis-cli --cluster create`` does). Left at 0, the nodes
                # settle their epoch collisions by gossip in the first seconds,
                # and a node that bumps its epoch meanwhile wins any slot it
                # still claims: a slot moved in those seconds went back to its
                # source, and the target dropped the moved keys (seen in CI).
                server.execute("CLUSTER", "SET-CONFIG-EPOCH", epoch)
            n = len(self.masters)
            for i, master in enumerate(self.masters):
                first, last = i * SLOTS // n, (i + 1) * SLOTS // n - 1
                master.execute("CLUSTER", "ADDSLOTSRANGE", first, last)
            head = self.masters[0]
            for server in self.servers[1:]:
                head.execute("CLUSTER", "MEET", server.host, server.port)
            self._wait_known(timeout)
            for master, replicas in zip(self.masters, self.replicas):
                for replica in replicas:
                    replica.execute("CLUSTER", "REPLICATE", self.ids[master.port])
            self.wait_ok(timeout)
        except BaseException:
            self._stop_all(suppress=True)
            raise
        return self

    def _live(self) -> list[RedisServer]:
        return [s for s in self.servers if s.is_running() and not s.paused]

    def _wait_known(self, timeout: float) -> None:
        live = self._live()

        def known() -> bool:
            return all(int(_cluster_info(s).get("cluster_known_nodes", 0)) >= len(live)
                       for s in live)

        _wait("cluster nodes that know each other", known, timeout)

    def wait_ok(self, timeout: float = 20.0) -> None:
        """Wait until every live node says ``cluster_state:ok``, every live
        replica (whichever they are now) has synced, and all live nodes name the same owner for every
        slot."""
        seen = ["nothing read yet"]  # what the last look found wrong, for the error

        def ok() -> bool:
            live = self._live()
            for s in live:
                info = _cluster_info(s)
                if info.get("cluster_state") != "ok":
                    seen[0] = (f"{s.port}: cluster_state:{info.get('cluster_state')} "
                               f"(slots_fail {info.get('cluster_slots_fail')}, "
                               f"slots_pfail {info.get('cluster_slots_pfail')})")
                    return False
            maps = {s.port: self._slot_map(s) for s in live}
            if len(set(maps.values())) != 1:
                seen[0] = f"the nodes name different slot owners: {maps}"
                return False
            for server in live:  # a replica now: the original replicas, or a demoted master
                replication = _text(server.execute("INFO", "replication"))
                if "role:slave" in replication and "master_link_status:up" not in replication:
                    seen[0] = f"{server.port}: a replica whose link to its master is down"
                    return False
            return True

        deadline = time.monotonic() + timeout
        try:
            _wait("cluster_state:ok on every node", ok, timeout, 0.1)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; last seen: {seen[0]}") from None
        self._wait_replicas_follow(deadline)

    def _wait_replicas_follow(self, deadline: float) -> None:
        """Every live master's live replicas confirm a write (``WAIT``): a
        replica whose link is "up" may not apply the stream yet for up to a
        second after its first sync, and a test with ``REPLICA_ACKS`` would
        then see its very first grant unconfirmed (CI saw that twice).

        How many replicas a master has is counted from the replicas' side
        (each live replica's ``master_port``), not from the master's
        ``state=online``: the master lists a replica as online only after
        that replica's first ACK, exactly the moment this waits for, so
        counting there would skip the very master that is not ready."""
        live = self._live()
        following: dict[int, int] = {}
        for server in live:
            replication = _text(server.execute("INFO", "replication"))
            if "role:slave" in replication:
                port = re.search(r"^master_port:(\d+)", replication, re.M)
                if port:
                    following[int(port.group(1))] = following.get(int(port.group(1)), 0) + 1
        owners = self._slot_map(live[0]) if live else ()
        for server in live:
            expected = following.get(server.port, 0)
            first = next((lo for lo, _, port in owners if port == server.port), None)
            if not expected or first is None:
                continue
            acked = replicas_following(server, expected, deadline, key=_key_in_slot(first))
            if acked < expected:
                raise RuntimeError(f"{server!r}: {acked} of {expected} replicas follow its "
                                   "writes")

    @staticmethod
    def _slot_map(server: RedisServer) -> tuple[tuple[int, int, int], ...]:
        reply = server.execute("CLUSTER", "SLOTS", timeout=1.0)
        return tuple(sorted((int(r[0]), int(r[1]), int(r[2][1])) for r in reply))

    # -- slots ----------------------------------------------------------------

    def key_slot(self, key: str | bytes) -> int:
        """The hash slot of ``key`` (``CLUSTER KEYSLOT``)."""
        return int(self._any().execute("CLUSTER", "KEYSLOT", key))

    def _any(self) -> RedisServer:
        for server in self._live():
            return server
        raise RuntimeError("no cluster node is running")

    def master_for_slot(self, slot: int) -> RedisServer:
        """The master serving ``slot`` now, as the first live node sees it."""
        for first, last, port in self._slot_map(self._any()):
            if first <= slot <= last:
                return next(s for s in self.servers if s.port == port)
        raise RuntimeError(f"slot {slot} is not served")

    def migrate_slot(self, slot: int, to: RedisServer | int, *, finish: bool = True,
                     timeout: float = 10.0) -> RedisServer:
        """Move ``slot`` with its keys to master ``to`` (a server or an index
        into :attr:`masters`); returns the source master.

        The steps a resharding runs: ``IMPORTING`` on the target, ``MIGRATING``
        on the source, ``MIGRATE`` of every key of the slot, then ``SETSLOT
        NODE`` on every master. With ``finish=False`` only the first two
        steps: the slot stays half-moved (clients get ``ASK`` for keys not on
        the source) until :meth:`finish_migration`.
        """
        target = self.masters[to] if isinstance(to, int) else to
        source = self.master_for_slot(slot)
        if source is target:
            raise ValueError(f"slot {slot} is already on {target!r}")
        target.execute("CLUSTER", "SETSLOT", slot, "IMPORTING", self.ids[source.port])
        source.execute("CLUSTER", "SETSLOT", slot, "MIGRATING", self.ids[target.port])
        self._pending = (slot, source, target)
        if finish:
            self.finish_migration(timeout=timeout)
        return source

    def move_keys(self, slot: int, source: RedisServer, target: RedisServer) -> int:
        """``MIGRATE`` every key of ``slot`` from ``source`` to ``target``
        (bounded: at most 100 batches of 100 keys); returns how many moved."""
        moved = 0
        for _ in range(100):
            keys = source.execute("CLUSTER", "GETKEYSINSLOT", slot, 100)
            if not keys:
                break
            args: list[Any] = ["MIGRATE", target.host, target.port, "", 0, 5000]
            if target.password is not None:
                args += ["AUTH", target.password]
            source.execute(*args, "KEYS", *keys, timeout=6.0)
            moved += len(keys)
        return moved

    def finish_migration(self, timeout: float = 10.0, *, hand_over_after: float = 0.0) -> None:
        """Move the keys of the slot :meth:`migrate_slot` started moving and
        give the slot to its target on every master: the target first, then
        the source, then the others (the order of the Redis docs' resharding).

        The target's ``SETSLOT NODE`` bumps its config epoch above every
        epoch *it knows of* (``clusterBumpConfigEpochWithoutConsensus``; no
        bump at all when it thinks its own is the greatest), and until its
        own ``SETSLOT`` the source still claims the slot in its gossip: a
        claim with a greater epoch than the target's takes the slot back, and
        the target drops the keys it had imported. The epochs travel by
        gossip, about once a second, so a move right after another one did
        exactly that (CI: the clean-up move of a test's slot, back to its
        source, a moment after the test's own move)::

            t0  move slot s from A to B: B bumps, B 4 (A 3, the greatest before)
            t1  at once, move s back to A: A has not heard of B's 4 yet, its
                own 3 is the greatest it knows of: no bump, A claims s with 3
            t2  before A's SETSLOT reaches B (a loaded machine), B's ping
                claims s with 4 > 3: A gives s back to B and deletes its keys
            t3  B's SETSLOT hands s to A: nobody claims it, A names B, the
                others A; the key moved is gone

        So every live node first learns every master's current epoch
        (:meth:`_share_epochs`), then the target claims the slot and its
        epoch is checked to be the greatest of all: the source's claims lose
        however late its hand-over comes. ``hand_over_after``: seconds between
        the target's claim and the source's hand-over (a loaded machine's
        delay, made long: for the harness's own test)."""
        if self._pending is None:
            raise RuntimeError("no slot migration was started")
        slot, source, target = self._pending
        self._pending = None
        deadline = time.monotonic() + timeout
        moved = self.move_keys(slot, source, target)
        self._share_epochs(deadline)
        owner = self.ids[target.port]
        target.execute("CLUSTER", "SETSLOT", slot, "NODE", owner)
        claimed = _my_epoch(target)
        rivals = {m.port: _my_epoch(m) for m in self._masters_now() if m is not target}
        if any(epoch >= claimed for epoch in rivals.values()):
            raise RuntimeError(f"slot {slot}: {target!r} claimed it with config epoch "
                               f"{claimed}, not above the other masters' {rivals}")
        if hand_over_after:
            time.sleep(hand_over_after)
        for server in (source, *[m for m in self._masters_now() if m not in (source, target)]):
            server.execute("CLUSTER", "SETSLOT", slot, "NODE", owner)
        self.wait_ok(max(0.1, deadline - time.monotonic()))
        # The next move starts from epochs every node knows.
        self._share_epochs(deadline)
        # A node that loses a slot to a claim with a greater epoch drops its
        # keys there: say so here, not as a test's missing key later.
        held = int(target.execute("CLUSTER", "COUNTKEYSINSLOT", slot))
        if held < moved:
            raise RuntimeError(f"slot {slot}: {moved} keys moved to {target!r}, which now "
                               f"holds {held} (it lost the slot for a moment and dropped "
                               "them)")

    def _share_epochs(self, deadline: float) -> None:
        """Wait until every live node knows each live master's config epoch
        and the cluster's current epoch, and no two masters share an epoch.

        Gossip would tell them within a second or two; a ``PUBLISH`` on each
        master tells them at once (a Cluster sends it over the bus to every
        node, and every bus message carries its sender's epochs, which the
        receiver records whatever the message). Sent again while not known:
        a message may meet a link being set up again. Equal epochs (none
        should arise here) are left to the Cluster, whose rule is that the
        master with the smaller node id takes a new one."""
        masters = self._masters_now()
        seen = ["nothing read yet"]

        def shared() -> bool:
            own = {m.port: _my_epoch(m) for m in masters}
            if len(set(own.values())) < len(own):
                seen[0] = f"masters share a config epoch: {own}"
                return False
            for server in self._live():
                current = int(_cluster_info(server).get("cluster_current_epoch", 0))
                recorded = _config_epochs(server)
                if current < max(own.values()) or any(recorded.get(port) != epoch
                                                      for port, epoch in own.items()):
                    seen[0] = (f"{server.port} knows current epoch {current} and "
                               f"{recorded}; the masters have {own}")
                    for master in masters:
                        master.execute("PUBLISH", EPOCH_CHANNEL, "")
                    return False
            return True

        try:
            _wait("every node knowing the masters' config epochs", shared,
                  max(0.1, deadline - time.monotonic()), 0.02)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; last seen: {seen[0]}") from None

    def _masters_now(self) -> list[RedisServer]:
        out = []
        for server in self._live():
            role = server.execute("ROLE", timeout=1.0)
            if role and _text(role[0]) == "master":
                out.append(server)
        return out

    def failover(self, index: int, timeout: float = 30.0) -> RedisServer:
        """``CLUSTER FAILOVER`` on master ``index``'s first replica (a manual
        failover: the replica catches up, then takes over); returns it once
        every node agrees. Needs ``replicas >= 1``."""
        if not self.replicas[index]:
            raise ValueError("failover needs a replica")
        replica = self.replicas[index][0]
        replica.execute("CLUSTER", "FAILOVER")
        asked = [time.monotonic()]

        def promoted() -> bool:
            role = replica.execute("ROLE", timeout=1.0)
            if bool(role) and _text(role[0]) == "master":
                return True
            # A manual failover that did not finish within the server's own
            # limit (5 s: the master must pause its clients and the masters
            # vote; a loaded machine misses it) is dropped, not retried: ask
            # again, as an operator would.
            if time.monotonic() - asked[0] > MANUAL_FAILOVER_RETRY:
                replica.execute("CLUSTER", "FAILOVER")
                asked[0] = time.monotonic()
            return False

        _wait("the replica promoted", promoted, timeout)
        self.wait_ok(timeout)
        return replica

    def stop(self) -> None:
        self._stop_all(suppress=False)

    def _stop_all(self, *, suppress: bool) -> None:
        first: BaseException | None = None
        for server in self.servers:
            try:
                server.stop()
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                first = first or exc
        if first is not None and not suppress:
            raise first

    def flushall(self) -> None:
        """``FLUSHALL`` on every live master."""
        for server in self._masters_now():
            server.execute("FLUSHALL")

    def __getitem__(self, index: int) -> RedisServer:
        return self.masters[index]

    def __len__(self) -> int:
        return len(self.masters)

    def __iter__(self) -> Iterator[RedisServer]:
        return iter(self.masters)

    def __repr__(self) -> str:
        return f"<RedisClusterGroup {self.masters!r}>"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


__all__: Sequence[str] = ["RedisClusterGroup", "SentinelGroup", "SentinelServer", "SLOTS"]
