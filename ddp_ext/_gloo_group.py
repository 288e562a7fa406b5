"""A Gloo process group met through a store, for groups made outside
`init_process_group` and `new_group` (the 8-bit exchange's companion group,
a fault-tolerant replica's group per epoch)."""

import datetime

import torch
import torch.distributed as dist

from ddp_ext import _exit


def gloo_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A ProcessGroup of `size` ranks whose collectives run on Gloo for every
    device Gloo serves, meeting under `store` (give each group a prefix of
    its own), with `timeout` for each collective."""
    backend = dist.ProcessGroupGloo(store, rank, size, timeout)
    group = dist.ProcessGroup(store, rank, size)
    gloo = dist.Backend.backend_type_map["gloo"]
    for device in dist.Backend.backend_capability["gloo"]:
        group._register_backend(torch.device(device), gloo, backend)
    group._set_default_backend(gloo)
    _exit.track(group)  # Note [Exit after training]
    return group
