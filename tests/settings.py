"""Settings for the test suite. REDLOCK_NODES is filled in by tests/conftest.py
with servers the suite starts itself on free loopback ports."""

import os

from tests.testapp.dburl import postgres_databases

SECRET_KEY = "tests-only-not-secret"
DEBUG = False
USE_TZ = True
ALLOWED_HOSTS = ["*"]
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_redlock",
    "tests.testapp",
    "testproject.inventory",  # the demo app (tests/test_demo.py)
]
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "tests.urls"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("REDLOCK_TEST_DB", "file:redlock-tests?mode=memory&cache=shared"),
    }
}
DATABASES.update(postgres_databases())  # alias "postgres" when DATABASE_URL is set
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
REDLOCK_NODES = ["redis://127.0.0.1:1/0"]  # replaced by the session fixture
REDLOCK = {"NODE_TIMEOUT": 0.5}
LOGGING_CONFIG = None
