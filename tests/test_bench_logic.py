"""The pure logic of the benchmark's newer sections (issue 23): reading wrk's and
redis-benchmark's output, the sale check of the real-HTTP runs, and the ratios.

No timing here: benchmarks are not timed tests. The outputs below are real
ones (wrk 4.1.0 and redis-benchmark 7.0), shortened.
"""

from __future__ import annotations

import math

import pytest

from bench.distinct import benchmark_commands, pair_rate, parse_benchmark_csv
from bench.procs import counted_ratios
from bench.realhttp import parse_wrk, ratio, sale_check

WRK_WITH_SCRIPT = """\
Running 3s test @ http://127.0.0.1:40123/products/4/decrement/
  2 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    61.02ms   55.17ms 328.10ms   84.40%
    Req/Sec   102.51     30.12   171.00     68.33%
  Latency Distribution
     50%   53.81ms
     75%   81.20ms
     90%  120.44ms
     99%  328.10ms
  615 requests in 3.01s, 170.81KB read
  Socket errors: connect 0, read 3, write 0, timeout 1
  Non-2xx or 3xx responses: 7
Requests/sec:    204.32
Transfer/sec:     56.75KB
BENCH requests=615 s200=608 s409=5 s5xx=2 sother=0 p50_us=53807 p99_us=328097
"""

WRK_PLAIN = """\
Running 1s test @ http://127.0.0.1:18777/
  1 threads and 2 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     1.51ms    0.92ms   9.80ms   81.66%
    Req/Sec     1.31k   109.98     1.51k    72.73%
  Latency Distribution
     50%  812.00us
     75%    1.76ms
     90%    2.40ms
     99%    1.02s
  1437 requests in 1.10s, 5.05MB read
Requests/sec:   1305.93
Transfer/sec:      4.59MB
"""


def test_parse_wrk_prefers_the_scripts_line() -> None:
    out = parse_wrk(WRK_WITH_SCRIPT)
    assert out["rps"] == pytest.approx(204.32)
    assert out["requests"] == 615
    assert out["seconds"] == pytest.approx(3.01)
    assert (out["s200"], out["s409"], out["s5xx"], out["sother"]) == (608, 5, 2, 0)
    assert out["non_2xx"] == 7
    assert out["errors"] == {"connect": 0, "read": 3, "write": 0, "timeout": 1}
    # Whole microseconds from the script, not the rounded distribution lines.
    assert out["p50_us"] == 53807
    assert out["p99_us"] == 328097


def test_parse_wrk_without_the_script_reads_the_distribution_units() -> None:
    out = parse_wrk(WRK_PLAIN)
    assert out["rps"] == pytest.approx(1305.93)
    assert out["p50_us"] == pytest.approx(812.0)
    assert out["p99_us"] == pytest.approx(1_020_000.0)
    assert out["non_2xx"] == 0
    assert "s200" not in out
    assert sum(out["errors"].values()) == 0


def test_parse_wrk_refuses_output_without_a_rate() -> None:
    with pytest.raises(ValueError, match="Requests/sec"):
        parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n")


def test_sale_check() -> None:
    # Every 200 took a unit; 16 units went to requests in flight when wrk stopped.
    assert sale_check(1230, 1_000_000, 1_000_000 - 1246) == {
        "sold_db": 1246, "oversold": 0, "unanswered": 16}
    # Two customers told "bought" for one unit: a lost update.
    assert sale_check(10, 100, 92) == {"sold_db": 8, "oversold": 2, "unanswered": 0}


def test_ratio() -> None:
    assert ratio(303.0, 204.0) == pytest.approx(303 / 204)
    assert ratio(None, 204.0) is None
    assert ratio(303.0, 0.0) is None
    assert ratio(303.0, None) is None


BENCH_CSV = (
    '"test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms",'
    '"p99_latency_ms","max_latency_ms"\n'
    '"EVALSHA 5511 3 redlock:bench:dn:__rand_int__ {redlock:bench:dn:__rand_int__}:fence '
    '{redlock:bench:dn:__rand_int__}:waiters 0123 10000 {"host":"vm","pid":29236,'
    '"thread":"MainThread","since":1795587120.083,"n":1} 1 3600000 0 30000 ",'
    '"37037.04","0.190","0.032","0.183","0.327","0.871","1.119"\n')


