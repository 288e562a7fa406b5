"""Delayed parameters (`delay_all_reduce_named_params`) after
`_update_process_group`: three ranks train, rank 2 leaves, ranks 0 and 1 move
to a group of their own and train on. The delayed gradients are averaged over
the new group, as with torch's DDP (real 3-rank runs over Gloo)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddp_ext
from tests.support.worlds import shared_world

WORLD_SIZE = 3
STEPS_BEFORE, STEPS_AFTER = 2, 3


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    # No first bias: the hooked first weight's gradient comes last.
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(), nn.Linear(16, 4))


def _train(rank: int, wrapper, every_parameter_delayed: bool):
    net = _net()
    delayed = [("2.weight", net[2].weight), ("2.bias", net[2].bias)]
    if every_parameter_delayed:
        delayed += [("0.weight", net[0].weight)]
    # The last layer's gradients come first: the first layer's weight hook reduces them.
    ddp = wrapper(net, delay_all_reduce_named_params=delayed, param_to_hook_all_reduce=net[0].weight)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    group = None
    for step in range(STEPS_BEFORE + STEPS_AFTER):
        if step == STEPS_BEFORE:
            group = dist.new_group([0, 1])  # every rank of the world takes part in making it
            if rank == 2:
                break
            ddp._update_process_group(group)
        batch = torch.randn(4, 12, generator=torch.Generator().manual_seed(100 * step + rank))
        x, y = batch[:, :8], batch[:, 8:]
        F.mse_loss(ddp(x), y).backward()
        if not isinstance(ddp, ddp_ext.DistributedDataParallel):
            dist.barrier(group)  # torch's DDP does not wait for the delayed allreduce (ddp_ext does)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def _case(rank: int, world_size: int, wrapper_name: str, every_parameter_delayed: bool):
    wrapper = TorchDDP if wrapper_name == "torch" else ddp_ext.DistributedDataParallel
    return _train(rank, wrapper, every_parameter_delayed)


def test_delayed_parameters_are_averaged_over_the_new_group():
    world = shared_world(WORLD_SIZE)
    theirs = world.run(_case, "torch", False, timeout=180)
    ours = world.run(_case, "ddp_ext", False, timeout=180)
    for rank in (0, 1):
        for t, o in zip(theirs[rank], ours[rank]):
            assert torch.equal(t, o), f"rank {rank}: ddp_ext differs from torch's DDP by {(t - o).abs().max()}"


def test_every_parameter_delayed_moves_to_the_new_group():
    # torch's DDP builds no reducer when every parameter is delayed, and its
    # _update_process_group then fails. The two ranks left must train on
    # together, in step: ddp_ext's allreduce starts once the hooked (last)
    # gradient is accumulated (Note [The delayed allreduce starts after
    # accumulation]).
    ours = shared_world(WORLD_SIZE).run(_case, "ddp_ext", True, timeout=180)
    for a, b in zip(ours[0], ours[1]):
        assert torch.equal(a, b), "ranks 0 and 1 ended with different parameters"
    assert not all(torch.equal(a, b) for a, b in zip(ours[0], ours[2])), "rank 2 left: its parameters must differ"
