"""The two kinds of protected resource the workers update, and their audit logs.

Both keep a counter that the workers increment by a *non-atomic*
read-modify-write under the lock (read the value, compute value + 1, write it).
If mutual exclusion ever fails and nothing stops the late writer, an increment
is lost, which the checker sees: final value < number of writes the resource
accepted.

``db:<pk>``
    A ``tests.testapp.models.Product`` row (a ``LockableModel``) in a SQLite file
    shared by the worker processes. Fenced mode writes through the public ORM API:
    ``Product.objects.locked(pk=...)``, which claims the row right after acquiring
    (``UPDATE ... SET fence = F WHERE id = %s AND fence < F``) and then reads it,
    then ``fenced_save(lock)``, one conditional ``UPDATE ... WHERE id = %s AND
    fence = F`` (the row still carries our claim). Unfenced mode writes the same
    columns unconditionally (``filter(pk=...).update(stock=..., fence=...)``).
    A trigger (created here, outside the app's migrations, on the run's own
    database file) copies every applied update into ``chaos_audit`` in commit
    order, so the checker reads the resource's own history.

``ctr:<n>``
    A counter on a separate Redis server (not one of the lock nodes, never
    faulted), written the way ``Model.objects.locked()`` writes a row: right
    after acquiring, the holder *claims* it (:data:`CLAIM_LUA`: "set the stored
    fence to mine if mine is higher", refused otherwise), then reads it, then
    writes only while the claim holds (:data:`WRITE_LUA` check ``3``: "stored
    fence == mine"). A stale holder, whose claim a newer holder has overwritten,
    is refused whether the newer holder has written yet or only read. Every
    applied write is appended to a list, in the order Redis applied them.

``cas:<n>``
    The same counter with a stricter check: "write only if fence > stored fence
    *and* the stored fence is still the one read with the value". The fence
    check alone stops a paused holder's write once a newer holder has *written*;
    it lets it through while a newer holder has only *read*, and that newer
    holder's write then erases it (a lost update with every fence in order). The
    unchanged-since-read check closes that window too: the two counters side by
    side show whether it matters.

``rw:<n>`` (the ``family`` schedule)
    The ``ctr`` counter under ``read_lock`` / ``write_lock("chaos-rw:<n>")``:
    writers claim, read and write it as above; readers claim it too, with
    :data:`READ_CLAIM_LUA` ("raise the stored fence to mine, refuse nobody": a
    writer paused past its lease then finds a newer fence and is refused), read
    it at the start and at the end of their section, and write nothing.

``mx:<n><x>`` and ``seg:<n>.<i>`` (the ``family`` schedule)
    More ``ctr`` counters, claimed, read and written as above: a ``multi_lock``
    holder writes each of the two counters it locked (``mx:<n>a``, ``mx:<n>b``,
    ``mx:<n>c``; lock ``chaos-mx:<n><x>``) with that name's fence, a
    ``segments("chaos-seg:<n>", 2)`` holder buys from its segment's counter
    ``seg:<n>.<i>`` with the segment's fence.

Critical sections (``rw:<n>``, ``sem:<n>``, ``mx:<n>``, ``seg:<n>``)
    Every holder of the family joins a set of those inside the resource
    (:data:`ENTER_LUA`, which answers who was already inside, atomically) and
    leaves it (:data:`EXIT_LUA`), on the same never-faulted Redis server. The
    checker pairs that with whether the holder's lease covered its section.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from .history import Write

#: KEYS: value, stored fence, log list. ARGV: new value, fence, check ('0' none,
#: '1' fence > stored, '2' that and stored == the fence read, '3' stored == fence:
#: the row is still claimed by us), op id, fence read.
#: Returns {1, stored} when applied, {0, stored} when refused.
WRITE_LUA = """
local stored = redis.call('GET', KEYS[2]) or '0'
if (ARGV[3] == '1' or ARGV[3] == '2') and tonumber(ARGV[2]) <= tonumber(stored) then
  return {0, stored}
end
if ARGV[3] == '2' and stored ~= ARGV[5] then
  return {0, stored}
end
if ARGV[3] == '3' and stored ~= ARGV[2] then
  return {0, stored}
end
local old = redis.call('GET', KEYS[1]) or '0'
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
redis.call('RPUSH', KEYS[3], ARGV[2] .. ' ' .. stored .. ' ' .. old .. ' ' .. ARGV[1] .. ' ' .. ARGV[4])
return {1, stored}
"""

#: KEYS: value, stored fence. ARGV: fence. The claim: {1, value} after storing our
#: fence when it is higher than the stored one; {0, stored} when it is not (a
#: newer holder claimed the counter: we are the stale one).
CLAIM_LUA = """
local stored = redis.call('GET', KEYS[2]) or '0'
if tonumber(ARGV[1]) <= tonumber(stored) then
  return {0, stored}
end
redis.call('SET', KEYS[2], ARGV[1])
return {1, redis.call('GET', KEYS[1]) or '0'}
"""

#: KEYS: value, stored fence. ARGV: fence. A reader's claim: the stored fence
#: becomes max(stored, mine), never refused (readers share the lock, and their
#: fences are in no order among themselves); returns the value.
READ_CLAIM_LUA = """
local stored = redis.call('GET', KEYS[2]) or '0'
if tonumber(ARGV[1]) > tonumber(stored) then
  redis.call('SET', KEYS[2], ARGV[1])