def test_parse_benchmark_csv_reads_a_row_whose_name_has_quotes() -> None:
    assert parse_benchmark_csv(BENCH_CSV) == pytest.approx(37037.04)


def test_parse_benchmark_csv_refuses_an_error_reply() -> None:
    with pytest.raises(ValueError, match="error"):
        parse_benchmark_csv('"test","rps"\nError from server: NOSCRIPT No matching script.\n')
    with pytest.raises(ValueError, match="no result"):
        parse_benchmark_csv('"test","rps","avg_latency_ms"\n')


def test_pair_rate() -> None:
    # 1/(1/60,000 + 1/120,000): one acquire and one release each 1/40,000 s.
    assert pair_rate(60_000.0, 120_000.0) == pytest.approx(40_000.0)
    assert pair_rate(0.0, 120_000.0) == 0.0


def test_benchmark_commands_are_the_locks_own_calls() -> None:
    from django_redlock.engine import rounds

    acquire, release = benchmark_commands()
    assert acquire[:3] == ["EVALSHA", rounds.ACQUIRE.sha.decode(), "3"]
    assert release[:3] == ["EVALSHA", rounds.RELEASE.sha.decode(), "3"]
    for args in (acquire, release):
        assert args[3] == "redlock:bench:dn:__rand_int__"
        assert args[4] == "{redlock:bench:dn:__rand_int__}:fence"
    # Fencing on, and the counter's grace the lock sends (an hour).
    assert acquire[9] == "1" and acquire[10] == str(rounds.FENCE_GRACE_MS)


def test_counted_ratios_within_a_round() -> None:
    res = {"drl-renew-1": {"acq_s": 2400.0, "seconds": 0.5},
           "prl-1": {"acq_s": 1600.0, "seconds": 0.75},
           "drl-renew-5": {"acq_s": 800.0, "seconds": 1.5},
           "pottery-5": {"acq_s": 200.0, "seconds": 6.0}}
    counted_ratios(res)
    assert res["drl-renew-1"]["x_prl"] == pytest.approx(1.5)
    assert res["drl-renew-1"]["time_x_prl"] == pytest.approx(0.5 / 0.75)
    assert res["drl-renew-5"]["x_pottery"] == pytest.approx(4.0)
    assert res["drl-renew-5"]["time_x_pottery"] == pytest.approx(0.25)
    assert "x_prl" not in res["prl-1"]


def test_counted_ratios_skip_a_failed_peer() -> None:
    res = {"drl-renew-1": {"acq_s": 2400.0, "seconds": 0.5}, "prl-1": {"error": "boom"}}
    counted_ratios(res)
    assert "x_prl" not in res["drl-renew-1"]
    assert not math.isnan(res["drl-renew-1"]["acq_s"])


def test_the_docs_bench_commands_name_real_sections() -> None:
    """Every ``python -m bench`` line of the performance page parses, and each
    section it names exists (a renamed section would leave the docs behind)."""
    import re
    import shlex
    from pathlib import Path

    from bench.__main__ import SECTIONS, parse_args

    page = (Path(__file__).resolve().parent.parent / "docs" / "performance.rst").read_text(
        encoding="utf-8")
    lines = re.findall(r"^\s*\$ python -m bench( .*)?$", page, re.MULTILINE)
    assert len(lines) >= 3
    named = set()
    for tail in lines:
        args = parse_args(shlex.split((tail or "").split("#")[0]))
        named.update(s for s in args.only.split(",") if s)
    assert {"http", "distinct", "contended2"} <= named
    assert named <= set(SECTIONS)


