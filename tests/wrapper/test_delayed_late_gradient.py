"""Delayed parameters whose gradient is accumulated after the delayed
allreduce has started race with it (in torch's DDP too): ddp_ext warns once,
naming them; hooked on the last gradient, it stays silent (2-rank runs over
Gloo)."""

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import ddp_ext
from tests.support.worlds import shared_world


def _case(rank: int, world_size: int, hook_last: bool):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(), nn.Linear(16, 4))
    delayed = [("0.weight", net[0].weight), ("2.weight", net[2].weight)]
    hooked = net[0].weight if hook_last else net[2].weight  # 0.weight's gradient comes last
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = ddp_ext.DistributedDataParallel(net, delay_all_reduce_named_params=delayed,
                                              param_to_hook_all_reduce=hooked)
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            F.mse_loss(ddp(x), torch.zeros(4, 4)).backward()
    return [str(w.message) for w in caught if "delay_all_reduce_named_params" in str(w.message)]


def test_a_delayed_gradient_after_the_allreduce_started_is_warned_of_once():
    world = shared_world(2)
    late = world.run(_case, False, timeout=120)
    for rank in (0, 1):
        assert len(late[rank]) == 1, late[rank]
        assert f"rank {rank}" in late[rank][0] and "0.weight" in late[rank][0]
        assert "2.weight" not in late[rank][0]
    assert world.run(_case, True, timeout=120) == [[], []]
