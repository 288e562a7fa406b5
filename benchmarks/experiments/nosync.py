"""nosync [paper Figs. 10-11]: synchronising gradients every n iterations.

Latency (Fig. 10): for each n, one measured sample is a group of n iterations
(n - 1 forward/backward passes under no_sync, one synchronising pass, one
optimizer step) divided by n: the amortised per-iteration latency. ddp_ext and
torch's DDP alternate block by block; the values of n run one after another.
Convergence (Fig. 11): see nosync_convergence.py.
"""

import time

import numpy as np
import torch
from torch.nn import functional as F

from benchmarks.harness import smoothing, stats
from benchmarks.harness.interleave import merge_ranks, run_interleaved
from benchmarks.harness.launcher import launch
from benchmarks.harness.options import BenchOptions, effective_bucket_cap_mb
from benchmarks.reporting import figures, markdown, section
from benchmarks.workloads import nosync_convergence as convergence
from benchmarks.workloads.presets import Workload, input_seed
from benchmarks.workloads.replicas import LABELS, OURS, TORCH, make_replica
from benchmarks.workloads.training_step import LEARNING_RATE

NAME = "nosync"
FIGURE = "Figs. 10-11"
TITLE = "Skipping gradient synchronisation: latency and convergence"
# Samples here are groups of n iterations (15 iterations per round of n = 1, 2, 4, 8).
RUN_LENGTHS = {"warmup": 2, "blocks": 4, "block_iterations": 3}

KINDS = (OURS, TORCH)


class SyncEveryStep:
    """One call runs n iterations on a fixed batch, synchronising only the
    last, and returns {"total": amortised ms per iteration}."""

    def __init__(self, ddp, batch, sync_every: int):
        self.ddp = ddp
        self.inputs, self.targets = batch
        self.sync_every = sync_every
        self.optimizer = torch.optim.SGD(ddp.parameters(), lr=LEARNING_RATE)

    def _pass(self):
        F.cross_entropy(self.ddp(self.inputs), self.targets).backward()

    def __call__(self):
        start = time.perf_counter()
        with self.ddp.no_sync():
            for _ in range(self.sync_every - 1):
                self._pass()
        self._pass()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"total": (time.perf_counter() - start) * 1e3 / self.sync_every}


def _measure(rank, world_size, job):
    options, progress = job
    progress = progress.for_rank(rank)
    cap = effective_bucket_cap_mb(options.single_bucket_cap())
    measured = {}
    for model in options.models:
        workload = Workload(model, options.preset)
        batch = workload.batch(input_seed(options.seed, rank))
        measured[model] = {}
        for n in options.sync_every:
            variants = {k: SyncEveryStep(make_replica(k, workload, options.seed, cap), batch, n) for k in KINDS}
            measured[model][n] = run_interleaved(variants, **options.run_lengths(), progress=progress,
                                                 label=f"{model}, sync every {n}")
    return measured


def _latency(options, progress) -> dict:
    per_rank = launch(_measure, options.world_size, (options, progress), options.threads, options.timeout_s)
    models = {}
    for model in options.models:
        every = {}
        for n in options.sync_every:
            merged = merge_ranks([r[model][n] for r in per_rank])
            every[str(n)] = {"summary": {k: stats.summarize(merged[k]) for k in KINDS},
                             "ratio": stats.ratio(merged[OURS], merged[TORCH])}
        models[model] = {"sync_every": every, "workload": Workload(model, options.preset).describe()}
    return models


