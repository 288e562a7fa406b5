"""LayerDrop: layers that training skips at random, the same on every rank.

    self.layers = ddp_ext.LayerDrop([Block() for _ in range(12)], p=0.2)
    ...
    x = self.layers(x)                  # the kept layers, in order
    for layer in self.layers.kept():    # or iterate them yourself
        x = layer(x, mask)

In training mode every call draws a plan: each layer is dropped with
probability `p`. Plans come from `seed` and a count of the plans drawn so far,
so modules with equal seeds that are called equally often drop the same
layers, on any rank, in local training as under DistributedDataParallel. In
eval mode every layer runs and nothing is drawn. The state dict is that of an
nn.ModuleList holding the same layers.

Under ddp_ext's DistributedDataParallel the seed and the count are taken from
rank 0 when the wrapper is built, and a layer dropped on every rank costs no
communication: its gradients are neither copied nor sent (see Note [Layer
dropping] in reducer/participation/layer_drop.h). torch's DDP also trains such a model, with
find_unused_parameters=True and a seed that all ranks share.
"""

from typing import Iterable, List, Optional

import torch
from torch import nn

_SEED_BOUND = 2**62


def _mixed(seed: int, draw: int) -> int:
    """A seed for plan `draw` of a module seeded `seed` (SplitMix64's mixer)."""
    z = (seed + (draw + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) % _SEED_BOUND


class LayerDrop(nn.ModuleList):
    """A ModuleList whose layers are skipped in training with probability `p`.

    Args:
        layers: the layers, in the order they run.
        p: the probability of dropping each layer in a training-mode call,
            in [0, 1]. May be changed between iterations (a drop schedule),
            the same way on every rank.
        seed: the seed plans are drawn from. Default: drawn from torch's
            default generator when the module is built.
    """

    def __init__(self, layers: Optional[Iterable[nn.Module]] = None, p: float = 0.0, seed: Optional[int] = None):
        super().__init__(layers)
        self.p = p
        if seed is None:
            seed = int(torch.randint(0, _SEED_BOUND, (1,)).item())
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _SEED_BOUND:
            raise ValueError(f"LayerDrop's seed must be an int in [0, 2**62), got {seed!r}")
        self.seed = seed
        # Plans drawn so far; the next call in training mode draws plan `draws`.
        self.draws = 0
        self._kept_since_mark: Optional[List[bool]] = None
        self._draws_since_mark = 0

    @property
    def p(self) -> float:
        return self._p

    @p.setter
    def p(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"LayerDrop's drop probability p must be a number in [0, 1], got {value!r}")
        self._p = float(value)

    def plan(self, draw: int) -> List[bool]:
        """Which layers plan number `draw` keeps (True: kept). Pure."""
        generator = torch.Generator().manual_seed(_mixed(self.seed, draw))
        return (torch.rand(len(self), generator=generator) >= self._p).tolist()

    def kept(self) -> List[nn.Module]:
        """The layers this call runs: all in eval mode; in training mode, the
        ones the next plan keeps (and the plan counts as drawn)."""
        if not self.training:
            return list(self)
        keep = self.plan(self.draws)
        self.draws += 1
        self._note(keep)
        return [layer for layer, kept in zip(self, keep) if kept]

    def forward(self, x, *args, **kwargs):
        """Runs the kept layers in order, each on the previous one's output
        (with the same extra arguments)."""
        for layer in self.kept():
            x = layer(x, *args, **kwargs)
        return x

    def extra_repr(self) -> str:
        return f"p={self._p}, seed={self.seed}"

    # What DistributedDataParallel reads (ddp_ext/_dropped_layers.py).

    def _mark(self) -> None:
        self._kept_since_mark = None
        self._draws_since_mark = 0

    def _note(self, keep: List[bool]) -> None:
        if self._kept_since_mark is None:
            self._kept_since_mark = list(keep)
        else:
            self._kept_since_mark = [a or b for a, b in zip(self._kept_since_mark, keep)]
        self._draws_since_mark += 1
