"""Quorum and validity arithmetic of the Redlock algorithm.

Integer arithmetic on purpose: redlock-py's ``len(nodes) / 2 + 1`` is a float and
silently demands 3 of 3 nodes.
"""

from __future__ import annotations

#: Extra drift allowance in seconds, on top of ``ttl * drift_factor``: the Redis
#: expiry resolution (1 ms) plus a margin for the time between the script and the
#: reply leaving the server.
DRIFT_MARGIN = 0.002


def quorum(n_nodes: int) -> int:
    """How many nodes must agree: a strict majority, ``N // 2 + 1``."""
    if n_nodes < 1:
        raise ValueError("a lock manager needs at least one node")
    return n_nodes // 2 + 1


def max_failures(n_nodes: int) -> int:
    """How many nodes may fail while a quorum remains."""
    return n_nodes - quorum(n_nodes)


def drift(ttl: float, drift_factor: float) -> float:
    """Clock drift allowance for a lease of ``ttl`` seconds."""
    return ttl * drift_factor + DRIFT_MARGIN


def validity(ttl: float, elapsed: float, drift_factor: float) -> float:
    """Seconds of lease left after an acquire or extend round that took ``elapsed``.

    The lease started, at the latest, when the request left: the nodes set their
    expiry after that, so counting from the start of the round is conservative.
    A result <= 0 means the lock must not be used even if a quorum said yes.
    """
    return ttl - elapsed - drift(ttl, drift_factor)


def handover_validity(ttl: float, since_asked: float, server_gap_ms: int,
                      drift_factor: float) -> float:
    """Seconds of lease left on the node whose release handed a waiter the lock.

    The waiter sent no request of its own for it, so "elapsed since the request
    left" must be bounded another way. Its last refused attempt left
    ``since_asked`` seconds ago and the node read its clock (ms) while queueing
    it; the hand-over happened ``server_gap_ms`` later on that same clock. So the
    lease started at least ``(server_gap_ms - 1) / 1000 * (1 - drift_factor)``
    seconds after the attempt left (1 ms for the clock's resolution, the factor
    for the two clocks' rates): the time since then is what counts as elapsed.
    It assumes what Redlock already assumes (clocks whose *rates* differ by at
    most the drift factor); the node's own key expiry reads the same clock.
    A result <= 0 means the lock must not be used as handed over.
    """
    gap = max(0, server_gap_ms - 1) / 1000.0 * (1.0 - drift_factor)
    # Never less than nothing elapsed: a node clock that stepped forward between
    # the two readings made a 10 s lease look like 14.35 s.
    return validity(ttl, max(0.0, since_asked - gap), drift_factor)


def has_quorum(successes: int, n_nodes: int) -> bool:
    return successes >= quorum(n_nodes)


def quorum_reachable(answered: int, n_nodes: int) -> bool:
    """Whether enough nodes answered (yes or busy) for a quorum to be possible."""
    return answered >= quorum(n_nodes)
