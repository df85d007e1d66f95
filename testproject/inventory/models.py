"""Products and their stock.

A product's stock lives either in its own row (``stripes == 0``), decremented under
the lock ``stock:<pk>``, or, for a hot item, in ``stripes`` :class:`ProductSegment`
rows, each under its own lock ``stock:<pk>[<i>]`` (segment ``i`` of
``segments("stock:<pk>", stripes)``), so that up to ``stripes``
purchases of the same product proceed at once (lock striping). Both kinds of row
carry a fence (:class:`~django_redlock.models.LockableModel`): every purchase
writes with ``fenced_save``, so a worker whose lease ran out cannot overwrite a
newer holder's write.
"""

from __future__ import annotations

from django.db import models, transaction
from django.db.models import Sum

from django_redlock.models import LockableModel


class Product(LockableModel):
    sku = models.CharField(max_length=32, unique=True)
    name = models.CharField(max_length=100)
    stock = models.PositiveIntegerField(
        default=0, help_text="Units on sale (unused when the stock is striped).")
    stripes = models.PositiveSmallIntegerField(
        default=0, help_text="0: the stock is in this row; K > 0: split over K segments, "
                             "each with its own lock.")

    #: The same name the decrement view's ``@with_lock("stock:<pk>")`` uses, so
    #: ``product.lock()`` and ``Product.objects.locked(pk=...)`` exclude it too.
    lock_name_template = "stock:<pk>"

    class Meta:
        ordering = ["pk"]

    def __str__(self) -> str:
        return f"{self.sku} ({self.name})"

    @property
    def striped(self) -> bool:
        return self.stripes > 0

    def available(self) -> int:
        """Units left: this row's stock, or the sum over the segments of a striped product."""
        if not self.striped:
            return self.stock
        return self.segments.aggregate(total=Sum("stock"))["total"] or 0

    def reset_stock(self, total: int, *, stripes: int | None = None) -> None:
        """Put ``total`` units on sale, split evenly over ``stripes`` segments (0: none).

        An operator's action, not a purchase: it writes without a lock (run it
        while nothing is buying) and leaves every fence where it was, so a late
        fenced write from before the reset is still refused.
        """
        if total < 0:
            raise ValueError("stock cannot be negative")
        stripes = self.stripes if stripes is None else stripes
        if stripes < 0:
            raise ValueError("stripes cannot be negative")
        with transaction.atomic():
            self.stripes = stripes
            self.stock = 0 if stripes else total
            self.save(update_fields=["stock", "stripes"])
            self.segments.filter(index__gte=stripes).delete()
            for index in range(stripes):
                share = total // stripes + (1 if index < total % stripes else 0)
                segment, created = ProductSegment.objects.get_or_create(
                    product=self, index=index, defaults={"stock": share})
                if not created:
                    segment.stock = share
                    segment.save(update_fields=["stock"])


class ProductSegment(LockableModel):
    """One stripe of a hot product's stock, locked on its own."""

    product = models.ForeignKey(Product, on_delete=models.CASCADE, related_name="segments")
    index = models.PositiveSmallIntegerField()
    stock = models.PositiveIntegerField(default=0)

    #: The lock of segment ``index`` of ``segments("stock:<product_id>", stripes)``
    #: (views.decrement_striped): the row and the segment share one lock name.
    lock_name_template = "stock:<product_id>[<index>]"

    class Meta:
        ordering = ["product", "index"]
        constraints = [
            models.UniqueConstraint(fields=["product", "index"], name="inventory_segment_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.product.sku} segment {self.index}"
