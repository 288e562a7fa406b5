"""The sharded optimizer's checkpoint form for torch.distributed.checkpoint
(DCP): ddp.sharded_optimizer_state_dict() saved with dcp.save at 2 ranks
(each rank writes its own ranges), read back in a new run with
ddp.load_sharded_optimizer_state_dict(), continues bitwise as the unbroken
run does (which is torch's DDP with a plain optimizer, at 2 ranks). Read at
3 ranks, or with other buckets (1 MiB), the same checkpoint continues as torch's DDP
does from the gathered optimizer.state_dict() saved at the same step. A
checkpoint of another model is refused at the first step, on every rank,
before stepping; so is optimizer.state_dict() before that step. A rank whose
range of a bucket holds no state (unused parameters only) still saves its
range of the bucket's DTensors, and the run resumes bitwise."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.sharding.shard_support import SMALL_BUCKETS, optimizer_of, optimizer_tensors, run, train_steps, wrapped
from tests.support import models
from tests.support.harness import assert_states_bitwise, assert_states_close
from tests.support.worlds import shared_world

R = run(optimizer="adam")


def _save_job(rank, world_size, folder: str):
    """Two sharded steps, then both forms: the sharded one with DCP, the gathered one with torch.save."""
    module, ddp, optimizer, scheduler = wrapped(R, "sharded")
    train_steps(R, "sharded", ddp, optimizer, scheduler, rank, world_size, range(2))
    sharded = ddp.sharded_optimizer_state_dict()
    own = [v for k, v in sharded.items() if k.startswith("bucket.")]
    dcp.save({"model": module.state_dict(), "optimizer": sharded}, checkpoint_id=os.path.join(folder, "dcp"))
    gathered = optimizer.state_dict()  # a collective: every rank
    if rank == 0:
        torch.save({"model": module.state_dict(), "optimizer": gathered, "scheduler": scheduler.state_dict()},
                   os.path.join(folder, "plain.pt"))
    dist.barrier()
    whole = sum(v.numel() for state in gathered["state"].values() for v in state.values() if v.dim() > 0)
    return {"local": sum(v.to_local().numel() for v in own), "global": sum(v.numel() for v in own), "whole": whole}


def _resumed(rank, world_size, folder: str, kind: str, bucket_cap_mb: float = SMALL_BUCKETS):
    """A fresh run from the checkpoint, trained on steps 2 and 3: `kind` 'sharded' reads the DCP form,
    'torch' (torch's DDP, a plain optimizer) the gathered one."""
    plain = torch.load(os.path.join(folder, "plain.pt"), weights_only=False)
    module = models.build(R.model, seed=123)  # other weights: the checkpoint must set them
    optimizer = optimizer_of(R.optimizer, module)
    if kind == "torch":
        module.load_state_dict(plain["model"])
        ddp = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
        optimizer.load_state_dict(plain["optimizer"])
    else:
        import ddp_ext

        state = {"model": module.state_dict()}
        dcp.load(state, checkpoint_id=os.path.join(folder, "dcp"))
        ddp = ddp_ext.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
        ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0)
        ddp.load_sharded_optimizer_state_dict(os.path.join(folder, "dcp"), key="optimizer")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scheduler.load_state_dict(plain["scheduler"])
    train_steps(R, kind, ddp, optimizer, scheduler, rank, world_size, range(2, 4))
    return {"params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "optimizer": optimizer_tensors(optimizer.state_dict())}


def _unbroken_job(rank, world_size, folder: str):
    resumed = _resumed(rank, world_size, folder, "sharded")
    module, ddp, optimizer, scheduler = wrapped(R, "torch")
    train_steps(R, "torch", ddp, optimizer, scheduler, rank, world_size, range(4))
    return resumed, {"params": {n: p.detach().clone() for n, p in module.named_parameters()},
                     "optimizer": optimizer_tensors(optimizer.state_dict())}


def _other_world_job(rank, world_size, folder: str):
    return _resumed(rank, world_size, folder, "sharded"), _resumed(rank, world_size, folder, "torch")


def _other_buckets_job(rank, world_size, folder: str):
    return (_resumed(rank, world_size, folder, "sharded", bucket_cap_mb=1.0),
            _resumed(rank, world_size, folder, "torch", bucket_cap_mb=1.0))


class _Outer(torch.nn.Module):
    """The saved model inside another: its parameters' names differ."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return self.inner(*args)


def _refusals_job(rank, world_size, folder: str):
    import ddp_ext

    module = _Outer(models.build(R.model, seed=123))
    optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
    optimizer.add_param_group({"params": []})  # the saved run's two groups
    ddp = ddp_ext.DistributedDataParallel(module, bucket_cap_mb=SMALL_BUCKETS)
    ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0)
    ddp.load_sharded_optimizer_state_dict(os.path.join(folder, "dcp"), key="optimizer")
    messages = {}
    try:
        optimizer.state_dict()
    except RuntimeError as error:
        messages["state_dict"] = str(error)
    before = [p.detach().clone() for p in module.parameters()]
    args, target = models.rank_batch(R.model, 0, 0, rank, world_size, per_rank=4)
    models.MODELS[R.model].loss(ddp(*args), target).backward()
    try:
        optimizer.step()
    except RuntimeError as error:
        messages["step"] = str(error)
    ddp.finish_forward_tail()
    messages["stepped"] = any(not torch.equal(a, p) for a, p in zip(before, module.parameters()))
    return messages


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("sharded_checkpoint"))
    return folder, shared_world(2).run(_save_job, folder)


def test_each_rank_saves_its_range_only(saved):
    _, sizes = saved
    for rank, size in enumerate(sizes):
        assert size["global"] == size["whole"], size  # the buckets' elements: the whole state
        assert 0 < size["local"] <= size["global"] // 2 + 2 * 8, f"rank {rank}: {size}"  # half, up to padding
    assert sum(s["local"] for s in sizes) == sizes[0]["global"]


def test_dcp_checkpoint_continues_bitwise_as_the_unbroken_run(saved):
    folder, _ = saved
    for rank, (resumed, unbroken) in enumerate(shared_world(2).run(_unbroken_job, folder)):
        for kind in ("params", "optimizer"):
            assert_states_bitwise(resumed[kind], unbroken[kind], f"rank {rank}: sharded DCP resume: {kind}")


def test_dcp_checkpoint_loads_at_another_world_size(saved):
    folder, _ = saved
    for rank, (sharded, plain) in enumerate(shared_world(3).run(_other_world_job, folder)):
        # At 3 ranks the reduce-scatter may add in another order than torch's
        # allreduce (Note [Exact sharded steps]): equal up to rounding.
        for kind in ("params", "optimizer"):
            assert_states_close(sharded[kind], plain[kind], f"rank {rank}: read at 3 ranks: {kind}")


def test_dcp_checkpoint_loads_with_other_buckets(saved):
    folder, _ = saved
    for rank, (sharded, plain) in enumerate(shared_world(2).run(_other_buckets_job, folder)):
        for kind in ("params", "optimizer"):
            assert_states_bitwise(sharded[kind], plain[kind], f"rank {rank}: read with 1 MiB buckets: {kind}")


def test_another_models_checkpoint_is_refused_before_stepping(saved):
    folder, _ = saved
    for rank, messages in enumerate(shared_world(2).run(_refusals_job, folder)):
        assert "before the next optimizer.step()" in messages.get("state_dict", ""), messages
        step = messages.get("step", "")
        assert "cannot place the saved state of 'inner.layers" in step and "not in the checkpoint" in step, messages
        assert "Nothing was stepped" in step and messages["stepped"] is False, f"rank {rank}: {messages}"


class _Saved(torch.nn.Module):
    """One bucket laid out as [fc's bias and weight, `spare`] (reversed registration)."""

    def __init__(self):
        super().__init__()
        self.spare = torch.nn.Parameter(torch.randn(1000))
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x) + self.spare.sum()


class _Grown(torch.nn.Module):
    """The saved model and `extra`, registered first: last in the bucket, so at 2 ranks in rank 1's range only."""

    def __init__(self):
        super().__init__()
        self.extra = torch.nn.Parameter(torch.randn(10))
        self.spare = torch.nn.Parameter(torch.randn(1000))
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x) + self.spare.sum() + self.extra.sum()


