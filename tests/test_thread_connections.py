"""The library's own threads leave no database connection open behind them.

A ``lock_lost`` receiver runs in the renewal thread when renewal finds the lock
gone; if it uses the ORM, Django opens a connection that belongs to that thread.
The thread closes it after the tick (as a request's end does) and in any case
when it ends, instead of leaving it to the garbage collector (Python 3.13 warns
about an unclosed ``sqlite3`` connection, and a PostgreSQL connection would stay
open for the life of the process).

Run in a subprocess: the suite's database is an in-memory SQLite one, whose
connections Django never closes; this needs a file database.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from django_redlock.testing import RedisNodes

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, sys, threading, time
import django
from django.conf import settings

settings.configure(DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3",
                                          "NAME": sys.argv[1]}}, INSTALLED_APPS=[])
django.setup()
from django.db import connections

from django_redlock import LockManager, signals

urls = sys.argv[2].split(",")
mgr, operator = LockManager(urls, node_timeout=0.5), LockManager(urls, node_timeout=0.5)
used = []
lost = threading.Event()


def on_lost(sender, **kwargs):
    wrapper = connections["default"]
    with wrapper.cursor() as cursor:
        cursor.execute("SELECT 1")
    used.append((threading.current_thread().name, wrapper))
    lost.set()


signals.lock_lost.connect(on_lost)
lock = mgr.lock("db-in-renewal", ttl=0.6, auto_renew=True)
assert lock.acquire()
operator.force_release("db-in-renewal")
assert lost.wait(10), "renewal never noticed the loss"
time.sleep(0.3)  # the tick that sent lock_lost is over
name, wrapper = used[0]
after_tick = wrapper.connection is None
mgr.close()
operator.close()
print(json.dumps({"thread": name, "after_tick": after_tick,
                  "after_close": wrapper.connection is None}))
"""


def test_renewal_thread_closes_the_connection_a_receiver_opened(tmp_path: Path,
                                                                nodes3: RedisNodes) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error", "-c", SCRIPT, str(tmp_path / "db.sqlite3"),
         ",".join(nodes3.urls)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"thread": "redlock-watchdog", "after_tick": True, "after_close": True}
    assert "ResourceWarning" not in done.stderr and "Exception ignored" not in done.stderr, \
        done.stderr
