"""Construction-time check that every rank wraps the same model."""

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist


def _describe(named_params: Sequence[Tuple[str, torch.Tensor]]) -> List[str]:
    return [f"{name} {tuple(p.shape)} {p.dtype}".replace("torch.", "") for name, p in named_params]


def _allgather_strings(process_group: dist.ProcessGroup, lines: List[str], device) -> List[List[str]]:
    """Every rank's `lines`, gathered with two allgathers on `process_group` itself,
    so any c10d process group works, registered with torch.distributed or not."""
    world_size = process_group.size()
    payload = torch.tensor(list("\n".join(lines).encode()), dtype=torch.uint8, device=device)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world_size)]
    process_group.allgather([lengths], [length]).wait()
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(max(longest, 1), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    process_group.allgather([gathered], [padded]).wait()
    result = []
    for n, data in zip(lengths, gathered):
        text = bytes(data[: int(n.item())].cpu().tolist()).decode()
        result.append(text.split("\n") if text else [])
    return result


def verify_same_model(process_group: dist.ProcessGroup, named_params, device) -> None:
    """Raises the same RuntimeError on every rank if the ranks' parameters differ
    in count, name, shape or dtype; names the first parameter that differs."""
    every_rank = _allgather_strings(process_group, _describe(named_params), device)
    reference = every_rank[0]
    for rank, described in enumerate(every_rank[1:], start=1):
        if described == reference:
            continue
        index = next(
            (i for i, (ours, theirs) in enumerate(zip(reference, described)) if ours != theirs),
            min(len(reference), len(described)),
        )

        def at(entries):
            return f"`{entries[index]}`" if index < len(entries) else "nothing"

        count = ""
        if len(reference) != len(described):
            count = (
                f"rank 0 has {len(reference)} parameters that require grad and rank {rank} "
                f"has {len(described)}; "
            )
        raise RuntimeError(
            f"DDP expects same model across all ranks, but {count}parameter {index} differs: "
            f"rank 0 has {at(reference)}, rank {rank} has {at(described)} (name shape dtype). "
            "Build the model identically on every rank, with the same parameters frozen, "
            "before wrapping it."
        )
