"""A fragment's exchange shared among a host's ranks.

# Note [DiLoCo splits the exchange within a host]

DDP keeps a host's ranks equal, so after each inner step they all hold the
same pseudo-gradient, and in 8 or 4 bits the same residual and the same
payload. Instead of each sending the whole fragment across hosts, the L
ranks of a host cut it into L parts of whole scale chunks (the codec's
`split_alignment`), and the rank of part i exchanges only part i, with the
ranks of part i on the other hosts (its outer group). Then the host's
ranks all-gather the parts' means among themselves (inside the host: no
slow link) and every rank holds the whole mean. That gather runs on a
thread of the exchange's own, over a group of the host's ranks made for it
(not the DDP model's, whose collectives the training thread issues
meanwhile), as soon as the part's mean is in, one exchange after another
in launch order: so one rank's `wait` (in `state_dict`, say, on a host's
first rank only) never waits for another rank to call anything.

Nothing else changes: every rank still encodes the whole fragment with the
whole residual (the same on every rank of a host, so checkpoints and
healing are as before); a part of a payload is exactly the payload of
those elements, since a chunk's scale and codes depend on that chunk
alone; and each element's mean adds the same hosts' values in the same
order (Note [DiLoCo groups agree bitwise]). So every rank ends the merge
with the same bits as if every rank had sent the whole fragment; the
bytes across hosts are L times fewer. A fragment smaller than L chunks has
fewer non-empty parts: a rank whose part is empty sends nothing.
"""

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist


class HostSplit:
    """This rank's share of a host's exchanges: part `part` of `count`, and
    the group of the host's ranks over which the parts' means are
    all-gathered (`inner`: not the DDP model's), whose rank j holds part
    `part_of_inner_rank[j]`."""

    def __init__(self, part: int, count: int, inner: dist.ProcessGroup, part_of_inner_rank: Sequence[int]):
        self.part = part
        self.count = count
        self._inner = inner
        self._part_of_inner_rank = list(part_of_inner_rank)
        self.last_thread = None  # the last exchange's gathering thread: the next one's waits for it

    def bounds(self, numel: int, alignment: int) -> List[Tuple[int, int]]:
        return part_bounds(numel, alignment, self.count)

    def gather(self, mine: torch.Tensor, numel: int, bounds: List[Tuple[int, int]]) -> torch.Tensor:
        """The whole fragment's mean from every part's (this rank's: `mine`),
        all-gathered over the inner group. Collective over it."""
        longest = max(stop - start for start, stop in bounds)
        padded = torch.zeros(longest, dtype=mine.dtype, device=mine.device)
        padded[:mine.numel()] = mine
        gathered = [torch.empty_like(padded) for _ in self._part_of_inner_rank]
        dist.all_gather(gathered, padded, group=self._inner)
        whole = torch.empty(numel, dtype=mine.dtype, device=mine.device)
        for values, part in zip(gathered, self._part_of_inner_rank):
            start, stop = bounds[part]
            whole[start:stop] = values[:stop - start]
        return whole


def part_bounds(numel: int, alignment: int, count: int) -> List[Tuple[int, int]]:
    """The element ranges [start, stop) of `count` parts of a fragment of
    `numel` elements, cut at multiples of `alignment`, as equal as that
    allows (the last ones empty when there are fewer units than parts)."""
    units = -(-numel // alignment)
    per = -(-units // count) * alignment
    return [(min(i * per, numel), min((i + 1) * per, numel)) for i in range(count)]


def cut_payload(payload: torch.Tensor, codec, start: int, stop: int) -> torch.Tensor:
    """The payload of elements [start, stop) of a fragment: float32 values
    (`codec` None) sliced, or the codec's whole chunks of them."""
    if codec is None:
        return payload[start:stop]
    return payload[:0] if start == stop else codec.cut(payload, start, stop)


def parts_by_rank(outer_by_rank: Sequence[Sequence[int]]) -> List[int]:
    """Each rank's part: the index of its outer group among all outer groups
    (each rank's members, by rank), ordered by their members. Every outer
    group holds one rank of each host, so each host's ranks hold every part
    once, and an outer group's ranks all hold the same one."""
    ordered = sorted({tuple(group) for group in outer_by_rank})
    return [ordered.index(tuple(group)) for group in outer_by_rank]
