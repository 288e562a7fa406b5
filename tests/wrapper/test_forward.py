"""Single process: the wrapper's forward has the wrapped module's signature
and outputs, and its attributes are torch's (issue 2)."""

import collections

import pytest
import torch
from torch import nn

from tests.support import reference

Out = collections.namedtuple("Out", ["y", "note", "count"])


class _Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x, *, scale=1.0, extra=None, as_tuple=False):
        y = self.fc(x) * scale
        if extra is not None:
            y = y + extra["shift"]
        return Out(y, "text", 7) if as_tuple else y


CALLS = [
    pytest.param((), {}, id="positional"),
    pytest.param((), dict(scale=2.0), id="keyword"),
    pytest.param((), dict(extra={"shift": torch.ones(3)}), id="nested_keyword_tensor"),
    pytest.param((), dict(as_tuple=True), id="namedtuple_with_non_tensors"),
]


@pytest.mark.parametrize("find_unused", [False, True])
@pytest.mark.parametrize("args, kwargs", CALLS)
def test_forward_passes_arguments_and_returns_outputs_unchanged(single_process_group, args, kwargs, find_unused):
    torch.manual_seed(0)
    module = _Keywords()
    ddp = reference.ext_ddp(module, find_unused_parameters=find_unused)
    x = torch.randn(2, 3)
    expected = module(x, *args, **kwargs)
    got = ddp(x, *args, **kwargs)
    assert type(got) is type(expected)
    if isinstance(expected, Out):
        assert (got.note, got.count) == (expected.note, expected.count)
        got, expected = got.y, expected.y
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    got.sum().backward()  # and the backward goes through


def test_attributes_are_torchs(single_process_group):
    module = nn.Linear(2, 2)
    ddp = reference.ext_ddp(module)
    assert ddp.module is module
    assert ddp.process_group is single_process_group
    assert sorted(ddp.state_dict()) == ["module.bias", "module.weight"]
    ddp.eval()
    assert not module.training
    ddp.train()
    assert module.training
