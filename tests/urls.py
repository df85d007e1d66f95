from django.urls import include, path

urlpatterns: list = [path("", include("tests.testapp.urls"))]
