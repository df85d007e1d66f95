"""ORM helpers: lock-then-read (``objects.locked``), fenced writes, FenceField.

The fenced-write tests run on SQLite always, and on PostgreSQL too when
``DATABASE_URL`` names one (alias ``"postgres"``, see tests/testapp/dburl.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.core.exceptions import ImproperlyConfigured

import django_redlock
from django_redlock import signals
from django_redlock.exceptions import FencedWriteRejected, LockLost, RedlockError
from django_redlock.models import FenceField, LockableModel
from tests.testapp.dburl import skip_reason
from tests.testapp.models import GiftProduct, Product, ShelfItem, SkuItem

PG_SKIP = skip_reason()

DATABASES = [
    pytest.param("default", marks=pytest.mark.django_db, id="sqlite"),
    pytest.param("postgres", id="postgres", marks=[
        pytest.mark.postgres,
        pytest.mark.skipif(PG_SKIP is not None, reason=PG_SKIP or ""),
        pytest.mark.django_db(databases=["default", "postgres"]),
    ]),
]


@pytest.fixture
def on_acquire() -> Iterator[list[Any]]:
    """Callables run by a lock_acquired receiver (to act 'while we were waiting')."""
    actions: list[Any] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        for action in actions:
            action(kwargs["name"])

    signals.lock_acquired.connect(receiver, weak=False)
    yield actions
    signals.lock_acquired.disconnect(receiver)


# -- names and lock-then-read ------------------------------------------------------
@pytest.mark.django_db
def test_lock_name_and_locked_agree() -> None:
    product = Product.objects.create(name="p", stock=3)
    name = f"testapp.product:{product.pk}"
    assert product.lock_name() == name and product.lock().name == name
    assert product.lock().label == "model:testapp.Product"
    for lookup in ({"pk": product.pk}, {"pk": str(product.pk)}, {"id": product.pk},
                   {"pk__exact": product.pk}):
        with Product.objects.locked(**lookup, timeout=0) as locked:
            assert locked.held_lock.name == name and locked.held_lock.owned()
            assert locked.pk == product.pk and locked.stock == 3
            assert django_redlock.lock(name).locked()
        assert not locked.held_lock.owned()
    assert not django_redlock.lock(name).locked()


@pytest.mark.django_db
def test_locked_reads_the_row_after_the_lock_is_held(on_acquire: list[Any]) -> None:
    product = Product.objects.create(name="p", stock=3)
    # A write that lands while we wait for the lock (here: right as we get it)
    # must be visible to the body: the row is read after acquiring, not before.
    on_acquire.append(lambda name: Product.objects.filter(pk=product.pk).update(stock=42))
    with Product.objects.locked(pk=product.pk) as locked:
        assert locked.stock == 42


@pytest.mark.django_db
def test_locked_waits_for_the_holder_and_times_out() -> None:
    product = Product.objects.create(name="p")
    with product.lock(timeout=0):
        started = time.monotonic()
        with pytest.raises(django_redlock.LockNotAcquired), \
                Product.objects.locked(pk=product.pk, timeout=0.3):
            pass  # pragma: no cover
        assert 0.25 < time.monotonic() - started < 3


@pytest.mark.django_db
def test_locked_needs_the_template_placeholders_in_the_lookup() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"needs <pk> in the lookup.*got: name"), \
            Product.objects.locked(name="p"):
        pass  # pragma: no cover
    item = SkuItem.objects.create(sku="A1", qty=1)
    assert item.lock_name() == "sku:A1"
    with SkuItem.objects.locked(sku="A1") as locked:
        assert locked.held_lock.name == "sku:A1" and locked.pk == item.pk
    with pytest.raises(ImproperlyConfigured, match="<sku>"), SkuItem.objects.locked(pk=item.pk):
        pass  # pragma: no cover


@pytest.mark.django_db
def test_locked_missing_row_releases_the_lock() -> None:
    with pytest.raises(Product.DoesNotExist), Product.objects.locked(pk=987654):
        pass  # pragma: no cover
    assert not django_redlock.lock("testapp.product:987654").locked()


def test_unsaved_instance_cannot_be_locked() -> None:
    with pytest.raises(ValueError, match="unsaved Product"):
        Product(name="new").lock()


# -- fenced writes -----------------------------------------------------------------
@pytest.mark.parametrize("alias", DATABASES)
def test_fenced_save_writes_with_a_newer_fence(alias: str) -> None:
    product = Product.objects.using(alias).create(name="p", stock=1)
    before = product.updated
    with Product.objects.using(alias).locked(pk=product.pk) as locked:
        locked.stock = 2
        locked.name = "not written"
        locked.fenced_save(locked.held_lock, update_fields=["stock", "updated"])
        assert locked.fence == locked.held_lock.fence > 0
    row = Product.objects.using(alias).get(pk=product.pk)
    assert (row.stock, row.name, row.fence) == (2, "p", locked.fence)
    assert row.updated > before  # auto_now honoured (pre_save)
    with product.lock() as lock:
        # `product` was read before the write above, and not after this hold's
        # claim: writing it back would undo that write (stock 2 -> 1), so it
        # is refused before anything is written.
        product.name = "renamed"
        with pytest.raises(FencedWriteRejected, match="not read after a claim"):
            product.fenced_save(lock)
        assert Product.objects.using(alias).get(pk=product.pk).name == "p"
        product = Product.objects.using(alias).claim_and_get(lock, pk=product.pk)
        product.name = "renamed"
        product.fenced_save(lock)  # every field by default
    row = Product.objects.using(alias).get(pk=product.pk)
    assert (row.stock, row.name, row.fence) == (2, "renamed", lock.fence)


@pytest.mark.parametrize("alias", DATABASES)
def test_fenced_write_refused_after_a_paused_holder_lease_passed(alias: str) -> None:
    product = Product.objects.using(alias).create(name="p", stock=10)
    # A: takes the lock with a short lease, reads, then "pauses" past the lease.
    a_lock = product.lock(ttl=0.5, auto_renew=False)
    assert a_lock.acquire(timeout=0)
    a_view = Product.objects.using(alias).get(pk=product.pk)
    a_view.stock -= 1
    time.sleep(0.8)
    # B: the lease passed, B gets the lock (higher fence) and writes.
    with Product.objects.using(alias).locked(pk=product.pk, timeout=1) as b_view:
        assert b_view.held_lock.fence > a_lock.fence
        b_view.stock -= 5
        b_view.fenced_save(b_view.held_lock, update_fields=["stock"])
    # A resumes and writes its stale value: the database refuses it.
    with pytest.raises(FencedWriteRejected) as info:
        a_view.fenced_save(a_lock, update_fields=["stock"])
    assert isinstance(info.value, RedlockError)
    assert info.value.fence == a_lock.fence and info.value.lock_name == a_lock.name
    assert "newer lock holder" in str(info.value)
    row = Product.objects.using(alias).get(pk=product.pk)
    assert (row.stock, row.fence) == (5, b_view.held_lock.fence)  # B's write stands
    with pytest.raises(LockLost):
        a_lock.release()


@pytest.mark.parametrize("alias", DATABASES)
def test_fenced_update_writes_only_rows_claimed_by_the_lock(alias: str) -> None:
    products = Product.objects.using(alias)
    a = products.create(name="a", stock=1)
    b = products.create(name="b", stock=1)
    with django_redlock.lock("testapp.products:all") as old:
        pass
    with django_redlock.lock("testapp.products:all") as new:
        pass
    assert new.fence > old.fence
    # Not claimed yet: refused, whatever the fences (the values could rest on a
    # read that a newer holder's claim should have fenced off).
    with pytest.raises(FencedWriteRejected, match="claim the rows"):
        products.filter(pk=b.pk).fenced_update(new, stock=9)
    assert products.filter(pk=b.pk).claim(new) == 1
    assert products.filter(pk=b.pk).claim(new) == 0  # already ours: nothing to do
    assert products.filter(pk=b.pk).fenced_update(new, stock=9) == 1
    # The old holder claims both: a gets its fence, b carries the newer one -> refused.
    with pytest.raises(FencedWriteRejected, match="newer lock holder claimed") as info:
        products.filter(pk__in=[a.pk, b.pk]).claim(old)
    assert info.value.context["stored_fence"] == new.fence
    # a was claimed by old, b stays new's: old writes a only; new cannot write a.
    assert products.filter(pk__in=[a.pk, b.pk]).fenced_update(old, stock=5) == 1
    assert dict(products.values_list("name", "stock")) == {"a": 5, "b": 9}
    with pytest.raises(FencedWriteRejected, match="newer lock holder claimed"):
        products.filter(pk=b.pk).fenced_update(old, stock=0)
    assert products.none().fenced_update(old, stock=0) == 0  # nothing selected: no error
    with pytest.raises(ValueError, match="do not pass 'fence'"):
        products.fenced_update(new, fence=1)
    assert dict(products.values_list("name", "fence")) == {"a": old.fence, "b": new.fence}


# -- the lost-update interleaving, for every helper ----------------------------------
#
#   A (fence 5) reads stock 10 and pauses past its lease
#   B (fence 6) acquires and reads 10
#   A wakes and writes 9
#   B writes 9                      -> two sales, stock 9, unless A's write is refused
#
# Each test plays exactly that with two real locks on one name (A's lease is short
# and not renewed, so B acquires once it passed) and checks: A's write refused,
# B's accepted, stock 9 for one sale.

def _pause_past(lock: Any) -> None:
    deadline = time.monotonic() + 5
    while lock.owned() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)  # the lease is over on the nodes too (drift allowance)
    assert not lock.owned()


@pytest.mark.parametrize("alias", DATABASES)
def test_interleaving_locked_then_fenced_save(alias: str) -> None:
    products = Product.objects.using(alias)
    pk = products.create(name="p", stock=10).pk
    a_ctx = products.locked(pk=pk, ttl=0.4, auto_renew=False)
    a = a_ctx.__enter__()
    assert a.stock == 10 and a.fence == a.held_lock.fence  # claimed before the read
    _pause_past(a.held_lock)
    with products.locked(pk=pk, timeout=2) as b:
        assert b.held_lock.fence > a.held_lock.fence and b.stock == 10
        a.stock -= 1
        with pytest.raises(FencedWriteRejected, match="newer lock holder"):
            a.fenced_save(a.held_lock, update_fields=["stock"])  # A wakes: refused
        b.stock -= 1
        b.fenced_save(b.held_lock, update_fields=["stock"])
    with pytest.raises(LockLost):
        a_ctx.__exit__(None, None, None)
    assert products.get(pk=pk).stock == 9


@pytest.mark.parametrize("alias", DATABASES)
def test_interleaving_claim_and_get_then_fenced_update(alias: str) -> None:
    products = Product.objects.using(alias)
    pk = products.create(name="p", stock=10).pk
    name = f"testapp.product:{pk}"
    a_lock = django_redlock.lock(name, ttl=0.4, auto_renew=False)
    assert a_lock.acquire(timeout=0)
    a_read = products.claim_and_get(a_lock, pk=pk).stock
    _pause_past(a_lock)
    with django_redlock.lock(name, timeout=2) as b_lock:
        b_read = products.claim_and_get(b_lock, pk=pk).stock
        assert a_read == b_read == 10
        with pytest.raises(FencedWriteRejected, match="newer lock holder claimed"):
            products.filter(pk=pk).fenced_update(a_lock, stock=a_read - 1)
        assert products.filter(pk=pk).fenced_update(b_lock, stock=b_read - 1) == 1
    with pytest.raises(LockLost):
        a_lock.release()
    assert products.get(pk=pk).stock == 9


@pytest.mark.parametrize("alias", DATABASES)
def test_interleaving_claim_then_fenced_update_of_several_rows(alias: str) -> None:
    products = Product.objects.using(alias)
    pks = [products.create(name=f"p{i}", stock=10).pk for i in range(3)]
    rows = products.filter(pk__in=pks)
    a_lock = django_redlock.lock("testapp.products:batch", ttl=0.4, auto_renew=False)
    assert a_lock.acquire(timeout=0)
    assert rows.claim(a_lock) == 3
    a_read = {p.pk: p.stock for p in rows}
    _pause_past(a_lock)
    with django_redlock.lock("testapp.products:batch", timeout=2) as b_lock:
        assert rows.claim(b_lock) == 3
        b_read = {p.pk: p.stock for p in rows}
        with pytest.raises(FencedWriteRejected):
            for pk in pks:
                products.filter(pk=pk).fenced_update(a_lock, stock=a_read[pk] - 1)
        for pk in pks:
            assert products.filter(pk=pk).fenced_update(b_lock, stock=b_read[pk] - 1) == 1
    with pytest.raises(LockLost):
        a_lock.release()
    assert sorted(rows.values_list("stock", flat=True)) == [9, 9, 9]


@pytest.mark.parametrize("alias", DATABASES)
def test_interleaving_unclaimed_reads_are_refused_and_nothing_is_lost(alias: str) -> None:
    """An instance read without a claim (``row.lock()``, then ``get()``) is
    refused, the stale holder's as the newer one's: a compare-and-set on the
    fence it was read with cannot see a write that keeps the row's fence (the
    next two tests). The newer holder then claims, reads and writes."""
    products = Product.objects.using(alias)
    product = products.create(name="p", stock=10)
    a_lock = product.lock(ttl=0.4, auto_renew=False)
    assert a_lock.acquire(timeout=0)
    a = products.get(pk=product.pk)
    _pause_past(a_lock)
    with product.lock(timeout=2) as b_lock:
        b = products.get(pk=product.pk)
        a.stock -= 1
        with pytest.raises(FencedWriteRejected, match="not read after a claim"):
            a.fenced_save(a_lock, update_fields=["stock"])
        b.stock -= 1
        with pytest.raises(FencedWriteRejected, match="not read after a claim"):
            b.fenced_save(b_lock, update_fields=["stock"])
        assert products.get(pk=product.pk).stock == 10  # nothing written
        b = products.claim_and_get(b_lock, pk=product.pk)
        b.stock -= 1
        b.fenced_save(b_lock, update_fields=["stock"])
    with pytest.raises(LockLost):
        a_lock.release()
    assert products.get(pk=product.pk).stock == 9  # one sale, recorded once


@pytest.mark.parametrize("alias", DATABASES)
def test_interleaving_a_claimed_write_then_an_unclaimed_one_loses_no_sale(alias: str) -> None:
    """The schedule that broke the unclaimed compare-and-set::

        A claims (fence 41) and reads stock 10, is paused past its lease
        B (fence 42) acquires and reads without a claim: stock 10, fence 41
        A resumes, writes 9 WHERE fence = 41: lands (nobody claimed since)
        B wrote 9 WHERE fence = 41 (the fence it read): landed, a sale lost

    B's unclaimed write is refused now; B's claim-then-read sees A's sale."""
    products = Product.objects.using(alias)
    product = products.create(name="p", stock=10)
    a_lock = product.lock(ttl=0.4, auto_renew=False)
    assert a_lock.acquire(timeout=0)
    a = products.claim_and_get(a_lock, pk=product.pk)
    _pause_past(a_lock)
    with product.lock(timeout=2) as b_lock:
        assert b_lock.fence > a_lock.fence
        b = products.get(pk=product.pk)  # no claim: fence 41, stock 10
        a.stock -= 1
        a.fenced_save(a_lock, update_fields=["stock"])  # nobody claimed since A: lands
        b.stock -= 1
        with pytest.raises(FencedWriteRejected, match="not read after a claim"):
            b.fenced_save(b_lock, update_fields=["stock"])
        b = products.claim_and_get(b_lock, pk=product.pk)
        assert b.stock == 9  # A's sale
        b.stock -= 1
        b.fenced_save(b_lock, update_fields=["stock"])
    with pytest.raises(LockLost):
        a_lock.release()
    assert products.get(pk=product.pk).stock == 8  # two sales, both recorded


