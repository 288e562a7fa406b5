"""A fault-tolerant sync's exchange over its quorum (every rank of every
host, one Gloo group): each member's payload to every member, or each
host's share of it only.

# Note [DiLoCo shares a host's exchange under fault tolerance]

In a fault-tolerant sync (Note [DiLoCo survives a host]) every member
could all-gather its whole payload over the quorum, and add the members'
values in the quorum's order. But a host's L ranks hold the same payload
(DDP keeps their parameters equal; their residuals and their part in the
sync are the same), so, as without fault tolerance (Note [DiLoCo splits
the exchange within a host]), each host's member of part j (the j-th of
the host's members in the quorum's order) sends only part j of the payload
(whole scale chunks), and only to the members of part j on the other
hosts; the host's members then exchange the parts' means among themselves.
Both are all-to-alls over the quorum's group, so every member takes part in
every collective of the sync, and a member that dies fails the sync on
every survivor (the commit then aborts it) as the all-gather did.

Each member of part j adds, for every member of the quorum in its order,
that member's host's part j: the same values in the same order as the
whole exchange adds, elementwise, so every rank ends with the same bits as
with the all-gather, which the quorum falls back to when the split does
not hold: hosts with different numbers of members in the quorum (one of a
host's ranks is gone and the host not yet dropped), a host whose members
differ in contributing, one rank per host, or a member that asked for no
split (`split_within_host=False`). A host that contributes nothing (a
joiner) sends nothing: zeros stand for it, as the all-gather's joiners
send zeros.
"""

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch

from ddp_ext.diloco.exchange import mean_of
from ddp_ext.diloco.host_split import cut_payload, part_bounds


@dataclasses.dataclass(frozen=True)
class Contribution:
    """What one member says before the payloads travel."""

    trained: bool  # it has a pseudo-gradient of its own (not a joiner)
    splits: bool  # it takes part in a split exchange (split_within_host)


def gather_contributions(group, mine: Contribution, size: int) -> List[Contribution]:
    """Every member's Contribution, by quorum rank (an all-gather over `group`)."""
    flags = torch.tensor([float(mine.trained), float(mine.splits)])
    gathered = [torch.empty_like(flags) for _ in range(size)]
    group.allgather([gathered], [flags]).wait()
    return [Contribution(bool(f[0].item()), bool(f[1].item())) for f in gathered]


@dataclasses.dataclass(frozen=True)
class HostShares:
    """Member i of the quorum is on host `host[i]` and holds part `part[i]`
    of `parts` (its host's members each hold one)."""

    host: Tuple[int, ...]
    part: Tuple[int, ...]
    parts: int


def host_shares(members: Sequence[str], contributions: Sequence[Contribution]) -> Optional[HostShares]:
    """How the quorum's members (replica ids "<host_id>/<rank>") share
    their hosts' exchange, or None where the split does not hold (Note
    [DiLoCo shares a host's exchange under fault tolerance])."""
    if not all(c.splits for c in contributions):
        return None
    names: List[str] = []
    host, part, sizes = [], [], {}
    for member in members:
        name = member.rsplit("/", 1)[0]
        if name not in names:
            names.append(name)
        h = names.index(name)
        host.append(h)
        part.append(sizes.get(h, 0))
        sizes[h] = sizes.get(h, 0) + 1
    if len(set(sizes.values())) != 1 or sizes[0] == 1:
        return None
    if any(len({contributions[i].trained for i in range(len(members)) if host[i] == h}) != 1 for h in sizes):
        return None
    return HostShares(tuple(host), tuple(part), sizes[0])


def whole_mean(group, contributions: Sequence[Contribution], payload: torch.Tensor,
               codec) -> Tuple[torch.Tensor, int]:
    """The mean over the members that trained, every member's payload
    all-gathered and added in the quorum's order; and the bytes of this
    member's payload."""
    gathered = [torch.empty_like(payload) for _ in contributions]
    group.allgather([gathered], [payload]).wait()
    return _over_trained(mean_of(gathered, codec), contributions), payload.numel() * payload.element_size()


def shared_mean(group, rank: int, contributions: Sequence[Contribution], payload: torch.Tensor, codec,
                numel: int, shares: HostShares) -> Tuple[torch.Tensor, int]:
    """`whole_mean`'s bits, each member sending only its part across
    hosts; and the bytes of that part (none from a joiner)."""
    size = len(contributions)
    bounds = part_bounds(numel, 1 if codec is None else codec.split_alignment, shares.parts)
    my_host, my_part = shares.host[rank], shares.part[rank]
    start, stop = bounds[my_part]
    piece = cut_payload(payload, codec, start, stop)
    # Across hosts: part j to and from the members of part j on the other hosts.
    peers = [i for i in range(size) if shares.part[i] == my_part and shares.host[i] != my_host]
    sends = [piece.numel() if i in peers and contributions[rank].trained else 0 for i in range(size)]
    receives = [piece.numel() if i in peers and contributions[i].trained else 0 for i in range(size)]
    received = _all_to_all(group, piece, sends, receives)
    by_host = {my_host: piece}  # a joiner's payload is zeros already
    for i in peers:
        by_host[shares.host[i]] = received[i] if receives[i] else torch.zeros_like(piece)
    if stop > start:
        mine = _over_trained(mean_of([by_host[shares.host[i]] for i in range(size)], codec, stop - start),
                             contributions)
    else:
        mine = torch.zeros(0, dtype=torch.float32, device=payload.device)
    # Inside the host: every part's mean to the host's other members.
    mates = [i for i in range(size) if shares.host[i] == my_host and i != rank]
    lengths = [bounds[shares.part[i]][1] - bounds[shares.part[i]][0] for i in range(size)]
    means = _all_to_all(group, mine, [mine.numel() if i in mates else 0 for i in range(size)],
                        [lengths[i] if i in mates else 0 for i in range(size)])
    whole = torch.empty(numel, dtype=torch.float32, device=payload.device)
    whole[start:stop] = mine
    for i in mates:
        first, last = bounds[shares.part[i]]
        whole[first:last] = means[i]
    return whole, (piece.numel() * piece.element_size() if any(sends) else 0)


def _all_to_all(group, mine: torch.Tensor, sends: List[int], receives: List[int]) -> List[torch.Tensor]:
    """`mine` to each member i with sends[i] > 0 (all the same length),
    and receives[i] elements from each member i: what came, by member."""
    out = torch.empty(sum(receives), dtype=mine.dtype, device=mine.device)
    group.alltoall_base(out, mine.repeat(sum(1 for s in sends if s)), receives, sends).wait()
    return list(out.split(receives))


def _over_trained(mean: torch.Tensor, contributions: Sequence[Contribution]) -> torch.Tensor:
    """A mean over every member, made the mean over those that trained
    (the others added zeros); the same operations in both exchanges."""
    trained = sum(1 for c in contributions if c.trained)
    if trained != len(contributions):
        mean.mul_(len(contributions) / trained)
    return mean
