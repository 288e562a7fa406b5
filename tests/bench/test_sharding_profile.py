"""`python -m benchmarks.sharding_profile` runs end to end on the loopback
and accounts for the iteration: the time with a collective in flight is
part of it, and covers each kind's own. Its interval arithmetic is
unit-tested. It times nothing that is asserted against a figure."""

import json
import os
import subprocess
import sys

from benchmarks.sharding_profile import busy_ns

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = {"forward_ms", "backward_ms", "step_ms", "iteration_ms", "reduce_scatter_busy_ms", "all_gather_busy_ms",
        "comm_busy_ms", "first_gather_ms", "idle_ms", "link_ms_per_phase"}


def test_busy_time_is_the_union_of_the_intervals_within_the_window():
    assert busy_ns([(0, 10), (5, 15), (20, 30)], 0, 25) == 20
    assert busy_ns([(-5, 3), (2, 4)], 0, 100) == 4  # clipped at the window's start
    assert busy_ns([(1, 2)], 5, 9) == 0
    assert busy_ns([(0, 100), (10, 20)], 0, 50) == 50  # one inside another


def test_profile_runs_on_the_loopback():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "benchmarks.sharding_profile", "--link-gbit", "0", "--per-host", "1",
               "--steps", "3"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["ranks"] for r in rows] == ["rank 0", "rank 1", "all ranks (median)"], done.stdout
    for r in rows:
        assert KEYS <= set(r), r
        assert r["link_ms_per_phase"] == 0  # the loopback: no bound
        assert r["all_gather_busy_ms"] > 0 and r["reduce_scatter_busy_ms"] > 0, r  # the MLP's buckets are sharded
        assert r["first_gather_ms"] is not None and r["first_gather_ms"] > 0, r
        slack = 0.02  # rounding to 2 decimals
        assert r["comm_busy_ms"] <= r["iteration_ms"] + slack, r
        assert r["comm_busy_ms"] + slack >= max(r["reduce_scatter_busy_ms"], r["all_gather_busy_ms"]), r
