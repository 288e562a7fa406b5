"""bucket [paper Figs. 6-7]: per-iteration latency against bucket_cap_mb, as box plots.

For every cap, ddp_ext and torch's DDP are built with it and alternate block by
block; the caps themselves run one after another. Cap 0 is the paper's "every
gradient communicated on its own": see options.ONE_PARAMETER_PER_BUCKET_MB.

With --auto, each model then gets one more interleaved run, of ddp_ext only:
its default caps, every cap above, and bucket_cap_mb="auto" (tuned until it
settles before the blocks start), all alternating block by block, so that
auto is compared with the best fixed cap measured beside it.
"""

import time

from benchmarks.harness import stats
from benchmarks.harness.interleave import merge_ranks, run_interleaved
from benchmarks.harness.launcher import launch
from benchmarks.harness.options import BenchOptions, effective_bucket_cap_mb
from benchmarks.harness.product import TuningStage, settled_caps_mb
from benchmarks.reporting import figures, markdown
from benchmarks.workloads.presets import Workload, input_seed
from benchmarks.workloads.replicas import LABELS, OURS, TORCH, make_replica
from benchmarks.workloads.training_step import TrainingStep

NAME = "bucket"
FIGURE = "Figs. 6-7"
TITLE = "Per-iteration latency vs bucket size"
# Seven caps per model: fewer blocks than the default keep preset small within minutes.
RUN_LENGTHS = {"blocks": 5}

KINDS = (OURS, TORCH)
AUTO = "auto"
# Iterations the auto replica may take to settle before the run gives up
# (the default policy needs 126 with seven distinct layouts).
SETTLE_LIMIT = 400


def _cap_label(cap) -> str:
    return "default" if cap is None else f"{cap:g}"


def _measure(rank, world_size, job):
    options, progress = job
    progress = progress.for_rank(rank)
    measured = {}
    for model in options.models:
        workload = Workload(model, options.preset)
        batch = workload.batch(input_seed(options.seed, rank))
        measured[model] = {}
        for cap in options.bucket_cap_mb:
            replicas = {k: make_replica(k, workload, options.seed, effective_bucket_cap_mb(cap)) for k in KINDS}
            variants = {k: TrainingStep(replica, batch) for k, replica in replicas.items()}
            samples = run_interleaved(variants, **options.run_lengths(), progress=progress,
                                      label=f"{model}, bucket_cap_mb {_cap_label(cap)}")
            measured[model][_cap_label(cap)] = (samples, len(replicas[OURS].bucket_indices()))
        if options.auto:
            measured[model][AUTO] = _measure_auto(options, workload, batch, progress, model)
    return measured


def _settle(step: TrainingStep, ddp) -> dict:
    """Steps the auto replica until its tuner settles (at the same iteration
    on every rank: its decisions are agreed)."""
    started = time.perf_counter()
    iterations = 0
    while ddp.bucket_tuner.stage is not TuningStage.SETTLED:
        if iterations == SETTLE_LIMIT:
            raise RuntimeError(f"bucket_cap_mb='auto' did not settle in {SETTLE_LIMIT} iterations")
        step()
        iterations += 1
    return {"iterations": iterations, "seconds": time.perf_counter() - started}


def _measure_auto(options: BenchOptions, workload: Workload, batch, progress, model: str) -> dict:
    caps = [None] + [c for c in options.bucket_cap_mb if c is not None]
    replicas = {_cap_label(c): make_replica(OURS, workload, options.seed, effective_bucket_cap_mb(c)) for c in caps}
    replicas[AUTO] = make_replica(OURS, workload, options.seed, AUTO)
    variants = {k: TrainingStep(replica, batch) for k, replica in replicas.items()}
    tuning = _settle(variants[AUTO], replicas[AUTO])
    settled = settled_caps_mb(replicas[AUTO])
    samples = run_interleaved(variants, **options.run_lengths(), progress=progress,
                              label=f"{model}, ddp_ext fixed caps and auto")
    tuner = replicas[AUTO].bucket_tuner
    return {
        "samples": samples,
        "buckets": {k: len(r.bucket_indices()) for k, r in replicas.items()},
        "tuning": tuning,
        "settled_cap_mb": list(settled),
        "final_cap_mb": list(settled_caps_mb(replicas[AUTO])),
        "history": [[e.iteration, e.kind, list(tuner.policy.candidates_mb[e.candidate]), e.figure]
                    for e in tuner.history],
    }


def _cap_mb_text(caps) -> str:
    """[1, 25] -> "1+25"; [5] -> "5"."""
    return "+".join(f"{c:g}" for c in caps)


