"""DiLoCo that survives a host's death: the outer exchange runs as a step of
a `ddp_ext.fault_tolerance.Replica`, whose coordinator decides who takes
part in each sync.

# Note [DiLoCo survives a host]

With `fault_tolerance=`, each host is a torch.distributed job of its own (its
default group is the host's ranks, the inner group), and every rank of every
host is a replica of one fault-tolerant run, named "<host_id>/<rank>". Each
sync is one `Replica.run_step` over a module holding the last synced
parameters (`_Synced`): each rank's "gradient" is its pseudo-gradient, the
replica's DDP averages it over the sync's quorum, and the replica steps the
outer optimizer only once every member of the quorum finished the exchange
(Note [Committing a step] in ddp_ext/fault_tolerance/commit.py). So:
  - a host that died between syncs is missing from the next sync's quorum:
    the others average without it and go on; what it trained since its
    last sync is lost, nothing else;
  - a death during a sync aborts that sync on every survivor before any of
    them applies it, and the survivors run it again among themselves;
  - every rank of every host applies the same mean (one all-reduce over
    the quorum), so a host's ranks stay equal, as DDP inside it needs;
  - a replacement (or a host started late) joins at the others' next sync:
    the replica heals it from a live peer (the synced parameters and the
    outer optimizer's state), it takes part in that sync with nothing to
    contribute, and afterwards starts, like every rank, from the new
    synced parameters, at the others' step. Its inner optimizer starts
    afresh.
Members that contribute nothing (joiners) are not counted in the mean: each
contributor scales its pseudo-gradient by members / contributors, counted by
an all-reduce in the same step. The first sync, at construction, has no
contributor and steps nothing: it forms the first quorum, which starts every
host from the first member's parameters.
The exchange is not overlapped with training here (delay 0, one fragment):
a sync is over, or aborted, before training goes on.
"""

import dataclasses
from typing import List

import torch
import torch.distributed as dist
from torch import nn

from ddp_ext.diloco.outer_state import FragmentState


@dataclasses.dataclass(frozen=True)
class FaultTolerance:
    """Where DiLoCo's hosts meet to survive a death (docs/DILOCO.md).

    Args:
        coordinator: "host:port" of `python -m ddp_ext.fault_tolerance.coordinator`.
        host_id: this host's name, unique in the run; a replacement may reuse
            a dead host's name.
        run_id: the coordinator's --run-id.
        heartbeat_timeout: seconds of silence after which a rank is dropped;
            also the outer exchange's timeout (set it above the exchange's
            time on your links).
    """

    coordinator: str
    host_id: str
    run_id: str = "default"
    heartbeat_timeout: float = 10.0

    def problems(self) -> List[str]:
        found = []
        if not isinstance(self.host_id, str) or not self.host_id or "/" in self.host_id:
            found.append(f"fault_tolerance.host_id must be a non-empty name without '/', got {self.host_id!r}")
        timeout = self.heartbeat_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            found.append(f"fault_tolerance.heartbeat_timeout must be a positive number, got {timeout!r}")
        return found


class _Synced(nn.Module):
    """The last synced parameters as a module: what the replica heals and
    averages. forward(pseudo-gradients) is a loss whose gradient with
    respect to each parameter is its pseudo-gradient."""

    def __init__(self, synced: List[torch.nn.Parameter]):
        super().__init__()
        self.synced = nn.ParameterList(synced)

    def forward(self, pseudo_gradients: List[torch.Tensor]) -> torch.Tensor:
        return sum((p * g).sum() for p, g in zip(self.synced, pseudo_gradients))


class SurvivingSync:
    """The outer syncs of one rank of a fault-tolerant DiLoCo (Note [DiLoCo
    survives a host])."""

    def __init__(self, fragment: FragmentState, settings: FaultTolerance):
        from ddp_ext.fault_tolerance import Replica  # its threads and sockets only when asked for

        self._fragment = fragment
        self._synced = _Synced(fragment.synced)
        self.replica = Replica(self._synced, fragment.optimizer, coordinator=settings.coordinator,
                               replica_id=f"{settings.host_id}/{dist.get_rank()}", run_id=settings.run_id,
                               heartbeat_timeout=settings.heartbeat_timeout)
        self._contributes = False  # until this rank took part in a committed sync
        self._expected = -1
        self.last_members: tuple = ()  # the last committed sync's quorum
        self.last_attempts = 0  # how often it ran (more than 1: members failed during it)

    def sync(self, expected: int) -> int:
        """One sync, run again with the survivors if a member dies in it;
        afterwards the live parameters are the new synced ones. `expected`:
        the sync's number as this rank counts (syncs committed before it; -1
        before its first). Returns the number the quorum gives it: a rank
        the others went on without (dropped while stopped, then back) was
        healed to theirs, and contributed nothing."""
        self._expected = expected
        result = self.replica.run_step(self._exchange)
        self._contributes = True
        self.last_members = result.membership.members
        self.last_attempts = result.attempts
        with torch.no_grad():
            for synced, live in zip(self._fragment.synced, self._fragment.live):
                live.copy_(synced)
        return result.membership.step

    def _exchange(self, membership) -> None:
        for p in self._synced.parameters():
            p.grad = None
        ddp = self.replica.ddp
        contributes = self._contributes and membership.step == self._expected
        count = torch.tensor([1.0 if contributes else 0.0])
        # On the group itself: it is not in torch.distributed's map of groups.
        ddp.process_group.allreduce([count]).wait()
        if count.item() == 0:
            return  # nobody trained yet: the first quorum; nothing to step
        scale = membership.world_size / count.item() if contributes else 0.0
        with torch.no_grad():
            pseudo = [(s - p).mul_(scale) for s, p in zip(self._fragment.synced, self._fragment.live)]
        with torch.enable_grad():  # DiLoCo.step runs under no_grad
            ddp(pseudo).backward()
