"""optimizer.step() steps the shards a group of buckets at a time and
launches each group's all-gathers as soon as it is stepped (Note [Pipelined
steps and all-gathers] in ddp_ext/_sharded_optimizer.py). In real runs over
Gloo at 2 ranks, with groups of one bucket and of a few, the parameters and
the unsharded optimizer state (Adam's step counts included) stay bitwise
those of one call for every bucket, and torch's DDP's with a plain
optimizer.step() (clipping aside, which sums in another order): two parameter groups with a
scheduler and an LR set after backward(), no_sync, unused and frozen
parameters, clipping, a rebuild (static_graph), the all-gathers in place
and through the gather buffers, behind the next forward or waited for in
the step. And the step really interleaves: an all-gather is launched
before the last group is stepped."""

import re

import pytest

from tests.sharding.shard_support import run, train_steps, wrapped, optimizer_tensors
from tests.support.harness import assert_states_bitwise
from tests.support.worlds import shared_world

RUNS = [
    run(optimizer="adam", lr_after_backward=True, between_steps=True, steps=5),
    run(optimizer="adam_foreach", clip=0.05),
    run(optimizer="sgd", micro_batches=2),
    run(model="branches", optimizer="adam", micro_batches=2, ddp=dict(find_unused_parameters=True)),
    run(optimizer="adamw", freeze_first=True),
    run(optimizer="rmsprop", ddp=dict(static_graph=True)),
]
PATHS = ("overlapped", "copying", "sharded")  # in place behind the forward; through buffers; waited in the step


def _job(rank, world_size, r, group_bytes, path):
    import ddp_ext._sharded_optimizer as so

    events = []
    kept = (so.STEP_GROUP_BYTES, so._all_gather, so.ShardedOptimizer._step)
    step, gather = kept[2], kept[1]

    def counted_step(self, plans, places, used):
        events.append(("step", len(plans)))
        return step(self, plans, places, used)

    def counted_gather(*args, **kwargs):
        events.append(("gather", 1))
        return gather(*args, **kwargs)

    so.STEP_GROUP_BYTES, so._all_gather, so.ShardedOptimizer._step = group_bytes, counted_gather, counted_step
    try:
        out = {}
        for kind in ("ddp_ext", "one_call", "torch"):
            so.STEP_GROUP_BYTES = 2**62 if kind == "one_call" else group_bytes
            module, ddp, optimizer, scheduler = wrapped(r, "torch" if kind == "torch" else
                                                        ("sharded" if path == "sharded" else "overlapped"))
            if kind != "torch" and path == "copying":
                ddp._optimizer_overlap.storage.in_place = False
            if kind == "one_call":
                events.append(("one_call", 0))
            train_steps(r, kind, ddp, optimizer, scheduler, rank, world_size, range(r.steps))
            if kind == "ddp_ext":
                out["buckets"] = len(ddp._optimizer_overlap.plans)
                out["steady_storage"] = sum(plan.storage is not None for plan in ddp._optimizer_overlap.plans.values())
            out[kind] = {"params": {n: p.detach().clone() for n, p in module.named_parameters()},
                         "optimizer": optimizer_tensors(optimizer.state_dict())}
        out["events"] = events
        return out
    finally:
        so.STEP_GROUP_BYTES, so._all_gather, so.ShardedOptimizer._step = kept


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("group_bytes", [1, 600], ids=["one_bucket", "a_few_buckets"])
@pytest.mark.parametrize("r", RUNS, ids=lambda r: r.id)
def test_pipelined_step_stays_bitwise_torch_ddp(r, group_bytes, path):
    for rank, out in enumerate(shared_world(2).run(_job, r, group_bytes, path)):
        for kind in ("params", "optimizer"):
            what = f"rank {rank} {r.id} {path}: {kind}"
            assert_states_bitwise(out["ddp_ext"][kind], out["one_call"][kind], f"{what} vs one call for every bucket")
            if not r.clip:  # clipping sums the norm in another order than torch's (Note [Clipping sharded gradients])
                assert_states_bitwise(out["ddp_ext"][kind], out["torch"][kind], f"{what} vs torch's DDP")
        events = out["events"][:out["events"].index(("one_call", 0))]
        calls = [n for what, n in events if what == "step"]
        assert out["buckets"] > 2 and calls, (rank, out["buckets"], events)
        if group_bytes == 1:
            assert max(calls) == 1, f"rank {rank}: groups of one bucket, got {calls}"
        else:
            assert max(calls) > 1, f"rank {rank}: some group of several buckets, got {calls}"
        # Interleaved: some all-gather is launched between two group steps.
        kinds = "".join(what[0] for what, _ in events)
        assert re.search("sg+s", kinds), f"rank {rank}: the all-gathers waited for every group's step: {kinds}"
        if path == "copying":
            assert out["steady_storage"] == 0, (rank, out["steady_storage"])
        if path == "overlapped":
            assert out["steady_storage"] == out["buckets"], (rank, out["steady_storage"], out["buckets"])