end
return redis.call('GET', KEYS[1]) or '0'
"""

#: KEYS: the set of sections inside. ARGV: this section's id. Returns the ids that
#: were inside before it joined (one atomic step: of two sections that meet, the
#: later one always sees the earlier).
ENTER_LUA = """
local inside = redis.call('SMEMBERS', KEYS[1])
redis.call('SADD', KEYS[1], ARGV[1])
return inside
"""

#: KEYS: the set of sections inside. ARGV: this section's id.
EXIT_LUA = """
return redis.call('SREM', KEYS[1], ARGV[1])
"""


#: ``family``: the names a multi-lock takes two of (``multi_counter``).
MULTI_NAMES = ("a", "b", "c")
#: ``family``: the segments of ``segments("chaos-seg:<n>", SEGMENTS)``.
SEGMENTS = 2


def multi_counter(ident: str, name: str) -> str:
    """The counter (and, prefixed with ``chaos-``, the lock) of multi-lock name ``name``."""
    return f"mx:{ident}{name}"


def segment_counter(ident: str, index: int) -> str:
    """The counter of segment ``index`` of ``seg:<ident>``."""
    return f"seg:{ident}.{index}"


def family_counters(items: list[str]) -> list[str]:
    """Every counter the family's work ``items`` may write (the ones to audit)."""
    out: set[str] = set()
    for item in items:
        kind, ident = item.split(":", 1)
        if kind == "rw-write" or kind == "rw-read":
            out.add(f"rw:{ident}")
        elif kind == "multi":
            out.update(multi_counter(ident, n) for n in MULTI_NAMES)
        elif kind == "seg":
            out.update(segment_counter(ident, i) for i in range(SEGMENTS))
    return sorted(out)


def inside_key(resource: str) -> str:
    """The set of critical sections inside ``resource`` (``rw:<n>``, ``sem:<n>``,
    ``mx:<n>``, ``seg:<n>``)."""
    return f"chaos:{resource}:inside"


AUDIT_SQL = """
CREATE TABLE IF NOT EXISTS chaos_audit (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    product_id INTEGER NOT NULL,
    old_fence INTEGER NOT NULL,
    new_fence INTEGER NOT NULL,
    old_stock INTEGER NOT NULL,
    new_stock INTEGER NOT NULL
);
CREATE TRIGGER IF NOT EXISTS chaos_audit_product AFTER UPDATE OF stock ON testapp_product
BEGIN
    INSERT INTO chaos_audit (product_id, old_fence, new_fence, old_stock, new_stock)
    VALUES (NEW.id, OLD.fence, NEW.fence, OLD.stock, NEW.stock);
END;
"""


def counter_keys(resource: str) -> tuple[str, str, str]:
    """Keys of counter ``ctr:<n>`` on the resource server: value, fence, log."""
    return f"chaos:{resource}:value", f"chaos:{resource}:fence", f"chaos:{resource}:log"


def counter_state(client: Any, resource: str) -> tuple[int, list[Write]]:
    """Final value and applied-write log of a counter."""
    value_key, _, log_key = counter_keys(resource)
    value = int(client.get(value_key) or 0)
    writes = []
    for i, raw in enumerate(client.lrange(log_key, 0, -1)):
        fence, prev, old, new, _op = raw.decode().split(" ")
        writes.append(Write(resource, i, int(fence), int(prev), int(old), int(new)))
    return value, writes


def db_prepare(db_path: str) -> None:
    """Add the audit table and trigger to a migrated database (idempotent); WAL mode
    so readers do not block the one writer."""
    con = sqlite3.connect(db_path, timeout=10)
    try:
        con.execute("PRAGMA journal_mode=WAL")
        con.executescript(AUDIT_SQL)
        con.commit()
    finally:
        con.close()


def db_create_rows(db_path: str, names: list[str]) -> list[int]:
    """Insert one Product row per name (stock 0, fence 0); return their pks."""
    con = sqlite3.connect(db_path, timeout=10)
    try:
        pks = []
        for name in names:
            cur = con.execute(
                "INSERT INTO testapp_product (fence, name, stock, updated) "
                "VALUES (0, ?, 0, datetime('now'))", (name,))
            pks.append(int(cur.lastrowid or 0))
        con.commit()
        return pks
    finally:
        con.close()


def db_state(db_path: str, resource: str) -> tuple[int, list[Write]]:
    """Final stock and applied-update log of row ``db:<pk>``."""
    pk = int(resource.split(":", 1)[1])
    con = sqlite3.connect(db_path, timeout=10)
    try:
        row = con.execute("SELECT stock FROM testapp_product WHERE id = ?", (pk,)).fetchone()
        rows = con.execute(
            "SELECT old_fence, new_fence, old_stock, new_stock FROM chaos_audit "
            "WHERE product_id = ? ORDER BY seq", (pk,)).fetchall()
    finally:
        con.close()
    writes = [Write(resource, i, int(nf), int(of), int(os_), int(ns))
              for i, (of, nf, os_, ns) in enumerate(rows)]
    return int(row[0]) if row else 0, writes
