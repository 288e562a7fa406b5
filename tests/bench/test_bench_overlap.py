"""`python -m benchmarks overlap` runs end to end (a functionality check; it times nothing).

A --quick run on BERT (whose dropout draws random numbers) and the scaleout MLP at 2 ranks, with 1 MiB buckets so that the
overlapped optimizer steps several buckets in the backward, must write a
summary with every variant's medians and phases, both ratios and a passed
bitwise check, and rows (one per model and variant) with a bound and a peak
memory; torch's optimizer in backward has a time or the reason it has none.
The same over 1 Gbit/s links at 2 hosts x 2 ranks is in
test_bench_overlap_configs.py. The check itself must see a one-ulp difference and fail the
run on it; the bound, the rows and the peak's running sum are unit-tested.
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
from benchmarks.harness import iteration_bound, peak_memory  # noqa: E402
from benchmarks.reporting import results  # noqa: E402
from benchmarks.workloads import scaleout_variants as sv  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROW_KEYS = {"model", "hosts", "ranks_per_host", "link", "variant", "ms", "ratio_to_torch", "bound_ms", "over_bound",
            "peak_mib", "peak_ratio_to_torch"}


SEGFAULT = "died with exit code -11"


def _quick_overlap(tmp_path, *extra, models=("mlp",)):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               PYTHONFAULTHANDLER="1")  # a crash prints every thread's Python stack
    command = [sys.executable, "-m", "benchmarks", "overlap", "--quick", "--models", *models, "--bucket-cap-mb", "1",
               "--world-size", "2", "--out", str(tmp_path), *extra]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and SEGFAULT in done.stderr:
        # Seen here about once in ten runs on a loaded machine, always inside
        # the untimed peak-memory iteration (torch's profiler with
        # profile_memory=True) and on a thread Python did not start; torch
        # disabled its own test of that profiler with C++ threads for the same
        # crash (CppThreadTest.test_profile_memory). One more try, said out loud.
        print(f"overlap --quick: a rank crashed (segmentation fault), run again:\n{done.stderr[-2000:]}")
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
    with open(tmp_path / "overlap.json") as f:
        return done, json.load(f)


def _check_rows(result, models, config):
    rows = result["rows"]
    assert [(r["model"], r["variant"]) for r in rows] == [(m, v) for m in models for v in overlap.VARIANTS]
    assert set(overlap.VARIANTS) == {"torch", "torch_in_backward", "ours", "ours_optimizer", "ours_overlap"}
    for r in rows:
        assert ROW_KEYS <= set(r), r
        assert (r["hosts"], r["ranks_per_host"], r["link"]) == config, r
        assert r["bound_ms"] > 0 and r["bound_ms"] == max(r["computation_ms"], r["link_ms"]), r
        if r["ms"] is None:  # torch's optimizer in backward on a machine without an accelerator
            assert r["variant"] == "torch_in_backward" and "raised in torch/" in r["reason"], r
            continue
        assert r["ms"] > 0 and r["peak_mib"] > 0, r
        assert r["over_bound"] == pytest.approx(r["ms"] / r["bound_ms"]), r
    for m in models:
        torch_row = next(r for r in rows if r["model"] == m and r["variant"] == "torch")
        assert torch_row["ratio_to_torch"] == 1.0 and torch_row["peak_ratio_to_torch"] == 1.0
    unmeasured = [r for r in rows if r["ms"] is None]
    if unmeasured:
        assert any(unmeasured[0]["reason"] in note for note in result["notes"])


def test_overlap_quick_writes_results_and_checks_bitwise(tmp_path):
    done, result = _quick_overlap(tmp_path, models=("bert", "mlp"))
    assert result["options"]["link_gbit"] is None
    assert result["models"]["bert"]["bitwise_equal"]["equal"] is True
    assert result["experiment"] == "overlap" and result["options"]["quick"] is True
    assert set(result["models"]) == {"bert", "mlp"}
    _check_rows(result, ("bert", "mlp"), (1, 2, "loopback"))
    assert [t["model"] for t in result["targets"]] == ["bert"]  # the peak target: compare models only
    mlp = result["models"]["mlp"]
    timed = {"torch", "ours", "ours_optimizer", "ours_overlap", "local"} | ({"torch_in_backward"} - set(mlp["unmeasured"]))
    assert set(mlp["summary"]) == timed
    for kind in timed:
        assert mlp["summary"][kind]["median_ms"] > 0, kind
        assert mlp["summary"][kind]["iterations"] == 4, kind  # --quick: 2 blocks of 2
        assert set(mlp["phases_ms"][kind]) == {"forward", "backward", "optimizer", "total"}, kind
    for key in ("optimizer_over_torch", "optimizer_over_ours", "ours_over_torch", "overlap_over_torch"):
        assert mlp[key]["ratio"] > 0 and len(mlp[key]["per_block"]["values"]) == 2, key
    n_params = len(list(sv.ScaleoutMLP(0.0).parameters()))
    assert mlp["bitwise_equal"] == {"equal": True, "ranks": 2, "tensors_per_rank": n_params}
    assert mlp["workload"]["parameters"] == sum(p.numel() for p in sv.ScaleoutMLP(0.0).parameters())
    assert mlp["gradient_bytes"] == 4 * mlp["workload"]["parameters"]
    assert mlp["workload"]["optimizer"].startswith("Adam (foreach)")
    assert "samples_ms" not in mlp
    full = results.read_result(str(tmp_path), "overlap")
    assert {k: len(v) for k, v in full["models"]["mlp"]["samples_ms"].items()} == {k: 4 for k in timed}
    assert (tmp_path / "overlap.png").stat().st_size > 0
    assert "| mlp | 1x2 loopback | ddp_ext + overlap_optimizer |" in done.stdout and "| equal |" in done.stdout
    assert "| mlp | 1x2 loopback | ddp_ext + overlap_optimizer + forward |" in done.stdout


def test_bound_is_computation_or_ring_bytes_over_the_link():
    assert iteration_bound.ring_allreduce_bytes(1000, 2) == 1000
    assert iteration_bound.ring_allreduce_bytes(1000, 4) == 1500
    assert iteration_bound.ring_allreduce_bytes(1000, 1) == 0
    # 125 MB from each of 2 ranks at 1 Gbit/s: one second.
    assert iteration_bound.link_ms(125_000_000, 2, 1.0) == pytest.approx(1000.0)
    assert iteration_bound.link_ms(125_000_000, 2, 10.0) == pytest.approx(100.0)
    assert iteration_bound.bound_ms(300.0, 125_000_000, 2, 1.0) == pytest.approx(1000.0)
    assert iteration_bound.bound_ms(300.0, 125_000_000, 2, 10.0) == 300.0
    assert iteration_bound.bound_ms(300.0, 125_000_000, 2, None) == 300.0  # the loopback: computation alone


def test_rows_carry_the_configuration_the_bound_and_the_reason():
    summary = {"summary": {k: {"median_ms": ms, "q25_ms": ms, "q75_ms": ms}
                           for k, ms in (("torch", 200.0), ("ours", 150.0), ("ours_optimizer", 120.0),
                                         ("ours_overlap", 110.0))},
               "computation_ms": 100.0, "gradient_bytes": 12_500_000, "peak_mib": {"torch": 40.0, "ours": 40.0,
                                                                                  "ours_optimizer": 30.0,
                                                                                  "ours_overlap": 30.0},
               "unmeasured": {"torch_in_backward": "RuntimeError: no accelerator"}}
    rows = {r["variant"]: r for r in overlap.rows_of("bert", summary, 2, 2, 1.0)}
    assert set(rows) == set(overlap.VARIANTS)
    # 1.5 x 12.5 MB at 1 Gbit/s = 150 ms, above the 100 ms of computation.
    assert [r["bound_ms"] for r in rows.values()] == [pytest.approx(150.0)] * 5
    assert rows["ours_optimizer"]["ratio_to_torch"] == 0.6
    assert rows["ours_optimizer"]["over_bound"] == pytest.approx(0.8)
    assert rows["ours_optimizer"]["peak_ratio_to_torch"] == 0.75
    assert (rows["ours"]["link"], rows["ours"]["hosts"], rows["ours"]["ranks_per_host"]) == ("1gbit", 2, 2)
    assert rows["torch_in_backward"]["ms"] is None and rows["torch_in_backward"]["reason"] == "RuntimeError: no accelerator"
    loopback = overlap.rows_of("bert", summary, 1, 2, None)
    assert {r["link"] for r in loopback} == {"loopback"} and {r["bound_ms"] for r in loopback} == {100.0}


def test_peak_is_the_running_sums_maximum_above_the_start():
    # Out of time order on purpose: +100, +30, -50, +10.
    assert peak_memory.running_peak([(2, -50), (0, 100), (1, 30), (3, 10)]) == 130
    assert peak_memory.running_peak([(0, -64), (1, 32)]) == 0
    assert peak_memory.running_peak([]) == 0


def test_peak_bytes_sees_a_tensor_held_for_the_call():
    mib = 2**20

    def hold_two_mib():
        a = torch.ones(mib // 4)  # 1 MiB of float32
        b = torch.ones(mib // 4)
        return float(a[0] + b[0])

    assert 2 * mib <= peak_memory.peak_bytes(hold_two_mib) < 3 * mib
    assert peak_memory.peak_bytes(lambda: None) == 0


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


def _overlap_options(*argv):
    from benchmarks.__main__ import _options, _parser

    return _options(_parser().parse_args(["overlap", *argv]), "overlap")


def test_hosts_and_ranks_per_host_set_the_world_size():
    two_by_two = _overlap_options("--link", "1gbit", "--hosts", "2", "--ranks-per-host", "2")
    assert (two_by_two.world_size, two_by_two.hosts, two_by_two.ranks_per_host) == (4, 2, 2)
    assert overlap.placement(two_by_two) == (2, 2)
    assert overlap.placement(_overlap_options("--link", "10gbit", "--world-size", "3")) == (3, 1)
    assert overlap.placement(_overlap_options("--world-size", "2")) == (1, 2)  # the loopback: one host
    assert _overlap_options("--models", "tiny").models == ("tiny",)
    with pytest.raises(SystemExit, match="need --link"):
        _overlap_options("--hosts", "2")
    with pytest.raises(SystemExit, match="cannot place --world-size 3"):
        _overlap_options("--link", "1gbit", "--world-size", "3", "--ranks-per-host", "2")


def test_peak_target_applies_to_the_compare_models_only():
    def row(model, variant, peak_ratio):
        return {"model": model, "variant": variant, "peak_ratio_to_torch": peak_ratio, "hosts": 1,
                "ranks_per_host": 2, "link": "loopback"}

    rows = [row("resnet50", "ours_optimizer", 0.85), row("bert", "ours_optimizer", 0.95),
            row("bert", "ours", 0.5), row("mlp", "ours_optimizer", 0.5)]
    assert [(t["model"], t["met"]) for t in overlap.targets(rows)] == [("resnet50", True), ("bert", False)]
