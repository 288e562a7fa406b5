"""The re-cut of the sharded state after the buckets change (Note [Re-cutting
the state] in ddp_ext/_shard_recut.py), on its own, in real multi-process
runs over Gloo: each rank starts with the pieces of an old layout, cut from
known whole states, and must end with exactly the new layout's pieces of
them (bitwise, scalars included), the old pieces dropped, and the whole
state of a parameter no new bucket holds; with ranges that cut through
parameters, ranks that own no piece of a bucket, and a parameter without
state."""

import pytest
import torch

from tests.support.worlds import shared_world

# (numel of each parameter), then buckets as lists of parameter indices.
NUMELS = [7, 1, 12, 5, 3, 9, 2, 4]
OLD = [[7, 6, 5, 4, 3, 2, 1, 0]]  # one bucket for everything, as the first iteration
NEW = [[0], [1, 6], [2, 3, 4], [5]]  # parameter 7 is in no new bucket: its bucket was not reduced
# ([1, 6] has 3 elements: at 4 ranks the last rank owns none of it)
STATELESS = 4  # a parameter never stepped: no state anywhere


def _plans(buckets, rank, world_size):
    from ddp_ext._shard_plan import ShardPlan

    plans = []
    for members in buckets:
        layout, offset = [], 0
        for index in members:
            layout.append((index, offset, NUMELS[index]))
            offset += NUMELS[index]
        plans.append(ShardPlan(tuple(layout), offset, torch.float32, torch.device("cpu"), rank, world_size))
    return plans


def _whole(index):
    g = torch.Generator().manual_seed(index)
    return {"step": torch.tensor(float(10 + index)), "exp_avg": torch.randn(NUMELS[index], generator=g),
            "exp_avg_sq": torch.rand(NUMELS[index], generator=g, dtype=torch.float64)}


def _job(rank, world_size, old_buckets):
    import torch.distributed as dist

    from ddp_ext._shard_recut import recut

    group = dist.group.WORLD
    params = [torch.zeros(n) for n in NUMELS]
    old, new = _plans(old_buckets, rank, world_size), _plans(NEW, rank, world_size)
    state = {}
    for plan in old:
        for piece in plan.pieces:
            if piece.index != STATELESS:
                state[piece.flat] = {k: (v[piece.start:piece.stop].clone() if v.dim() else v.clone())
                                     for k, v in _whole(piece.index).items()}
    whole = recut(state, old, new, params, group)
    pieces = {id(piece.flat): piece for plan in new for piece in plan.pieces}
    got = {(pieces[id(flat)].index, pieces[id(flat)].start, pieces[id(flat)].stop): {k: v.clone() for k, v in s.items()}
           for flat, s in state.items() if id(flat) in pieces}
    return {"left": len(state) - len(got), "got": got, "whole": whole,
            "wanted": sorted(piece.key for piece in pieces.values() if piece.index != STATELESS)}


@pytest.mark.parametrize("old", [OLD, [[7, 6, 5], [4, 3, 2, 1, 0]]], ids=["one_bucket", "two_buckets"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_recut_moves_every_element_to_its_new_piece(world_size, old):
    for rank, r in enumerate(shared_world(world_size).run(_job, old)):
        assert r["left"] == 0, f"rank {rank}: old pieces left in the state"
        assert sorted(r["got"]) == r["wanted"], (rank, sorted(r["got"]), r["wanted"])
        for (index, start, stop), state in r["got"].items():
            whole = _whole(index)
            assert list(state) == list(whole), (rank, index, list(state))  # the optimizer's key order
            for key, value in whole.items():
                expected = value[start:stop] if value.dim() else value
                assert state[key].dtype == expected.dtype and torch.equal(state[key], expected), (rank, index, key)
        assert sorted(r["whole"]) == [7], (rank, sorted(r["whole"]))
        for key, value in _whole(7).items():
            assert torch.equal(r["whole"][7][key], value), (rank, key)
