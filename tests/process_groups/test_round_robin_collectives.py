"""Multi-process tests: round-robin groups compute what plain Gloo computes.

Every collective is run through torch.distributed's public API on the default
(plain Gloo) group and on round-robin groups of 1, 3 and 5 Gloo children, with
the same inputs; results (or the fact that the call raised) must be equal.
One job per world size covers every collective, dtype and child count.
"""

import os

import pytest
import torch
import torch.distributed as dist

from tests.support.spawn import run_ranks
from tests.support.worlds import shared_world

CHILD_COUNTS = [1, 3, 5]
DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64]
OPS = ["SUM", "AVG", "MIN", "MAX", "PRODUCT"]
N = 4  # elements each rank contributes per destination rank


def _input(rank, world_size, dtype, length=N, salt=0):
    """Small distinct values per rank, so products cannot overflow int32."""
    values = (torch.arange(length) + rank + salt) % 3 + 1 + (torch.arange(length) % 2) * rank
    return values.to(dtype)


def _equal(a, b):
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and torch.equal(a, b)


# Collectives: name -> fn(group, rank, world_size, dtype, op) returning the
# tensors it wrote. `op` is only used by reductions; others run once per dtype.
def _all_reduce(group, rank, ws, dtype, op):
    t = _input(rank, ws, dtype)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
    return t


def _all_reduce_coalesced(group, rank, ws, dtype, op):
    tensors = [_input(rank, ws, dtype), _input(rank, ws, dtype, length=3, salt=1)]
    opts = torch._C._distributed_c10d.AllreduceCoalescedOptions()
    opts.reduceOp = getattr(dist.ReduceOp, op)
    group.allreduce_coalesced(tensors, opts).wait()
    return tensors


def _reduce(group, rank, ws, dtype, op):
    t = _input(rank, ws, dtype)
    dist.reduce(t, dst=ws - 1, op=getattr(dist.ReduceOp, op), group=group)
    return t if rank == ws - 1 else torch.zeros(0)


def _broadcast(group, rank, ws, dtype, op):
    t = _input(rank, ws, dtype)
    dist.broadcast(t, src=ws - 1, group=group)
    return t


def _all_gather(group, rank, ws, dtype, op):
    out = [torch.zeros(N, dtype=dtype) for _ in range(ws)]
    dist.all_gather(out, _input(rank, ws, dtype), group=group)
    return out


def _all_gather_into_tensor(group, rank, ws, dtype, op):
    out = torch.zeros(N * ws, dtype=dtype)
    dist.all_gather_into_tensor(out, _input(rank, ws, dtype), group=group)
    return out


def _gather(group, rank, ws, dtype, op):
    out = [torch.zeros(N, dtype=dtype) for _ in range(ws)] if rank == 0 else None
    dist.gather(_input(rank, ws, dtype), out, dst=0, group=group)
    return out if rank == 0 else []


def _scatter(group, rank, ws, dtype, op):
    out = torch.zeros(N, dtype=dtype)
    chunks = [_input(r, ws, dtype, salt=7) for r in range(ws)] if rank == 1 else None
    dist.scatter(out, chunks, src=1, group=group)
    return out


def _reduce_scatter(group, rank, ws, dtype, op):
    out = torch.zeros(N, dtype=dtype)
    chunks = [_input(rank, ws, dtype, salt=r) for r in range(ws)]
    dist.reduce_scatter(out, chunks, op=getattr(dist.ReduceOp, op), group=group)
    return out


def _reduce_scatter_tensor(group, rank, ws, dtype, op):
    out = torch.zeros(N, dtype=dtype)
    dist.reduce_scatter_tensor(out, _input(rank, ws, dtype, length=N * ws), op=getattr(dist.ReduceOp, op), group=group)
    return out


def _all_to_all(group, rank, ws, dtype, op):
    out = [torch.zeros(N, dtype=dtype) for _ in range(ws)]
    dist.all_to_all(out, [_input(rank, ws, dtype, salt=r) for r in range(ws)], group=group)
    return out


