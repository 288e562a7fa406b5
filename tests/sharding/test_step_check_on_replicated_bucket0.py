"""The step check on a replicated bucket 0 under overlap_optimizer(...,
shard=True) (Note [The step check on a replicated bucket 0] in
reducer/agreement/step_check.h): where bucket 0 is smaller than
shard_min_bytes it is allreduced whole, and the backward's step check
rides on that allreduce as it does without sharding, so a backward of a
fully replicated model runs one collective, as torch's DDP does. Where
bucket 0 is sharded the check stays a collective of its own. Counted with
torch's profiler (each Gloo collective with its tensors' shapes); the
parameters stay bitwise torch's DDP's; ranks out of step are caught on the
bucket 0 that carries the check, with the same message on every rank."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.profiler import ProfilerActivity, profile

import ddp_ext
from tests.reducer.test_step_check_on_bucket0 import (Net, assert_caught_out_of_step, carried_numel, check_numel,
                                                     first_bucket, skip_one_backward)
from tests.support.harness import CaseTable


@dataclasses.dataclass(frozen=True)
class C:
    id: str
    shard_min_bytes: int  # Net's one bucket holds 163 float32 (652 bytes)
    rides: bool


CASES = [C("replicated", 64 * 1024, True), C("sharded", 0, False)]


def gloo_collectives(prof) -> list:
    """(name, shapes) of every Gloo collective the profile recorded, in order."""
    return [(e.name, e.input_shapes) for e in prof.events() if e.name.startswith("gloo:")]


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def count_collectives(rank: int, world_size: int, c: C):
    group = dist.new_group()
    try:
        ours = ddp_ext.DistributedDataParallel(Net(torch.float32, False), process_group=group)
        theirs = TorchDDP(Net(torch.float32, False), process_group=group)
        ours_opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
        theirs_opt = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
        ours.overlap_optimizer(ours_opt, shard=True, shard_min_bytes=c.shard_min_bytes)
        collectives = None
        for step in range(4):
            for model, opt in ((ours, ours_opt), (theirs, theirs_opt)):
                opt.zero_grad(set_to_none=True)
                loss = (model(batch(step, rank)) ** 2).sum()
                if model is ours and step == 2:
                    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                        loss.backward()
                    collectives = gloo_collectives(prof)
                else:
                    loss.backward()
                opt.step()
        same = [torch.equal(a, b) for a, b in zip(ours.module.parameters(), theirs.module.parameters())]
        return {"collectives": collectives, "first_bucket": first_bucket(ours), "same": same}
    finally:
        dist.destroy_process_group(group)


TABLE = CaseTable(count_collectives, CASES, timeout=180.0)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_one_collective_per_backward_when_bucket0_is_replicated(c, world_size):
    for rank, r in enumerate(TABLE.results(world_size, c)):
        collectives = r["collectives"]
        allreduces = [shapes for name, shapes in collectives if name == "gloo:all_reduce"]
        carried = carried_numel(r["first_bucket"], world_size)
        if c.rides:
            # One allreduce, of bucket 0 and the check's tail; nothing else.
            assert collectives == [("gloo:all_reduce", [[carried]])], f"rank {rank}: {collectives}"
        else:
            # The separate check (int64 slots); bucket 0 reduce-scattered without a tail.
            assert [[check_numel(world_size)]] in allreduces, f"rank {rank}: {collectives}"
            assert [[carried]] not in allreduces, f"rank {rank}: {collectives}"
        if world_size == 2 or c.rides:
            # Replicated: bucket 0's own allreduce, torch's; sharded at two
            # ranks: the ring-ordered sum (Note [Sharded buckets]).
            assert all(r["same"]), f"rank {rank}: parameters differ from torch's DDP's: {r['same']}"


def skip_a_backward(rank: int, world_size: int, c: C):
    group = dist.new_group()  # the dropped collectives stay on this group
    try:
        ddp = ddp_ext.DistributedDataParallel(Net(torch.float32, False), process_group=group)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=c.shard_min_bytes)
        return skip_one_backward(ddp, rank, world_size, lambda step: batch(step, 0), optimizer)
    finally:
        dist.destroy_process_group(group)


OUT_OF_STEP_TABLE = CaseTable(skip_a_backward, CASES, timeout=180.0, isolated=True)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_ranks_out_of_step_are_caught(c, world_size):
    results = OUT_OF_STEP_TABLE.results(world_size, c)
    assert_caught_out_of_step(results, world_size)
    for r in results:
        allreduces = r["shapes"]
        carried = carried_numel(r["first_bucket"], world_size)
        if c.rides:  # caught by the bucket 0 that carried the check
            assert [[carried]] in allreduces and [[check_numel(world_size)]] not in allreduces, allreduces
        else:
            assert [[check_numel(world_size)]] in allreduces, allreduces
