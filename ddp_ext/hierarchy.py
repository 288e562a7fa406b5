"""Hierarchical allreduce: inside each host, across hosts, inside again.
(And, for the sharded optimizer, the all-gather: across hosts, then inside.)

``DistributedDataParallel(..., hierarchical_allreduce="auto")`` (the default)
reduces gradient buckets in three steps where ranks share hosts and there
is more than one host: a reduce-scatter inside the host, an allreduce of
each rank's segment across hosts (among the ranks of the same local rank),
and an allgather inside the host. Each host then sends 2 (H - 1)/H of the
gradients across the inter-host link for H hosts, instead of a flat ring's
2 (W - 1)/W over all W ranks. See Note [Hierarchical allreduce] in
process_groups/hierarchical/backend.h.

The topology is the one torchrun gives: ``LOCAL_WORLD_SIZE`` ranks per host,
ranks numbered host by host (rank = host * LOCAL_WORLD_SIZE + LOCAL_RANK).
The groups are made with ``dist.new_group`` (Gloo), once per process and
flat group, on every rank in the same order.
"""

import atexit
import dataclasses
import os
import weakref
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ddp_ext import _exit
from ddp_ext._native import core as _C

SETTINGS = ("auto", True, False)
# flat group -> {(setting, torchrun variables) -> its twin, or None: the flat group itself}
_resolved: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# flat group -> {Topology -> its hierarchical twin}
_hierarchical: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_backends: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # twin -> its HierarchicalBackend


@dataclasses.dataclass(frozen=True)
class Topology:
    hosts: int
    ranks_per_host: int


def topology_from_env(world_size: int, environ=os.environ) -> Optional[Topology]:
    """The hosts x ranks-per-host torchrun describes (LOCAL_WORLD_SIZE), or
    None where it says nothing usable (unset, or not dividing the world)."""
    raw = environ.get("LOCAL_WORLD_SIZE")
    try:
        local = int(raw) if raw is not None else 0
    except ValueError:
        return None
    if local < 1 or world_size % local:
        return None
    return Topology(world_size // local, local)


def pays(topology: Optional[Topology]) -> bool:
    """Whether "auto" turns it on: more than one host, and more than one
    rank on each to combine before the link (with one host nothing crosses
    a slower link; with one rank per host the three steps are a flat
    allreduce with extra rounds)."""
    return topology is not None and topology.hosts > 1 and topology.ranks_per_host > 1


def check_setting(setting) -> None:
    if not any(setting is s or (isinstance(setting, str) and setting == s) for s in SETTINGS):
        raise ValueError(f"hierarchical_allreduce must be 'auto', True or False, got {setting!r}")


def _layout_holds(process_group: dist.ProcessGroup, topology: Topology) -> bool:
    """Whether every rank's LOCAL_RANK is its rank modulo the ranks per host
    (torchrun's numbering), agreed by all ranks (one small allreduce)."""
    raw = os.environ.get("LOCAL_RANK")
    mine = raw is not None and raw.isdigit() and int(raw) == process_group.rank() % topology.ranks_per_host
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=process_group)
    return bool(flag.item())


def resolve(setting: Union[str, bool], process_group: dist.ProcessGroup, device_type: str = "cpu") -> Optional[Topology]:
    """The topology to reduce hierarchically over, or None for a flat
    allreduce. "auto": on where `pays` (a CPU module over the default group
    on Gloo only, torchrun's numbering checked on every rank); True: on, or
    a ValueError saying why it cannot be; False: off."""
    check_setting(setting)
    if setting is False:
        return None
    topology = topology_from_env(process_group.size())
    if setting == "auto" and not pays(topology):
        return None  # nothing else looked at: one host changes nothing
    is_world = dist.is_initialized() and process_group is c10d._get_default_group()
    on_gloo = is_world and device_type == "cpu" and dist.get_backend(process_group) == "gloo"
    if setting == "auto":
        if not on_gloo:
            return None
        return topology if _layout_holds(process_group, topology) else None
    why = None
    if not is_world:
        why = "it needs the default process group (its subgroups are made from the world's ranks)"
    elif not on_gloo:
        why = (f"it reduces CPU tensors over Gloo subgroups; this module is on {device_type} and the group's "
               f"backend is {dist.get_backend(process_group)!r}")
    elif topology is None:
        why = (f"LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE')!r} does not give ranks per host dividing "
               f"the world size {process_group.size()} (start with torchrun, or set LOCAL_WORLD_SIZE and LOCAL_RANK)")
    elif not _layout_holds(process_group, topology):
        why = "some rank's LOCAL_RANK is not its rank modulo LOCAL_WORLD_SIZE (ranks must be numbered host by host)"
    if why:
        raise ValueError(f"hierarchical_allreduce=True: cannot reduce hierarchically: {why}")
    return topology


