"""compare: per-iteration latency of ddp_ext vs torch's DDP vs local training.

The three run the same model from the same seed on the same synthetic batch,
with the same bucket cap, alternating block by block (Note [Interleaved
measurement]), over the ranks' default group (Gloo, or ddp_ext's MPI backend
with --backend ddp_ext_mpi). With --world-size 1 the ddp_ext/local ratio is the reducer's
own overhead, since there is no one to communicate with.
"""

from benchmarks.harness import stats
from benchmarks.harness.interleave import merge_ranks
from benchmarks.harness.launcher import launch
from benchmarks.harness.options import BenchOptions
from benchmarks.reporting import figures, markdown
from benchmarks.workloads.presets import Workload
from benchmarks.workloads.replicas import KINDS, LABELS, LOCAL, OURS, OURS_NO_HANG_WATCH, TORCH
from benchmarks.workloads.side_by_side import measure_kinds, measure_kinds_and_no_hang_watch

NAME = "compare"
FIGURE = "none (ddp_ext's own target: at least as fast as torch's DDP)"
TITLE = "Per-iteration latency: ddp_ext vs torch DDP vs local training"


def run(options: BenchOptions, progress) -> dict:
    options.single_bucket_cap()
    body = measure_kinds_and_no_hang_watch if options.hang_watch_cost else measure_kinds
    kinds = (*KINDS, OURS_NO_HANG_WATCH) if options.hang_watch_cost else KINDS
    per_rank = launch(body, options.world_size, (options, progress), options.threads, options.timeout_s,
                      backend=options.process_group_backend())
    models = {}
    for model in options.models:
        merged = merge_ranks([r[model] for r in per_rank])
        vs_torch = stats.ratio(merged[OURS], merged[TORCH])
        models[model] = {
            "ours_ms": stats.median_ms(merged[OURS]),
            "torch_ms": stats.median_ms(merged[TORCH]),
            "local_ms": stats.median_ms(merged[LOCAL]),
            "ratio": vs_torch["ratio"],
            "ratio_per_block": vs_torch["per_block"],
            "ours_over_local": stats.ratio(merged[OURS], merged[LOCAL]),
            "torch_over_local": stats.ratio(merged[TORCH], merged[LOCAL]),
            "summary": {kind: stats.summarize(merged[kind]) for kind in kinds},
            "samples_ms": {kind: stats.values(merged[kind]) for kind in kinds},
            "workload": Workload(model, options.preset).describe(),
        }
        if options.hang_watch_cost:
            # See Note [Hang attribution]: ddp_ext as shipped over ddp_ext with it off.
            models[model]["hang_watch_cost"] = stats.ratio(merged[OURS], merged[OURS_NO_HANG_WATCH])
    notes = ["ratio = median ddp_ext / median torch DDP over all measured iterations; "
             "[min-max] is the range of the same ratio over back-to-back block pairs."]
    return {"models": models, "notes": notes}


def table(data: dict) -> str:
    rows = []
    for model, r in data["models"].items():
        rows.append([
            model,
            markdown.ms_iqr(r["summary"][OURS]),
            markdown.ms_iqr(r["summary"][TORCH]),
            markdown.ms_iqr(r["summary"][LOCAL]),
            markdown.ratio_spread({"ratio": r["ratio"], "per_block": r["ratio_per_block"]}),
            markdown.ratio_spread(r["ours_over_local"]),
        ])
        if "hang_watch_cost" in r:
            rows[-1] += [markdown.ms_iqr(r["summary"][OURS_NO_HANG_WATCH]), markdown.ratio_spread(r["hang_watch_cost"])]
    headers = ["model", "ddp_ext ms (IQR)", "torch DDP ms (IQR)", "local ms (IQR)",
               "ddp_ext / torch [block range]", "ddp_ext / local [block range]"]
    if any("hang_watch_cost" in r for r in data["models"].values()):
        headers += ["ddp_ext, hang watch off, ms (IQR)", "ddp_ext / hang watch off [block range]"]
    return markdown.table(headers, rows)


def plot(data: dict, path: str) -> None:
    figure, axes = figures.panels(len(data["models"]))
    for ax, (model, r) in zip(axes, data["models"].items()):
        kinds = list(r["samples_ms"])
        boxes = ax.boxplot([r["samples_ms"][kind] for kind in kinds], showfliers=True, patch_artist=True,
                            medianprops=figures.MEDIAN)
        for patch, kind in zip(boxes["boxes"], kinds):
            patch.set_facecolor(figures.COLORS.get(kind, "tab:cyan"))
        ax.set_xticks(range(1, len(kinds) + 1), [LABELS[k] for k in kinds])
        ax.set_title(f"{model}: ddp_ext/torch = {r['ratio']:.3f}")
        ax.set_ylabel("per-iteration latency (ms)")
    world = data["options"]["world_size"]
    figures.save(figure, path, f"{TITLE} ({world} ranks, {data['options']['preset']} preset)")
