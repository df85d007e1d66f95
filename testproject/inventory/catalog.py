"""The demo's products: a small catalogue for the browser, and one product per load mode.

Importable without Django set up (``testproject.demo`` reads the SKUs before any
Django process runs); the ORM is imported where it is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .models import Product


@dataclass(frozen=True)
class Mode:
    """One way of buying, with the product the load runs it against."""

    name: str
    sku: str
    title: str
    url_name: str
    striped: bool = False

    def product(self, *, stock: int, stripes: int) -> Product:
        """This mode's product with ``stock`` units on sale (created if missing)."""
        from .models import Product

        product, _ = Product.objects.get_or_create(sku=self.sku, defaults={"name": self.title})
        product.reset_stock(stock, stripes=stripes if self.striped else 0)
        return product

    def path(self, product: Product) -> str:
        from django.urls import reverse

        return reverse(f"inventory:{self.url_name}", args=[product.pk])


MODES: dict[str, Mode] = {
    "protected": Mode("protected", "DEMO-LOCKED", "Limited sneaker (with_lock)", "decrement"),
    "unprotected": Mode("unprotected", "DEMO-NOLOCK", "Limited sneaker (no lock)",
                        "decrement-unsafe"),
    "striped": Mode("striped", "DEMO-STRIPED", "Limited sneaker (striped locks)",
                    "decrement-striped", striped=True),
}

#: Products for clicking around in a browser: (sku, name, stock, stripes).
CATALOG = [
    ("TEA-001", "Green tea, 100 g", 25, 0),
    ("MUG-001", "Enamel mug", 10, 0),
    ("BAG-001", "Canvas tote bag", 40, 4),
]

#: The product the renewal showcase buys slowly (a purchase that outlives the TTL).
RENEWAL_SKU = "DEMO-SLOW"
