"""A world of one rank: gradients stay where autograd put them (no copies, no
collectives), training equals local training bitwise, and errors still fire.
See Note [A world of one rank] in reducer/core/reducer.cpp."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddp_ext


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(5, 6)
        self.head = nn.Linear(6, 2)
        self.unused_head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(torch.relu(self.trunk(x)))


def _train(model, steps=3):
    g = torch.Generator().manual_seed(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(torch.randn(8, 5, generator=g)), torch.randn(8, 2, generator=g)).backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


@pytest.mark.parametrize("kwargs", [dict(find_unused_parameters=True), dict(static_graph=True), dict(gradient_as_bucket_view=True, find_unused_parameters=True)], ids=["find_unused", "static_graph", "bucket_view"])
def test_one_rank_trains_exactly_like_local_training(single_process_group, kwargs):
    torch.manual_seed(0)
    local = _TwoHeads()
    torch.manual_seed(0)
    net = _TwoHeads()
    ddp = ddp_ext.DistributedDataParallel(net, **kwargs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ours = _train(ddp)
    theirs = _train(local)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert [x is None for x in a] == [x is None for x in b], f"step {step}: .grad None pattern"
        for x, y in zip(a, b):
            if x is not None:
                assert torch.equal(x, y), f"step {step}: gradient differs from local training"
    for p, q in zip(net.parameters(), local.parameters()):
        assert torch.equal(p, q)
    allreduces = sum(e.name == "c10d::allreduce_" for e in prof.events())
    if kwargs.get("gradient_as_bucket_view"):
        assert allreduces > 0, "with bucket views the buckets are reduced as usual"
        assert net.head.weight.grad._base is not None, ".grad is a view into a bucket"
    else:
        assert allreduces == 0, f"{allreduces} allreduces in a world of one rank"


def test_one_rank_still_reports_unfinished_reduction(single_process_group):
    ddp = ddp_ext.DistributedDataParallel(_TwoHeads())
    ddp(torch.randn(2, 5)).sum().backward()
    with pytest.raises(RuntimeError, match="Expected to have finished reduction") as info:
        ddp(torch.randn(2, 5))
    assert "unused_head.weight" in str(info.value)
