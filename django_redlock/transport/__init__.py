"""Transports: the thin layer that talks to the Redis nodes.

:mod:`.resp` packs commands and knows the scripts; :mod:`.sync` asks every node in
parallel from one thread; :mod:`.notify` delivers release notices to waiters.
The engine (``django_redlock.engine``: the rounds and the manager) decides what to ask; the
transport only asks it, within a deadline, and reports each node's answer or error.
"""
