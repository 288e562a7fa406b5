"""Clipping the sharded gradient by the whole gradient's norm, for
`ddp.clip_grad_norm_(max_norm)` under `overlap_optimizer(..., shard=True)`.

Note [Clipping sharded gradients]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch.nn.utils.clip_grad_norm_ takes the norm of each gradient, then the
norm of those norms, and multiplies every gradient by
clamp(max_norm / (norm + 1e-6), max=1). Here each rank sums |g|^p over its
pieces in float64, one all-reduce adds the ranks' sums (a max for
p = inf), and the root is cast to the gradients' dtype: the same formula,
summed in another order, so the norm (and the clipped gradients) may differ
from torch's in the last bits. A replicated bucket (Note [Replicated plans]
in ddp_ext/_shard_plan.py) counts once: each rank sums the range a sharded
plan would give it, the same slices of the same bits, so the norm is
bitwise the sharded one. Every rank gets the same norm, so the parameters
stay identical on every rank. The clipped pieces are remembered as the
gradients the step may use (Note [Gradients after a sharded backward] in
ddp_ext/_shard_gradient.py). Every rank joins the all-reduce, also one
whose pieces hold no parameter some rank used, and the all-reduce carries
whether a rank's gradients were edited, so every rank refuses alike.
"""

import math
from typing import List, Tuple

import torch
import torch.distributed as dist


class GlobalNorm:
    """The norm of order `norm_type` of a gradient whose elements the ranks
    of `group` hold in parts, each element counted on one rank."""

    def __init__(self, norm_type: float, group, device):
        self.norm_type = float(norm_type)
        self.group = group
        self.device = device

    def of(self, counted: List[torch.Tensor], edited: bool, dtype: torch.dtype) -> Tuple[torch.Tensor, bool]:
        """The whole norm, in `dtype`, from this rank's `counted` parts (one
        all-reduce), and whether some rank's gradients were `edited`."""
        infinite = math.isinf(self.norm_type)
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for g in counted:
            if g.numel():
                if infinite:
                    local = torch.maximum(local, g.detach().abs().max().to(torch.float64))
                else:
                    local += torch.linalg.vector_norm(g.detach(), self.norm_type, dtype=torch.float64) ** self.norm_type
        both = torch.stack([local, torch.tensor(float(edited), dtype=torch.float64, device=self.device)])
        dist.all_reduce(both, op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM, group=self.group)
        total = both[0] if infinite else both[0] ** (1.0 / self.norm_type)
        return total.to(dtype), bool(both[1] > 0)

    def refuse_nonfinite(self, total: torch.Tensor) -> None:
        """torch.nn.utils.clip_grad_norm_'s error for error_if_nonfinite=True."""
        if not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {self.norm_type} for gradients from `parameters` is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`")


def scale_by_norm(grads: List[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Multiplies `grads` in place by clamp(max_norm / (total + 1e-6), max=1)."""
    if grads:  # a rank whose pieces hold no used parameter joined the all-reduce all the same
        with torch.no_grad():
            torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
