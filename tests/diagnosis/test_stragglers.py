"""Stragglers: a rank persistently slower in data loading, forward or
backward is named, with the phase, from figures the ranks exchange on the
step check (Note [Stragglers] in reducer/observation/step_timings.h); balanced ranks are not
(no false alarms under this machine's noise)."""

import time
import warnings

import pytest
import torch
import torch._dynamo  # noqa: F401 - imported by the first forward otherwise
from torch import nn

import ddp_ext
from ddp_ext._diagnosis.stragglers import Stragglers
from tests.support.spawn import run_ranks

EVERY = 10
SLEEP_S = 0.03


class _Net(nn.Module):
    def __init__(self, sleep_in=None):
        super().__init__()
        self.sleep_in = sleep_in
        self.fc0 = nn.Linear(8, 8)
        self.fc1 = nn.Linear(8, 4)

    def forward(self, x):
        if self.sleep_in == "forward":
            time.sleep(SLEEP_S)
        return self.fc1(torch.relu(self.fc0(x)))


def _train(rank, world_size, slow_phase, steps):
    torch.manual_seed(0)
    slow = rank == world_size - 1 and slow_phase is not None
    net = _Net("forward" if slow and slow_phase == "forward" else None)
    ddp = ddp_ext.DistributedDataParallel(net)
    ddp.watch_stragglers(every=EVERY)
    if slow and slow_phase == "backward":
        net.fc1.weight.register_hook(lambda g: time.sleep(SLEEP_S))
    x = torch.randn(4, 8) + rank
    first_named = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, steps + 1):
            if slow and slow_phase == "data wait":
                time.sleep(SLEEP_S)
            ddp(x).pow(2).mean().backward()
            if first_named is None and any("persistently slower" in str(w.message) for w in caught):
                first_named = step
    alerts = [str(w.message) for w in caught if "persistently slower" in str(w.message)]
    return dict(alerts=alerts, first_named=first_named, report=ddp.straggler_report())


@pytest.mark.parametrize("phase", ["data wait", "forward", "backward"])
def test_a_slow_rank_is_named_with_its_phase(phase):
    for rank, out in enumerate(run_ranks(_train, 3, phase, 8 * EVERY, timeout=240)):
        assert out["alerts"], f"rank {rank}: no warning; report {out['report']}"
        assert f"rank 2 is persistently slower than the others in its {phase}" in out["alerts"][0], out["alerts"]
        # Three exchanges in a row; named at the forward after the third.
        assert out["first_named"] <= 5 * EVERY + 1, out["first_named"]
        report = out["report"]
        assert [s["rank"] for s in report["stragglers"]] == [2], report
        assert report["stragglers"][0]["phase"] == phase, report
        slow_ms = report["ranks"][2][f"{phase}_ms"]
        assert slow_ms >= SLEEP_S * 1000 * 0.9, report


def test_balanced_ranks_raise_no_alarm():
    for rank, out in enumerate(run_ranks(_train, 2, None, 300, timeout=240)):
        assert out["alerts"] == [], f"rank {rank}: false alarm: {out['alerts']}"
        report = out["report"]
        assert report is not None and report["stragglers"] == [], report
        assert report["step"] == 300 and len(report["ranks"]) == 2, report


def test_thresholds_are_relative_and_absolute():
    watch = Stragglers(every=10, margin=0.3, min_excess_ms=5.0, persist=2)

    def figures(*per_rank_ms):
        return [int(ms * 1000) + 1 for row in per_rank_ms for ms in row]

    # 40% above the median but only 0.4 ms: noise on a tiny model.
    for step in (10, 20, 30):
        assert watch.observe(step, figures((1, 1, 1), (1, 1, 1), (1.4, 1, 1))) is None
    # 20 ms above a 100 ms median (20%): under the margin.
    for step in (40, 50, 60):
        assert watch.observe(step, figures((1, 100, 1), (1, 100, 1), (1, 120, 1))) is None
    # 60 ms above: named at the second exchange in a row, once.
    assert watch.observe(70, figures((1, 100, 1), (1, 100, 1), (1, 160, 1))) is None
    with pytest.warns(RuntimeWarning, match="rank 2 is persistently slower than the others in its forward"):
        assert watch.observe(80, figures((1, 100, 1), (1, 100, 1), (1, 160, 1))) is not None
    assert watch.observe(90, figures((1, 100, 1), (1, 100, 1), (1, 160, 1))) is None
    assert watch.report["stragglers"][0]["rank"] == 2


def test_a_rank_with_nothing_to_publish_is_left_out_of_the_comparison():
    watch = Stragglers(every=10, margin=0.3, min_excess_ms=5.0, persist=1)
    published = [int(ms * 1000) + 1 for ms in (1, 100, 1, 1, 100, 1)]
    # The third rank published nothing (zeros): counting it as 0 ms would
    # put the others 100 ms above its median, a false alarm.
    assert watch.observe(10, published + [0, 0, 0]) is None
    assert watch.report is None or watch.report.get("step") != 10
