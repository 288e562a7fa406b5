"""`python -m benchmarks overlap` runs end to end (a functionality check; it times nothing).

A --quick run on BERT (whose dropout draws random numbers) and the scaleout MLP at 2 ranks, with 1 MiB buckets so that the
overlapped optimizer steps several buckets in the backward, must write a
summary with every variant's medians and phases, both ratios and a passed
bitwise check; the same with --link 1gbit, each rank a host of its own
(where network namespaces can be made); and the check itself must see a
one-ulp difference and fail the run on it.
"""

import json
import os
import subprocess
import sys

import argparse

import pytest
import torch
from torch import nn

pytest.importorskip("matplotlib", reason="the benchmark suite needs matplotlib (the `bench` extra)")

from benchmarks.__main__ import _link_gbit  # noqa: E402
from benchmarks.experiments import overlap  # noqa: E402
from benchmarks.harness import fake_hosts as hosts  # noqa: E402
from benchmarks.reporting import results  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _quick_overlap(tmp_path, *extra, models=("mlp",)):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "benchmarks", "overlap", "--quick", "--models", *models, "--bucket-cap-mb", "1",
               "--world-size", "2", "--out", str(tmp_path), *extra]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
    with open(tmp_path / "overlap.json") as f:
        return done, json.load(f)


def test_overlap_quick_writes_results_and_checks_bitwise(tmp_path):
    done, result = _quick_overlap(tmp_path, models=("bert", "mlp"))
    assert result["options"]["link_gbit"] is None
    assert result["models"]["bert"]["bitwise_equal"]["equal"] is True
    assert result["experiment"] == "overlap" and result["options"]["quick"] is True
    assert set(result["models"]) == {"bert", "mlp"}
    mlp = result["models"]["mlp"]
    assert set(mlp["summary"]) == set(overlap.VARIANTS) == {"torch", "ours", "ours_overlap"}
    for kind in overlap.VARIANTS:
        assert mlp["summary"][kind]["median_ms"] > 0, kind
        assert mlp["summary"][kind]["iterations"] == 4, kind  # --quick: 2 blocks of 2
        assert set(mlp["phases_ms"][kind]) == {"forward", "backward", "optimizer", "total"}, kind
    for key in ("overlap_over_torch", "overlap_over_ours", "ours_over_torch"):
        assert mlp[key]["ratio"] > 0 and len(mlp[key]["per_block"]["values"]) == 2, key
    n_params = len(list(overlap.sv.ScaleoutMLP(0.0).parameters()))
    assert mlp["bitwise_equal"] == {"equal": True, "ranks": 2, "tensors_per_rank": n_params}
    assert mlp["workload"]["parameters"] == sum(p.numel() for p in overlap.sv.ScaleoutMLP(0.0).parameters())
    assert mlp["workload"]["optimizer"].startswith("Adam (foreach)")
    assert "samples_ms" not in mlp
    full = results.read_result(str(tmp_path), "overlap")
    assert {k: len(v) for k, v in full["models"]["mlp"]["samples_ms"].items()} == {k: 4 for k in overlap.VARIANTS}
    assert (tmp_path / "overlap.png").stat().st_size > 0
    assert "| mlp | ddp_ext + overlap_optimizer |" in done.stdout and "| equal |" in done.stdout


def test_overlap_over_shaped_links(tmp_path):
    reason = hosts.cannot_make_namespaces()
    if reason:
        pytest.skip(f"overlap --link: {reason}")
    done, result = _quick_overlap(tmp_path, "--link", "1gbit")
    assert result["options"]["link_gbit"] == 1.0
    assert result["models"]["mlp"]["bitwise_equal"]["equal"] is True
    assert any("shaped to 1 Gbit/s" in note for note in result["notes"])
    assert "| mlp | ddp_ext + overlap_optimizer |" in done.stdout


def test_link_rates_parse():
    assert _link_gbit("10gbit") == 10.0 and _link_gbit("2.5Gbit") == 2.5
    for wrong in ("fast", "0gbit", "10mbit", "gbit"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a rate such as 1gbit"):
            _link_gbit(wrong)


def _twins():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    b = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    b.load_state_dict(a.state_dict())
    return a, b


def test_bitwise_check_sees_one_ulp_and_fails_naming_the_rank():
    a, b = _twins()
    assert overlap.differing_tensors(a, b) == []
    with torch.no_grad():
        b[0].bias[2] = torch.nextafter(b[0].bias[2], torch.tensor(1.0))
        b[1].running_mean[0] += 1.0
    assert overlap.differing_tensors(a, b) == ["0.bias", "1.running_mean"]

    same = {"differing": [], "compared": 7}
    assert overlap.bitwise_check("mlp", [same, same]) == {"equal": True, "ranks": 2, "tensors_per_rank": 7}
    with pytest.raises(RuntimeError, match=r"overlap, mlp: .*not bitwise.*rank 1: 0\.bias, 1\.running_mean"):
        overlap.bitwise_check("mlp", [same, {"differing": ["0.bias", "1.running_mean"], "compared": 7}])
