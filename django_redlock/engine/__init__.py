"""The lock engine: the lock's protocol, its two drivers, and what serves them.

``protocol`` writes every rule of a lock once (``LockBase``'s plans, no I/O);
``lock`` and ``aio`` run them from a thread and from a coroutine; ``rounds``
says what each round asks the nodes and what the replies mean; ``manager``
holds the nodes and makes every primitive; ``watchdog`` renews, ``held``
releases at exit; ``events`` holds the signals the locks send (re-exported by
``django_redlock.signals``); ``compose``, ``multilock``, ``segments`` and
``reentrant`` are the family members made of plain locks; ``inspection`` is the
operator's read model. See docs/architecture.rst.
"""
