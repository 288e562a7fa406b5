"""A parameter added to (or replaced in) the module after wrapping would
never be synchronised: the next forward raises, naming it. Unrelated modules
built in between cost one check and raise nothing."""

import pytest
import torch
from torch import nn

import ddp_ext


def _step(ddp):
    ddp(torch.randn(3, 4)).sum().backward()


def test_parameter_added_after_wrapping_is_named(single_process_group):
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ddp = ddp_ext.DistributedDataParallel(module)
    _step(ddp)
    module[1].scale = nn.Parameter(torch.ones(2))
    with pytest.raises(RuntimeError, match=r"parameters changed after it was wrapped \(added or replaced: \['1.scale'\]"):
        _step(ddp)


def test_layer_replaced_after_wrapping_is_named(single_process_group):
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ddp = ddp_ext.DistributedDataParallel(module)
    module[1] = nn.Linear(4, 2)
    with pytest.raises(RuntimeError, match=r"\['1.weight', '1.bias'\]"):
        _step(ddp)


def test_unrelated_modules_and_no_grad_forwards_raise_nothing(single_process_group):
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ddp = ddp_ext.DistributedDataParallel(module)
    for _ in range(3):
        nn.Sequential(nn.Linear(4, 4), nn.ReLU())  # registers parameters elsewhere
        _step(ddp)
    with torch.no_grad():
        ddp(torch.randn(3, 4))
    assert module[0].weight.grad is not None
