"""order [paper section 6.2.1]: rebuilding buckets in the order gradients arrive.

Three models whose forward disagrees with their registration order (see
benchmarks/workloads/models/ordered.py): layers used in reverse, two lists used
alternately, and stages whose order swaps during the warm-up. ddp_ext with
continuous rebuilding (its default), ddp_ext rebuilding once (torch's
behaviour) and torch's DDP train each from the same seed on the same batch,
alternating block by block (Note [Interleaved measurement]); every iteration
also records ddp_ext's overlap fraction (the fraction of gradient bytes whose
allreduce was launched before the last gradient of the backward arrived), its
launch delay (the byte-weighted mean time, in gradient bytes, a gradient
waited for its allreduce to launch, as a fraction of all gradient bytes) and
its rebuild count.
"""

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddp_ext import DistributedDataParallel as OurDDP
from benchmarks.harness import stats
from benchmarks.harness.interleave import merge_ranks, run_interleaved
from benchmarks.harness.launcher import launch
from benchmarks.harness.options import BenchOptions, effective_bucket_cap_mb
from benchmarks.reporting import figures, markdown
from benchmarks.workloads.models.ordered import CLASSES, DEPTH, ORDERED_MODELS, WIDTH, layer_bytes
from benchmarks.workloads.presets import input_seed
from benchmarks.workloads.training_step import TrainingStep

NAME = "order"
FIGURE = "none (section 6.2.1, gradient order prediction)"
TITLE = "Gradient order prediction: models whose gradient order disagrees with their registration"
# Warm-up long enough for the switching model to swap (at warmup // 3) and
# for continuous rebuilding to follow (3 iterations of patience, 1 of vote);
# 30 blocks, since on a shared 2-core machine block medians vary widely.
RUN_LENGTHS = {"warmup": 12, "blocks": 30, "block_iterations": 5}

OURS, ONCE, TORCH = "ours", "ours_once", "torch"
VARIANTS = (OURS, ONCE, TORCH)
LABELS = {OURS: "ddp_ext (continuous)", ONCE: "ddp_ext (once)", TORCH: "torch DDP"}
COLORS = {OURS: figures.COLORS["ours"], ONCE: "tab:cyan", TORCH: figures.COLORS["torch"]}
BATCH = 32
PLOTTED_ITERATIONS = 25
# Default cap: two layers per bucket in both DDPs (the cap equals two layers'
# bytes, which torch's DDP closes a bucket at and ddp_ext's still admits).
DEFAULT_CAP_MB = 2 * layer_bytes() / 2**20


class OrderStep(TrainingStep):
    """A training iteration that swaps a switching model's stages at
    iteration `switch_at`, and records ddp_ext's overlap fraction and launch
    delay after each iteration (outside the timed region), and the rebuild
    count its backward ran with: read at the end of its forward, since the
    first rebuild happens at the start of a forward and later ones at the end
    of a backward."""

    def __init__(self, ddp, batch, switch_at):
        super().__init__(ddp, batch)
        self.switch_at = switch_at
        self.iteration = 0
        self.overlap = []
        self.delay = []
        self.rebuilds = []
        if isinstance(ddp, OurDDP):
            ddp.module.register_forward_hook(self._record_rebuilds)

    def _record_rebuilds(self, module, inputs, output):
        self.rebuilds.append(self.model.reducer.rebuilds)

    def __call__(self):
        if self.iteration == self.switch_at and hasattr(self.model.module, "swapped"):
            self.model.module.swapped = True
        sample = super().__call__()
        self.iteration += 1
        if isinstance(self.model, OurDDP):
            self.overlap.append(self.model.reducer.overlap_fraction)
            self.delay.append(self.model.reducer.launch_delay)
        return sample


def _replica(variant, model, seed, cap_mb):
    torch.manual_seed(seed)
    module = ORDERED_MODELS[model]()
    if variant == TORCH:
        return TorchDDP(module, bucket_cap_mb=cap_mb)
    return OurDDP(module, bucket_cap_mb=cap_mb, rebuild_buckets="continuous" if variant == OURS else "once")


def _batch(seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, WIDTH, generator=generator), torch.randint(0, CLASSES, (BATCH,), generator=generator)


def cap_mb(options: BenchOptions) -> float:
    return effective_bucket_cap_mb(options.single_bucket_cap()) or DEFAULT_CAP_MB


