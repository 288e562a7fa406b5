"""DiLoCo: DDP inside each group of ranks (a host), and across groups only
an averaged parameter change every few steps, in fragments, overlapped with
training. See docs/DILOCO.md."""

import dataclasses
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ddp_ext.diloco import fragments as _fragments
from ddp_ext.diloco import groups as _groups
from ddp_ext.diloco.agreement import agree
from ddp_ext.diloco.exchange import Arrived, Exchange
from ddp_ext.diloco.host_split import HostSplit, parts_by_rank
from ddp_ext.diloco.outer_state import FragmentState, OuterOptimizerFactory, default_outer_optimizer
from ddp_ext.diloco.schedule import Schedule
from ddp_ext.diloco.settings import Settings, default_mix
from ddp_ext.diloco.survival import FaultTolerance, SurvivingSync


@dataclasses.dataclass
class _InFlight:
    fragment: int
    merge_step: int
    exchange: object  # Exchange or Arrived


class DiLoCo:
    """Streaming DiLoCo around a DDP model whose process group is one inner
    group (a host's ranks: see `ddp_ext.diloco.host_groups`).

        outer = ddp_ext.DiLoCo(ddp, inner_optimizer, sync_every=100)
        ...
        inner_optimizer.step()
        outer.step()

    Args:
        ddp: a DistributedDataParallel (ddp_ext's or torch's) built over the
            inner group.
        inner_optimizer: the optimizer stepping ddp's parameters (saved and
            loaded with the rest of the state).
        sync_every: H, inner steps between two syncs of a fragment.
        fragments: F, parts the parameters are cut into, synced at steps
            spread over each H (1 <= F <= H).
        delay: tau, inner steps an exchange overlaps before it is merged
            (tau < H / F).
        outer_optimizer: a function from a list of parameters to the torch
            optimizer stepping them; called once per fragment, with that
            fragment's last synced copies. Default: Nesterov SGD, lr 0.7,
            momentum 0.9.
        bits: 32 (float32), 8 or 4 (one scale per `int8_chunk` elements,
            and error feedback across syncs).
        mix: weight of the new global parameters at a merge; default 1
            without delay, 0.5 with (Note [DiLoCo merge]).
        inner_group: ddp's process group (default: taken from ddp).
        outer_group: this rank's outer group (default: derived from the inner
            groups, the ranks at the same position in each).
        split_within_host: each rank of an inner group exchanges only its
            part of each fragment across hosts, and the group's ranks then
            all-gather the parts' means among themselves: the same result,
            with as many times fewer bytes across hosts as the group has
            ranks (Note [DiLoCo splits the exchange within a host]; with
            fault_tolerance, Note [DiLoCo shares a host's exchange under
            fault tolerance]). False: every rank exchanges the whole
            fragment.
        fault_tolerance: a `ddp_ext.diloco.FaultTolerance`: each host is a job
            of its own (its default group is the inner group), the hosts meet
            through a fault-tolerance coordinator, and a host that dies is
            dropped at the next sync (Note [DiLoCo survives a host]).

    Construction is collective over the default process group; bad
    settings raise ValueError on every rank.
    """

    def __init__(self, ddp: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *, sync_every: int,
                 fragments: int = 1, delay: int = 0, outer_optimizer: Optional[OuterOptimizerFactory] = None,
                 bits: int = 32, mix: Optional[float] = None, int8_chunk: int = 1024,
                 inner_group: Optional[dist.ProcessGroup] = None, outer_group: Optional[dist.ProcessGroup] = None,
                 split_within_host: bool = True, fault_tolerance: Optional[FaultTolerance] = None):
        self.settings = Settings(sync_every, fragments, delay, bits, default_mix(delay, mix), int8_chunk)
        self.module = getattr(ddp, "module", None)
        self.inner_optimizer = inner_optimizer
        self._parameters = [p for p in self.module.parameters() if p.requires_grad] if self.module is not None else []
        inner = inner_group if inner_group is not None else getattr(ddp, "process_group", None)
        problems = self.settings.problems() + _local_problems(ddp, inner_group, inner_optimizer, outer_optimizer,
                                                              self._parameters)
        if fault_tolerance is not None:
            problems += _surviving_problems(fault_tolerance, inner, outer_group)
        self._fragments: List[FragmentState] = []
        if not problems:
            problems += self._make_fragments(outer_optimizer or default_outer_optimizer)
        facts = (_groups.members(inner) if inner is not None else [],
                 _groups.members(outer_group) if outer_group is not None else None)
        same = {"settings": self.settings, "outer_group given": outer_group is not None,
                "split_within_host": bool(split_within_host), "fault_tolerance": fault_tolerance,
                "parameters": [(tuple(p.shape), str(p.dtype)) for p in self._parameters]}
        gathered = agree("DiLoCo", problems, same, facts)
        self._schedule = Schedule(self.settings)
        self._in_flight: List[_InFlight] = []
        self.bytes_sent = 0
        self.inner_group = inner
        self._surviving: Optional[SurvivingSync] = None
        if fault_tolerance is not None:
            self.outer_group = None
            self._surviving = SurvivingSync(self._fragments, self._schedule, self.settings.mix, self.settings.delay,
                                            fault_tolerance, split_within_host)
            self._surviving_merge_step = 0
            self._step = self._schedule.launch_step(self._surviving.sync(-1))
            return
        inner_by_rank = [inner_members for inner_members, _ in gathered]
        outer_by_rank = None if outer_group is None else [outer_members for _, outer_members in gathered]
        structure = _groups.structure_problems(inner_by_rank, outer_by_rank)
        if structure:
            raise ValueError("DiLoCo: " + "; ".join(structure))  # the same on every rank: all saw the same facts
        self.outer_group = outer_group if outer_group is not None else _groups.derive_outer(inner_by_rank)
        self._split = _host_split(inner_by_rank, outer_by_rank) if split_within_host else None
        self._step = 0
        self._next_event = self._schedule.next_event(0, [])
        self._start_equal()

    def _make_fragments(self, factory: OuterOptimizerFactory) -> List[str]:
        try:
            runs = _fragments.split(self._parameters, self.settings.fragments)
            self._fragments = [FragmentState([self._parameters[i] for i in run], factory, self.settings.bits,
                                             self.settings.int8_chunk) for run in runs]
        except Exception as error:  # the user's factory may raise anything: report it on every rank
            return [f"{type(error).__name__}: {error}"]
        return []

    @torch.no_grad()
    def _start_equal(self) -> None:
        """Every group starts from the outer group's first rank's parameters
        (DDP made them equal inside each group), and syncs from there."""
        source = dist.get_global_rank(self.outer_group, 0)
        for p in self._parameters:
            dist.broadcast(p.data, src=source, group=self.outer_group)
        for fragment in self._fragments:
            fragment.reset_synced()

    @property
    def step_count(self) -> int:
        """Inner steps taken so far (calls of `step`)."""
        return self._step

    def fragment_parameters(self) -> List[List[torch.nn.Parameter]]:
        """The model's parameters by fragment, in registration order."""
        return [list(fragment.live) for fragment in self._fragments]

    def global_parameters(self) -> List[torch.Tensor]:
        """The last synced parameters in the model's parameter order: the same
        on every rank (the live ones differ between groups between syncs)."""
        return [p.detach() for fragment in self._fragments for p in fragment.synced]

    def step(self) -> None:
        """Call after each `inner_optimizer.step()`: launches the fragments
        whose step this is and merges the exchanges due."""
        self._step += 1
        if self._surviving is not None:
            with torch.no_grad():
                self._surviving_step()
            return
        if self._step < self._next_event:  # most steps: nothing to launch or merge
            return
        with torch.no_grad():
            self._launch_and_merge()
        self._next_event = self._schedule.next_event(self._step, [f.merge_step for f in self._in_flight])

    def _surviving_step(self) -> None:
        self._finish_surviving_sync()
        if self._schedule.launches_at(self._step):
            self._surviving.launch(self._schedule.launches_up_to(self._step))
            self._surviving_merge_step = self._schedule.merge_step(self._step)
            self._finish_surviving_sync()

    def _launch_and_merge(self) -> None:
        for p in self._schedule.launches_at(self._step):
            fragment = self._fragments[p]
            exchange = Exchange(fragment.pseudo_gradient(), self.outer_group, fragment.codec, self._split)
            self.bytes_sent += exchange.bytes_sent
            self._in_flight.append(_InFlight(p, self._schedule.merge_step(self._step), exchange))
        due = [f for f in self._in_flight if f.merge_step <= self._step]
        self._in_flight = [f for f in self._in_flight if f.merge_step > self._step]
        for flight in due:
            self._fragments[flight.fragment].merge(flight.exchange.wait(), self.settings.mix)

    def _finish_surviving_sync(self) -> None:
        """Finishes the fault-tolerant sync in flight if its merge step has
        come; a rank healed to the others' sync takes their step count."""
        if not self._surviving.in_flight or self._step < self._surviving_merge_step:
            return
        number = self._surviving.finish()
        self._step = self._schedule.launch_step(number) + self.settings.delay
        self.bytes_sent = self._surviving.bytes_sent  # every attempt's, the sync's own thread counting

    def state_dict(self) -> Dict:
        """Everything a resumed run needs to continue bit for bit: the model,
        the inner optimizer, each fragment's outer state and the exchanges in
        flight (waited for here, and kept as their results)."""
        if self._surviving is not None and self._surviving.in_flight:
            raise ValueError("DiLoCo.state_dict: with fault_tolerance, a sync is in flight until its merge step; "
                             "save at a step with none in flight (before a launch, or at or after its merge)")
        for flight in self._in_flight:
            flight.exchange = Arrived(flight.exchange.wait())
        return {
            "settings": dataclasses.asdict(self.settings),
            "step": self._step,
            "bytes_sent": self.bytes_sent,
            "model": self.module.state_dict(),
            "inner_optimizer": self.inner_optimizer.state_dict(),
            "fragments": [fragment.state_dict() for fragment in self._fragments],
            "in_flight": [{"fragment": f.fragment, "merge_step": f.merge_step, "mean": f.exchange.wait().clone()}
                          for f in self._in_flight],
        }

    def load_state_dict(self, state: Dict) -> None:
        """Restores what `state_dict` saved, into a DiLoCo with the same
        settings and no exchange in flight (one just constructed)."""
        if self._surviving is not None:
            raise ValueError("DiLoCo.load_state_dict: with fault_tolerance a host (re)starts by healing from a live "
                             "peer at the next sync; a checkpoint cannot be loaded into one host alone")
        saved = Settings(**state["settings"])
        if saved != self.settings:
            raise ValueError(f"DiLoCo.load_state_dict: saved with {saved}, this one has {self.settings}")
        if self._in_flight:
            raise ValueError("DiLoCo.load_state_dict: exchanges are in flight; load into a DiLoCo that has not "
                             "stepped since the last merge (one just constructed)")
        self.module.load_state_dict(state["model"])
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        for fragment, saved_fragment in zip(self._fragments, state["fragments"], strict=True):
            fragment.load_state_dict(saved_fragment)
        self._in_flight = [_InFlight(f["fragment"], f["merge_step"], Arrived(f["mean"].clone()))
                           for f in state["in_flight"]]
        self._step = state["step"]
        self.bytes_sent = state["bytes_sent"]
        self._next_event = self._schedule.next_event(self._step, [f.merge_step for f in self._in_flight])