@pytest.mark.parametrize("alias", DATABASES)
def test_interleaving_a_second_write_of_a_stale_holder_is_refused_after_a_claim(
        alias: str) -> None:
    """A writes twice; between them its lease runs out and B claims: A's
    second write (at A's fence, which a write does not move) is refused."""
    products = Product.objects.using(alias)
    product = products.create(name="p", stock=10)
    a_lock = product.lock(ttl=0.4, auto_renew=False)
    assert a_lock.acquire(timeout=0)
    a = products.claim_and_get(a_lock, pk=product.pk)
    a.stock -= 1
    a.fenced_save(a_lock, update_fields=["stock"])  # sale 1
    _pause_past(a_lock)
    with product.lock(timeout=2) as b_lock:
        b = products.claim_and_get(b_lock, pk=product.pk)
        a.stock -= 1
        with pytest.raises(FencedWriteRejected, match="newer lock holder"):
            a.fenced_save(a_lock, update_fields=["stock"])  # stale sale 2: refused
        b.stock -= 1
        b.fenced_save(b_lock, update_fields=["stock"])  # sale 2
    with pytest.raises(LockLost):
        a_lock.release()
    assert products.get(pk=product.pk).stock == 8


@pytest.mark.parametrize("alias", DATABASES)
def test_interleaving_the_blind_update_without_a_claim_is_refused(alias: str) -> None:
    """The pattern the docs used to teach, ``filter(fence__lt=F).update(stock=<read>)``,
    lost A's sale here; ``fenced_update`` without a claim now refuses instead."""
    products = Product.objects.using(alias)
    pk = products.create(name="p", stock=10).pk
    name = f"testapp.product:{pk}"
    a_lock = django_redlock.lock(name, ttl=0.4, auto_renew=False)
    assert a_lock.acquire(timeout=0)
    a_read = products.get(pk=pk).stock
    _pause_past(a_lock)
    with django_redlock.lock(name, timeout=2) as b_lock:
        b_read = products.get(pk=pk).stock
        with pytest.raises(FencedWriteRejected, match="claim the rows"):
            products.filter(pk=pk).fenced_update(a_lock, stock=a_read - 1)
        with pytest.raises(FencedWriteRejected, match="claim the rows"):
            products.filter(pk=pk).fenced_update(b_lock, stock=b_read - 1)
    with pytest.raises(LockLost):
        a_lock.release()
    assert products.get(pk=pk).stock == 10  # nothing written, nothing lost


