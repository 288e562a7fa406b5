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
shard] in ddp_ext/_sharded_optimizer.py), or, once the parameters live in
the bucket's storage, the rank's range of that storage (Note [Parameters
in the bucket's storage]).

Note [Parameters in the bucket's storage]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Once a bucket's layout is settled (the same at two steps in a row), its
parameters are given one storage of `padded` elements laid out as the
bucket: each parameter's .data becomes a view of its range (its values
copied once). The rank's range of that storage is the flat shard the inner
optimizer steps, so the step writes the parameters themselves (no copy in,
no copy out), and the all-gather runs in place: all_gather_into_tensor
with the storage as output and the rank's range of it as input. Gloo reads
the input into a temporary and only then copies every rank's range into
the output (ProcessGroupGloo's allgather), and NCCL documents
sendbuff == recvbuff + rank * sendcount as its in-place all-gather, so the
input may be a view of the output. No gather buffer is needed, so every
bucket's all-gather may stay behind the next forward (Note [Gathering
behind the next forward] in ddp_ext/_gather_tail.py).
Re-pointing .data keeps the Parameter object (the optimizer's, the
reducer's, the modules' and tied modules' references, autograd's
accumulator, .grad); what it would break is anything holding the old
memory, which would keep the old values. So a bucket stays in the
copying path of the gather buffers when one of its parameters:
 - has its memory held by anything but the parameters (a view the user or
   a module keeps, a parameter made as a view of another tensor that is
   still alive, a graph kept with retain_graph that saved a view of it):
   its storage is used by more tensors than the parameters and this
   plan's own views;
 - shares its memory with another parameter in a storage ddp_ext did not
   make (views of each other): they would stop sharing it;
 - is not a dense strided tensor of the bucket's dtype and device (a
   tensor subclass, another layout).
These are checked again at every step until the bucket is re-pointed, and
a re-pointed bucket is checked at every step to still be (a parameter
given new .data, by `p.data = ...` or a move, sends its bucket back to
copying, with the values it now has). A rebuild gives new plans: their
parameters still view the old plans' storages, which only the parameters
hold, so they are re-pointed again once the new layout is settled.
The step and the all-gather write the parameters through views of the
storage, not through the parameters, so their version counters would not
move: each is bumped as its bucket's all-gather is launched, and a graph
that saved one still fails its check in backward, as after a plain step.
What cannot be seen stays as with the copying path: another thread or C++
code reading a parameter while its all-gather is on the wire.

