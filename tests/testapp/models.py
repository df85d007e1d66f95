"""Models of the test app: a LockableModel subclass and a plain counter row."""

from __future__ import annotations

from django.db import models

from django_redlock.decorators import with_lock
from django_redlock.models import LockableModel


class Product(LockableModel):
    name = models.CharField(max_length=50)
    stock = models.IntegerField(default=0)
    updated = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return self.name

    @with_lock("restock:<pk>", timeout=0.5)
    def restock(self, qty: int) -> int:
        """A model method under a lock: placeholders come from self."""
        fresh = type(self).objects.get(pk=self.pk)
        fresh.stock += qty
        fresh.save(update_fields=["stock"])
        self.stock = fresh.stock
        return fresh.stock


class GiftProduct(Product):
    """A child of multi-table inheritance: its fence is in Product's table,
    so its own claims and fenced writes are refused (models._claim_field)."""

    wrapping = models.CharField(max_length=20, default="plain")


class Catalogue(models.Model):
    """A concrete parent with no fence (for ShelfItem)."""

    title = models.CharField(max_length=50, default="")


class ShelfItem(LockableModel, Catalogue):
    """Its fence in its own table, its parent's fields in Catalogue's: a
    fenced write of those would not be one conditional statement
    (models._check_own_table)."""

    stock = models.IntegerField(default=0)


class SkuItem(LockableModel):
    """A LockableModel with its own lock name template."""

    sku = models.CharField(max_length=20, unique=True)
    qty = models.IntegerField(default=0)

    lock_name_template = "sku:<sku>"


class Counter(models.Model):
    """A row the concurrency tests read-modify-write without any atomicity."""

    name = models.CharField(max_length=50, unique=True)
    value = models.IntegerField(default=0)
