"""scaleout's model and its eight DDP variants.

The model is small enough that 8 ranks fit on a 2-core machine: an MLP of
2.2 M parameters (about 9 MB of float32 gradients). For the layer-drop
variants its hidden blocks sit in a ddp_ext.LayerDrop (p = 0.5, the same
seed on every rank); for the others in an nn.Sequential (a LayerDrop, even
at p = 0, makes ddp_ext cut buckets at its layers, ten buckets here instead
of torch's two, which is not what those variants compare). Every ddp_ext variant but `ours_hierarchy` is told
hierarchical_allreduce=False, so `ours` is the flat allreduce whatever the
topology; `ours_hierarchy` takes the default ("auto"), which turns the
hierarchy on only with several hosts of several ranks.
"""

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddp_ext
from benchmarks.workloads.compression_variants import TORCH_PSGD1, HookSettings
from benchmarks.workloads.compression_variants import wrap as wrap_compression

TORCH, TORCH_FP16, TORCH_POWERSGD = "torch", "torch_fp16", "torch_powersgd"
OURS, OURS_HIERARCHY, OURS_ADAPTIVE = "ours", "ours_hierarchy", "ours_adaptive"
OURS_LAYERDROP, TORCH_LAYERDROP = "ours_layerdrop", "torch_layerdrop"
VARIANTS = (TORCH, TORCH_FP16, TORCH_POWERSGD, OURS, OURS_HIERARCHY, OURS_ADAPTIVE, OURS_LAYERDROP, TORCH_LAYERDROP)
LABELS = {
    TORCH: "torch DDP", TORCH_FP16: "torch DDP + fp16 hook", TORCH_POWERSGD: "torch DDP + PowerSGD rank 1",
    OURS: "ddp_ext (flat)", OURS_HIERARCHY: "ddp_ext, hierarchical_allreduce='auto'",
    OURS_ADAPTIVE: "ddp_ext + adaptive precision", OURS_LAYERDROP: "ddp_ext + LayerDrop p=0.5",
    TORCH_LAYERDROP: "torch DDP + LayerDrop p=0.5 (find_unused)",
}
LAYERDROP_P = 0.5
LAYERDROP_SEED = 2020
IN_FEATURES, WIDTH, BLOCKS, CLASSES = 256, 512, 8, 10
BATCH = 32  # per rank
# Short start-ups, so that every variant is past its own within the warm-up.
HOOKS = HookSettings(start_powerSGD_iter=2, adaptive_warmup=4, adaptive_check_every=4)


class ScaleoutMLP(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, WIDTH)
        blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(BLOCKS)]
        self.blocks = ddp_ext.LayerDrop(blocks, p=p, seed=LAYERDROP_SEED) if p > 0 else nn.Sequential(*blocks)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        return self.head(self.blocks(torch.relu(self.inp(x))))


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, IN_FEATURES, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def build(variant: str, seed: int):
    """(the DDP model, the hook state or None) of `variant`."""
    torch.manual_seed(seed)
    module = ScaleoutMLP(LAYERDROP_P if variant in (OURS_LAYERDROP, TORCH_LAYERDROP) else 0.0)
    if variant == OURS_HIERARCHY:
        return ddp_ext.DistributedDataParallel(module), None
    if variant in (OURS, OURS_LAYERDROP):
        return ddp_ext.DistributedDataParallel(module, hierarchical_allreduce=False), None
    if variant == OURS_ADAPTIVE:
        ddp = ddp_ext.DistributedDataParallel(module, hierarchical_allreduce=False)
        state = HOOKS.adaptive(off_when_slower=True)
        ddp.register_comm_hook(state, ddp_ext.adaptive_precision_hook)
        return ddp, state
    if variant == TORCH_LAYERDROP:
        return TorchDDP(module, find_unused_parameters=True), None
    if variant == TORCH_FP16:
        ddp = TorchDDP(module)
        ddp.register_comm_hook(None, fp16_compress_hook)
        return ddp, None
    if variant == TORCH_POWERSGD:
        return wrap_compression(TORCH_PSGD1, module, HOOKS)
    return TorchDDP(module), None
