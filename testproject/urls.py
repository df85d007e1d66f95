"""URLs of the demo project: the shop at ``/``, the admin at ``/admin/`` (when installed)."""

from django.apps import apps
from django.urls import include, path

urlpatterns = [
    path("", include("testproject.inventory.urls")),
]

if apps.is_installed("django.contrib.admin"):  # the test suite mounts the shop without it
    from django.contrib import admin

    urlpatterns.insert(0, path("admin/", admin.site.urls))
