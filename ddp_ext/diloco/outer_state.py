"""One fragment's outer state: the parameters as last synced (the same on
every rank), the outer optimizer that steps them, and, in 8 bits, the
error-feedback residual.

# Note [DiLoCo merge]

A fragment launched at step t sends its pseudo-gradient, the last synced
parameters minus the live ones (what this group learned since, negated, so
that an optimizer descending it moves towards the groups' parameters). At
step t + tau its mean over the outer group arrives: the outer optimizer
steps the last synced copy with it as gradient, and the live parameters,
which trained on for tau steps meanwhile, become

    live = mix * synced + (1 - mix) * live

With tau = 0 nothing trained meanwhile and mix defaults to 1: the live
parameters are replaced. With tau > 0 the default is 0.5, the Streaming
DiLoCo paper's mixing factor: half of what trained during the exchange is
kept. The next pseudo-gradient is taken against the new synced copy, so what
mixing keeps of local training is sent at the next sync.
"""

from typing import Callable, List, Optional, Sequence

import torch

from ddp_ext.diloco.int4 import Int4ErrorFeedback
from ddp_ext.diloco.int8 import ErrorFeedback

OuterOptimizerFactory = Callable[[List[torch.nn.Parameter]], torch.optim.Optimizer]


def default_outer_optimizer(params: List[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """DiLoCo's: Nesterov SGD, lr 0.7, momentum 0.9."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


class FragmentState:
    def __init__(self, live: Sequence[torch.Tensor], factory: OuterOptimizerFactory, bits: int = 32,
                 chunk: int = 1024):
        """`live`: the fragment's model parameters; `bits`: 32, or 8 or 4
        with `chunk` elements per scale. Raises ValueError if the factory's
        optimizer steps other tensors than the synced copies it was given."""
        self.live = list(live)
        self.synced = [torch.nn.Parameter(p.detach().clone()) for p in self.live]
        self.numel = sum(p.numel() for p in self.live)
        self.optimizer = factory(self.synced)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ValueError(f"outer_optimizer returned {type(self.optimizer).__name__}, not a torch.optim.Optimizer")
        stepped = [p for group in self.optimizer.param_groups for p in group["params"]]
        if len(stepped) != len(self.synced) or {id(p) for p in stepped} != {id(p) for p in self.synced}:
            raise ValueError(
                "outer_optimizer must build its optimizer over the parameters it is given (DiLoCo's last synced "
                "copies), e.g. lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True); "
                "it returned one over other tensors"
            )
        device = self.live[0].device
        codecs = {8: ErrorFeedback, 4: Int4ErrorFeedback}
        self.codec = codecs[bits](self.numel, chunk, device) if bits in codecs else None

    @torch.no_grad()
    def reset_synced(self) -> None:
        """The synced copy := the live parameters (after they were made equal everywhere)."""
        for synced, live in zip(self.synced, self.live):
            synced.copy_(live)

    @torch.no_grad()
    def pseudo_gradient(self) -> torch.Tensor:
        """synced - live, flat float32 (a new tensor)."""
        return torch.cat([(s.float() - p.float()).reshape(-1) for s, p in zip(self.synced, self.live)])

    @torch.no_grad()
    def merge(self, mean: torch.Tensor, mix: float) -> None:
        """Steps the synced copy with the outer group's mean pseudo-gradient,
        then mixes it into the live parameters (Note [DiLoCo merge])."""
        self.outer_step(mean)
        self.mix_into_live(mix)

    @torch.no_grad()
    def outer_step(self, mean: torch.Tensor) -> None:
        """Steps the synced copy with the mean pseudo-gradient."""
        offset = 0
        for synced in self.synced:
            n = synced.numel()
            synced.grad = mean[offset:offset + n].view(synced.shape).to(synced.dtype)
            offset += n
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def mix_into_live(self, mix: float) -> None:
        """live := mix * synced + (1 - mix) * live."""
        for synced, live in zip(self.synced, self.live):
            if mix == 1:
                live.copy_(synced)
            else:
                live.mul_(1 - mix).add_(synced.to(live.dtype), alpha=mix)

    def state_dict(self) -> dict:
        return {
            "synced": [p.detach().clone() for p in self.synced],
            "outer_optimizer": self.optimizer.state_dict(),
            "error_feedback": self.codec.state_dict() if self.codec is not None else None,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for synced, saved in zip(self.synced, state["synced"], strict=True):
            synced.copy_(saved)
        self.optimizer.load_state_dict(state["outer_optimizer"])
        if self.codec is not None:
            self.codec.load_state_dict(state["error_feedback"])
