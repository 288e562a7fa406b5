"""faults [no paper figure; docs/RELIABILITY.md]: what the other ranks see
when one rank dies or raises, and memory over a long run, for ddp_ext and
torch's DDP side by side.

Every repetition runs each fault of fault_injection.FAULTS once per DDP (the
DDP measured first alternating) in a fresh world of `--world-size` ranks over
Gloo whose process groups time out after PG_TIMEOUT_S; rank 1 is the victim.
Recorded per run: every survivor's time from the fault to its error, the
error's first line, and anything that went wrong (a survivor that hung,
crashed or finished). Then one soak per DDP: `--soak-iterations` iterations
of the same MLP on every rank, RSS sampled every SAMPLE_EVERY iterations.
"""

import collections
import re

import numpy as np

from benchmarks.harness.interleave import rotated
from benchmarks.harness.options import BenchOptions
from benchmarks.reporting import figures, markdown
from benchmarks.workloads.fault_injection import FAULTS, WRAPPERS, run_fault
from benchmarks.workloads.fault_worlds import run_world
from benchmarks.workloads.soak import SoakJob, slope_per_100, soak

NAME = "faults"
FIGURE = "none"
TITLE = "Faults: the survivors' time to error, and memory over a long run"
RUN_LENGTHS = {"blocks": 5}  # repetitions of every (fault, DDP)

PG_TIMEOUT_S = 20.0
VICTIM = 1
SAMPLE_EVERY = 20
SOAK_DEADLINE_S = 3600.0
LABELS = {"ddp_ext": "ddp_ext", "torch": "torch DDP"}


def error_kind(line: str) -> str:
    """An error's first sentence without source paths and peer addresses,
    so that the same error reads the same from run to run."""
    line = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", line)
    line = re.sub(r"\[[0-9a-fA-F.:]+\]:\d+", "[peer]", line)
    return line.split(". ")[0].rstrip(".")


def _record(run) -> dict:
    return {
        "times_s": run.times_to_error(),
        "errors": [e["error"] for e in run.errors()],
        "error_types": [e["error_type"] for e in run.errors()],
        "phases": [e["phase"] for e in run.errors()],
        "problems": run.problems(),
    }


def _summarize_fault(records) -> dict:
    times = [t for r in records for t in r["times_s"]]
    kinds = collections.Counter(f"{k}: {error_kind(e)}" for r in records for k, e in zip(r["error_types"], r["errors"]))
    return {
        "runs": len(records),
        "survivors_raised": len(times),
        "median_s": float(np.median(times)) if times else None,
        "max_s": max(times) if times else None,
        "errors": dict(kinds.most_common()),
        "runs_with_problems": sum(bool(r["problems"]) for r in records),
    }


def _soak(wrapper: str, options: BenchOptions) -> dict:
    job = SoakJob(wrapper, options.soak_iterations, SAMPLE_EVERY)
    outcomes = run_world(soak, options.world_size, job, PG_TIMEOUT_S, SOAK_DEADLINE_S)
    ranks = []
    for o in outcomes:
        if not o.returned:
            ranks.append({"rank": o.rank, "problem": f"exit {o.exitcode}: {o.error}"})
            continue
        samples = o.value["samples"]
        ranks.append({
            "rank": o.rank,
            "seconds": o.value["seconds"],
            "rss_start_mib": samples[0][1] / 2**20,
            "rss_end_mib": samples[-1][1] / 2**20,
            "rss_slope_kib_per_100": slope_per_100(samples, 1, options.soak_iterations / 2) / 1024,
            "objects_slope_per_100": slope_per_100(samples, 2, options.soak_iterations / 2),
            "samples": samples,
        })
    return {"iterations": options.soak_iterations, "ranks": ranks}


