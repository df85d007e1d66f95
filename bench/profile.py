"""``python -m bench.profile``: where django-redlock's uncontended acquire + release goes.

Runs ``--ops`` acquire + release cycles on 1 node and on 5 nodes (nodes started
here, as in the benchmark) under cProfile, and prints the top functions by own
time and by cumulative time. ``--pyinstrument`` prints pyinstrument's call tree
instead (``pip install pyinstrument``). ``--renew`` turns auto_renew on.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

from .libs import DjangoRedlock
from .nodes import running_nodes


def _profile(lib: DjangoRedlock, ops: int, use_pyinstrument: bool, top: int) -> str:
    op = lib.make_op("bench:profile")
    for _ in range(200):
        op()
    t = time.perf_counter()
    for _ in range(ops):
        op()
    plain_us = (time.perf_counter() - t) / ops * 1e6
    header = f"{ops} ops, {plain_us:.0f} µs per acquire + release without the profiler\n"
    if use_pyinstrument:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0001)
        profiler.start()
        for _ in range(ops):
            op()
        profiler.stop()
        return header + profiler.output_text(unicode=True, color=False, show_all=False)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(ops):
        op()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return header + out.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=3000)
    p.add_argument("--nodes", default="1,5", help="node counts to profile (default 1,5)")
    p.add_argument("--renew", action="store_true", help="auto_renew on")
    p.add_argument("--pyinstrument", action="store_true", help="pyinstrument call tree")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    for n in [int(x) for x in args.nodes.split(",")]:
        with running_nodes(n) as urls:
            lib = DjangoRedlock(urls, auto_renew=args.renew)
            try:
                print(f"=== django-redlock, {n} node(s), auto_renew {'on' if args.renew else 'off'}")
                print(_profile(lib, args.ops, args.pyinstrument, args.top))
            finally:
                lib.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
