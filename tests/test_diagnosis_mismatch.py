"""Mismatches at construction: the same message on every rank, before any
gradient is averaged, never a hang (docs/DIAGNOSIS.md).

The last rank differs from the others in one way per case: a parameter's
shape (tests/test_model_check.py covers more of the model), the parameters
it ignores, its bucket caps, find_unused_parameters, static_graph, or
rebuild_buckets; or, at the first forward, the communication hook it
registered. Every rank must raise a RuntimeError whose text is the same on
every rank and names what differs.
"""

import dataclasses
from typing import Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddp_ext
from tests.harness import CaseTable


@dataclasses.dataclass(frozen=True)
class Mismatch:
    id: str
    # (keyword arguments of every rank but the last, of the last rank)
    kwargs: Tuple[dict, dict] = ({}, {})
    ignore_on_last: Tuple[str, ...] = ()
    wider_on_last: bool = False
    says: Tuple[str, ...] = ()


CASES = [
    Mismatch("shape", wider_on_last=True, says=("DDP expects same model across all ranks", "parameter 0 differs")),
    Mismatch(
        "ignored_parameters",
        ignore_on_last=("1.weight", "1.bias"),
        says=("ignore different parameters", "_set_params_and_buffers_to_ignore_for_model", "'1.weight'"),
    ),
    Mismatch("bucket_caps", ({"bucket_cap_mb": 25}, {"bucket_cap_mb": 1}), says=("bucket_cap_mb: rank 0",)),
    Mismatch(
        "find_unused_parameters",
        ({}, {"find_unused_parameters": True}),
        says=("find_unused_parameters: rank 0 False",),
    ),
    Mismatch("static_graph", ({}, {"static_graph": True}), says=("static_graph: rank 0 False",)),
    Mismatch("rebuild_buckets", ({}, {"rebuild_buckets": "never"}), says=("rebuild_buckets: rank 0 'continuous'",)),
]


def _construct(rank, world_size, case: Mismatch):
    last = rank == world_size - 1
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    if case.wider_on_last:
        module = nn.Sequential(nn.Linear(4, 4 + int(last)), nn.Linear(4 + int(last), 4))
    if last and case.ignore_on_last:
        ddp_ext.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(case.ignore_on_last))
    try:
        ddp_ext.DistributedDataParallel(module, **case.kwargs[int(last)])
    except RuntimeError as e:
        return str(e)
    return None


TABLE = CaseTable(_construct, CASES)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_rank_raises_the_same_message(case, world_size):
    messages = TABLE.results(world_size, case)
    assert all(m is not None for m in messages), f"a rank did not raise: {messages}"
    assert len(set(messages)) == 1, "the ranks' messages differ:\n" + "\n".join(messages)
    for says in case.says:
        assert says in messages[0], f"message lacks {says!r}:\n{messages[0]}"
    if case.id not in ("shape", "ignored_parameters"):
        assert f"rank {world_size - 1}" in messages[0], messages[0]


def _same_everywhere(rank, world_size, _):
    ddp = ddp_ext.DistributedDataParallel(nn.Linear(4, 4), bucket_cap_mb=1, find_unused_parameters=True)
    ddp(torch.randn(2, 4)).sum().backward()
    dist.barrier()
    return True


def test_the_same_arguments_construct():
    table = CaseTable(_same_everywhere, [Mismatch("none")])
    assert table.results(2, Mismatch("none")) == [True, True]


# Hooks are registered after construction, so they are compared at the first
# forward: (the hook of every rank but the last, the last rank's), None for none.
HOOK_CASES = [
    Mismatch("hook_on_last_rank_only", says=("different communication hooks", "rank 0: none", "fp16_compress_hook")),
    Mismatch("different_hooks", says=("different communication hooks", "allreduce_hook", "fp16_compress_hook")),
]
_HOOKS = {
    "hook_on_last_rank_only": (None, "fp16_compress_hook"),
    "different_hooks": ("allreduce_hook", "fp16_compress_hook"),
}


def _first_forward_with_hooks(rank, world_size, case: Mismatch):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    ddp = ddp_ext.DistributedDataParallel(nn.Linear(4, 4))
    hook = _HOOKS[case.id][int(rank == world_size - 1)]
    if hook is not None:
        ddp.register_comm_hook(None, getattr(default_hooks, hook))
    try:
        ddp(torch.randn(2, 4)).sum().backward()
    except RuntimeError as e:
        return (str(e), [p.grad for p in ddp.parameters()])
    return (None, None)


HOOK_TABLE = CaseTable(_first_forward_with_hooks, HOOK_CASES)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", HOOK_CASES, ids=lambda c: c.id)
def test_different_hooks_raise_the_same_message_at_the_first_forward(case, world_size):
    results = HOOK_TABLE.results(world_size, case)
    messages = [message for message, _ in results]
    assert all(m is not None for m in messages), f"a rank did not raise: {messages}"
    assert len(set(messages)) == 1, "the ranks' messages differ:\n" + "\n".join(messages)
    for says in case.says:
        assert says in messages[0], f"message lacks {says!r}:\n{messages[0]}"
    assert f"rank {world_size - 1}: fp16_compress_hook" in messages[0], messages[0]
    # Raised in the forward, before any gradient was computed, let alone averaged.
    assert all(g is None for _, grads in results for g in grads)
