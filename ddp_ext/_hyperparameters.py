"""The hyperparameters of an optimizer's param groups as they stood at one
moment, and what changed since: for overlap_optimizer, whose backward steps
buckets with the values it finds then (Note [Hyperparameters fixed at the
backward] in ddp_ext/_optimizer_overlap.py)."""

from typing import Any, List

import torch

_MISSING = object()


def _copied(value: Any) -> Any:
    """`value` as it is now: tensors cloned (a scheduler may change one in
    place), lists and tuples copied through."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value) in (list, tuple):
        return type(value)(_copied(v) for v in value)
    return value


def same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a, b)))
    if type(a) in (list, tuple) or type(b) in (list, tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value that cannot say is taken as changed
        return False


def of_group(group: dict) -> dict:
    """A group's values other than its parameters, copied."""
    return {key: _copied(value) for key, value in group.items() if key != "params"}


class GroupValues:
    """The param groups (the dicts themselves) and their values at one moment."""

    def __init__(self, groups: List[dict]):
        self.groups = list(groups)
        self.values = [of_group(group) for group in groups]

    def changes(self, groups: List[dict]) -> List[str]:
        """What changed in `groups` since: a group gone or replaced, or a key
        whose value differs, as "param group N: 'key' OLD -> NEW". A group
        added after the last (add_param_group) is no change: its parameters
        were in no group then."""
        found = []
        for number, (group, values) in enumerate(zip(self.groups, self.values)):
            if number >= len(groups) or groups[number] is not group:
                found.append(f"param group {number}: replaced or removed (load_state_dict replaces every group)")
                continue
            for key in list(values) + [k for k in group if k not in values and k != "params"]:
                old, new = values.get(key, _MISSING), group.get(key, _MISSING)
                if not same(old, new):
                    found.append(f"param group {number}: {key!r} {_shown(old)} -> {_shown(new)}")
        return found


def _shown(value: Any) -> str:
    if value is _MISSING:
        return "(absent)"
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return f"tensor({value.item()!r})"
    return repr(value)
