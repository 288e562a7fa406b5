"""overlap: ddp_ext's overlap_optimizer against stepping after the backward.

Three variants of one training iteration run the same replica from the same
seed on the same batch, with the same bucket cap and Adam (foreach=True),
alternating block by block in the same ranks (Note [Interleaved
measurement]): torch's DDP and ddp_ext, each with optimizer.step() after the
backward, and ddp_ext after `ddp.overlap_optimizer(optimizer)`, whose
backward steps each bucket's parameters as soon as the bucket is reduced
(docs/OPTIMIZER_OVERLAP.md); its optimizer phase is then what the backward
left to step (nothing, usually). Models: the `compare` models at --preset and
the `scaleout` MLP. Each variant draws its dropout masks from a random
stream of its own, seeded alike. At the end every rank compares the parameters and
buffers of ddp_ext with and without the line: they saw the same data and
steps, so they must be bitwise equal; the run fails if they are not.

The ranks share the loopback, or with --link each is a host of its own, a
network namespace whose link sends at the given rate (harness/fake_hosts.py,
as in `scaleout`).
"""

import functools
import os
from typing import Dict, List

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddp_ext import DistributedDataParallel as OurDDP
from benchmarks.harness import fake_hosts as hosts
from benchmarks.harness import stats
from benchmarks.harness.interleave import merge_ranks, run_interleaved
from benchmarks.harness.launcher import launch
from benchmarks.harness.options import BenchOptions, effective_bucket_cap_mb
from benchmarks.reporting import figures, markdown
from benchmarks.workloads import scaleout_variants as sv
from benchmarks.workloads.presets import MODELS as PRESET_MODELS
from benchmarks.workloads.presets import Workload, input_seed
from benchmarks.workloads.replicas import OURS, TORCH
from benchmarks.workloads.training_step import PHASES, TrainingStep

NAME = "overlap"
FIGURE = "none (ddp_ext's own: the optimizer overlapped with communication)"
TITLE = "The optimizer overlapped with communication: overlap_optimizer vs a step after backward"

MLP = "mlp"  # the scaleout experiment's MLP (workloads/scaleout_variants.py)
MODELS = (*PRESET_MODELS, MLP)
OVERLAP = "ours_overlap"
VARIANTS = (TORCH, OURS, OVERLAP)
LABELS = {TORCH: "torch DDP", OURS: "ddp_ext", OVERLAP: "ddp_ext + overlap_optimizer"}
LEARNING_RATE = 1e-4


def _model_and_batch(model: str, preset: str, seed: int, rank: int):
    if model == MLP:
        torch.manual_seed(seed)
        return sv.ScaleoutMLP(0.0), sv.batch(input_seed(seed, rank))
    workload = Workload(model, preset)
    return workload.build(seed), workload.batch(input_seed(seed, rank))


def _variant(kind: str, model: str, options: BenchOptions, rank: int) -> TrainingStep:
    module, batch = _model_and_batch(model, options.preset, options.seed, rank)
    cap = effective_bucket_cap_mb(options.single_bucket_cap())
    kwargs = {} if cap is None else {"bucket_cap_mb": cap}
    ddp = TorchDDP(module, **kwargs) if kind == TORCH else OurDDP(module, **kwargs)
    step = TrainingStep(ddp, batch)
    step.optimizer = torch.optim.Adam(module.parameters(), lr=LEARNING_RATE, foreach=True)
    if kind == OVERLAP:
        ddp.overlap_optimizer(step.optimizer)
    return OwnRandomness(step, input_seed(options.seed, rank))


class OwnRandomness:
    """A step that draws from a CPU random stream of its own (BERT's dropout):
    every variant draws the same masks in the same order, whatever the other
    variants draw between its iterations. The swap is outside the step's timing."""

    def __init__(self, step: TrainingStep, seed: int):
        self.step = step
        self.state = torch.Generator().manual_seed(seed).get_state()

    def __call__(self) -> Dict[str, float]:
        outer = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            return self.step()
        finally:
            self.state = torch.get_rng_state()
            torch.set_rng_state(outer)


def differing_tensors(a: nn.Module, b: nn.Module) -> List[str]:
    """Names of the parameters and buffers of `a` that are not bitwise those of `b`."""
    named_b = {**dict(b.named_parameters()), **dict(b.named_buffers())}
    return [name for name, t in [*a.named_parameters(), *a.named_buffers()]
            if name not in named_b or not torch.equal(t, named_b[name])]


def _measure(rank: int, world_size: int, job):
    options, progress = job
    progress = progress.for_rank(rank)
    measured = {}
    for model in options.models:
        steps = {kind: _variant(kind, model, options, rank) for kind in VARIANTS}
        samples = run_interleaved(steps, **options.run_lengths(), progress=progress, label=model)
        ours, overlap = steps[OURS].step.model.module, steps[OVERLAP].step.model.module
        measured[model] = {"samples": samples, "differing": differing_tensors(ours, overlap),
                           "compared": len([*ours.parameters(), *ours.buffers()])}
    return measured


def bitwise_check(model: str, per_rank: List[dict]) -> Dict[str, object]:
    """The summary's record of the check; raises if any rank differs."""
    differing = {rank: r["differing"] for rank, r in enumerate(per_rank) if r["differing"]}
    if differing:
        raise RuntimeError(
            f"overlap, {model}: ddp_ext with overlap_optimizer ended with parameters or buffers that are not "
            "bitwise those of ddp_ext without it: "
            + "; ".join(f"rank {rank}: {', '.join(names[:5])}" + (f" and {len(names) - 5} more" if len(names) > 5
                                                                   else "") for rank, names in differing.items()))
    return {"equal": True, "ranks": len(per_rank), "tensors_per_rank": per_rank[0]["compared"]}


