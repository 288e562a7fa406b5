"""Forming an epoch on one replica: the epoch's Gloo group, healing the
members that are behind from the one with the newest committed state, and a
fresh wrapper over the group (Note [Epochs and quorums] in
ddp_ext/fault_tolerance/roster.py; Note [What a replica holds] in
ddp_ext/fault_tolerance/heal.py)."""

import time
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ddp_ext.distributed import DistributedDataParallel
from ddp_ext.fault_tolerance import group as groups, heal


class StateLost(RuntimeError):
    """Every replica that held the run's committed state is gone."""


class EpochFormation:
    """What one replica trains with in its current epoch: the group and the
    wrapper over it (`ddp`), and what carries over from one epoch's wrapper
    to the next (the bucket caps, the cap tuner)."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        ddp_kwargs: dict,
        configure: Optional[Callable[[DistributedDataParallel, dist.ProcessGroup], None]],
        heartbeat_timeout: float,
    ):
        self.module = module
        self.optimizer = optimizer
        self._ddp_kwargs = ddp_kwargs
        self._configure = configure
        self._heartbeat_timeout = heartbeat_timeout
        self.ddp: Optional[DistributedDataParallel] = None
        self._group = None
        self._hooks_after_configure = 0
        self.formed: Optional[Tuple[int, Tuple[str, ...]]] = None  # (epoch, members) in use
        self.last_formed = -1  # the last epoch this replica trained in; -1: holds no state
        self._caps = None  # bucket caps to carry to the next wrapper
        self._auto_buckets = None
        self.last_heal_bytes = 0
        self.last_heal_s = 0.0
        self.last_wrap_s = 0.0

    def form(self, store, run_id: str, epoch: int, members: Tuple[str, ...], replica_id: str, step: int,
             history: bool) -> int:
        """Forms `epoch` with `members` (every member calls this at once) and
        returns this replica's committed step count afterwards: its own, or
        the one it was healed to. `history`: some epoch formed before, so
        members that hold no state cannot start the run afresh."""
        rank, size = members.index(replica_id), len(members)
        group = groups.make_group(store, run_id, epoch, rank, size, self._heartbeat_timeout)
        mine = torch.tensor([self.last_formed, step], dtype=torch.int64)
        rows = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
        group.allgather([rows], [mine]).wait()
        rows = [tuple(r.tolist()) for r in rows]
        holders = [r for r in range(size) if rows[r][0] >= 0]
        if not holders:
            if history:
                raise StateLost(
                    "every replica that held the run's committed state is gone (the members of "
                    f"epoch {epoch} are all new processes): restart the run from a checkpoint"
                )
            source, best = 0, rows[0]  # the run's start: rank 0's model, as DDP broadcasts it
        else:
            best = max(rows[r] for r in holders)
            source = min(r for r in holders if rows[r] == best)
        needy = [r for r in range(size) if r != source and (rows[r] != best or rows[r][0] < 0)]
        started = time.perf_counter()
        if rank == source and needy:
            blob = heal.capture(self.module, self.optimizer, step, self._current_caps(), self._auto_buckets)
            for r in needy:
                heal.send(group, blob, r)
            self.last_heal_bytes = len(blob) * len(needy)
        elif rank in needy:
            blob = heal.receive(group, source)
            state = heal.restore(blob, self.module, self.optimizer)
            step, self._caps, self._auto_buckets = state["step"], state["caps"], state["auto_buckets"]
            self.last_heal_bytes = len(blob)
        self.last_heal_s = time.perf_counter() - started
        started = time.perf_counter()
        self.ddp = self._wrap(group)
        self.last_wrap_s = time.perf_counter() - started
        self._group = group
        self.formed = (epoch, members)
        self.last_formed = epoch
        return step

    def check_hooks(self) -> None:
        """Refuses a hook registered on the wrapper directly (Replica's
        configure registers them, on every wrapper)."""
        if self.ddp is not None and len(self.ddp._comm_hooks) != self._hooks_after_configure:
            raise ValueError(
                "a communication hook was registered on replica.ddp directly: it would be lost when "
                "the group is re-formed after a failure; register it in Replica(configure=...) instead"
            )

    def release(self) -> None:
        """Drops the wrapper and the group (keeping what the next wrapper carries)."""
        if self.ddp is not None:
            self._caps = self._current_caps()
            self._auto_buckets = self.ddp._auto_buckets
            if self.ddp.reducer is not None:
                self.ddp.reducer._remove_autograd_hooks()
            self.ddp = None
        self._group = None
        self.formed = None

    def _current_caps(self):
        if self.ddp is not None and self.ddp.reducer is not None:
            return list(self.ddp.reducer.bucket_caps)
        return list(self._caps or [])

    def _wrap(self, group) -> DistributedDataParallel:
        """The one entry point by which ddp_ext learns that the group changed:
        a fresh wrapper over the new group, carrying the caps and the tuner."""
        ddp = DistributedDataParallel(self.module, process_group=group, init_sync=False, **self._ddp_kwargs)
        # A step applied inside the backward would be applied before the
        # quorum decides (Note [Committing a step]); an aborted step, run
        # again, would apply it twice.
        ddp._refuse_backward_steps(
            "under ddp_ext.fault_tolerance.Replica a step is applied only once every member of the quorum "
            "finished it, and the backward ends before that is known; let Replica(optimizer=...) step it")
        if self._auto_buckets is not None and ddp._auto_buckets is not None:
            ddp._auto_buckets = self._auto_buckets
            ddp._auto_buckets.restart()  # every member restarts it here, at the same step
        if self._caps and ddp.reducer is not None and list(ddp.reducer.bucket_caps) != list(self._caps):
            ddp.reducer._set_bucket_caps(list(self._caps))
        if self._configure is not None:
            self._configure(ddp, group)
        self._hooks_after_configure = len(ddp._comm_hooks)
        return ddp
