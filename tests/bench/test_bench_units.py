"""Single-process checks of the benchmark suite's pure pieces (no ranks, no timing)."""

import os
import subprocess
import sys

import pytest

from benchmarks.experiments.allreduce import splits
from benchmarks.experiments.order import around_last_rebuild
from benchmarks.harness import stats
from benchmarks.harness.interleave import balanced_order, merge_ranks, rotated
from benchmarks.harness.machine import git_commit
from benchmarks.harness.options import ONE_PARAMETER_PER_BUCKET_MB, device_problem, effective_bucket_cap_mb
from benchmarks.reporting.document import assemble, figures_named, results_named

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _blocks(*blocks):
    return [[{"total": ms} for ms in block] for block in blocks]


@pytest.mark.parametrize("items, by, expected", [
    (["a", "b", "c"], 0, ["a", "b", "c"]),
    (["a", "b", "c"], 1, ["b", "c", "a"]),
    (["a", "b", "c"], 5, ["c", "a", "b"]),
])
def test_rotated(items, by, expected):
    assert rotated(items, by) == expected


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_balanced_order_puts_each_variant_after_each_other_equally_often(n):
    items = [f"v{i}" for i in range(n)]
    rounds = n if n % 2 == 0 else 2 * n
    orders = [balanced_order(items, r) for r in range(rounds)]
    assert all(sorted(order) == items for order in orders)
    followers = {}
    positions = {}
    for order in orders:
        for position, item in enumerate(order):
            positions[(item, position)] = positions.get((item, position), 0) + 1
        for before, after in zip(order, order[1:]):
            followers[(before, after)] = followers.get((before, after), 0) + 1
    pairs = [(a, b) for a in items for b in items if a != b]
    assert sorted(followers) == sorted(pairs), "a pair never or wrongly follows"
    assert len(set(followers.values())) <= 1, followers
    assert len(set(positions.values())) == 1 and len(positions) == n * n, positions
    # The cycle repeats.
    assert balanced_order(items, rounds) == orders[0]


def test_merge_ranks_keeps_the_slowest_rank_per_iteration():
    rank0 = {"ours": _blocks([10, 30], [5])}
    rank1 = {"ours": _blocks([20, 25], [7])}
    assert stats.values(merge_ranks([rank0, rank1])["ours"]) == [20, 30, 7]


def test_ratio_and_its_per_block_spread():
    ours = _blocks([9, 9, 9], [12, 12, 12])
    theirs = _blocks([10, 10, 10], [10, 10, 10])
    result = stats.ratio(ours, theirs)
    assert result["ratio"] == pytest.approx(10.5 / 10)  # median of all six of ours / median of theirs
    assert result["per_block"]["min"] == pytest.approx(0.9)
    assert result["per_block"]["max"] == pytest.approx(1.2)


@pytest.mark.parametrize("cap, expected", [
    (None, None),
    (0, ONE_PARAMETER_PER_BUCKET_MB),
    (25, 25),
])
def test_effective_bucket_cap(cap, expected):
    assert effective_bucket_cap_mb(cap) == expected


def test_zero_cap_is_one_byte():
    assert int(ONE_PARAMETER_PER_BUCKET_MB * 1024 * 1024) == 1


@pytest.mark.parametrize("total, expected", [
    (1024, [1024]),
    (5000, [1024, 4096, 5000]),
    (2**16, [1024, 4096, 16384, 65536]),
])
def test_allreduce_splits(total, expected):
    assert splits(total) == expected


def test_assemble_replaces_placeholders_and_keeps_the_prose():
    texts = ["# Title\n\nintro\n", "## compare\n\nbefore\n<!-- RESULT: compare -->\nafter\n<!-- RESULT: mpi/compare-mpi -->\n"]
    rendered = assemble(texts, lambda name: f"table of {name}\n")
    assert results_named(texts[1]) == ["compare", "mpi/compare-mpi"]
    assert "RESULT" not in rendered
    assert ("before\n<!-- BEGIN GENERATED: compare -->\ntable of compare\n<!-- END GENERATED: compare -->\nafter\n"
            in rendered)
    assert rendered.endswith("<!-- BEGIN GENERATED: compare-mpi -->\ntable of mpi/compare-mpi\n"
                             "<!-- END GENERATED: compare-mpi -->\n")
    assert "# Title\n\nintro\n\n## compare" in rendered