def run(options: BenchOptions, progress) -> dict:
    if options.world_size < 2:
        raise ValueError("faults needs --world-size 2 or more: one rank fails, the others are watched")
    raw = {fault: {w: [] for w in WRAPPERS} for fault in FAULTS}
    for repetition in range(options.blocks):
        for fault in FAULTS:
            for wrapper in rotated(list(WRAPPERS), repetition):
                run_ = run_fault(wrapper, fault, options.world_size, VICTIM, PG_TIMEOUT_S)
                raw[fault][wrapper].append(_record(run_))
        progress.say(f"repetition {repetition + 1}/{options.blocks} of the faults")
    soaks = {}
    for wrapper in WRAPPERS:
        progress.say(f"soak of {options.soak_iterations} iterations, {wrapper}")
        soaks[wrapper] = _soak(wrapper, options)
    summary = {fault: {w: _summarize_fault(raw[fault][w]) for w in WRAPPERS} for fault in FAULTS}
    notes = [
        f"Process-group timeout {PG_TIMEOUT_S:.0f} s; rank {VICTIM} is the victim, at iteration 3 of a 4-layer "
        "MLP with one bucket per layer (benchmarks/workloads/fault_injection.py). Time to error: from the victim's "
        "fault to each survivor catching its exception (one clock, time.monotonic(), for every process).",
        f"Soak: RSS of each rank every {SAMPLE_EVERY} iterations; slope by least squares over the second half.",
    ]
    return {"faults": summary, "raw": raw, "soak": soaks, "pg_timeout_s": PG_TIMEOUT_S, "victim": VICTIM,
            "notes": notes}


def run_line(data: dict) -> str:
    o = data["options"]
    return (f"{o['blocks']} repetitions of every (fault, DDP) pair, the DDP run first alternating; then a soak of "
            f"{o['soak_iterations']} iterations per DDP.")


def _ms(seconds) -> str:
    return markdown.ms(None if seconds is None else seconds * 1e3)


def table(data: dict) -> str:
    rows = []
    for fault, by_wrapper in data["faults"].items():
        for wrapper, s in by_wrapper.items():
            survivors = data["options"]["world_size"] - 1
            errors = "; ".join(f"{e} (x{n})" for e, n in s["errors"].items()) or "-"
            rows.append([fault, LABELS[wrapper], f"{_ms(s['median_s'])} ({_ms(s['max_s'])})",
                         f"{s['survivors_raised']}/{s['runs'] * survivors}", s["runs_with_problems"], errors])
    faults = markdown.table(["fault", "DDP", "time to error ms, median (max)", "survivors that raised",
                             "runs with problems", "errors (first sentence)"], rows)
    rows = []
    for wrapper, s in data["soak"].items():
        for r in s["ranks"]:
            if "problem" in r:
                rows.append([LABELS[wrapper], r["rank"], "-", "-", "-", "-", r["problem"]])
                continue
            rows.append([LABELS[wrapper], r["rank"], f"{r['rss_start_mib']:.1f}", f"{r['rss_end_mib']:.1f}",
                         f"{r['rss_slope_kib_per_100']:.1f}", f"{r['objects_slope_per_100']:.2f}",
                         f"{r['seconds']:.1f}"])
    iterations = next(iter(data["soak"].values()))["iterations"]
    soaks = markdown.table(["DDP", "rank", "RSS start MiB", f"RSS end MiB ({iterations} it)",
                            "RSS slope, 2nd half, KiB/100 it", "gc objects/100 it", "loop s"], rows)
    return faults + "\n\n" + soaks


def plot(data: dict, path: str) -> None:
    figure, (left, right) = figures.panels(2, width_per_panel=6.0)
    colors = {"ddp_ext": figures.COLORS["ours"], "torch": figures.COLORS["torch"]}
    for i, (fault, by_wrapper) in enumerate(data["raw"].items()):
        for offset, wrapper in ((-0.15, "ddp_ext"), (0.15, "torch")):
            times = [t * 1e3 for r in by_wrapper[wrapper] for t in r["times_s"]]
            left.scatter([i + offset] * len(times), times, color=colors[wrapper], s=12,
                         label=LABELS[wrapper] if i == 0 else None)
    left.set_xticks(range(len(data["raw"])), list(data["raw"]))
    left.set_yscale("log")
    left.set_ylabel("survivor's time to error (ms)")
    left.legend(fontsize="small")
    for wrapper, s in data["soak"].items():
        for r in s["ranks"]:
            if "samples" in r:
                its, rss = zip(*[(x[0], x[1] / 2**20) for x in r["samples"]])
                right.plot(its, rss, color=colors[wrapper], linestyle=("-", "--", ":")[r["rank"] % 3],
                           label=f"{LABELS[wrapper]} rank {r['rank']}")
    right.set_xlabel("iteration")
    right.set_ylabel("RSS (MiB)")
    right.legend(fontsize="small")
    figures.save(figure, path, f"{TITLE} ({data['options']['world_size']} ranks)")