@pytest.mark.django_db
def test_claim_and_get_edge_cases() -> None:
    product = Product.objects.create(name="p", stock=1)
    with product.lock() as lock:
        with pytest.raises(Product.DoesNotExist):
            Product.objects.claim_and_get(lock, pk=987654)
        Product.objects.create(name="p", stock=2)
        with pytest.raises(Product.MultipleObjectsReturned, match="claim several rows"):
            Product.objects.claim_and_get(lock, name="p")
        assert Product.objects.filter(name="p").exclude(fence=0).count() == 0  # none claimed
        row = Product.objects.claim_and_get(lock, pk=product.pk)
        assert row.fence == lock.fence and row.held_lock is lock
    with django_redlock.lock(f"stock:{product.pk}") as other:
        with pytest.warns(RuntimeWarning, match="two names for one row"):
            Product.objects.claim_and_get(other, pk=product.pk)
    with pytest.raises(ValueError, match="fencing"), product.lock(fencing=False) as nofence:
        Product.objects.claim_and_get(nofence, pk=product.pk)


@pytest.mark.django_db
def test_locked_refuses_a_row_a_newer_holder_claimed() -> None:
    product = Product.objects.create(name="p", stock=1)
    Product.objects.filter(pk=product.pk).update(fence=2**62)  # claimed by "the future"
    with pytest.raises(FencedWriteRejected, match="newer lock holder"), \
            Product.objects.locked(pk=product.pk):
        pass  # pragma: no cover
    assert not product.lock().locked()
    with Product.objects.locked(pk=product.pk, fencing=False) as row:  # nothing to claim with
        assert row.fence == 2**62 and row.held_lock.fence == 0


