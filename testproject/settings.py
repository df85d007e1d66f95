"""Settings of the demo project (``testproject``).

Everything a run may want to change comes from the environment, so the same
module serves ``manage.py``, gunicorn workers and ``python -m testproject.demo``:

``REDLOCK_NODES``
    comma-separated Redis URLs (default: three local nodes on 6379-6381; the demo
    starts its own on free ports and passes them here).
``DEMO_DB``
    the SQLite file (default: ``<tmp>/django-redlock-demo/demo.sqlite3``).
``DEMO_LOCK_TTL``
    the lock lease in seconds (default 10).
``DEMO_DELAY``
    extra seconds spent inside the protected critical section of every purchase
    (default 0). Set it above ``DEMO_LOCK_TTL`` to watch the renewal keep the lock.
``DEMO_WORK``
    seconds of simulated work (a payment call, say) in every purchase, with the
    lock held for the protected and striped purchases, and between the read and
    the write of the unprotected one (default 0.05). It is what makes the race
    real and the striping gain visible.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _float_env(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        return float(raw) if raw.strip() else default
    except ValueError:
        return default


BASE_DIR = Path(__file__).resolve().parent
VAR_DIR = Path(os.environ.get("DEMO_VAR_DIR") or Path(tempfile.gettempdir()) / "django-redlock-demo")

SECRET_KEY = os.environ.get("DEMO_SECRET_KEY", "demo-only-not-secret-do-not-deploy")
DEBUG = os.environ.get("DEMO_DEBUG", "") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]", "testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_redlock",
    "testproject.inventory",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "testproject.urls"
WSGI_APPLICATION = "testproject.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("DEMO_DB") or str(VAR_DIR / "demo.sqlite3"),
        # Several gunicorn workers write one file: wait for SQLite's write lock
        # rather than failing with "database is locked".
        "OPTIONS": {"timeout": 30},
    }
}
#: WAL journal + synchronous=NORMAL on every connection (testproject.inventory.apps):
#: readers do not block the writer, and a purchase's UPDATE costs no fsync.
DEMO_SQLITE_WAL = True

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "/static/"

REDLOCK_NODES = [
    url.strip()
    for url in os.environ.get(
        "REDLOCK_NODES",
        "redis://127.0.0.1:6379/0,redis://127.0.0.1:6380/0,redis://127.0.0.1:6381/0",
    ).split(",")
    if url.strip()
]
_LOCK_TTL = _float_env("DEMO_LOCK_TTL", 10.0)
REDLOCK = {
    "TTL": _LOCK_TTL,
    # 32 clients and 4 workers share two cores in the demo: a node answering in
    # 100 ms is busy, not down. At most a tenth of the TTL (check redlock.W002),
    # so a slow round cannot eat the lease.
    "NODE_TIMEOUT": _float_env("DEMO_NODE_TIMEOUT", min(0.5, _LOCK_TTL / 10)),
}

DEMO_DELAY = _float_env("DEMO_DELAY", 0.0)
DEMO_WORK = _float_env("DEMO_WORK", 0.05)
#: A purchase may ask for its own delay (POST field ``delay``, at most
#: DEMO_MAX_DELAY seconds): the demo uses it to show one slow purchase outliving
#: the TTL without restarting the server. A demo-only knob: keep it off elsewhere.
DEMO_ALLOW_DELAY_PARAM = True
DEMO_MAX_DELAY = 10.0

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "django_redlock": {"handlers": ["console"], "level": "WARNING"},
    },
}
