"""overlap_optimizer(..., shard=True, shard_min_bytes=B): the buckets of fewer
than B bytes are allreduced and stepped whole on every rank, their state
replicated, with no all-gather; the larger ones are sharded. In real runs
over Gloo with both kinds of buckets: parameters and the gathered optimizer
state are bitwise torch's DDP's with a plain optimizer at 2 and 3 ranks (SGD
with momentum, Adam; no_sync, find_unused_parameters, the all-gathers behind
the next forward); clipping gives the bits it gives with every bucket sharded;
the gathered checkpoint goes to torch's DDP and back, and the sharded (DCP)
one loads with another shard_min_bytes or world size; a bad value is refused
on every rank."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.sharding.shard_support import optimizer_of, optimizer_tensors, run, train_steps, wrapped
from tests.support import models
from tests.support.harness import assert_states_bitwise, assert_states_close
from tests.support.worlds import shared_world

# conv's buckets (SMALL_BUCKETS): 16 and 304 bytes replicated below 400, 444 and 576 sharded;
# branches': 108 and 128 bytes replicated below 150, 192 sharded.
CONV = dict(model="conv", shard_min_bytes=400)
BRANCHES = dict(model="branches", shard_min_bytes=150, ddp=dict(find_unused_parameters=True))

RUNS = [
    run(optimizer="adam", steps=5, **CONV),
    run(optimizer="sgd", steps=5, **CONV),
    run(optimizer="sgd", micro_batches=3, **CONV),  # no_sync
    run(optimizer="adam", lr_after_backward=True, between_steps=True, **CONV),
    run(optimizer="adam", **BRANCHES),
    run(optimizer="sgd", micro_batches=2, **BRANCHES),
]


def _state(module, optimizer):
    return {"params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "optimizer": optimizer_tensors(optimizer.state_dict())}


def _trained(rank, world_size, r, kind):
    module, ddp, optimizer, scheduler = wrapped(r, kind)
    train_steps(r, kind, ddp, optimizer, scheduler, rank, world_size, range(r.steps))
    out = _state(module, optimizer)
    if kind != "torch":
        plans = ddp._optimizer_overlap.plans.values()
        out["kinds"] = sorted({plan.replicated for plan in plans})
        out["state_bytes"] = ddp._optimizer_overlap.state_bytes()
    return out


def _job(rank, world_size, r, kind):
    return {"ours": _trained(rank, world_size, r, kind), "torch": _trained(rank, world_size, r, "torch")}


def _check(results, r):
    for rank, result in enumerate(results):
        assert result["ours"]["kinds"] == [False, True], f"rank {rank} {r.id}: not both kinds of buckets"
        for kind in ("params", "optimizer"):
            assert_states_bitwise(result["ours"][kind], result["torch"][kind], f"rank {rank} {r.id}: {kind}")


@pytest.mark.parametrize("r", RUNS, ids=lambda r: r.id)
def test_bitwise_torch_ddp_at_2_ranks(r):
    _check(shared_world(2).run(_job, r, "sharded"), r)


@pytest.mark.parametrize("r", [RUNS[0], RUNS[2], RUNS[4]], ids=lambda r: r.id)
def test_bitwise_torch_ddp_at_3_ranks(r):
    _check(shared_world(3).run(_job, r, "sharded"), r)


def test_bitwise_with_the_all_gathers_behind_the_next_forward():
    r = RUNS[0]
    _check(shared_world(2).run(_job, r, "overlapped"), r)


def _replicated_and_sharded_job(rank, world_size, r):
    every = run(**{**_fields(r), "shard_min_bytes": 0})
    return {"ours": _trained(rank, world_size, r, "sharded"), "sharded": _trained(rank, world_size, every, "sharded"),
            "torch": _trained(rank, world_size, r, "torch")}


def _fields(r):
    return {"model": r.model, "optimizer": r.optimizer, "steps": r.steps, "micro_batches": r.micro_batches,
            "ddp": dict(r.ddp), "clip": r.clip, "shard_min_bytes": r.shard_min_bytes}


@pytest.mark.parametrize("world_size", [2, 3])
def test_clipping_counts_a_replicated_bucket_once(world_size):
    """The norm sums each rank's sharded range of a replicated bucket: the
    bits of the all-sharded run; torch's up to the order of the sum."""
    r = run(optimizer="adam", clip=0.05, steps=4, **CONV)
    for rank, result in enumerate(shared_world(world_size).run(_replicated_and_sharded_job, r)):
        assert result["ours"]["kinds"] == [False, True]
        for kind in ("params", "optimizer"):
            assert_states_bitwise(result["ours"][kind], result["sharded"][kind], f"rank {rank}: {kind}")
            assert_states_close(result["ours"][kind], result["torch"][kind], f"rank {rank}: {kind}")


def test_state_memory_is_whole_for_replicated_buckets_only():
    """The replicated buckets' state is whole on every rank; the sharded ones' is cut."""
    r = run(optimizer="adam", **CONV)
    for rank, result in enumerate(shared_world(2).run(_replicated_and_sharded_job, r)):
        whole = sum(v.numel() * v.element_size() for k, v in result["torch"]["optimizer"].items()
                    if v.dim() > 0)
        # Adam's two states of 4 + 76 replicated elements, and a half of the rest (up to padding).
        replicated = 2 * 4 * (4 + 76)
        assert result["ours"]["state_bytes"] <= replicated + (whole - replicated) // 2 + 2 * 4 * 8 * 2
        assert result["sharded"]["state_bytes"] < result["ours"]["state_bytes"] < whole


# --- checkpoints ------------------------------------------------------------------

R = run(optimizer="adam", **CONV)


