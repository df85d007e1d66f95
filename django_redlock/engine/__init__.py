"""The lock engine: primitives, their protocols and their drivers.

The lock family's members that are made of plain locks (``multi_lock``,
``segments``, reentrant holds) live here, one module each; their protocol is
written once (:mod:`.compose`) and run by a sync and an asyncio driver.
"""
