"""The DDP set-ups the `compression` experiment compares: torch's DDP without
a hook, with its float16 hook and with PowerSGD; ddp_ext without a hook and
with its adaptive-precision hook (defaults, and never switching itself off).

Hook state (PowerSGD's iteration count, the adaptive hook's warm-up and
windows) decides what a variant sends, so `settle_iterations` says how many
iterations a variant needs before it runs as it will from then on.
"""

import dataclasses
from typing import Optional

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddp_ext
from benchmarks.workloads.in_order_hook import InOrder, in_order_hook

TORCH, TORCH_FP16, TORCH_PSGD1, TORCH_PSGD4 = "torch", "torch_fp16", "torch_powersgd1", "torch_powersgd4"
OURS, ADAPTIVE, ADAPTIVE_ALWAYS = "ours", "ours_adaptive", "ours_adaptive_always"
VARIANTS = (TORCH, TORCH_FP16, TORCH_PSGD1, TORCH_PSGD4, OURS, ADAPTIVE, ADAPTIVE_ALWAYS)
ADAPTIVE_VARIANTS = (ADAPTIVE, ADAPTIVE_ALWAYS)
LABELS = {
    TORCH: "torch DDP", TORCH_FP16: "torch DDP + fp16 hook", TORCH_PSGD1: "torch DDP + PowerSGD rank 1",
    TORCH_PSGD4: "torch DDP + PowerSGD rank 4", OURS: "ddp_ext", ADAPTIVE: "ddp_ext + adaptive",
    ADAPTIVE_ALWAYS: "ddp_ext + adaptive, never off",
}

# PowerSGD compresses from this iteration on (torch's default is 1000; 10 is
# past DDP's bucket rebuild after iteration 1, so timed blocks see it compress).
START_POWERSGD_ITER = 10
# After the rebuild of buckets at the end of iteration 1, a DDP without hook
# state sends the same every iteration.
REBUILD_ITERATIONS = 2


@dataclasses.dataclass(frozen=True)
class HookSettings:
    """What the hooks are told; --quick shortens the adaptive hook's windows."""
    start_powerSGD_iter: int = START_POWERSGD_ITER
    adaptive_warmup: int = ddp_ext.AdaptivePrecision().warmup_iterations
    adaptive_check_every: int = ddp_ext.AdaptivePrecision().check_every

    def adaptive(self, off_when_slower: bool) -> ddp_ext.AdaptivePrecision:
        return ddp_ext.AdaptivePrecision(warmup_iterations=self.adaptive_warmup,
                                         check_every=self.adaptive_check_every, off_when_slower=off_when_slower)

    def settle_iterations(self, variant: str) -> int:
        """Iterations after which `variant` has left its start-up behaviour:
        PowerSGD compresses, the adaptive hook has measured its first
        compressed window and chosen on measurement."""
        if variant in ADAPTIVE_VARIANTS:
            return self.adaptive_warmup + self.adaptive_check_every
        if variant in (TORCH_PSGD1, TORCH_PSGD4):
            return self.start_powerSGD_iter
        return REBUILD_ITERATIONS


# The adaptive hook's warm-up outlasts the first rebuild (iteration 1 runs
# with torch's first bucket, iteration 2 gives the rebuilt buckets' figures).
QUICK_HOOKS = HookSettings(start_powerSGD_iter=2, adaptive_warmup=4, adaptive_check_every=2)


def wrap(variant: str, module: nn.Module, hooks: HookSettings, group: Optional[dist.ProcessGroup] = None):
    """(the DDP model, its hook state or None) for `variant`, over `group`
    (default: the default group)."""
    if variant in (OURS, *ADAPTIVE_VARIANTS):
        ddp = ddp_ext.DistributedDataParallel(module, process_group=group)
        if variant == OURS:
            return ddp, None
        state = hooks.adaptive(off_when_slower=variant == ADAPTIVE)
        ddp.register_comm_hook(state, ddp_ext.adaptive_precision_hook)
        return ddp, state
    ddp = TorchDDP(module, process_group=group)
    if variant == TORCH:
        return ddp, None
    if variant == TORCH_FP16:
        ddp.register_comm_hook(group, fp16_compress_hook)  # its state is the group (None: the default one)
        return ddp, None
    rank = {TORCH_PSGD1: 1, TORCH_PSGD4: 4}[variant]
    state = PowerSGDState(group, matrix_approximation_rank=rank, start_powerSGD_iter=hooks.start_powerSGD_iter)
    ddp.register_comm_hook(InOrder(powerSGD_hook, state), in_order_hook)
    return ddp, state


def decisions(state: ddp_ext.AdaptivePrecision) -> list:
    """The adaptive hook's decisions as plain records."""
    return [{"iteration": d.iteration, "mode": d.mode, "formats": list(d.formats), "full_cost_ms": d.full_cost_ms,
             "compressed_cost_ms": d.compressed_cost_ms} for d in state.decisions()]


def in_effect(records: list, first: int, end: int) -> list:
    """The decisions that governed iterations first..end-1: the last one
    taken at or before `first`, and those taken after it, before `end`."""
    before = [r for r in records if r["iteration"] <= first]
    return before[-1:] + [r for r in records if first < r["iteration"] < end]
