"""Mismatches at construction: the same message on every rank, before any
gradient is averaged, never a hang (docs/DIAGNOSIS.md).

The last rank differs from the others in one way per case: a parameter's
shape (tests/diagnosis/test_model_check.py covers more of the model), the parameters
it ignores, its bucket caps, find_unused_parameters, static_graph, or
rebuild_buckets; or, at the first forward, the communication hook it
registered. Every rank must raise a RuntimeError whose text is the same on
every rank and names what differs. A hook registered after the first forward
on some ranks only, or different ones, is found by the next backward's step
check, with the same message on every rank and no hang.
"""

import dataclasses
from typing import Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddp_ext
from tests.support.harness import CaseTable


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


# --- Hooks registered after the first forward ------------------------------------------
# torch's DDP accepts them (once, at any time). Every backward's step check
# compares the ranks' hook fingerprints (Note [Hooks registered after the
# first forward] in reducer/agreement/step_check.h).

LATE_HOOKS = {
    "hook_on_last_rank_only": (None, "fp16_compress_hook"),
    "different_hooks": ("allreduce_hook", "fp16_compress_hook"),
    "same_hook": ("fp16_compress_hook", "fp16_compress_hook"),
}


def _hook_after_first_forward(rank, world_size, case_id):
    import datetime
    import time

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    # A group of its own with a short timeout: a rank's dropped bucket
    # allreduce must not hold up the end of the process for long.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=15))
    torch.manual_seed(0)
    # Two buckets, so the ranks without a new hook launch one during the backward.
    ddp = ddp_ext.DistributedDataParallel(
        nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4)), process_group=group, bucket_cap_mb=0.01
    )
    x = torch.randn(8, 64) + rank
    ddp(x).sum().backward()  # step 1: the hooks were compared at its forward
    hook = LATE_HOOKS[case_id][int(rank == world_size - 1)]
    if hook is not None:
        ddp.register_comm_hook(group, getattr(default_hooks, hook))
    outcome = (None, None, None)
    start = time.monotonic()
    try:
        for _ in range(2):
            ddp.zero_grad()
            ddp(x).sum().backward()
        grads = [p.grad.clone() for p in ddp.parameters()]
        outcome = (None, time.monotonic() - start, grads)
    except RuntimeError as e:
        outcome = (str(e), time.monotonic() - start, None)
    store = dist.distributed_c10d._get_default_store()
    store.add(f"late-hook-{case_id}", 1)  # not a collective: the group may hold a dropped allreduce
    while int(store.add(f"late-hook-{case_id}", 0)) < world_size:
        time.sleep(0.05)
    return outcome


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case_id", ["hook_on_last_rank_only", "different_hooks"])
def test_hooks_registered_after_the_first_forward_raise_the_same_message(case_id, world_size):
    from tests.support.spawn import run_ranks

    results = run_ranks(_hook_after_first_forward, world_size, case_id, timeout=150)
    messages = [message for message, _, _ in results]
    print(messages[0])
    assert all(m is not None for m in messages), f"a rank did not raise: {messages}"
    assert len(set(messages)) == 1, "the ranks' messages differ:\n" + "\n".join(messages)
    last = world_size - 1
    others = "rank 0" if world_size == 2 else "ranks 0, 1"
    for says in ("the ranks registered different communication hooks", "in the backward of training step 2",
                 f"rank {last}: hook", "were not averaged", "after the first forward"):
        assert says in messages[0], f"message lacks {says!r}:\n{messages[0]}"
    if case_id == "hook_on_last_rank_only":
        assert f"{others}: none" in messages[0], messages[0]
    # In the step that found it, within seconds: no rank waited for a partner.
    assert all(seconds < 10 for _, seconds, _ in results), [s for _, s, _ in results]


def test_the_same_hook_registered_after_the_first_forward_trains_on():
    from tests.support.spawn import run_ranks

    results = run_ranks(_hook_after_first_forward, 2, "same_hook", timeout=150)
    (message0, _, grads0), (message1, _, grads1) = results
    assert message0 is None and message1 is None, (message0, message1)
    for g0, g1 in zip(grads0, grads1):
        assert torch.equal(g0, g1)
