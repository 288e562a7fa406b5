"""Training loops shared by the parity tests: one for a DDP wrapper (ddp_ext's
or torch's) run on every rank, and the local reference that reproduces the
same math in one process.

A Case says what to train and how; a trace records what came out of it
(final parameters and buffers, which `.grad` were None after
each step, a digest of the final parameters; for DDP runs also the bucket
layout and any `.grad` strided unlike its parameter) so that the parent
process can compare ranks, wrappers and references.
"""

import contextlib
import dataclasses
import hashlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from tests.support import models

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


@dataclasses.dataclass(frozen=True)
class Case:
    model: str  # key of tests.support.models.MODELS
    optimizer: str = "sgd"  # key of OPTIMIZERS
    steps: int = 4
    # Micro-batches per step; all but the last run inside no_sync().
    micro_batches: int = 1
    # Rank r runs r extra no_sync micro-batches per step (uneven accumulation).
    uneven_no_sync: bool = False
    per_rank: int = 4  # samples per rank and micro-batch
    # Keyword arguments for the DDP constructor, as sorted (name, value) pairs.
    ddp: Tuple[Tuple[str, Any], ...] = ()
    # optimizer.zero_grad(set_to_none=...) after each step.
    set_to_none: bool = True
    # ddp_ext only: DistributedDataParallel.set_overlap_with_backward(...).
    overlap: bool = True

    @property
    def id(self) -> str:
        parts = [self.model, self.optimizer]
        if self.micro_batches != 1:
            parts.append(f"micro{self.micro_batches}")
        if self.uneven_no_sync:
            parts.append("uneven")
        parts += [f"{k}={v}" for k, v in self.ddp]
        if not self.set_to_none:
            parts.append("zero_grad_to_zeros")
        if not self.overlap:
            parts.append("no_overlap")
        return "-".join(parts)

    def micro_batches_of(self, rank: int) -> int:
        return self.micro_batches + (rank if self.uneven_no_sync else 0)


def case(model: str, optimizer: str = "sgd", **kwargs) -> Case:
    ddp = kwargs.pop("ddp", {})
    return Case(model, optimizer, ddp=tuple(sorted(ddp.items())), **kwargs)


def state_tensors(module: nn.Module) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """Copies of the module's parameters and buffers, by name."""
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    return params, buffers


def digest(module: nn.Module) -> str:
    """sha256 over every parameter's name, dtype, shape and bytes. (Buffers are
    left out: BatchNorm's running statistics legitimately differ between
    ranks, each rank updating them with its own batch.)"""
    return digest_tensors(module.named_parameters())


def digest_tensors(named_tensors) -> str:
    h = hashlib.sha256()
    for name, t in named_tensors:
        t = t.detach().contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(bytes(t.reshape(-1).view(torch.uint8).tolist()))
    return h.hexdigest()


def none_grads(module: nn.Module) -> List[str]:
    return sorted(n for n, p in module.named_parameters() if p.requires_grad and p.grad is None)


def grads_off_layout(module: nn.Module) -> List[str]:
    """Parameters whose .grad is not strided like the parameter (autograd's
    gradient layout contract, which torch's DDP keeps)."""
    return sorted(n for n, p in module.named_parameters() if p.grad is not None and p.grad.stride() != p.stride())


def trace_of(module: nn.Module, grad_none: List[List[str]], **extra) -> Dict[str, Any]:
    params, buffers = state_tensors(module)
    return dict(params=params, buffers=buffers, grad_none=grad_none, digest=digest(module), **extra)


def train_ddp(
    wrapper: Callable[..., nn.Module],
    c: Case,
    rank: int,
    world_size: int,
    seed: int = models.MODEL_SEED,
    on_step: Optional[Callable[[nn.Module, nn.Module], None]] = None,
) -> Dict[str, Any]:
    """Trains `c` on this rank with `wrapper(module, **c.ddp)` (ddp_ext's or
    torch's DistributedDataParallel) and returns its trace. on_step(ddp,
    module) runs after each step's backward passes, before the optimizer."""
    module = models.build(c.model, seed)
    ddp = wrapper(module, **dict(c.ddp))
    if not c.overlap and hasattr(ddp, "set_overlap_with_backward"):  # a ddp_ext-only knob
        ddp.set_overlap_with_backward(False)
    optimizer = OPTIMIZERS[c.optimizer](module.parameters())
    off_layout = []

    def check_layout(ddp, module):
        off_layout.extend(grads_off_layout(module))
        if on_step is not None:
            on_step(ddp, module)

    grad_none = run_steps(ddp, optimizer, c, rank, world_size, range(c.steps), check_layout)
    extra = {"grads_off_layout": sorted(set(off_layout))}
    if hasattr(ddp, "bucket_indices"):
        extra["bucket_indices"] = ddp.bucket_indices()
    return trace_of(module, grad_none, **extra)


def run_steps(ddp, optimizer, c: Case, rank: int, world_size: int, steps, on_step=None) -> List[List[str]]:
    """Steps `steps` of case `c` through `ddp`: each step's micro-batches (all
    but the last inside no_sync), then the optimizer. Returns, per step, the
    names of the parameters whose .grad was None before the optimizer ran."""
    spec = models.MODELS[c.model]
    module = ddp.module
    grad_none = []
    for step in steps:
        micro_batches = c.micro_batches_of(rank)
        for micro in range(micro_batches):
            args, target = models.rank_batch(c.model, step, micro, rank, world_size, c.per_rank)
            last = micro == micro_batches - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                spec.loss(ddp(*args), target).backward()
        grad_none.append(none_grads(module))
        if on_step is not None:
            on_step(ddp, module)
        optimizer.step()
        optimizer.zero_grad(set_to_none=c.set_to_none)
    return grad_none


def train_local(
    c: Case, world_size: int, concat: bool, on_step: Optional[Callable[[nn.Module], None]] = None
) -> Dict[str, Any]:
    """The same training in one process, without any DDP.

    concat=True: one forward per micro-batch over the global batch (the
    concatenation of every rank's slice), loss mean-reduced over it.
    concat=False: every rank's loss computed separately with its own forward
    arguments, and their average backpropagated (for models whose forward
    differs between ranks, or uneven micro-batch counts).
    Either way the gradient equals the average DDP computes. on_step(module)
    runs after each step's backward passes, before the optimizer.
    """
    spec = models.MODELS[c.model]
    module = models.build(c.model)
    optimizer = OPTIMIZERS[c.optimizer](module.parameters())
    grad_none = []
    for step in range(c.steps):
        if concat:
            assert not c.uneven_no_sync
            for micro in range(c.micro_batches):
                inputs, target = models.global_batch(c.model, step, micro, c.per_rank * world_size)
                extra = spec.extra_args(0, step, micro)
                assert extra == (), f"{c.model} takes per-rank arguments: use concat=False"
                spec.loss(module(*inputs), target).backward()
        else:
            for rank in range(world_size):
                for micro in range(c.micro_batches_of(rank)):
                    args, target = models.rank_batch(c.model, step, micro, rank, world_size, c.per_rank)
                    (spec.loss(module(*args), target) / world_size).backward()
        grad_none.append(none_grads(module))
        if on_step is not None:
            on_step(module)
        optimizer.step()
        optimizer.zero_grad(set_to_none=c.set_to_none)
    return trace_of(module, grad_none)


def ext_ddp(module, **kwargs):
    import ddp_ext

    return ddp_ext.DistributedDataParallel(module, **kwargs)


def torch_ddp(module, **kwargs):
    return torch.nn.parallel.DistributedDataParallel(module, **kwargs)
