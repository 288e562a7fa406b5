"""The model's parameters cut into fragments: consecutive runs of the
parameters in registration order, balanced by element count."""

import itertools
from typing import List, Sequence

import torch


def split(parameters: Sequence[torch.Tensor], count: int) -> List[List[int]]:
    """Indices into `parameters`, cut into `count` consecutive non-empty
    runs: the k-th cut falls where the cumulative element count comes
    closest to k / count of the total, leaving every run at least one
    parameter. Raises ValueError for fewer parameters than `count`."""
    n = len(parameters)
    if n < count:
        raise ValueError(f"the model has {n} trainable parameters, fewer than fragments={count}")
    cumulative = list(itertools.accumulate(p.numel() for p in parameters))
    total = cumulative[-1]
    ends, start = [], 0  # a run ends after index `end`
    for k in range(1, count):
        # The run may end at start .. n - 1 - (count - k): later runs need one parameter each.
        candidates = range(start, n - (count - k))
        end = min(candidates, key=lambda i: (abs(cumulative[i] * count - k * total), i))
        ends.append(end)
        start = end + 1
    bounds = [-1] + ends + [n - 1]
    return [list(range(bounds[k] + 1, bounds[k + 1] + 1)) for k in range(count)]