def _all_to_all_single(group, rank, ws, dtype, op):
    # Uneven splits: rank r sends r + 1 + d elements to rank d.
    send = [rank + 1 + d for d in range(ws)]
    recv = [s + 1 + rank for s in range(ws)]
    out = torch.zeros(sum(recv), dtype=dtype)
    dist.all_to_all_single(out, _input(rank, ws, dtype, length=sum(send)), recv, send, group=group)
    return out


def _barrier(group, rank, ws, dtype, op):
    dist.barrier(group=group)
    return torch.zeros(0)


REDUCTIONS = {
    "all_reduce": _all_reduce,
    "all_reduce_coalesced": _all_reduce_coalesced,
    "reduce": _reduce,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
}
OTHERS = {
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "gather": _gather,
    "scatter": _scatter,
    "all_to_all": _all_to_all,
    "all_to_all_single": _all_to_all_single,
    "barrier": _barrier,
}


def _cases():
    for name, fn in REDUCTIONS.items():
        for dtype in DTYPES:
            for op in OPS:
                yield f"{name}/{dtype}/{op}", fn, dtype, op
    for name, fn in OTHERS.items():
        for dtype in DTYPES:
            yield f"{name}/{dtype}", fn, dtype, None


def _outcome(fn, group, rank, ws, dtype, op):
    """("ok", tensors) or ("raised", the error's first line), so that a
    collective Gloo refuses (AVG on integers) is refused alike by round-robin."""
    try:
        return "ok", fn(group, rank, ws, dtype, op)
    except RuntimeError as error:
        return "raised", type(error).__name__ + ": " + str(error).splitlines()[0]


def _future_results(group, rank, ws):
    """What get_future().then(...) chains resolve to, for a few collectives.
    Checked against known values where they are obvious, and against the same
    chains on plain Gloo for the rest."""
    t = torch.full((3,), float(rank + 1))
    work = dist.all_reduce(t, group=group, async_op=True)
    doubled = work.get_future().then(lambda fut: fut.value()[0] * 2)
    plus_one = doubled.then(lambda fut: fut.value() + 1)
    total = ws * (ws + 1) / 2
    assert torch.equal(plus_one.wait(), torch.full((3,), 2 * total + 1))
    assert work.wait() and work.is_completed()

    b = torch.full((2,), float(rank))
    work = dist.broadcast(b, src=ws - 1, group=group, async_op=True)
    assert torch.equal(work.get_future().then(lambda fut: fut.value()[0]).wait(), torch.full((2,), float(ws - 1)))

    out = torch.zeros(2 * ws)
    work = dist.all_gather_into_tensor(out, torch.full((2,), float(rank)), group=group, async_op=True)
    gathered = work.get_future().then(lambda fut: [x.clone() for x in fut.value()]).wait()

    chunks = [torch.zeros(2) for _ in range(ws)]
    work = dist.all_gather(chunks, torch.full((2,), float(rank)), group=group, async_op=True)
    listed = work.get_future().then(lambda fut: fut.value()).wait()
    return [plus_one.value(), gathered, listed]


