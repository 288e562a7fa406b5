"""The two benchmark models at each preset size, with their synthetic batches.

Preset `paper` is the full ResNet-50 (224x224 images) and BERT-base. The paper
does not state its per-GPU batch sizes; 32 images and 8 sequences of 128
tokens are our choice. Preset `small` keeps both architectures' depth and
halves or quarters their widths so that, with 2 ranks on 2 cores, one
iteration's computation and its gradient allreduce take similar time (about
26 MiB of gradients each; see docs/BENCHMARKS.md).
"""

import dataclasses
from typing import Dict, Tuple, Union

import torch
from torch import nn

from benchmarks.workloads.models import BertConfig, BertEncoder, resnet50

MODELS = ("resnet50", "bert")
PRESETS = ("small", "paper")


@dataclasses.dataclass(frozen=True)
class ResNetSize:
    base_width: int  # stem channels; 64 in ResNet-50
    image_size: int  # square input images, pixels per side
    batch_size: int  # images per rank per iteration
    num_classes: int = 1000


@dataclasses.dataclass(frozen=True)
class BertSize:
    config: BertConfig
    seq_len: int  # tokens per sequence
    batch_size: int  # sequences per rank per iteration


SIZES: Dict[str, Dict[str, Union[ResNetSize, BertSize]]] = {
    "small": {
        "resnet50": ResNetSize(base_width=32, image_size=32, batch_size=8),
        "bert": BertSize(BertConfig(vocab_size=8192, hidden=256, layers=6, heads=4, ffn=1024), seq_len=32,
                         batch_size=4),
    },
    "paper": {
        "resnet50": ResNetSize(base_width=64, image_size=224, batch_size=32),
        "bert": BertSize(BertConfig(), seq_len=128, batch_size=8),
    },
}


class Workload:
    """One model at one preset: builds identical replicas and synthetic batches."""

    def __init__(self, model: str, preset: str):
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
        self.model = model
        self.preset = preset
        self.size = SIZES[preset][model]

    def build(self, seed: int) -> nn.Module:
        """A fresh replica; the same seed gives the same initial parameters."""
        torch.manual_seed(seed)
        if isinstance(self.size, ResNetSize):
            return resnet50(base_width=self.size.base_width, num_classes=self.size.num_classes)
        return BertEncoder(self.size.config)

    def batch(self, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Synthetic (inputs, class targets) for one rank, fixed by `seed`."""
        generator = torch.Generator().manual_seed(seed)
        size = self.size
        if isinstance(size, ResNetSize):
            inputs = torch.randn(size.batch_size, 3, size.image_size, size.image_size, generator=generator)
            targets = torch.randint(0, size.num_classes, (size.batch_size,), generator=generator)
        else:
            inputs = torch.randint(0, size.config.vocab_size, (size.batch_size, size.seq_len), generator=generator)
            targets = torch.randint(0, size.config.num_classes, (size.batch_size,), generator=generator)
        return inputs, targets

    def describe(self) -> dict:
        """Size facts recorded with the results."""
        params = sum(p.numel() for p in self.build(0).parameters())
        inputs, _ = self.batch(0)
        return {
            "preset": self.preset,
            "parameters": params,
            "gradient_mib": round(params * 4 / 2**20, 2),
            "input_shape_per_rank": list(inputs.shape),
            "size": dataclasses.asdict(self.size),
        }


def input_seed(seed: int, rank: int) -> int:
    """Seed of rank `rank`'s synthetic batch: fixed, and different on every rank."""
    return seed * 1009 + rank + 1
