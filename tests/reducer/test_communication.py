"""What ddp_ext communicates, seen through a recording process group (issues 2
and 3).

- Construction: the model check (two allgathers) and one broadcast per dtype
  of parameters and buffers (coalesced, not one collective per tensor).
- Backward: the step check (an allreduce of one int64 per rank and a rider,
  see Note [Ranks out of step]), then one allreduce per bucket, in bucket
  order on every rank even when gradients arrive in another order; with
  find_unused_parameters=True exactly one extra allreduce (the int32 "used"
  bitmap), after the buckets.
- no_sync: nothing at all, except the buffer broadcast before a forward that
  follows a synchronising one (paper section 4.1), which the step check
  precedes.
- Rebuilding buckets in the observed gradient order: the first rebuild, as
  torch's DDP, broadcasts rank 0's order (int64, one per parameter) at the
  start of the first forward with gradients after the first synchronising
  backward; later rebuilds are voted on through the step check's rider, and
  an agreed one adds the same broadcast at the end of that backward; buckets
  then follow the new layout. The scenarios above fix the layout
  (rebuild_buckets="never") to see the buckets alone.
"""

import contextlib
import dataclasses
import itertools
from collections import Counter

import torch.distributed as dist

import pytest
import torch
from torch import nn

from tests.support import models, reference
from tests.support.harness import CaseTable
from benchmarks.harness.recording_group import RecordingProcessGroup

SIZES = (1, 2, 3, 4)


class Scales(nn.Module):
    """Parameters of 1, 2, 3 and 4 elements, used in an order that depends on
    the rank, so gradients arrive in a different order on every rank."""

    def __init__(self, order):
        super().__init__()
        self.order = order
        self.scales = nn.ParameterList(nn.Parameter(torch.rand(k) + 0.5) for k in SIZES)

    def forward(self, x):
        for i in self.order:
            x = x * self.scales[i].sum()
        return x


# A wrapper's first forward compares the ranks' communication hooks with two
# small allgathers (none here: the text "none"), once (ddp_ext/_comm_hooks.py).
HOOK_CHECK = [("allgather", [("int64", 1)]), ("allgather", [("uint8", len("none"))])]


def _after_hook_check(calls):
    """`calls` of a wrapper's first forward without the hook comparison,
    which must open them."""
    assert calls[:2] == HOOK_CHECK, f"the first forward does not start by comparing hooks: {calls}"
    return calls[2:]


def _iterate(ddp, pg, batches):
    """One forward and backward per batch; returns the calls of each (the
    first without the hook comparison)."""
    logs = []
    for x in batches:
        ddp(x).pow(2).mean().backward()
        calls = pg.take()
        logs.append(_after_hook_check(calls) if not logs else calls)
    return logs


def _group():
    return RecordingProcessGroup(dist.distributed_c10d._get_default_group())


@dataclasses.dataclass(frozen=True)
class Scenario:
    id: str


def _construction(rank, world_size, model):
    pg = _group()
    module = models.build(model)
    reference.ext_ddp(module, process_group=pg)
    tensors = list(module.parameters()) + list(module.buffers())
    numel_by_dtype = Counter()
    for t in tensors:
        numel_by_dtype[str(t.dtype).replace("torch.", "")] += t.numel()
    return pg.take(), dict(numel_by_dtype)


def _bucket_order(rank, world_size, ddp_kwargs, overlap=True):
    pg = _group()
    torch.manual_seed(0)
    order = list(itertools.permutations(range(len(SIZES))))[rank * 7 % 24]
    ddp = reference.ext_ddp(Scales(order), process_group=pg, rebuild_buckets="never", **ddp_kwargs)
    ddp.set_overlap_with_backward(overlap)
    pg.take()
    logs = _iterate(ddp, pg, [torch.randn(3, 2) for _ in range(3)])
    return order, logs, ddp.bucket_indices(), reference.digest(ddp.module)


def _no_sync(rank, world_size, model, find_unused):
    """Per forward+backward: (synchronising?, calls). Pattern: 2 no_sync
    micro-batches then 1 synchronising one, twice."""
    pg = _group()
    module = models.build(model)
    ddp = reference.ext_ddp(module, process_group=pg, find_unused_parameters=find_unused, rebuild_buckets="never")
    pg.take()
    spec = models.MODELS[model]
    log = []
    for step in range(2):
        for micro in range(3):
            args, target = models.rank_batch(model, step, micro, rank, world_size, 4)
            sync = micro == 2
            if sync:
                spec.loss(ddp(*args), target).backward()
            else:
                with ddp.no_sync():
                    spec.loss(ddp(*args), target).backward()
            calls = pg.take()
            log.append((sync, _after_hook_check(calls) if not log else calls))
    n_params = sum(1 for p in module.parameters() if p.requires_grad)
    buffers = Counter()
    for b in module.buffers():
        buffers[str(b.dtype).replace("torch.", "")] += b.numel()
    return log, n_params, dict(buffers)


