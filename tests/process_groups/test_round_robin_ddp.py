"""Training over round-robin groups gives the parameters plain Gloo gives.

torch's DDP (with and without a communication hook, which chains futures)
and ddp_ext's DDP each train the same model from the same data over the
default Gloo group and over round-robin groups of 1, 3 and 5 Gloo children.
Buckets are made tiny so that every iteration issues several allreduces, which
the round-robin groups spread over their children.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.support.worlds import shared_world

CHILD_COUNTS = [1, 3, 5]
STEPS = 3
TINY_BUCKET_MB = 1e-4  # ~100 bytes: about one parameter per bucket


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _torch_ddp(model, group):
    return nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=TINY_BUCKET_MB)


def _torch_ddp_with_hook(model, group):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = _torch_ddp(model, group)
    ddp.register_comm_hook(group, default_hooks.allreduce_hook)
    return ddp


def _ddp_ext(model, group):
    import ddp_ext

    return ddp_ext.DistributedDataParallel(model, process_group=group, bucket_cap_mb=TINY_BUCKET_MB)


WRAPPERS = {"torch": _torch_ddp, "torch+allreduce_hook": _torch_ddp_with_hook, "ddp_ext": _ddp_ext}


def _train(wrap, group, rank):
    model = wrap(_model(), group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x = torch.randn(5, 6, generator=generator)
        y = torch.randn(5, 3, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _training_matches_gloo(rank, world_size):
    import ddp_ext

    groups = {k: ddp_ext.new_round_robin_group(num_groups=k) for k in CHILD_COUNTS}
    mismatches = []
    for name, wrap in WRAPPERS.items():
        reference = _train(wrap, dist.group.WORLD, rank)
        for k, group in groups.items():
            params = _train(wrap, group, rank)
            if not all(torch.equal(a, b) for a, b in zip(params, reference)):
                worst = max((a - b).abs().max().item() for a, b in zip(params, reference))
                mismatches.append(f"{name} over {k} children: parameters differ from plain Gloo by up to {worst}")
    turns = {k: g._get_backend(torch.device("cpu")).forwarded_calls for k, g in groups.items()}
    assert not mismatches, "\n".join(mismatches)
    return turns


@pytest.mark.parametrize("world_size", [2, 3])
def test_training_over_round_robin_matches_plain_gloo(world_size):
    turns = shared_world(world_size).run(_training_matches_gloo)
    assert all(t == turns[0] for t in turns), f"ranks made different numbers of collective calls: {turns}"
    # Each run issued many more collectives than there are children, so every
    # child took part.
    assert min(turns[0].values()) > 2 * max(CHILD_COUNTS) * len(WRAPPERS), turns[0]
