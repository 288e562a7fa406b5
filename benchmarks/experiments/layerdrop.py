"""layerdrop [paper section 6.2.2]: communication that shrinks with dropped layers.

The BERT-like model of the preset with its encoder layers in a
ddp_ext.LayerDrop (the same seed in every replica, so every variant drops the
same layers in the same iteration), at drop rates P. ddp_ext needs no
find_unused_parameters: the layers a plan drops are known before the backward,
their buckets are not sent. torch's DDP must run with find_unused_parameters
(what its users do today), and is also measured with
skip_all_reduce_unused_params. Variants alternate block by block (Note
[Interleaved measurement]).

Besides time, two short untimed passes per drop rate:
- bytes: each variant over a process group that counts what every allreduce
  carries (gradients, and the small control allreduces: ddp_ext's step check,
  torch's unused-parameter bitmap), per iteration and rank;
- max_diff_vs_local: ddp_ext on the ranks' batches against one process
  training on their concatenation with the same drops (dropout off, so the
  two runs draw nothing else at random), the largest parameter difference.
"""

import dataclasses

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddp_ext import DistributedDataParallel as OurDDP
from ddp_ext import LayerDrop
from benchmarks.harness import stats
from benchmarks.harness.interleave import merge_ranks, run_interleaved
from benchmarks.harness.launcher import launch
from benchmarks.harness.options import BenchOptions
from benchmarks.harness.recording_group import RecordingProcessGroup
from benchmarks.reporting import figures, markdown
from benchmarks.workloads.models import BertEncoder
from benchmarks.workloads.presets import SIZES, input_seed
from benchmarks.workloads.training_step import LEARNING_RATE, TrainingStep

NAME = "layerdrop"
FIGURE = "none (section 6.2.2, layer dropping)"
TITLE = "Layer dropping: the BERT-like model with LayerDrop"
P = (0.0, 0.2, 0.5)
# 20 blocks: on a shared 2-core machine block medians vary widely.
RUN_LENGTHS = {"blocks": 20}
LAYERDROP_SEED = 2020
# Untimed iterations of the bytes pass and steps of the parity pass (--quick: fewer).
BYTES_ITERATIONS = {False: 40, True: 4}
PARITY_STEPS = {False: 6, True: 2}

OURS, TORCH, TORCH_SKIP, LOCAL = "ours", "torch", "torch_skip", "local"
VARIANTS = (OURS, TORCH, TORCH_SKIP)  # the DDPs, whose bytes are counted
TIMED = VARIANTS + (LOCAL,)
LABELS = {OURS: "ddp_ext", TORCH: "torch DDP (find_unused)", TORCH_SKIP: "torch DDP (+ skip_all_reduce_unused)",
          LOCAL: "local (no DDP)"}
COLORS = {OURS: figures.COLORS["ours"], TORCH: figures.COLORS["torch"], TORCH_SKIP: "tab:gray",
          LOCAL: figures.COLORS["local"]}


def _module(preset: str, p: float, seed: int, dropout=None):
    config = SIZES[preset]["bert"].config
    if dropout is not None:
        config = dataclasses.replace(config, dropout=dropout)
    torch.manual_seed(seed)
    module = BertEncoder(config)
    module.layers = LayerDrop(list(module.layers), p=p, seed=LAYERDROP_SEED)
    return module


def _wrap(variant, module, group=None):
    if variant == LOCAL:
        return module
    if variant == OURS:
        return OurDDP(module, process_group=group)
    return TorchDDP(module, process_group=group, find_unused_parameters=True,
                    skip_all_reduce_unused_params=variant == TORCH_SKIP)


def _batch(preset, seed):
    size = SIZES[preset]["bert"]
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, size.config.vocab_size, (size.batch_size, size.seq_len), generator=generator)
    return tokens, torch.randint(0, size.config.num_classes, (size.batch_size,), generator=generator)


def _bytes_per_iteration(options, p, variant, batch):
    group = RecordingProcessGroup(dist.distributed_c10d._get_default_group())
    step = TrainingStep(_wrap(variant, _module(options.preset, p, options.seed), group), batch)
    group.take_bytes()  # what construction sent (ddp_ext's allgathered checks) belongs to no iteration
    counted = []
    for _ in range(BYTES_ITERATIONS[options.quick]):
        step()
        counted.append(group.take_bytes())
    return counted


