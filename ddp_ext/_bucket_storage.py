"""Which buckets' parameters live in their bucket's storage, and why the
others copy (Note [Parameters in the bucket's storage] in
ddp_ext/_shard_plan.py): the sharded optimizer asks at each step.

A bucket that stays on the copying path says why once per layout and
reason, on the package's logger (`logging.getLogger("ddp_ext")`, INFO).
"""

import logging
from collections import defaultdict
from typing import Dict, Iterable, List, Tuple

import torch

from ddp_ext._shard_plan import ShardPlan, holders, storage_key

_log = logging.getLogger("ddp_ext")

# A piece's old view and its new one: the optimizer's state follows it.
Moved = List[Tuple[torch.Tensor, torch.Tensor]]


class BucketStorage:
    """The storages made for buckets, and, by layout, why a bucket's
    parameters were not re-pointed at the last step. Holds the parameters
    and their names, not the plans (the caller hands those in)."""

    def __init__(self, params: List[torch.Tensor], names: Dict[int, str], rank: int):
        self.params = params
        self.names = names
        self.rank = rank
        self.made: set = set()  # the storages made for buckets, by storage_key
        self.in_place = True  # False: every bucket copies (a test's switch)
        self.copying: Dict[Tuple, str] = {}  # by layout: why its parameters were not re-pointed, last step
        self._told: set = set()  # (layout, reason) pairs logged already

    def place(self, plans: List[ShardPlan], every: Iterable[ShardPlan], settled: bool) -> Moved:
        """Keeps or makes each of `plans`' parameters views of its storage,
        where it can; `every` is all the live plans (their storages count as
        ours). Returns the pieces' (old, new) views, for the state to follow."""
        moved: Moved = []
        members = {plan.layout: self._members(plan) for plan in plans}
        for plan in plans:
            if plan.storage is not None and not plan.bound(members[plan.layout]):
                moved += plan.unbind()
        unbound = [plan for plan in plans if plan.storage is None]
        if not (settled and self.in_place and unbound):
            return moved
        users: Dict[int, int] = defaultdict(int)  # storage -> the tensors of ours that use it
        for p in self.params:
            if p.numel():
                users[storage_key(p)] += 1
        for other in every:
            if other.storage is not None:
                users[storage_key(other.storage)] += other.own_views
        self.made &= set(users)
        for plan in unbound:
            why = self._refusal(plan, members[plan.layout], users)
            if why:
                self._copy(plan.layout, why)
                continue
            self.copying.pop(plan.layout, None)
            for p in members[plan.layout]:
                if p.numel():
                    users[storage_key(p)] -= 1
            moved += plan.bind(members[plan.layout])
            key = storage_key(plan.storage)
            self.made.add(key)
            users[key] += len(members[plan.layout]) + plan.own_views
        return moved

    def _members(self, plan: ShardPlan) -> List[torch.Tensor]:
        return [self.params[index] for index, _, _ in plan.layout]

    def _copy(self, layout: Tuple, why: str) -> None:
        self.copying[layout] = why
        if (layout, why) not in self._told:
            self._told.add((layout, why))
            first = min(index for index, _, _ in layout)
            _log.info("rank %d: the bucket of %d parameters from reducer index %d copies its parameters through "
                      "the gather buffers instead of holding them in its storage: %s", self.rank, len(layout),
                      first, why)

    def _refusal(self, plan: ShardPlan, members: List[torch.Tensor], users: Dict[int, int]) -> str:
        """Why the bucket's parameters cannot be re-pointed now, or ''."""
        for p in members:
            name = self.names.get(id(p), f"a parameter of shape {tuple(p.shape)}")
            if not plan.fits(p):
                return f"{name} is not a dense contiguous tensor of the bucket's dtype and device"
            if not p.numel():
                continue
            key = storage_key(p)
            if users[key] > 1 and key not in self.made:
                return f"{name} shares its memory with another parameter"
            if holders(p) != users[key]:
                return f"something else holds a view of {name}'s memory"
        return ""
