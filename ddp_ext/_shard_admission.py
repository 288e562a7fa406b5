"""What the sharded optimizer admits (ddp_ext/_sharded_optimizer.py): the
optimizers it can step by pieces, the wrapper's settings it can shard
under, and shard_min_bytes, agreed by every rank. Each check returns why
not, or '', the same on every rank."""

from typing import List

import torch
import torch.distributed as dist

from ddp_ext._optimizer_overlap import shown_names

# Note [Elementwise optimizers]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Sharding is exact for an optimizer whose update of each element depends
# only on that element's gradient and state, and on scalars the same for
# every element (the group's values, a step count). torch.optim's below
# are (foreach, fused or not). An optimizer of the user's own is admitted
# when its class says so: `ddp_ext_elementwise = True`.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad,
               torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax, torch.optim.Adadelta)
_MIXING = {
    "LBFGS": "its step needs a closure and mixes every parameter's gradient in one line search",
    "SparseAdam": "it steps sparse gradients, which the buckets do not reduce-scatter",
    "Adafactor": "it factors the second moment of a matrix into its rows' and columns' means, which look across "
                 "the whole parameter",
}


def elementwise_refusal(optimizer) -> str:
    """Why `optimizer` cannot be sharded exactly, or ''."""
    cls = type(optimizer)
    if cls in ELEMENTWISE or getattr(cls, "ddp_ext_elementwise", False) is True:
        return ""
    reason = _MIXING.get(cls.__name__)
    if reason:
        return f"cannot shard {cls.__qualname__}: {reason}, so a rank holding part of a parameter cannot step it."
    return (f"cannot shard {cls.__qualname__}: only optimizers that update each element from its own gradient and "
            "state can be stepped by pieces (torch.optim's SGD, Adam, AdamW, RMSprop, Adagrad, NAdam, RAdam, Adamax, "
            "Adadelta). If yours does, set `ddp_ext_elementwise = True` on its class.")


# Buckets of fewer bytes are replicated, not sharded (Note [Replicated small
# buckets] in reducer/transport/reduce_scatter.h); docs/SHARDING.md says why 64 KiB.
SHARD_MIN_BYTES = 64 * 2**10


def agreed_shard_min_bytes(value, group, device, refusal: str = "") -> str:
    """Why `value` cannot be shard_min_bytes, or '': a number of bytes >= 0,
    the same on every rank (a collective: every rank learns whether any
    rank's differs, so every rank refuses alike). `refusal`: this rank's
    other reason to refuse, if any; a rank without one refuses too when
    another rank has one."""
    valid = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**62
    mine = value if valid else -1
    try:
        nccl = dist.get_backend(group) == "nccl"
    except (RuntimeError, ValueError):  # a group of another kind, which `refusal` names
        nccl = False
    seen = torch.tensor([mine, -mine, int(bool(refusal))], dtype=torch.int64, device=device if nccl else "cpu")
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    if refusal:
        return refusal
    if int(seen[2]):
        return "was refused on another rank (that rank's error says why): every rank refuses alike."
    if not valid:
        return (f"takes shard_min_bytes as a number of bytes >= 0 (got {value!r}): buckets of fewer bytes are "
                "allreduced and stepped whole on every rank, 0 shards every bucket.")
    if int(seen[0]) != value or -int(seen[1]) != value:
        return (f"found shard_min_bytes={value} here but not on every rank (from {-int(seen[1])} to "
                f"{int(seen[0])}, -1 for a value refused): every rank must decide alike which buckets it "
                "shards. Pass the same value on every rank.")
    return ""


def settings_refusal(module, named, hooks: List[str], layer_drop: bool, overlap_forward, group) -> str:
    """Why this wrapper cannot shard its optimizer, or '' (the same on every
    rank: it reads settings every rank shares)."""
    if overlap_forward not in (True, False, None):
        return (f"takes overlap_forward=True or False (got {overlap_forward!r}): the all-gathers of every bucket "
                "go behind the next forward, there is no fraction to hold.")
    if overlap_forward:
        devices = sorted({p.device.type for _, p in named})
        if devices != ["cpu"]:
            return (f"overlaps the all-gathers with the next forward for a module on the CPU only (this one is on "
                    f"{devices}): use overlap_forward=False.")
    if hooks:
        return (f"cannot shard with a communication hook registered ({'; '.join(hooks)}): the sharded optimizer "
                "reduce-scatters each bucket itself. Use one or the other.")
    if layer_drop:
        return ("cannot shard with layer dropping (ddp_ext.LayerDrop): a dropped layer's bucket is not reduced, "
                "so its shard would not be stepped. Use one or the other.")
    backend = None
    try:
        backend = dist.get_backend(group)
    except (RuntimeError, ValueError):
        pass
    if backend not in ("gloo", "nccl"):
        return (f"needs a Gloo or NCCL process group (got {type(group).__name__}, backend {backend}): the shards "
                "are reduce-scattered and all-gathered with reduce_scatter_tensor and all_gather_into_tensor, "
                "which the MPI and round-robin groups do not offer.")
    sparse = [name for name, m in module.named_modules() if getattr(m, "sparse", False) is True]
    if sparse:
        return (f"cannot shard sparse gradients ({shown_names(sparse)} set sparse=True): only dense buckets are "
                "reduce-scattered. Use dense gradients.")
    strided = [name for name, p in named if not p.is_contiguous()]
    if strided:
        return (f"cannot shard non-contiguous parameters ({shown_names(strided)}): the shards are ranges of each "
                "parameter's elements in memory order. Make them contiguous (e.g. .contiguous() before wrapping).")
    return ""
