"""recovery [no paper figure; docs/FAULT_TOLERANCE.md]: training through
failures with ddp_ext.fault_tolerance, beside torch's answer (torchrun
--max-restarts restarting every worker from a checkpoint), same model, same
failure schedule, each against a fault-free run of its own system.

--world-size replicas (3 in the published run) of the MLP of
benchmarks/workloads/recovery_replica.py, one process each, over Gloo on
this host, each run for WINDOW_S seconds from its first step. Fault
tolerant: a coordinator process; the last replica is SIGKILLed every
FAILURE_EVERY_S seconds, half a period into each, and started again at once
(as its own torchrun agent would). Restart: one `torchrun
--nproc_per_node=N --max-restarts`, rank 0 checkpointing every
CHECKPOINT_EVERY steps, the last rank SIGKILLed at the same times. Runs, in
order: each system fault-free, each with the failures; then a fault-tolerant
run with the last replica SIGSTOPped once; then the loopback probe
(benchmarks/workloads/loopback_probe.py) with the heal's size.

Figures (top-level keys of recovery.json): kill_to_commit_s (median over the
kills: from the SIGKILL to the survivors' next committed step beyond the last
one before it), hang_detect_s (SIGSTOP to the survivors' first commit
without the stopped replica), heartbeat_timeout_s, heal_s and heal_bytes (the last replacement receiving
the state), loopback_bytes_per_s (the probe: the heal's bytes sent once over
Gloo on loopback, median of 5), steps_lost (committed steps the fault-tolerant
run computed twice or lost), goodput_fraction and
restart_baseline_goodput_fraction (committed samples per minute over the
window, with the failures, over the same for the same system fault-free), and
targets (each target of docs/FAULT_TOLERANCE.md, met or not). A figure the
runs did not yield is None, and `not_measured` says why; if a run or the
analysis fails, the runs finished are written to recovery.incomplete.json
(Note [Finished runs are written] in benchmarks/harness/finished_runs.py).
"""

import statistics
import tempfile
from typing import Optional, Tuple

from benchmarks.harness.finished_runs import FinishedRuns
from benchmarks.harness.options import BenchOptions
from benchmarks.reporting import figures, markdown
from benchmarks.workloads.loopback_probe import measure as measure_loopback
from benchmarks.workloads.recovery import (first_commit_without, progress_at, progress_series, run_fault_tolerant,
                                           run_restart, steps_past)
from benchmarks.workloads.recovery_replica import GLOBAL_BATCH

NAME = "recovery"
FIGURE = "none"
TITLE = "Recovery: training through failures, beside torchrun restarts from checkpoints"

FAILURE_EVERY_S = 60.0
# The shortest run with 3 failures 60 s apart: three periods, each failure half a period in.
FAILURES = 3
WINDOW_S = FAILURE_EVERY_S * FAILURES
QUICK_FAILURE_EVERY_S = 6.0
CHECKPOINT_EVERY = 50
HEARTBEAT_S = 2.0
STOP_AT_S = 5.0
BIN_S = 10.0  # goodput over time: committed samples per minute in bins this long (--quick: 1 s)

KILL_TO_COMMIT_TARGET_S = 1.0
HANG_SLACK_S = 1.0
HEAL_SLACK_S = 1.0
GOODPUT_TARGET = 0.90
# The runs, in the order they run: each system fault-free, each with the
# kills, the SIGSTOP run, the loopback probe.
RUNS = ("ft_clean", "restart_clean", "ft", "restart", "hang", "probe")


def _summarize(run: dict, window_s: float) -> dict:
    t0, end = run["t0"], run["t0"] + window_s
    records = [r for r in run["steps"] if r["time"] <= end]
    progress = []
    for kill in run["kills"]:
        # A restarted job may still record a step or two before it notices the
        # kill: its progress counts from its resumption, the next start after the kill.
        resumed = [r["time"] for r in run.get("resumed", []) if r["time"] > kill["time"]]
        since = resumed[0] if resumed else kill["time"]
        after = [r for r in run["steps"] if r["time"] > since and r["step"] > kill["after_step"]]
        progress.append(after[0]["time"] - kill["time"] if after else None)
    intervals = [b["time"] - a["time"] for a, b in zip(records, records[1:]) if b["step"] == a["step"] + 1]
    committed = progress_at(run["steps"], end)
    return {
        "kills": len(run["kills"]),
        "kill_times": [k["time"] - t0 for k in run["kills"]],
        "kill_to_progress_s": progress,
        "steps_redone": len(records) - len({r["step"] for r in records}),
        "steps_missing": len(set(range(committed)) - {r["step"] for r in records}),
        "median_step_s": statistics.median(intervals) if intervals else None,
        "committed_steps": committed,
        "samples_per_min": committed * GLOBAL_BATCH / (window_s / 60.0),
        "progress": progress_series(run["steps"], t0, window_s),
    }


