"""A Jepsen-style chaos run for django-redlock: workers, a nemesis, a history checker.

``python -m tests.chaos --duration 60`` (``make chaos``) starts 5 Redis nodes,
each behind a :class:`~django_redlock.testing.FaultProxy`, worker processes that
do locked read-modify-writes on database rows and Redis counters through the
public API, and a seeded nemesis that kills, pauses, slows, cuts and
clock-shifts nodes and SIGSTOPs workers past their lease. The checker then
reads the clients' history and the resources' own logs. See
``docs/reliability.rst`` for the figures and how to reproduce a run.

Modules: :mod:`.nemesis` (the fault schedule), :mod:`.workers` (the client
processes), :mod:`.history` (the records), :mod:`.checker` (the verdicts),
:mod:`.resources` (the protected resources) and :mod:`.runner` (wiring it up).
"""
