"""Real-Redis test harness: start, break and heal Redis servers from a test.

Why this module exists
----------------------
A distributed lock is only as good as its behaviour when nodes die, stall or
lag. Mocks cannot show that: a mocked ``SET NX PX`` never times out half-way,
never answers after the lease is over and never forgets a key after a crash.
So django-redlock is tested against *real* ``redis-server`` (or
``valkey-server``) processes, and this module lets users do the same with
their own code:

>>> from django_redlock.testing import RedisNodes, FaultProxy
>>> with RedisNodes(3) as nodes:                     # doctest: +SKIP
...     nodes[0].kill()                              # kill -9 one node
...     nodes[1].pause()                             # SIGSTOP another
...     with FaultProxy(nodes[2].host, nodes[2].port) as slow:
...         slow.set_latency(0.2)                    # 200 ms each way
...         run_my_code([slow.url, ...])

Each :class:`RedisServer` is one independent process bound to 127.0.0.1 only,
on a free port, without persistence, in its own temporary directory. The
faults map onto what goes wrong in production:

==========================  ===============================================
``kill()``                  crash (``kill -9``): connections refused, data lost
``pause()`` / ``resume()``  a stalled node (GC pause, VM freeze): TCP connects
                            still complete, nothing answers
``restart(empty=True)``     crash and come back empty on the same address
                            (the case the Redlock paper's "delayed restart"
                            is about)
``FaultProxy.set_latency``  a slow link to one node
``FaultProxy.cut()``        a network partition (packets black-holed, not
                            refused)
``FaultProxy.reset()``      a network blip (every connection dropped)
==========================  ===============================================

This module is deliberately standalone: it imports neither Django nor the rest
of django_redlock, only the standard library (and redis-py lazily, inside
:meth:`RedisServer.client`), so it can be used to test anything that speaks
the Redis protocol.

Every wait in here is bounded both in the number of iterations and in time:
a test harness that can hang is worse than none.
"""

from __future__ import annotations

from .base import (  # noqa: F401 - LOCALHOST, for users
    LOCALHOST,
    RedisReplyError,
    ServerBinaryNotFound,
    _free_port,  # noqa: F401 - the test suite picks free ports with it
)
from .binaries import find_server_binary, find_valkey_binary
from .groups import RedisClusterGroup, SentinelGroup, SentinelServer
from .proxy import FaultProxy
from .servers import RedisNodes, RedisServer

__all__ = [
    "FaultProxy",
    "RedisClusterGroup",
    "RedisNodes",
    "RedisReplyError",
    "RedisServer",
    "SentinelGroup",
    "SentinelServer",
    "ServerBinaryNotFound",
    "find_server_binary",
    "find_valkey_binary",
]
