"""The step check on bucket 0 (Note [The step check on bucket 0] in
reducer/agreement/step_check.h): where no communication hook runs, no layer is dropped
and no buffer is broadcast, a backward's step check travels in a tail of
bucket 0's allreduce instead of a collective of its own. These tests count
the collectives a backward runs (torch's profiler records each Gloo
allreduce with its tensors' shapes), check that the averaged gradients are
exactly torch's DDP's (the tail must not disturb the average, nor the
average the tail), and that ranks out of step are still caught on the
bucket 0 that carries the check. At three ranks or more the carrier keeps
each of bucket 0's elements in the chunk of Gloo's ring it has in bucket 0
alone (Note [Gloo's ring chunks] in reducer/agreement/ring_chunks.h), so the
gradients are bitwise those of the separate check's run."""

import dataclasses
import datetime
from typing import Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.profiler import ProfilerActivity, profile

import ddp_ext
from tests.support.harness import CaseTable, same_bits

PHASES = 3  # StepSlots::kPhases
PIECES = 3  # kPieces in reducer/agreement/step_slots.h


def tail_numel(world_size: int) -> int:
    return PIECES * ((3 + PHASES) * world_size + 1)


def ring_chunk(elements: int, element_size: int, world_size: int) -> int:
    """Elements per chunk of Gloo's ring allreduce (Note [Gloo's ring chunks])."""
    max_segment = element_size * max(1, (1 << 20) // element_size)
    segments = max(-(-elements * element_size // max_segment), 2 * world_size)
    segments = -(-segments // world_size) * world_size
    return segments // world_size * -(-elements // segments)


def carried_numel(first_bucket: int, world_size: int, element_size: int = 4) -> int:
    """The carrier's length: bucket 0 then the tail at two ranks; else world_size
    chunks, each bucket 0's chunk and room for the tail, a length Gloo cuts alike."""
    tail = tail_numel(world_size)
    if world_size == 2:
        return first_bucket + tail
    padded = ring_chunk(first_bucket, element_size, world_size) + -(-tail // world_size)
    while ring_chunk(padded * world_size, element_size, world_size) != padded:
        padded += 1
    return padded * world_size


def check_numel(world_size: int) -> int:
    return (3 + PHASES) * world_size + 1  # the separate check's int64 slots


@dataclasses.dataclass(frozen=True)
class C:
    id: str
    dtype: torch.dtype = torch.float32
    ddp_kwargs: Tuple = ()
    hook: bool = False
    buffers: bool = False
    rides: bool = True  # whether the check should ride on bucket 0


CASES = [
    C("float32"),
    C("float64", dtype=torch.float64),
    C("many_buckets", ddp_kwargs=(("bucket_cap_mb", 0.001),)),
    C("gradient_as_bucket_view", ddp_kwargs=(("gradient_as_bucket_view", True),)),
    C("find_unused_parameters", ddp_kwargs=(("find_unused_parameters", True),)),
    C("static_graph", ddp_kwargs=(("static_graph", True),)),
    C("batched_grad_copy", ddp_kwargs=(("batched_grad_copy", True),)),
    # Where the separate check stays: a hook, buffers broadcast before forwards,
    # buckets of a dtype that cannot hold the pieces exactly.
    C("comm_hook", hook=True, rides=False),
    C("buffers_broadcast", buffers=True, rides=False),
    C("float16", dtype=torch.float16, rides=False),
]


class Net(nn.Module):
    def __init__(self, dtype: torch.dtype, buffers: bool):
        super().__init__()
        torch.manual_seed(0)
        self.fc0 = nn.Linear(6, 16)
        self.norm = nn.BatchNorm1d(16) if buffers else nn.Identity()
        self.fc1 = nn.Linear(16, 3)
        self.to(dtype)

    def forward(self, x):
        return self.fc1(torch.relu(self.norm(self.fc0(x))))


def ddp_kwargs(c: C) -> dict:
    return dict(c.ddp_kwargs)


def gloo_allreduces(prof) -> list:
    """The shapes of every Gloo allreduce the profile recorded, in order."""
    return [e.input_shapes for e in prof.events() if e.name in ("gloo:all_reduce", "gloo:all_reduce_coalesced")]


def run_case(rank: int, world_size: int, c: C):
    group = dist.new_group()
    try:
        return compare(rank, world_size, c, group)
    finally:
        dist.destroy_process_group(group)


def compare(rank: int, world_size: int, c: C, group):
    ours = ddp_ext.DistributedDataParallel(Net(c.dtype, c.buffers), process_group=group, **ddp_kwargs(c))
    kwargs = {k: v for k, v in ddp_kwargs(c).items() if k != "batched_grad_copy"}
    theirs = TorchDDP(Net(c.dtype, c.buffers), process_group=group, **kwargs)
    if c.hook:
        ours.register_comm_hook(group, default_hooks.allreduce_hook)
        theirs.register_comm_hook(group, default_hooks.allreduce_hook)
    grads = []  # per step: (ours, torch's) per parameter
    shapes: Optional[list] = None
    for step in range(5):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank)).to(c.dtype)
        for model in (ours, theirs):
            model.zero_grad(set_to_none=True)
        if step == 3:
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                (ours(x) ** 2).sum().backward()
            shapes = gloo_allreduces(prof)
        else:
            (ours(x) ** 2).sum().backward()
        (theirs(x) ** 2).sum().backward()
        grads.append([(a.grad.clone(), b.grad.clone()) for a, b in zip(ours.module.parameters(), theirs.module.parameters())])
    return {"grads": grads, "shapes": shapes, "buckets": len(ours.bucket_indices()),
            "first_bucket": first_bucket(ours)}


def first_bucket(ddp) -> int:
    """Elements in bucket 0."""
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    return sum(params[i].numel() for i in ddp.bucket_indices()[0])


TABLE = CaseTable(run_case, CASES, timeout=180.0)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_step_check_rides_on_bucket0_and_gradients_stay_exact(c, world_size):
    results = TABLE.results(world_size, c)
    for rank, r in enumerate(results):
        for step, (per_param, on_rank0) in enumerate(zip(r["grads"], results[0]["grads"])):
            for i, ((ours, theirs), (ours_on_rank0, _)) in enumerate(zip(per_param, on_rank0)):
                where = f"rank {rank}, step {step}, parameter {i}"
                # Every replica gets the same average, exactly torch's DDP's:
                # at two ranks the tail changed none of bucket 0's elements
                # (a + b in either order); at three the carrier keeps Gloo's
                # order of the sums (test_the_carrier_keeps_the_order_of_the_sums).
                assert torch.equal(ours, ours_on_rank0), where
                if world_size == 2:
                    assert torch.equal(ours, theirs), where
                else:
                    # Until both have rebuilt, a gradient's place in its bucket
                    # may differ from torch's (TORCH_CONTRACT.md), which at three
                    # ranks changes the order of the sums in the last bits;
                    # tests/process_groups/test_round_robin_ddp.py compares
                    # ddp_ext with itself bit for bit there.
                    tol = dict(rtol=1e-2, atol=1e-3) if c.dtype == torch.float16 else {}
                    torch.testing.assert_close(ours, theirs, **tol, msg=where)
        shapes = r["shapes"]
        usage = 1 if c.id == "find_unused_parameters" else 0  # the usage bitmap's allreduce
        if c.rides:
            # One collective per bucket: bucket 0's carries the tail.
            assert len(shapes) == r["buckets"] + usage, f"rank {rank}: {shapes}"
            # (The profiler orders events as they ran on Gloo's thread.)
            carried = carried_numel(r["first_bucket"], world_size, 8 if c.dtype == torch.float64 else 4)
            assert [[carried]] in shapes, f"rank {rank}: {shapes}"
            assert [[r["first_bucket"]]] not in shapes, f"rank {rank}: {shapes}"
            assert [[check_numel(world_size)]] not in shapes, f"rank {rank}: {shapes}"
        else:
            # The separate check (int64 slots), and no tail on bucket 0.
            assert [[check_numel(world_size)]] in shapes, f"rank {rank}: {shapes}"
            assert [[r["first_bucket"]]] in shapes, f"rank {rank}: {shapes}"


# --- Ranks out of step are caught on bucket 0 ------------------------------------------


@dataclasses.dataclass(frozen=True)
class OutOfStep:
    id: str
    ddp_kwargs: Tuple = ()


OUT_OF_STEP = [
    OutOfStep("one_bucket"),
    OutOfStep("many_buckets", (("bucket_cap_mb", 0.001),)),
    OutOfStep("float64"),
]


def skip_one_backward(ddp, rank: int, world_size: int, batch, optimizer=None) -> dict:
    """Four steps over `ddp` in which the last rank skips the backward of
    step 1. Each rank's outcome per step (None, "skipped", or the error it
    raised, which ends its run), the Gloo allreduces' shapes of the backward
    that raised, and bucket 0's elements. `batch(step)` is a step's input;
    `optimizer`, if any, is stepped after each backward."""
    outcome = []
    for step in range(4):
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        loss = (ddp(batch(step)) ** 2).sum()
        if step == 1 and rank == world_size - 1:
            outcome.append("skipped")
            continue
        error = None
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            try:
                loss.backward()
                if optimizer is not None:
                    optimizer.step()
            except RuntimeError as raised:
                error = str(raised)
                drain(ddp.process_group)
        outcome.append(error)
        if error is not None:
            return {"outcome": outcome, "shapes": gloo_allreduces(prof), "first_bucket": first_bucket(ddp)}
    return {"outcome": outcome, "shapes": None}


def drain(group) -> None:
    """Waits (30 s at most) for the collectives the raising backward dropped,
    which pair up among the ranks that raised: torch's profiler can crash the
    process if it stops while a Gloo collective it recorded still runs on a
    Gloo thread (seen about once in 600 stops, without ddp_ext too). A Gloo
    barrier completes after every collective launched before it."""
    try:
        dist.barrier(group=group, async_op=True).wait(timeout=datetime.timedelta(seconds=30))
    except RuntimeError:
        pass  # unpaired: the profiler stops anyway


def skip_a_backward(rank: int, world_size: int, c: OutOfStep):
    group = dist.new_group()  # the dropped allreduces stay on this group
    try:
        dtype = torch.float64 if c.id == "float64" else torch.float32
        ddp = ddp_ext.DistributedDataParallel(Net(dtype, False), process_group=group, **dict(c.ddp_kwargs))
        def batch(step: int) -> torch.Tensor:
            return torch.randn(4, 6, generator=torch.Generator().manual_seed(step)).to(dtype)

        return skip_one_backward(ddp, rank, world_size, batch)
    finally:
        dist.destroy_process_group(group)


OUT_OF_STEP_TABLE = CaseTable(skip_a_backward, OUT_OF_STEP, timeout=180.0, isolated=True)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("c", OUT_OF_STEP, ids=lambda c: c.id)
def test_ranks_out_of_step_are_caught_on_bucket0(c, world_size):
    results = OUT_OF_STEP_TABLE.results(world_size, c)
    assert_caught_out_of_step(results, world_size)
    for rank, r in enumerate(results):
        # Caught by the bucket 0 that carried the check: no collective of its own.
        carried = carried_numel(r["first_bucket"], world_size, 8 if c.id == "float64" else 4)
        assert r["shapes"] and [[carried]] in r["shapes"], f"rank {rank}: {r['shapes']}"
        assert [[check_numel(world_size)]] not in r["shapes"], f"rank {rank}: {r['shapes']}"


def assert_caught_out_of_step(results, world_size: int) -> None:
    """Every rank raised the same out-of-step message (but for "this is rank
    r"): the last rank skipped the backward of training step 2, so the
    others' backward of step 2 met its backward of step 3."""
    messages = [r["outcome"][-1] for r in results]
    odd = world_size - 1
    in_step = "rank 0" if world_size == 2 else "ranks 0, 1"
    for rank, r in enumerate(results):
        message = messages[rank]
        assert message not in (None, "skipped"), f"rank {rank} trained on out of step: {r['outcome']}"
        assert "out of step" in message and f"this is rank {rank})" in message, message
        assert f"{in_step} in the backward of training step 2; rank {odd} in the backward of training step 3" in message
    assert len({m.replace(f"this is rank {r})", "") for r, m in enumerate(messages)}) == 1, messages


# --- At three ranks or more the carrier keeps Gloo's order of the sums ------------------


@dataclasses.dataclass(frozen=True)
class Sizes:
    id: str
    features: int  # bucket 0 holds the last layer's weight (3 * features)
    dtype: torch.dtype = torch.float32


SIZES = [
    Sizes("small", 5),
    Sizes("odd", 1001),
    Sizes("float64", 777, torch.float64),
    # Over 2 * world_size MiB: Gloo cuts more than two segments per rank.
    Sizes("many_segments", 1_200_000),
]


class Wide(nn.Module):
    def __init__(self, features: int, dtype: torch.dtype, buffer: bool):
        super().__init__()
        torch.manual_seed(0)
        self.fc0 = nn.Linear(4, features)
        self.fc1 = nn.Linear(features, 3)
        if buffer:  # broadcast before forwards: the separate check runs
            self.register_buffer("unused", torch.zeros(1))
        self.to(dtype)

    def forward(self, x):
        return self.fc1(torch.tanh(self.fc0(x)))


def riding_against_separate(rank: int, world_size: int, c: Sizes):
    group = dist.new_group()
    try:
        runs = {}
        for name, buffer in (("riding", False), ("separate", True)):
            ddp = ddp_ext.DistributedDataParallel(
                Wide(c.features, c.dtype, buffer), process_group=group, bucket_cap_mb=1000)
            grads, shapes = [], None
            for step in range(3):
                # Values of many magnitudes, so that another order of the sums changes bits.
                x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank)).to(c.dtype)
                x = x * 10.0 ** (rank - 1)
                ddp.zero_grad(set_to_none=True)
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    (ddp(x) ** 2).sum().backward()
                shapes = gloo_allreduces(prof)
                grads.append([p.grad.clone() for p in ddp.module.parameters()])
            runs[name] = {"grads": grads, "shapes": shapes, "first_bucket": first_bucket(ddp)}
        # Compared here: only the verdicts travel back, not every step's gradients.
        runs["same_bits"] = [[same_bits(a, b) for a, b in zip(ours, theirs)]
                             for ours, theirs in zip(runs["riding"].pop("grads"), runs["separate"].pop("grads"))]
        return runs
    finally:
        dist.destroy_process_group(group)


SIZES_TABLE = CaseTable(riding_against_separate, SIZES, timeout=300.0)


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("c", SIZES, ids=lambda c: c.id)
def test_the_carrier_keeps_the_order_of_the_sums(c, world_size):
    results = SIZES_TABLE.results(world_size, c)
    element_size = 8 if c.dtype == torch.float64 else 4
    for rank, runs in enumerate(results):
        riding, separate = runs["riding"], runs["separate"]
        assert riding["first_bucket"] == separate["first_bucket"]
        carried = carried_numel(riding["first_bucket"], world_size, element_size)
        assert [[carried]] in riding["shapes"], f"rank {rank}: {riding['shapes']}"
        assert [[check_numel(world_size)]] not in riding["shapes"], f"rank {rank}: {riding['shapes']}"
        assert [[check_numel(world_size)]] in separate["shapes"], f"rank {rank}: {separate['shapes']}"
        assert len(runs["same_bits"]) == 3, runs["same_bits"]
        for step, same in enumerate(runs["same_bits"]):
            for i, equal in enumerate(same):
                assert equal, f"rank {rank}, step {step}, parameter {i}: the carrier changed a sum"
