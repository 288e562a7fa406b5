"""Single-process checks of the compression experiment's pieces (no ranks, no timing)."""

import torch
import torch.distributed as dist

from ddp_ext.bench.compression_variants import in_effect
from ddp_ext.bench.counting_group import CountingProcessGroup
from ddp_ext.bench.in_order_hook import InOrder, in_order_hook


def test_in_effect_keeps_the_decision_in_force_and_those_after_it():
    records = [{"iteration": i} for i in (10, 20, 30, 40)]
    assert [r["iteration"] for r in in_effect(records, 25, 41)] == [20, 30, 40]
    assert [r["iteration"] for r in in_effect(records, 30, 40)] == [30]
    assert in_effect(records, 5, 9) == []


def test_in_order_hook_starts_a_bucket_once_the_previous_one_is_done():
    started, pending = [], []

    def hook(state, bucket):
        started.append(bucket)
        future = torch.futures.Future()
        pending.append(future)
        return future

    chain = InOrder(hook, None)
    first, second, third = (in_order_hook(chain, b) for b in ("b0", "b1", "b2"))
    assert started == ["b0"]
    pending[0].set_result(torch.zeros(1))
    assert started == ["b0", "b1"] and first.done() and not second.done()
    pending[1].set_result(torch.ones(1))
    pending[2].set_result(torch.full((1,), 2.0))
    assert started == ["b0", "b1", "b2"] and third.value().item() == 2.0
    assert in_order_hook(chain, "b3") is not None and started[-1] == "b3"  # previous done: starts at once


def test_counting_group_counts_allreduce_and_allgather_inputs():
    if dist.is_initialized():
        import pytest

        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = CountingProcessGroup(dist.distributed_c10d._get_default_group())
        group.allreduce([torch.zeros(10)]).wait()
        group.allgather([[torch.empty(3, dtype=torch.uint8)]], [torch.zeros(3, dtype=torch.uint8)]).wait()
        assert (group.allreduce_bytes, group.allgather_bytes) == (40, 3)
        assert group.take() == 43 and group.take() == 0
    finally:
        dist.destroy_process_group()
