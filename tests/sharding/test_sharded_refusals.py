"""What overlap_optimizer(..., shard=True) refuses: on every rank, with the
reason, and before anything is stepped (the parameters and the optimizer's
state stay as they were)."""

import dataclasses
import functools
from typing import Callable, Tuple

import pytest
import torch
from torch import nn

from tests.optimizer.overlap_support import backward, plain_wrapper, raised, snapshot, unchanged
from tests.support.worlds import shared_world


class Elementwise(torch.optim.SGD):
    ddp_ext_elementwise = True


class Custom(torch.optim.SGD):
    pass


LINE_OPTIMIZERS = {
    "lbfgs": lambda m: torch.optim.LBFGS(m.parameters()),
    "sparse_adam": lambda m: torch.optim.SparseAdam(list(m.parameters())),
    "adafactor": lambda m: torch.optim.Adafactor(m.parameters()),
    "custom": lambda m: Custom(m.parameters(), lr=0.1),
}


def _refuse_line(rank, world_size, name):
    module, ddp = plain_wrapper()
    optimizer = LINE_OPTIMIZERS[name](module)
    before = snapshot(module)
    message = raised(lambda: ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0))
    return message, unchanged(module, before) and ddp._optimizer_overlap is None


def _line(name: str) -> Callable:
    return functools.partial(_refuse_line, name=name)


def _refuse_forward_fraction(rank, world_size):
    module, ddp = plain_wrapper()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    return raised(lambda: ddp.overlap_optimizer(optimizer, overlap_forward=0.5, shard=True, shard_min_bytes=0)), True


def _refuse_hook_before(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    module, ddp = plain_wrapper()
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return raised(lambda: ddp.overlap_optimizer(torch.optim.SGD(module.parameters(), lr=0.1), shard=True, shard_min_bytes=0)), True


def _refuse_hook_after(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    module, ddp = plain_wrapper()
    ddp.overlap_optimizer(torch.optim.SGD(module.parameters(), lr=0.1), shard=True, shard_min_bytes=0)
    return raised(lambda: ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)), True


def _refuse_mixed_precision(rank, world_size):
    from torch.nn.parallel.distributed import _MixedPrecision

    module, ddp = plain_wrapper(mixed_precision=_MixedPrecision(param_dtype=torch.float64))
    return raised(lambda: ddp.overlap_optimizer(torch.optim.SGD(module.parameters(), lr=0.1), shard=True, shard_min_bytes=0)), True


def _refuse_sparse(rank, world_size):
    import ddp_ext

    module = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    ddp = ddp_ext.DistributedDataParallel(module)
    return raised(lambda: ddp.overlap_optimizer(torch.optim.SGD(module.parameters(), lr=0.1), shard=True, shard_min_bytes=0)), True


def _stepped(rank, world_size, between, step):
    """`between(ddp, module)` (a backward and more), then `step(optimizer)`:
    its error, and whether nothing was stepped. Either may be named (BETWEEN, STEPS)."""
    between = BETWEEN.get(between, between)
    step = STEPS.get(step, step)
    module, ddp = plain_wrapper()
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0)
    before = snapshot(module)
    between(ddp, module, rank, world_size)
    message = raised(lambda: step(optimizer))
    return message, unchanged(module, before) and not ddp._optimizer_overlap.state and not optimizer.state


def _backward(ddp, module, rank, world_size):
    backward(ddp, rank, world_size)


def _grad_replaced(ddp, module, rank, world_size):
    backward(ddp, rank, world_size)
    first = next(module.parameters())
    first.grad = torch.zeros_like(first)


def _no_sync_only(ddp, module, rank, world_size):
    with ddp.no_sync():
        backward(ddp, rank, world_size)


BETWEEN = {"backward": _backward, "grad_replaced": _grad_replaced, "no_sync_only": _no_sync_only}
STEPS = {"plain": lambda o: o.step(), "closure": lambda o: o.step(lambda: torch.tensor(0.0)),
         "hooked": lambda o: (o.register_step_post_hook(lambda *args: None), o.step())}


