"""Construction-time agreement: every rank learns every rank's problems and
settings before any rank goes on, so a bad setting raises on every rank
instead of leaving the others waiting in a collective."""

from typing import Any, Dict, List

import torch.distributed as dist


def agree(what: str, problems: List[str], same: Dict[str, Any], facts: Any) -> List[Any]:
    """Gathers (problems, same, facts) from every rank of the default group
    (a collective: every rank calls it, in the same order) and raises the
    same ValueError on every rank if any rank found a problem or any value
    of `same` differs between ranks. Returns every rank's `facts`, by rank."""
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (problems, same, facts))
    lines = []
    if all(theirs == gathered[0][0] for theirs, _, _ in gathered):
        lines += [f"every rank: {problem}" for problem in gathered[0][0]]
    else:
        for rank, (theirs, _, _) in enumerate(gathered):
            lines += [f"rank {rank}: {problem}" for problem in theirs]
    if not lines:
        reference = gathered[0][1]
        for rank, (_, theirs, _) in enumerate(gathered):
            differing = sorted(k for k in set(reference) | set(theirs) if reference.get(k) != theirs.get(k))
            lines += [f"rank {rank} has {k}={theirs.get(k)!r}, rank 0 has {reference.get(k)!r}" for k in differing]
    if lines:
        raise ValueError(f"{what}: " + "; ".join(lines))
    return [facts for _, _, facts in gathered]
