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
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.admin",  # the "Locks" admin page (tests/test_admin_locks.py)
    "django_redlock",
    "tests.testapp",
    "testproject.inventory",  # the demo app (tests/test_demo.py)
]
MIDDLEWARE: list[str] = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
STATIC_URL = "/static/"
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
ROOT_URLCONF = "tests.urls"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("REDLOCK_TEST_DB", "file:redlock-tests?mode=memory&cache=shared"),
    },
    # A second database for the primary/replica router tests (test_models.py);
    # created only for the tests that ask for it.
    "replica": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": "file:redlock-tests-replica?mode=memory&cache=shared",
    },
}
DATABASES.update(postgres_databases())  # alias "postgres" when DATABASE_URL is set
if "postgres" in DATABASES:
    # A test database of this run's own: two runs at once against one server (CI
    # runs the suite on two Pythons side by side) would drop each other's
    # "test_postgres". Set in the environment, so the processes a test starts
    # name the same one.
    os.environ.setdefault("REDLOCK_TEST_PG_NAME", f"test_redlock_{os.getpid()}")
    DATABASES["postgres"]["TEST"] = {"NAME": os.environ["REDLOCK_TEST_PG_NAME"]}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
REDLOCK_NODES = ["redis://127.0.0.1:1/0"]  # replaced by the session fixture
REDLOCK = {"NODE_TIMEOUT": 0.5}
LOGGING_CONFIG = None

try:  # in the test extra: the django_redlock.panels.LocksPanel tests (tests/test_panels.py)
    import debug_toolbar  # noqa: F401
except ImportError:  # pragma: no cover
    pass
else:
    INSTALLED_APPS.append("debug_toolbar")
    # The middleware is added by the panel tests only; never in other tests.
    DEBUG_TOOLBAR_CONFIG = {"IS_RUNNING_TESTS": False}
