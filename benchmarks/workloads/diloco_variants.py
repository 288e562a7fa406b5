"""The `diloco` experiment's ways to train one model across hosts.

- `torch`: torch's DDP over every rank, gradients averaged every step;
- `ours_adaptive`: ddp_ext's DDP over every rank with AdaptivePrecision
  (gradients in 16 or 8 bits where that pays; docs/COMPRESSION.md);
- `diloco`: ddp_ext's DDP inside each host, DiLoCo across hosts (F = 1);
- `streaming`: the same in fragments, each exchange overlapping a step
  (tau = 1, Streaming DiLoCo), merged with mix 0.6;
- `diloco_int8`, `streaming_int8`: those two with the exchange in 8 bits
  (with error feedback);
- `diloco_int4`, `streaming_int4`: `diloco` and `streaming` with the
  exchange in 4 bits (with error feedback).

Every variant starts from the same parameters (seeded), steps the same inner
optimizer (AdamW) on the same batches per rank, and gives the parameters
all hosts agree on (`agreed_parameters`): the model's for the DDPs, the last
synced ones for DiLoCo.
"""

import dataclasses
import time
from typing import List, Optional

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddp_ext
import ddp_ext.diloco
from benchmarks.workloads.char_transformer import CharModelShape, CharTransformer, loss

TORCH, ADAPTIVE = "torch", "ours_adaptive"
DILOCO, STREAMING, DILOCO_INT8, STREAMING_INT8 = "diloco", "streaming", "diloco_int8", "streaming_int8"
DILOCO_INT4, STREAMING_INT4 = "diloco_int4", "streaming_int4"
VARIANTS = (TORCH, ADAPTIVE, DILOCO, STREAMING, DILOCO_INT8, STREAMING_INT8, DILOCO_INT4, STREAMING_INT4)
OUTER_VARIANTS = (DILOCO, STREAMING, DILOCO_INT8, STREAMING_INT8, DILOCO_INT4, STREAMING_INT4)
STREAMING_VARIANTS = (STREAMING, STREAMING_INT8, STREAMING_INT4)
BITS = {DILOCO_INT8: 8, STREAMING_INT8: 8, DILOCO_INT4: 4, STREAMING_INT4: 4}


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    shape: CharModelShape = CharModelShape()
    batch: int = 4  # sequences per rank and step
    lr: float = 2e-3  # AdamW, every variant
    sync_every: int = 25  # H
    fragments: int = 2  # F of `streaming`
    delay: int = 1  # tau of `streaming`
    mix: Optional[float] = 0.6  # of `streaming` (the sweep's); None: DiLoCo's default (0.5 with a delay)
    outer_lr: float = 0.7
    outer_momentum: float = 0.5

    def outer_optimizer(self, params):
        return torch.optim.SGD(params, lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.outer_momentum > 0)

    def diloco_arguments(self, variant: str) -> dict:
        """DiLoCo's keyword arguments for `variant` (one of OUTER_VARIANTS)."""
        streaming = variant in STREAMING_VARIANTS
        return {"sync_every": self.sync_every, "fragments": self.fragments if streaming else 1,
                "delay": self.delay if streaming else 0, "bits": BITS.get(variant, 32),
                "outer_optimizer": self.outer_optimizer, "mix": self.mix if streaming else None}

    def describe(self, variant: str) -> str:
        if variant == TORCH:
            return "torch DDP, every rank"
        if variant == ADAPTIVE:
            return "ddp_ext + AdaptivePrecision, every rank"
        a = self.diloco_arguments(variant)
        mix = "" if a["mix"] is None else f" mix={a['mix']:g}"
        return f"DiLoCo H={a['sync_every']} F={a['fragments']} tau={a['delay']}{mix}, {a['bits']} bits"


class Trainer:
    """One variant's model, optimizers and step."""

    def __init__(self, variant: str, settings: TrainSettings, seed: int):
        if variant not in VARIANTS:
            raise ValueError(f"no variant {variant!r}; the variants are {', '.join(VARIANTS)}")
        torch.manual_seed(seed)
        module = CharTransformer(settings.shape)
        self.variant, self.outer, self.adaptive = variant, None, None
        self.outer_s = 0.0  # seconds in DiLoCo's step: launching, waiting for and merging exchanges
        if variant == TORCH:
            self.ddp = TorchDDP(module)
        elif variant == ADAPTIVE:
            self.ddp = ddp_ext.DistributedDataParallel(module, hierarchical_allreduce=False)
            self.adaptive = ddp_ext.AdaptivePrecision()
            self.ddp.register_comm_hook(self.adaptive, ddp_ext.adaptive_precision_hook)
        else:
            groups = ddp_ext.diloco.host_groups()
            self.ddp = ddp_ext.DistributedDataParallel(module, process_group=groups.inner)
        self.optimizer = torch.optim.AdamW(self.ddp.parameters(), lr=settings.lr)
        if variant in OUTER_VARIANTS:
            self.outer = ddp_ext.DiLoCo(self.ddp, self.optimizer, outer_group=groups.outer,
                                        **settings.diloco_arguments(variant))

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        value = loss(self.ddp(inputs), targets)
        self.optimizer.zero_grad()
        value.backward()
        self.optimizer.step()
        if self.outer is not None:
            started = time.perf_counter()
            self.outer.step()
            self.outer_s += time.perf_counter() - started
        return value.item()

    def agreed_parameters(self) -> List[torch.Tensor]:
        """Copies of the parameters every host agrees on, in the model's order."""
        if self.outer is not None:
            return [p.detach().clone() for p in self.outer.global_parameters()]
        return [p.detach().clone() for p in self.ddp.module.parameters()]

    @property
    def outer_bytes_sent(self) -> int:
        """Bytes this rank's DiLoCo put on the wire across hosts (0 for the DDPs)."""
        return self.outer.bytes_sent if self.outer is not None else 0

    def adaptive_formats(self) -> list:
        return list(self.adaptive.formats) if self.adaptive is not None else []


def parameter_count(shape: CharModelShape) -> int:
    return sum(p.numel() for p in CharTransformer(shape).parameters())
