"""Round-robin process groups: several groups over the same ranks that take
turns running collectives (paper sections 3.3 and 5.4).

A round-robin group is an ordinary ``torch.distributed.ProcessGroup`` whose
backend, ddp_ext's C++ ``RoundRobinBackend``, sends each collective to the
next of its child groups. See Note [Round-robin process group] in
process_groups/round_robin/backend.h. Three ways to get one:

    rr = ddp_ext.new_round_robin_group(num_groups=3, backend="gloo")
    rr = ddp_ext.round_robin_group([g1, g2, g3])
    dist.init_process_group("round_robin", pg_options=ddp_ext.RoundRobinOptions(3, "gloo"), ...)

Importing ddp_ext registers the backend name "round_robin" with
``torch.distributed.Backend.register_backend``; without ``pg_options`` its
children come from the environment variables DDP_EXT_ROUND_ROBIN_NUM_GROUPS
(default 3) and DDP_EXT_ROUND_ROBIN_BACKEND (default "gloo").
"""

import dataclasses
import itertools
import os
from datetime import timedelta
from typing import Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ddp_ext import _exit
from ddp_ext._native import core as _C

BACKEND_NAME = "round_robin"
ENV_NUM_GROUPS = "DDP_EXT_ROUND_ROBIN_NUM_GROUPS"
ENV_BACKEND = "DDP_EXT_ROUND_ROBIN_BACKEND"
DEFAULT_NUM_GROUPS = 3
DEFAULT_BACKEND = "gloo"
# Devices the registered backend claims; each child serves whichever of them
# its own backend supports.
DEVICES = ["cpu", "cuda"]

_CUSTOM = dist.ProcessGroup.BackendType.CUSTOM
# Names for groups made by round_robin_group(); see _next_group_name.
_group_numbers = itertools.count()


def _child_backends() -> List[str]:
    """Backends this torch build can make round-robin children of."""
    names = []
    if dist.is_gloo_available():
        names.append("gloo")
    if dist.is_nccl_available():
        names.append("nccl")
    names += [p.lower() for p in dist.Backend._plugins if p.lower() != BACKEND_NAME]
    return names


def _check_num_groups(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} must be an integer >= 1 (the number of child process groups), got {value!r}")
    return value


def _check_child_backend(value, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where} must be a backend name such as 'gloo', got {type(value).__name__}")
    name = value.lower()
    if name == BACKEND_NAME:
        raise ValueError(f"{where}={value!r}: a round-robin group's children cannot themselves be round-robin groups")
    known = _child_backends()
    if name not in known:
        hint = "" if dist.is_nccl_available() else " ('nccl' needs a CUDA build of torch)"
        raise ValueError(f"{where}={value!r} is not a backend this torch build can create; choose one of {known}{hint}")
    return name


@dataclasses.dataclass(frozen=True)
class RoundRobinOptions:
    """What a "round_robin" group is made of; pass it as ``pg_options`` to
    ``dist.init_process_group("round_robin", ...)`` or ``dist.new_group``.

    num_groups: how many child process groups take turns (>= 1).
    backend: what each child is ("gloo", "nccl" where available, or a
        backend registered with ``torch.distributed.Backend.register_backend``).
    """

    num_groups: int = DEFAULT_NUM_GROUPS
    backend: str = DEFAULT_BACKEND

    def __post_init__(self):
        _check_num_groups(self.num_groups, "RoundRobinOptions.num_groups")
        object.__setattr__(self, "backend", _check_child_backend(self.backend, "RoundRobinOptions.backend"))

    @classmethod
    def from_env(cls) -> "RoundRobinOptions":
        """Options from DDP_EXT_ROUND_ROBIN_NUM_GROUPS and
        DDP_EXT_ROUND_ROBIN_BACKEND, each falling back to its default."""
        raw = os.environ.get(ENV_NUM_GROUPS, str(DEFAULT_NUM_GROUPS))
        try:
            num_groups = int(raw)
        except ValueError:
            raise ValueError(f"environment variable {ENV_NUM_GROUPS}={raw!r} must be an integer >= 1") from None
        _check_num_groups(num_groups, f"environment variable {ENV_NUM_GROUPS}")
        backend = _check_child_backend(
            os.environ.get(ENV_BACKEND, DEFAULT_BACKEND), f"environment variable {ENV_BACKEND}"
        )
        return cls(num_groups, backend)


def _new_child_backend(kind: str, index: int, store, options):
    """A backend of `kind` for child `index`, or a ProcessGroup if the
    backend's creator makes whole groups (Python process groups do)."""
    rank, size, timeout = options.group_rank, options.group_size, options.timeout
    if kind == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if kind == "nccl":
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = timeout
        nccl_options.global_ranks_in_group = options.global_ranks_in_group
        nccl_options.group_name = f"{options.group_id}/child{index}"
        return dist.ProcessGroupNCCL(store, rank, size, nccl_options)
    plugin = dist.Backend._plugins[kind.upper()]
    if not plugin.extended_api:
        return plugin.creator_fn(store, rank, size, timeout)
    child_options = c10d._DistributedBackendOptions()
    child_options.store = store
    child_options.group_rank = rank
    child_options.group_size = size
    child_options.timeout = timeout
    child_options.group_id = f"{options.group_id}/child{index}"
    child_options.global_ranks_in_group = options.global_ranks_in_group
    return plugin.creator_fn(child_options, None)


