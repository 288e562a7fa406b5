"""Streaming DiLoCo: DDP inside each host, and across hosts an averaged
parameter change every few steps, in fragments overlapped with training,
in 32 or 8 bits. See docs/DILOCO.md.

    groups = ddp_ext.diloco.host_groups()
    ddp = ddp_ext.DistributedDataParallel(model, process_group=groups.inner)
    outer = ddp_ext.DiLoCo(ddp, inner_optimizer, sync_every=100)
    ...
    inner_optimizer.step()
    outer.step()
"""

from ddp_ext.diloco.diloco import DiLoCo
from ddp_ext.diloco.groups import HostGroups, host_groups
from ddp_ext.diloco.survival import FaultTolerance

__all__ = ["DiLoCo", "FaultTolerance", "HostGroups", "host_groups"]
