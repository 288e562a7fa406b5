"""The recovery experiment's analysis, on made-up runs (no processes): the
SIGSTOP figure counts only a step committed without the stopped replica,
and says so where the run holds none; a run or an analysis that fails
leaves the finished runs written (Note [Finished runs are written] in
benchmarks/harness/finished_runs.py)."""

import os

import pytest

pytest.importorskip("matplotlib", reason="the benchmark suite needs matplotlib (the `bench` extra)")

from benchmarks import runner  # noqa: E402
from benchmarks.experiments import recovery  # noqa: E402
from benchmarks.harness.finished_runs import Incomplete  # noqa: E402
from benchmarks.harness.options import BenchOptions  # noqa: E402
from benchmarks.reporting import results  # noqa: E402

REPLICAS = 3
T0 = 1000.0
STEP_S = 0.1


def _steps(first_step, start, count, world_size=REPLICAS):
    return [{"step": first_step + i, "time": start + i * STEP_S, "world_size": world_size} for i in range(count)]


def _stop(after_step, at):
    return {"time": at, "after_step": after_step, "wait_limit_s": 60.0}


def _crashed_case():
    """The SIGSTOP run that crashed the analysis: r0's one step past the stop
    still carries the stopped replica's vote, and the run ended there."""
    steps = _steps(0, T0, 50)  # steps 0..49, up to 4.9 s
    steps.append({"step": 50, "time": T0 + 5.05, "world_size": REPLICAS})
    return {"steps": steps, "t0": T0, "window_s": 5.05, "kills": [], "stop": _stop(49, T0 + 5.0),
            "heal_bytes": None, "heal_s": None}


def _windowed_run(window_s, kills=()):
    return {"steps": _steps(0, T0, int(window_s / STEP_S)), "t0": T0, "window_s": window_s,
            "kills": [{"time": T0 + at, "after_step": int(at / STEP_S) - 1} for at in kills],
            "stop": None, "heal_bytes": 4096 if kills else None, "heal_s": 0.01 if kills else None}


def _runs(hang):
    options = _options("/unused")
    _, _, window, kill_at = recovery._schedule(options)
    restart = dict(_windowed_run(window, kill_at), resumed=[])
    return {"ft_clean": _windowed_run(window), "restart_clean": dict(_windowed_run(window), resumed=[]),
            "ft": _windowed_run(window, kill_at), "restart": restart, "hang": hang,
            "probe": {"bytes_per_s": 1e9}}


def _options(out):
    return BenchOptions(experiment="recovery", world_size=REPLICAS, quick=True, out=str(out))


def test_hang_counts_the_first_step_without_the_stopped_replica():
    hang = _crashed_case()
    detect_s, why = recovery.hang_detection(hang, REPLICAS)
    assert detect_s is None
    assert why == ("no step committed without the stopped replica within 60 s of the SIGSTOP; 1 step(s) past it, "
                   "each with all 3 replicas")
    # Had the run waited, the survivors' first commit alone (2.4 s after the stop) is the figure.
    hang["steps"] += [{"step": 51, "time": T0 + 7.4, "world_size": REPLICAS - 1},
                      {"step": 52, "time": T0 + 7.5, "world_size": REPLICAS - 1}]
    detect_s, why = recovery.hang_detection(hang, REPLICAS)
    assert detect_s == pytest.approx(2.4) and why is None


def test_analysis_of_the_crashed_case_names_the_missing_figure(tmp_path):
    data = recovery.analyze(_runs(_crashed_case()), _options(tmp_path))
    assert data["hang_detect_s"] is None
    assert set(data["not_measured"]) == {"hang_detect_s"}
    hung = [t for t in data["targets"] if t["target"].startswith("hung")]
    assert hung == [{"target": hung[0]["target"], "measured": "not measured", "met": False,
                     "why": data["not_measured"]["hang_detect_s"]}]
    assert any(note.startswith("Not measured: hang_detect_s: no step committed") for note in data["notes"])
    # The rest is measured as usual, and the table and figure draw.
    assert data["steps_lost"] == 0 and data["heal_bytes"] == 4096 and data["goodput_fraction"] == 1.0
    assert "| 1.000 | 1.000 | - |" in recovery.table(data)
    recovery.plot({**data, "experiment": "recovery"}, str(tmp_path / "recovery.png"))
    assert os.path.getsize(tmp_path / "recovery.png") > 0


def _fake_runs(monkeypatch, runs, fail_at=None):
    """recovery's runs replaced by `runs`, in its order; the one named `fail_at` raises."""
    def returning(*names):
        pending = list(names)

        def fake(*args, **kwargs):
            name = pending.pop(0)
            if name == fail_at:
                raise RuntimeError(f"recovery: the {name} run failed")
            return runs[name]
        return fake

    monkeypatch.setattr(recovery, "run_fault_tolerant", returning("ft_clean", "ft", "hang"))
    monkeypatch.setattr(recovery, "run_restart", returning("restart_clean", "restart"))
    monkeypatch.setattr(recovery, "measure_loopback", returning("probe"))


def test_a_failing_analysis_still_writes_the_finished_runs(tmp_path, monkeypatch):
    runs = _runs(_crashed_case())
    _fake_runs(monkeypatch, runs)

    def failing_analysis(runs, options):
        raise IndexError("list index out of range")

    monkeypatch.setattr(recovery, "analyze", failing_analysis)
    with pytest.raises(Incomplete, match="figures"):
        runner.run_experiment(_options(tmp_path), "python -m benchmarks recovery --quick")

    assert not (tmp_path / "recovery.json").exists()  # an earlier complete result would stay as it was
    written = results.read_result(str(tmp_path), "recovery.incomplete")
    assert written["runs"] == runs  # every run, series included
    assert written["not_measured"] == {"figures": "not computed: IndexError: list index out of range"}
    assert written["command"] == "python -m benchmarks recovery --quick"
    assert "load_average_at_end" in written["machine"]


def test_a_failing_run_still_writes_the_runs_before_it(tmp_path, monkeypatch):
    runs = _runs(_crashed_case())
    _fake_runs(monkeypatch, runs, fail_at="ft")
    with pytest.raises(Incomplete):
        runner.run_experiment(_options(tmp_path), "python -m benchmarks recovery --quick")

    written = results.read_result(str(tmp_path), "recovery.incomplete")
    assert set(written["runs"]) == {"ft_clean", "restart_clean"}
    why = "RuntimeError: recovery: the ft run failed"
    assert written["not_measured"] == {**{name: f"not run: {why}" for name in ("ft", "restart", "hang", "probe")},
                                       "figures": f"not computed: {why}"}