def _targets(data: dict) -> list:
    """(target, measured, met, why) for each target of docs/FAULT_TOLERANCE.md."""
    ft, restart = data["fault_tolerant"], data["restart_baseline"]
    kills = [p for p in ft["kill_to_progress_s"] if p is not None]
    worst = max(kills) if kills else None
    hang_bound = data["heartbeat_timeout_s"] + HANG_SLACK_S
    bw = data["loopback_bytes_per_s"]
    hang = data["hang_detect_s"]
    heal_bound = 2 * data["heal_bytes"] / bw + HEAL_SLACK_S if data["heal_bytes"] and bw else None
    rows = [
        ("kill to the survivors' next committed step <= 1 s",
         f"median {data['kill_to_commit_s']:.2f} s, max {worst:.2f} s over {len(kills)} kills" if kills else "-",
         bool(kills) and worst <= KILL_TO_COMMIT_TARGET_S,
         "the dead process's connections close at once: the collective raises and the coordinator drops it"
         if kills else "no kill was followed by a commit within the run"),
        (f"hung replica dropped within heartbeat timeout + 1 s ({hang_bound:g} s)",
         f"{hang:.2f} s to the next commit" if hang is not None else "not measured",
         hang is not None and hang <= hang_bound,
         "the collective and the coordinator both wait out the heartbeat timeout" if hang is not None
         else data["not_measured"]["hang_detect_s"]),
        ("heal within 2 x bytes / loopback bandwidth + 1 s",
         f"{data['heal_s']:.3f} s for {data['heal_bytes']:,} bytes; bound {heal_bound:.3f} s "
         f"(loopback {bw / 1e6:.0f} MB/s)" if heal_bound else "no heal recorded",
         heal_bound is not None and data["heal_s"] <= heal_bound,
         "one point-to-point send of the serialized state over the new group"),
        ("zero committed steps lost", f"{data['steps_lost']} (restart baseline: {restart['steps_redone']} redone)",
         data["steps_lost"] == 0, "a step is applied on all of its quorum or none; survivors keep theirs"),
        (f"goodput >= {GOODPUT_TARGET:.0%} of fault-free, failure every {data['failure_every_s']:g} s",
         f"{data['goodput_fraction']:.3f} (restart baseline: {data['restart_baseline_goodput_fraction']:.3f})",
         data["goodput_fraction"] >= GOODPUT_TARGET,
         ("above 1: the load changed between this run and its fault-free partner more than the failures "
          "cost (compare the median step times); " if data["goodput_fraction"] > 1 else "")
         + ("survivors go on at once; the replacement's start-up runs beside them"
            if data["goodput_fraction"] >= GOODPUT_TARGET else
            "lost to the kills, and to the machine's load changing between the runs (see the notes)")),
    ]
    return [{"target": t, "measured": m, "met": bool(ok), "why": w} for t, m, ok, w in rows]


def _schedule(options: BenchOptions) -> Tuple[float, int, float, list]:
    """(failure every s, failures, window s, kill times s) of a run with these options."""
    every = QUICK_FAILURE_EVERY_S if options.quick else FAILURE_EVERY_S
    failures = 1 if options.quick else FAILURES
    return every, failures, every * failures, [every * (i + 0.5) for i in range(failures)]


def hang_detection(hang: dict, replicas: int) -> Tuple[Optional[float], Optional[str]]:
    """(seconds from the SIGSTOP to the survivors' first step committed
    without the stopped replica, None) from the SIGSTOP run; (None, why) if
    they committed none. The first steps past the stop may still commit with
    it: it voted for them before it stopped."""
    stop = hang["stop"]
    alone = first_commit_without(hang["steps"], stop, replicas)
    if alone is not None:
        return alone["time"] - stop["time"], None
    past = steps_past(hang["steps"], stop)
    return None, (f"no step committed without the stopped replica within {stop['wait_limit_s']:g} s of the "
                  f"SIGSTOP; {len(past)} step(s) past it, each with all {replicas} replicas")


