"""The fenced-write examples of the README and the docs, executed.

Every Python block of README.md and docs/ (all of them: tests/docsnippets.py
walks the pages) that writes a fenced row (``fenced_save``,
``fenced_update``, ``claim``, ``fence__...`` / ``fence=`` lookups, ``.update(``)
must be preceded by a marker (``.. snippet: NAME`` in reStructuredText,
``<!-- snippet: NAME -->`` in Markdown) and have a test below that runs it on the
test app's ``Product`` (standing in for the docs' ``Item``/``Product``) and checks
what it did. So an example cannot drift back to a pattern that loses updates
(``filter(fence__lt=F).update(stock=<a value read earlier>)``) unnoticed: a new
unmarked example fails :func:`test_every_fenced_example_is_executed`, and a
changed one fails its own test. Every other block has its test in
tests/test_doc_examples.py, which also checks that every block has one.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import pytest
from django.test import RequestFactory

import django_redlock
from django_redlock.exceptions import FencedWriteRejected, LockLost
from tests import docsnippets
from tests.testapp.models import Product

WRITES = re.compile(r"fenced_save|fenced_update|\.claim\(|claim_and_get|fence__|fence=|\.update\(|"
                    r"\.save\(")
#: ``filter(fence__lt=F).update(<anything but only the fence>)``: the pattern that loses updates.
BLIND = re.compile(r"fence__lt=[^)]*\)\s*\.update\(\s*(?!fence=[^,)]*\))")
#: A fenced write (``fenced_save``/``fenced_update`` and their async twins) ...
FENCED_WRITE = re.compile(r"fenced_save\(|fenced_update\(")
#: ... needs a claim in the same example, before the read: ``locked()``/``alocked()``,
#: ``claim_and_get()``, ``claim()`` or the plain ``update(fence=F)`` claim. A plain
#: ``get()`` then ``fenced_save()`` refuses the newer holder instead of the stale one.
CLAIM = re.compile(r"\.a?locked\(|claim_and_get\(|\.claim\(|\.update\(fence=")
#: The Python blocks of README.md and every page of docs/ (tests/docsnippets.py).
SNIPPETS = {name: block.code for name, block in docsnippets.SNIPPETS.items()}
_run = docsnippets.run


def test_every_fenced_example_is_executed() -> None:
    unmarked = []
    for block in docsnippets.python_blocks():
        code = block.code
        if WRITES.search(code) and block.marker is None:
            unmarked.append(f"{block.where}: {code.splitlines()[0]!r}...")
        assert not BLIND.search(code), (
            f"{block.where}: a write conditional only on 'fence < F' with values read earlier "
            f"loses updates; claim first:\n{code}")
        assert not FENCED_WRITE.search(code) or CLAIM.search(code), (
            f"{block.where}: a fenced write with no claim before the read; claim first "
            f"(locked(), claim_and_get(), claim()):\n{code}")
    assert not unmarked, "fenced examples without a snippet test:\n" + "\n".join(unmarked)
    # Every snippet has its test somewhere in tests/ (here or in test_doc_examples.py):
    # tests/test_doc_examples.py::test_every_python_block_is_marked_and_executed.
    tested = {name[len("test_snippet_"):].replace("_", "-") for name in globals()
              if name.startswith("test_snippet_")}
    assert tested <= set(SNIPPETS), tested - set(SNIPPETS)
    fenced = {name for name, code in SNIPPETS.items() if WRITES.search(code)}
    assert fenced <= set(docsnippets.tested_snippets()), fenced - set(docsnippets.tested_snippets())


def _row(stock: int = 10, pk: int | None = None, name: str = "p") -> Product:
    if pk is None:
        return Product.objects.create(name=name, stock=stock)
    return Product.objects.create(pk=pk, name=name, stock=stock)


@pytest.mark.django_db
def test_snippet_readme() -> None:
    _row(pk=42)
    ns = _run("readme")  # the module-level `with` block: one sale
    assert Product.objects.get(pk=42).stock == 9
    response = ns["reserve"](RequestFactory().post("/"), pk=42)
    assert response.status_code == 200 and Product.objects.get(pk=42).stock == 8
    assert Product.objects.get(pk=42).fence > 0


@pytest.mark.django_db
def test_snippet_index() -> None:
    _row(pk=42)
    _run("index")
    assert Product.objects.get(pk=42).stock == 9


@pytest.mark.django_db
def test_snippet_quickstart_helpers() -> None:
    pk = _row().pk
    _run("quickstart-helpers", pk=pk)
    assert Product.objects.get(pk=pk).stock == 9


@pytest.mark.django_db
def test_snippet_quickstart_plain() -> None:
    pk = _row().pk
    _run("quickstart-plain", pk=pk)
    row = Product.objects.get(pk=pk)
    assert row.stock == 9 and row.fence > 0
    # A holder whose claim a newer one overtook is refused, not written.
    Product.objects.filter(pk=pk).update(fence=2**62)
    with pytest.raises(FencedWriteRejected):
        _run("quickstart-plain", pk=pk)
    assert Product.objects.get(pk=pk).stock == 9


@pytest.mark.django_db
def test_the_quickstart_plain_snippet_refuses_a_write_after_a_newer_claim() -> None:
    """The worst schedule for the plain-ORM snippet: holder A claims and reads the
    row, pauses; B (a newer fence) claims, reads and sells; A wakes and writes.
    A's write is refused, and only B's sale is recorded."""
    from django.db.models import F

    pk = _row().pk

    class _Objects:
        filter = staticmethod(Product.objects.filter)

        @staticmethod
        def get(**kwargs: Any) -> Any:
            item = Product.objects.get(**kwargs)  # A has read the row ...
            newer = item.fence + 1                # ... and B claims it, reads and sells
            Product.objects.filter(pk=item.pk, fence__lt=newer).update(fence=newer)
            Product.objects.filter(pk=item.pk, fence=newer).update(stock=F("stock") - 1)
            return item

    class _Item:
        objects = _Objects

    with pytest.raises(FencedWriteRejected):
        _run("quickstart-plain", pk=pk, Item=_Item)
    assert Product.objects.get(pk=pk).stock == 9  # B's sale only: A's stale 9 never landed


@pytest.mark.django_db
def test_snippet_quickstart_long(settings: Any) -> None:
    """The long-running import commits while its lock is held, and a lock
    lost midway (its renewal finds it taken) rolls it back: LockLost, raised
    inside the transaction, which is inside the lock."""
    import time

    settings.REDLOCK = {**getattr(settings, "REDLOCK", {}), "TTL": 0.3}  # renewed every 0.1 s
    pk = _row(stock=0).pk

    def import_row(row: int) -> None:
        Product.objects.filter(pk=pk).update(stock=row)

    _run("quickstart-long", rows=[1, 2, 3], import_row=import_row)
    assert Product.objects.get(pk=pk).stock == 3

    def import_then_lose(row: int) -> None:
        Product.objects.filter(pk=pk).update(stock=100 + row)
        if row == 1:
            django_redlock.get_manager().force_release("import:feed-7")
            thief = django_redlock.get_manager().lock("import:feed-7", auto_renew=False)
            assert thief.acquire(timeout=0)  # another holder: ours is gone
            time.sleep(0.35)  # our renewal finds it taken: owned() turns False
            thief.release()

    with pytest.raises(LockLost):
        _run("quickstart-long", rows=[1, 2, 3], import_row=import_then_lose)
    assert Product.objects.get(pk=pk).stock == 3  # rolled back


@pytest.mark.django_db
def test_snippet_mistake_read_before_lock() -> None:
    """The page's first mistake does lose an update, as it says: another
    request sells between this one's read and its lock."""
    from django.db.models import F

    pk = _row(stock=5).pk

    class _Objects:
        @staticmethod
        def get(**kwargs: Any) -> Any:
            item = Product.objects.get(**kwargs)  # read 5, unprotected ...
            Product.objects.filter(pk=item.pk).update(stock=F("stock") - 1)  # another sells
            return item

    class _Item:
        objects = _Objects

    _run("mistake-read-before-lock", pk=pk, Product=_Item)
    assert Product.objects.get(pk=pk).stock == 4  # two sales, one recorded


