from django.urls import path

from . import views

urlpatterns = [
    path("counter/<str:name>/incr/", views.counter_incr),
    path("busy/<str:name>/", views.busy),
    path("busy-custom/<str:name>/", views.busy_custom),
    path("per-user/", views.per_user),
    path("per-day/", views.per_day),
    path("per-query/", views.per_query),
    path("async/per-query/", views.aper_query),
    path("broken/<int:pk>/", views.broken),
    path("product/<int:pk>/atomic-restock/", views.atomic_restock),
    path("slow/<str:name>/", views.slow),
    path("cbv/<str:name>/", views.CounterView.as_view()),
    path("cbv-method/<str:name>/", views.MethodLockedView.as_view()),
    path("async/counter/<str:name>/", views.acounter),
    path("async/counter-unlocked/<str:name>/", views.acounter_unlocked),
    path("async/busy/<str:name>/", views.abusy),
    path("async/cbv/<str:name>/", views.AsyncCounterView.as_view()),
    path("async/cbv-method/<str:name>/", views.AsyncMethodView.as_view()),
]
