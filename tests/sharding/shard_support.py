"""What the sharding tests share: one training loop run with ddp_ext's
sharded optimizer or with torch's DDP and a plain optimizer, and the
optimizer state flattened into comparable tensors."""

import dataclasses
import io
from typing import Any, Dict, Optional, Tuple

import torch

from tests.support import models

SMALL_BUCKETS = 0.0001  # several buckets per model; shards cut through parameters


def optimizer_of(name: str, module) -> torch.optim.Optimizer:
    """Two parameter groups with different learning rates."""
    params = list(module.parameters())
    groups = [{"params": params[:2], "lr": 0.05}, {"params": params[2:]}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.01)
    if name == "adam":
        return torch.optim.Adam(groups, lr=0.01)
    if name == "adam_foreach":
        return torch.optim.Adam(groups, lr=0.01, foreach=True, amsgrad=True)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)
    if name == "rmsprop":
        return torch.optim.RMSprop(groups, lr=0.01, momentum=0.5, centered=True)
    if name == "adagrad":
        return torch.optim.Adagrad(groups, lr=0.05)
    if name == "nadam":
        return torch.optim.NAdam(groups, lr=0.01)
    raise KeyError(name)


@dataclasses.dataclass(frozen=True)
class Run:
    model: str = "deep"
    optimizer: str = "adam"
    steps: int = 4
    micro_batches: int = 1  # all but the last under no_sync
    ddp: Tuple[Tuple[str, Any], ...] = (("bucket_cap_mb", SMALL_BUCKETS),)
    scheduler: bool = True  # a StepLR stepped after each optimizer.step()
    lr_after_backward: bool = False  # each group's lr set between backward() and step()
    between_steps: bool = False  # EMA, deepcopy, torch.save and an eval forward after each step
    clip: float = 0.0  # clip_grad_norm_(clip) before each step
    freeze_first: bool = False  # the first layer's weight frozen (requires_grad=False, kept in the optimizer)
    shard_min_bytes: int = 0  # 0: every bucket sharded; above, the smaller buckets replicated

    @property
    def id(self) -> str:
        parts = [self.model, self.optimizer] + [f"{k}={v}" for k, v in self.ddp if k != "bucket_cap_mb"]
        for flag in ("lr_after_backward", "between_steps", "freeze_first"):
            if getattr(self, flag):
                parts.append(flag)
        if self.micro_batches > 1:
            parts.append(f"micro{self.micro_batches}")
        if self.clip:
            parts.append(f"clip{self.clip}")
        if self.shard_min_bytes:
            parts.append(f"replicated<{self.shard_min_bytes}")
        return "-".join(parts)


def run(**kwargs) -> Run:
    ddp = dict(kwargs.pop("ddp", {}))
    ddp.setdefault("bucket_cap_mb", SMALL_BUCKETS)
    return Run(ddp=tuple(sorted(ddp.items())), **kwargs)


def wrapped(r: Run, kind: str, seed: int = models.MODEL_SEED):
    """(module, wrapper, optimizer, scheduler): kind 'sharded', 'overlapped'
    (sharded, the all-gathers behind the next forward) or 'torch'."""
    module = models.build(r.model, seed)
    if r.freeze_first:
        next(module.parameters()).requires_grad_(False)
    if kind == "torch":
        ddp = torch.nn.parallel.DistributedDataParallel(module, **dict(r.ddp))
    else:
        import ddp_ext

        ddp = ddp_ext.DistributedDataParallel(module, **dict(r.ddp))
    optimizer = optimizer_of(r.optimizer, module)
    if kind == "sharded":
        ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=r.shard_min_bytes)
    if kind == "overlapped":
        ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=r.shard_min_bytes, overlap_forward=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5) if r.scheduler else None
    return module, ddp, optimizer, scheduler


def train_steps(r: Run, kind: str, ddp, optimizer, scheduler, rank: int, world_size: int, steps) -> None:
    for step in steps:
        for micro in range(r.micro_batches):
            args, target = models.rank_batch(r.model, step, micro, rank, world_size, per_rank=4)
            last = micro == r.micro_batches - 1
            if last:
                models.MODELS[r.model].loss(ddp(*args), target).backward()
            else:
                with ddp.no_sync():
                    models.MODELS[r.model].loss(ddp(*args), target).backward()
        if r.lr_after_backward:
            for number, group in enumerate(optimizer.param_groups):
                group["lr"] = 0.01 / (1 + step + number)
        if r.clip:
            if kind == "torch":
                torch.nn.utils.clip_grad_norm_(ddp.module.parameters(), r.clip)
            else:
                ddp.clip_grad_norm_(r.clip)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        if r.between_steps:
            between(ddp, r, rank, world_size, step)


def between(ddp, r: Run, rank: int, world_size: int, step: int) -> None:
    """What users do between step() and the next forward."""
    import copy

    ema = [p.detach().clone() for p in ddp.module.parameters()]
    for e, p in zip(ema, ddp.module.parameters()):
        e.mul_(0.9).add_(p.detach(), alpha=0.1)
    copy.deepcopy(ddp.module)
    torch.save(ddp.module.state_dict(), io.BytesIO())
    with torch.no_grad():
        args, _ = models.rank_batch(r.model, step, 9, rank, world_size, per_rank=4)
        ddp.module(*args)


def optimizer_tensors(state_dict: Dict) -> Dict[str, torch.Tensor]:
    """An optimizer's state_dict as named tensors (ints and floats as tensors)."""
    out = {}
    for number, state in state_dict["state"].items():
        for key, value in state.items():
            if value is None:
                continue
            out[f"{number}.{key}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    for number, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"group{number}.{key}"] = torch.tensor(value, dtype=torch.float64)
    return out


def trained(rank: int, world_size: int, r: Run, kind: str) -> Dict[str, Dict[str, torch.Tensor]]:
    module, ddp, optimizer, scheduler = wrapped(r, kind)
    train_steps(r, kind, ddp, optimizer, scheduler, rank, world_size, range(r.steps))
    return {
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
        "optimizer": optimizer_tensors(optimizer.state_dict()),
    }