def _missing_on_one_rank_job(rank, world_size, folder: str):
    import ddp_ext

    messages = {}
    for kind in ("saved", "grown"):
        torch.manual_seed(0)
        module = _Saved() if kind == "saved" else _Grown()
        ddp = ddp_ext.DistributedDataParallel(module)
        optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
        ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0)
        if kind == "grown":
            ddp.load_sharded_optimizer_state_dict(os.path.join(folder, "missing"), key="optimizer")
        ddp(torch.randn(8, 4)).square().mean().backward()
        try:
            optimizer.step()
        except RuntimeError as error:
            messages[kind] = str(error)
        if kind == "saved":
            dcp.save({"optimizer": ddp.sharded_optimizer_state_dict()}, checkpoint_id=os.path.join(folder, "missing"))
        dist.barrier()
    return messages


def test_a_parameter_missing_from_the_checkpoint_in_one_ranks_range_is_refused_on_every_rank(tmp_path):
    """`extra` lies in rank 1's range only: rank 0 refuses too, rather than waiting in DCP's load (a hang)."""
    for rank, messages in enumerate(shared_world(2).run(_missing_on_one_rank_job, str(tmp_path), timeout=90)):
        assert "saved" not in messages, messages
        assert "cannot place the saved state of 'extra'" in messages.get("grown", ""), f"rank {rank}: {messages}"


