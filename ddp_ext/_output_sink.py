"""Identity autograd function over a forward's outputs; see Note [Unused parameters]
in reducer/participation/usage.h.

When the loss ignores some outputs, autograd would never visit the parameters
behind them, and their buckets would wait forever. Passing every output through
one node makes autograd visit all of them; the ignored ones receive no gradient
(materialisation is off), so their accumulators run with nothing to add and the
reducer's hooks mark those parameters ready without counting them as used.

With static_graph, the sink's backward also tells the reducer when the
learning iteration's backward has begun; see Note [Static graph] in
reducer/participation/static_graph.h.
"""

import copy
import dataclasses
import weakref
from typing import Any, Callable, List, Optional

import torch


class _OutputSink(torch.autograd.Function):
    @staticmethod
    def forward(ctx, on_backward, clone, *tensors):
        ctx.set_materialize_grads(False)
        ctx.on_backward = on_backward
        # Clones, not views, unless told otherwise: callers may modify outputs
        # in place.
        return tuple(t.clone() for t in tensors) if clone else tensors

    @staticmethod
    def backward(ctx, *grads):
        if ctx.on_backward is not None:
            ctx.on_backward()
        return (None, None, *grads)


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Rebuilds `obj` with fn applied to every tensor nested in tuples, lists,
    dicts, namedtuples and dataclasses. Dicts and dataclasses are shallow-copied
    and refilled, so their type, default factory and every field survive."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    if isinstance(obj, dict):
        mapped = copy.copy(obj)
        for key, value in obj.items():
            mapped[key] = _map_tensors(value, fn)
        return mapped
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        mapped = copy.copy(obj)
        for field in dataclasses.fields(obj):
            # object.__setattr__ also works on frozen dataclasses.
            object.__setattr__(mapped, field.name, _map_tensors(getattr(obj, field.name), fn))
        return mapped
    return obj


def find_tensors(obj: Any) -> List[torch.Tensor]:
    """Every tensor nested in `obj`, in a deterministic order."""
    found: List[torch.Tensor] = []

    def collect(t):
        found.append(t)
        return t

    _map_tensors(obj, collect)
    return found


def sink_outputs(output: Any, on_backward: Optional[Callable[[], None]] = None, clone: bool = True) -> Any:
    """`output` with each tensor that requires grad routed through one _OutputSink
    node, whose backward first calls `on_backward` (if given)."""
    tracked = [t for t in find_tensors(output) if t.requires_grad and t.grad_fn is not None]
    if not tracked:
        return output
    passed = dict(zip(map(id, tracked), _OutputSink.apply(on_backward, clone, *tracked)))
    return _map_tensors(output, lambda t: passed.get(id(t), t))


def at_backward_start(reducer, group, learning: bool) -> Callable[[], None]:
    """What the sink runs when the backward reaches it. It holds the reducer
    weakly: a wrapper freed after its forward makes that backward raise,
    instead of running unsynchronised (torch's DDP raises too)."""
    reducer_ref = weakref.ref(reducer)

    def on_backward() -> None:
        alive = reducer_ref()
        if alive is None:
            raise RuntimeError(
                f"DistributedDataParallel on rank {group.rank()} was destroyed after its forward pass, so "
                "this backward pass would not average gradients across ranks. Keep the wrapper "
                "alive until backward returns."
            )
        if learning:
            alive.queue_finish_learning_iteration()

    return on_backward
