"""Moving the sharded optimizer's state to the buckets' new layout after a
rebuild (ShardedOptimizer._reshard in ddp_ext/_sharded_optimizer.py).

Note [Re-cutting the state]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
When the buckets are laid out again (after the first iteration, as torch's
DDP does; a new bucket_cap_mb) each rank's range of a new bucket covers
other elements than its old ranges did (Note [Shard plan] in
ddp_ext/_shard_plan.py). Every rank knows every rank's ranges, old and new,
from the layouts alone, so each element's state goes straight from the rank
that holds it to the rank that will:
 - one all_gather_object of each parameter's state keys, with the dtype and
   device of its elementwise state and the value of its scalar state
   (`step`), sent by the rank holding the parameter's first element: a rank
   that held no piece of a parameter learns what state it has;
 - then, for each new bucket in the order of the plans (the same on every
   rank) and each of its elementwise keys (Adam's exp_avg, exp_avg_sq):
   one all_to_all_single, in which each rank sends every other rank the
   elements of its old pieces that fall in that rank's new pieces, and
   receives those of its own. A key of the old pieces is dropped as soon
   as it is packed to be sent.
Beyond its shards a rank thus holds, at most, what it sends of one new
bucket's parameters for one key and its new range of them, received
(about two of its bucket ranges of one key); every rank, whatever the
layouts, takes part in the same collectives in the same order. The elements
are copied, never computed: the state is bitwise what it was.

A replicated bucket (Note [Replicated plans] in ddp_ext/_shard_plan.py)
sends as a sharded one would, each rank its sharded range, so each
element goes once to each rank that needs it, and receives whole: every
rank's new range of a replicated bucket is all of it.

A parameter of an old bucket that no new bucket holds (its new bucket was
not reduced at this step, as with skip_all_reduce_unused_params) is sent
whole to every rank instead, and waits whole, as a loaded checkpoint's state
does, until its bucket is next reduced: that costs its whole state on every
rank meanwhile.
"""

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from ddp_ext._shard_plan import Piece, ShardPlan, elementwise_state

Span = Tuple[int, int]  # [start, stop) of a parameter's elements; empty when start >= stop


def recut(state: Dict[torch.Tensor, dict], old: List[ShardPlan], new: List[ShardPlan],
          params: List[torch.Tensor], group) -> Dict[int, dict]:
    """Moves the state of the old plans' pieces, in `state`, to the new
    plans' pieces (Note [Re-cutting the state]); a collective. Returns the
    whole state of the old plans' parameters that no new plan holds, by
    reducer index."""
    rank, world_size = group.rank(), group.size()
    held: Dict[int, Piece] = {piece.index: piece for plan in old for piece in plan.pieces}
    was: Dict[int, List[Span]] = {index: [plan.span(offset, numel, r) for r in range(world_size)]
                                  for plan in old for index, offset, numel in plan.layout}
    kinds = _kinds(state, held, group)
    placed = {index for plan in new for index, _, _ in plan.layout}
    moves = [[(index, [plan.held(offset, numel, r) for r in range(world_size)]) for index, offset, numel in plan.layout
              if index in kinds] for plan in new]
    orphans = sorted(index for index in was if index in kinds and index not in placed)
    moves.append([(index, [(0, params[index].numel())] * world_size) for index in orphans])
    arrived: Dict[int, dict] = {}
    for members in moves:
        keys = []
        for index, _ in members:
            keys += [key for key, kind in kinds[index] if kind[0] == "elementwise" and key not in keys]
        for key in keys:
            arrived_key = _move(state, key, [(index, into) for index, into in members
                                             if any(k == key for k, _ in kinds[index])], held, was, kinds, rank, group)
            for index, value in arrived_key.items():
                arrived.setdefault(index, {})[key] = value
    for piece in held.values():
        state.pop(piece.flat, None)
    whole: Dict[int, dict] = {}
    for plan in new:
        for piece in plan.pieces:
            if piece.index in kinds:
                state[piece.flat] = _assembled(kinds[piece.index], arrived.get(piece.index, {}), None)
    for index in orphans:
        whole[index] = _assembled(kinds[index], arrived.get(index, {}), params[index].shape)
    return whole


def _kinds(state, held: Dict[int, Piece], group) -> Dict[int, list]:
    """Each parameter's state, as (key, kind) pairs in the optimizer's order:
    ("elementwise", dtype, device) or ("scalar", value, device); only the
    parameters with state (a collective)."""
    mine = {}
    for index, piece in held.items():
        if piece.start != 0 or not state.get(piece.flat):
            continue
        mine[index] = [(key, ("elementwise", value.dtype, str(value.device))
                        if elementwise_state(key, value, piece.stop - piece.start)
                        else ("scalar", value.detach().cpu() if isinstance(value, torch.Tensor) else value,
                              str(value.device) if isinstance(value, torch.Tensor) else None))
                       for key, value in state[piece.flat].items()]
    every = [None] * group.size()
    dist.all_gather_object(every, mine, group=group)
    return {index: kinds for rank_kinds in every for index, kinds in rank_kinds.items()}


def _overlap(a: Span, b: Span) -> Span:
    return max(a[0], b[0]), min(a[1], b[1])


def _move(state, key: str, members: List[Tuple[int, List[Span]]], held: Dict[int, Piece],
          was: Dict[int, List[Span]], kinds: Dict[int, list], rank: int, group) -> Dict[int, torch.Tensor]:
    """One all_to_all_single of `key` for `members` (each a parameter and
    every rank's new span of it): this rank's new span of each, by index."""
    world_size = group.size()
    _, dtype, device = next(kind for k, kind in kinds[members[0][0]] if k == key)
    parts, send_counts = [], []
    for to in range(world_size):
        count = 0
        for index, into in members:
            mine = was[index][rank]
            lo, hi = _overlap(mine, into[to])
            if lo < hi:
                piece = held[index]  # the whole parameter, in a replicated plan
                parts.append(state[piece.flat][key][lo - piece.start:hi - piece.start])
                count += hi - lo
        send_counts.append(count)
    send = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)
    del parts
    for index, _ in members:
        if index in held:
            state.get(held[index].flat, {}).pop(key, None)  # sent: its memory goes
    recv_counts = [sum(max(0, hi - lo) for lo, hi in (_overlap(was[index][source], into[rank])
                                                      for index, into in members))
                   for source in range(world_size)]
    received = torch.empty(sum(recv_counts), dtype=dtype, device=device)
    dist.all_to_all_single(received, send, recv_counts, send_counts, group=group)
    del send
    out = {index: torch.empty(into[rank][1] - into[rank][0], dtype=dtype, device=device)
           for index, into in members if into[rank][0] < into[rank][1]}
    at = 0
    for source in range(world_size):
        for index, into in members:
            lo, hi = _overlap(was[index][source], into[rank])
            if lo < hi:
                out[index][lo - into[rank][0]:hi - into[rank][0]].copy_(received[at:at + hi - lo])
                at += hi - lo
    return out


def _assembled(kinds: list, arrived: Dict[str, torch.Tensor], shape) -> dict:
    """A piece's (shape None) or a whole parameter's state, in the optimizer's key order."""
    out = {}
    for key, kind in kinds:
        if kind[0] == "elementwise":
            if key in arrived:
                out[key] = arrived[key] if shape is None else arrived[key].view(shape)
        else:
            value, device = kind[1], kind[2]
            out[key] = value.clone().to(device) if isinstance(value, torch.Tensor) else value
    return out