def test_assemble_renders_a_headline_where_the_prose_shows_a_figure():
    text = "## compare\n\n<!-- FIGURE: mpi/compare-mpi -->\nreading\n"
    rendered = assemble([text], lambda name: "never", lambda name: f"figure of {name}\n")
    assert figures_named(text) == ["mpi/compare-mpi"] and results_named(text) == []
    assert ("<!-- BEGIN GENERATED: compare-mpi -->\nfigure of mpi/compare-mpi\n<!-- END GENERATED: compare-mpi -->\n"
            "reading\n") in rendered
    with pytest.raises(ValueError):
        assemble([text], lambda name: "never")


def test_assemble_leaves_an_inline_mention_of_the_placeholder_alone():
    text = "write `<!-- RESULT: name -->` on a line of its own\n"
    assert assemble([text], lambda name: "never") .endswith(text)


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_commit_is_dirty_for_source_changes_only(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "GUIDE.md").write_text("text\n")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "compare.json").write_text("{}\n")
    (tmp_path / "reducer.cpp").write_text("int x;\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    assert not git_commit(str(tmp_path)).endswith("+dirty")
    (tmp_path / "benchmarks" / "results" / "compare.json").write_text('{"new": 1}\n')  # a result rewritten in place
    (tmp_path / "docs" / "GUIDE.md").write_text("edited\n")
    (tmp_path / "notes.txt").write_text("untracked\n")
    assert not git_commit(str(tmp_path)).endswith("+dirty")
    (tmp_path / "reducer.cpp").write_text("int y;\n")
    assert git_commit(str(tmp_path)).endswith("+dirty")


@pytest.mark.parametrize("values, rebuilds, expected", [
    # Each iteration's backward ran with the layout of this many rebuilds: rebuilt
    # after iterations 0 and 3 (at the next forward), so iteration 3 ran with the
    # layout the last rebuild replaced, and "after" is the median of iterations 4-7.
    ([0.0, 0.1, 0.9, 0.2, 0.3, 0.8, 0.9, 0.9], [0, 1, 1, 1, 2, 2, 2, 2],
     {"before": 0.2, "after": 0.85, "last_rebuild_iteration": 3}),
    ([0.5, 0.4, 0.6], [0, 0, 0], {"before": 0.5, "after": 0.5, "last_rebuild_iteration": None}),
])
def test_order_measures_around_the_last_rebuild(values, rebuilds, expected):
    assert around_last_rebuild(values, rebuilds) == pytest.approx(expected)


def test_all_runs_each_experiment_with_the_models_it_trains():
    from benchmarks.__main__ import _options, _parser

    for_resnet = _parser().parse_args(["all", "--models", "resnet50"])
    assert _options(for_resnet, "compare", part_of_all=True).models == ("resnet50",)
    # order trains only its own models: it runs its defaults instead of failing.
    assert "resnet50" not in _options(for_resnet, "order", part_of_all=True).models
    for_order = _parser().parse_args(["all", "--models", "reversed"])
    assert _options(for_order, "order", part_of_all=True).models == ("reversed",)
    assert _options(for_order, "compare", part_of_all=True).models == ("resnet50", "bert")
    # Run alone, a model the experiment does not train is still refused.
    with pytest.raises(SystemExit, match="not one of its models"):
        _options(_parser().parse_args(["order", "--models", "resnet50"]), "order")


@pytest.mark.parametrize("experiment, device, backend, cuda, world_size, gpus, expected", [
    ("compare", "cpu", "", False, 2, 0, None),  # the default: no CUDA needed
    ("scale", "cpu", "gloo", False, 2, 0, None),
    ("compare", "cpu", "nccl", True, 1, 1, "needs --device cuda"),
    ("compare", "cuda", "", False, 1, 0, "no CUDA device"),
    ("compare", "cuda", "gloo", False, 2, 0, "no CUDA device"),
    ("scale", "cuda", "", True, 1, 1, "compare only"),
    ("compare", "cuda", "", True, 1, 1, None),  # NCCL, one rank per GPU
    ("compare", "cuda", "nccl", True, 2, 1, "a GPU per rank"),
    ("compare", "cuda", "gloo", True, 2, 1, None),  # Gloo: ranks share the GPU
])
def test_device_problem(experiment, device, backend, cuda, world_size, gpus, expected):
    problem = device_problem(experiment, device, backend, cuda, world_size, gpus)
    if expected is None:
        assert problem is None
    else:
        assert expected in problem


def test_cuda_without_a_gpu_is_refused_before_any_rank_starts():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    command = [sys.executable, "-m", "benchmarks", "compare", "--device", "cuda", "--quick", "--out", "/nonexistent"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "--device cuda: no CUDA device" in run.stderr, run.stderr