def reducer_group(setting: Union[str, bool], process_group: dist.ProcessGroup,
                  device_type: str = "cpu") -> dist.ProcessGroup:
    """The group the reducer reduces buckets over: `process_group`, or its
    hierarchical twin when `resolve` says so. Both the decision (for this
    setting and these torchrun variables) and the twin's groups are made
    once per process and flat group, remembered only while the flat group
    lives (a process group that module state keeps until the interpreter's
    teardown is destroyed after its threads' runtime, and aborts)."""
    if setting is False:
        return process_group
    decisions = _resolved.setdefault(process_group, {})
    key = (setting, device_type, os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("LOCAL_RANK"))
    if key not in decisions:
        topology = resolve(setting, process_group, device_type)
        twins = _hierarchical.setdefault(process_group, {})
        if topology is not None and topology not in twins:
            twins[topology] = _make(process_group, topology)
        decisions[key] = None if topology is None else twins[topology]
    return decisions[key] if decisions[key] is not None else process_group


@atexit.register
def _forget() -> None:
    """Releases the hierarchical groups before the interpreter's teardown."""
    _resolved.clear()
    _hierarchical.clear()
    _backends.clear()


def _make(process_group: dist.ProcessGroup, topology: Topology) -> dist.ProcessGroup:
    hosts, local = topology.hosts, topology.ranks_per_host
    host, local_rank = divmod(process_group.rank(), local)
    # Every rank makes every group, in the same order (dist.new_group's rule).
    mine = {}
    for kind in ("intra", "intra_gather", "gather_inside"):
        for h in range(hosts):
            group = dist.new_group(list(range(h * local, (h + 1) * local)), backend="gloo")
            if h == host:
                mine[kind] = group
    for kind in ("inter", "gather_across"):
        for lr in range(local):
            group = dist.new_group([h * local + lr for h in range(hosts)], backend="gloo")
            if lr == local_rank:
                mine[kind] = group
    backend = _C.HierarchicalBackend(process_group, mine["intra"], mine["inter"], mine["intra_gather"],
                                     mine["gather_across"], mine["gather_inside"])
    store = dist.PrefixStore("ddp_ext_hierarchical/", c10d._world.pg_map[process_group][1])
    group = dist.ProcessGroup(store, process_group.rank(), process_group.size())
    custom = dist.ProcessGroup.BackendType.CUSTOM
    group._register_backend(torch.device("cpu"), custom, backend)
    group._set_default_backend(custom)
    group._set_group_name(f"{process_group.group_name}/hierarchical")
    _backends[group] = backend
    _exit.track(group)  # Note [Exit after training]
    return group


def hierarchical_calls(group: dist.ProcessGroup) -> int:
    """Allreduces `group` (a `reducer_group`) ran in three steps; 0 for a flat group."""
    backend = _backends.get(group)
    return backend.hierarchical_calls if backend is not None else 0


def hierarchical_gathers(group: dist.ProcessGroup) -> int:
    """All-gathers `group` (a `reducer_group`) ran in two steps; 0 for a flat group."""
    backend = _backends.get(group)
    return backend.hierarchical_gathers if backend is not None else 0