def _host_split(inner_by_rank, outer_by_rank) -> Optional[HostSplit]:
    """This rank's share of its host's exchanges (None with one rank per
    host: nothing to share), from every rank's groups. Makes a group per
    inner group for the parts' gather: collective over the default group."""
    if len(inner_by_rank[dist.get_rank()]) == 1:
        return None
    if outer_by_rank is None:
        outer_by_rank = _groups.derived_outer_by_rank(inner_by_rank)
    parts = parts_by_rank(outer_by_rank)
    gathering = _groups.make_groups(sorted({tuple(group) for group in inner_by_rank}))
    inner_members = _groups.members(gathering)
    return HostSplit(parts[dist.get_rank()], len(inner_members), gathering, [parts[m] for m in inner_members])


def _surviving_problems(fault_tolerance, inner, outer_group) -> List[str]:
    """What keeps these arguments from a fault-tolerant DiLoCo."""
    if not isinstance(fault_tolerance, FaultTolerance):
        return [f"fault_tolerance must be a ddp_ext.diloco.FaultTolerance, got {type(fault_tolerance).__name__}"]
    problems = fault_tolerance.problems()
    if outer_group is not None:
        problems.append("with fault_tolerance the coordinator makes the outer groups: do not pass outer_group")
    if inner is not None and dist.get_world_size(inner) != dist.get_world_size():
        problems.append("with fault_tolerance each host is a job of its own: the DDP model's group must be the "
                        "whole default process group (the host's ranks)")
    return problems


def _local_problems(ddp, inner_group, inner_optimizer, outer_optimizer, parameters) -> List[str]:
    """What this rank alone sees wrong with the arguments besides the settings."""
    problems = []
    ddp_group = getattr(ddp, "process_group", None)
    if getattr(ddp, "module", None) is None or ddp_group is None:
        problems.append(f"the model must be a DistributedDataParallel over the inner group, got {type(ddp).__name__}")
    elif inner_group is not None and inner_group is not ddp_group:
        problems.append("inner_group is not the process group the DDP model averages over")
    if not isinstance(inner_optimizer, torch.optim.Optimizer):
        problems.append(f"inner_optimizer must be a torch.optim.Optimizer, got {type(inner_optimizer).__name__}")
    else:
        ours = {id(p) for p in parameters}
        if any(id(p) not in ours for group in inner_optimizer.param_groups for p in group["params"]):
            problems.append("inner_optimizer steps tensors that are not the DDP model's trainable parameters")
    if outer_optimizer is not None and (not callable(outer_optimizer)
                                        or isinstance(outer_optimizer, torch.optim.Optimizer)):
        problems.append("outer_optimizer must be a function from a list of parameters to an optimizer over them, "
                        "e.g. lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)")
    return problems