def _auto_results(model: str, per_rank: list) -> dict:
    mine = per_rank[0][model][AUTO]
    merged = merge_ranks([r[model][AUTO]["samples"] for r in per_rank])
    medians = {k: stats.median_ms(blocks) for k, blocks in merged.items()}
    best = min((k for k in merged if k != AUTO), key=medians.get)
    # The fixed variant with the caps auto ended on, if the run measured it:
    # auto against it is what timing and agreeing cost, without the choice.
    same = {"1+25": "default"}.get(_cap_mb_text(mine["final_cap_mb"]), _cap_mb_text(mine["final_cap_mb"]))
    return {
        "same_cap_fixed": same if same in merged else None,
        "auto_vs_same_cap": stats.ratio(merged[AUTO], merged[same]) if same in merged else None,
        "auto_ms": medians[AUTO],
        "auto_cap_mb": _cap_mb_text(mine["final_cap_mb"]),
        "best_fixed_ms": medians[best],
        "best_fixed_cap_mb": best,
        "default_ms": medians["default"],
        "auto_vs_best": stats.ratio(merged[AUTO], merged[best]),
        "auto_vs_default": stats.ratio(merged[AUTO], merged["default"]),
        "tuning": mine["tuning"],
        "settled_cap_mb": _cap_mb_text(mine["settled_cap_mb"]),
        "history": mine["history"],
        "buckets": mine["buckets"],
        "summary": {k: stats.summarize(blocks) for k, blocks in merged.items()},
        "samples_ms": {k: stats.values(blocks) for k, blocks in merged.items()},
    }


def run(options: BenchOptions, progress) -> dict:
    per_rank = launch(_measure, options.world_size, (options, progress), options.threads, options.timeout_s)
    models = {}
    for model in options.models:
        caps = {}
        for cap in map(_cap_label, options.bucket_cap_mb):
            merged = merge_ranks([r[model][cap][0] for r in per_rank])
            caps[cap] = {
                "ours_buckets": per_rank[0][model][cap][1],
                "summary": {k: stats.summarize(merged[k]) for k in KINDS},
                "ratio": stats.ratio(merged[OURS], merged[TORCH]),
                "samples_ms": {k: stats.values(merged[k]) for k in KINDS},
            }
        models[model] = {"caps": caps, "workload": Workload(model, options.preset).describe()}
        if options.auto:
            models[model]["auto"] = _auto_results(model, per_rank)
    notes = [
        "bucket_cap_mb 0 is measured as a cap of 1 byte (2^-20 MiB): ddp_ext rejects caps <= 0, and "
        "1 byte puts every parameter in a bucket of its own in both DDPs, which is what 0 means in the paper.",
        "Caps are measured one after another; within each cap ddp_ext and torch DDP alternate block by block.",
        "An explicit cap applies to every bucket in both DDPs (both use a 1 MiB first bucket only "
        "with their default cap).",
    ]
    if options.auto:
        notes.append(
            'auto: bucket_cap_mb="auto", tuned on its own replica until it settled, then measured in one interleaved '
            "run with ddp_ext at its default caps (1 MiB first bucket, then 25 MiB) and at every cap above; "
            "best fixed = the fixed setting with the lowest median in that same run; same cap fixed = the fixed "
            "setting with the caps auto settled on, where the run measured it. Tuning tries 1+25, 1, 2.5, 5, "
            "10, 25 and 50 MiB, those giving the same layout once (see Note [Auto-tuned bucket caps])."
        )
    return {"models": models, "notes": notes}


def table(data: dict) -> str:
    rows = []
    for model, r in data["models"].items():
        for cap, c in r["caps"].items():
            rows.append([model, cap, c["ours_buckets"], markdown.ms_iqr(c["summary"][OURS]),
                         markdown.ms_iqr(c["summary"][TORCH]), markdown.ratio_spread(c["ratio"])])
    headers = ["model", "bucket_cap_mb", "ddp_ext buckets", "ddp_ext ms (IQR)", "torch DDP ms (IQR)",
               "ddp_ext / torch [block range]"]
    text = markdown.table(headers, rows)
    autos = {m: r["auto"] for m, r in data["models"].items() if "auto" in r}
    if autos:
        rows = [[model, a["auto_cap_mb"], f"{a['tuning']['iterations']} ({a['tuning']['seconds']:.0f} s)",
                 markdown.ms_iqr(a["summary"][AUTO]), a["best_fixed_cap_mb"],
                 markdown.ms_iqr(a["summary"][a["best_fixed_cap_mb"]]), markdown.ms_iqr(a["summary"]["default"]),
                 markdown.ratio_spread(a["auto_vs_best"]),
                 markdown.ratio_spread(a["auto_vs_same_cap"]) if a.get("auto_vs_same_cap") else "not measured"]
                for model, a in autos.items()]
        headers = ["model", "auto settled on (MiB)", "iterations to settle", "auto ms (IQR)", "best fixed cap",
                   "best fixed ms (IQR)", "default ms (IQR)", "auto / best fixed [block range]",
                   "auto / same cap fixed [block range]"]
        text += "\n\n" + markdown.table(headers, rows)
    return text


def plot(data: dict, path: str) -> None:
    figure, axes = figures.panels(len(data["models"]), width_per_panel=6.0)
    for ax, (model, r) in zip(axes, data["models"].items()):
        figures.paired_boxes(ax, list(r["caps"]), lambda c, kind: r["caps"][c]["samples_ms"][kind], LABELS)
        ax.set_xlabel("bucket_cap_mb (MiB)")
        ax.set_ylabel("per-iteration latency (ms)")
        ax.set_title(model)
        ax.legend(fontsize="small")
    figures.save(figure, path, f"{TITLE} ({data['options']['world_size']} ranks)")