def _no_sync_after_forward_without_backward(rank, world_size):
    """A synchronising forward whose output is dropped (e.g. a quick look at
    the model with grad enabled), then a no_sync micro-batch."""
    pg = _group()
    module = models.build("mlp")
    ddp = reference.ext_ddp(module, process_group=pg)
    args, target = models.rank_batch("mlp", 0, 0, rank, world_size, 4)
    ddp(*args)
    pg.take()
    with ddp.no_sync():
        models.MODELS["mlp"].loss(ddp(*args), target).backward()
    return pg.take()


def _rebuild(rank, world_size, mode):
    """stack_reversed (registered in reverse of use), 4 steps of a no_sync
    micro-batch then a synchronising one. Per pass: (synchronising?, the
    layout it ran with, calls)."""
    pg = _group()
    module = models.build("stack_reversed")
    ddp = reference.ext_ddp(module, process_group=pg, rebuild_buckets=mode, bucket_cap_mb=576 / 2**20)  # two Stack layers exactly
    pg.take()
    spec = models.MODELS["stack_reversed"]
    log = []
    for step in range(4):
        for micro in range(2):
            args, target = models.rank_batch("stack_reversed", step, micro, rank, world_size, 4)
            layout = ddp.bucket_indices()
            with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                spec.loss(ddp(*args), target).backward()
            calls = pg.take()
            log.append((micro == 1, layout, _after_hook_check(calls) if not log else calls))
    sizes = [p.numel() for p in module.parameters()]
    return log, sizes, ddp.bucket_indices()


SCENARIOS = {
    "construction_mlp": lambda r, w: _construction(r, w, "mlp"),
    "construction_batchnorm": lambda r, w: _construction(r, w, "batchnorm"),
    "construction_mixed_dtype": lambda r, w: _construction(r, w, "mixed_dtype"),
    "bucket_order_tiny": lambda r, w: _bucket_order(r, w, dict(bucket_cap_mb=1e-9)),
    "bucket_order_tiny_no_overlap": lambda r, w: _bucket_order(r, w, dict(bucket_cap_mb=1e-9), overlap=False),
    "bucket_order_default": lambda r, w: _bucket_order(r, w, {}),
    "no_sync_mlp": lambda r, w: _no_sync(r, w, "mlp", False),
    "no_sync_mlp_find_unused": lambda r, w: _no_sync(r, w, "mlp", True),
    "no_sync_batchnorm": lambda r, w: _no_sync(r, w, "batchnorm", False),
    "no_sync_branches_find_unused": lambda r, w: _no_sync(r, w, "branches", True),
    "no_sync_after_forward_without_backward": _no_sync_after_forward_without_backward,
    "rebuild_continuous": lambda r, w: _rebuild(r, w, "continuous"),
    "rebuild_once": lambda r, w: _rebuild(r, w, "once"),
    "rebuild_never": lambda r, w: _rebuild(r, w, "never"),
}


def _run(rank, world_size, s):
    return SCENARIOS[s.id](rank, world_size)


CASES = [Scenario(name) for name in SCENARIOS]
TABLE = CaseTable(_run, CASES, timeout=120)


def _scenario(name):
    return next(s for s in CASES if s.id == name)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("model", ["mlp", "batchnorm", "mixed_dtype"])
def test_construction_checks_model_then_broadcasts_one_chunk_per_dtype(model, world_size):
    for rank, (calls, numel_by_dtype) in enumerate(TABLE.results(world_size, _scenario(f"construction_{model}"))):
        kinds = [kind for kind, _ in calls]
        assert kinds[:2] == ["allgather", "allgather"], f"rank {rank}: {calls}"
        broadcasts = [tensors for kind, tensors in calls[2:] if kind == "broadcast"]
        assert len(broadcasts) == len(calls) - 2, f"rank {rank}: only broadcasts after the model check: {calls}"
        assert all(len(t) == 1 for t in broadcasts), f"rank {rank}: one flat tensor per broadcast: {broadcasts}"
        broadcast_numel = Counter()
        for (dtype, numel), in broadcasts:
            broadcast_numel[dtype] += numel
        assert len(broadcasts) == len(numel_by_dtype), f"rank {rank}: {broadcasts} for {numel_by_dtype}"
        assert dict(broadcast_numel) == numel_by_dtype, f"rank {rank}"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", ["bucket_order_tiny", "bucket_order_tiny_no_overlap", "bucket_order_default"])
