"""The reducer's autograd hooks live exactly as long as the wrapper."""

import gc

import torch
import torch.distributed as dist

import ddp_ext
from tests.support.native_extensions import accumulator_post_hook_count


def test_wrapper_installs_one_hook_per_parameter_and_removes_them():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        params = list(net.parameters())
        # Keep the accumulators alive across wrappers, as a training loop would.
        keep = [p.view_as(p).grad_fn.next_functions[0][0] for p in params]
        assert [accumulator_post_hook_count(p) for p in params] == [0] * 4

        ddp = ddp_ext.DistributedDataParallel(net)
        assert [accumulator_post_hook_count(p) for p in params] == [1] * 4
        del ddp
        gc.collect()
        assert [accumulator_post_hook_count(p) for p in params] == [0] * 4

        # A second wrapper works on the same module, with its own hooks only.
        ddp = ddp_ext.DistributedDataParallel(net)
        ddp(torch.ones(5, 4)).sum().backward()
        assert [accumulator_post_hook_count(p) for p in params] == [1] * 4
        assert all(p.grad is not None for p in params)
        del keep
    finally:
        dist.destroy_process_group()
