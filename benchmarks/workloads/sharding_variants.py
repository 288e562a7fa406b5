"""The training steps the `sharding` experiment measures side by side.

The `overlap` experiment's steps (workloads/overlap_variants.py: the same
replica, seed, batch, bucket cap and Adam with foreach=True), and two more:
torch's DDP with torch's ZeroRedundancyOptimizer over Adam (stepped after the
backward: its overlap with DDP is refused on Gloo), and ddp_ext with
`overlap_optimizer(optimizer, shard=True, overlap_forward=True)`.
"""

from typing import Optional

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddp_ext import DistributedDataParallel as OurDDP
from benchmarks.workloads import overlap_variants as ov
from benchmarks.workloads.overlap_variants import OURS_OVERLAP, OwnRandomness
from benchmarks.workloads.presets import input_seed
from benchmarks.workloads.replicas import LOCAL, OURS, TORCH
from benchmarks.workloads.training_step import TrainingStep

TORCH_ZERO = "torch_zero"
OURS_SHARDED = "ours_sharded"
VARIANTS = (TORCH, TORCH_ZERO, OURS, OURS_OVERLAP, OURS_SHARDED)
TIMED = (*VARIANTS, LOCAL)
LABELS = {TORCH: "torch DDP", TORCH_ZERO: "torch DDP + ZeroRedundancyOptimizer", OURS: "ddp_ext",
          OURS_OVERLAP: "ddp_ext + overlap_optimizer + forward",
          OURS_SHARDED: "ddp_ext + overlap_optimizer(shard=True) + forward", LOCAL: "local (no DDP)"}


def build(kind: str, model: str, preset: str, seed: int, rank: int, cap: Optional[float]) -> OwnRandomness:
    """One variant's training step on this rank; `cap` the bucket cap in MiB (None: each DDP's default)."""
    if kind not in (TORCH_ZERO, OURS_SHARDED):
        return ov.build(kind, model, preset, seed, rank, cap)
    module, batch = ov.model_and_batch(model, preset, seed, rank)
    kwargs = {} if cap is None else {"bucket_cap_mb": cap}
    if kind == TORCH_ZERO:
        step = TrainingStep(TorchDDP(module, **kwargs), batch)
        step.optimizer = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.Adam,
                                                 lr=ov.LEARNING_RATE, foreach=True)
    else:
        wrapped = OurDDP(module, **kwargs)
        step = TrainingStep(wrapped, batch)
        step.optimizer = ov.adam(module.parameters())
        wrapped.overlap_optimizer(step.optimizer, shard=True, overlap_forward=True)
    return OwnRandomness(step, input_seed(seed, rank))