def run(options: BenchOptions, progress) -> dict:
    if options.world_size < 2:
        raise ValueError("recovery needs --world-size 2 or more: one replica is killed, the others go on")
    _, _, window, kill_at = _schedule(options)
    n = options.world_size
    finished = FinishedRuns(RUNS)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            progress.say(f"fault tolerant, fault-free: {n} replicas, {window:g} s")
            finished.keep("ft_clean", run_fault_tolerant(tmp, n, window, [], HEARTBEAT_S))
            progress.say(f"torchrun --max-restarts, fault-free: {window:g} s, checkpoint every {CHECKPOINT_EVERY} "
                         "steps")
            finished.keep("restart_clean", run_restart(tmp, n, window, [], CHECKPOINT_EVERY))
            progress.say(f"fault tolerant: the last replica killed at {kill_at} s and started again")
            ft = finished.keep("ft", run_fault_tolerant(tmp, n, window, kill_at, HEARTBEAT_S))
            progress.say(f"torchrun --max-restarts: the last rank killed at {kill_at} s")
            finished.keep("restart", run_restart(tmp, n, window, kill_at, CHECKPOINT_EVERY))
        progress.say(f"fault tolerant with the last replica SIGSTOPped {STOP_AT_S:g} s in")
        with tempfile.TemporaryDirectory() as tmp:
            finished.keep("hang", run_fault_tolerant(tmp, n, STOP_AT_S, [], HEARTBEAT_S, stop_at_s=STOP_AT_S))
        progress.say(f"loopback probe: {ft['heal_bytes']} bytes over Gloo, 5 times")
        finished.keep("probe", measure_loopback(ft["heal_bytes"]) if ft["heal_bytes"] else None)
        return analyze(finished.runs, options)
    except Exception as error:
        raise finished.incomplete(error) from error


def analyze(runs: dict, options: BenchOptions) -> dict:
    """The result's payload from the finished runs (by the names of RUNS)."""
    every, failures, window, kill_at = _schedule(options)
    n = options.world_size
    ft, probe = runs["ft"], runs["probe"]
    summaries = {name: _summarize(runs[name], window) for name in ("ft", "ft_clean", "restart", "restart_clean")}
    hang_detect_s, hang_why = hang_detection(runs["hang"], n)
    not_measured = {"hang_detect_s": hang_why} if hang_why else {}
    kills = [p for p in summaries["ft"]["kill_to_progress_s"] if p is not None]
    data = {
        "kill_to_commit_s": statistics.median(kills) if kills else None,
        "hang_detect_s": hang_detect_s,
        "heartbeat_timeout_s": HEARTBEAT_S,
        "heal_s": ft["heal_s"],
        "heal_bytes": ft["heal_bytes"],
        "loopback_bytes_per_s": probe["bytes_per_s"] if probe else None,
        "steps_lost": summaries["ft"]["steps_redone"] + summaries["ft"]["steps_missing"],
        "goodput_fraction": summaries["ft"]["samples_per_min"] / summaries["ft_clean"]["samples_per_min"],
        "restart_baseline_goodput_fraction":
            summaries["restart"]["samples_per_min"] / summaries["restart_clean"]["samples_per_min"],
        "restart_baseline_steps_lost": summaries["restart"]["steps_redone"],
        "loopback_probe": probe,
        "fault_tolerant": summaries["ft"],
        "fault_tolerant_fault_free": summaries["ft_clean"],
        "restart_baseline": summaries["restart"],
        "restart_baseline_fault_free": summaries["restart_clean"],
        "window_s": window,
        "failure_every_s": every,
        "kill_at_s": kill_at,
        "replicas": n,
        "global_batch": GLOBAL_BATCH,
        "not_measured": not_measured,
    }
    data["targets"] = _targets(data)
    data["notes"] = [
        f"Goodput: committed samples per minute over the {window:g} s from a run's first step: the steps the run "
        f"holds at the window's end (a restarted job holds only what it re-reached from its checkpoint) x the "
        f"global batch ({GLOBAL_BATCH}), / {window / 60:g} min. goodput_fraction divides the fault-tolerant run's "
        "by a fault-free fault-tolerant run's of the same length; the restart baseline's divides the torchrun "
        "job's by a fault-free torchrun job's.",
        f"The failure schedule asked for is a failure every {every:g} s; the shortest run with {failures} such "
        f"failures is {window:g} s, each failure half a period in ({kill_at} s).",
        f"Heartbeat timeout {HEARTBEAT_S:g} s (also the collective timeout). hang_detect_s: from SIGSTOP "
        f"{STOP_AT_S:g} s into a separate run to the survivors' first step committed without the stopped replica "
        "(a step it voted for before it stopped may still commit with it).",
        "The four runs follow each other on a shared 2-core machine: a change of load between a run and its "
        "fault-free partner moves its goodput fraction as much as the failures do, either way (see the "
        "median step times).",
        *(f"Not measured: {name}: {why}." for name, why in not_measured.items()),
    ]
    return data


