"""The wrapper's Python per training step, counted: a forward through
ddp_ext makes no more Python function calls than one through torch's DDP,
and the backward with the optimizer's step no more either, on the same
small model at 2 ranks over Gloo, once past the sampled first iterations
of the logging data. Each call is a fixed cost on every iteration
(docs/BENCHMARKS.md, fixedcost); a count, unlike a time, does not depend on
the machine's load. torch's DDP is the reference because its count moves
with torch's version.

Left out of the count: the frames of the wrappers that keep dynamo out of
the wrapper's own methods (torch._disable_dynamo). torch's DDP needs one,
on forward; ddp_ext needs four, because dynamo skips torch's files but
would trace ddp_ext's (Note [torch.compile] in ddp_ext/distributed.py)."""

import os
import sys

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddp_ext
from tests.support.spawn import run_ranks

STEPS = 10
WARMUP = 12  # the logging data samples iterations 1-10, then every 100th
# Where the frames of torch._disable_dynamo's wrappers come from.
DYNAMO_FOLDER = os.path.join("torch", "_dynamo", "")
DYNAMO_FILES = (os.path.join("torch", "_compile.py"), os.path.join("torch", "compiler", "__init__.py"))


def _dynamo_wrapper(frame) -> bool:
    path = frame.f_code.co_filename
    return DYNAMO_FOLDER in path or path.endswith(DYNAMO_FILES)


def _python_calls(ddp, optimizer, batch, part: str) -> float:
    """Python function calls per step in `part` ("forward" or "step":
    forward, backward and the optimizer)."""
    x, y = batch
    calls = [0]

    def count(frame, event, arg):
        if event == "call" and not _dynamo_wrapper(frame):
            calls[0] += 1

    def step(counted: bool):
        optimizer.zero_grad()
        if counted and part == "forward":
            sys.setprofile(count)
        output = ddp(x)
        if counted and part == "forward":
            sys.setprofile(None)
        if counted and part == "step":
            sys.setprofile(count)
        nn.functional.mse_loss(output, y).backward()
        optimizer.step()
        if counted:
            sys.setprofile(None)

    for _ in range(WARMUP):
        step(counted=False)
    for _ in range(STEPS):
        step(counted=True)
    return calls[0] / STEPS


def _count(rank, world_size):
    torch.manual_seed(0)
    batch = (torch.randn(8, 16), torch.randn(8, 1))
    result = {}
    for name, wrap in (("ddp_ext", ddp_ext.DistributedDataParallel), ("torch", TorchDDP)):
        module = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
        ddp = wrap(module)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        result[name] = {part: _python_calls(ddp, optimizer, batch, part) for part in ("forward", "step")}
    return result


def test_a_training_step_makes_no_more_python_calls_than_torchs():
    for rank, counts in enumerate(run_ranks(_count, 2)):
        print(f"rank {rank}: Python calls per step {counts}")
        for part in ("forward", "step"):
            assert counts["ddp_ext"][part] <= counts["torch"][part], (rank, part, counts)
