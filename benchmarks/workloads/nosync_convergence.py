"""The convergence half of `nosync` [paper Fig. 11]: training loss when
gradients are synchronised every n iterations.

Like the paper (ResNet on MNIST, batch 8 with learning rate 0.02, and batch 256
with 0.06) we train a ResNet-50 (narrower in preset small) on real digits, with
ddp_ext's DDP. Between synchronisations gradients accumulate under no_sync and
the optimizer steps once per synchronisation, with the same learning rate, so
larger n means larger effective steps. Each run starts from the same seed and
sees the same data order. The blocks' last batch norms start at zero
(zero_init_residual): without it, in our trial runs the from-scratch loss
jumped several-fold early on whenever gradients accumulated, swamping the
effect being measured.
"""

import contextlib

import torch
from torch.nn import functional as F

from ddp_ext import DistributedDataParallel
from benchmarks.harness.options import BenchOptions
from benchmarks.workloads.digits import rank_batches
from benchmarks.workloads.models import resnet50

# (batch size per rank, learning rate), as in the paper's Fig. 11 (a) and (b).
CONFIGS = ((8, 0.02), (256, 0.06))
BASE_WIDTH = {"small": 16, "paper": 64}
ITERATIONS = {"small": 200, "paper": 1000}
QUICK_ITERATIONS = 20


def iterations(options: BenchOptions) -> int:
    if options.convergence_iterations:
        return options.convergence_iterations
    return QUICK_ITERATIONS if options.quick else ITERATIONS[options.preset]


def config_label(batch_size: int, lr: float) -> str:
    return f"batch {batch_size}, lr {lr:g}"


def _train(rank, world_size, options, batch_size, lr, sync_every):
    torch.manual_seed(options.seed)
    model = resnet50(base_width=BASE_WIDTH[options.preset], num_classes=10, in_channels=1, zero_init_residual=True)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    batches = rank_batches(rank, world_size, batch_size, options.seed)
    losses = []
    for iteration in range(iterations(options)):
        images, labels = next(batches)
        sync = (iteration + 1) % sync_every == 0
        with contextlib.nullcontext() if sync else ddp.no_sync():
            loss = F.cross_entropy(ddp(images), labels)
            loss.backward()
        if sync:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def train_losses(rank, world_size, job):
    """Rank body: {config label: {sync_every: this rank's loss per iteration}}."""
    options, progress = job
    progress = progress.for_rank(rank)
    runs = {}
    for batch_size, lr in CONFIGS:
        label = config_label(batch_size, lr)
        runs[label] = {}
        for n in options.sync_every:
            runs[label][n] = _train(rank, world_size, options, batch_size, lr, n)
            progress.say(f"convergence, {label}, sync every {n}: final loss {runs[label][n][-1]:.3f}")
    return runs
