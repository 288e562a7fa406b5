"""Collectives called from Python the way torch's own code calls them: with
an options object and, on the Work, `wait(timeout)`. A process group written
in Python (a `dist.ProcessGroup` subclass) receives exactly these arguments,
positionally, so it has no defaults to fall back on; a C++ group (Gloo, NCCL,
ddp_ext's own) gets what its defaults would have given."""

from datetime import timedelta
from typing import List

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions  # as torch's distributed_c10d

# c10d's kNoTimeout: wait until the work is done (the process group's own
# timeout still applies), what `work.wait()` means on a C++ Work.
NO_TIMEOUT = timedelta(0)


def wait(work) -> bool:
    return work.wait(NO_TIMEOUT)


def allgather(group: dist.ProcessGroup, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor]):
    return group.allgather(outputs, inputs, AllgatherOptions())


def allreduce(group: dist.ProcessGroup, tensors: List[torch.Tensor], op=dist.ReduceOp.SUM):
    options = AllreduceOptions()
    options.reduceOp = op
    return group.allreduce(tensors, options)
