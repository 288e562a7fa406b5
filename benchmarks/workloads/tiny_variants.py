"""The variants fixedcost and instructions run on the tiny MLP, each its own
replica from the same seed: local training, torch's DDP, ddp_ext, ddp_ext with
its step check on a collective of its own, and a second torch DDP (a control)."""

from torch import nn

from benchmarks.harness.product import with_separate_step_check
from benchmarks.workloads.replicas import LABELS as REPLICA_LABELS
from benchmarks.workloads.replicas import LOCAL, OURS, TORCH
from benchmarks.workloads.tiny_mlp import build_mlp

SEPARATE_CHECK = "ours_separate_check"
TORCH_CONTROL = "torch_control"
LABELS = {**REPLICA_LABELS, SEPARATE_CHECK: "ddp_ext, separate step check", TORCH_CONTROL: "torch DDP, second replica"}


def make(kind: str, seed: int) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from ddp_ext import DistributedDataParallel as OurDDP

    model = build_mlp(seed)
    if kind == LOCAL:
        return model
    if kind in (TORCH, TORCH_CONTROL):
        return TorchDDP(model)
    if kind == OURS:
        return OurDDP(model)
    if kind == SEPARATE_CHECK:
        return with_separate_step_check(model)
    raise ValueError(f"unknown variant {kind!r}")
