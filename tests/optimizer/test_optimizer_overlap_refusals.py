"""overlap_optimizer refuses what it cannot do exactly, on every rank, with
nothing applied (or says what was): real 2-rank runs over Gloo."""

import dataclasses
from typing import Any, Tuple

import pytest
import torch

from tests.optimizer.overlap_support import backward, plain_wrapper, raised, snapshot, unchanged
from tests.support import models
from tests.support.harness import CaseTable


def _refuse_foreign(rank, world_size):
    module, ddp = plain_wrapper()
    other = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(list(module.parameters()) + list(other.parameters()), lr=0.1)
    return raised(lambda: ddp.overlap_optimizer(optimizer)), optimizer.step.__func__ is type(optimizer).step


def _refuse_ignored(rank, world_size):
    import ddp_ext

    module = models.build("deep")
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ["layers.3.bias"])
    ddp = ddp_ext.DistributedDataParallel(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    return raised(lambda: ddp.overlap_optimizer(optimizer)), ddp._optimizer_overlap is None


def _refuse_hook_before(rank, world_size):
    module, ddp = plain_wrapper()
    ddp._register_fused_optim(torch.optim.SGD, lr=0.1)  # a hook that steps each bucket itself
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    return raised(lambda: ddp.overlap_optimizer(optimizer)), None


def _refuse_hook_after(rank, world_size):
    module, ddp = plain_wrapper()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    ddp.overlap_optimizer(optimizer)
    message = raised(lambda: ddp._register_fused_optim(torch.optim.SGD, lr=0.1))
    # Refused at registration: the next backward is overlapped as before.
    for step in range(2):
        backward(ddp, rank, world_size, step)
        optimizer.step()
        optimizer.zero_grad()
    backward(ddp, rank, world_size, 2)
    return message, not ddp._comm_hooks and len(ddp._optimizer_overlap.stepped) == len(snapshot(module))


def _refuse_step_hook_before(rank, world_size):
    module, ddp = plain_wrapper()
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    optimizer.register_step_post_hook(lambda opt, args, kwargs: None)
    return raised(lambda: ddp.overlap_optimizer(optimizer)), None


def _refuse_step_hook_after(rank, world_size):
    module, ddp = plain_wrapper()
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    ddp.overlap_optimizer(optimizer)
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: None)
    before = snapshot(module)
    message = raised(lambda: backward(ddp, rank, world_size))
    return message, unchanged(module, before) and not optimizer.state


def _refuse_lbfgs(rank, world_size):
    module, ddp = plain_wrapper()
    return raised(lambda: ddp.overlap_optimizer(torch.optim.LBFGS(module.parameters()))), None


def _refuse_not_an_optimizer(rank, world_size):
    module, ddp = plain_wrapper()
    return raised(lambda: ddp.overlap_optimizer([p for p in module.parameters()])), None


def _refuse_twice(rank, world_size):
    module, ddp = plain_wrapper()
    ddp.overlap_optimizer(torch.optim.SGD(module.parameters(), lr=0.1))
    return raised(lambda: ddp.overlap_optimizer(torch.optim.SGD(module.parameters(), lr=0.1))), None


def _refuse_second_backward(rank, world_size):
    module, ddp = plain_wrapper()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    ddp.overlap_optimizer(optimizer)
    backward(ddp, rank, world_size, step=0)
    stepped = snapshot(module)
    message = raised(lambda: backward(ddp, rank, world_size, step=1))
    # Nothing stepped by the refused backward; the wrapper is usable after it.
    untouched = unchanged(module, stepped)
    optimizer.step()
    optimizer.zero_grad()
    backward(ddp, rank, world_size, step=2)
    overlapped = len(ddp._optimizer_overlap.stepped) == len(stepped)
    again = raised(lambda: backward(ddp, rank, world_size, step=3))  # refused once overlapped too
    return message, untouched and overlapped and "Nothing was stepped in this backward" in again


def _refuse_closure(rank, world_size):
    module, ddp = plain_wrapper()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    ddp.overlap_optimizer(optimizer)
    return raised(lambda: optimizer.step(lambda: torch.tensor(0.0))), None


def _refuse_mixed_precision(rank, world_size):
    from torch.nn.parallel.distributed import _MixedPrecision

    module, ddp = plain_wrapper(mixed_precision=_MixedPrecision(param_dtype=torch.float64))
    return raised(lambda: ddp.overlap_optimizer(torch.optim.SGD(module.parameters(), lr=0.1))), None


