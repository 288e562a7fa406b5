"""The benchmark entry point runs end to end (a functionality check; it times nothing).

`python -m ddp_ext.bench compare` with the shortest run lengths on 2 ranks must
write compare.json with positive medians and ratios for both models, plus the
figure and the markdown table. `order` must record the rebuilds and overlap
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORTEST_RUN = ["--warmup", "1", "--blocks", "1", "--block-iterations", "1", "--discard-per-block", "0"]


def test_compare_writes_results(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "ddp_ext.bench", "compare", "--world-size", "2", "--out", str(tmp_path),
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
    assert "| resnet50 |" in (tmp_path / "compare.md").read_text()


def _run_bench(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "ddp_ext.bench", *args, "--world-size", "2", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
    return done


def test_order_records_rebuilds_and_overlap(tmp_path):
    # 7 iterations per variant; the switching model swaps at iteration 2
    # (warmup // 3), continuous rebuilding follows at the end of iteration 5.
    _run_bench(tmp_path, "order", "--models", "reversed", "switching", "--warmup", "6", "--blocks", "1",
               "--block-iterations", "1", "--discard-per-block", "0")
    with open(tmp_path / "order.json") as f:
        result = json.load(f)
    reversed_, switching = result["models"]["reversed"], result["models"]["switching"]
    for measured in (reversed_, switching):
        for key in ("ours_ms", "torch_ms", "ratio"):
            assert measured[key] > 0, key
    assert reversed_["rebuilds"] == reversed_["rebuilds_once"] == 1
    assert reversed_["overlap_fraction"]["before"] == 0.0 and reversed_["overlap_fraction"]["after"] > 0.9
    assert switching["rebuilds"] == 1 and switching["rebuilds_once"] == 0
    assert switching["overlap_fraction"]["last_rebuild_iteration"] == 5
    assert switching["overlap_fraction"]["after"] > 0.9
    assert switching["overlap_fraction_once"]["after"] < 0.5  # torch's behaviour keeps the stale layout
    assert "| switching |" in (tmp_path / "order.md").read_text()


def test_layerdrop_records_bytes_and_parity(tmp_path):
    _run_bench(tmp_path, "layerdrop", "--quick")
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
    assert "| 0.5 |" in (tmp_path / "layerdrop.md").read_text()


def test_timeline_draws_both_ddps(tmp_path):
    _run_bench(tmp_path, "timeline", "--quick")
    with open(tmp_path / "timeline.json") as f:
        result = json.load(f)
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
    assert "| ddp_ext: bucket 0 |" in (tmp_path / "timeline.md").read_text()


def test_bucket_auto_writes_the_auto_row(tmp_path):
    # Settling takes the tuner's own iterations (about 90), whatever the run lengths.
    _run_bench(tmp_path, "bucket", "--auto", "--models", "resnet50", "--bucket-cap-mb", "5", *SHORTEST_RUN)
    with open(tmp_path / "bucket.json") as f:
        result = json.load(f)
    auto = result["models"]["resnet50"]["auto"]
    for key in ("auto_ms", "best_fixed_ms", "default_ms"):
        assert auto[key] > 0, f"{key} = {auto[key]}"
    assert auto["best_fixed_cap_mb"] in ("default", "5")
    assert auto["auto_cap_mb"] in ("1+25", "1", "2.5", "5", "10", "25", "50")
    assert auto["history"][-1][1] == "settled" and auto["tuning"]["iterations"] > 10
    assert set(auto["summary"]) == {"default", "5", "auto"}
    assert auto["same_cap_fixed"] in (None, "default", "5")
    assert "| auto / best fixed [block range] |" in (tmp_path / "bucket.md").read_text()


def test_compression_records_time_bytes_and_accuracy(tmp_path):
    # --quick shortens the adaptive hook's warm-up and windows to 2 iterations.
    _run_bench(tmp_path, "compression", "--quick", "--models", "bert")
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
    for measured in result["convergence"].values():
        assert measured["final_loss"] > 0 and 0 <= measured["test_accuracy"] <= 100
    assert "| bert | ddp_ext + adaptive |" in (tmp_path / "compression.md").read_text()
