"""recovery [no paper figure; docs/FAULT_TOLERANCE.md]: training through
failures with ddp_ext.fault_tolerance, beside torch's answer (torchrun
--max-restarts restarting every worker from a checkpoint), same model, same
failure schedule.

--world-size replicas (3 in the published run) of the MLP of
ddp_ext/bench/workloads/recovery_replica.py, one process each, over Gloo on
this host. Fault tolerant: a coordinator process; the last replica is
SIGKILLed at each step of the schedule and started again at once (as its own
torchrun agent would); then a separate run SIGSTOPs it once. Restart: one
`torchrun --nproc_per_node=N --max-restarts`, rank 0 checkpointing every
CHECKPOINT_EVERY steps, the last rank SIGKILLed at the same steps.

Figures (top-level keys of recovery.json): kill_to_commit_s (median over the
kills: from the SIGKILL to the first committed step beyond the last one before
it), hang_detect_s (SIGSTOP to the survivors' next commit), heartbeat_timeout_s,
heal_s and heal_bytes (a replacement receiving the state), loopback_bytes_per_s
(what that heal achieved: bytes over seconds, point to point over Gloo on
loopback), steps_lost (steps computed again after a failure), goodput_fraction
and restart_baseline_goodput_fraction ((steps - 1) x the run's median step
time, over the wall time from its first to its last step).
"""

import statistics
import tempfile

from ddp_ext.bench.harness.options import BenchOptions
from ddp_ext.bench.reporting import figures, markdown
from ddp_ext.bench.workloads.recovery import run_fault_tolerant, run_restart

NAME = "recovery"
FIGURE = "none"
TITLE = "Recovery: training through failures, beside torchrun restarts from checkpoints"

STEPS = 1200
# Halfway between checkpoints: a restart loses CHECKPOINT_EVERY / 2 steps, its average.
KILL_AT = (325, 625, 925)
CHECKPOINT_EVERY = 50
HEARTBEAT_S = 2.0
STOP_AT = 100
STOP_RUN_STEPS = 200


def _summarize(run: dict, steps: int) -> dict:
    records = run["steps"]
    progress = []
    for kill in run["kills"]:
        after = [r for r in records if r["time"] > kill["time"] and r["step"] > kill["after_step"]]
        progress.append(after[0]["time"] - kill["time"])
    intervals = [b["time"] - a["time"] for a, b in zip(records, records[1:]) if b["step"] == a["step"] + 1]
    step_s = statistics.median(intervals)
    wall = records[-1]["time"] - records[0]["time"]
    return {
        "kills": len(run["kills"]),
        "kill_to_progress_s": progress,
        "steps_redone": len(records) - len({r["step"] for r in records}),
        "median_step_s": step_s,
        "wall_s": wall,
        "goodput_fraction": (steps - 1) * step_s / wall,
        "timeline": [(r["time"] - records[0]["time"], r["step"]) for r in records],
        "kill_times": [k["time"] - records[0]["time"] for k in run["kills"]],
    }


