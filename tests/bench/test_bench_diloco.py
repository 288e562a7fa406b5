"""`python -m benchmarks diloco`: DiLoCo against DDP over slow links.

- Units: the standard-library corpus (which files, the held-out split, the
  byte budget), batches and token counts, the evaluation schedule, the rows
  and targets made from measured records, the table.
- End to end (about half a minute): every variant on 2 "hosts" of 1 rank on
  the loopback (no namespaces), the quick plan: curves at every evaluation
  step, DiLoCo's bytes as its schedule says, 8 bits about a quarter of 32,
  4 bits an eighth.
"""

import math

import pytest
import torch

pytest.importorskip("matplotlib", reason="the benchmark suite needs matplotlib (the `bench` extra)")

from benchmarks.experiments import diloco  # noqa: E402
from benchmarks.harness.progress import Progress  # noqa: E402
from benchmarks.workloads import diloco_variants as dv  # noqa: E402
from benchmarks.workloads import stdlib_text  # noqa: E402


def _tree(root, files):
    for path, text in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def test_source_files_are_sorted_python_files_outside_site_packages(tmp_path):
    _tree(tmp_path, {"b.py": "b", "a.py": "a", "pkg/c.py": "c", "notes.txt": "x", "site-packages/d.py": "d",
                     "pkg/__pycache__/e.py": "e"})
    assert stdlib_text.source_files(str(tmp_path)) == ["a.py", "b.py", "pkg/c.py"]


def test_every_twentieth_file_is_held_out_and_the_budgets_hold(tmp_path):
    _tree(tmp_path, {f"m{i:02d}.py": chr(ord("A") + i % 26) * 10 for i in range(40)})
    corpus = stdlib_text.load(max_bytes=95, held_out_bytes=1000, root=str(tmp_path))
    assert bytes(corpus.held_out.tolist()) == b"T" * 10 + b"N" * 10  # files 19 and 39
    assert corpus.train.numel() == 95 and bytes(corpus.train[:20].tolist()) == b"A" * 10 + b"B" * 10
    assert corpus.digest == stdlib_text.load(95, 1000, str(tmp_path)).digest


def test_the_real_standard_library_gives_text():
    corpus = stdlib_text.load(max_bytes=50_000, held_out_bytes=5_000)
    assert corpus.train.numel() == 50_000 and corpus.held_out.numel() == 5_000
    assert b"def " in bytes(corpus.train.tolist())


