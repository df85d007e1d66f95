"""The demo project: an inventory shop whose stock decrement is guarded by django-redlock.

``python -m testproject.demo`` (``make demo``) runs it end to end; ``manage.py``
at the repository root uses ``testproject.settings``.
"""
