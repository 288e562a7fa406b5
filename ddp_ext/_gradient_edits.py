"""Which reduced gradients were changed between the backward and the step,
for overlap_optimizer (Note [Gradients edited before the step] in
ddp_ext/_optimizer_overlap.py)."""

from typing import Dict, List, Optional, Tuple

import torch


class GradientEdits:
    """Each parameter's .grad as a bucket's reduction left it: the tensor and
    its version counter, which in-place changes through autograd's ops bump
    (clip_grad_norm_'s multiply, `grad.mul_(...)`), by id of the parameter.
    A parameter whose .grad is then another tensor (replaced, or set to None)
    counts as edited too."""

    def __init__(self):
        self._seen: Dict[int, Tuple[torch.Tensor, Optional[torch.Tensor], int]] = {}

    def __contains__(self, key: int) -> bool:
        return key in self._seen

    def __bool__(self) -> bool:
        return bool(self._seen)

    def remember(self, params) -> None:
        for p in params:
            grad = p.grad
            self._seen[id(p)] = (p, grad, -1 if grad is None else grad._version)

    def edited(self) -> List[torch.Tensor]:
        """The parameters whose .grad changed since it was remembered."""
        changed = []
        for p, grad, version in self._seen.values():
            now = p.grad
            if now is not grad or (now is not None and now._version != version):
                changed.append(p)
        return changed

    def forget(self) -> None:
        self._seen = {}