def _max_diff_vs_local(options, p, rank, world_size):
    """ddp_ext on each rank's batch vs local training on the concatenation."""
    module = _module(options.preset, p, options.seed, dropout=0.0)
    ddp = OurDDP(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE)
    local = _module(options.preset, p, options.seed, dropout=0.0) if rank == 0 else None
    local_optimizer = torch.optim.SGD(local.parameters(), lr=LEARNING_RATE) if local is not None else None
    for step in range(PARITY_STEPS[options.quick]):
        batches = [_batch(options.preset, input_seed(options.seed + 1 + step, r)) for r in range(world_size)]
        tokens, targets = batches[rank]
        F.cross_entropy(ddp(tokens), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if local is not None:
            tokens = torch.cat([b[0] for b in batches])
            targets = torch.cat([b[1] for b in batches])
            F.cross_entropy(local(tokens), targets).backward()
            local_optimizer.step()
            local_optimizer.zero_grad(set_to_none=True)
    if local is None:
        return None
    return max((a - b).abs().max().item() for a, b in zip(module.parameters(), local.parameters()))


def _measure(rank, world_size, job):
    options, progress = job
    progress = progress.for_rank(rank)
    batch = _batch(options.preset, input_seed(options.seed, rank))
    measured = {}
    for p in P:
        steps = {v: TrainingStep(_wrap(v, _module(options.preset, p, options.seed)), batch) for v in TIMED}
        samples = run_interleaved(steps, **options.run_lengths(), progress=progress, label=f"p={p}")
        dist.barrier()
        measured[p] = {
            "samples": samples,
            "bytes": {v: _bytes_per_iteration(options, p, v, batch) for v in VARIANTS},
            "max_diff_vs_local": _max_diff_vs_local(options, p, rank, world_size),
            "bucket_sizes": steps[OURS].model.reducer.bucket_sizes(),
            "gradient_bytes": sum(q.numel() * q.element_size() for q in steps[OURS].model.parameters()),
            "layer_bytes": sum(q.numel() * q.element_size() for q in steps[OURS].model.module.layers.parameters()),
        }
        dist.barrier()
    return measured


def run(options: BenchOptions, progress) -> dict:
    per_rank = launch(_measure, options.world_size, (options, progress), options.threads, options.timeout_s)
    results = {}
    for p in P:
        merged = merge_ranks([r[p]["samples"] for r in per_rank])
        first = per_rank[0][p]
        bytes_mean = {v: float(np.mean(first["bytes"][v])) for v in VARIANTS}
        vs_torch = stats.ratio(merged[OURS], merged[TORCH])
        local_ms, torch_ms = stats.median_ms(merged[LOCAL]), stats.median_ms(merged[TORCH])
        results[str(p)] = {
            "p": p,
            "ours_ms": stats.median_ms(merged[OURS]),
            "torch_ms": stats.median_ms(merged[TORCH]),
            "torch_skip_ms": stats.median_ms(merged[TORCH_SKIP]),
            "local_ms": local_ms,
            # What the ratio would be if everything torch's DDP adds to local
            # training shrank with the bytes sent, and nothing else changed.
            "ratio_if_time_followed_bytes": (
                local_ms + (torch_ms - local_ms) * bytes_mean[OURS] / bytes_mean[TORCH]) / torch_ms,
            "ratio": vs_torch["ratio"],
            "ratio_per_block": vs_torch["per_block"],
            "ratio_vs_skip": stats.ratio(merged[OURS], merged[TORCH_SKIP]),
            "ours_bytes": bytes_mean[OURS],
            "torch_bytes": bytes_mean[TORCH],
            "torch_skip_bytes": bytes_mean[TORCH_SKIP],
            "bytes_per_iteration": first["bytes"],
            "expected_kept_bytes": first["gradient_bytes"] - p * first["layer_bytes"],
            "gradient_bytes": first["gradient_bytes"],
            "layer_bytes": first["layer_bytes"],
            "max_diff_vs_local": first["max_diff_vs_local"],
            "bucket_sizes": first["bucket_sizes"],
            "summary": {v: stats.summarize(merged[v]) for v in TIMED},
            "samples_ms": {v: stats.values(merged[v]) for v in TIMED},
        }
    config = SIZES[options.preset]["bert"]
    notes = [
        f"Model: the `{options.preset}` BERT-like encoder ({config.config.layers} layers, hidden "
        f"{config.config.hidden}), {config.batch_size} sequences of {config.seq_len} tokens per rank; its encoder "
        "layers in a ddp_ext.LayerDrop with drop probability p, the same seed in every replica and variant.",
        "Both DDPs at their default bucket caps; ddp_ext keeps each encoder layer's parameters in buckets of "
        "their own (Note [Layer dropping]).",
        "ratio = median ddp_ext / median torch DDP with find_unused_parameters=True; [min-max] over back-to-back "
        "block pairs. ratio vs skip: against torch DDP with skip_all_reduce_unused_params=True as well. local: "
        "the same model and drops without DDP, one process per rank, interleaved with the others.",
        "if time followed bytes: (local + (torch - local) x ddp_ext bytes / torch bytes) / torch, the ratio if "
        "all the time torch's DDP adds to local training shrank in proportion to the bytes sent.",
        f"bytes: mean over {BYTES_ITERATIONS[options.quick]} untimed iterations of the bytes every allreduce of "
        "one rank carried (gradients plus the control allreduces), counted by a wrapping process group; expected "
        "kept: all gradient bytes minus p times the encoder layers' bytes, what dropping saves on average.",
        f"max |diff| vs local: after {PARITY_STEPS[options.quick]} SGD steps with dropout off, ddp_ext's "
        "parameters against one process training on the ranks' concatenated batches with the same drops.",
    ]
    return {"p": results, "notes": notes}


def _mib(value: float) -> str:
    return f"{value / 2**20:.2f}"


def table(data: dict) -> str:
    rows = []
    for r in data["p"].values():
        rows.append([
            f"{r['p']:g}",
            markdown.ms_iqr(r["summary"][OURS]),
            markdown.ms_iqr(r["summary"][TORCH]),
            markdown.ms_iqr(r["summary"][TORCH_SKIP]),
            markdown.ms_iqr(r["summary"][LOCAL]),
            markdown.ratio_spread({"ratio": r["ratio"], "per_block": r["ratio_per_block"]}),
            markdown.ratio(r["ratio_vs_skip"]["ratio"]),
            markdown.ratio(r["ratio_if_time_followed_bytes"]),
            _mib(r["ours_bytes"]),
            _mib(r["torch_bytes"]),
            _mib(r["torch_skip_bytes"]),
            _mib(r["expected_kept_bytes"]),
            f"{r['max_diff_vs_local']:.1e}",
        ])
    headers = ["p", "ddp_ext ms (IQR)", "torch DDP ms (IQR)", "torch DDP + skip ms (IQR)", "local ms (IQR)",
               "ddp_ext / torch [block range]", "ddp_ext / torch + skip", "if time followed bytes", "ddp_ext MiB/iter", "torch MiB/iter",
               "torch + skip MiB/iter", "expected kept MiB", "max |diff| vs local"]
    return markdown.table(headers, rows)


def plot(data: dict, path: str) -> None:
    results = list(data["p"].values())
    figure, (left, right) = figures.plt.subplots(1, 2, figsize=(12.0, 4.5))
    width = 0.2
    xs = np.arange(len(results))
    for k, v in enumerate(TIMED):
        left.bar(xs + (k - 1.5) * width, [r["summary"][v]["median_ms"] for r in results], width,
                 yerr=[[r["summary"][v]["median_ms"] - r["summary"][v]["q25_ms"] for r in results],
                       [r["summary"][v]["q75_ms"] - r["summary"][v]["median_ms"] for r in results]],
                 color=COLORS[v], label=LABELS[v])
        if v != LOCAL:
            key = {OURS: "ours_bytes", TORCH: "torch_bytes", TORCH_SKIP: "torch_skip_bytes"}[v]
            right.bar(xs + (k - 1) * width, [r[key] / 2**20 for r in results], width, color=COLORS[v],
                      label=LABELS[v])
    right.plot(xs, [r["expected_kept_bytes"] / 2**20 for r in results], "k_", markersize=30,
               label="all gradients - p x layers")
    for ax, label in ((left, "median per-iteration latency (ms), IQR bars"), (right, "MiB allreduced per iteration")):
        ax.set_xticks(xs, [f"p = {r['p']:g}" for r in results])
        ax.set_ylabel(label)
        ax.legend(fontsize="small")
    left.set_title("time")
    right.set_title("bytes on the wire")
    figures.save(figure, path, f"{TITLE} ({data['options']['world_size']} ranks)")
