"""Measures what each DDP does when one rank gets out of step, side by side.

    torchrun --nproc_per_node=2 tools/out_of_step_probe.py

For ddp_ext's and torch's DistributedDataParallel, with and without
BatchNorm buffers, rank 1 either catches an exception raised in its forward
at iteration 3 and goes on, or skips its backward there. Each rank reports
how many iterations it trained after that point, the seconds from the
misbehaviour to its first error, and the error's first words. Each case runs
in a process group of its own with a 10 s timeout, so a hang shows as an
error after about 10 s. One run on a shared machine: the times are
indicative only.
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ddp_ext  # noqa: E402

ITERATIONS = 8
ODD = 3
TIMEOUT = datetime.timedelta(seconds=10)


class Net(nn.Module):
    def __init__(self, buffers: bool):
        super().__init__()
        torch.manual_seed(0)
        self.fc0 = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8) if buffers else nn.Identity()
        self.fc1 = nn.Linear(8, 2)
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise ValueError("a bad batch")
        return self.fc1(torch.tanh(self.norm(self.fc0(x))))


def run(wrapper, buffers: bool, misbehaviour: str, rank: int) -> str:
    group = dist.new_group(timeout=TIMEOUT)
    net = Net(buffers)
    ddp = wrapper(net, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    odd_at = None
    trained_after = 0
    try:
        for i in range(ITERATIONS):
            opt.zero_grad()
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * i + rank))
            if i == ODD and rank == 1:
                odd_at = time.monotonic()
                if misbehaviour == "forward exception":
                    net.fail = True
                    try:
                        ddp(x)
                    except ValueError:
                        pass
                    net.fail = False
                    continue
            if i == ODD and rank == 0:
                odd_at = time.monotonic()
            loss = (ddp(x) ** 2).sum()
            if i == ODD and rank == 1 and misbehaviour == "skipped backward":
                continue
            loss.backward()
            opt.step()
            if i >= ODD:
                trained_after += 1
        dist.barrier(group)
        outcome = "no error"
        seconds = float("nan")
    except RuntimeError as error:
        seconds = time.monotonic() - odd_at
        outcome = str(error).splitlines()[0][:70]
    return f"{trained_after:>3} iterations trained after it, {seconds:6.2f} s to error: {outcome}"


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for misbehaviour in ("forward exception", "skipped backward"):
        for buffers in (False, True):
            for name, wrapper in (("ddp_ext", ddp_ext.DistributedDataParallel), ("torch", TorchDDP)):
                line = run(wrapper, buffers, misbehaviour, rank)
                lines = [None] * dist.get_world_size()
                # The default group is untouched by the case's hangs.
                dist.all_gather_object(lines, line)
                if rank == 0:
                    what = f"{misbehaviour} on rank 1, {'BatchNorm' if buffers else 'no buffers'}, {name}"
                    print(what)
                    for r, text in enumerate(lines):
                        print(f"  rank {r}: {text}")
                    sys.stdout.flush()


if __name__ == "__main__":
    main()