@pytest.mark.django_db
def test_snippet_testing() -> None:
    item = _row()
    ns = _run("testing")
    ns["test_paused_holder_cannot_lose_an_update"](item)
    assert Product.objects.get(pk=item.pk).stock == 9


@pytest.mark.django_db
def test_snippet_howto_sell() -> None:
    pk = _row().pk
    ns = _run("howto-sell")
    ns["sell"](pk, 3)
    assert Product.objects.get(pk=pk).stock == 7
    with pytest.raises(ValueError, match="not enough"):
        ns["sell"](pk, 8)


@pytest.mark.django_db
def test_snippet_howto_story() -> None:
    _row(pk=1)
    ns: dict[str, Any] = {}
    with pytest.raises(FencedWriteRejected, match="newer lock holder"):
        _run("howto-story", ns)
    assert Product.objects.get(pk=1).stock == 9  # B's sale, once; A's refused
    assert ns["a"].fence == ns["lock_a"].fence < ns["b"].held_lock.fence
    with pytest.raises(LockLost):  # A's lease ran out during its "pause"
        ns["lock_a"].release()


@pytest.mark.django_db
def test_snippet_howto_claim_and_get() -> None:
    pk = _row().pk
    ns = _run("howto-claim-and-get")
    response = ns["buy"](RequestFactory().post("/"), pk=pk)
    assert response.status_code == 200 and Product.objects.get(pk=pk).stock == 9