# What reads or changes a ShardGradient (Note [Gradients after a sharded backward]).
GRADIENT_OPS = {
    "torch_clip": lambda module, scaler, optimizer: torch.nn.utils.clip_grad_norm_(module.parameters(), 0.01),
    "mul_": lambda module, scaler, optimizer: next(module.parameters()).grad.mul_(2),
    "norm": lambda module, scaler, optimizer: next(module.parameters()).grad.norm(),
    "unscale_": lambda module, scaler, optimizer: scaler.unscale_(optimizer),
}


def _refuse_gradient_op(rank, world_size, op):
    """A ShardGradient refuses `op` after a (scaled) backward; the step then still works."""
    from tests.support import models

    module, ddp = plain_wrapper()
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0)
    scaler = torch.amp.GradScaler("cpu")
    before = snapshot(module)
    args, target = models.rank_batch("deep", 0, 0, rank, world_size, per_rank=4)
    scaler.scale(models.MODELS["deep"].loss(ddp(*args), target)).backward()
    message = raised(lambda: GRADIENT_OPS[op](module, scaler, optimizer))
    nothing = unchanged(module, before) and not ddp._optimizer_overlap.state
    optimizer.step()
    return message, nothing and not unchanged(module, before)


def _refuse_grad_scaler(rank, world_size):
    from tests.support import models

    scaler = torch.amp.GradScaler("cpu")

    def scaled(ddp, module, rank, world_size):
        args, target = models.rank_batch("deep", 0, 0, rank, world_size, per_rank=4)
        scaler.scale(models.MODELS["deep"].loss(ddp(*args), target)).backward()

    return _stepped(rank, world_size, scaled, scaler.step)


def _refuse_join(rank, world_size):
    module, ddp = plain_wrapper()
    ddp.overlap_optimizer(torch.optim.SGD(module.parameters(), lr=0.1), shard=True, shard_min_bytes=0)

    def joined():
        with ddp.join():
            backward(ddp, rank, world_size)
    before = snapshot(module)
    return raised(joined), unchanged(module, before)


def _refuse_second_backward(rank, world_size):
    module, ddp = plain_wrapper()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0)
    backward(ddp, rank, world_size)
    before = snapshot(module)
    return raised(lambda: backward(ddp, rank, world_size, step=1)), unchanged(module, before)


@dataclasses.dataclass(frozen=True)
class Refusal:
    name: str
    job: Callable
    expected: Tuple[str, ...]


REFUSALS = [
    Refusal("lbfgs", _line("lbfgs"), ("cannot shard LBFGS", "line search")),
    Refusal("sparse_adam", _line("sparse_adam"),
            ("cannot shard SparseAdam", "sparse")),
    Refusal("adafactor", _line("adafactor"),
            ("cannot shard Adafactor", "rows' and columns'")),
    Refusal("custom", _line("custom"),
            ("cannot shard Custom", "ddp_ext_elementwise = True")),
    Refusal("forward_fraction", _refuse_forward_fraction, ("takes overlap_forward=True or False", "0.5")),
    Refusal("hook_before", _refuse_hook_before, ("with a communication hook registered", "fp16_compress_hook")),
    Refusal("hook_after", _refuse_hook_after, ("",)),
    Refusal("mixed_precision", _refuse_mixed_precision, ("does not support mixed_precision",)),
    Refusal("sparse_gradients", _refuse_sparse, ("cannot shard sparse gradients", "0 set sparse=True")),
    Refusal("grad_replaced", functools.partial(_stepped, between="grad_replaced", step="plain"),
            ("changed between backward() and optimizer.step()", "ddp.clip_grad_norm_", "Nothing was stepped")),
    Refusal("no_sync_only", functools.partial(_stepped, between="no_sync_only", step="plain"),
            ("no synchronising backward since the last optimizer.step()", "Nothing was stepped")),
    Refusal("closure", functools.partial(_stepped, between="backward", step="closure"),
            ("without a closure",)),
    Refusal("step_hook", functools.partial(_stepped, between="backward", step="hooked"),
            ("step post-hooks registered", "steps this rank's shard in a pre-hook of its own")),
    Refusal("grad_scaler", _refuse_grad_scaler, ("holds only this rank's shard", "ddp.clip_grad_norm_")),
    Refusal("join", _refuse_join, ("cannot join uneven inputs with overlap_optimizer(..., shard=True)",)),
    Refusal("second_backward", _refuse_second_backward, ("holds only this rank's shard",
                                                         "optimizer.zero_grad() before the next backward")),
]
REFUSALS += [Refusal(f"gradient_{op}", functools.partial(_refuse_gradient_op, op=op),
                     ("holds only this rank's shard", "ddp.clip_grad_norm_")) for op in GRADIENT_OPS]


