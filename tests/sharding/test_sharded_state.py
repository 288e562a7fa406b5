"""The sharded optimizer's state: optimizer.state_dict() gives the unsharded
state (gathered), which loads into torch's DDP with a plain optimizer and
continues bitwise as an unbroken run does; and the reverse. A bucket rebuild
moves the state to the new buckets' pieces. Each rank holds about 1/world_size of
the unsharded state. clip_grad_norm_ clips by the whole gradient's norm."""

import io

import pytest
import torch
from torch import nn

from tests.sharding.shard_support import optimizer_tensors, run, train_steps, wrapped
from tests.support import models
from tests.support.harness import assert_states_bitwise, assert_states_close
from tests.support.worlds import shared_world

R = run(optimizer="adam")


def _saved(module, optimizer, scheduler) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, buffer)
    return buffer.getvalue()


def _resumed(rank, world_size, saved: bytes, kind: str, load_before_line: bool = False):
    """A fresh `kind` run from `saved`, trained on steps 2 and 3."""
    checkpoint = torch.load(io.BytesIO(saved), weights_only=False)
    module = models.build(R.model, seed=123)  # other weights: the checkpoint must set them
    module.load_state_dict(checkpoint["model"])
    optimizer = __import__("tests.sharding.shard_support", fromlist=["optimizer_of"]).optimizer_of(R.optimizer, module)
    if kind == "torch":
        ddp = torch.nn.parallel.DistributedDataParallel(module, **dict(R.ddp))
    else:
        import ddp_ext

        ddp = ddp_ext.DistributedDataParallel(module, **dict(R.ddp))
    if load_before_line:
        optimizer.load_state_dict(checkpoint["optimizer"])
    if kind == "sharded":
        ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0)
    if not load_before_line:
        optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scheduler.load_state_dict(checkpoint["scheduler"])
    train_steps(R, kind, ddp, optimizer, scheduler, rank, world_size, range(2, 4))
    return module, optimizer


def _result(module, optimizer):
    return {"params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "optimizer": optimizer_tensors(optimizer.state_dict())}


def _checkpoint_job(rank, world_size, first: str, then: str, load_before_line: bool):
    module, ddp, optimizer, scheduler = wrapped(R, first)
    train_steps(R, first, ddp, optimizer, scheduler, rank, world_size, range(2))
    saved = _saved(module, optimizer, scheduler)
    resumed = _result(*_resumed(rank, world_size, saved, then, load_before_line))
    module, ddp, optimizer, scheduler = wrapped(R, "torch")
    train_steps(R, "torch", ddp, optimizer, scheduler, rank, world_size, range(4))
    return resumed, _result(module, optimizer)


@pytest.mark.parametrize("first,then,load_before_line", [("sharded", "torch", False), ("torch", "sharded", False),
                                                          ("torch", "sharded", True)])
def test_checkpoint_moves_between_sharded_and_torch_ddp(first, then, load_before_line):
    for rank, (resumed, unbroken) in enumerate(shared_world(2).run(_checkpoint_job, first, then, load_before_line)):
        for kind in ("params", "optimizer"):
            assert_states_bitwise(resumed[kind], unbroken[kind], f"rank {rank}: {first} -> {then}: {kind}")


def _state_dict_job(rank, world_size):
    """The unsharded state_dict has the keys and values of a plain optimizer's, on every rank."""
    module, ddp, optimizer, scheduler = wrapped(R, "sharded")
    train_steps(R, "sharded", ddp, optimizer, scheduler, rank, world_size, range(3))
    sharded = ddp._optimizer_overlap
    state_dict = optimizer.state_dict()
    return {"keys": {k: sorted(v) for k, v in state_dict["state"].items()},
            "held_by_optimizer": len(optimizer.state), "reshards": sharded.reshards,
            "tensors": optimizer_tensors(state_dict)}


def test_state_dict_is_unsharded_and_a_rebuild_reshards():
    results = shared_world(2).run(_state_dict_job)
    n_params = len(list(models.build(R.model).parameters()))
    for rank, r in enumerate(results):
        assert sorted(r["keys"]) == list(range(n_params)), f"rank {rank}: {sorted(r['keys'])}"
        assert all(keys == ["exp_avg", "exp_avg_sq", "step"] for keys in r["keys"].values()), r["keys"]
        assert r["held_by_optimizer"] == 0, "the user's optimizer holds no state of the sharded parameters"
        # The first iteration's bucket layout is rebuilt after it: the state was moved to the new pieces.
        assert r["reshards"] == 1, r["reshards"]
        assert_states_bitwise(r["tensors"], results[0]["tensors"], f"rank {rank} vs rank 0")


class Wide(nn.Module):
    """Few, large parameters: the state is what it is per element."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(256, 256)
        self.c = nn.Linear(256, 8)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _memory_job(rank, world_size):
    import ddp_ext

    torch.manual_seed(0)
    module = Wide()
    ddp = ddp_ext.DistributedDataParallel(module, bucket_cap_mb=0.1)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
    ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0)
    for step in range(2):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step * 10 + rank))
        ddp(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    held = ddp._optimizer_overlap.state_bytes()
    unsharded = sum(v.numel() * v.element_size() for s in optimizer.state_dict()["state"].values()
                    for v in s.values() if isinstance(v, torch.Tensor))
    return held, unsharded


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_rank_holds_its_share_of_the_state(world_size):
    results = shared_world(world_size).run(_memory_job)
    unsharded = results[0][1]
    assert sum(held for held, _ in results) >= unsharded  # every element's state is somewhere
    for rank, (held, _) in enumerate(results):
        assert held <= unsharded / world_size * 1.05, f"rank {rank}: {held} bytes of {unsharded} at {world_size} ranks"


def _clip_job(rank, world_size, max_norm):
    r = run(optimizer="adamw", clip=max_norm)
    out = {}
    for kind in ("sharded", "torch"):
        module, ddp, optimizer, scheduler = wrapped(r, kind)
        train_steps(r, kind, ddp, optimizer, scheduler, rank, world_size, range(3))
        out[kind] = {n: p.detach().clone() for n, p in module.named_parameters()}
    return out


@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_clip_grad_norm_clips_by_the_whole_norm(max_norm):
    """The norm is summed in another order than torch's (float64 sums of
    squares per shard, then across ranks): equal up to float32 rounding. A
    norm that clips nothing leaves the result bitwise."""
    results = shared_world(2).run(_clip_job, max_norm)
    for rank, r in enumerate(results):
        if max_norm > 1e5:
            assert_states_bitwise(r["sharded"], r["torch"], f"rank {rank}: nothing clipped")
        else:
            assert_states_close(r["sharded"], r["torch"], f"rank {rank}: clipped", rtol=1e-5, atol=1e-6)
        assert_states_bitwise(r["sharded"], results[0]["sharded"], f"rank {rank} vs rank 0")


class UnusedTail(nn.Module):
    """One bucket laid out as [fc's bias and weight, `spare`]: at 2 ranks,
    rank 1's half of it is `spare` alone, which no rank uses."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Parameter(torch.randn(1000))
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x)


