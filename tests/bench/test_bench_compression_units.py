"""Single-process checks of the compression experiment's pieces (no ranks, no timing)."""

import torch
import torch.distributed as dist

from benchmarks.harness.recording_group import RecordingProcessGroup
from benchmarks.workloads.compression_variants import in_effect
from benchmarks.workloads.in_order_hook import InOrder, in_order_hook


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


def test_recording_group_records_collectives_and_counts_allreduce_and_allgather_bytes():
    # A group of its own (no default group): the test runs whatever ran before it.
    group = RecordingProcessGroup(dist.ProcessGroupGloo(dist.HashStore(), 0, 1))
    group.allreduce([torch.zeros(10)]).wait()
    group.broadcast([torch.zeros(2, dtype=torch.float16)]).wait()
    group.allgather([[torch.empty(3, dtype=torch.uint8)]], [torch.zeros(3, dtype=torch.uint8)]).wait()
    assert group.take_bytes() == 43 and group.take_bytes() == 0  # the broadcast is not counted
    group.allreduce([torch.zeros(4, dtype=torch.float64)]).wait()
    assert group.take() == [("allreduce", [("float64", 4)])] and group.take() == [] and group.take_bytes() == 0
