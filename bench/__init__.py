"""Benchmarks of django-redlock against the floors and the peers (issue 7).

``python -m bench`` (or ``make bench``) starts its own Redis nodes on loopback (1 and
5), runs every measurement interleaved round by round, and writes
``bench/results/results.{md,json,rst}``. ``python -m bench --quick`` is a short run
(under a minute); ``python -m bench.profile`` profiles django-redlock's hot path.

Why rounds: the machine is shared and noisy. Each round measures every library and
the floors back to back, in a shuffled order, so a burst of load from elsewhere
hits all of them alike; ratios are taken inside a round, then the median over
rounds is reported.
"""
