"""DiLoCo that survives a host's death: the outer exchange runs as a step of
a `ddp_ext.fault_tolerance.Replica`, whose coordinator decides who takes
part in each sync.

# Note [DiLoCo survives a host]

With `fault_tolerance=`, each host is a torch.distributed job of its own (its
default group is the host's ranks, the inner group), and every rank of every
host is a replica of one fault-tolerant run, named "<host_id>/<rank>". Each
sync (of one fragment: the n-th sync, counting every fragment's, is the
schedule's n-th launch) is one `Replica.run_step` over a module holding
every fragment's last synced parameters (`_Synced`), with the fragments'
outer optimizers as the replica's optimizer (`_OuterSteps`). In the step
the members' pseudo-gradients (in 32, 8 or 4 bits) travel over the quorum's
group, each host's ranks sending a share of their host's each (Note [DiLoCo
shares a host's exchange under fault tolerance]), and every rank adds the
members' values in the quorum's order, so all get the same bits; the
outer optimizer steps, and the live parameters are
merged, only once every member finished the exchange (Note [Committing a
step] in ddp_ext/fault_tolerance/commit.py). So:
  - a host that died between syncs is missing from the next sync's quorum:
    the others average without it and go on; what it trained since its
    last sync of each fragment is lost, nothing else;
  - a death during a sync aborts that sync on every survivor before any of
    them applies it, and the survivors run it again among themselves. In 8
    and 4 bits each attempt encodes from the residual held before the
    first, so what an aborted attempt rounded away is not counted twice;
  - every rank of every host applies the same mean, so a host's ranks stay
    equal, as DDP inside it needs;
  - a replacement (or a host started late) joins at the others' next sync:
    the replica heals it from a live peer (every fragment's synced
    parameters and outer optimizer state), it takes part in that sync with
    nothing to contribute, and afterwards starts from every fragment's new
    synced parameters, at the others' step. Its inner optimizer starts
    afresh, its 8- or 4-bit residuals at zero.
Error-feedback residuals are each rank's own: a dead host's die with it
(what they held is lost, as its training since its last sync is), the
survivors keep theirs, and a rank that was healed (a joiner, or one the
others went on without) zeroes its own.
Members that contribute nothing (joiners) are not counted in the mean:
every member says first whether it trained (an all-gather in the same
step), zeros stand for those that did not, and the sum is divided by the
number that did. The first sync, at construction, has no
contributor and steps nothing: it forms the first quorum, which starts every
host from the first member's parameters.
With a delay (tau > 0) the sync runs on a thread of its own (the Replica's
collectives are on the quorum's group, the training's on the host's) while
the training thread takes tau more steps; at the merge step it waits for
the sync, committed (with as many attempts as deaths required), and mixes
the stepped fragment into the live parameters. The pseudo-gradient is taken
at the launch, as without fault tolerance; a death while it is in flight
aborts the attempt, and the survivors run it again with the same
pseudo-gradients. The outer step (on the synced copy, which training does
not touch) is applied at the commit, on the sync's thread; only the merge
into the live parameters waits for the merge step.
"""

import dataclasses
import threading
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ddp_ext.diloco.outer_state import FragmentState
from ddp_ext.diloco.quorum_exchange import Contribution, gather_contributions, host_shares, shared_mean, whole_mean
from ddp_ext.diloco.schedule import Schedule


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
    """Every fragment's last synced parameters as one module: what a replica
    heals from a peer."""

    def __init__(self, synced: List[torch.nn.Parameter]):
        super().__init__()
        self.synced = nn.ParameterList(synced)


class _OuterSteps:
    """The fragments' outer optimizers as the one optimizer a Replica holds:
    it heals their states together, and at a commit steps the synced copy
    of the fragment whose sync committed with the mean the exchange left
    (`due`); the live parameters are merged later, by the training thread."""

    def __init__(self, fragments: List[FragmentState]):
        self._fragments = fragments
        self.due: Optional[Tuple[int, torch.Tensor]] = None  # (fragment, mean) of the sync being run
        self.stepped: Optional[int] = None  # the fragment the last commit stepped

    def step(self) -> None:
        self.stepped = None
        if self.due is not None:
            fragment, mean = self.due
            self._fragments[fragment].outer_step(mean)
            self.stepped = fragment
        self.due = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # outer_step leaves no gradient behind

    def state_dict(self) -> dict:
        return {"outer_optimizers": [f.optimizer.state_dict() for f in self._fragments]}

    def load_state_dict(self, state: dict) -> None:
        for fragment, saved in zip(self._fragments, state["outer_optimizers"], strict=True):
            fragment.optimizer.load_state_dict(saved)