def _convergence(options, progress) -> dict:
    per_rank = launch(convergence.train_losses, options.world_size, (options, progress), options.threads,
                      options.timeout_s)
    runs = {}
    for label in per_rank[0]:
        runs[label] = {}
        for n in options.sync_every:
            mean_loss = np.mean([r[label][n] for r in per_rank], axis=0).tolist()
            smoothed = smoothing.smooth(mean_loss)
            tail = max(1, len(mean_loss) // 10)
            runs[label][str(n)] = {"loss": mean_loss, "smoothed": smoothed, "final_smoothed": smoothed[-1],
                                   "last_tenth_mean": float(np.mean(mean_loss[-tail:]))}
    return {
        "runs": runs,
        "iterations": convergence.iterations(options),
        "model": f"resnet50(base_width={convergence.BASE_WIDTH[options.preset]}, 1 input channel, 10 classes, "
                 "zero_init_residual)",
        "smoothing": f"scipy.signal.butter({smoothing.ORDER}, {smoothing.CUTOFF}) + filtfilt",
    }


def run(options: BenchOptions, progress) -> dict:
    options.single_bucket_cap()
    models = _latency(options, progress)
    progress.say("convergence on scikit-learn's digits")
    notes = [
        "Latency: amortised per-iteration ms = time of n iterations (one synchronising) / n.",
        "Convergence: loss is the mean over ranks of each rank's mini-batch loss; batch size is per rank.",
        f"Smoothed with an order-{smoothing.ORDER} Butterworth low-pass filter (cutoff {smoothing.CUTOFF} of "
        "Nyquist, our choice) through scipy.signal.filtfilt, as in the paper.",
    ]
    return {"models": models, "convergence": _convergence(options, progress), "notes": notes}


def run_line(data: dict) -> str:
    o = data["options"]
    return (f"preset `{o['preset']}`, seed {o['seed']}, {section.bucket_cap_text(o['bucket_cap_mb'])}; for each n, "
            f"per DDP {o['warmup']} warm-up groups of n "
            f"iterations, then {o['blocks']} blocks of {o['discard_per_block']} discarded + "
            f"{o['block_iterations']} measured groups, ddp_ext and torch DDP alternating block by block.")


def table(data: dict) -> str:
    rows = []
    for model, r in data["models"].items():
        first = r["sync_every"][next(iter(r["sync_every"]))]["summary"][OURS]["median_ms"]
        for n, s in r["sync_every"].items():
            rows.append([model, n, markdown.ms_iqr(s["summary"][OURS]), markdown.ms_iqr(s["summary"][TORCH]),
                         markdown.ratio_spread(s["ratio"]),
                         markdown.ratio(first / s["summary"][OURS]["median_ms"])])
    latency = markdown.table(["model", "sync every", "ddp_ext ms/iteration (IQR)", "torch DDP ms/iteration (IQR)",
                              "ddp_ext / torch [block range]", "ddp_ext speedup vs first row"], rows)
    conv = data["convergence"]
    rows = [[label, n, f"{run['final_smoothed']:.3f}", f"{run['last_tenth_mean']:.3f}"]
            for label, runs in conv["runs"].items() for n, run in runs.items()]
    losses = markdown.table(["digits, ddp_ext", "sync every", "final smoothed loss",
                             "mean loss, last tenth of iterations"], rows)
    return (f"{latency}\n\nConvergence: {conv['model']}, {conv['iterations']} iterations, "
            f"{conv['smoothing']}.\n\n{losses}")


def plot(data: dict, path: str) -> None:
    conv = data["convergence"]["runs"]
    figure, axes = figures.panels(len(data["models"]) + len(conv))
    for ax, (model, r) in zip(axes, data["models"].items()):
        every = [int(n) for n in r["sync_every"]]
        for offset, kind in ((-0.15, OURS), (0.15, TORCH)):
            summaries = [r["sync_every"][str(n)]["summary"][kind] for n in every]
            medians = [s["median_ms"] for s in summaries]
            spread = [[m - s["q25_ms"] for m, s in zip(medians, summaries)],
                      [s["q75_ms"] - m for m, s in zip(medians, summaries)]]
            ax.bar([i + offset for i in range(len(every))], medians, width=0.3, yerr=spread, capsize=3,
                   color=figures.COLORS[kind], label=LABELS[kind])
        ax.set_xticks(range(len(every)), every)
        ax.set_xlabel("synchronise every n iterations")
        ax.set_ylabel("amortised ms per iteration (median, IQR)")
        ax.set_title(f"{model} latency")
        ax.legend(fontsize="small")
    for ax, (label, runs) in zip(axes[len(data["models"]):], conv.items()):
        for n, run in runs.items():
            line, = ax.plot(run["smoothed"], label=f"sync every {n}")
            ax.plot(run["loss"], ".", markersize=1.5, alpha=0.3, color=line.get_color())
        ax.set_xlabel("iteration")
        ax.set_ylabel("training loss (dots raw, lines smoothed)")
        ax.set_title(f"digits, {label}")
        ax.legend(fontsize="small")
    figures.save(figure, path, f"{TITLE} ({data['options']['world_size']} ranks)")
