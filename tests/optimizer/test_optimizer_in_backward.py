"""Optimizers applied in backward (torch.distributed.optim._apply_optimizer_in_backward)
under ddp_ext's DDP: each parameter's own optimizers step once per
synchronising backward, on the averaged gradient, and its .grad is None
after the backward (Note [Optimizers applied in backward] in
ddp_ext/_backward_steps.py).

torch's DDP cannot be the reference here on a machine without an
accelerator: its hook for them asks for the accelerator's current stream at
the end of the backward, which raises. The reference is what that hook
computes, written out: the same per-parameter optimizers stepped after a
plain backward, with zeros for a gradient no rank produced, then .grad set
to None; run over torch's DDP (bitwise at 2 ranks, up to rounding at 3, as
tests/wrapper/test_parity_torch_ddp.py says of ddp_ext itself) and over
ddp_ext's (bitwise at every world size).
"""

import contextlib
import dataclasses
from typing import Any, Dict, Tuple

import pytest
import torch

from tests.optimizer.overlap_support import raised
from tests.support import models, reference
from tests.support.harness import CaseTable, assert_states_bitwise, assert_states_close

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw_foreach": (torch.optim.AdamW, {"lr": 0.01, "foreach": True}),
}


@dataclasses.dataclass(frozen=True)
class Run:
    model: str
    optimizer: str
    micro_batches: int = 1
    ddp: Tuple[Tuple[str, Any], ...] = (("bucket_cap_mb", 0.0001),)
    steps: int = 4

    @property
    def id(self):
        extra = [f"{k}={v}" for k, v in self.ddp if k != "bucket_cap_mb"]
        return "-".join([self.model, self.optimizer, *extra] + ([f"micro{self.micro_batches}"]
                                                                 if self.micro_batches > 1 else []))


RUNS = [
    Run("deep", "sgd"),
    Run("deep", "adam"),
    Run("mlp", "adamw_foreach", micro_batches=2),
    Run("branches", "sgd", ddp=(("bucket_cap_mb", 0.0001), ("find_unused_parameters", True))),
]


def _train(rank, world_size, c: Run, wrapper: str, in_backward: bool) -> Dict[str, Any]:
    from torch.distributed.optim import _apply_optimizer_in_backward

    spec = models.MODELS[c.model]
    module = models.build(c.model)
    trained = [p for p in module.parameters() if p.requires_grad]
    cls, kwargs = OPTIMIZERS[c.optimizer]
    if in_backward:
        _apply_optimizer_in_backward(cls, trained, kwargs)
        optimizers = [o for p in trained for o in p._in_backward_optimizers]
    else:
        optimizers = [cls([p], **kwargs) for p in trained]
    ddp = (reference.torch_ddp if wrapper == "torch" else reference.ext_ddp)(module, **dict(c.ddp))
    grads_none_after_backward = []
    for step in range(c.steps):
        for micro in range(c.micro_batches):
            args, target = models.rank_batch(c.model, step, micro, rank, world_size, per_rank=4)
            last = micro == c.micro_batches - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                spec.loss(ddp(*args), target).backward()
        grads_none_after_backward.append(all(p.grad is None for p in trained))
        if not in_backward:
            # What torch's hook for optimizers in backward does, after the backward.
            for p, optimizer in zip(trained, optimizers):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                optimizer.step()
                p.grad = None
    state = {}
    for number, optimizer in enumerate(optimizers):
        for key, value in optimizer.state_dict()["state"].get(0, {}).items():
            state[f"{number}.{key}"] = value.clone() if torch.is_tensor(value) else torch.tensor(value)
    params, _ = reference.state_tensors(module)
    return dict(params=params, state=state, grads_none=grads_none_after_backward)


def _three(rank, world_size, c):
    return {
        "in_backward": _train(rank, world_size, c, "ext", in_backward=True),
        "ext": _train(rank, world_size, c, "ext", in_backward=False),
        "torch": _train(rank, world_size, c, "torch", in_backward=False),
    }


TABLE = CaseTable(_three, RUNS)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("c", RUNS, ids=lambda c: c.id)
def test_optimizers_in_backward_step_like_the_hook(c, world_size):
    for rank, r in enumerate(TABLE.results(world_size, c)):
        what = f"{c.id}, rank {rank} of {world_size}"
        assert all(r["in_backward"]["grads_none"]), f"{what}: .grad not None after backward: {r['in_backward']}"
        for kind in ("params", "state"):
            assert_states_bitwise(r["in_backward"][kind], r["ext"][kind], f"{what}: {kind} vs ddp_ext, stepped after")
            if world_size == 2:
                assert_states_bitwise(r["in_backward"][kind], r["torch"][kind], f"{what}: {kind} vs torch DDP")
            else:
                assert_states_close(r["in_backward"][kind], r["torch"][kind], f"{what}: {kind} vs torch DDP")
        # The parameters moved: the optimizers did step.
        start = dict(models.build(c.model).named_parameters())
        moved = [n for n, t in r["in_backward"]["params"].items() if start[n].requires_grad
                 and not torch.equal(t, start[n].detach())]
        assert moved, f"{what}: no parameter moved"


# --- refusals --------------------------------------------------------------------


def _forward(ddp, rank, world_size):
    args, target = models.rank_batch("deep", 0, 0, rank, world_size, per_rank=4)
    return models.MODELS["deep"].loss(ddp(*args), target)


def _refusal(rank, world_size, name):  # name: a Refusal
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.optim import _apply_optimizer_in_backward

    module = models.build("deep")
    if name.id == "overlap_first":
        ddp = reference.ext_ddp(module)
        ddp.overlap_optimizer(torch.optim.SGD(module.parameters(), lr=0.1))
        _apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": 0.1})
        return raised(lambda: _forward(ddp, rank, world_size))
    _apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": 0.1})
    ddp = reference.ext_ddp(module)
    if name.id == "overlap_optimizer":
        return raised(lambda: ddp.overlap_optimizer(torch.optim.SGD(module.parameters(), lr=0.1)))
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    return raised(lambda: _forward(ddp, rank, world_size))


@dataclasses.dataclass(frozen=True)
class Refusal:
    id: str
    expected: Tuple[str, ...]


REFUSALS = [
    Refusal("overlap_optimizer", ("RuntimeError", "on rank {rank}", "cannot be used with optimizers applied in "
                                  "backward")),
    Refusal("overlap_first", ("RuntimeError", "on rank {rank}", "cannot apply optimizers in backward",
                              "and overlap_optimizer together")),
    Refusal("comm_hook", ("RuntimeError", "on rank {rank}", "cannot apply optimizers in backward",
                          "communication hook registered (allreduce_hook)")),
]
REFUSAL_TABLE = CaseTable(_refusal, REFUSALS)


@pytest.mark.parametrize("r", REFUSALS, ids=lambda r: r.id)
def test_refusals(r):
    for rank, message in enumerate(REFUSAL_TABLE.results(2, r)):
        for fragment in r.expected:
            assert fragment.format(rank=rank) in message, f"rank {rank}: {fragment!r} not in {message!r}"