def _refuse_clipping(rank, world_size):
    module, ddp = plain_wrapper()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    ddp.overlap_optimizer(optimizer)
    before = snapshot(module)
    backward(ddp, rank, world_size)
    torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm=1e6)  # multiplies by 1: an edit all the same
    return raised(optimizer.step), unchanged(module, before) and not optimizer.state


def _refuse_clipping_later(rank, world_size):
    """Clipping that starts after the overlap did: refused at that step,
    which says the backward's steps are applied."""
    module, ddp = plain_wrapper()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    ddp.overlap_optimizer(optimizer)
    for step in range(2):
        backward(ddp, rank, world_size, step)
        optimizer.step()
        optimizer.zero_grad()
    before = snapshot(module)
    backward(ddp, rank, world_size, 2)
    next(module.parameters()).grad.mul_(0.5)
    return raised(optimizer.step), not unchanged(module, before)


def _changed_between(rank, world_size, optimizer, ddp, module, change, at_step: int, overlap_forward=False):
    """Trains until `change(optimizer)`, made between the backward and the
    step of step `at_step`, is refused: (the message, whether the backward of
    that step had changed the parameters, whether it had stepped any)."""
    ddp.overlap_optimizer(optimizer, overlap_forward=overlap_forward)
    for step in range(at_step):
        backward(ddp, rank, world_size, step)
        optimizer.step()
        optimizer.zero_grad()
    before = snapshot(module)
    backward(ddp, rank, world_size, at_step)
    change(optimizer)
    message = raised(optimizer.step)
    return message, (not unchanged(module, before), bool(optimizer.state))


def _set(key, value):
    def change(optimizer):
        for group in optimizer.param_groups:
            group[key] = value
    return change


def _refuse_lr_changed(rank, world_size):
    """A warm-up written by hand before the step: refused at the first
    synchronising backward's step, with nothing applied."""
    module, ddp = plain_wrapper()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    return _changed_between(rank, world_size, optimizer, ddp, module, _set("lr", 0.01), at_step=0)


def _refuse_lr_changed_later(rank, world_size):
    """The same change once the backward steps buckets: refused, the
    backward's steps applied."""
    module, ddp = plain_wrapper()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    return _changed_between(rank, world_size, optimizer, ddp, module, _set("lr", 0.01), at_step=2)


def _refuse_lr_changed_forward_overlap(rank, world_size):
    module, ddp = plain_wrapper()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    return _changed_between(rank, world_size, optimizer, ddp, module, _set("lr", 0.01), at_step=2,
                            overlap_forward=True)


def _refuse_weight_decay_changed(rank, world_size):
    module, ddp = plain_wrapper()
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.01)
    return _changed_between(rank, world_size, optimizer, ddp, module, _set("weight_decay", 0.1), at_step=2)


def _refuse_betas_changed(rank, world_size):
    """A tuple value (Adam's betas) and a tensor learning rate, changed in place."""
    module, ddp = plain_wrapper()
    params = list(module.parameters())
    optimizer = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:], "lr": torch.tensor(0.01)}],
                                 lr=0.01, betas=(0.9, 0.999))

    def change(opt):
        opt.param_groups[0]["betas"] = (0.8, 0.999)
        opt.param_groups[1]["lr"].fill_(0.02)

    return _changed_between(rank, world_size, optimizer, ddp, module, change, at_step=1)


def _refuse_groups_reloaded(rank, world_size):
    """load_state_dict between backward and step replaces the groups."""
    module, ddp = plain_wrapper()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    saved = optimizer.state_dict()
    return _changed_between(rank, world_size, optimizer, ddp, module, lambda opt: opt.load_state_dict(saved),
                            at_step=2)


def _scaled_backward(ddp, scaler, rank, world_size):
    args, target = models.rank_batch("deep", 0, 0, rank, world_size, per_rank=4)
    scaler.scale(models.MODELS["deep"].loss(ddp(*args), target)).backward()


def _refuse_grad_scaler(rank, world_size):
    module, ddp = plain_wrapper()
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    ddp.overlap_optimizer(optimizer)
    scaler = torch.amp.GradScaler("cpu")
    before = snapshot(module)
    _scaled_backward(ddp, scaler, rank, world_size)
    return raised(lambda: scaler.step(optimizer)), unchanged(module, before) and not optimizer.state


