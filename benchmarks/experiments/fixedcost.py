"""fixedcost: what ddp_ext adds to an iteration where communication is cheap.

A tiny MLP (32 -> 64 -> 10, batch 8 per rank, one bucket) makes every
iteration mostly fixed costs: the wrapper's Python around the forward, the
reducer's bookkeeping, and the latency of each collective. ddp_ext, torch's
DDP and local training run the same replica from the same seed in the same
processes, alternating block by block (Note [Interleaved measurement]), and
each iteration is timed per phase (forward with loss, backward with the
allreduce waits, optimizer), so a difference shows where it lies.

A fourth variant, "ddp_ext, separate step check", is ddp_ext with its step
check on a collective of its own (as when buffers are broadcast), where it
would ride on bucket 0 otherwise (Note [The step check on bucket 0] in
reducer/agreement/step_check.h): what that note saves, measured in the same processes.

A fifth, "torch DDP, second replica", is a control: a second torch DDP over
its own copy of the model, timed as the others. Its ratio to the first is
what this machine's noise and the order of the variants alone make of two
identical implementations, the yardstick for ddp_ext's ratio.
"""

from typing import Dict

from benchmarks.harness import stats
from benchmarks.harness.interleave import merge_ranks, run_interleaved
from benchmarks.harness.launcher import launch
from benchmarks.harness.options import BenchOptions
from benchmarks.reporting import figures, markdown
from benchmarks.workloads.replicas import LOCAL, OURS, TORCH
from benchmarks.workloads.tiny_mlp import BATCH, SIZES
from benchmarks.workloads.tiny_variants import LABELS, SEPARATE_CHECK, TORCH_CONTROL, make
from benchmarks.workloads.training_step import PHASES, TrainingStep

NAME = "fixedcost"
FIGURE = "none (ddp_ext's own: its fixed cost per iteration against torch's DDP)"
TITLE = "Fixed cost per iteration on a tiny MLP: ddp_ext vs torch DDP"
# Iterations are about a millisecond: many, in many blocks.
RUN_LENGTHS = {"warmup": 200, "blocks": 20, "block_iterations": 100, "discard_per_block": 10}

MODEL = "tinymlp"
KINDS = (OURS, TORCH, LOCAL, SEPARATE_CHECK, TORCH_CONTROL)
# The ratio to torch's DDP each row of the table shows, by the result's key.
RATIO_KEYS = {OURS: "ratio", SEPARATE_CHECK: "separate_check_over_torch", TORCH_CONTROL: "control_over_torch"}


def _measure(rank: int, world_size: int, job):
    import torch

    options, progress = job
    progress = progress.for_rank(rank)
    generator = torch.Generator().manual_seed(options.seed * 1000 + rank)
    batch = (torch.randn(BATCH, SIZES[0], generator=generator),
             torch.randint(0, SIZES[2], (BATCH,), generator=generator))
    variants = {kind: TrainingStep(make(kind, options.seed), batch) for kind in KINDS}
    return run_interleaved(variants, **options.run_lengths(), progress=progress, label=MODEL)


def _phases(blocks) -> Dict[str, float]:
    return {phase: stats.median_ms(blocks, phase) for phase in (*PHASES, "total")}


def run(options: BenchOptions, progress) -> dict:
    per_rank = launch(_measure, options.world_size, (options, progress), options.threads, options.timeout_s)
    merged = merge_ranks(per_rank)
    result = {
        "summary": {kind: stats.summarize(merged[kind]) for kind in KINDS},
        "phases_ms": {kind: _phases(merged[kind]) for kind in KINDS},
        "ratio": stats.ratio(merged[OURS], merged[TORCH]),
        "separate_check_over_torch": stats.ratio(merged[SEPARATE_CHECK], merged[TORCH]),
        "ours_over_separate_check": stats.ratio(merged[OURS], merged[SEPARATE_CHECK]),
        "ours_over_local": stats.ratio(merged[OURS], merged[LOCAL]),
        "control_over_torch": stats.ratio(merged[TORCH_CONTROL], merged[TORCH]),
        "samples_ms": {kind: stats.values(merged[kind]) for kind in KINDS},
        "workload": f"MLP {' -> '.join(map(str, SIZES))}, batch {BATCH} per rank, SGD, cross-entropy",
    }
    notes = ["phases: medians per phase over all measured iterations (the slowest rank's iteration); "
             "ratio [min-max]: median ddp_ext / median torch DDP, and its range over back-to-back block pairs; "
             "on the second torch DDP replica's row, its ratio to the first: the noise floor of this run."]
    return {"models": {MODEL: result}, "notes": notes}


def table(data: dict) -> str:
    rows = []
    for model, r in data["models"].items():
        for kind in (k for k in KINDS if k in r["phases_ms"]):  # runs before the control lack it
            phases = r["phases_ms"][kind]
            rows.append([model, LABELS[kind], markdown.ms_iqr(r["summary"][kind]),
                         *(markdown.ms(phases[p]) for p in PHASES),
                         markdown.ratio_spread(r[RATIO_KEYS[kind]]) if kind in RATIO_KEYS else ""])
    return markdown.table(["model", "implementation", "ms per iteration (IQR)", *(f"{p} ms" for p in PHASES),
                           "ddp_ext / torch [block range]"], rows)


def plot(data: dict, path: str) -> None:
    figure, axes = figures.panels(len(data["models"]))
    for ax, (model, r) in zip(axes, data["models"].items()):
        kinds = list(r["samples_ms"])
        boxes = ax.boxplot([r["samples_ms"][kind] for kind in kinds], showfliers=False, patch_artist=True,
                           medianprops=figures.MEDIAN)
        for patch, kind in zip(boxes["boxes"], kinds):
            patch.set_facecolor(figures.COLORS.get(kind, "tab:cyan"))
        ax.set_xticks(range(1, len(kinds) + 1), [LABELS[k] for k in kinds])
        ax.set_title(f"{model}: ddp_ext/torch = {r['ratio']['ratio']:.3f}")
        ax.set_ylabel("per-iteration latency (ms)")
    figures.save(figure, path, f"{TITLE} ({data['options']['world_size']} ranks)")
