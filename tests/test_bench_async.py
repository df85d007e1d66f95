"""The benchmark's asyncio contestant: timed inside its running loop (what an
ASGI server's long-lived loop pays), with the loop run per operation kept as a
row of its own (what ``async_to_sync`` pays per request). No timing is judged
here; the harness's shape is."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from bench.libs import DjangoRedlockAsync, build
from bench.uncontended import FIVE_NODES, ONE_NODE, timed_chunk
from django_redlock.testing import RedisNodes


def test_both_asyncio_rows_are_in_the_uncontended_tables() -> None:
    ids = [cid for cid, _, _ in ONE_NODE + FIVE_NODES]
    for n in (1, 5):
        assert f"drl-async-{n}" in ids and f"drl-async-call-{n}" in ids
        urls = [f"redis://127.0.0.1:{port}/0" for port in range(1, n + 1)]
        lib = build(f"drl-async-call-{n}", urls, urls)  # no I/O until used
        assert isinstance(lib, DjangoRedlockAsync) and lib.per_call
        lib.close()


def test_the_asyncio_row_is_timed_in_one_loop_run(
        redis_nodes_factory: Callable[..., RedisNodes]) -> None:
    one = redis_nodes_factory(1)
    inside = DjangoRedlockAsync(one.urls)
    per_call = DjangoRedlockAsync(one.urls, per_call=True)
    runs: list[str] = []
    try:
        for label, lib in (("inside", inside), ("per_call", per_call)):
            lib.label = label
            original = lib.loop.run_until_complete

            def counted(aw: Any, original: Any = original, label: str = label) -> Any:
                runs.append(label)
                return original(aw)

            lib.loop.run_until_complete = counted  # type: ignore[method-assign]
        errors: list[Exception] = []
        lat_inside: list[int] = []
        lat_call: list[int] = []
        op = inside.make_op("bench:test:async")
        assert hasattr(op, "timed_chunk")
        assert timed_chunk(op, 20, 3, lat_inside, errors.append) > 0
        call_op = per_call.make_op("bench:test:async-call")
        assert not hasattr(call_op, "timed_chunk")
        timed_chunk(call_op, 20, 3, lat_call, errors.append)
        assert not errors
        assert len(lat_inside) == 20 and len(lat_call) == 20
        assert runs.count("inside") == 1 and runs.count("per_call") == 23
    finally:
        for lib in (inside, per_call):
            lib.loop.run_until_complete = asyncio.BaseEventLoop.run_until_complete.__get__(
                lib.loop)  # type: ignore[method-assign]
            lib.close()


def test_the_asyncio_floors_send_both_commands_and_check_each_reply(
        redis_nodes_factory: Callable[..., RedisNodes]) -> None:
    """``raw-async-1`` (streams) and ``raw-protocol-1`` (a Protocol of our
    own) do the floor's work on a real node, timed in one loop run; a SET NX
    that finds the key taken is an error, not a fast no-op."""
    from bench.libs import BenchError, contestant_op

    one = redis_nodes_factory(1)
    for cid in ("raw-async-1", "raw-protocol-1"):
        key = f"bench:test:{cid}"
        op, close = contestant_op(cid, one.urls, key)
        try:
            errors: list[Exception] = []
            lat: list[int] = []
            assert hasattr(op, "timed_chunk")
            timed_chunk(op, 20, 3, lat, errors.append)
            assert not errors and len(lat) == 20
            assert not one[0].client().exists(key)  # each op deleted its own key
            one[0].client().set(key, "someone else")
            with pytest.raises(BenchError):
                op()
        finally:
            close()
