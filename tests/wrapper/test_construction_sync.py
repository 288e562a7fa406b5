"""Construction broadcasts rank 0's parameters and buffers in coalesced chunks."""

import torch
from torch import nn

import ddp_ext
from tests.support.worlds import shared_world

LAYERS = 10


def _construct_under_profiler(rank, world_size):
    torch.manual_seed(rank)  # every rank starts from different weights
    net = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(LAYERS)])
    for buf in net.buffers():
        buf.fill_(rank)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ddp_ext.DistributedDataParallel(net)
    broadcasts = sum(e.name == "gloo:broadcast" for e in prof.events())
    return broadcasts, {k: v.clone() for k, v in net.state_dict().items()}


def test_construction_broadcasts_rank0_state_in_one_chunk_per_dtype():
    results = shared_world(3).run(_construct_under_profiler)
    tensors = 4 * LAYERS + 3 * LAYERS  # weights, biases, BN affine; BN buffers
    for rank, (broadcasts, _) in enumerate(results):
        # float32 (parameters and running stats) and int64 (num_batches_tracked)
        assert broadcasts == 2, f"rank {rank}: {broadcasts} broadcasts for {tensors} tensors"
    reference = results[0][1]
    torch.manual_seed(0)
    assert torch.equal(reference["0.0.weight"], nn.Linear(4, 4).weight), "rank 0 must keep its own weights"
    for rank, (_, state) in enumerate(results[1:], start=1):
        for name, value in reference.items():
            assert torch.equal(state[name], value), f"rank {rank}: {name} not overwritten by rank 0's"
