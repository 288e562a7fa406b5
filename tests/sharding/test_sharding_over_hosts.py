"""The sharded optimizer over several hosts of several ranks (torchrun's
LOCAL_WORLD_SIZE, faked on one machine): the reducer reduce-scatters over
the flat group, bitwise torch's DDP, and the parameters are all-gathered
across hosts, then inside each host (Note [Sharding over several hosts] in
ddp_ext/_sharded_optimizer.py; Note [Hierarchical all-gather] in
process_groups/hierarchical/backend.h)."""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from tests.sharding.shard_support import run, trained
from tests.support.harness import assert_states_bitwise
from tests.support.worlds import shared_world


@contextlib.contextmanager
def _hosts_of(rank: int, ranks_per_host: int):
    """torchrun's variables for `rank` on hosts of `ranks_per_host` ranks (the job's own)."""
    os.environ.update(LOCAL_WORLD_SIZE=str(ranks_per_host), LOCAL_RANK=str(rank % ranks_per_host))
    try:
        yield
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        os.environ.pop("LOCAL_RANK", None)


def _gathers(rank, world_size, ranks_per_host):
    """Each size all-gathered over the hierarchical twin and over the flat group, into a
    fresh output and in place (the input a view of the output)."""
    from ddp_ext import hierarchy

    with _hosts_of(rank, ranks_per_host):
        twin = hierarchy.reducer_group(True, dist.group.WORLD)
    results = []
    for size in (1, 7, 1000):
        mine = torch.arange(size, dtype=torch.float32) * 0.1 + rank
        flat = torch.empty(size * world_size)
        dist.all_gather_into_tensor(flat, mine, group=dist.group.WORLD)
        fresh = torch.full((size * world_size,), float("nan"))
        dist.all_gather_into_tensor(fresh, mine, group=twin, async_op=True).wait()
        in_place = torch.full((size * world_size,), float("nan"))
        in_place[rank * size:(rank + 1) * size] = mine
        dist.all_gather_into_tensor(in_place, in_place[rank * size:(rank + 1) * size], group=twin)
        results.append((torch.equal(fresh, flat), torch.equal(in_place, flat)))
    return results, hierarchy.hierarchical_gathers(twin)


@pytest.mark.parametrize("world_size,ranks_per_host", [(4, 2), (6, 3), (6, 2)])
def test_the_hierarchical_all_gather_gives_the_flat_one_s_bits(world_size, ranks_per_host):
    for rank, (results, gathers) in enumerate(shared_world(world_size).run(_gathers, ranks_per_host)):
        assert results == [(True, True)] * 3, f"rank {rank}: {results}"
        assert gathers >= 6, f"rank {rank}: {gathers} all-gathers ran in two steps"


R = run(optimizer="adam")


def _trained(rank, world_size, kind):
    from ddp_ext import hierarchy

    with _hosts_of(rank, 2):
        twin = hierarchy.reducer_group("auto", dist.group.WORLD)
        before = hierarchy.hierarchical_gathers(twin)  # the process runs other jobs too
        result = trained(rank, world_size, R, kind)
    result["gathers"] = hierarchy.hierarchical_gathers(twin) - before
    return result


@pytest.mark.parametrize("kind", ["sharded", "overlapped"])
def test_sharded_training_on_two_hosts_of_two_ranks_is_torch_ddp_bitwise(kind):
    """torchrun's 2 hosts x 2: the reduce-scatter runs flat, in the flat allreduce's order, and the
    all-gathers in two steps (before, the first backward raised: the hierarchical twin has no
    reduce-scatter)."""
    world = shared_world(4)
    ours = world.run(_trained, kind)
    torch_ddp = world.run(_trained, "torch")
    for rank in range(4):
        assert ours[rank]["gathers"] > 0, f"rank {rank}: no all-gather ran in two steps"
        assert_states_bitwise(ours[rank]["params"], torch_ddp[rank]["params"], f"rank {rank} parameters")
        assert_states_bitwise(ours[rank]["optimizer"], torch_ddp[rank]["optimizer"], f"rank {rank} optimizer")