def test_lock_template_is_the_rows_lock_name() -> None:
    assert Product.lock_template() == "testapp.product:<pk>"
    assert SkuItem.lock_template() == "sku:<sku>"


@pytest.mark.django_db
def test_fenced_save_refuses_a_lock_without_fence() -> None:
    product = Product.objects.create(name="p")
    with product.lock(fencing=False) as lock:
        assert lock.fence == 0
        with pytest.raises(ValueError, match="fencing=True"):
            product.fenced_save(lock)
    with pytest.raises(ValueError, match="has fence 0"):
        product.fenced_save(product.lock())  # never acquired
    with pytest.raises(ValueError, match="fencing"):
        Product.objects.fenced_update(product.lock(), stock=1)
    with pytest.raises(ValueError, match="unsaved"), product.lock() as lock:
        Product(name="new").fenced_save(lock)


@pytest.mark.django_db
def test_fenced_save_of_a_deleted_row_and_bad_fields() -> None:
    product = Product.objects.create(name="p")
    with product.lock() as lock:
        with pytest.raises(ValueError, match="no field 'nope'"):
            product.fenced_save(lock, update_fields=["nope"])
        with pytest.raises(ValueError, match="not a concrete, non-primary-key field"):
            product.fenced_save(lock, update_fields=["id"])
        Product.objects.filter(pk=product.pk).delete()
        with pytest.raises(FencedWriteRejected, match="no longer exists"):
            product.fenced_save(lock)


