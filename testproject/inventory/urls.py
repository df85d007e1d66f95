from django.urls import path

from . import views

app_name = "inventory"

urlpatterns = [
    path("", views.product_list, name="list"),
    path("health/", views.health, name="health"),
    path("products/<int:pk>/", views.product_detail, name="detail"),
    path("products/<int:pk>/decrement/", views.decrement, name="decrement"),
    path("products/<int:pk>/decrement-unsafe/", views.decrement_unsafe, name="decrement-unsafe"),
    path("products/<int:pk>/decrement-striped/", views.decrement_striped,
         name="decrement-striped"),
]