def _saved_from(rank, world_size, folder: str, shard_min_bytes: int):
    """Two steps sharded with `shard_min_bytes`, then the DCP form and the gathered one."""
    r = run(**{**_fields(R), "shard_min_bytes": shard_min_bytes})
    module, ddp, optimizer, scheduler = wrapped(r, "sharded")
    train_steps(r, "sharded", ddp, optimizer, scheduler, rank, world_size, range(2))
    dcp.save({"model": module.state_dict(), "optimizer": ddp.sharded_optimizer_state_dict()},
             checkpoint_id=os.path.join(folder, f"dcp{shard_min_bytes}"))
    gathered = optimizer.state_dict()  # a collective: every rank
    if rank == 0:
        torch.save({"model": module.state_dict(), "optimizer": gathered, "scheduler": scheduler.state_dict()},
                   os.path.join(folder, f"plain{shard_min_bytes}.pt"))
    dist.barrier()


def _save_job(rank, world_size, folder: str):
    _saved_from(rank, world_size, folder, R.shard_min_bytes)
    _saved_from(rank, world_size, folder, 0)


def _resumed(rank, world_size, folder: str, kind: str, saved_with: int, shard_min_bytes: int = 0):
    """Steps 2 and 3 from the checkpoint saved with `saved_with`: kind 'torch' reads the gathered form
    into torch's DDP, 'gathered' into ours with `shard_min_bytes`, 'dcp' the DCP form into ours."""
    plain = torch.load(os.path.join(folder, f"plain{saved_with}.pt"), weights_only=False)
    module = models.build(R.model, seed=123)  # other weights: the checkpoint must set them
    optimizer = optimizer_of(R.optimizer, module)
    cap = dict(R.ddp)["bucket_cap_mb"]
    if kind == "torch":
        module.load_state_dict(plain["model"])
        ddp = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=cap)
        optimizer.load_state_dict(plain["optimizer"])
    else:
        import ddp_ext

        module.load_state_dict(plain["model"])
        ddp = ddp_ext.DistributedDataParallel(module, bucket_cap_mb=cap)
        ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=shard_min_bytes)
        if kind == "gathered":
            optimizer.load_state_dict(plain["optimizer"])
        else:
            ddp.load_sharded_optimizer_state_dict(os.path.join(folder, f"dcp{saved_with}"), key="optimizer")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scheduler.load_state_dict(plain["scheduler"])
    train_steps(R, "torch" if kind == "torch" else "sharded", ddp, optimizer, scheduler, rank, world_size, range(2, 4))
    return _state(module, optimizer)


def _unbroken(rank, world_size):
    module, ddp, optimizer, scheduler = wrapped(R, "torch")
    train_steps(R, "torch", ddp, optimizer, scheduler, rank, world_size, range(4))
    return _state(module, optimizer)


def _round_trips_job(rank, world_size, folder: str):
    threshold = R.shard_min_bytes
    return {
        "unbroken": _unbroken(rank, world_size),
        # ours (replicated buckets) -> torch's DDP, and torch's -> ours: the gathered form is torch's
        "to_torch": _resumed(rank, world_size, folder, "torch", threshold),
        "from_torch": _resumed(rank, world_size, folder, "gathered", threshold, threshold),
        # the DCP form read with the other shard_min_bytes
        "dcp_replicated_to_sharded": _resumed(rank, world_size, folder, "dcp", threshold, 0),
        "dcp_sharded_to_replicated": _resumed(rank, world_size, folder, "dcp", 0, threshold),
    }


def _other_world_job(rank, world_size, folder: str):
    return {"dcp": _resumed(rank, world_size, folder, "dcp", R.shard_min_bytes, R.shard_min_bytes),
            "torch": _resumed(rank, world_size, folder, "torch", R.shard_min_bytes)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("replicated_checkpoint"))
    shared_world(2).run(_save_job, folder)
    return folder


def test_checkpoints_round_trip_bitwise(saved):
    for rank, result in enumerate(shared_world(2).run(_round_trips_job, saved)):
        for name in ("to_torch", "from_torch", "dcp_replicated_to_sharded", "dcp_sharded_to_replicated"):
            for kind in ("params", "optimizer"):
                assert_states_bitwise(result[name][kind], result["unbroken"][kind], f"rank {rank} {name}: {kind}")


def test_dcp_checkpoint_loads_at_another_world_size(saved):
    for rank, result in enumerate(shared_world(3).run(_other_world_job, saved)):
        for kind in ("params", "optimizer"):
            assert_states_bitwise(result["dcp"][kind], result["torch"][kind], f"rank {rank}: read at 3 ranks: {kind}")


# --- refusals ---------------------------------------------------------------------


def _refusal_job(rank, world_size, values):
    import ddp_ext

    module = models.build("conv", models.MODEL_SEED)
    ddp = ddp_ext.DistributedDataParallel(module)
    try:
        ddp.overlap_optimizer(torch.optim.SGD(module.parameters(), lr=0.1), shard=True,
                              shard_min_bytes=values[rank])
    except ValueError as error:
        return str(error)
    return ""


@pytest.mark.parametrize("value", [-1, 2.5, True, "64k"])
def test_a_bad_value_is_refused_on_every_rank(value):
    for rank, message in enumerate(shared_world(2).run(_refusal_job, [value, value])):
        assert f"takes shard_min_bytes as a number of bytes >= 0 (got {value!r})" in message, f"rank {rank}: {message}"


def test_values_differing_between_ranks_are_refused_on_every_rank():
    messages = shared_world(2).run(_refusal_job, [0, 1024])
    for rank, message in enumerate(messages):
        assert "not on every rank" in message and "Pass the same value on every rank" in message, message
    messages = shared_world(2).run(_refusal_job, [-1, 1024])  # one refused here: the other refuses too
    assert "takes shard_min_bytes" in messages[0] and "not on every rank" in messages[1], messages
