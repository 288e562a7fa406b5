"""Which elements of a bucket a rank owns when the optimizer is sharded
(`ddp.overlap_optimizer(opt, shard=True)`, ddp_ext/_sharded_optimizer.py).

Note [Shard plan]
~~~~~~~~~~~~~~~~~
A bucket's flat buffer of L elements is cut into world_size contiguous
ranges of S = ceil(L / world_size) elements; rank r owns [r*S, (r+1)*S)
(the last ranges end at L, and may be empty). The buffer is padded with
zeros to world_size * S for the reduce-scatter and the all-gather. The plan
depends only on the bucket's layout (its parameters' reducer indices,
offsets and sizes), which every rank agrees on, so every rank derives the
same ranges; a bucket laid out again (a rebuild) gets a new plan. A range
may cut through parameters: the rank's elements of each parameter are a
piece, [start, stop) of the parameter's flattened elements. The pieces are
views of one flat tensor per bucket, the rank's copy of its parameters'
elements, which the inner optimizer steps in place (Note [Stepping the
shard] in ddp_ext/_sharded_optimizer.py).
"""

from typing import List, Tuple

import torch

# One parameter of a bucket: its index among the reducer's parameters, its
# offset in the bucket's buffer and its number of elements.
Placed = Tuple[int, int, int]

# The scalar state of torch.optim's optimizers: told apart by name from a
# 0-d parameter's elementwise state, which is 0-d too.
SCALAR_STATE = ("step", "mu_product", "eta", "mu")


def elementwise_state(key: str, value, length: int) -> bool:
    """Whether a piece's state `key` holds one value per element of a piece
    of `length` elements (else it is a scalar shared by the parameter)."""
    return (isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == length
            and key not in SCALAR_STATE)


class Piece:
    """The rank's elements [start, stop) of one parameter, at `at` in the
    rank's shard of the bucket. `flat` is the view the inner optimizer steps."""

    def __init__(self, index: int, start: int, stop: int, at: int, flat: torch.Tensor):
        self.index = index
        self.start = start
        self.stop = stop
        self.at = at
        self.flat = flat

    @property
    def key(self) -> Tuple[int, int, int]:
        return (self.index, self.start, self.stop)


class ShardPlan:
    """One bucket's shard on this rank: the range, the pieces, the buffers."""

    def __init__(self, layout: Tuple[Placed, ...], length: int, dtype: torch.dtype, device: torch.device,
                 rank: int, world_size: int):
        self.layout = layout
        self.length = length
        self.world_size = world_size
        self.shard = -(-length // world_size) if length else 0
        self.lo = min(rank * self.shard, length)
        self.hi = min((rank + 1) * self.shard, length)
        # The reducer's shard of the bucket, the averaged gradient of the
        # range, from a synchronising backward to the step (else None).
        self.grad = None
        # The rank's copy of its parameters' elements, stepped in place.
        self.params = torch.zeros(self.shard, dtype=dtype, device=device)
        self.pieces: List[Piece] = []
        for index, offset, numel in layout:
            lo, hi = max(self.lo, offset), min(self.hi, offset + numel)
            if lo < hi:
                at = lo - self.lo
                self.pieces.append(Piece(index, lo - offset, hi - offset, at, self.params[at:at + hi - lo]))

    @property
    def padded(self) -> int:
        return self.shard * self.world_size

    def span(self, offset: int, numel: int, rank: int) -> Tuple[int, int]:
        """The elements [start, stop) of the parameter at `offset` (of `numel`
        elements) that rank `rank` owns; start >= stop when it owns none."""
        lo, hi = min(rank * self.shard, self.length), min((rank + 1) * self.shard, self.length)
        return max(lo, offset) - offset, min(hi, offset + numel) - offset