def run_line(data: dict) -> str:
    return (f"Four runs of {data['window_s']:g} s, {data['replicas']} replicas: each system fault-free, then each "
            f"with the last replica SIGKILLed at {data['kill_at_s']} s; then one fault-tolerant run with it "
            "SIGSTOPped; then the loopback probe.")


def _s(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(data: dict) -> str:
    rows = []
    for label, key in (("ddp_ext.fault_tolerance", "fault_tolerant"),
                       ("ddp_ext.fault_tolerance, fault-free", "fault_tolerant_fault_free"),
                       ("torchrun --max-restarts + checkpoints", "restart_baseline"),
                       ("torchrun --max-restarts, fault-free", "restart_baseline_fault_free")):
        s = data[key]
        p = [x for x in s["kill_to_progress_s"] if x is not None]
        rows.append([label, markdown.ms(s["median_step_s"] * 1e3 if s["median_step_s"] else None), s["kills"],
                     f"{statistics.median(p):.2f} ({max(p):.2f})" if p else "-", s["steps_redone"],
                     s["committed_steps"], f"{s['samples_per_min']:.0f}"])
    first = markdown.table(["", "median step ms", "kills", "kill to progress s, median (max)", "steps redone",
                            "steps held at the end", "committed samples/min"], rows)
    second = markdown.table(
        ["goodput fraction (vs own fault-free)", "restart baseline's", "hang (SIGSTOP) to next commit s",
         "heartbeat timeout s", "heal bytes", "heal s", "loopback probe"],
        [[f"{data['goodput_fraction']:.3f}", f"{data['restart_baseline_goodput_fraction']:.3f}",
          _s(data["hang_detect_s"]), f"{data['heartbeat_timeout_s']:g}",
          f"{data['heal_bytes']:,}" if data["heal_bytes"] else "-",
          f"{data['heal_s']:.4f}" if data["heal_s"] is not None else "-",
          f"{data['loopback_bytes_per_s'] / 1e6:.0f} MB/s" if data["loopback_bytes_per_s"] else "-"]])
    targets = markdown.table(["target", "measured", "met", "why"],
                             [[t["target"], t["measured"], "met" if t["met"] else "**not met**", t["why"]]
                              for t in _targets(data)])
    return first + "\n\n" + second + "\n\n" + targets


def _goodput_bins(series, batch: int, bin_s: float):
    """(bin middle s, committed samples per minute in the bin) from (t, steps held) per second."""
    held = dict(series)
    end = series[-1][0]
    out, t = [], 0.0
    while t + bin_s <= end + 1e-9:
        out.append((t + bin_s / 2, (held[t + bin_s] - held[t]) * batch * 60.0 / bin_s))
        t += bin_s
    return out


def plot(data: dict, path: str) -> None:
    figure, (held, rate) = figures.panels(2, width_per_panel=7.0)
    batch = data["global_batch"]
    bin_s = BIN_S if data["window_s"] >= 6 * BIN_S else 1.0
    for label, key, color, style in (
            ("ddp_ext.fault_tolerance", "fault_tolerant", figures.COLORS["ours"], "-"),
            ("ddp_ext.fault_tolerance, fault-free", "fault_tolerant_fault_free", figures.COLORS["ours"], "--"),
            ("torchrun --max-restarts", "restart_baseline", figures.COLORS["torch"], "-"),
            ("torchrun --max-restarts, fault-free", "restart_baseline_fault_free", figures.COLORS["torch"], "--")):
        series = [tuple(p) for p in data[key]["progress"]]
        t, steps = zip(*series)
        held.plot(t, [s * batch for s in steps], style, color=color, label=label, linewidth=1.2)
        bins = _goodput_bins(series, batch, bin_s)
        if bins:
            bt, g = zip(*bins)
            rate.plot(bt, g, style, marker=".", color=color, label=label, linewidth=1.2)
    for ax in (held, rate):
        for i, k in enumerate(data["fault_tolerant"]["kill_times"]):
            ax.axvline(k, color="tab:red", linestyle=":", linewidth=1, label="SIGKILL" if i == 0 else None)
        ax.set_xlabel("seconds since the run's first step")
    held.set_ylabel("committed samples held")
    rate.set_ylabel(f"committed samples / min, {bin_s:g} s bins")
    held.legend(fontsize="small")
    figures.save(figure, path, TITLE)
