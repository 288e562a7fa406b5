"""ddp.overlap_optimizer(optimizer, shard=True, overlap_forward=True): the
step returns with the all-gathers on the wire, and what reads a parameter
waits for its bucket (Note [Gathering behind the next forward] in
ddp_ext/_gather_tail.py). In real runs over Gloo at 2 ranks: bitwise the
waiting variant and torch's DDP with a plain optimizer.step(), with the
usual reads between steps (EMA, deepcopy, torch.save, an evaluation
forward) and no_sync; where the parameters are not in their bucket's
storage, the all-gathers are launched in the first layers' order through
two reused buffers, the last two really left pending by the step, and nothing is pending, the mode off the stack, after the forward
that consumed them."""

import copy
import gc
import io

import pytest
import torch

from ddp_ext._sharded_optimizer import GATHER_BUFFERS
from tests.sharding.shard_support import run, train_steps, trained, wrapped
from tests.support import models
from tests.support.harness import assert_states_bitwise
from tests.support.worlds import shared_world

RUNS = [
    run(optimizer="adam"),
    run(optimizer="sgd"),
    run(optimizer="adamw", lr_after_backward=True, between_steps=True),
    run(optimizer="sgd", between_steps=True, micro_batches=3),
    run(optimizer="adam", freeze_first=True, ddp=dict(gradient_as_bucket_view=True)),
    run(model="branches", optimizer="adam", ddp=dict(find_unused_parameters=True)),
]


def _job(rank, world_size, r):
    return {kind: trained(rank, world_size, r, kind) for kind in ("overlapped", "sharded", "torch")}


@pytest.mark.parametrize("r", RUNS, ids=lambda r: r.id)
def test_bitwise_waiting_variant_and_torch_ddp_at_2_ranks(r):
    for rank, result in enumerate(shared_world(2).run(_job, r)):
        for kind in ("params", "optimizer"):
            assert_states_bitwise(result["overlapped"][kind], result["sharded"][kind],
                                  f"rank {rank} {r.id}: {kind} vs the waiting variant")
            assert_states_bitwise(result["overlapped"][kind], result["torch"][kind],
                                  f"rank {rank} {r.id}: {kind} vs torch's DDP")


def _pending_job(rank, world_size):
    r = run(optimizer="adam", scheduler=False)
    module, ddp, optimizer, _ = wrapped(r, "overlapped")
    sharded = ddp._optimizer_overlap
    sharded.storage.in_place = False  # the copying path's buffers (in place: tests/sharding/test_bucket_storage.py)
    tail = sharded.tail
    facts = {}
    # The first iteration's one bucket is rebuilt after it: its step and the
    # next (on new buckets) wait for their all-gathers; the third leaves some pending.
    train_steps(r, "overlapped", ddp, optimizer, None, rank, world_size, range(2))
    facts["pending_after_new_buckets"] = len(tail.buckets)
    train_steps(r, "overlapped", ddp, optimizer, None, rank, world_size, range(2, 3))
    # train_steps ended with step() and zero_grad(): zero_grad waited for nothing.
    facts["buckets_after_step"] = len(tail.buckets)
    facts["buckets_stepped"] = len(sharded.active)
    facts["mode_after_step"] = tail._mode_on_stack()
    # The last launched are left pending; the first layers' were launched first, and written in the step.
    facts["pending_are_the_last_launched"] = sorted(tail.buckets) == list(
        range(sharded.gathers - len(tail.buckets), sharded.gathers))
    facts["first_layer_written"] = all(p is not sharded.params[0] for ps in tail.buckets.values() for p in ps)
    facts["gather_buffers"] = {kind: len(buffers) for kind, buffers in sharded.gather_buffers.items()}
    args, target = models.rank_batch(r.model, 2, 0, rank, world_size, per_rank=4)
    loss = models.MODELS[r.model].loss(ddp(*args), target)
    facts["read_by_forward"] = tail.finished_on_read
    facts["pending_after_forward"] = len(tail.pending) + len(tail.buckets) + len(sharded.gathering)
    facts["mode_after_forward"] = tail._mode_on_stack()
    loss.backward()
    optimizer.step()
    # A read between steps waits for every bucket it reads, then the mode goes.
    facts["buckets_after_second_step"] = len(tail.buckets)
    module.state_dict()
    facts["pending_after_state_dict"] = len(tail.pending)
    # Written from inside the mode's handler, it cannot go there; finish_forward_tail takes it off.
    ddp.finish_forward_tail()
    facts["mode_after_finish"] = tail._mode_on_stack()
    return facts