Note [Replicated plans]
~~~~~~~~~~~~~~~~~~~~~~~
A bucket the reducer allreduces whole (fewer bytes than shard_min_bytes, at
two ranks or more: Note [Replicated small buckets] in
reducer/transport/reduce_scatter.h) has a replicated plan: the rank's
range is the whole bucket (S = L, no padding), its pieces are whole
parameters, and every rank steps it and keeps its state whole. replicates()
is the rule both sides apply to the bucket's byte size. What the ranks
hand each other still follows the sharded ranges, which `span` gives for
both kinds of plan: the re-cut of the state sends each element once
(ddp_ext/_shard_recut.py), the sharded checkpoint saves rank r's range of
a replicated bucket as of a sharded one (ddp_ext/_sharded_checkpoint.py),
and clipping sums rank r's range only, so the norm is the sharded plan's.
"""

from typing import List, Optional, Tuple

import torch

# One parameter of a bucket: its index among the reducer's parameters, its
# offset in the bucket's buffer and its number of elements.
Placed = Tuple[int, int, int]

# The scalar state of torch.optim's optimizers: told apart by name from a
# 0-d parameter's elementwise state, which is 0-d too.
SCALAR_STATE = ("step", "mu_product", "eta", "mu")


def replicates(length: int, element_size: int, world_size: int, shard_min_bytes: int) -> bool:
    """Whether a bucket of `length` elements is replicated (Note [Replicated
    plans]); the reducer applies the same rule to the same bytes."""
    return world_size > 1 and length * element_size < shard_min_bytes


def holders(t: torch.Tensor) -> int:
    """How many tensors use t's storage (t included); -1 where torch cannot
    tell (then no bucket is re-pointed)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return -1
    storage = t.untyped_storage()
    return use_count(storage._cdata) - 1  # less `storage`, which holds it too


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


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
                 rank: int, world_size: int, replicated: bool = False):
        self.layout = layout
        self.length = length
        self.world_size = world_size
        self.replicated = replicated  # Note [Replicated plans]
        self.cut = -(-length // world_size) if length else 0  # the sharded ranges' size
        self.shard = length if replicated else self.cut
        self.lo = 0 if replicated else min(rank * self.shard, length)
        self.hi = length if replicated else min((rank + 1) * self.shard, length)
        # The reducer's shard of the bucket, the averaged gradient of the
        # range, from a synchronising backward to the step (else None).
        self.grad = None
        self.rank = rank
        # The bucket's storage once its parameters are views of it, else None
        # (Note [Parameters in the bucket's storage]).
        self.storage: Optional[torch.Tensor] = None
        self.own_views = 0  # the tensors of this plan that use the storage
        # The rank's elements, stepped in place: a copy, or its range of the storage.
        self.params = torch.zeros(self.shard, dtype=dtype, device=device)
        self.pieces: List[Piece] = []
        self._cut()

    def _cut(self) -> None:
        self.pieces = []
        for index, offset, numel in self.layout:
            lo, hi = max(self.lo, offset), min(self.hi, offset + numel)
            if lo < hi:
                at = lo - self.lo
                self.pieces.append(Piece(index, lo - offset, hi - offset, at, self.params[at:at + hi - lo]))

    def _recut(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """The pieces cut again from self.params: (old view, new view) pairs."""
        old = [piece.flat for piece in self.pieces]
        self._cut()
        return list(zip(old, [piece.flat for piece in self.pieces]))

    def fits(self, p: torch.Tensor) -> bool:
        """Whether `p` can be a view of the bucket's storage."""
        return (type(p.data) is torch.Tensor and p.layout == torch.strided and p.is_contiguous()
                and p.dtype == self.params.dtype and p.device == self.params.device)

    def bind(self, members: List[torch.Tensor]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Makes the parameters (`members`, in the layout's order) views of one
        storage in the bucket's layout, their values copied (Note [Parameters
        in the bucket's storage]); returns the pieces' (old, new) views."""
        storage = torch.zeros(self.padded, dtype=self.params.dtype, device=self.params.device)
        with torch.no_grad():
            for (_, offset, numel), p in zip(self.layout, members):
                storage[offset:offset + numel].copy_(p.detach().reshape(-1))
            for (_, offset, numel), p in zip(self.layout, members):
                p.data = storage[offset:offset + numel].view(p.shape)
        self.storage = storage
        start = 0 if self.replicated else self.rank * self.shard  # its range of the padded storage
        self.params = storage[start:start + self.shard]
        moved = self._recut()
        self.own_views = holders(storage) - len(members)
        return moved

    def bound(self, members: List[torch.Tensor]) -> bool:
        """Whether every parameter is still the view of the storage it was made."""
        base, size = self.storage.data_ptr(), self.storage.element_size()
        return all(p.data_ptr() == base + offset * size and p.dtype == self.storage.dtype and p.is_contiguous()
                   for (_, offset, _), p in zip(self.layout, members))

    def unbind(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Back to a copy of the rank's elements (refreshed at each step)."""
        self.storage = None
        self.own_views = 0
        self.params = self.params.clone()
        return self._recut()

    @property
    def padded(self) -> int:
        return self.length if self.replicated else self.shard * self.world_size

    def sharded_range(self, rank: int) -> Tuple[int, int]:
        """Rank `rank`'s range [lo, hi) of the bucket as a sharded plan cuts
        it, replicated or not (Note [Replicated plans])."""
        return min(rank * self.cut, self.length), min((rank + 1) * self.cut, self.length)

    def span(self, offset: int, numel: int, rank: int) -> Tuple[int, int]:
        """The elements [start, stop) of the parameter at `offset` (of `numel`
        elements) in rank `rank`'s sharded range; start >= stop when it has none."""
        lo, hi = self.sharded_range(rank)
        return max(lo, offset) - offset, min(hi, offset + numel) - offset

    def sharded_part(self, piece: "Piece") -> Tuple[int, int]:
        """The elements of this rank's `piece`, as positions [start, stop) in
        the bucket, that lie in its sharded range: the whole piece in a
        sharded plan, in a replicated one what a sharded plan would give it."""
        at = self.lo + piece.at
        lo, hi = self.sharded_range(self.rank)
        return max(at, lo), min(at + piece.stop - piece.start, hi)

    def held(self, offset: int, numel: int, rank: int) -> Tuple[int, int]:
        """The elements of that parameter whose state rank `rank` holds: all
        of them in a replicated plan, else its span."""
        return (0, numel) if self.replicated else self.span(offset, numel, rank)

