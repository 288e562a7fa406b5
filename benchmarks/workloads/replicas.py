"""The implementations under comparison, each wrapping its own identical replica."""

from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddp_ext import DistributedDataParallel as OurDDP
from benchmarks.workloads.presets import Workload

OURS = "ours"  # ddp_ext.DistributedDataParallel
TORCH = "torch"  # torch.nn.parallel.DistributedDataParallel
LOCAL = "local"  # the bare model, no communication
OURS_NO_HANG_WATCH = "ours_no_hang_watch"  # ddp_ext with hang attribution off (hang_timeout_s=0)
KINDS = (OURS, TORCH, LOCAL)
LABELS = {OURS: "ddp_ext", TORCH: "torch DDP", LOCAL: "local", OURS_NO_HANG_WATCH: "ddp_ext, no hang watch"}


def make_replica(kind: str, workload: Workload, seed: int, bucket_cap_mb: Union[float, str, None] = None,
                 process_group: Optional[dist.ProcessGroup] = None, device: Optional[torch.device] = None) -> nn.Module:
    """A replica built from `seed`, wrapped as `kind`, on `device` (default:
    where the workload builds it, the CPU). bucket_cap_mb None keeps the
    wrappers' defaults (25 MiB with a 1 MiB first bucket, in both); any
    other value goes to both wrappers unchanged ("auto": ddp_ext's only)."""
    model = workload.build(seed)
    if device is not None:
        model = model.to(device)
    if kind == LOCAL:
        return model
    kwargs = {"process_group": process_group}
    if bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    if kind == OURS:
        return OurDDP(model, **kwargs)
    if kind == OURS_NO_HANG_WATCH:
        return OurDDP(model, hang_timeout_s=0, **kwargs)
    if kind == TORCH:
        return TorchDDP(model, **kwargs)
    raise ValueError(f"unknown implementation {kind!r}; choose from {', '.join(KINDS)}")
