"""The benchmark entry point runs end to end (a functionality check; it times nothing).

`python -m benchmarks compare` with the shortest run lengths on 2 ranks must
write compare.json with positive medians and ratios for both models, plus the
figure, the samples, and the markdown table on stdout. `order` must record the rebuilds and overlap
that its models' gradient orders imply (counts, not timings); `layerdrop` the
bytes each drop rate sends and its agreement with local training; `compression`
the bytes each hook sends (allreduced and allgathered) and its accuracy.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib", reason="the benchmark suite needs matplotlib (the `bench` extra)")

from benchmarks.reporting import figures, results  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORTEST_RUN = ["--warmup", "1", "--blocks", "1", "--block-iterations", "1", "--discard-per-block", "0"]


def test_compare_writes_results(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "benchmarks", "compare", "--world-size", "2", "--out", str(tmp_path),
               *SHORTEST_RUN]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"

    with open(tmp_path / "compare.json") as f:
        result = json.load(f)
    assert set(result["models"]) == {"resnet50", "bert"}
    for model, measured in result["models"].items():
        for key in ("ours_ms", "torch_ms", "local_ms", "ratio"):
            assert measured[key] > 0, f"{model}: {key} = {measured[key]}"
    for key in ("logical_cores", "usable_cores", "torch", "backend", "threads_per_rank"):
        assert key in result["machine"], f"machine record lacks {key}"
    assert result["machine"]["backend"] == "gloo"
    assert result["options"]["world_size"] == 2
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert "| resnet50 |" in done.stdout
    # Summary and samples together: one sample per measured iteration (1 block of 1) per implementation.
    full = results.read_result(str(tmp_path), "compare")
    assert {k: len(v) for k, v in full["models"]["bert"]["samples_ms"].items()} == {"ours": 1, "torch": 1, "local": 1}
    assert "samples_ms" not in result["models"]["bert"]
    assert figures.read_provenance(str(tmp_path / "compare.png"))["Command"] == result["command"]


def _run_bench(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "benchmarks", *args, "--world-size", "2", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
    return done


def test_order_records_rebuilds_and_overlap(tmp_path):
    # 7 iterations per variant; the switching model swaps at iteration 2
    # (warmup // 3), continuous rebuilding follows at the end of iteration 5.
    done = _run_bench(tmp_path, "order", "--models", "reversed", "switching", "--warmup", "6", "--blocks", "1",
               "--block-iterations", "1", "--discard-per-block", "0")
    with open(tmp_path / "order.json") as f:
        result = json.load(f)
    reversed_, switching = result["models"]["reversed"], result["models"]["switching"]
    for measured in (reversed_, switching):
        for key in ("ours_ms", "torch_ms", "ratio"):
            assert measured[key] > 0, key
    assert reversed_["rebuilds"] == reversed_["rebuilds_once"] == 1
    assert reversed_["overlap_fraction"]["before"] == 0.0 and reversed_["overlap_fraction"]["after"] > 0.9
    # The first rebuild re-lays torch's first bucket in both modes; continuous also follows the swap.
    assert switching["rebuilds"] == 2 and switching["rebuilds_once"] == 1
    assert switching["overlap_fraction"]["last_rebuild_iteration"] == 5
    assert switching["overlap_fraction"]["after"] > 0.9
    assert switching["overlap_fraction_once"]["after"] < 0.5  # torch's behaviour keeps the stale layout
    assert "| switching |" in done.stdout


def test_layerdrop_records_bytes_and_parity(tmp_path):
    done = _run_bench(tmp_path, "layerdrop", "--quick")
    with open(tmp_path / "layerdrop.json") as f:
        result = json.load(f)
    assert sorted(result["p"]) == ["0.0", "0.2", "0.5"]
    for measured in result["p"].values():
        for key in ("ours_ms", "torch_ms", "ratio", "ours_bytes", "torch_bytes"):
            assert measured[key] > 0, key
        assert measured["max_diff_vs_local"] < 1e-5
    no_drop, half = result["p"]["0.0"], result["p"]["0.5"]
    # Without drops both send every gradient (plus a few control bytes).
    assert abs(no_drop["ours_bytes"] - no_drop["torch_bytes"]) < 0.01 * no_drop["torch_bytes"]
    assert half["torch_bytes"] == no_drop["torch_bytes"], "torch's DDP sends every bucket"
    assert half["ours_bytes"] < no_drop["ours_bytes"]
    assert "| 0.5 |" in done.stdout


def test_timeline_draws_both_ddps(tmp_path):
    done = _run_bench(tmp_path, "timeline", "--quick")
    result = results.read_result(str(tmp_path), "timeline")  # the per-parameter series are in the samples
    for rank in result["ranks_data"]:
        ours, theirs = rank["ours"], rank["torch"]
        assert len(ours["ready_ms"]) == ours["parameters"]
        for measured in (ours, theirs):
            assert measured["buckets"], "no bucket drawn"
            for bucket in measured["buckets"]:
                assert bucket["bytes"] > 0 and bucket["done_ms"] >= bucket["launch_ms"] >= 0
        assert sum(b["bytes"] for b in ours["buckets"]) == sum(b["bytes"] for b in theirs["buckets"])
    assert result["cost"]["off"]["median_ms"] > 0 and result["cost"]["on"]["median_ms"] > 0
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert "| ddp_ext: bucket 0 |" in done.stdout


def test_bucket_auto_writes_the_auto_row(tmp_path):
    # Settling takes the tuner's own iterations (about 90), whatever the run lengths.
    done = _run_bench(tmp_path, "bucket", "--auto", "--models", "resnet50", "--bucket-cap-mb", "5", *SHORTEST_RUN)
    result = results.read_result(str(tmp_path), "bucket")  # the tuner's history is a series: in the samples
    auto = result["models"]["resnet50"]["auto"]
    for key in ("auto_ms", "best_fixed_ms", "default_ms"):
        assert auto[key] > 0, f"{key} = {auto[key]}"
    fixed_ms = {k: auto["summary"][k]["median_ms"] for k in ("default", "5")}
    assert auto["best_fixed_cap_mb"] == min(fixed_ms, key=fixed_ms.get)
    # The caps auto ended on are those the tuner's last decision settled on.
    _, kind, settled_caps, _ = auto["history"][-1]
    assert kind == "settled" and auto["tuning"]["iterations"] > 10
    assert settled_caps and all(cap > 0 for cap in settled_caps)
    assert auto["auto_cap_mb"] == auto["settled_cap_mb"] == "+".join(f"{c:g}" for c in settled_caps)
    assert set(auto["summary"]) == {"default", "5", "auto"}
    # Auto is set against the fixed run with its caps where this run measured them (default = 1+25).
    expected_same = {"1+25": "default", "5": "5"}.get(auto["auto_cap_mb"])
    assert auto["same_cap_fixed"] == expected_same
    assert (auto["auto_vs_same_cap"] is None) == (expected_same is None)
    assert "| auto / best fixed [block range] |" in done.stdout


def test_compression_records_time_bytes_and_accuracy(tmp_path):
    # --quick shortens the adaptive hook's warm-up and windows to 2 iterations.
    done = _run_bench(tmp_path, "compression", "--quick", "--models", "bert")
    with open(tmp_path / "compression.json") as f:
        result = json.load(f)
    variants = result["models"]["bert"]["variants"]
    for name, measured in variants.items():
        assert measured["ms"] > 0 and measured["bytes"] > 0, name
    full = variants["ours"]["bytes"]
    assert abs(variants["torch"]["bytes"] - full) < 0.01 * full
    assert abs(variants["torch_fp16"]["bytes"] - full / 2) < 0.01 * full
    assert variants["torch_powersgd1"]["bytes"] < variants["torch_powersgd4"]["bytes"] < 0.1 * full
    # Compressing whatever it costs: 8-bit codes plus scales, a quarter of the bytes.
    always = variants["ours_adaptive_always"]
    assert {f for d in always["bytes_counted"]["decisions"] for f in d["formats"]} == {"int8"}
    assert 0.25 * full <= always["bytes"] < 0.26 * full
    # The hook's own count leaves out only its small statistics allreduce.
    assert 0 < always["bytes"] - always["bytes_counted"]["bytes_sent_per_iteration"] < 1024
    for name, measured in result["convergence"].items():
        # --quick: one seed, scored on the 20% of the 1797 digits held out.
        assert measured["final_loss"] > 0 and measured["test_images"] == 359, name
        accuracy = measured["test_accuracy"]
        assert [s["test_accuracy"] for s in measured["seeds"]] == [accuracy], name
        assert measured["test_accuracy_range"] == [accuracy, accuracy], name
        correct = accuracy / 100 * measured["test_images"]  # a percentage of whole images
        assert 0 <= accuracy <= 100 and abs(correct - round(correct)) < 1e-3, f"{name}: {accuracy}"
    assert "| bert | ddp_ext + adaptive |" in done.stdout


def test_fixedcost_measures_a_second_torch_replica_as_its_control(tmp_path):
    done = _run_bench(tmp_path, "fixedcost", *SHORTEST_RUN)
    with open(tmp_path / "fixedcost.json") as f:
        measured = json.load(f)["models"]["tinymlp"]
    assert set(measured["phases_ms"]) == {"ours", "torch", "local", "ours_separate_check", "torch_control"}
    for key in ("ratio", "control_over_torch", "separate_check_over_torch"):
        assert measured[key]["ratio"] > 0, (key, measured[key])
    assert "| tinymlp | torch DDP, second replica |" in done.stdout, done.stdout
