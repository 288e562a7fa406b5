"""mixed_precision (torch's _MixedPrecision): forward and backward in
param_dtype, reduction in reduce_dtype, full-precision parameters and
gradients for the optimizer. torch's own DDP mixed precision needs CUDA
events and fails on CPU, so the reference is the same arithmetic done by hand
in one process: each rank's gradient computed with parameters and inputs
cast to param_dtype, scaled by 1/world_size, cast to reduce_dtype, summed in
reduce_dtype."""

import dataclasses
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel.distributed import _MixedPrecision

import ddp_ext
from tests.support.harness import CaseTable

WORLD_SIZE = 2
STEPS = 4
PER_RANK = 4


@dataclasses.dataclass(frozen=True)
class Case:
    param_dtype: Optional[torch.dtype]
    reduce_dtype: Optional[torch.dtype]
    no_sync: bool = False
    compiled: bool = False  # torch.compile(ddp) (dynamo's "eager" backend)

    @property
    def id(self) -> str:
        name = lambda d: str(d).replace("torch.", "")  # noqa: E731
        return (
            f"param={name(self.param_dtype)}-reduce={name(self.reduce_dtype)}"
            + ("-no_sync" if self.no_sync else "")
            + ("-compiled" if self.compiled else "")
        )


CASES = [
    Case(torch.bfloat16, torch.float32),
    Case(torch.bfloat16, None),
    Case(None, torch.bfloat16),
    Case(torch.bfloat16, torch.float32, no_sync=True),
    Case(torch.bfloat16, torch.float32, compiled=True),
]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    return torch.randn(PER_RANK, 8, generator=g), torch.randn(PER_RANK, 4, generator=g)


def _micro_batches(c):
    return 2 if c.no_sync else 1


def _ddp_ext_run(rank, world_size, c: Case):
    module = _model()
    ddp = ddp_ext.DistributedDataParallel(module, mixed_precision=_MixedPrecision(param_dtype=c.param_dtype, reduce_dtype=c.reduce_dtype))
    if c.compiled:
        torch._dynamo.reset()
        ddp = torch.compile(ddp, backend="eager")
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(STEPS):
        for micro in range(_micro_batches(c)):
            x, y = _batch(rank, step, micro)
            last = micro == _micro_batches(c) - 1
            if last:
                F.mse_loss(ddp(x).float(), y).backward()
            else:
                with ddp.no_sync():
                    F.mse_loss(ddp(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _by_hand(c: Case):
    module = _model()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    compute = c.param_dtype or torch.float32
    reduce = c.reduce_dtype or c.param_dtype or torch.float32
    for step in range(STEPS):
        total = None
        for rank in range(WORLD_SIZE):
            grads = [torch.zeros_like(p) for p in module.parameters()]
            for micro in range(_micro_batches(c)):
                x, y = _batch(rank, step, micro)
                low = {n: p.to(compute) for n, p in module.named_parameters()}
                out = torch.func.functional_call(module, low, (x.to(compute),))
                rank_grads = torch.autograd.grad(F.mse_loss(out.float(), y), list(module.parameters()))
                grads = [a + b for a, b in zip(grads, rank_grads)]
            scaled = [(g * (1.0 / WORLD_SIZE)).to(reduce) for g in grads]
            total = scaled if total is None else [a + b for a, b in zip(total, scaled)]
        for p, g in zip(module.parameters(), total):
            p.grad = g.to(p.dtype)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in module.named_parameters()}


TABLE = CaseTable(_ddp_ext_run, CASES)


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_mixed_precision_matches_the_arithmetic_by_hand(c):
    expected = _by_hand(c)
    for rank, state in enumerate(TABLE.results(WORLD_SIZE, c)):
        for name, value in expected.items():
            assert state[name].dtype == torch.float32
            torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"rank {rank} `{n}`: {m}")
