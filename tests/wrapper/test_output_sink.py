"""Single process: the forward-output plumbing of find_unused_parameters=True
(ddp_ext/_output_sink.py, issue 3).

find_tensors must see every tensor nested in the output (tuples, lists,
dicts, namedtuples, dataclasses), and sink_outputs must hand back the same
structure, same types and same values, with every tensor that requires grad
routed through one autograd node and everything else left as it was.
"""

import collections
import dataclasses
from typing import Any, Callable, List

import pytest
import torch

from ddp_ext._output_sink import find_tensors, sink_outputs

Pair = collections.namedtuple("Pair", ["main", "aux"])


@dataclasses.dataclass
class Plain:
    main: torch.Tensor
    extras: List[Any]


@dataclasses.dataclass(frozen=True)
class Frozen:
    main: torch.Tensor
    label: str = "frozen"


@dataclasses.dataclass
class WithDerivedField:
    """A field outside __init__, filled after construction (as HuggingFace-style
    output classes and user code do)."""

    main: torch.Tensor
    aux: Any = dataclasses.field(init=False, default=None)


def _tensors():
    w = torch.randn(3, requires_grad=True)
    return w * 2, w * 3, torch.randn(3)  # two with grad_fn, one plain


def _with_aux(cls, main, aux):
    out = cls(main)
    out.aux = aux
    return out


def _defaultdict(a, b, c):
    out = collections.defaultdict(list)
    out["a"] = a
    out["rest"] = [b, c]
    return out


# Each builds an output from tensors (a, b, c), of which a and b require grad.
STRUCTURES = [
    pytest.param(lambda a, b, c: a, id="tensor"),
    pytest.param(lambda a, b, c: (a, b, c), id="tuple"),
    pytest.param(lambda a, b, c: [a, None, 3, "x", b], id="list_with_non_tensors"),
    pytest.param(lambda a, b, c: {"a": a, "more": {"b": b, "c": [c, (a,)]}}, id="nested_dict"),
    pytest.param(lambda a, b, c: collections.OrderedDict(a=a, b=b), id="ordered_dict"),
    pytest.param(lambda a, b, c: Pair(a, [b, c]), id="namedtuple"),
    pytest.param(lambda a, b, c: Plain(a, [b, {"c": c}]), id="dataclass"),
    pytest.param(lambda a, b, c: Frozen(a), id="frozen_dataclass"),
    pytest.param(lambda a, b, c: torch.max(torch.stack([a, b]), dim=0), id="return_types"),
    pytest.param(_defaultdict, id="defaultdict"),
    pytest.param(lambda a, b, c: _with_aux(WithDerivedField, a, b), id="dataclass_field_not_in_init"),
]


def _leaves(obj) -> List[Any]:
    """Every leaf of obj, in order; for dataclasses every field, those outside
    __init__ included."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _leaves(v)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _leaves(v)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [x for f in dataclasses.fields(obj) for x in _leaves(getattr(obj, f.name))]
    return [obj]


@pytest.mark.parametrize("build", STRUCTURES)
def test_sink_outputs_keeps_structure_and_values(build: Callable):
    a, b, c = _tensors()
    output = build(a, b, c)
    expected_leaves = _leaves(output)
    expected_tensors = [x for x in expected_leaves if isinstance(x, torch.Tensor)]

    sunk = sink_outputs(output)
    assert type(sunk) is type(output)
    sunk_leaves = _leaves(sunk)
    assert len(sunk_leaves) == len(expected_leaves)
    for i, (before, after) in enumerate(zip(expected_leaves, sunk_leaves)):
        if not isinstance(before, torch.Tensor):
            assert after is before or after == before, f"leaf {i}: {before!r} became {after!r}"
            continue
        assert isinstance(after, torch.Tensor), f"leaf {i}: a tensor became {after!r}"
        if before.requires_grad and before.grad_fn is not None:
            assert after is not before and torch.equal(after, before)
            assert type(after.grad_fn).__name__ == "_OutputSinkBackward", after.grad_fn
        else:
            assert after is before, "tensors without grad_fn must be handed back untouched"

    found = find_tensors(output)
    assert [id(t) for t in found] == [id(t) for t in expected_tensors], "find_tensors missed or reordered tensors"
    routed = {id(x.grad_fn) for x in sunk_leaves if isinstance(x, torch.Tensor) and x.grad_fn is not None}
    assert len(routed) <= 1, "every tracked tensor goes through one sink node"


def test_sink_passes_gradients_through_and_none_for_ignored_outputs():
    w = torch.randn(3, requires_grad=True)
    used, ignored = sink_outputs((w * 2, w * 3))
    used.sum().backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 2.0))


@pytest.mark.parametrize("n_outputs", [1, 2])
def test_sunk_outputs_can_be_modified_in_place(n_outputs):
    w = torch.randn(3, requires_grad=True)
    outputs = sink_outputs(tuple(w * (i + 2) for i in range(n_outputs)))
    outputs[0].mul_(0.5)
    outputs[0].sum().backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 1.0))