def _refuse_fused_grad_scaler(rank, world_size):
    """A fused optimizer unscales inside its step: GradScaler hands it the scale."""
    module, ddp = plain_wrapper()
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1, fused=True)
    ddp.overlap_optimizer(optimizer)
    scaler = torch.amp.GradScaler("cpu")
    before = snapshot(module)
    _scaled_backward(ddp, scaler, rank, world_size)
    return raised(lambda: scaler.step(optimizer)), unchanged(module, before) and not optimizer.state


class FailingSGD(torch.optim.SGD):
    fails = False

    def step(self, closure=None):
        if self.fails:
            raise ValueError("this optimizer's step failed")
        return super().step(closure)


def _step_raises(rank, world_size):
    module, ddp = plain_wrapper()
    optimizer = FailingSGD(module.parameters(), lr=0.1)
    ddp.overlap_optimizer(optimizer)
    backward(ddp, rank, world_size)  # the first backward steps nothing
    optimizer.step()
    optimizer.zero_grad()
    optimizer.fails = True
    before = snapshot(module)
    message = raised(lambda: backward(ddp, rank, world_size))
    # The backward finished its reduction (every .grad written back), so the
    # next forward and backward run; the next optimizer.step() raises again.
    grads = [p.grad is not None for p in module.parameters()]
    ddp.set_overlap_with_backward(True)  # a change: raises if the reducer were mid-iteration
    return message, unchanged(module, before) and all(grads)


@dataclasses.dataclass(frozen=True)
class Refusal:
    name: str
    expected: Tuple[str, ...]  # fragments of the message, `{rank}` filled in
    then: Any = None  # what the case's second value must be

    @property
    def id(self):
        return self.name


REFUSALS = [
    Refusal("foreign", ("ValueError", "on rank {rank}", "cannot step parameters the wrapper does not reduce",
                        "a parameter of shape (2, 2) (param group 0)"), then=True),
    Refusal("ignored", ("ValueError", "on rank {rank}", "layers.3.bias (param group 0)", "parameters_to_ignore"),
            then=True),
    Refusal("hook_before", ("RuntimeError", "on rank {rank}", "communication hook that steps parameters itself",
                            "hook_then_optimizer")),
    Refusal("hook_after", ("RuntimeError", "on rank {rank}", "hook_then_optimizer", "which steps parameters itself, "
                           "after overlap_optimizer"), then=True),
    Refusal("step_hook_before", ("RuntimeError", "on rank {rank}", "step post-hooks registered")),
    Refusal("step_hook_after", ("RuntimeError", "on rank {rank}", "step pre-hooks registered"), then=True),
    Refusal("lbfgs", ("ValueError", "on rank {rank}", "cannot overlap torch.optim.LBFGS")),
    Refusal("not_an_optimizer", ("TypeError", "on rank {rank}", "needs a torch.optim.Optimizer, got list")),
    Refusal("twice", ("RuntimeError", "on rank {rank}", "was called already on this wrapper")),
    Refusal("second_backward", ("RuntimeError", "on rank {rank}", "second synchronising backward before "
                                "optimizer.step()", "ddp.no_sync()", "Nothing was stepped in this backward"),
            then=True),
    Refusal("closure", ("ValueError", "on rank {rank}", "without a closure only")),
    Refusal("mixed_precision", ("ValueError", "on rank {rank}", "does not support mixed_precision")),
    Refusal("clipping", ("RuntimeError", "on rank {rank}", "changed between backward() and optimizer.step()",
                         "clip_grad_norm_", "and 59 more", "Nothing was stepped."), then=True),
    Refusal("clipping_later", ("RuntimeError", "on rank {rank}", "found the gradients of layers.0.weight changed",
                               "The backward had stepped 64 parameters already"), then=True),
    Refusal("grad_scaler", ("RuntimeError", "on rank {rank}", "cannot step through a GradScaler",
                            "Nothing was stepped."), then=True),
    Refusal("fused_grad_scaler", ("RuntimeError", "on rank {rank}", "cannot step through a GradScaler",
                                  "Nothing was stepped."), then=True),
    Refusal("step_raises", ("ValueError", "this optimizer's step failed"), then=True),
] + [
    # Note [Hyperparameters fixed at the backward]; then: (parameters changed, optimizer state made).
    Refusal("lr_changed", ("RuntimeError", "on rank {rank}", "param groups changed between backward() and "
                           "optimizer.step(): param group 0: 'lr' 0.1 -> 0.01.", "Nothing was stepped.",
                           "before the backward", "an LR scheduler whose step() is called after optimizer.step()"),
            then=(False, False)),
    Refusal("lr_changed_later", ("RuntimeError", "on rank {rank}", "param group 0: 'lr' 0.1 -> 0.01.",
                                 "The backward had stepped 64 parameters already, with the values as they stood then",
                                 "those steps are applied", "before the backward", "LR scheduler"),
            then=(True, True)),
    Refusal("lr_changed_forward_overlap", ("RuntimeError", "on rank {rank}", "param group 0: 'lr' 0.1 -> 0.01.",
                                           "parameters already, with the values as they stood then",
                                           "those steps are applied, and this optimizer.step() stepped nothing"),
            then=(True, True)),
    Refusal("weight_decay_changed", ("RuntimeError", "on rank {rank}", "param group 0: 'weight_decay' 0.01 -> 0.1.",
                                     "The backward had stepped 64 parameters already"), then=(True, True)),
    Refusal("betas_changed", ("RuntimeError", "on rank {rank}", "param group 0: 'betas' (0.9, 0.999) -> (0.8, "
                              "0.999), param group 1: 'lr' tensor(0.009999999776482582) -> "
                              "tensor(0.019999999552965164)", "The backward had stepped"), then=(True, True)),
    # The saved state was empty: no optimizer state after it.
    Refusal("groups_reloaded", ("RuntimeError", "on rank {rank}", "param group 0: replaced or removed",
                                "(load_state_dict replaces every group)", "The backward had stepped 64"),
            then=(True, False)),
]
REFUSAL_FNS = {r.name: globals()[f"_refuse_{r.name}" if r.name != "step_raises" else "_step_raises"]
               for r in REFUSALS}


