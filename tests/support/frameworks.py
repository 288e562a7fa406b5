"""What the framework integration tests share.

Each test trains one tiny model twice in the same spawned world, once with
the framework wrapping it in ddp_ext's DDP and once in torch's, and compares
the final parameters. The ranks see different batches, so a rank whose
gradients were not averaged ends with different parameters: the check fails.
"""

import os
from typing import Dict, List

import torch

from tests.support.harness import assert_states_close, same_bits

FEATURES = 4
SAMPLES = 64  # 32 per rank at world size 2: 8 batches
BATCH = 4


def set_torchrun_env(rank: int, world_size: int) -> None:
    """The variables torchrun sets, so that a framework started inside a
    spawned rank (whose process group tests/support/spawn.py has already made) takes
    itself for a rank of an external launcher and launches nothing."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # never dialled: the process group exists
    )


def dataset() -> torch.utils.data.TensorDataset:
    """The same samples on every rank; samplers give each rank its share."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x @ torch.randn(FEATURES, 2, generator=g) + 0.1 * torch.randn(SAMPLES, 2, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def params(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def assert_parity(per_rank: List[Dict[str, Dict[str, torch.Tensor]]], what: str) -> None:
    """per_rank[r] holds rank r's final parameters under "ext" and "torch":
    ddp_ext's equal torch's on every rank, and training moved them."""
    initial = params(net())
    for rank, r in enumerate(per_rank):
        assert_states_close(r["ext"], r["torch"], f"{what}, rank {rank}, ddp_ext vs torch DDP")
        moved = [n for n, t in r["ext"].items() if not same_bits(t, initial[n])]
        assert moved, f"{what}, rank {rank}: training left every parameter as it was"
