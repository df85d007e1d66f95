from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.db.backends.signals import connection_created


def _tune_sqlite(sender: Any, connection: Any, **kwargs: Any) -> None:
    """WAL + synchronous=NORMAL: readers never wait for the writer, commits skip fsync.

    Four gunicorn workers and the load command share one SQLite file; in the
    default rollback-journal mode every purchase would block every page view.
    """
    if connection.vendor != "sqlite" or not getattr(settings, "DEMO_SQLITE_WAL", False):
        return
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")


class InventoryConfig(AppConfig):
    name = "testproject.inventory"
    label = "inventory"
    verbose_name = "Inventory (django-redlock demo)"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        connection_created.connect(_tune_sqlite, dispatch_uid="inventory-sqlite-wal")
