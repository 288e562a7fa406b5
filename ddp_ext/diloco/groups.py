"""DiLoCo's two kinds of group. An inner group trains as one DDP model
(gradients averaged every step); an outer group holds one rank of each inner
group, the ranks at the same position in theirs (the same local rank), and
averages parameter changes every few steps. Every rank is in one of each.

Inner groups come from `host_groups()` (one per host, from torchrun's
LOCAL_WORLD_SIZE) or from the user; outer groups are derived from the inner
groups, or given. Making groups is collective over the default group: every
rank makes every group, in the same order."""

import dataclasses
import os
from typing import List, Optional, Sequence

import torch.distributed as dist

from ddp_ext.diloco.agreement import agree


@dataclasses.dataclass(frozen=True)
class HostGroups:
    inner: dist.ProcessGroup  # this rank's host: build the DDP model over it
    outer: dist.ProcessGroup  # this rank and the ranks of the same local rank on the other hosts


def host_groups() -> HostGroups:
    """This rank's groups when ranks are numbered host by host, as torchrun
    does: LOCAL_WORLD_SIZE ranks per host, rank = host * LOCAL_WORLD_SIZE +
    LOCAL_RANK. Collective over the default group; raises ValueError on
    every rank if some rank's variables do not describe that layout."""
    world, rank = dist.get_world_size(), dist.get_rank()
    raw_local, raw_rank = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("LOCAL_RANK")
    problems = []
    if raw_local is None or not raw_local.isdigit() or int(raw_local) < 1 or world % int(raw_local):
        problems.append(f"LOCAL_WORLD_SIZE={raw_local!r} does not give ranks per host dividing the world size "
                        f"{world} (start with torchrun, or pass explicit groups)")
    elif raw_rank is not None and raw_rank != str(rank % int(raw_local)):
        problems.append(f"LOCAL_RANK={raw_rank} is not rank {rank} modulo LOCAL_WORLD_SIZE={raw_local} "
                        "(ranks must be numbered host by host)")
    agree("ddp_ext.diloco.host_groups", problems, {"LOCAL_WORLD_SIZE": raw_local}, None)
    local = int(raw_local)
    inner = make_groups([list(range(h * local, (h + 1) * local)) for h in range(world // local)])
    outer = make_groups([list(range(i, world, local)) for i in range(local)])
    return HostGroups(inner, outer)


def make_groups(memberships: Sequence[Sequence[int]]) -> dist.ProcessGroup:
    """Makes every group of `memberships` (a partition of the world's ranks)
    and returns this rank's."""
    rank, mine = dist.get_rank(), None
    for members in memberships:
        group = dist.new_group(list(members))
        if rank in members:
            mine = group
    return mine


def members(group: dist.ProcessGroup) -> List[int]:
    """The default group's ranks of `group`'s members, in the group's order."""
    return list(dist.get_process_group_ranks(group))


def inner_problems(inner_by_rank: Sequence[Sequence[int]]) -> List[str]:
    """What keeps the inner groups (each rank's members, by rank) from
    partitioning the world into groups of one size: inner groups of unequal
    sizes would leave some outer group without a rank of some host."""
    problems = []
    for rank, group in enumerate(inner_by_rank):
        if rank not in group or any(list(inner_by_rank[other]) != list(group) for other in group):
            problems.append(f"rank {rank}'s inner group {list(group)} is not the same group on each of its ranks")
    if not problems:
        sizes = sorted({len(group) for group in inner_by_rank})
        if len(sizes) > 1:
            problems.append(
                f"inner groups have unequal sizes {sizes}: DiLoCo pairs rank i of each inner group with rank i of "
                f"the others, so every inner group needs the same number of ranks"
            )
    return problems


def outer_memberships(inner_by_rank: Sequence[Sequence[int]]) -> List[List[int]]:
    """The outer groups derived from valid inner groups: the i-th members of
    every inner group, in rank order (the order a new group has)."""
    inner = sorted({tuple(group) for group in inner_by_rank})
    return [sorted(group[i] for group in inner) for i in range(len(inner[0]))]


def derived_outer_by_rank(inner_by_rank: Sequence[Sequence[int]]) -> List[List[int]]:
    """Each rank's derived outer group (its members), by rank."""
    derived = outer_memberships(inner_by_rank)
    return [next(g for g in derived if rank in g) for rank in range(len(inner_by_rank))]


def outer_problems(inner_by_rank: Sequence[Sequence[int]], outer_by_rank: Sequence[Sequence[int]]) -> List[str]:
    """What is wrong with outer groups (each rank's members in group order,
    by rank): each must hold exactly one rank of every inner group, and list
    the inner groups in the same order as every other outer group does, so
    that all of them add the same values in the same order (Note [DiLoCo
    groups agree bitwise])."""
    inner_count = len({tuple(group) for group in inner_by_rank})
    problems, orders = [], set()
    for rank, group in enumerate(outer_by_rank):
        hosts = tuple(tuple(inner_by_rank[member]) for member in group)
        if rank not in group or any(list(outer_by_rank[m]) != list(group) for m in group):
            problems.append(f"rank {rank}'s outer group {list(group)} is not the same group on each of its ranks")
        elif len(set(hosts)) != len(hosts) or len(hosts) != inner_count:
            problems.append(f"rank {rank}'s outer group {list(group)} does not hold exactly one rank of each of "
                            f"the {inner_count} inner groups")
        orders.add(hosts)
    if not problems and len(orders) > 1:
        problems.append("the outer groups list the inner groups in different orders (number the ranks host by "
                        "host, or pass outer groups whose i-th ranks are on the same host)")
    return problems


def structure_problems(inner_by_rank: Sequence[Sequence[int]],
                       outer_by_rank: Optional[Sequence[Sequence[int]]]) -> List[str]:
    """What keeps these groups (each rank's members, by rank; outer ones
    None: to be derived) from DiLoCo's layout."""
    problems = inner_problems(inner_by_rank)
    if problems:
        return problems
    if outer_by_rank is None:
        outer_by_rank = derived_outer_by_rank(inner_by_rank)
    return outer_problems(inner_by_rank, outer_by_rank)


def derive_outer(inner_by_rank: Sequence[Sequence[int]]) -> dist.ProcessGroup:
    """Makes the outer groups derived from the inner groups; this rank's."""
    return make_groups(outer_memberships(inner_by_rank))
