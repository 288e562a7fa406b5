"""`python -m benchmarks recovery --quick` runs end to end (a
functionality check; its numbers are not a measurement): the keys
docs/FAULT_TOLERANCE.md's figures come from, a targets table, and a figure.
Two replicas, the fewest the experiment takes (one killed, one going on):
each run starts one replica fewer than the published run's three."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib", reason="the benchmark suite needs matplotlib (the `bench` extra)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = ("kill_to_commit_s", "hang_detect_s", "heartbeat_timeout_s", "heal_s", "heal_bytes", "loopback_bytes_per_s",
        "steps_lost", "goodput_fraction", "restart_baseline_goodput_fraction")


def test_recovery_quick_writes_results(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "benchmarks", "recovery", "--quick", "--world-size", "2",
               "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr[-5000:]}"

    with open(tmp_path / "recovery.json") as f:
        result = json.load(f)
    missing = [k for k in KEYS if k not in result]
    assert not missing, missing
    assert result["steps_lost"] == 0
    assert result["fault_tolerant"]["kills"] == result["restart_baseline"]["kills"] == 1
    assert result["heal_bytes"] > 0 and result["heal_s"] > 0 and result["loopback_bytes_per_s"] > 0
    assert result["hang_detect_s"] >= result["heartbeat_timeout_s"] * 0.5
    for key in ("goodput_fraction", "restart_baseline_goodput_fraction"):
        assert 0 < result[key] < 2, (key, result[key])
    assert [t["target"].split()[0] for t in result["targets"]] == ["kill", "hung", "heal", "zero", "goodput"]
    assert "| target | measured | met | why |" in done.stdout
    assert (tmp_path / "recovery.png").stat().st_size > 0
