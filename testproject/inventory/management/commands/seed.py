"""``manage.py seed``: the demo catalogue plus one product per load mode."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from ...catalog import CATALOG, MODES, RENEWAL_SKU
from ...models import Product


class Command(BaseCommand):
    help = "Create (or reset) the demo products: a small catalogue and one product per load mode."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--stock", type=int, default=200,
                            help="units of each load-mode product (default 200)")
        parser.add_argument("--stripes", type=int, default=8,
                            help="segments of the striped product (default 8)")
        parser.add_argument("--json", action="store_true",
                            help="print {sku: pk} of every product as one JSON line")

    def handle(self, *args: Any, **options: Any) -> None:
        for sku, name, stock, stripes in CATALOG:
            product, _ = Product.objects.get_or_create(sku=sku, defaults={"name": name})
            product.reset_stock(stock, stripes=stripes)
        for mode in MODES.values():
            mode.product(stock=options["stock"], stripes=options["stripes"])
        slow, _ = Product.objects.get_or_create(
            sku=RENEWAL_SKU, defaults={"name": "Hand-made watch (slow checkout)"})
        slow.reset_stock(10, stripes=0)
        if options["json"]:
            self.stdout.write(json.dumps(dict(Product.objects.values_list("sku", "pk"))))
        else:
            self.stdout.write(f"seeded {Product.objects.count()} products")
