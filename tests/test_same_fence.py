"""Two holders with one fence: after a node lost its data, the claim keeps them apart.

``make chaos-long`` found it (the ``dataloss`` schedule, one sale lost in 4,516
operations): two workers held ``testapp.product:9`` at once with the same
fence, both claims were taken, and both fenced writes landed. The nodes issue
``max(counter + 1, clock)``, and a majority shares a node with the previous
holder's; but when that node lost its data, the new fence comes from the other
nodes of the new majority, which may have reached the same counter::

    A: granted by nodes 1, 2 (node 3 out of reach): counters 500 -> 501, fence 501
    node 2 loses its data (FLUSHALL, eviction, a restart empty)
    B: granted by nodes 2 (counter gone: its clock, lower) and 3 (500 -> 501): fence 501
    A claims row 7 at 501, reads stock 10; B's claim finds 501: "already ours"
    A writes 9 WHERE fence = 501; B writes 9 WHERE fence = 501: one sale lost

Here the counters are set far above the clock, so the collision is certain
rather than a matter of one millisecond. The claim now takes a row at its own
fence only if this hold claimed it before: B is refused.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
from django.db import connection

from django_redlock.exceptions import FencedWriteRejected
from django_redlock.testing import RedisNodes
from tests.testapp.models import Product

pytestmark = pytest.mark.django_db


def _two_holders_one_fence(nodes3: RedisNodes, make_manager: Callable[..., Any],
                           name: str) -> tuple[Any, Any]:
    a_mgr = make_manager(nodes3, node_timeout=0.2)
    b_mgr = make_manager(nodes3, node_timeout=0.2)
    a = a_mgr.lock(name, ttl=30, auto_renew=False)
    counter = a._fence_key_b
    clock_ms = int(nodes3[0].execute("TIME")[0]) * 1000
    for server in nodes3:  # the same counter on every node, far above the clocks
        server.execute("SET", counter, str(clock_ms + 10**9))
    nodes3[2].pause()
    try:
        assert a.acquire(timeout=5)  # nodes 1 and 2
    finally:
        nodes3[2].resume()
    nodes3[1].execute("FLUSHALL")  # node 2 loses A's lock and its counter
    b = b_mgr.lock(name, ttl=30, auto_renew=False)
    assert b.acquire(timeout=5)  # nodes 2 and 3
    assert b.fence == a.fence  # the collision this file is about
    return a, b


def test_a_claim_refuses_a_row_another_holder_claimed_with_the_same_fence(
        nodes3: RedisNodes, make_manager: Callable[..., Any]) -> None:
    product = Product.objects.create(name="p", stock=10)
    a, b = _two_holders_one_fence(nodes3, make_manager, product.lock_name())
    mine = Product.objects.claim_and_get(a, pk=product.pk)
    assert mine.stock == 10
    assert Product.objects.claim_and_get(a, pk=product.pk).stock == 10  # A again: its own
    with pytest.raises(FencedWriteRejected, match="same fence"):
        Product.objects.claim_and_get(b, pk=product.pk)
    with pytest.raises(FencedWriteRejected, match="same fence"):
        Product.objects.filter(pk=product.pk).claim(b)
    # B's write without a claim of its own writes nothing (the row carries A's
    # fence, which is B's too).
    with pytest.raises(FencedWriteRejected):
        Product.objects.filter(pk=product.pk).fenced_update(b, stock=9)
    mine.stock -= 1
    mine.fenced_save(a, update_fields=["stock"])
    assert Product.objects.get(pk=product.pk).stock == 9  # one sale, recorded once
    Product.objects.filter(pk=product.pk).fenced_update(a, stock=8)  # A's claimed row
    assert Product.objects.get(pk=product.pk).stock == 8


def test_a_multi_row_claim_refuses_rows_another_holder_claimed_with_the_same_fence(
        nodes3: RedisNodes, make_manager: Callable[..., Any]) -> None:
    rows = [Product.objects.create(name=f"r{i}", stock=5) for i in range(3)]
    a, b = _two_holders_one_fence(nodes3, make_manager, "restock:all")
    everything = Product.objects.filter(pk__in=[r.pk for r in rows])
    assert everything.claim(a) == 3
    assert everything.claim(a) == 0  # A's own rows: claimed again, none newly
    with pytest.raises(FencedWriteRejected, match="same fence"):
        everything.claim(b)
    assert everything.fenced_update(a, stock=4) == 3
    with pytest.raises(FencedWriteRejected):
        everything.fenced_update(b, stock=0)
    assert sorted(everything.values_list("stock", flat=True)) == [4, 4, 4]


def test_a_claim_that_lost_a_race_to_the_same_fence_records_no_row_as_its_own(
        nodes3: RedisNodes, make_manager: Callable[..., Any]) -> None:
    """B's claim reads the rows below its fence, and A (same fence) claims one
    of them before B's UPDATE runs::

        B: SELECT pk WHERE fence < 501  -> [7]
        A: UPDATE SET fence = 501 WHERE pk = 7 AND fence < 501  -> 1 (A's)
        B: UPDATE ... WHERE pk IN (7) AND fence < 501  -> 0: "same fence"

    B is refused. It used to record row 7 as its own all the same, so its
    next claim (the docs say: read again) found the row at its fence,
    "claimed by this hold", and passed, and both holders' writes landed: one
    sale lost. A row whose claimer cannot be told stays foreign to B."""
    product = Product.objects.create(name="p", stock=10)
    a, b = _two_holders_one_fence(nodes3, make_manager, product.lock_name())
    selects: list[str] = []
    a_read: list[Any] = []

    def a_claims_between_bs_read_and_its_update(execute: Any, sql: str, params: Any,
                                                  many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        if sql.lstrip().upper().startswith("SELECT"):
            selects.append(sql)
            if len(selects) == 2 and not a_read:  # B's read of the rows below its fence
                a_read.append(Product.objects.claim_and_get(a, pk=product.pk))
        return result

    with connection.execute_wrapper(a_claims_between_bs_read_and_its_update):
        with pytest.raises(FencedWriteRejected, match="same fence"):
            Product.objects.filter(pk=product.pk).claim(b)
    assert a_read and a_read[0].stock == 10  # the race happened as drawn above
    with pytest.raises(FencedWriteRejected, match="same fence"):
        Product.objects.filter(pk=product.pk).claim(b)  # B reads again: still refused
    with pytest.raises(FencedWriteRejected):
        Product.objects.filter(pk=product.pk).fenced_update(b, stock=9)
    mine = a_read[0]
    mine.stock -= 1
    mine.fenced_save(a, update_fields=["stock"])
    assert Product.objects.get(pk=product.pk).stock == 9  # A's sale, and only A's write