def _refusal(rank, world_size, r):
    return REFUSAL_FNS[r.name](rank, world_size)


REFUSAL_TABLE = CaseTable(_refusal, REFUSALS)


@pytest.mark.parametrize("r", REFUSALS, ids=lambda r: r.id)
def test_refusals(r):
    world_size = 2
    for rank, (message, then) in enumerate(REFUSAL_TABLE.results(world_size, r)):
        for fragment in r.expected:
            assert fragment.format(rank=rank) in message, f"rank {rank}: {fragment!r} not in {message!r}"
        assert then == r.then, f"rank {rank}: {r.name}: {then!r}"


# --- a wrapper whose caller applies the steps (ddp_ext.fault_tolerance) -------


def test_a_wrapper_refusing_backward_steps_refuses_each_way_in(single_process_group):
    """After _refuse_backward_steps nothing installs a step inside the
    backward: overlap_optimizer, a hook that steps parameters, optimizers
    applied in backward; each error ends with the caller's reason."""
    module, ddp = plain_wrapper()
    ddp._refuse_backward_steps("the caller steps")
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"on rank 0 cannot step parameters inside the backward "
                                         r"\(overlap_optimizer\): the caller steps"):
        ddp.overlap_optimizer(optimizer)
    assert ddp._optimizer_overlap is None and optimizer.step.__func__ is type(optimizer).step
    with pytest.raises(ValueError, match=r"inside the backward \(.+\): the caller steps"):
        ddp._register_fused_optim(torch.optim.SGD, lr=0.1)
    assert not ddp._comm_hooks
    before = snapshot(module)
    backward(ddp, 0, 1)  # a plain backward still runs, and steps nothing
    assert unchanged(module, before)


@pytest.mark.parametrize("in_place", ["overlap_optimizer", "optimizers applied in backward"])
def test_refusing_backward_steps_raises_at_once_where_one_is_in_place(single_process_group, in_place):
    import ddp_ext
    from torch.distributed.optim import _apply_optimizer_in_backward

    module = models.build("deep")
    if in_place == "optimizers applied in backward":
        _apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": 0.1})
    ddp = ddp_ext.DistributedDataParallel(module)
    if in_place == "overlap_optimizer":
        ddp.overlap_optimizer(torch.optim.SGD(module.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=rf"inside the backward \({in_place}\): the caller steps"):
        ddp._refuse_backward_steps("the caller steps")
