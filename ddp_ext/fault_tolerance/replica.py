"""Replica: one data-parallel replica of a fault-tolerant run.

    replica = Replica(model, optimizer, coordinator="host:29600", replica_id="r0", heartbeat_timeout=2.0)
    while replica.step < steps:
        replica.run_step(train_step)   # train_step(membership): forward and backward through replica.ddp

run_step finds the step's quorum (forming a new Gloo group and healing
joiners when membership changed), runs `train_step`, and applies the
optimizer step only if every member of the quorum finished it (Note
[Committing a step] in ddp_ext/fault_tolerance/commit.py); when a member
failed, it runs the step again with the survivors. Forming an epoch (its
group, healing, the wrapper) is ddp_ext/fault_tolerance/formation.py.
"""

import dataclasses
import logging
import datetime
import traceback
from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ddp_ext.distributed import DistributedDataParallel
from ddp_ext.fault_tolerance import _wire, commit, group as groups, heal, link as links
from ddp_ext.fault_tolerance.formation import EpochFormation, StateLost
from ddp_ext.fault_tolerance.link import CoordinatorLost, Link, ReplicaDropped

_log = logging.getLogger("ddp_ext.fault_tolerance")

# DistributedDataParallel arguments the replica sets itself.
_OWN_ARGUMENTS = ("process_group", "init_sync", "device_mesh")


@dataclasses.dataclass(frozen=True)
class Membership:
    """Who takes part in the step being run (what a sampler shards by)."""

    step: int  # committed steps so far: the number of the step being run
    rank: int  # this replica's index among the live members
    world_size: int  # live members in this step's quorum
    members: Tuple[str, ...]  # their replica ids, by rank
    epoch: int  # the membership epoch (Note [Epochs and quorums])


@dataclasses.dataclass(frozen=True)
class StepResult:
    membership: Membership  # the quorum that committed the step
    value: Any  # what train_step returned
    attempts: int  # 1 unless members failed during the step