@pytest.mark.django_db
def test_plain_save_never_moves_the_fence_back() -> None:
    product = Product.objects.create(name="p", stock=1)
    stale = Product.objects.get(pk=product.pk)  # fence 0 in memory
    with Product.objects.locked(pk=product.pk) as held:
        held.fenced_save(held.held_lock)
        lock = held.held_lock
    stale.stock = 2
    stale.save()  # writes stock, not fence
    row = Product.objects.get(pk=product.pk)
    assert (row.stock, row.fence) == (2, lock.fence)
    stale.save(update_fields=["stock", "fence"])  # named: still not the fence
    assert Product.objects.get(pk=product.pk).fence == lock.fence
    # An instance built with the row's pk (an upsert; a form or serializer
    # that makes a fresh instance) is saved by an UPDATE of every field: its
    # fence of 0 stays out of it.
    Product(pk=product.pk, name="p", stock=3).save()
    row = Product.objects.get(pk=product.pk)
    assert (row.stock, row.fence) == (3, lock.fence)
    fresh = Product(name="q")
    fresh.save()  # inserts work as usual, fence 0
    assert Product.objects.get(pk=fresh.pk).fence == 0
    fresh.delete()
    fresh.save()  # a deleted instance (pk None) is inserted again, as with Model.save()
    assert Product.objects.filter(name="q").count() == 1