def _clip_unused_job(rank, world_size):
    import ddp_ext

    out = {}
    for kind in ("sharded", "torch"):
        torch.manual_seed(0)
        module = UnusedTail()
        wrapper = ddp_ext.DistributedDataParallel if kind == "sharded" else torch.nn.parallel.DistributedDataParallel
        ddp = wrapper(module, find_unused_parameters=True)
        optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
        if kind == "sharded":
            ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0)
        norms = []
        for step in range(3):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step * 10 + rank))
            ddp(x).square().mean().backward()
            clip = ddp.clip_grad_norm_ if kind == "sharded" else (
                lambda n: torch.nn.utils.clip_grad_norm_(module.parameters(), n))
            norms.append(clip(0.01))
            optimizer.step()
            optimizer.zero_grad()
        out[kind] = {"params": {n: p.detach().clone() for n, p in module.named_parameters()},
                     "norms": {str(i): n for i, n in enumerate(norms)}}
    return out


def test_clip_grad_norm_on_a_rank_whose_shard_holds_only_unused_parameters():
    """That rank still joins the norm's all-reduce (no hang), and clips by the same norm."""
    results = shared_world(2).run(_clip_unused_job, timeout=90)
    for rank, r in enumerate(results):
        for what in ("params", "norms"):
            assert_states_close(r["sharded"][what], r["torch"][what], f"rank {rank}: {what}", rtol=1e-5, atol=1e-7)
        assert_states_bitwise(r["sharded"]["params"], results[0]["sharded"]["params"], f"rank {rank} vs rank 0")


def _clip_edited_on_one_rank_job(rank, world_size):
    import ddp_ext

    torch.manual_seed(0)
    module = UnusedTail()
    ddp = ddp_ext.DistributedDataParallel(module, find_unused_parameters=True)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
    ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0)
    ddp(torch.randn(8, 4)).square().mean().backward()
    if rank == 1:
        module.fc.bias.grad = None
    try:
        ddp.clip_grad_norm_(0.01)
    except RuntimeError as error:
        return str(error)
    return "nothing raised"


def test_clip_grad_norm_refuses_on_every_rank_a_gradient_changed_on_one():
    """Rank 1 set a .grad to None: rank 0 refuses too, rather than waiting in the norm's all-reduce (a hang)."""
    for rank, message in enumerate(shared_world(2).run(_clip_edited_on_one_rank_job, timeout=90)):
        assert "changed between backward() and optimizer.step()" in message, f"rank {rank}: {message}"
