"""Frees the DDP wrapper from a hook inside its own backward pass, on every rank.

    torchrun --nproc_per_node=2 tools/free_inside_backward_probe.py ddp_ext
    torchrun --nproc_per_node=2 tools/free_inside_backward_probe.py torch

Prints, per rank and for find_unused_parameters False then True, what the
backward pass did: returned, or raised (and the message).
"""

import gc
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ddp_ext  # noqa: E402


def main() -> None:
    wrapper = ddp_ext.DistributedDataParallel if sys.argv[1] == "ddp_ext" else TorchDDP
    dist.init_process_group("gloo")
    for find_unused in (False, True):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        holder = [wrapper(module, find_unused_parameters=find_unused)]
        leaf = torch.randn(3, 4, requires_grad=True)
        # leaf's gradient comes after every parameter's: the wrapper goes
        # once all its buckets were launched.
        loss = holder[0](leaf * 1.0).sum()

        def drop_wrapper(grad):
            holder.clear()
            gc.collect()
            return grad

        leaf.register_hook(drop_wrapper)
        try:
            loss.backward()
            outcome = "backward returned"
        except RuntimeError as error:
            outcome = f"raised: {str(error).splitlines()[0][:160]}"
        print(f"rank {dist.get_rank()}, find_unused_parameters={find_unused}: {outcome}", flush=True)


if __name__ == "__main__":
    main()
