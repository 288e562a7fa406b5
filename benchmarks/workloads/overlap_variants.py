"""The training steps the `overlap` experiment measures side by side.

Every variant builds the same replica from the same seed, on the same batch,
with the same bucket cap and Adam (foreach=True); see
benchmarks/experiments/overlap.py for what each variant is.
"""

import os
import traceback
from typing import Callable, Dict, Optional

import torch
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddp_ext import DistributedDataParallel as OurDDP
from benchmarks.workloads import scaleout_variants as sv
from benchmarks.workloads import tiny_mlp
from benchmarks.workloads.presets import MODELS as PRESET_MODELS
from benchmarks.workloads.presets import Workload, input_seed
from benchmarks.workloads.replicas import LOCAL, OURS, TORCH
from benchmarks.workloads.training_step import TrainingStep

MLP = "mlp"  # the scaleout experiment's MLP (workloads/scaleout_variants.py)
TINY = "tiny"  # the fixedcost experiment's MLP: an iteration of fixed costs
MODELS = (*PRESET_MODELS, MLP, TINY)

TORCH_IN_BACKWARD = "torch_in_backward"
OURS_OPTIMIZER = "ours_optimizer"
OURS_OVERLAP = "ours_overlap"  # the optimizer and the next forward overlapped
# The variants a row stands for, and the bare model that gives the computation.
VARIANTS = (TORCH, TORCH_IN_BACKWARD, OURS, OURS_OPTIMIZER, OURS_OVERLAP)
TIMED = (*VARIANTS, LOCAL)
LABELS = {TORCH: "torch DDP", TORCH_IN_BACKWARD: "torch DDP + optimizer in backward", OURS: "ddp_ext",
          OURS_OPTIMIZER: "ddp_ext + overlap_optimizer", OURS_OVERLAP: "ddp_ext + overlap_optimizer + forward",
          LOCAL: "local (no DDP)"}
LEARNING_RATE = 1e-4


def model_and_batch(model: str, preset: str, seed: int, rank: int):
    if model == MLP:
        torch.manual_seed(seed)
        return sv.ScaleoutMLP(0.0), sv.batch(input_seed(seed, rank))
    if model == TINY:
        return tiny_mlp.build_mlp(seed), tiny_mlp.batch(input_seed(seed, rank))
    workload = Workload(model, preset)
    return workload.build(seed), workload.batch(input_seed(seed, rank))


def gradient_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def adam(params) -> torch.optim.Adam:
    return torch.optim.Adam(params, lr=LEARNING_RATE, foreach=True)


def build(kind: str, model: str, preset: str, seed: int, rank: int, cap: Optional[float]) -> "OwnRandomness":
    """One variant's training step on this rank; `cap` the bucket cap in MiB (None: each DDP's default)."""
    module, batch = model_and_batch(model, preset, seed, rank)
    kwargs = {} if cap is None else {"bucket_cap_mb": cap}
    if kind == LOCAL:
        wrapped = module
    elif kind == TORCH_IN_BACKWARD:
        _apply_optimizer_in_backward(torch.optim.Adam, module.parameters(),
                                     {"lr": LEARNING_RATE, "foreach": True})
        wrapped = TorchDDP(module, **kwargs)
    elif kind == TORCH:
        wrapped = TorchDDP(module, **kwargs)
    else:
        wrapped = OurDDP(module, **kwargs)
    step = TrainingStep(wrapped, batch)
    if kind != TORCH_IN_BACKWARD:  # its backward leaves every .grad None: the step after it finds nothing
        step.optimizer = adam(module.parameters())
    if kind == OURS_OPTIMIZER:
        wrapped.overlap_optimizer(step.optimizer)
    if kind == OURS_OVERLAP:
        wrapped.overlap_optimizer(step.optimizer, overlap_forward=True)
    return OwnRandomness(step, input_seed(seed, rank))


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


def first_iteration_failure(step: Callable[[], object]) -> Optional[str]:
    """Runs one iteration; None if it ran, else what it raised and the
    deepest frame of torch.distributed or torch.nn.parallel on the way
    (every rank runs it: a failure must be the same on all of them)."""
    try:
        step()
        return None
    except Exception as error:  # noqa: BLE001 - any failure is the reason the variant is not measured
        return f"{type(error).__name__}: {error} ({_torch_frame(error)})"


def _torch_frame(error: BaseException) -> str:
    root = os.path.dirname(os.path.dirname(torch.__file__))
    frames = traceback.extract_tb(error.__traceback__)
    inside = [f for f in frames if os.sep.join(("torch", "distributed")) in f.filename
              or os.sep.join(("torch", "nn", "parallel")) in f.filename] or frames
    frame = inside[-1]
    return f"raised in {os.path.relpath(frame.filename, root)}:{frame.lineno}, {frame.name}"