def _collectives_match_gloo(rank, world_size):
    import ddp_ext

    torch.manual_seed(0)
    groups = {k: ddp_ext.new_round_robin_group(num_groups=k) for k in CHILD_COUNTS}
    cases = list(_cases())
    reference = {name: _outcome(fn, dist.group.WORLD, rank, world_size, dtype, op) for name, fn, dtype, op in cases}
    assert sum(kind == "ok" for kind, _ in reference.values()) > 0.9 * len(cases)
    mismatches = []
    reference_futures = _future_results(dist.group.WORLD, rank, world_size)
    for k, group in groups.items():
        assert dist.get_backend(group) == "round_robin"
        assert group._get_backend(torch.device("cpu")).next_child_index == 0
        for name, fn, dtype, op in cases:
            got = _outcome(fn, group, rank, world_size, dtype, op)
            want = reference[name]
            same = got[0] == want[0] and (_equal(got[1], want[1]) if got[0] == "ok" else got[1] == want[1])
            if not same:
                mismatches.append(f"{k} children, {name}: got {got}, gloo gave {want}")
        # Every collective took exactly one turn, raised or not.
        backend = group._get_backend(torch.device("cpu"))
        assert backend.forwarded_calls == len(cases) and backend.next_child_index == len(cases) % k
        got = _future_results(group, rank, world_size)
        if not _equal(got, reference_futures):
            mismatches.append(f"{k} children: futures resolved to {got}, on gloo to {reference_futures}")
    assert not mismatches, "\n".join(mismatches[:20])
    return [name for name, (kind, _) in reference.items() if kind == "raised"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_match_plain_gloo(world_size):
    refused_by_gloo = shared_world(world_size).run(_collectives_match_gloo)[0]
    # AVG is the one reduction Gloo may refuse; anything else it refuses
    # would leave the comparison toothless.
    assert all("AVG" in name for name in refused_by_gloo), refused_by_gloo


def _creation_paths(rank, world_size, store_path):
    import ddp_ext
    from ddp_ext import round_robin

    def children(group):
        return len(group._get_backend(torch.device("cpu")).children)

    def check_sum(group, ranks):
        t = torch.full((5,), float(rank + 1))
        dist.all_reduce(t, group=group)
        assert torch.equal(t, torch.full((5,), float(sum(r + 1 for r in ranks)))), t

    everyone = list(range(world_size))

    # 1. ddp_ext.new_round_robin_group, also over a subset of ranks.
    rr = ddp_ext.new_round_robin_group(num_groups=2, backend="gloo")
    assert children(rr) == 2 and rr._get_backend(torch.device("cpu")).owns_children
    check_sum(rr, everyone)
    subset = [0, world_size - 1]
    rr_subset = ddp_ext.new_round_robin_group(num_groups=3, ranks=subset)
    if rank in subset:
        assert rr_subset.size() == 2 and dist.get_rank(rr_subset) == subset.index(rank)
        check_sum(rr_subset, subset)
    else:
        assert rr_subset == dist.GroupMember.NON_GROUP_MEMBER

    # 2. ddp_ext.round_robin_group over existing groups.
    plain = [dist.new_group(backend="gloo") for _ in range(3)]
    rr_borrowed = ddp_ext.round_robin_group(plain)
    assert children(rr_borrowed) == 3 and not rr_borrowed._get_backend(torch.device("cpu")).owns_children
    assert dist.get_backend(rr_borrowed) == "round_robin"
    assert dist.get_process_group_ranks(rr_borrowed) == everyone
    check_sum(rr_borrowed, everyone)
    dist.destroy_process_group(rr_borrowed)
    check_sum(plain[0], everyone)  # borrowed children survive

    # 3. dist.new_group(backend="round_robin"), from pg_options or from the environment.
    rr_options = dist.new_group(backend="round_robin", pg_options=ddp_ext.RoundRobinOptions(num_groups=4))
    assert children(rr_options) == 4
    check_sum(rr_options, everyone)
    os.environ[round_robin.ENV_NUM_GROUPS] = "5"
    rr_env = dist.new_group(backend="round_robin")
    del os.environ[round_robin.ENV_NUM_GROUPS]
    assert children(rr_env) == 5
    check_sum(rr_env, everyone)

    # 4. dist.init_process_group("round_robin") as the default group.
    dist.destroy_process_group()
    dist.init_process_group(
        "round_robin",
        store=dist.FileStore(store_path, world_size),
        rank=rank,
        world_size=world_size,
        pg_options=ddp_ext.RoundRobinOptions(num_groups=3, backend="gloo"),
    )
    assert dist.get_backend() == "round_robin"
    assert children(dist.group.WORLD) == 3
    check_sum(None, everyone)
    # spawn.py's teardown destroys this default group.


@pytest.mark.parametrize("world_size", [3])
def test_three_ways_to_get_a_round_robin_group(world_size, tmp_path):
    run_ranks(_creation_paths, world_size, str(tmp_path / "rr_default_store"))