def test_gathers_pending_after_step_and_consumed_by_the_forward():
    for rank, facts in enumerate(shared_world(2).run(_pending_job)):
        assert facts["pending_after_new_buckets"] == 0, (rank, facts)
        assert facts["buckets_stepped"] > GATHER_BUFFERS, (rank, facts)  # some are written in the step
        assert facts["buckets_after_step"] == GATHER_BUFFERS, (rank, facts)
        assert facts["mode_after_step"], (rank, facts)
        assert facts["pending_are_the_last_launched"], (rank, facts)
        assert facts["first_layer_written"], (rank, facts)
        assert list(facts["gather_buffers"].values()) == [GATHER_BUFFERS], (rank, facts)
        assert facts["read_by_forward"] >= 1, (rank, facts)
        assert facts["pending_after_forward"] == 0, (rank, facts)
        assert not facts["mode_after_forward"], (rank, facts)
        assert facts["buckets_after_second_step"] == GATHER_BUFFERS, (rank, facts)
        assert facts["pending_after_state_dict"] == 0, (rank, facts)
        assert not facts["mode_after_finish"], (rank, facts)


def _reads_job(rank, world_size, read):
    """One step, then `read` of the parameters before any forward: the values
    it sees are those of the waiting variant, and nothing stays pending."""
    r = run(optimizer="adam", scheduler=False)
    seen = {}
    for kind in ("sharded", "overlapped"):
        module, ddp, optimizer, _ = wrapped(r, kind)
        train_steps(r, kind, ddp, optimizer, None, rank, world_size, range(3))  # the third on settled buckets
        if kind == "overlapped":
            assert ddp._optimizer_overlap.tail.pending, "the step left no all-gather pending"
        tail = ddp._optimizer_overlap.tail
        if read == "dropped_wrapper":
            del ddp
            gc.collect()
            seen[kind] = {n: p.detach().clone() for n, p in module.named_parameters()}
        else:
            seen[kind] = READS[read](module, ddp, optimizer)
        if tail is not None:
            seen["left_pending"] = len(tail.pending)
            tail.finish_all()  # the mode, inert now, cannot leave from inside its handler
            seen["mode_left"] = tail._mode_on_stack()
    return seen


def _saved(module, ddp, optimizer):
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer)


def _ema(module, ddp, optimizer):
    ema = [torch.zeros_like(p) for p in module.parameters()]
    with torch.no_grad():
        torch._foreach_lerp_(ema, list(module.parameters()), 0.5)
    return {str(i): e for i, e in enumerate(ema)}


def _evaluated(module, ddp, optimizer):
    with torch.no_grad():
        args, _ = models.rank_batch("deep", 7, 0, 0, 2, per_rank=4)
        return {"out": ddp(*args)}


def _no_sync_forward(module, ddp, optimizer):
    args, _ = models.rank_batch("deep", 7, 0, 0, 2, per_rank=4)
    with ddp.no_sync():
        out = ddp(*args)
    return {"out": out.detach()}


def _nothing_pending(ddp) -> None:
    tail = ddp._optimizer_overlap.tail
    assert tail is None or not (tail.pending or tail._mode_on_stack()), "something is still pending"


def _optimizer_state(module, ddp, optimizer):
    optimizer.state_dict()
    _nothing_pending(ddp)
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _second_step(module, ddp, optimizer):
    optimizer.step()  # no backward since: steps nothing, after writing the last step's parameters
    _nothing_pending(ddp)
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _zero_grad(module, ddp, optimizer):
    optimizer.zero_grad(set_to_none=False)
    optimizer.zero_grad()
    tail = ddp._optimizer_overlap.tail
    assert tail is None or tail.pending, "zero_grad() waited for the all-gathers"
    return {n: p.detach().clone() for n, p in module.named_parameters()}


READS = {
    "second_step": _second_step,
    "zero_grad": _zero_grad,
    "deepcopy": lambda module, ddp, optimizer: dict(copy.deepcopy(module).named_parameters()),
    "torch_save": _saved,
    "ema": _ema,
    "evaluation_forward": _evaluated,
    "no_sync_forward": _no_sync_forward,
    "optimizer_state_dict": _optimizer_state,
    "finish_forward_tail": lambda module, ddp, optimizer: (ddp.finish_forward_tail(), _nothing_pending(ddp), dict(
        (n, p.detach().clone()) for n, p in module.named_parameters()))[2],
    "dropped_wrapper": None,
}


@pytest.mark.parametrize("read", sorted(READS))
def test_reads_before_the_next_forward_wait(read):
    for rank, seen in enumerate(shared_world(2).run(_reads_job, read)):
        assert_states_bitwise({k: v.detach() for k, v in seen["overlapped"].items()},
                              {k: v.detach() for k, v in seen["sharded"].items()}, f"rank {rank} {read}")
        assert seen["left_pending"] == 0 and not seen["mode_left"], (rank, read, seen)
