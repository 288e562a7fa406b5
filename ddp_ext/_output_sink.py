"""Identity autograd function over a forward's outputs; see Note [Unused parameters]
in reducer/unused_parameters.cpp.

When the loss ignores some outputs, autograd would never visit the parameters
behind them, and their buckets would wait forever. Passing every output through
one node makes autograd visit all of them; the ignored ones receive no gradient
(materialisation is off), so their accumulators run with nothing to add and the
reducer's hooks mark those parameters ready without counting them as used.

With static_graph, the sink's backward also tells the reducer when the
learning iteration's backward has begun; see Note [Static graph] in
reducer/reducer.cpp.
"""

import dataclasses
from typing import Any, Callable, List, Optional

import torch


class _OutputSink(torch.autograd.Function):
    @staticmethod
    def forward(ctx, on_backward, *tensors):
        ctx.set_materialize_grads(False)
        ctx.on_backward = on_backward
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.on_backward is not None:
            ctx.on_backward()
        return (None, *grads)


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Rebuilds `obj` with fn applied to every tensor nested in tuples, lists,
    dicts, namedtuples and dataclasses."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def find_tensors(obj: Any) -> List[torch.Tensor]:
    """Every tensor nested in `obj`, in a deterministic order."""
    found: List[torch.Tensor] = []

    def collect(t):
        found.append(t)
        return t

    _map_tensors(obj, collect)
    return found


def sink_outputs(output: Any, on_backward: Optional[Callable[[], None]] = None) -> Any:
    """`output` with each tensor that requires grad routed through one _OutputSink
    node, whose backward first calls `on_backward` (if given)."""
    tracked = [t for t in find_tensors(output) if t.requires_grad and t.grad_fn is not None]
    if not tracked:
        return output
    passed = dict(zip(map(id, tracked), _OutputSink.apply(on_backward, *tracked)))
    return _map_tensors(output, lambda t: passed.get(id(t), t))