class _PrimaryReplicaRouter:
    """The router of Django's multi-database docs: reads from the replica,
    writes to the primary."""

    def db_for_read(self, model: Any, **hints: Any) -> str:
        return "replica"

    def db_for_write(self, model: Any, **hints: Any) -> str:
        return "default"

    def allow_relation(self, *args: Any, **hints: Any) -> bool:
        return True

    def allow_migrate(self, *args: Any, **hints: Any) -> bool:
        return True


@pytest.mark.django_db(databases=["default", "replica"])
def test_claims_and_fenced_writes_go_to_the_primary_under_a_replica_router(settings: Any) -> None:
    """A claim's read must see its own UPDATE, and a fenced write goes where
    save() writes: with reads routed to a replica that lags (here: one never
    written but at the start), the claim read the replica's row (fence 0) and
    refused itself, and fenced_save wrote the replica."""
    product = Product.objects.create(name="p", stock=10)
    Product.objects.using("replica").create(pk=product.pk, name="p", stock=10)  # "replicated"
    settings.DATABASE_ROUTERS = [_PrimaryReplicaRouter()]
    assert Product.objects.get(pk=product.pk)._state.db == "replica"  # the router is on
    with Product.objects.locked(pk=product.pk) as held:
        assert held._state.db == "default" and held.fence == held.held_lock.fence
        held.stock -= 1
        held.fenced_save(held.held_lock, update_fields=["stock"])
    with product.lock() as lock:
        assert Product.objects.filter(pk=product.pk).claim(lock) == 1
        assert Product.objects.filter(pk=product.pk).fenced_update(lock, stock=8) == 1
        row = Product.objects.claim_and_get(lock, pk=product.pk)
        row.stock -= 1
        row._state.db = "replica"  # as if read from the replica after the claim
        row.fenced_save(lock, update_fields=["stock"])
    primary = Product.objects.using("default").get(pk=product.pk)
    assert (primary.stock, primary.fence) == (7, lock.fence)
    assert Product.objects.using("replica").get(pk=product.pk).stock == 10  # never written


@pytest.mark.django_db
def test_a_child_model_of_multi_table_inheritance_is_refused_fenced_writes() -> None:
    """A child's fence is in its parent's table, which Django updates with a
    SELECT and then an UPDATE: the fence condition would not be in the UPDATE
    (a stale holder paused between the two wrote over a newer holder's write).
    Its claims and fenced writes are refused; the parent's rows work, and a
    plain save() of the child still never writes the fence."""
    gift = GiftProduct.objects.create(name="g", stock=3)
    with pytest.raises(ImproperlyConfigured, match="multi-table inheritance"):
        with GiftProduct.objects.locked(pk=gift.pk):
            pass
    with gift.lock() as lock:
        for write in (lambda: GiftProduct.objects.claim_and_get(lock, pk=gift.pk),
                      lambda: GiftProduct.objects.filter(pk=gift.pk).claim(lock),
                      lambda: GiftProduct.objects.filter(pk=gift.pk).fenced_update(lock, stock=1),
                      lambda: gift.fenced_save(lock)):
            with pytest.raises(ImproperlyConfigured, match="testapp.Product"):
                write()
    assert GiftProduct.objects.get(pk=gift.pk).fence == 0  # nothing claimed
    with Product.objects.locked(pk=gift.pk) as parent:  # the parent's row: one statement
        parent.stock -= 1
        parent.fenced_save(parent.held_lock, update_fields=["stock"])
        fence = parent.held_lock.fence
    gift.wrapping = "gold"
    gift.save()  # the child's plain save: every field but the fence
    row = GiftProduct.objects.get(pk=gift.pk)
    assert (row.stock, row.wrapping, row.fence) == (3, "gold", fence)