def _measure(rank, world_size, job):
    options, progress = job
    progress = progress.for_rank(rank)
    batch = _batch(input_seed(options.seed, rank))
    switch_at = options.warmup // 3
    measured = {}
    for model in options.models:
        steps = {v: OrderStep(_replica(v, model, options.seed, cap_mb(options)), batch, switch_at) for v in VARIANTS}
        samples = run_interleaved(steps, **options.run_lengths(), progress=progress, label=model)
        measured[model] = {
            "samples": samples,
            "overlap": {v: steps[v].overlap for v in (OURS, ONCE)},
            "delay": {v: steps[v].delay for v in (OURS, ONCE)},
            "rebuilds": {v: steps[v].rebuilds for v in (OURS, ONCE)},
            "bucket_sizes": steps[OURS].model.reducer.bucket_sizes(),
            "torch_bucket_sizes": steps[TORCH].model._get_ddp_logging_data().get("rebuilt_bucket_sizes", ""),
        }
        dist.barrier()
    return measured


def around_last_rebuild(values, rebuilds) -> dict:
    """A per-iteration measure in the last iteration that ran with the layout
    the last rebuild replaced, and its median over every iteration after it
    (`rebuilds`: the count each iteration's backward ran with). Without a
    rebuild both are the median."""
    first_final = [i for i, count in enumerate(rebuilds) if count == rebuilds[-1]][0] if rebuilds[-1] else None
    if first_final is None:
        median = float(np.median(values))
        return {"before": median, "after": median, "last_rebuild_iteration": None}
    return {"before": values[first_final - 1], "after": float(np.median(values[first_final:])),
            "last_rebuild_iteration": first_final - 1}


def run(options: BenchOptions, progress) -> dict:
    per_rank = launch(_measure, options.world_size, (options, progress), options.threads, options.timeout_s)
    models = {}
    for model in options.models:
        merged = merge_ranks([r[model]["samples"] for r in per_rank])
        first = per_rank[0][model]
        vs_torch = stats.ratio(merged[OURS], merged[TORCH])
        models[model] = {
            "ours_ms": stats.median_ms(merged[OURS]),
            "torch_ms": stats.median_ms(merged[TORCH]),
            "once_ms": stats.median_ms(merged[ONCE]),
            "ratio": vs_torch["ratio"],
            "ratio_per_block": vs_torch["per_block"],
            "ratio_once_vs_torch": stats.ratio(merged[ONCE], merged[TORCH]),
            "rebuilds": first["rebuilds"][OURS][-1],
            "rebuilds_once": first["rebuilds"][ONCE][-1],
            "overlap_fraction": around_last_rebuild(first["overlap"][OURS], first["rebuilds"][OURS]),
            "overlap_fraction_once": around_last_rebuild(first["overlap"][ONCE], first["rebuilds"][ONCE]),
            "launch_delay": around_last_rebuild(first["delay"][OURS], first["rebuilds"][OURS]),
            "launch_delay_once": around_last_rebuild(first["delay"][ONCE], first["rebuilds"][ONCE]),
            "overlap_per_iteration": first["overlap"],
            "launch_delay_per_iteration": first["delay"],
            "rebuilds_per_iteration": first["rebuilds"],
            "bucket_sizes": first["bucket_sizes"],
            "torch_rebuilt_bucket_sizes": [int(b) for b in first["torch_bucket_sizes"].split(", ") if b],
            "summary": {v: stats.summarize(merged[v]) for v in VARIANTS},
            "samples_ms": {v: stats.values(merged[v]) for v in VARIANTS},
        }
    notes = [
        f"Models: {DEPTH} Linear({WIDTH}, {WIDTH}) layers, the last one's outputs the class scores, {BATCH} "
        "samples per rank; reversed: "
        "layers used in the reverse of registration; grouped: two lists of layers used alternately; switching: "
        f"two stages of {DEPTH // 2} layers, whose order swaps at iteration warmup // 3 (in the warm-up).",
        f"bucket_cap_mb {cap_mb(options):g} for all three: two layers' bytes, so that both DDPs lay out the "
        "same buckets of two layers (ddp_ext's cap admits a bucket up to the cap, torch's closes one on reaching it).",
        "ratio = median ddp_ext (continuous) / median torch DDP; [min-max] over back-to-back block pairs. "
        "ddp_ext (once) rebuilds once, at the second iteration's forward, as torch's DDP does.",
        "overlap fraction: the fraction of gradient bytes whose allreduce was launched before the last gradient "
        "of the backward arrived (see Note [Gradient order prediction]); `before`: the last iteration run with the "
        "layout the last rebuild replaced; `after`: median over every later iteration "
        "(for ddp_ext once, whose only rebuild may change nothing, over every iteration then).",
        "launch delay: the byte-weighted mean wait of a gradient for its allreduce to launch, counted in gradient "
        "bytes arriving meanwhile, as a fraction of all gradient bytes (0: every allreduce launches as its last "
        "gradient arrives); it also counts launches held back by an earlier bucket that fills late but not last, "
        "which the overlap fraction misses.",
    ]
    return {"models": models, "notes": notes}


