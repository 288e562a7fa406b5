"""One timed training iteration: forward with loss, backward, optimizer step."""

import time
from typing import Dict, Tuple

import torch
from torch import nn
from torch.nn import functional as F

# The paper trains with SGD and cross-entropy; the learning rate only matters
# for the convergence experiment, which sets its own.
LEARNING_RATE = 0.01

PHASES = ("forward", "backward", "optimizer")


class TrainingStep:
    """Calling it runs one iteration on a fixed batch and returns milliseconds
    per phase: forward (including the loss), backward (including, under DDP,
    waiting for the gradient allreduces), optimizer (step and zero_grad), total.
    On CUDA each phase ends with torch.cuda.synchronize(), so that it counts
    the GPU work it queued."""

    def __init__(self, model: nn.Module, batch: Tuple[torch.Tensor, torch.Tensor], lr: float = LEARNING_RATE):
        self.model = model
        self.inputs, self.targets = batch
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        self.on_cuda = self.inputs.is_cuda

    def _now(self) -> float:
        if self.on_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def __call__(self) -> Dict[str, float]:
        t0 = self._now()
        loss = F.cross_entropy(self.model(self.inputs), self.targets)
        t1 = self._now()
        loss.backward()
        t2 = self._now()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = self._now()
        return {
            "forward": (t1 - t0) * 1e3,
            "backward": (t2 - t1) * 1e3,
            "optimizer": (t3 - t2) * 1e3,
            "total": (t3 - t0) * 1e3,
        }
