"""A rank that caught an error which left collectives without a partner
goes on: freeing the wrapper and its process group does not block, and a
new wrapper over a new group trains. See Note [Collectives left without a
partner] in reducer/core/unpaired_collectives.h."""

import gc
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import ddp_ext
from tests.diagnosis.test_out_of_step import Net  # raises in forward when `fail` is set
from tests.support.spawn import run_ranks


def _out_of_step_then_go_on(rank: int, world_size: int, variant: str, first_to_free: int):
    group = dist.new_group()
    net = Net(buffers=variant == "buffers")
    ddp = ddp_ext.DistributedDataParallel(net, process_group=group, bucket_cap_mb=0)
    if variant == "hook":
        ddp.register_comm_hook(group, default_hooks.allreduce_hook)
    error = None
    for step in range(4):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        try:
            if step == 2 and rank == world_size - 1:
                net.fail = True
                try:
                    ddp(x)
                except ValueError:
                    continue
                finally:
                    net.fail = False
            (ddp(x) ** 2).sum().backward()
        except RuntimeError as raised:
            error = str(raised)
            break
    dist.destroy_process_group(group)
    del group, net
    # One rank frees the wrapper and its group while the other still holds
    # them and goes on: the first one's garbage collection must not wait for
    # the collectives the other never answers.
    freed_in = None
    if rank == first_to_free:
        del ddp
        start = time.monotonic()
        gc.collect()
        freed_in = time.monotonic() - start
    # A new wrapper over a new group trains as local training does.
    fresh = dist.new_group()
    model = nn.Linear(4, 2)
    torch.manual_seed(1)
    model.reset_parameters()
    again = ddp_ext.DistributedDataParallel(model, process_group=fresh)
    full = torch.randn(2 * world_size, 4, generator=torch.Generator().manual_seed(7))
    (again(full[2 * rank : 2 * rank + 2]) ** 2).sum().backward()
    grads = [p.grad.clone() for p in again.module.parameters()]
    dist.barrier(fresh)
    dist.destroy_process_group(fresh)
    return {"error": error, "freed_in": freed_in, "grads": grads, "full": full}


@pytest.mark.parametrize("first_to_free", [0, 1])
@pytest.mark.parametrize("variant", ["plain", "buffers", "hook"])
def test_a_rank_goes_on_after_collectives_were_left_without_a_partner(variant, first_to_free):
    outcomes = run_ranks(_out_of_step_then_go_on, 2, variant, first_to_free, timeout=60)
    for rank, outcome in enumerate(outcomes):
        assert outcome["error"] is not None and "out of step" in outcome["error"], f"rank {rank}: {outcome['error']}"
    freed_in = outcomes[first_to_free]["freed_in"]
    assert freed_in < 5.0, f"rank {first_to_free}: freeing the group took {freed_in:.1f} s"
    # The new wrapper's gradients: local training on the concatenated batch.
    local = nn.Linear(4, 2)
    torch.manual_seed(1)
    local.reset_parameters()
    world_size = len(outcomes)
    (local(outcomes[0]["full"]) ** 2).sum().div(world_size).backward()
    for outcome in outcomes:
        for ours, expected in zip(outcome["grads"], local.parameters()):
            torch.testing.assert_close(ours, expected.grad)
