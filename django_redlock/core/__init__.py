"""The pure core of django-redlock: arithmetic and formats, no I/O.

Everything here is deterministic given its inputs (clocks and random sources are
passed in), so it is unit tested without Redis. The transports and the engine
build on it; nothing here imports Django or redis-py.
"""