class _UnusedSpare(_Saved):
    """_Saved's bucket, `spare` unused: at 2 ranks rank 1's range is `spare` alone, with no state."""

    def forward(self, x):
        return self.fc(x)


def _unused_range_job(rank, world_size, folder: str):
    """Two steps, a DCP save and a resume from it in a fresh wrapper, two more steps; and torch's DDP's 4 steps."""
    import ddp_ext

    def steps(ddp, optimizer, numbers):
        for step in numbers:
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step * 10 + rank))
            ddp(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    out = {}
    for kind in ("saved", "resumed", "torch"):
        torch.manual_seed(0 if kind != "resumed" else 1)  # the resumed run takes the saved run's weights
        module = _UnusedSpare()
        if kind == "resumed":
            module.load_state_dict(weights)
        wrapper = torch.nn.parallel.DistributedDataParallel if kind == "torch" else ddp_ext.DistributedDataParallel
        ddp = wrapper(module, find_unused_parameters=True)
        optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
        if kind != "torch":
            ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0)
        if kind == "resumed":
            ddp.load_sharded_optimizer_state_dict(os.path.join(folder, "unused"), key="optimizer")
        steps(ddp, optimizer, range(2) if kind == "saved" else range(2, 4) if kind == "resumed" else range(4))
        if kind == "saved":
            dcp.save({"optimizer": ddp.sharded_optimizer_state_dict()}, checkpoint_id=os.path.join(folder, "unused"))
            weights = {n: t.detach().clone() for n, t in module.state_dict().items()}
        else:
            out[kind] = {"params": {n: p.detach().clone() for n, p in module.named_parameters()},
                         "optimizer": optimizer_tensors(optimizer.state_dict())}
    return out


def test_a_range_holding_no_state_saves_and_resumes_bitwise(tmp_path):
    """Rank 1's range of the bucket holds no state (only the unused `spare`): the ranks still agree on the
    bucket's DTensors (else DCP refuses the save), and the resumed run continues as torch's DDP does."""
    for rank, r in enumerate(shared_world(2).run(_unused_range_job, str(tmp_path), timeout=90)):
        assert "spare" not in str(sorted(r["resumed"]["optimizer"])) and "0.exp_avg" not in r["resumed"]["optimizer"]
        for what in ("params", "optimizer"):
            assert_states_bitwise(r["resumed"][what], r["torch"][what], f"rank {rank}: {what}")