@pytest.mark.parametrize("r", REFUSALS, ids=lambda r: r.name)
def test_refused_on_every_rank_before_anything_is_stepped(r):
    for rank, (message, nothing_stepped) in enumerate(shared_world(2).run(r.job)):
        assert message != "nothing raised", f"rank {rank}: {r.name}: nothing raised"
        for fragment in r.expected:
            assert fragment in message, f"rank {rank}: {fragment!r} not in {message!r}"
        assert nothing_stepped, f"rank {rank}: {r.name}: something was stepped or installed"


def _elementwise_admitted(rank, world_size):
    module, ddp = plain_wrapper()
    optimizer = Elementwise(module.parameters(), lr=0.1)
    ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0)
    before = snapshot(module)
    backward(ddp, rank, world_size)
    optimizer.step()
    return unchanged(module, before)


def test_an_optimizer_that_declares_itself_elementwise_is_sharded():
    assert shared_world(2).run(_elementwise_admitted) == [False, False]


def test_a_wrapper_refusing_backward_steps_refuses_sharding(single_process_group):
    """ddp_ext.fault_tolerance's replicas apply the steps themselves."""
    module, ddp = plain_wrapper()
    ddp._refuse_backward_steps("the caller steps")
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"\(overlap_optimizer\(shard=True\)\): the caller steps"):
        ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0)
    assert ddp._optimizer_overlap is None and not ddp._comm_hooks


def _refuse_strided_on_one_rank(rank, world_size):
    module, ddp = plain_wrapper()
    if rank == 1:  # after wrapping: the construction's check of strides across ranks has passed
        weight = next(p for p in module.parameters() if p.dim() == 2)
        weight.data = weight.data.t().contiguous().t()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    message = raised(lambda: ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0))
    return message, ddp._optimizer_overlap is None


def test_a_refusal_on_one_rank_is_a_refusal_on_every_rank():
    """Rank 1 refuses a non-contiguous parameter: rank 0 refuses too, rather than waiting in the
    agreement on shard_min_bytes (a hang)."""
    for rank, (message, installed_none) in enumerate(shared_world(2).run(_refuse_strided_on_one_rank, timeout=90)):
        assert message.startswith("ValueError"), f"rank {rank}: {message}"
        assert "non-contiguous parameters" in message or "another rank" in message, f"rank {rank}: {message}"
        assert installed_none, f"rank {rank}: installed"


def _refuse_step_hook_on_one_rank(rank, world_size):
    module, ddp = plain_wrapper()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    if rank == 1:
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: None)
    message = raised(lambda: ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0))
    return message, ddp._optimizer_overlap is None


def test_a_step_hook_on_one_rank_is_refused_at_the_line_on_every_rank():
    """Rank 1's optimizer has a step pre-hook: it refuses with the sharded step's reason, and rank 0
    refuses too instead of going on to shard alone."""
    (first, none_first), (second, none_second) = shared_world(2).run(_refuse_step_hook_on_one_rank, timeout=90)
    assert "was refused on another rank" in first, first
    assert "step pre-hooks registered" in second and "steps this rank's shard" in second, second
    assert none_first and none_second
