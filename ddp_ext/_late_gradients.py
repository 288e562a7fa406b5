"""The warning for gradients a second backward left on one rank: see Note
[Late gradients] in reducer/core/late_gradients.h."""

import os
import sys
import warnings
from typing import List

import torch

# How many parameter names the warning lists before "and N more".
_NAMES_SHOWN = 8
# The warning points at the first frame outside these (the user's forward call).
_OWN_FOLDERS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules[__package__]))


class LocalGradientWarning(UserWarning):
    """Gradients that stayed on this rank, unaveraged: a backward pass ran over
    a forward whose gradients DistributedDataParallel had already averaged
    (torch's DistributedDataParallel leaves them the same way, silently)."""


class LateGradientCheck:
    """Warns once, on this rank, when the reducer recorded late gradients.
    Called first in a forward with gradients enabled, without the reducer's
    lock, before anything changes: a warning turned into an error (a
    warnings filter) leaves the iteration as it was. No collective."""

    def __init__(self, names: List[str]):
        self._names = names  # the reducer's parameter names, in its order
        self._warned = False

    def warn_once(self, reducer, rank: int) -> None:
        indices = reducer._take_late_gradients()
        if self._warned or not indices:
            return
        self._warned = True
        warnings.warn(self.message([self._names[i] for i in indices], rank), LocalGradientWarning,
                      stacklevel=_caller_level())

    @staticmethod
    def message(names: List[str], rank: int) -> str:
        shown = ", ".join(names[:_NAMES_SHOWN])
        if len(names) > _NAMES_SHOWN:
            shown += f" and {len(names) - _NAMES_SHOWN} more"
        return (
            f"DistributedDataParallel on rank {rank}: the gradients of {shown} were produced after this "
            "iteration's gradients had been averaged across ranks, by another backward pass over the same "
            "forward (loss.backward(retain_graph=True) followed by a second backward, or two losses of one "
            "forward each backwarded alone). They were added to .grad on this rank only, not averaged, so the "
            "ranks now hold different gradients (torch's DistributedDataParallel does the same, without a "
            "word). Run one backward per forward: sum the losses and call backward once, or run a forward "
            "for each backward; to accumulate gradients over several backward passes, run all but the last "
            "inside no_sync(). Warned once per DistributedDataParallel."
        )


def _caller_level() -> int:
    """The stacklevel, for a warning issued by this function's caller, of the
    first frame outside ddp_ext and torch."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_OWN_FOLDERS):
        frame, level = frame.f_back, level + 1
    return level