def _new_child(kind: str, index: int, options) -> dist.ProcessGroup:
    """Child group `index` of a round-robin group being created by
    torch.distributed: a ProcessGroup over the same ranks, rendezvousing in
    its own prefix of the round-robin group's store."""
    store = dist.PrefixStore(f"child{index}/", options.store)
    backend = _new_child_backend(kind, index, store, options)
    if isinstance(backend, dist.ProcessGroup):
        _exit.track(backend)  # Note [Exit after training]
        return backend
    group = dist.ProcessGroup(store, options.group_rank, options.group_size)
    backend_type = dist.Backend.backend_type_map[kind]
    for device in dist.Backend.backend_capability[kind]:
        group._register_backend(torch.device(device), backend_type, backend)
    group._set_default_backend(backend_type)
    group._set_group_name(f"{options.group_id}/child{index}")
    _exit.track(group)  # Note [Exit after training]
    return group


def _create_backend(options, pg_options) -> _C.RoundRobinBackend:
    """The creator torch.distributed calls for backend "round_robin" (with
    ``extended_api=True``: `options` is a c10d._DistributedBackendOptions)."""
    if pg_options is None:
        pg_options = RoundRobinOptions.from_env()
    elif not isinstance(pg_options, RoundRobinOptions):
        raise TypeError(
            "pg_options for the round_robin backend must be a ddp_ext.RoundRobinOptions, "
            f"got {type(pg_options).__name__}"
        )
    children = [_new_child(pg_options.backend, i, options) for i in range(pg_options.num_groups)]
    backend_options = _C.RoundRobinBackendOptions()
    backend_options.owns_children = True
    backend_options.timeout = options.timeout
    return _C.RoundRobinBackend(children, backend_options)


def _register_backend() -> None:
    """Makes "round_robin" a torch.distributed backend name (idempotent)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=DEVICES)


def new_round_robin_group(
    num_groups: int = DEFAULT_NUM_GROUPS,
    backend: str = DEFAULT_BACKEND,
    ranks: Optional[Sequence[int]] = None,
    timeout: Optional[timedelta] = None,
):
    """A new round-robin group of `num_groups` fresh `backend` groups.

    Works like ``dist.new_group(ranks, timeout)``: every rank of the default
    group must call it, in the same order as its other group creations, and
    ranks outside `ranks` get ``GroupMember.NON_GROUP_MEMBER``. The result is
    a ``torch.distributed.ProcessGroup`` usable wherever one is accepted
    (``dist.all_reduce(t, group=rr)``, torch's and ddp_ext's DDP).
    """
    options = RoundRobinOptions(
        _check_num_groups(num_groups, "num_groups"), _check_child_backend(backend, "backend")
    )
    return dist.new_group(ranks=ranks, timeout=timeout, backend=BACKEND_NAME, pg_options=options)


def _next_group_name() -> str:
    # Not torch's group counter: round_robin_group is called by members only,
    # and advancing torch's counter on some ranks would give later
    # dist.new_group calls different names (store keys) on different ranks.
    return f"{BACKEND_NAME}_{next(_group_numbers)}"


def _process_group(backend: _C.RoundRobinBackend, store, devices: Iterable[torch.device], group_name: str):
    """Wraps `backend` in a ProcessGroup for `devices`, without registering
    it with torch.distributed."""
    group = dist.ProcessGroup(store, backend.rank(), backend.size())
    for device in devices:
        group._register_backend(device, _CUSTOM, backend)
    group._set_default_backend(_CUSTOM)
    group._set_group_name(group_name)
    _exit.track(group)  # Note [Exit after training]
    return group


def round_robin_group(groups: Iterable[dist.ProcessGroup]):
    """A round-robin group that takes turns over existing `groups`.

    The groups must span the same ranks in the same order (each made with the
    same `ranks`); the round-robin group serves the devices they all serve.
    It borrows them: destroying it leaves them usable, and destroying one of
    them breaks it. Call it on the groups' member ranks, all in the same
    order; it communicates nothing itself.
    """
    if isinstance(groups, dist.ProcessGroup):
        raise TypeError("round_robin_group takes a list of process groups, got a single ProcessGroup")
    groups = list(groups)
    if not groups:
        raise ValueError("round_robin_group needs at least one process group, got an empty list")
    for i, group in enumerate(groups):
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"groups[{i}] is {group!r}, not a torch.distributed.ProcessGroup (ranks outside a "
                "dist.new_group get GroupMember.NON_GROUP_MEMBER; call round_robin_group on members only)"
            )
        if group not in c10d._world.pg_map:
            raise ValueError(
                f"groups[{i}] is not known to torch.distributed; make the children with "
                "dist.new_group or dist.init_process_group"
            )
    ranks = [dist.get_process_group_ranks(g) for g in groups]
    for i, r in enumerate(ranks):
        if r != ranks[0]:
            raise ValueError(
                f"groups[{i}] spans global ranks {r} but groups[0] spans {ranks[0]}; the children "
                "of a round-robin group must span the same ranks in the same order"
            )
    devices = [d for d in groups[0]._device_types if all(d in g._device_types for g in groups[1:])]
    if not devices:
        raise ValueError("the groups serve no device in common, so no round-robin group can serve any")

    backend_options = _C.RoundRobinBackendOptions()
    backend_options.owns_children = False
    backend = _C.RoundRobinBackend(groups, backend_options)
    group_name = _next_group_name()
    store = dist.PrefixStore(f"{group_name}/", c10d._world.pg_map[groups[0]][1])
    group = _process_group(backend, store, devices, group_name)
    c10d._register_pg_in_world(
        group,
        backend_name=dist.Backend(BACKEND_NAME),
        store=store,
        group_name=group_name,
        backend_config=",".join(f"{d.type}:{BACKEND_NAME}" for d in devices),
        rank_mapping={global_rank: group_rank for group_rank, global_rank in enumerate(ranks[0])},
        add_to_default_tag=True,
    )
    return group


_register_backend()