def test_batches_predict_the_next_character_and_tokens_count_every_rank():
    text = torch.arange(100, dtype=torch.uint8)
    inputs, targets = stdlib_text.random_batch(text, 3, 8, torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (3, 8) and inputs.dtype == torch.int64
    assert torch.equal(targets[:, :-1], inputs[:, 1:]) and torch.equal(targets[:, 0], inputs[:, 0] + 1)
    fixed, _ = stdlib_text.even_batch(text, 4, 8)
    assert fixed[0, 0] == 0 and fixed[-1, -1] == 97
    assert stdlib_text.tokens_seen(10, 4, 8, 64) == 10 * 4 * 8 * 64


def test_evaluation_steps_include_equal_tokens_and_the_last_step():
    plan = diloco.Plan(dv.TrainSettings(), steps=110, overrun=1.5, eval_every=25, seed=0)
    assert plan.steps_of(dv.TORCH) == 110 and plan.steps_of(dv.DILOCO) == 165
    assert plan.eval_steps(dv.TORCH) == [25, 50, 75, 100, 110]
    assert plan.eval_steps(dv.STREAMING) == [25, 50, 75, 100, 110, 125, 150, 165]


def _record(steps, losses, wall, link_bytes, outer_bytes=0):
    return {"steps": steps[-1], "wall_s": wall[-1], "link_bytes": link_bytes, "outer_bytes": outer_bytes,
            "curve_steps": steps, "curve_wall_s": wall, "curve_loss": losses}


def test_rows_and_targets_from_records():
    plan = diloco.Plan(dv.TrainSettings(), steps=4, overrun=1.5, eval_every=2, seed=0)
    records = {
        dv.TORCH: _record([0, 2, 4], [5.0, 3.0, 2.0], [0, 5.0, 10.0], link_bytes=4_000_000),
        dv.DILOCO: _record([0, 2, 4, 6], [5.0, 2.5, 2.03, 1.9], [0, 1.0, 2.0, 3.0], link_bytes=30_000,
                           outer_bytes=24_000),
        dv.STREAMING: _record([0, 2, 4, 6], [5.0, 4.0, 3.0, 2.5], [0, 1.0, 2.0, 3.0], link_bytes=90_000),
    }
    rows = {r["variant"]: r for r in diloco.summarize(0.1, records, plan, ranks=4)}
    d = rows[dv.DILOCO]
    assert d["equal_tokens"] == 4 * 4 * plan.settings.batch * plan.settings.shape.context
    assert d["loss_over_torch"] == pytest.approx(1.015)
    assert d["time_to_torch_loss_s"] == 3.0 and d["time_over_torch"] == pytest.approx(0.3)
    assert d["link_bytes_per_step"] == 5_000 and d["bytes_over_torch"] == pytest.approx(0.005)
    assert d["outer_bytes_per_step"] == 4_000
    assert rows[dv.STREAMING]["time_to_torch_loss_s"] is None
    met = {(t["target"], t["variant"]): t["met"] for t in diloco.targets(list(rows.values()))}
    assert met == {
        ("loss at equal tokens / torch DDP's", dv.DILOCO): True,  # 1.015
        ("bytes across hosts per step / torch DDP's", dv.DILOCO): True,  # 0.005
        ("time to torch DDP's final loss / torch DDP's time", dv.DILOCO): False,  # 0.3
        ("loss at equal tokens / torch DDP's", dv.STREAMING): False,  # 1.5
        ("bytes across hosts per step / torch DDP's", dv.STREAMING): False,  # 0.015
        ("time to torch DDP's final loss / torch DDP's time", dv.STREAMING): False,  # never reached
    }
    data = {"rows": list(rows.values()), "targets": diloco.targets(list(rows.values()))}
    text = diloco.table(data)
    assert "not reached" in text and "| 100 Mbit/s | diloco |" in text and "not met" in text


def test_quick_plan_on_the_loopback_trains_every_variant():
    plan = diloco.QUICK_PLAN
    corpus = stdlib_text.load(max_bytes=200_000, held_out_bytes=20_000)
    records = diloco.run_link(plan, None, corpus, Progress("test", enabled=False), timeout_s=240,
                              ranks_per_host=1, host_count=2)
    assert set(records) == set(dv.VARIANTS)
    for variant, r in records.items():
        assert r["curve_steps"] == [0, *plan.eval_steps(variant)]
        assert all(math.isfinite(x) for x in r["curve_loss"]) and r["link_bytes"] is None
    torch_curve = records[dv.TORCH]["curve_loss"]
    assert torch_curve[-1] < torch_curve[0]
    # F = 1: every H steps each of the 2 ranks sends every parameter, 4 bytes each.
    syncs = plan.steps_of(dv.DILOCO) // plan.settings.sync_every
    parameters = dv.parameter_count(plan.settings.shape)
    assert records[dv.DILOCO]["outer_bytes"] == 2 * syncs * parameters * 4
    assert records[dv.TORCH]["outer_bytes"] == 0
    assert records[dv.DILOCO]["outer_s"] > 0 and records[dv.TORCH]["outer_s"] == 0
    assert 0.24 < records[dv.DILOCO_INT8]["outer_bytes"] / records[dv.DILOCO]["outer_bytes"] < 0.27
    assert 0.12 < records[dv.DILOCO_INT4]["outer_bytes"] / records[dv.DILOCO]["outer_bytes"] < 0.14
    rows = diloco.summarize(None, records, plan, ranks=2)
    assert {r["variant"] for r in rows} == set(dv.VARIANTS)
    assert diloco.targets(rows) and all(t["target"].startswith("loss") for t in diloco.targets(rows))
