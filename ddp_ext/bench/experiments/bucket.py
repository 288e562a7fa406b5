"""bucket [paper Figs. 6-7]: per-iteration latency against bucket_cap_mb, as box plots.

For every cap, ddp_ext and torch's DDP are built with it and alternate block by
block; the caps themselves run one after another. Cap 0 is the paper's "every
gradient communicated on its own": see options.ONE_PARAMETER_PER_BUCKET_MB.
"""

from ddp_ext.bench import stats
from ddp_ext.bench.interleave import merge_ranks, run_interleaved
from ddp_ext.bench.launcher import launch
from ddp_ext.bench.options import BenchOptions, effective_bucket_cap_mb
from ddp_ext.bench.replicas import LABELS, OURS, TORCH, make_replica
from ddp_ext.bench.reporting import figures, markdown
from ddp_ext.bench.training_step import TrainingStep
from ddp_ext.bench.workloads import Workload, input_seed

NAME = "bucket"
FIGURE = "Figs. 6-7"
TITLE = "Per-iteration latency vs bucket size"
# Seven caps per model: fewer blocks than the default keep preset small within minutes.
RUN_LENGTHS = {"blocks": 5}

KINDS = (OURS, TORCH)


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
    return measured


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
    notes = [
        "bucket_cap_mb 0 is measured as a cap of 1 byte (2^-20 MiB): ddp_ext rejects caps <= 0, and "
        "1 byte puts every parameter in a bucket of its own in both DDPs, which is what 0 means in the paper.",
        "Caps are measured one after another; within each cap ddp_ext and torch DDP alternate block by block.",
        "An explicit cap applies to every bucket in both DDPs (both use a 1 MiB first bucket only "
        "with their default cap).",
    ]
    return {"models": models, "notes": notes}


def table(data: dict) -> str:
    rows = []
    for model, r in data["models"].items():
        for cap, c in r["caps"].items():
            rows.append([model, cap, c["ours_buckets"], markdown.ms_iqr(c["summary"][OURS]),
                         markdown.ms_iqr(c["summary"][TORCH]), markdown.ratio_spread(c["ratio"])])
    headers = ["model", "bucket_cap_mb", "ddp_ext buckets", "ddp_ext ms (IQR)", "torch DDP ms (IQR)",
               "ddp_ext / torch [block range]"]
    return markdown.table(headers, rows)


def plot(data: dict, path: str) -> None:
    figure, axes = figures.panels(len(data["models"]), width_per_panel=6.0)
    for ax, (model, r) in zip(axes, data["models"].items()):
        figures.paired_boxes(ax, list(r["caps"]), lambda c, kind: r["caps"][c]["samples_ms"][kind], LABELS)
        ax.set_xlabel("bucket_cap_mb (MiB)")
        ax.set_ylabel("per-iteration latency (ms)")
        ax.set_title(model)
        ax.legend(fontsize="small")
    figures.save(figure, path, f"{TITLE} ({data['options']['world_size']} ranks)")