@pytest.mark.django_db
def test_a_fenced_write_of_a_concrete_parents_field_is_refused() -> None:
    """The fence in the model's own table, a field in its concrete parent's:
    Django writes the parent's table with a SELECT of the pks and then an
    UPDATE ... WHERE pk IN (...), without the fence condition (a stale holder
    paused between the two wrote over a newer holder's sale). Such a write is
    refused; the model's own fields are written fenced as any."""
    item = ShelfItem.objects.create(title="t", stock=3)
    with ShelfItem.objects.locked(pk=item.pk) as held:
        lock = held.held_lock
        held.title, held.stock = "changed", 2
        with pytest.raises(ImproperlyConfigured, match="'title'.*testapp.Catalogue"):
            held.fenced_save(lock)  # every field by default: the parent's too
        with pytest.raises(ImproperlyConfigured, match="'title'"):
            ShelfItem.objects.filter(pk=item.pk).fenced_update(lock, title="changed")
        row = ShelfItem.objects.get(pk=item.pk)
        assert (row.title, row.stock) == ("t", 3)  # nothing written
        held.fenced_save(lock, update_fields=["stock"])
        assert ShelfItem.objects.filter(pk=item.pk).fenced_update(lock, stock=1) == 1
    row = ShelfItem.objects.get(pk=item.pk)
    assert (row.title, row.stock, row.fence) == ("t", 1, lock.fence)


def test_fence_field_defaults_and_migration_shape() -> None:
    field = Product._meta.get_field("fence")
    assert isinstance(field, FenceField)
    assert field.default == 0 and field.editable is False
    _, path, args, kwargs = field.deconstruct()
    assert (path, args, kwargs) == ("django_redlock.models.FenceField", [], {})
    assert FenceField(default=5).deconstruct()[3] == {"default": 5}
    assert LockableModel._meta.abstract


# -- async ------------------------------------------------------------------------
@pytest.mark.django_db
def test_async_locked_and_fenced_save() -> None:
    if not hasattr(django_redlock.LockManager, "alock"):
        pytest.skip("LockManager.alock is not there yet")
    product = Product.objects.create(name="p", stock=1)

    async def run() -> int:
        async with Product.objects.alocked(pk=product.pk) as locked:
            locked.stock += 1
            await locked.afenced_save(locked.held_lock, update_fields=["stock"])
            return locked.held_lock.fence

    # async_to_sync: the ORM calls come back to this thread (its DB connection).
    fence = async_to_sync(run)()
    row = Product.objects.get(pk=product.pk)
    assert (row.stock, row.fence) == (2, fence)


@pytest.mark.django_db
def test_async_interleaving_alocked_then_afenced_save() -> None:
    product = Product.objects.create(name="p", stock=10)

    async def run() -> None:
        a_ctx = Product.objects.alocked(pk=product.pk, ttl=0.4, auto_renew=False)
        a = await a_ctx.__aenter__()
        assert a.fence == a.held_lock.fence
        deadline = time.monotonic() + 5
        while a.held_lock.owned() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        async with Product.objects.alocked(pk=product.pk, timeout=2) as b:
            a.stock -= 1
            with pytest.raises(FencedWriteRejected):
                await a.afenced_save(a.held_lock, update_fields=["stock"])
            b.stock -= 1
            await b.afenced_save(b.held_lock, update_fields=["stock"])
        with pytest.raises(LockLost):
            await a_ctx.__aexit__(None, None, None)

    async_to_sync(run)()
    assert Product.objects.get(pk=product.pk).stock == 9
