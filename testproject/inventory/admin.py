from django.contrib import admin

from .models import Product, ProductSegment


class SegmentInline(admin.TabularInline):
    model = ProductSegment
    extra = 0
    readonly_fields = ("fence",)


@admin.register(Product)
class ProductAdmin(admin.ModelAdmin):
    list_display = ("sku", "name", "stock", "stripes", "fence")
    readonly_fields = ("fence",)
    search_fields = ("sku", "name")
    inlines = [SegmentInline]