def run_line(data: dict) -> str:
    o = data["options"]
    return (f"seed {o['seed']}; per variant {o['warmup']} warm-up iterations, then {o['blocks']} blocks of "
            f"{o['discard_per_block']} discarded + {o['block_iterations']} measured iterations, variants "
            "alternating block by block.")


def _before_after(o: dict) -> str:
    return f"{o['before']:.2f} -> {o['after']:.2f}"


def table(data: dict) -> str:
    rows = []
    for model, r in data["models"].items():
        rows.append([
            model,
            markdown.ms_iqr(r["summary"][OURS]),
            markdown.ms_iqr(r["summary"][TORCH]),
            markdown.ms_iqr(r["summary"][ONCE]),
            markdown.ratio_spread({"ratio": r["ratio"], "per_block": r["ratio_per_block"]}),
            f"{len(r['bucket_sizes'])} / {len(r['torch_rebuilt_bucket_sizes'])}",
            r["rebuilds"],
            _before_after(r["overlap_fraction"]),
            _before_after(r["launch_delay"]),
            f"{r['overlap_fraction_once']['after']:.2f} / {r['launch_delay_once']['after']:.2f}",
        ])
    headers = ["model", "ddp_ext ms (IQR)", "torch DDP ms (IQR)", "ddp_ext once ms (IQR)",
               "ddp_ext / torch [block range]", "buckets ddp_ext / torch", "rebuilds", "overlap fraction before -> after",
               "launch delay before -> after", "once: overlap / delay after"]
    return markdown.table(headers, rows)


def plot(data: dict, path: str) -> None:
    models = data["models"]
    figure, grid = figures.plt.subplots(2, len(models), figsize=(5.5 * len(models), 8.0), squeeze=False)
    for column, (model, r) in enumerate(models.items()):
        top, bottom = grid[0][column], grid[1][column]
        boxes = top.boxplot([r["samples_ms"][v] for v in VARIANTS], patch_artist=True, medianprops=figures.MEDIAN,
                            showfliers=False)
        for patch, v in zip(boxes["boxes"], VARIANTS):
            patch.set_facecolor(COLORS[v])
        top.set_xticks(range(1, len(VARIANTS) + 1), [LABELS[v] for v in VARIANTS], fontsize="small")
        top.set_ylabel("per-iteration latency (ms), outliers not drawn")
        top.set_title(f"{model}: ddp_ext/torch = {r['ratio']:.3f}")
        for v, width in ((OURS, 3.5), (ONCE, 1.5)):  # once drawn thin, over continuous
            bottom.plot(r["overlap_per_iteration"][v], marker=".", color=COLORS[v], linewidth=width,
                        label=f"{LABELS[v]}: overlap fraction")
            bottom.plot(r["launch_delay_per_iteration"][v], linestyle="--", color=COLORS[v], linewidth=width,
                        label=f"{LABELS[v]}: launch delay")
        bottom.set_ylim(-0.05, 1.05)
        bottom.set_xlim(-0.5, PLOTTED_ITERATIONS - 0.5)  # later iterations repeat the last
        bottom.set_xlabel(f"iteration of the replica (first {PLOTTED_ITERATIONS}, warm-up included)")
        bottom.set_ylabel("fraction of gradient bytes")
        bottom.legend(fontsize="small")
    figures.save(figure, path, f"{TITLE} ({data['options']['world_size']} ranks)")