def run(options: BenchOptions, progress) -> dict:
    if options.world_size < 2:
        raise ValueError("recovery needs --world-size 2 or more: one replica is killed, the others go on")
    quick = options.blocks <= 2  # --quick: half the steps and one kill
    steps = STEPS // 2 if quick else STEPS
    kill_at = list(KILL_AT[:1] if quick else KILL_AT)
    n = options.world_size
    with tempfile.TemporaryDirectory() as tmp:
        progress.say(f"fault tolerant: {n} replicas, {steps} steps, the last killed at {kill_at}")
        ft = run_fault_tolerant(tmp, n, steps, kill_at, HEARTBEAT_S)
        progress.say(f"torchrun --max-restarts: {steps} steps, checkpoint every {CHECKPOINT_EVERY}, kills at {kill_at}")
        restart = run_restart(tmp, n, steps, kill_at, CHECKPOINT_EVERY)
    progress.say(f"fault tolerant with the last replica SIGSTOPped at step {STOP_AT}")
    with tempfile.TemporaryDirectory() as tmp:
        hang = run_fault_tolerant(tmp, n, STOP_RUN_STEPS, [], HEARTBEAT_S, stop_at=STOP_AT)
    ft_summary, restart_summary = _summarize(ft, steps), _summarize(restart, steps)
    stop = hang["stop"]
    after_stop = [r for r in hang["steps"] if r["time"] > stop["time"] and r["step"] > stop["after_step"]]
    notes = [
        f"{steps} steps of a {n}-replica MLP (width 512), global batch 96; the last replica SIGKILLed when r0 had "
        f"committed steps {kill_at}. Restart baseline: one torchrun job, rank 0 checkpointing every "
        f"{CHECKPOINT_EVERY} steps. Goodput: (steps - 1) x the run's own median step time over its wall time "
        "from first to last step; the two runs' step times differ (the fault-tolerant step adds a vote and a "
        "decision through the coordinator's store), so both medians are in the table.",
        f"Heartbeat timeout {HEARTBEAT_S} s (also the collective timeout). hang_detect_s: from SIGSTOP at step "
        f"{STOP_AT} to the survivors' next committed step.",
    ]
    return {
        "kill_to_commit_s": statistics.median(ft_summary["kill_to_progress_s"]),
        "hang_detect_s": after_stop[0]["time"] - stop["time"],
        "heartbeat_timeout_s": HEARTBEAT_S,
        "heal_s": ft["heal_s"],
        "heal_bytes": ft["heal_bytes"],
        "loopback_bytes_per_s": ft["heal_bytes"] / ft["heal_s"] if ft["heal_s"] else None,
        "steps_lost": ft_summary["steps_redone"],
        "goodput_fraction": ft_summary["goodput_fraction"],
        "restart_baseline_goodput_fraction": restart_summary["goodput_fraction"],
        "restart_baseline_steps_lost": restart_summary["steps_redone"],
        "fault_tolerant": ft_summary,
        "restart_baseline": restart_summary,
        "steps": steps,
        "kill_at": kill_at,
        "replicas": n,
        "notes": notes,
    }


def run_line(data: dict) -> str:
    return (f"One run of each, {data['replicas']} replicas: {data['steps']} steps, the last replica SIGKILLed at "
            f"steps {data['kill_at']}; then one fault-tolerant run with it SIGSTOPped.")


def table(data: dict) -> str:
    rows = []
    for label, s in (("ddp_ext.fault_tolerance", data["fault_tolerant"]),
                     ("torchrun --max-restarts + checkpoints", data["restart_baseline"])):
        p = s["kill_to_progress_s"]
        rows.append([label, f"{s['median_step_s'] * 1e3:.1f}", s["kills"],
                     f"{statistics.median(p):.2f} ({max(p):.2f})" if p else "-", s["steps_redone"],
                     f"{s['wall_s']:.1f}", f"{s['goodput_fraction']:.3f}"])
    first = markdown.table(["", "median step ms", "kills", "kill to progress s, median (max)", "steps lost",
                            "wall s", "goodput"], rows)
    second = markdown.table(["hang (SIGSTOP) to next commit s", "heartbeat timeout s", "heal bytes", "heal s",
                             "heal bytes/s"],
                            [[f"{data['hang_detect_s']:.2f}", data["heartbeat_timeout_s"], data["heal_bytes"],
                              f"{data['heal_s']:.4f}", f"{data['loopback_bytes_per_s'] / 1e6:.0f} MB/s"]])
    return first + "\n\n" + second


def plot(data: dict, path: str) -> None:
    figure, (ax,) = figures.panels(1, width_per_panel=8.0)
    for label, key, color in (("ddp_ext.fault_tolerance", "fault_tolerant", figures.COLORS["ours"]),
                              ("torchrun --max-restarts", "restart_baseline", figures.COLORS["torch"])):
        s = data[key]
        t, step = zip(*s["timeline"])
        ax.plot(t, step, ".", markersize=2, color=color, label=label)
        for k in s["kill_times"]:
            ax.axvline(k, color=color, linestyle=":", linewidth=1)
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("step")
    ax.legend(fontsize="small")
    figures.save(figure, path, TITLE)