class Replica:
    """One replica of a fault-tolerant data-parallel run; see the module doc
    and docs/FAULT_TOLERANCE.md.

    Args:
        module: the model, the same architecture on every replica.
        optimizer: its optimizer (stepped by run_step when a step commits).
        coordinator: "host:port" of `python -m ddp_ext.fault_tolerance.coordinator`.
        replica_id: this replica's name, unique in the run (a restarted replica
            may reuse its old name).
        run_id: the coordinator's --run-id.
        heartbeat_timeout: seconds of silence after which the coordinator drops
            this replica; also every collective's timeout, so a hung peer makes
            collectives raise after that long.
        ddp_kwargs: arguments for ddp_ext's DistributedDataParallel (not
            process_group, init_sync or device_mesh).
        configure: called as configure(ddp, group) on every new wrapper, e.g. to
            register a communication hook (hooks do not carry over).
        max_attempts: how often one step may fail with the same members before
            run_step re-raises the error (a failure that is not a peer's).
        connect_timeout: seconds to keep trying to reach the coordinator, at the
            start and after losing it (a cut link: Note [A silent link]).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        *,
        coordinator: str,
        replica_id: str,
        run_id: str = "default",
        heartbeat_timeout: float = 5.0,
        ddp_kwargs: Optional[dict] = None,
        configure: Optional[Callable[[DistributedDataParallel, dist.ProcessGroup], None]] = None,
        max_attempts: int = 3,
        connect_timeout: float = 30.0,
    ):
        if isinstance(heartbeat_timeout, bool) or not isinstance(heartbeat_timeout, (int, float)) \
                or not heartbeat_timeout > 0:
            raise ValueError(f"heartbeat_timeout must be a positive number of seconds, got {heartbeat_timeout!r}")
        ddp_kwargs = dict(ddp_kwargs or {})
        for name in _OWN_ARGUMENTS:
            if name in ddp_kwargs:
                raise ValueError(
                    f"Replica makes the process group of every membership epoch itself: do not pass "
                    f"{name!r} in ddp_kwargs"
                )
        self.module = module
        self.optimizer = optimizer
        self.replica_id = replica_id
        self.run_id = run_id
        self.heartbeat_timeout = float(heartbeat_timeout)
        self._formation = EpochFormation(module, optimizer, ddp_kwargs, configure, self.heartbeat_timeout)
        self._max_attempts = max_attempts
        host, port = _wire.parse_address(coordinator)
        self._store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=connect_timeout))
        served = self._store.get("ddp_ext/coordinator_run_id").decode()
        if served != run_id:
            raise ValueError(
                f"the coordinator at {coordinator} serves run {served!r}, and this replica "
                f"({replica_id!r}) belongs to run {run_id!r}: point it at its own run's coordinator"
            )
        control_port = int(self._store.get(f"{run_id}/control_port"))
        self._bound_store(port)
        self._store_address = (host, port, connect_timeout)
        hello = {"type": "hello", "run_id": run_id, "replica_id": replica_id,
                 "heartbeat_timeout": self.heartbeat_timeout,
                 "fingerprint": heal.fingerprint(module, optimizer)}
        self._link_args = (host, control_port, hello, self.heartbeat_timeout, connect_timeout)
        self._link = Link(*self._link_args)
        self.rejoins = 0
        self._step = 0
        self._next_epoch: Optional[int] = None  # named by the last commit decision
        self._failed_epoch = 0  # after an abort: wait for an epoch newer than this

    # --- what the loop reads ------------------------------------------------

    @property
    def step(self) -> int:
        """Committed steps so far."""
        return self._step

    @property
    def membership(self) -> Membership:
        """The current quorum (forming it first if membership changed)."""
        return self._quorum()

    @property
    def ddp(self) -> Optional[DistributedDataParallel]:
        """The wrapper over the current epoch's group (None between epochs);
        a new one whenever membership changes."""
        return self._formation.ddp

    @property
    def last_heal_bytes(self) -> int:
        """Bytes this replica sent or received healing at the last formation."""
        return self._formation.last_heal_bytes

    @property
    def last_heal_s(self) -> float:
        """Seconds the last formation spent healing."""
        return self._formation.last_heal_s

    @property
    def last_wrap_s(self) -> float:
        """Seconds the last formation spent building the wrapper."""
        return self._formation.last_wrap_s

    # --- one step -----------------------------------------------------------

    def run_step(self, train_step: Callable[[Membership], Any]) -> StepResult:
        """Runs `train_step(membership)` (forward and backward through
        self.ddp, zeroing gradients first as usual) until a quorum commits it,
        then applies the optimizer step. See Note [Committing a step]."""
        attempts, same_members_failures, last_members, rejoins = 0, 0, None, 0
        while True:
            try:
                membership = self._quorum()
                attempts += 1
                if membership.members != last_members:
                    same_members_failures, last_members = 0, membership.members
                drops = heal.layer_drop_counters(self.module)
                error = None
                try:
                    self._formation.check_hooks()
                    value = train_step(membership)
                except (CoordinatorLost, ReplicaDropped):
                    raise
                except Exception as exc:  # a peer failed, or this step did
                    _drop_locals(exc)  # Note [A failed step holds its wrapper]
                    self._link.check()
                    error, value = exc, None
                decision = commit.decide(self._store, self._link, self.run_id, membership.epoch, self._step,
                                         membership.members, voted=error is None)
            except (ReplicaDropped, CoordinatorLost) as exc:
                # Stopped or cut off for longer than the heartbeat timeout: the
                # others went on without this replica. Join again (raises
                # CoordinatorLost if the coordinator is gone: Note [A silent
                # link]); the next formation heals it if it is behind.
                rejoins += 1
                if rejoins > self._max_attempts + 2:
                    raise
                self._rejoin(exc)
                continue
            if decision.committed:
                if self.optimizer is not None:
                    self.optimizer.step()
                self._step += 1
                self._next_epoch = decision.next_epoch
                self._link.progress = (membership.epoch, self._step)
                return StepResult(membership, value, attempts)
            # Aborted: nothing applied; run the step again with the next quorum.
            heal.set_layer_drop_counters(self.module, drops)
            for p in self.module.parameters():
                p.grad = None
            self._abandon(membership.epoch)
            if isinstance(error, (ValueError, TypeError)):
                raise error  # this replica's own mistake, not a peer's failure
            same_members_failures += 1
            if same_members_failures >= self._max_attempts:
                raise RuntimeError(
                    f"step {self._step} failed {same_members_failures} times with the same members "
                    f"{list(membership.members)}; the last error on this replica is chained below"
                ) from error

    # --- membership ---------------------------------------------------------

    def _quorum(self) -> Membership:
        link = self._link
        formed = self._formation.formed
        if formed is not None and self._next_epoch in (None, formed[0]):
            epoch, members = formed
            return Membership(self._step, members.index(self.replica_id), len(members), members, epoch)
        target = self._next_epoch
        while True:
            link.check()
            if target is None or link.members(target) is None:
                floor = self._failed_epoch
                link.wait(lambda: link.latest > floor and (target is None or target in link.epochs), 0.5)
                link.check()
                if link.latest <= floor:
                    continue
                target = target if target in link.epochs else link.latest
            members = link.members(target)
            if self.replica_id not in members:
                # Not in this quorum (dropped, or not yet let in): wait for one that has us.
                floor = target
                link.wait(lambda: link.latest > floor, 0.5)
                target = link.latest if link.latest > floor else target
                self._release()
                continue
            self._release()
            if not groups.meet(self._store, link, self.run_id, target, len(members)):
                target = link.latest
                continue
            try:
                self._form(target, members)
            except (CoordinatorLost, ReplicaDropped, StateLost):
                raise
            except Exception as exc:
                _drop_locals(exc)  # Note [A failed step holds its wrapper]
                link.check()
                if not isinstance(exc, RuntimeError):  # Gloo's errors are RuntimeErrors; this is a bug
                    self._abandon(target)
                    raise
                _log.warning("replica %s: forming epoch %d failed: %s", self.replica_id, target, exc)
                self._abandon(target)
                target = None
                continue
            self._next_epoch = target
            return self._quorum()

    def _form(self, epoch: int, members: Tuple[str, ...]) -> None:
        self._step = self._formation.form(self._store, self.run_id, epoch, members, self.replica_id, self._step,
                                          history=self._link.history)
        self._link.progress = (epoch, self._step)
        self._link.send({"type": "formed", "epoch": epoch, "step": self._step})

    def _release(self) -> None:
        self._formation.release()

    def _abandon(self, epoch: int) -> None:
        self._link.send({"type": "abort", "epoch": epoch})
        self._release()
        self._failed_epoch = max(self._failed_epoch, epoch)
        self._next_epoch = None

    def _bound_store(self, port: int) -> None:
        # Blocking store calls (Gloo's rendezvous) wait at most this long, and
        # a silent link ends them too (Note [A silent link]).
        self._store.set_timeout(datetime.timedelta(seconds=self.heartbeat_timeout + 2.0))
        links.bound_connections(port, self.heartbeat_timeout, self.heartbeat_timeout + 2.0)

    def _rejoin(self, cause: Exception) -> None:
        self._release()
        self._link.close()
        host, control_port, hello, heartbeat_timeout, connect_timeout = self._link_args
        _log.warning("replica %s: %s; saying hello again", self.replica_id, cause)
        self._link = links.reconnect(host, control_port, hello, heartbeat_timeout, connect_timeout)
        # The store's connection may have failed mid-call (its answers would
        # be out of step): a new one.
        host, port, connect_timeout = self._store_address
        self._store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=connect_timeout))
        self._bound_store(port)
        self._failed_epoch = 0
        self._next_epoch = None
        self.rejoins += 1

    def close(self) -> None:
        """Leaves the run (the others go on without this replica)."""
        self._release()
        self._link.close()


# Note [A failed step holds its wrapper]
# An exception's traceback holds the frames it passed through, and they hold
# their locals: a failed forward's frames hold the wrapper (self), and so
# its reducer and process group, with the group's threads and sockets. The
# replica keeps a failed step's error until it knows whether to raise it,
# which is after the next epoch formed; and frames that refer to each other
# wait for a garbage collection, at no point anyone can name. So the old
# group lingered beside the new one, and a long run held a changing number
# of dead groups. The frames' locals are dropped where the error is caught
# (traceback.clear_frames: the traceback still prints every line), so
# release() frees the old wrapper and group at once, by reference count.
def _drop_locals(error: BaseException) -> None:
    """Clears the locals of the finished frames in `error`'s traceback and
    in those of the errors it was raised from or during."""
    seen, pending = set(), [error]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        pending += [error.__cause__, error.__context__]
