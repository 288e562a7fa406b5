"""At three ranks or more over Gloo each sharded bucket is reduce-scattered by
a ring of point-to-point sends that threads of the reducer drive (Note [A
ring of sends for the reduce-scatter] in
reducer/transport/ring_reduce_scatter.h); tests/sharding/test_ring_order.py
checks its result bitwise against torch's DDP. Here: a rank that dies in the
middle of a backward makes the others raise within seconds, not hang, naming
the reduce-scatter they waited for, and
training goes on over several steps and buckets with the ring (the
parameters bitwise torch's DDP's with SGD)."""

import os
import time

import pytest
import torch

from tests.support.spawn import run_ranks, run_ranks_with_a_victim


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
    )


def _dies_mid_backward(rank, world_size):
    import ddp_ext

    victim = world_size - 1
    net = _net()
    ddp = ddp_ext.DistributedDataParallel(net, bucket_cap_mb=1e-9)  # a bucket per parameter
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0)
    steps = [0]
    if rank == victim:
        # Dies in the backward of step 2, after the last layers' buckets left.
        net[0].weight.register_hook(lambda g: os._exit(3) if steps[0] == 2 else g)
    torch.manual_seed(rank)
    x = torch.randn(4, 6)
    start = None
    try:
        for step in range(4):
            steps[0] = step
            optimizer.zero_grad()
            loss = ddp(x).pow(2).mean()
            start = time.monotonic()
            loss.backward()
            optimizer.step()
    except Exception as e:  # noqa: BLE001 - the test checks what was raised
        first = type(e).__name__, str(e), time.monotonic() - start
    else:
        return None
    # Going on after the error: another backward raises too (a ring cut
    # short leaves messages that a later ring could take), never trains.
    start = time.monotonic()
    try:
        optimizer.zero_grad()
        ddp(x).pow(2).mean().backward()
        optimizer.step()
    except Exception as e:  # noqa: BLE001
        return (*first, (type(e).__name__, str(e), time.monotonic() - start))
    return (*first, None)


def test_a_rank_that_dies_mid_ring_makes_the_others_raise():
    world_size = 3
    outcomes, exit_code = run_ranks_with_a_victim(_dies_mid_backward, world_size, timeout_s=150)
    assert exit_code == 3, f"the victim ended with {exit_code}"
    for rank, outcome in enumerate(outcomes):
        assert outcome is not None, f"rank {rank} did not answer within 150 s (hang?): {outcomes}"
        name, message, seconds, again = outcome
        assert seconds < 60, f"rank {rank} raised only after {seconds:.0f} s: {name}: {message}"
        print(f"rank {rank}: {name} after {seconds:.1f} s: {message.splitlines()[0][:200]}")
        # A bucket's wait is named as the collective it is.
        assert "allreduce of bucket" not in message, message
        if " of bucket " in message:
            assert "the reduce-scatter of bucket" in message, message
        assert again is not None, f"rank {rank} trained on after the ring failed"
        assert again[2] < 60, f"rank {rank}'s next step raised only after {again[2]:.0f} s"
        print(f"rank {rank}, next step: {again[0]}: {again[1].splitlines()[0][:200]}")


def _train(rank, world_size, sharded):
    import ddp_ext

    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    if sharded:
        model = ddp_ext.DistributedDataParallel(net, bucket_cap_mb=1e-4)
        model.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0)
    else:
        model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=1e-4)
    for step in range(5):
        torch.manual_seed(100 * step + rank)
        x = torch.randn(8, 6)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("world_size", [3, 4])
def test_training_over_the_ring_is_torch_ddp_bitwise(world_size):
    sharded = run_ranks(_train, world_size, True)
    plain = run_ranks(_train, world_size, False)
    for rank in range(world_size):
        for ours, theirs in zip(sharded[rank], plain[rank]):
            assert torch.equal(ours, theirs), f"rank {rank}: largest difference {(ours - theirs).abs().max()}"
        for ours, first in zip(sharded[rank], sharded[0]):
            assert torch.equal(ours, first), f"rank {rank}'s parameters differ from rank 0's"
