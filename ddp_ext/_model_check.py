"""Construction-time check that every rank wraps the same model."""

import json
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ddp_ext._collectives import allgather, wait

Named = Sequence[Tuple[str, torch.Tensor]]


def _describe(named_tensors: Named) -> List[str]:
    return [f"{name} {tuple(t.shape)} {t.dtype}".replace("torch.", "") for name, t in named_tensors]


def allgather_bytes(process_group: dist.ProcessGroup, payload: bytes, device) -> List[bytes]:
    """Every rank's `payload`, gathered with two allgathers on `process_group` itself,
    so any c10d process group works, registered with torch.distributed or not,
    written in Python too (see ddp_ext/_collectives.py)."""
    world_size = process_group.size()
    data = torch.tensor(list(payload), dtype=torch.uint8, device=device)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world_size)]
    wait(allgather(process_group, [lengths], [length]))
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(max(longest, 1), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    wait(allgather(process_group, [gathered], [padded]))
    return [bytes(d[: int(n.item())].cpu().tolist()) for n, d in zip(lengths, gathered)]


def _first_difference(reference: List[str], described: List[str]) -> int:
    return next(
        (i for i, (ours, theirs) in enumerate(zip(reference, described)) if ours != theirs),
        min(len(reference), len(described)),
    )


def _at(entries: List[str], index: int) -> str:
    return f"`{entries[index]}`" if index < len(entries) else "nothing"


def _ignored_differ(every_rank: list) -> None:
    reference = every_rank[0][2]
    for rank, described in enumerate(every_rank[1:], start=1):
        if described[2] != reference:
            only_0 = sorted(set(reference) - set(described[2]))
            only_r = sorted(set(described[2]) - set(reference))
            raise RuntimeError(
                "DDP expects same model across all ranks, but the ranks ignore different parameters and "
                f"buffers (_set_params_and_buffers_to_ignore_for_model): rank 0 alone ignores {only_0}, rank {rank} "
                f"alone ignores {only_r}. Their buckets would pair different gradients, and a parameter reduced on "
                "some ranks only would leave the others waiting: ignore the same names on every rank."
            )


def _settings_differ(every_rank: list) -> None:
    reference = every_rank[0][3]
    for rank, described in enumerate(every_rank[1:], start=1):
        differ = [key for key in reference if described[3].get(key) != reference[key]]
        if differ:
            values = "; ".join(f"{key}: rank 0 {reference[key]!r}, rank {rank} {described[3].get(key)!r}" for key in differ)
            raise RuntimeError(
                f"DistributedDataParallel's arguments differ across ranks ({values}). They decide which "
                "collectives each rank runs and how its buckets are cut, so ranks with different values would pair "
                "different gradients or wait for each other until the process group's timeout: pass the same "
                "values on every rank."
            )


def verify_same_model(
    process_group: dist.ProcessGroup,
    named_params: Named,
    device,
    named_broadcast: Named = (),
    ignored: Sequence[str] = (),
    settings: Optional[dict] = None,
    number: Optional[int] = None,
) -> Optional[int]:
    """Raises the same RuntimeError on every rank if the ranks ignore
    different parameters (`ignored`), if their parameters that require grad
    differ in count, name, shape or dtype, or so do the other tensors rank 0
    broadcasts at construction (`named_broadcast`: frozen parameters,
    buffers), which a broadcast would otherwise misplace silently (names the
    first entry that differs), or if the `settings` that must agree do.

    `number`: this rank's proposal for the wrapper's number in the store
    (ddp_ext/_diagnosis/hang.py, `store_key`), gathered in the same
    allgather; returns the largest proposal, the same on every rank."""
    ours = [_describe(named_params), _describe(named_broadcast), sorted(ignored), settings or {}, number]
    every_rank = [json.loads(p) for p in allgather_bytes(process_group, json.dumps(ours).encode(), device)]
    _ignored_differ(every_rank)
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
    _settings_differ(every_rank)
    proposals = [described[4] for described in every_rank if len(described) > 4 and described[4] is not None]
    return max(proposals) if proposals else None


def verify_module(
    process_group: dist.ProcessGroup, module, named_params: Named, ignored, include_buffers: bool,
    settings: Optional[dict] = None, number: Optional[int] = None,
) -> Optional[int]:
    """verify_same_model over all that the construction broadcast covers: a
    frozen parameter or buffer shaped differently would shift every tensor
    after it."""
    device = next((p.device for p in module.parameters() if p.device.type != "meta"), torch.device("cpu"))
    named_broadcast = [(n, p) for n, p in module.named_parameters() if not p.requires_grad and n not in ignored]
    if include_buffers:
        named_broadcast += [(n, b) for n, b in module.named_buffers() if n not in ignored]
    return verify_same_model(process_group, named_params, device, named_broadcast, sorted(ignored), settings, number)
