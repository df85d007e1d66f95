"""Keep node passwords off Django's debug page and error e-mails.

Django's technical 500 page (``DEBUG = True``) and the error reports mailed to
``ADMINS`` list every setting and every frame's local variables. Its
:class:`~django.views.debug.SafeExceptionReporterFilter` hides a setting only
by *name* (``API``, ``KEY``, ``PASS``, ``SECRET``, ``SIGNATURE``, ``TOKEN``), so
``REDLOCK_NODES = ["redis://:s3cret@10.0.0.1:6379/0"]`` is shown as written, and
so is a ``CACHES`` ``LOCATION`` with a password. Set::

    DEFAULT_EXCEPTION_REPORTER_FILTER = "django_redlock.debug.RedlockExceptionReporterFilter"

and every string that carries URL credentials (``user:password@`` before a
host, or ``password=`` in a query), in any setting and in any frame's locals,
is shown with the password replaced by ``***``
(:func:`django_redlock.core.config.mask_url`). Everything Django's own filter
hides stays hidden.

django-redlock's own objects need no filter: node specs and connection
options show a password as ``'***'`` in their ``repr()``
(:class:`~django_redlock.core.config.Secret`).
"""

from __future__ import annotations

import re
from typing import Any

from django.views.debug import SafeExceptionReporterFilter

from .core.config import Secret, mask_url

#: Text that may hold a password: "...:...@" (URL credentials, even with a
#: mistyped or missing scheme) or "password=" (a URL query). Prose, whose first
#: word is followed by a space before any ":", is left alone.
_CREDENTIALS = re.compile(r"^\s*[^\s@]*:[^@]*@|password=", re.IGNORECASE)
#: Dict keys whose values are hidden whatever they hold (a node's
#: ``OPTIONS["password"]`` in a frame's copy of ``REDLOCK_NODES``).
_SECRET_KEYS = re.compile(r"PASS|SECRET|TOKEN", re.IGNORECASE)
#: How deep into nested lists, tuples and dicts a frame variable is masked.
_MAX_DEPTH = 8


def mask_credentials(value: Any, *, every: bool = False, _depth: int = 0) -> Any:
    """``value`` with the password of every URL string in it masked.

    Strings, and lists, tuples and dicts of them (rebuilt, never changed in
    place; a dict value under a key like ``password`` becomes ``"***"``); any
    other object is returned as it is. ``every``: pass every
    string through :func:`~django_redlock.core.config.mask_url`, not only those
    that look like credentials (for ``REDLOCK_NODES``, where every string is a
    node).
    """
    if isinstance(value, Secret):
        return value  # its repr() is already '***'
    if isinstance(value, str):
        return mask_url(value) if every or _CREDENTIALS.search(value) else value
    if _depth >= _MAX_DEPTH:
        return value
    if type(value) is list:
        return [mask_credentials(v, every=every, _depth=_depth + 1) for v in value]
    if type(value) is tuple:
        return tuple(mask_credentials(v, every=every, _depth=_depth + 1) for v in value)
    if type(value) is dict:
        return {k: "***" if isinstance(k, str) and _SECRET_KEYS.search(k) and v
                else mask_credentials(v, every=every, _depth=_depth + 1)
                for k, v in value.items()}
    return value


class RedlockExceptionReporterFilter(SafeExceptionReporterFilter):
    """Django's filter, plus URL passwords masked in settings and frame locals."""

    def cleanse_setting(self, key: Any, value: Any) -> Any:
        # Django recurses into dicts, lists and tuples through this same method,
        # so each string is masked where it stands.
        if key == "REDLOCK_NODES":
            value = mask_credentials(value, every=True)
        cleansed = super().cleanse_setting(key, value)
        return mask_credentials(cleansed) if isinstance(cleansed, str) else cleansed

    def get_traceback_frame_variables(self, request: Any, tb_frame: Any) -> Any:
        return [(name, mask_credentials(value))
                for name, value in super().get_traceback_frame_variables(request, tb_frame)]
