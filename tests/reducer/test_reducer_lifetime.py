"""Freeing the wrapper from inside its own backward pass (a hook that drops
the last reference) must end that backward with a clear error on every rank,
never a crash: the callbacks the reducer queues on the autograd engine must
not outlive it. See Note [Reducer lifetime] in reducer/base/accumulator_hooks.h."""

import gc

import pytest
import torch
from torch import nn

import ddp_ext
from tests.support.spawn import run_ranks


def _free_inside_backward(rank, world_size, find_unused_parameters):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    holder = [ddp_ext.DistributedDataParallel(module, find_unused_parameters=find_unused_parameters)]
    leaf = torch.randn(3, 4, requires_grad=True)
    # `leaf`'s gradient is computed after every parameter's (it is behind one
    # more node), so the wrapper goes after its last bucket was launched.
    loss = holder[0](leaf * 1.0).sum()

    def drop_wrapper(grad):
        holder.clear()  # the last reference: the wrapper and its reducer go
        gc.collect()
        return grad

    leaf.register_hook(drop_wrapper)
    try:
        loss.backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("find_unused_parameters", [False, True])
def test_freeing_the_wrapper_inside_backward_raises_on_every_rank(find_unused_parameters):
    for rank, outcome in enumerate(run_ranks(_free_inside_backward, 2, find_unused_parameters, timeout=120)):
        assert "was destroyed during its backward pass" in outcome, f"rank {rank}: {outcome}"
