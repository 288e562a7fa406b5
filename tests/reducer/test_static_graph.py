"""static_graph=True: the used set is learned in the first iteration; reentrant
activation checkpointing and never-used parameters work, as in torch's DDP."""

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddp_ext
from tests.support.worlds import shared_world

BATCH_PER_RANK = 4
STEPS = 4


class CheckpointedNet(nn.Module):
    """Two blocks under reentrant checkpointing, a plain head, and a layer the
    forward never uses."""

    def __init__(self):
        super().__init__()
        self.block1 = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.block2 = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)
        self.never_used = nn.Linear(8, 3)

    def forward(self, x):
        x = checkpoint.checkpoint(self.block1, x, use_reentrant=True)
        x = checkpoint.checkpoint(self.block2, x, use_reentrant=True)
        return self.head(x)


def _batches(world_size):
    g = torch.Generator().manual_seed(7)
    n = world_size * BATCH_PER_RANK
    # requires_grad on the input lets reentrant checkpointing build a graph.
    return [(torch.randn(n, 6, generator=g).requires_grad_(), torch.randn(n, 3, generator=g)) for _ in range(STEPS)]


def _train(model, batches, shard):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads_none = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x[shard]), y[shard]).backward()
        grads_none.append([p.grad is None for p in model.parameters()])
        opt.step()
    return grads_none


def _static_graph_runs(rank, world_size, wrapper_name):
    wrapper = {"ddp_ext": ddp_ext.DistributedDataParallel, "torch": TorchDDP}[wrapper_name]
    torch.manual_seed(0)
    net = CheckpointedNet()
    model = wrapper(net, static_graph=True)
    shard = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    grads_none = _train(model, _batches(world_size), shard)
    return {k: v.clone() for k, v in net.state_dict().items()}, grads_none


@pytest.mark.parametrize("world_size", [2, 3])
def test_static_graph_with_reentrant_checkpointing_matches_local_and_torch(world_size):
    ours = shared_world(world_size).run(_static_graph_runs, "ddp_ext")
    theirs = shared_world(world_size).run(_static_graph_runs, "torch")

    torch.manual_seed(0)
    local = CheckpointedNet()
    local_none = _train(local, _batches(world_size), slice(None))

    for rank, (state, grads_none) in enumerate(ours):
        for name, value in local.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name} vs local")
            torch.testing.assert_close(state[name], theirs[rank][0][name], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name} vs torch")
        assert grads_none == local_none == theirs[rank][1]
    # The never-used layer kept .grad None throughout.
    assert all(step[-2:] == [True, True] for step in local_none)
