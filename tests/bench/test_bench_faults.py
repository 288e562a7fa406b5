"""`python -m benchmarks faults` runs end to end (a functionality check;
its numbers are not a measurement), and its error summary is stable."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib", reason="the benchmark suite needs matplotlib (the `bench` extra)")

from benchmarks.experiments.faults import error_kind  # noqa: E402
from benchmarks.workloads.fault_injection import FAULTS, WRAPPERS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_error_kind_drops_paths_and_addresses():
    line = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:59583. This is typically caused by a remote worker crashing.")
    assert error_kind(line) == "Connection closed by peer [peer]"
    assert error_kind("plain message") == "plain message"


def test_faults_writes_results(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "benchmarks", "faults", "--quick", "--blocks", "1",
               "--soak-iterations", "60", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr[-5000:]}"
    # The ranks that raise on purpose report their tracebacks in the result, not on the console.
    assert "Traceback" not in done.stderr, done.stderr[-5000:]

    with open(tmp_path / "faults.json") as f:
        result = json.load(f)
    assert set(result["faults"]) == set(FAULTS)
    for fault, by_wrapper in result["faults"].items():
        assert set(by_wrapper) == set(WRAPPERS)
        for wrapper, summary in by_wrapper.items():
            what = f"{fault}, {wrapper}: {summary}"
            assert summary["runs"] == 1 and summary["survivors_raised"] == 1, what
            assert summary["runs_with_problems"] == 0, what
            assert 0 < summary["median_s"] <= summary["max_s"] < result["pg_timeout_s"], what
    for wrapper, soak in result["soak"].items():
        assert soak["iterations"] == 60
        assert [r["rank"] for r in soak["ranks"]] == [0, 1]
        assert all(r["rss_start_mib"] > 0 and "rss_slope_kib_per_100" in r for r in soak["ranks"]), soak
    assert (tmp_path / "faults.png").stat().st_size > 0
    assert "| kill_backward | ddp_ext |" in done.stdout
