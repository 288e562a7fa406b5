"""roundrobin [paper Fig. 12]: per-iteration latency over round-robin process groups.

rrN is ddp_ext's round-robin group of N Gloo children, which sends each
bucket's allreduce to the next child in turn. For every N, ddp_ext's DDP and
torch's DDP both train over that same group, alternating block by block; the
values of N run one after another.
"""

from benchmarks.harness import round_robin, stats
from benchmarks.harness.interleave import merge_ranks, run_interleaved
from benchmarks.harness.launcher import launch
from benchmarks.harness.options import BenchOptions, effective_bucket_cap_mb
from benchmarks.reporting import figures, markdown
from benchmarks.workloads.presets import Workload, input_seed
from benchmarks.workloads.replicas import LABELS, OURS, TORCH, make_replica
from benchmarks.workloads.training_step import TrainingStep

NAME = "roundrobin"
FIGURE = "Fig. 12"
TITLE = "Per-iteration latency over round-robin process groups"
# Three groups per model: fewer blocks keep preset small within minutes.
RUN_LENGTHS = {"blocks": 6}

KINDS = (OURS, TORCH)


def _measure(rank, world_size, job):
    options, progress = job
    progress = progress.for_rank(rank)
    cap = effective_bucket_cap_mb(options.single_bucket_cap())
    # Created once, in the same order on every rank: group creation is collective.
    groups = {n: round_robin.new_round_robin_group(n) for n in options.rr_groups}
    measured = {}
    for model in options.models:
        workload = Workload(model, options.preset)
        batch = workload.batch(input_seed(options.seed, rank))
        measured[model] = {}
        for n, group in groups.items():
            variants = {k: TrainingStep(make_replica(k, workload, options.seed, cap, process_group=group), batch)
                        for k in KINDS}
            measured[model][n] = run_interleaved(variants, **options.run_lengths(), progress=progress,
                                                 label=f"{model}, {round_robin.label(n)}")
    return measured


def run(options: BenchOptions, progress) -> dict:
    options.single_bucket_cap()
    round_robin.require_round_robin()  # fail before starting any rank
    per_rank = launch(_measure, options.world_size, (options, progress), options.threads, options.timeout_s)
    models = {}
    for model in options.models:
        groups = {}
        for n in options.rr_groups:
            merged = merge_ranks([r[model][n] for r in per_rank])
            groups[round_robin.label(n)] = {
                "summary": {k: stats.summarize(merged[k]) for k in KINDS},
                "ratio": stats.ratio(merged[OURS], merged[TORCH]),
                "samples_ms": {k: stats.values(merged[k]) for k in KINDS},
            }
        models[model] = {"groups": groups, "workload": Workload(model, options.preset).describe()}
    notes = ["rrN: ddp_ext.new_round_robin_group(num_groups=N, backend='gloo'); both DDPs use the same group."]
    return {"models": models, "notes": notes}


def table(data: dict) -> str:
    rows = [[model, name, markdown.ms_iqr(g["summary"][OURS]), markdown.ms_iqr(g["summary"][TORCH]),
             markdown.ratio_spread(g["ratio"])]
            for model, r in data["models"].items() for name, g in r["groups"].items()]
    return markdown.table(["model", "group", "ddp_ext ms (IQR)", "torch DDP ms (IQR)",
                           "ddp_ext / torch [block range]"], rows)


def plot(data: dict, path: str) -> None:
    figure, axes = figures.panels(len(data["models"]))
    for ax, (model, r) in zip(axes, data["models"].items()):
        figures.paired_boxes(ax, list(r["groups"]), lambda n, kind: r["groups"][n]["samples_ms"][kind], LABELS)
        ax.set_ylabel("per-iteration latency (ms)")
        ax.set_title(model)
        ax.legend(fontsize="small")
    figures.save(figure, path, f"{TITLE} ({data['options']['world_size']} ranks)")
