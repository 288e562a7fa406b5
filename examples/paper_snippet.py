"""The paper's section 3.1 example, with ddp_ext's DistributedDataParallel.

    torchrun --nproc_per_node=2 examples/paper_snippet.py
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim

import ddp_ext


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)

    # setup model and optimizer
    net = nn.Linear(10, 10)
    net = ddp_ext.DistributedDataParallel(net)
    opt = optim.SGD(net.parameters(), lr=0.01)

    # run forward pass
    inp = torch.randn(20, 10)
    exp = torch.randn(20, 10)
    out = net(inp)

    # run backward pass
    nn.MSELoss()(out, exp).backward()

    # update parameters
    opt.step()

    print(f"rank {dist.get_rank()}: one step done, weight sum {net.module.weight.sum().item():.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