def test_allreduces_follow_bucket_order_whatever_the_gradient_order(name, world_size):
    results = TABLE.results(world_size, _scenario(name))
    orders = {order for order, _, _, _ in results}
    assert len(orders) == world_size, f"test setup: ranks should use parameters in different orders: {orders}"
    for rank, (order, logs, buckets, _) in enumerate(results):
        step_check = ("allreduce", [("int64", 6 * world_size + 1)])  # six slots per rank (step, plan, hooks, 3 phases), and the rider
        expected = [step_check] + [("allreduce", [("float32", sum(SIZES[i] for i in b))]) for b in buckets]
        for i, calls in enumerate(logs):
            assert calls == expected, f"rank {rank} (use order {order}), iteration {i}: {calls} != {expected}"
    if name.startswith("bucket_order_tiny"):
        assert results[0][2] == [[3], [2], [1], [0]]
    assert len({digest for *_, digest in results}) == 1, "parameters differ between ranks"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    "name", ["no_sync_mlp", "no_sync_mlp_find_unused", "no_sync_batchnorm", "no_sync_branches_find_unused"]
)
def test_no_sync_communicates_nothing_and_find_unused_adds_one_bitmap(name, world_size):
    find_unused = name.endswith("find_unused")
    for rank, (log, n_params, buffer_numel) in enumerate(TABLE.results(world_size, _scenario(name))):
        previous_synced = True  # construction counts as synchronising for buffers
        for i, (sync, calls) in enumerate(log):
            where = f"rank {rank}, forward {i} ({'sync' if sync else 'no_sync'}): {calls}"
            step_check = ("allreduce", [("int64", 6 * world_size + 1)])  # six slots per rank (step, plan, hooks, 3 phases), and the rider
            broadcasts = [c for c in calls if c[0] == "broadcast"]
            step_checks = [i for i, c in enumerate(calls) if c == step_check]
            others = [c for c in calls if c[0] != "broadcast" and c != step_check]
            # Buffers: broadcast (one chunk per dtype) before a forward that
            # follows a synchronising one, else not at all; a step check
            # comes first.
            forward_checks = 0
            if buffer_numel and previous_synced:
                assert sorted(t for _, (t,) in broadcasts) == sorted(buffer_numel.items()), where
                assert calls[0] == step_check, where
                forward_checks = 1
            else:
                assert broadcasts == [], where
            previous_synced = sync
            if not sync:
                assert others == [] and len(step_checks) == forward_checks, where
                continue
            # The backward starts with its own step check.
            assert len(step_checks) == forward_checks + 1, where
            assert calls.index(others[0]) > step_checks[-1], where
            assert others and all(kind == "allreduce" for kind, _ in others), where
            bitmaps = [c for c in others if c[1][0][0] == "int32"]
            if find_unused:
                assert bitmaps == [("allreduce", [("int32", n_params)])], where
                assert others[-1] == bitmaps[0], f"{where}: the bitmap goes after the buckets"
            else:
                assert bitmaps == [], where


@pytest.mark.parametrize("world_size", [2])
def test_no_sync_after_forward_without_backward_communicates_nothing(world_size):
    for rank, calls in enumerate(TABLE.results(world_size, _scenario("no_sync_after_forward_without_backward"))):
        assert calls == [], f"rank {rank}: collectives inside no_sync: {calls}"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("mode", ["continuous", "once", "never"])
def test_rebuild_broadcasts_the_order_once(mode, world_size):
    results = TABLE.results(world_size, _scenario(f"rebuild_{mode}"))
    for rank, (log, sizes, final) in enumerate(results):
        synced = 0
        for i, (sync, layout, calls) in enumerate(log):
            where = f"rank {rank}, pass {i}: {calls}"
            # The first rebuild, as torch's DDP: at the first forward with
            # gradients after the first synchronising backward (here one
            # under no_sync), rank 0's order is broadcast; no vote.
            first_rebuild = [("broadcast", [("int64", len(sizes))])] if mode != "never" and i == 2 else []
            if not sync:
                assert calls == first_rebuild, f"{where}: inside no_sync only the first rebuild's broadcast"
                continue
            synced += 1
            # Later votes ride on the step check: no collective of their own.
            expected = [("allreduce", [("int64", 6 * world_size + 1)])]  # Note [Ranks out of step], [Stragglers]
            expected += [("allreduce", [("float32", sum(sizes[j] for j in b))]) for b in layout]
            assert calls == expected, where
        n = len(sizes)
        if mode == "never":
            assert final == [list(range(n - 1, -1, -1))[k : k + 4] for k in range(0, n, 4)]
        else:
            # Stack layers are used in reverse: gradients arrive layer 0 first, bias before weight.
            assert final == [[k + 1, k, k + 3, k + 2] for k in range(0, n, 4)], f"rank {rank}: {final}"