class SurvivingSync:
    """The outer syncs of one rank of a fault-tolerant DiLoCo (Note [DiLoCo
    survives a host]): `launch` one, `finish` it (at once, or `delay` steps
    later: it runs on a thread of its own meanwhile)."""

    def __init__(self, fragments: List[FragmentState], schedule: Schedule, mix: float, delay: int,
                 settings: FaultTolerance, split_within_host: bool = True):
        from ddp_ext.fault_tolerance import Replica  # its threads and sockets only when asked for

        self._fragments = fragments
        self._schedule = schedule
        self._mix = mix
        self._delay = delay
        self._split = bool(split_within_host)
        self._steps = _OuterSteps(fragments)
        self._synced = _Synced([p for fragment in fragments for p in fragment.synced])
        self.replica = Replica(self._synced, self._steps, coordinator=settings.coordinator,
                               replica_id=f"{settings.host_id}/{dist.get_rank()}", run_id=settings.run_id,
                               heartbeat_timeout=settings.heartbeat_timeout)
        self._contributes = False  # until this rank took part in a committed sync
        self._expected = -1
        self._pseudo_gradient: Optional[torch.Tensor] = None  # this rank's, taken at the launch
        self._residual_before: Optional[dict] = None
        self._thread: Optional[threading.Thread] = None
        self._outcome: Optional[tuple] = None  # (StepResult, None) or (None, the exception)
        self.in_flight = False
        self.bytes_sent = 0
        self.last_members: tuple = ()  # the last committed sync's quorum
        self.last_attempts = 0  # how often it ran (more than 1: members failed during it)

    def sync(self, expected: int) -> int:
        """`launch` and `finish` at once."""
        self.launch(expected)
        return self.finish()

    def launch(self, expected: int) -> None:
        """Starts a sync; `expected`: its number as this rank counts
        (launches so far, every fragment's; -1 before its first). The
        pseudo-gradient is taken here: training may go on meanwhile."""
        self._expected = expected
        fragment = self._fragments[self._schedule.fragment_of(expected)] if expected > 0 else None
        self._pseudo_gradient = fragment.pseudo_gradient() if fragment is not None else None
        codec = fragment.codec if fragment is not None else None
        self._residual_before = codec.state_dict() if codec is not None else None
        self.in_flight = True
        if self._delay == 0 or expected <= 0:
            self._run()
        else:
            self._thread = threading.Thread(target=self._run, name="ddp_ext-diloco-sync", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._outcome = (self.replica.run_step(self._exchange), None)
        except BaseException as error:  # raised where the sync is finished, on the training thread
            self._outcome = (None, error)

    def finish(self) -> int:
        """Waits for the sync launched last, and merges it into the live
        parameters. Returns the number the quorum gave it: a rank the
        others went on without (dropped while stopped, then back; or
        joining) was healed to theirs, contributed nothing, and takes every
        fragment's synced parameters as its live ones."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        (result, error), self._outcome = self._outcome, None
        self.in_flight = False
        self._pseudo_gradient = None
        if error is not None:
            raise error
        healed = not (self._contributes and result.membership.step == self._expected)
        self._contributes = True
        self.last_members = result.membership.members
        self.last_attempts = result.attempts
        with torch.no_grad():
            if healed:
                for fragment in self._fragments:
                    fragment.mix_into_live(1.0)
                    if fragment.codec is not None:  # what it missed before is not the others' business now
                        fragment.codec.residual.zero_()
            elif self._steps.stepped is not None:
                self._fragments[self._steps.stepped].mix_into_live(self._mix)
        return result.membership.step

    def _exchange(self, membership) -> None:
        """One attempt: every member's payload over the quorum's group, the
        mean over those that trained left for the commit (Note [DiLoCo
        survives a host])."""
        self._steps.due = None
        group = self.replica.ddp.process_group  # not in torch.distributed's map of groups: used directly
        mine = Contribution(self._contributes and membership.step == self._expected, self._split)
        contributions = gather_contributions(group, mine, membership.world_size)
        if not any(c.trained for c in contributions):
            return  # nobody trained yet: the first quorum; nothing to step
        index = self._schedule.fragment_of(membership.step)
        fragment = self._fragments[index]
        if mine.trained:
            if self._residual_before is not None:  # an attempt after an aborted one encodes from the same residual
                fragment.codec.load_state_dict(self._residual_before)
            values = self._pseudo_gradient
            payload = values if fragment.codec is None else fragment.codec.encode(values)
        else:
            payload = torch.zeros(fragment.numel if fragment.codec is None else fragment.codec.payload_bytes,
                                  dtype=torch.float32 if fragment.codec is None else torch.uint8)
        mean, sent = self._mean(group, membership, contributions, payload, fragment)
        self.bytes_sent += sent
        self._steps.due = (index, mean)

    def _mean(self, group, membership, contributions, payload, fragment) -> Tuple[torch.Tensor, int]:
        """The quorum's mean of the payloads, each host's share only where
        that holds (Note [DiLoCo shares a host's exchange under fault
        tolerance]); and the bytes this member sent."""
        shares = host_shares(membership.members, contributions)
        if shares is None:
            return whole_mean(group, contributions, payload, fragment.codec)
        return shared_mean(group, membership.rank, contributions, payload, fragment.codec, fragment.numel, shares)