@pytest.mark.django_db
def test_snippet_views_claim() -> None:
    pk = _row().pk
    ns = _run("views-claim", with_lock=django_redlock.with_lock)
    response = ns["buy"](RequestFactory().post("/"), pk=pk)
    assert response.status_code == 200 and Product.objects.get(pk=pk).stock == 9


@pytest.mark.django_db
def test_snippet_views_buy(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    from django_redlock.core.templates import parse_template

    # The model of the page: its rows' own lock name is the view's.
    monkeypatch.setattr(Product, "lock_name_template", "stock:<pk>", raising=False)
    monkeypatch.setattr(Product, "_redlock_template", parse_template("stock:<pk>"),
                        raising=False)
    pk = _row().pk
    ns = _run("views-buy")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the row's own lock name: no warning
        response = ns["buy"](RequestFactory().post("/"), pk=pk)
    assert response.status_code == 200 and Product.objects.get(pk=pk).stock == 9
    assert Product.objects.get(pk=pk).fence > 0  # claimed, then written with the fence


@pytest.mark.django_db
def test_snippet_howto_several() -> None:
    pks = [_row(stock=10 + i, name="w7").pk for i in range(3)]
    _row(stock=50, name="elsewhere")
    _run("howto-several")
    assert [Product.objects.get(pk=pk).stock for pk in pks] == [5, 5, 6]
    assert Product.objects.get(name="elsewhere").stock == 50


@pytest.mark.django_db
def test_snippet_howto_method() -> None:
    pk = _row().pk

    class LockableModel:  # the snippet's model body is "...": give it a row to stand for
        objects = Product.objects

        def __init__(self, pk: int) -> None:
            self.pk = pk

    ns = _run("howto-method", LockableModel=LockableModel)
    assert ns["Product"](pk).restock(5) == 15
    assert Product.objects.get(pk=pk).stock == 15


@pytest.mark.django_db
def test_snippet_celery_restock() -> None:
    pk = _row().pk
    ns = _run("celery-restock")
    ns["restock"](pk, 5)
    row = Product.objects.get(pk=pk)
    assert row.stock == 15 and row.fence > 0
    # A worker whose claim a newer holder overtook is refused, not written.
    Product.objects.filter(pk=pk).update(fence=2**62)
    with pytest.raises(FencedWriteRejected):
        ns["restock"](pk, 5)
    assert Product.objects.get(pk=pk).stock == 15


@pytest.mark.django_db
def test_snippet_async_views_buy() -> None:
    from asgiref.sync import async_to_sync

    pk = _row().pk
    ns = _run("async-views-buy")
    # async_to_sync: the ORM calls come back to this thread (its DB connection).
    response = async_to_sync(ns["buy"])(RequestFactory().post("/"), pk=pk)
    row = Product.objects.get(pk=pk)
    assert response.status_code == 200 and row.stock == 9 and row.fence > 0
    Product.objects.filter(pk=pk).update(fence=2**62)
    with pytest.raises(FencedWriteRejected):
        async_to_sync(ns["buy"])(RequestFactory().post("/"), pk=pk)
    assert Product.objects.get(pk=pk).stock == 9


@pytest.mark.django_db
def test_current_lock_docstring_example_claims_first() -> None:
    """The example in ``current_lock()``'s docstring, run as written."""
    from django_redlock import decorators

    doc = decorators.current_lock.__doc__ or ""
    code = textwrap.dedent(doc.split("::", 1)[1]).strip("\n")
    assert "claim_and_get" in code and not BLIND.search(code)
    ns: dict[str, Any] = {"with_lock": decorators.with_lock,
                          "current_lock": decorators.current_lock, "Product": Product}
    exec(compile(code, "<current_lock docstring>", "exec"), ns)  # noqa: S102 - our own code
    pk = _row().pk
    ns["restock"](pk, 2)
    assert Product.objects.get(pk=pk).stock == 12


def test_blind_pattern_is_recognised() -> None:
    """The guard itself: the old pattern is caught, the claim step is not."""
    assert BLIND.search("Item.objects.filter(pk=pk, fence__lt=held.fence).update(\n"
                        "    stock=new_stock, fence=held.fence)")
    assert BLIND.search("Item.objects.filter(pk=42, fence__lt=held.fence).update("
                        "stock=F('stock') - 1, fence=held.fence)")
    assert not BLIND.search("Item.objects.filter(pk=pk, fence__lt=held.fence)"
                            ".update(fence=held.fence)")
    unclaimed = ("product = Product.objects.get(pk=product_id)\n"
                 "product.fenced_save(current_lock(), update_fields=['stock'])")
    assert FENCED_WRITE.search(unclaimed) and not CLAIM.search(unclaimed)
    for claimed in ("Product.objects.claim_and_get(lock, pk=pk)", "Item.objects.locked(pk=pk)",
                    "Product.objects.alocked(pk=pk)", "rows.claim(lock)",
                    "filter(pk=pk, fence__lt=held.fence).update(fence=held.fence)"):
        assert CLAIM.search(claimed), claimed