def _enter_host(placed, rank: int) -> None:
    """Runs first in each rank's process: into its own host, Gloo on its link."""
    hosts.enter(placed[rank])
    os.environ["GLOO_SOCKET_IFNAME"] = placed[rank].veth


def _describe(model: str, preset: str) -> dict:
    if model != MLP:
        return Workload(model, preset).describe()
    params = sum(p.numel() for p in sv.ScaleoutMLP(0.0).parameters())
    return {"model": "scaleout MLP", "parameters": params, "gradient_mib": round(params * 4 / 2**20, 2),
            "input_shape_per_rank": [sv.BATCH, sv.IN_FEATURES]}


def _launch(options: BenchOptions, progress) -> List[dict]:
    job = (options, progress)
    if options.link_gbit is None:
        return launch(_measure, options.world_size, job, options.threads, options.timeout_s)
    reason = hosts.cannot_make_namespaces()
    if reason:
        raise RuntimeError(f"overlap --link: {reason}")
    with hosts.fake_hosts(options.world_size, "ov", options.link_gbit) as placed:
        return launch(_measure, options.world_size, job, options.threads, options.timeout_s,
                      setup=functools.partial(_enter_host, placed))


def _where(link_gbit) -> str:
    return "loopback" if link_gbit is None else f"{link_gbit:g} Gbit/s links"


def run(options: BenchOptions, progress) -> dict:
    options.single_bucket_cap()
    per_rank = _launch(options, progress)
    models = {}
    for model in options.models:
        merged = merge_ranks([r[model]["samples"] for r in per_rank])
        models[model] = {
            "summary": {kind: stats.summarize(merged[kind]) for kind in VARIANTS},
            "phases_ms": {kind: {p: stats.median_ms(merged[kind], p) for p in (*PHASES, "total")}
                          for kind in VARIANTS},
            "overlap_over_torch": stats.ratio(merged[OVERLAP], merged[TORCH]),
            "overlap_over_ours": stats.ratio(merged[OVERLAP], merged[OURS]),
            "ours_over_torch": stats.ratio(merged[OURS], merged[TORCH]),
            "bitwise_equal": bitwise_check(model, [r[model] for r in per_rank]),
            "samples_ms": {kind: stats.values(merged[kind]) for kind in VARIANTS},
            "workload": {**_describe(model, options.preset), "optimizer": f"Adam (foreach) lr {LEARNING_RATE}"},
        }
    notes = ["phases: medians per phase (the slowest rank's iteration); with overlap_optimizer the backward "
             "includes stepping each bucket, and the optimizer phase is what it left (zero_grad, usually). "
             "ratio [min-max]: the medians' ratio over all measured iterations, and its range over back-to-back "
             "block pairs. bitwise: parameters and buffers of ddp_ext with and without overlap_optimizer, "
             "compared on every rank at the end of the run."]
    if options.link_gbit is not None:
        notes.append(f"Links: each rank a host of its own (a network namespace on this machine), what it sends "
                     f"shaped to {options.link_gbit:g} Gbit/s with tc tbf (rate only, no delay added); the ranks "
                     "still share this machine's cores.")
    return {"models": models, "notes": notes}


def table(data: dict) -> str:
    rows = []
    for model, r in data["models"].items():
        for kind in VARIANTS:
            phases = r["phases_ms"][kind]
            ratios = ([markdown.ratio_spread(r["overlap_over_torch"]), markdown.ratio_spread(r["overlap_over_ours"])]
                      if kind == OVERLAP else ["", ""])
            bitwise = ("equal" if r["bitwise_equal"]["equal"] else "DIFFERENT") if kind == OVERLAP else ""
            rows.append([model, LABELS[kind], markdown.ms_iqr(r["summary"][kind]),
                         *(markdown.ms(phases[p]) for p in PHASES), *ratios, bitwise])
    return markdown.table(["model", "implementation", "ms per iteration (IQR)", *(f"{p} ms" for p in PHASES),
                           "overlap / torch [block range]", "overlap / ddp_ext [block range]",
                           "bitwise vs ddp_ext"], rows)


def plot(data: dict, path: str) -> None:
    figure, axes = figures.panels(len(data["models"]), width_per_panel=5.5)
    colors = {**figures.COLORS, OVERLAP: "tab:green"}
    for ax, (model, r) in zip(axes, data["models"].items()):
        kinds = list(r["samples_ms"])
        boxes = ax.boxplot([r["samples_ms"][kind] for kind in kinds], showfliers=False, patch_artist=True,
                           medianprops=figures.MEDIAN)
        for patch, kind in zip(boxes["boxes"], kinds):
            patch.set_facecolor(colors[kind])
        ax.set_xticks(range(1, len(kinds) + 1), [LABELS[k] for k in kinds], fontsize="small")
        ax.set_title(f"{model}: overlap/torch = {r['overlap_over_torch']['ratio']:.3f}, "
                     f"/ddp_ext = {r['overlap_over_ours']['ratio']:.3f}", fontsize="small")
        ax.set_ylabel("per-iteration latency (ms)")
    options = data["options"]
    figures.save(figure, path, f"overlap_optimizer vs a step after backward ({options['world_size']} ranks, "
                               f"{options['preset']} preset, {_where(options.get('link_gbit'))})")
