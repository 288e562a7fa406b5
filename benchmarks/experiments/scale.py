"""scale [paper Fig. 9]: per-iteration latency against the number of ranks.

One launch per world size, each measuring ddp_ext, torch's DDP and local
training interleaved as in `compare`. On a 2-core machine ranks share cores:
beyond 2 ranks (with 1 thread each) they compete for CPU, so latency grows
from computation slowing down as well as from communication. Local training
is measured with the same number of ranks running side by side, which shows
how much of the growth core sharing alone explains.
"""

import dataclasses

from benchmarks.harness import stats
from benchmarks.harness.interleave import merge_ranks
from benchmarks.harness.launcher import launch
from benchmarks.harness.machine import usable_cores
from benchmarks.harness.options import BenchOptions
from benchmarks.reporting import figures, markdown
from benchmarks.workloads.presets import Workload
from benchmarks.workloads.replicas import KINDS, LABELS, LOCAL, OURS, TORCH
from benchmarks.workloads.side_by_side import measure_kinds

NAME = "scale"
FIGURE = "Fig. 9"
TITLE = "Per-iteration latency vs number of ranks"
# Four launches, the larger ones on shared cores: fewer blocks keep preset small within minutes.
RUN_LENGTHS = {"blocks": 5}


def run(options: BenchOptions, progress) -> dict:
    options.single_bucket_cap()
    by_world_size = {}
    for world_size in options.world_sizes:
        progress.say(f"world size {world_size}")
        job = dataclasses.replace(options, world_size=world_size)
        by_world_size[world_size] = launch(measure_kinds, world_size, (job, progress), options.threads,
                                           options.timeout_s)
    models = {}
    for model in options.models:
        sizes = {}
        for world_size, per_rank in by_world_size.items():
            merged = merge_ranks([r[model] for r in per_rank])
            sizes[str(world_size)] = {
                "summary": {k: stats.summarize(merged[k]) for k in KINDS},
                "ratio": stats.ratio(merged[OURS], merged[TORCH]),
                "ours_over_local": stats.ratio(merged[OURS], merged[LOCAL]),
            }
        models[model] = {"world_sizes": sizes, "workload": Workload(model, options.preset).describe()}
    cores = usable_cores()
    notes = [
        f"This machine has {cores} usable cores and every rank runs {options.threads} thread(s): with more "
        f"ranks than cores the ranks share cores, so latency also grows because computation slows down.",
        "local = the same number of ranks each training alone, side by side (no communication).",
    ]
    return {"models": models, "notes": notes, "ranks": ", ".join(map(str, options.world_sizes))}


def table(data: dict) -> str:
    rows = []
    for model, r in data["models"].items():
        for world_size, s in r["world_sizes"].items():
            rows.append([model, world_size, *(markdown.ms_iqr(s["summary"][k]) for k in KINDS),
                         markdown.ratio_spread(s["ratio"]), markdown.ratio_spread(s["ours_over_local"])])
    headers = ["model", "ranks", "ddp_ext ms (IQR)", "torch DDP ms (IQR)", "local ms (IQR)",
               "ddp_ext / torch [block range]", "ddp_ext / local [block range]"]
    return markdown.table(headers, rows)


def plot(data: dict, path: str) -> None:
    figure, axes = figures.panels(len(data["models"]))
    for ax, (model, r) in zip(axes, data["models"].items()):
        sizes = [int(w) for w in r["world_sizes"]]
        for kind in KINDS:
            summaries = [r["world_sizes"][str(w)]["summary"][kind] for w in sizes]
            medians = [s["median_ms"] for s in summaries]
            spread = [[m - s["q25_ms"] for m, s in zip(medians, summaries)],
                      [s["q75_ms"] - m for m, s in zip(medians, summaries)]]
            ax.errorbar(sizes, medians, yerr=spread, marker="o", capsize=3, color=figures.COLORS[kind],
                        label=LABELS[kind])
        ax.set_xticks(sizes)
        ax.set_xlabel("ranks (sharing the machine's cores)")
        ax.set_ylabel("per-iteration latency (ms), median and IQR")
        ax.set_title(model)
        ax.legend(fontsize="small")
    figures.save(figure, path, TITLE)
