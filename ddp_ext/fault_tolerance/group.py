"""A Gloo process group per epoch, met through the coordinator's store
under a prefix of its own, with the heartbeat timeout as its collective
timeout: a collective waiting on a hung peer raises after that long instead
of hanging (Gloo honours the group's timeout in every collective)."""

import datetime
import time

import torch.distributed as dist

from ddp_ext._gloo_group import gloo_group
from ddp_ext.fault_tolerance.commit import _store_call
from ddp_ext.fault_tolerance.link import Link


def arrival_key(run_id: str, epoch: int) -> str:
    """The counter the members of an epoch meet on before making its group."""
    return f"{run_id}/form/{epoch}/arrived"


def meet(store, link: Link, run_id: str, epoch: int, size: int) -> bool:
    """Waits until all `size` members of `epoch` arrived; False if a newer
    epoch was announced first (go there instead)."""
    key = arrival_key(run_id, epoch)
    if _store_call(link, store.add, key, 1) >= size:
        return True
    pause = 0.0005
    while True:
        if _store_call(link, store.add, key, 0) >= size:
            return True
        link.check()
        if link.latest > epoch:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def make_group(store, run_id: str, epoch: int, rank: int, size: int, timeout_s: float) -> dist.ProcessGroup:
    prefix = dist.PrefixStore(f"{run_id}/group/{epoch}/", store)
    return gloo_group(prefix, rank, size, datetime.timedelta(seconds=timeout_s))
