"""breakdown [paper Fig. 5]: forward, backward and optimizer time, with and without overlap.

ddp_ext's DDP measured twice: overlapping each bucket's allreduce with the rest
of the backward pass (its normal mode), and with
`set_overlap_with_backward(False)`, which holds every allreduce until the
backward pass has finished. torch's DDP (which always overlaps) and local
training run interleaved with them. As in the paper, each model's times are
normalised by the total of the non-overlapping run. The backward time of local
training is the computation alone, so the non-overlapping backward minus it
estimates the communication.
"""

from benchmarks.harness import stats
from benchmarks.harness.interleave import merge_ranks
from benchmarks.harness.launcher import launch
from benchmarks.harness.options import BenchOptions
from benchmarks.reporting import figures, markdown
from benchmarks.workloads.presets import Workload
from benchmarks.workloads.replicas import LOCAL, OURS, TORCH, make_replica
from benchmarks.workloads.side_by_side import measure_models
from benchmarks.workloads.training_step import PHASES, TrainingStep

NAME = "breakdown"
FIGURE = "Fig. 5"
TITLE = "Per-iteration latency breakdown, with and without overlap"

NO_OVERLAP = "ours_no_overlap"
OVERLAP = "ours_overlap"
VARIANTS = (NO_OVERLAP, OVERLAP, TORCH, LOCAL)
LABELS = {NO_OVERLAP: "ddp_ext, no overlap", OVERLAP: "ddp_ext, overlap", TORCH: "torch DDP", LOCAL: "local"}
PHASE_COLORS = {"forward": "tab:green", "backward": "tab:blue", "communication": "tab:red",
                "optimizer": "tab:purple"}


def _replica(variant, workload, seed, cap):
    if variant == LOCAL or variant == TORCH:
        return make_replica(variant, workload, seed, cap)
    ddp = make_replica(OURS, workload, seed, cap)
    ddp.set_overlap_with_backward(variant == OVERLAP)
    return ddp


def _variants(workload, batch, seed, cap):
    return {v: TrainingStep(_replica(v, workload, seed, cap), batch) for v in VARIANTS}


def _measure(rank, world_size, job):
    return measure_models(rank, job, _variants)


def _model_result(merged, workload) -> dict:
    phases_ms = {v: {p: stats.median_ms(merged[v], p) for p in (*PHASES, "total")} for v in VARIANTS}
    reference = phases_ms[NO_OVERLAP]["total"]
    return {
        "phases_ms": phases_ms,
        "normalised": {v: {p: ms / reference for p, ms in phases.items()} for v, phases in phases_ms.items()},
        "communication_estimate_ms": phases_ms[NO_OVERLAP]["backward"] - phases_ms[LOCAL]["backward"],
        "overlap_speedup": stats.ratio(merged[NO_OVERLAP], merged[OVERLAP]),
        "overlap_vs_torch": stats.ratio(merged[OVERLAP], merged[TORCH]),
        "summary": {v: stats.summarize(merged[v]) for v in VARIANTS},
        "workload": workload.describe(),
    }


def run(options: BenchOptions, progress) -> dict:
    options.single_bucket_cap()
    per_rank = launch(_measure, options.world_size, (options, progress), options.threads, options.timeout_s)
    models = {m: _model_result(merge_ranks([r[m] for r in per_rank]), Workload(m, options.preset))
              for m in options.models}
    notes = [
        "Phase columns are medians of each phase on its own, so they need not add up to the total's median.",
        "normalised total: total / total of ddp_ext without overlap (the paper's normalisation).",
        "overlap speedup = median total without overlap / with overlap [range over block pairs].",
        "communication estimate = backward without overlap - backward of local training.",
    ]
    return {"models": models, "notes": notes}


def table(data: dict) -> str:
    rows = []
    for model, r in data["models"].items():
        for v in VARIANTS:
            phases = r["phases_ms"][v]
            rows.append([f"{model}: {LABELS[v]}", *(markdown.ms(phases[p]) for p in (*PHASES, "total")),
                         markdown.ratio(r["normalised"][v]["total"])])
        rows.append([f"{model}: overlap speedup", "", "", "", "", markdown.ratio_spread(r["overlap_speedup"])])
        rows.append([f"{model}: communication estimate (ms)", "", markdown.ms(r["communication_estimate_ms"]),
                     "", "", ""])
    headers = ["model: variant", "forward ms", "backward ms", "optimizer ms", "total ms", "normalised total"]
    return markdown.table(headers, rows)


def _segments(r: dict, variant: str) -> list:
    """(label, normalised height) from bottom to top of one bar."""
    n = r["normalised"][variant]
    if variant == NO_OVERLAP:
        local_backward = r["normalised"][LOCAL]["backward"]
        return [("forward", n["forward"]), ("backward", local_backward),
                ("communication", max(0.0, n["backward"] - local_backward)), ("optimizer", n["optimizer"])]
    return [("forward", n["forward"]), ("backward", n["backward"]), ("optimizer", n["optimizer"])]


def plot(data: dict, path: str) -> None:
    figure, axes = figures.panels(len(data["models"]), width_per_panel=6.0)
    for ax, (model, r) in zip(axes, data["models"].items()):
        for x, variant in enumerate(VARIANTS):
            bottom = 0.0
            for phase, height in _segments(r, variant):
                ax.bar(x, height, bottom=bottom, color=PHASE_COLORS[phase], label=phase if x == 0 else None)
                bottom += height
        ax.set_xticks(range(len(VARIANTS)), [LABELS[v].replace(", ", "\n") for v in VARIANTS])
        ax.set_ylabel("latency / total without overlap")
        ax.set_title(f"{model}: overlap speedup {r['overlap_speedup']['ratio']:.2f}x")
        ax.legend(fontsize="small")
    figures.save(figure, path, f"{TITLE} ({data['options']['world_size']} ranks)")