def test_http_section_without_wrk_is_skipped_with_a_message(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    import random

    from bench import realhttp

    monkeypatch.setattr(realhttp.shutil, "which", lambda name: None)
    section = realhttp.RealHttp(quick=True)  # starts nothing without wrk
    section.run_round(random.Random(1))
    section.close()
    summary = section.summary()
    assert "apt-get install wrk" in summary["skipped"]
    assert set(summary) == {"skipped"}


def _results(**sections: object) -> dict:
    from bench import report

    results = {"machine": {"date": "d", "nproc": 2, "cpu": "c", "os": "o", "python": "p",
                           "server": "s", "loadavg_start": [0], "loadavg_end": [0],
                           "packages": {k: "1" for k in ("redis", "hiredis",
                                                         "python-redis-lock", "pottery",
                                                         "Django")}},
               "config": {"rounds": 1, "quick": True, "elapsed_s": 1.0}, **sections}
    results["goals"] = report.evaluate(results)
    return results


HTTP_ROW = {"endpoint": "protected", "node_killed": False, "rounds": 1, "rps": 300.0,
            "p50_us": 45000.0, "p99_us": 75000.0, "s200": 900, "s409": 0, "s5xx": 0,
            "sother": 0, "sold_db": 916, "oversold": 0, "unanswered": 16, "socket_errors": 0}


def test_report_renders_the_new_sections_and_their_goals() -> None:
    from bench import report

    results = _results(
        http={"rows": {"protected": HTTP_ROW,
                       "protected-killed": {**HTTP_ROW, "node_killed": True, "x_up": 0.9,
                                            "oversold": 2}},
              "seconds_per_run": 3.0, "connections": 16, "gunicorn_workers": 4, "nodes": 3,
              "stripes": 8},
        contended2={"target": 1000, "rows": {
            "drl-renew-1": {"label": "django-redlock", "nodes": 1, "rounds": 1,
                            "seconds": 0.4, "acq_s": 2500.0, "fairness": 0.9, "x_prl": 1.3,
                            "time_x_prl": 0.77, "per_worker_last": [250, 250, 250, 250],
                            "counter_exact": True, "errors": 0}}},
        distinct={"rows": {"8": {"processes": 8, "acq_s": 7000.0, "x_ceiling": 0.2,
                                 "server_us_per_pair": 15.0}},
                  "ceiling": {"acquire_rps": 55000.0, "release_rps": 100000.0,
                              "pair_s": 35000.0, "server_time_pair_s": 60000.0},
                  "memory": {"names": 2000, "grace_ms": 2000, "keys_after_use": 2000,
                             "keys_after_expiry": 0, "fence_key_bytes": 72,
                             "bytes_per_name_used": 143.0, "bytes_per_name_expired": 17.0},
                  "errors": 0, "seconds": 1.0})
    goals = {g["goal"]: g for g in results["goals"]}
    assert goals["http-oversold"]["value"] == 2 and goals["http-oversold"]["status"] == "MISS"
    assert goals["contended2-1"]["status"] == "PASS"
    assert goals["contended2-5"]["status"] == "n/a"
    text = report.markdown(results)
    assert "| protected | yes | 300 | 0.90x every node up | 45.00 | 75.00 |" in text
    assert "1.30x python-redis-lock (time 0.77x)" in text
    assert "| 143.0 | 2000 | 72 | 17.0 | 0 |" in text
    assert report.rst(results).count(".. list-table::") == len(report.tables(results))


def test_report_shows_a_skipped_http_section() -> None:
    from bench import report

    results = _results(http={"skipped": "wrk is not installed"})
    assert {g["goal"]: g for g in results["goals"]}["http-oversold"]["status"] == "n/a"
    assert "| wrk is not installed |" in report.markdown(results)


def test_the_failover_goal_is_judged_on_the_worst_kill() -> None:
    """Several kills per run: each one a row, and the goal on the worst, so a
    good median cannot hide one failover that kept the lock for a lease."""
    from bench import report

    samples = [{"sentinel_failover_s": 2.0, "lock_back_s": b, "x_sentinel": b / 2.0}
               for b in (2.5, 2.4, 4.6)]
    results = _results(nodekinds={"failover": {
        "samples": samples, "sentinel_failover_s": 2.0, "lock_back_s": 2.5,
        "x_sentinel": 1.25, "x_sentinel_max": 2.3}})
    goal = next(g for g in results["goals"] if g["goal"] == "kinds-failover")
    assert goal["value"] == 2.3 and goal["status"] == "MISS"
    text = report.markdown(results)
    assert "| kill 3 | 2.00 | 4.60 | 2.30 |" in text
    assert "| median | 2.00 | 2.50 | 1.25 |" in text
