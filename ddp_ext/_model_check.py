"""Construction-time check that every rank wraps the same model."""

import json
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

Named = Sequence[Tuple[str, torch.Tensor]]


def _describe(named_tensors: Named) -> List[str]:
    return [f"{name} {tuple(t.shape)} {t.dtype}".replace("torch.", "") for name, t in named_tensors]


def _allgather_bytes(process_group: dist.ProcessGroup, payload: bytes, device) -> List[bytes]:
    """Every rank's `payload`, gathered with two allgathers on `process_group` itself,
    so any c10d process group works, registered with torch.distributed or not."""
    world_size = process_group.size()
    data = torch.tensor(list(payload), dtype=torch.uint8, device=device)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world_size)]
    process_group.allgather([lengths], [length]).wait()
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(max(longest, 1), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    process_group.allgather([gathered], [padded]).wait()
    return [bytes(d[: int(n.item())].cpu().tolist()) for n, d in zip(lengths, gathered)]


def _first_difference(reference: List[str], described: List[str]) -> int:
    return next(
        (i for i, (ours, theirs) in enumerate(zip(reference, described)) if ours != theirs),
        min(len(reference), len(described)),
    )


def _at(entries: List[str], index: int) -> str:
    return f"`{entries[index]}`" if index < len(entries) else "nothing"


def verify_same_model(
    process_group: dist.ProcessGroup, named_params: Named, device, named_broadcast: Named = ()
) -> None:
    """Raises the same RuntimeError on every rank if the ranks' parameters that
    require grad differ in count, name, shape or dtype, or so do the other
    tensors rank 0 broadcasts at construction (`named_broadcast`: frozen
    parameters, buffers), which a broadcast would otherwise misplace
    silently; names the first entry that differs."""
    ours = [_describe(named_params), _describe(named_broadcast)]
    every_rank = [json.loads(p) for p in _allgather_bytes(process_group, json.dumps(ours).encode(), device)]
    reference = every_rank[0]
    for rank, described in enumerate(every_rank[1:], start=1):
        if described[0] != reference[0]:
            index = _first_difference(reference[0], described[0])
            count = ""
            if len(reference[0]) != len(described[0]):
                count = (
                    f"rank 0 has {len(reference[0])} parameters that require grad and rank {rank} "
                    f"has {len(described[0])}; "
                )
            raise RuntimeError(
                f"DDP expects same model across all ranks, but {count}parameter {index} differs: "
                f"rank 0 has {_at(reference[0], index)}, rank {rank} has {_at(described[0], index)} "
                "(name shape dtype). Build the model identically on every rank, with the same "
                "parameters frozen, before wrapping it."
            )
        if described[1] != reference[1]:
            index = _first_difference(reference[1], described[1])
            raise RuntimeError(
                "DDP expects same model across all ranks, but the frozen parameters and buffers that "
                f"rank 0 broadcasts at construction differ: rank 0 has {_at(reference[1], index)}, "
                f"rank {rank} has {_at(described[1], index)} (name shape dtype; rank 0 has "
                f"{len(reference[1])} such tensors, rank {rank} has {len(described[1])}). Build the model "
                "identically on every rank, or pass broadcast_buffers=False to keep buffers rank-local."
            )


def verify_module(process_group: dist.ProcessGroup, module, named_params: Named, ignored, include_buffers: bool) -> None:
    """verify_same_model over all that the construction broadcast covers: a
    frozen parameter or buffer shaped differently would shift every tensor
    after it."""
    device = next((p.device for p in module.parameters() if p.device.type != "meta"), torch.device("cpu"))
    named_broadcast = [(n, p) for n, p in module.named_parameters() if not p.requires_grad and n not in ignored]
    if include_buffers:
        named_broadcast += [(n, b) for n, b in module.named_buffers() if n not in ignored]
    verify_same_model(process_group, named_params, device, named_broadcast)
