"""A tiny MLP (32 -> 64 -> 10, batch 8 per rank): an iteration made mostly of
fixed costs (fixedcost's model, and overlap's `tiny`)."""

from typing import Tuple

import torch
from torch import nn

SIZES = (32, 64, 10)
BATCH = 8


def build_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(SIZES[0], SIZES[1]), nn.ReLU(), nn.Linear(SIZES[1], SIZES[2]))


def batch(seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and class targets for one rank, fixed by `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, SIZES[0], generator=generator),
            torch.randint(0, SIZES[-1], (BATCH,), generator=generator))
