"""The wrapper's side of layer dropping: which parameters belong to which
LayerDrop layer, and which ones a forward dropped. See Note [Layer dropping]
in reducer/participation/layer_drop.h.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ddp_ext.layer_drop import LayerDrop


class DroppedLayers:
    """The LayerDrop modules inside a wrapped module.

    `params` are the reducer's parameters. A parameter belongs to layer j of
    a LayerDrop when every name it is registered under lies inside that
    layer; one also used outside (tied weights) is never dropped.
    """

    def __init__(self, module: nn.Module, params: Sequence[nn.Parameter]):
        self.containers: List[LayerDrop] = []
        prefixes: List[str] = []
        seen = set()
        for name, sub in module.named_modules(remove_duplicate=False):
            if isinstance(sub, LayerDrop) and id(sub) not in seen:
                seen.add(id(sub))
                self.containers.append(sub)
                prefixes.append(f"{name}." if name else "")
        # layer_params[c][j]: reducer indices of the parameters of layer j of
        # container c. units[i]: the innermost layer parameter i belongs to.
        self.layer_params: List[List[List[int]]] = []
        self.units: List[int] = [-1] * len(params)
        # Without a LayerDrop (most models) there is nothing to look up.
        names: Dict[int, List[str]] = {}
        if self.containers:
            for name, param in module.named_parameters(remove_duplicate=False):
                names.setdefault(id(param), []).append(name)
        depth = [0] * len(params)
        unit = 0
        for prefix, container in zip(prefixes, self.containers):
            per_layer = []
            for j in range(len(container)):
                inside = f"{prefix}{j}."
                members = [
                    i for i, p in enumerate(params)
                    if all(n.startswith(inside) for n in names.get(id(p), ["\0"]))
                ]
                for i in members:
                    if len(inside) > depth[i]:
                        depth[i] = len(inside)
                        self.units[i] = unit
                per_layer.append(members)
                unit += 1
            self.layer_params.append(per_layer)
        # Per container, the layers kept by any forward with gradients since
        # the last synchronising one (None: not called): gradients
        # accumulated under no_sync are reduced with the next backward.
        self._window: List[Optional[List[bool]]] = [None] * len(self.containers)
        self._last_kept: List[Optional[List[bool]]] = [None] * len(self.containers)
        self._last_draws = [1] * len(self.containers)

    def __bool__(self) -> bool:
        return bool(self.containers)

    def agree_with_rank_0(self, broadcast) -> None:
        """Takes every LayerDrop's seed and plan count from rank 0;
        `broadcast(tensors)` broadcasts in place from rank 0."""
        state = torch.tensor([[c.seed, c.draws] for c in self.containers], dtype=torch.int64)
        broadcast(state)
        for container, (seed, draws) in zip(self.containers, state.tolist()):
            container.seed, container.draws = int(seed), int(draws)

    def begin_forward(self) -> None:
        """Called before a forward with gradients enabled."""
        for container in self.containers:
            container._mark()

    def end_forward(self) -> None:
        """Called after it: counts its plans into the window."""
        self._last_draws = [c._draws_since_mark for c in self.containers]
        self._last_kept = [c._kept_since_mark for c in self.containers]
        self._fold(self._last_kept)

    def simulate_forward(self) -> None:
        """For a rank that joined (Join), once per iteration its peers run:
        draws the plans their forward drew, assuming each LayerDrop was called
        as often as in this rank's last forward."""
        for container, draws in zip(self.containers, self._last_draws):
            container._mark()
            for _ in range(draws):
                keep = container.plan(container.draws)
                container.draws += 1
                container._note(keep)
        self._fold([c._kept_since_mark for c in self.containers])

    def take_dropped(self) -> Tuple[List[int], List[int]]:
        """Starts a new window and returns, from the one that ends:
        - the parameters of the layers that every forward since the last
          synchronising one dropped (none of a LayerDrop not called): they
          get no gradient and are not communicated;
        - those of the layers the last forward dropped but an earlier one
          (under no_sync) ran: no gradient arrives in this backward, yet
          .grad holds what the earlier ones accumulated, to be reduced."""
        dropped, accumulated_only = set(), set()
        for per_layer, window, last in zip(self.layer_params, self._window, self._last_kept):
            if window is None:
                continue
            for j, (members, kept_in_window) in enumerate(zip(per_layer, window)):
                if not kept_in_window:
                    dropped.update(members)
                elif last is None or not last[j]:
                    accumulated_only.update(members)
        self._window = [None] * len(self.containers)
        return sorted(dropped), sorted(accumulated_only - dropped)

    def _fold(self, kept_per_container) -> None:
        for c, kept in enumerate(kept_per_container):
            if kept is None:
                continue
            window = self._window[c]
            self._window[c] = list(kept) if window is None else [a or b for a, b in zip(window, kept)]

    def __setstate__(self, state: dict) -> None:
        """A copy (of a pickled wrapper) starts with no forward counted, as a
        new DroppedLayers does."""
        self.__dict__.update(state)
        self._window = [None] * len(self.containers)
        self._last_kept = [None] * len(self.containers)
        self._last_draws = [1] * len(self.containers)
