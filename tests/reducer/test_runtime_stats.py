"""torch's runtime statistics in `_get_ddp_logging_data()`: forward and
backward compute time, backward communication time and their overlap, in
nanoseconds, on the iterations `_set_ddp_runtime_logging_sample_rate`
samples (Note [Runtime statistics] in reducer/observation/runtime_times.h).

The invariants are the ones torch's own distributed tests assert, checked on
ddp_ext's and torch's DDP over the same loop: every time >= 1 ns on a
sampled iteration, backward compute time and communication time each >=
their overlap, the host-side instants in order; and the same keys.
"""

import dataclasses

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddp_ext
from tests.support.harness import CaseTable

TIMES = ("forward_compute_time", "backward_compute_time", "backward_comm_time", "backward_compute_comm_overlap_time")
INSTANTS = ("forward_compute_time_start", "backward_compute_time_start", "backward_compute_time_end",
            "backward_comm_time_start", "backward_comm_time_end")


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


@dataclasses.dataclass(frozen=True)
class Loop:
    which: str  # "ddp_ext" or "torch"
    overlap: bool = True

    @property
    def id(self) -> str:
        return self.which + ("" if self.overlap else "-no_overlap")


LOOPS = [Loop("ddp_ext"), Loop("torch"), Loop("ddp_ext", overlap=False)]


def _loop(rank, world_size, c: Loop):
    which, overlap = c.which, c.overlap
    ddp = ddp_ext.DistributedDataParallel(_net()) if which == "ddp_ext" else TorchDDP(_net())
    if not overlap:
        ddp.set_overlap_with_backward(False)
    ddp._set_ddp_runtime_logging_sample_rate(2)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    seen = []
    for idx in range(20):
        opt.zero_grad()
        ddp(torch.randn(4, 8) + rank).pow(2).mean().backward()
        opt.step()
        data = ddp._get_ddp_logging_data()
        seen.append({k: data.get(k) for k in (*TIMES, *(f"avg_{t}" for t in TIMES), *INSTANTS)})
    return seen


TABLE = CaseTable(_loop, LOOPS)  # the three loops on the shared ranks of 2


@pytest.mark.parametrize("which", ["ddp_ext", "torch"])
def test_sampled_iterations_hold_torchs_invariants(which):
    for rank, seen in enumerate(TABLE.results(2, Loop(which))):
        previous = None
        for idx, data in enumerate(seen):
            sampled = idx > 0 and (idx < 10 or idx % 2 == 0)
            if not sampled:
                continue
            where = f"{which}, rank {rank}, iteration {idx}: {data}"
            for key in ("forward_compute_time", "backward_compute_time", "backward_comm_time"):
                assert data[key] >= 1, where
            assert data["backward_compute_time"] >= data["backward_compute_comm_overlap_time"] >= 0, where
            assert data["backward_comm_time"] >= data["backward_compute_comm_overlap_time"], where
            for key in TIMES:
                assert data[f"avg_{key}"] >= (1 if key != "backward_compute_comm_overlap_time" else 0), where
            assert data["backward_comm_time_end"] >= data["backward_comm_time_start"] >= data[
                "backward_compute_time_start"] >= data["forward_compute_time_start"], where
            assert data["backward_compute_time_end"] >= data["backward_compute_time_start"], where
            if previous is not None:
                # A new sample each sampled iteration: the last one moved on.
                assert data["forward_compute_time_start"] > previous["forward_compute_time_start"], where
            previous = data
        # Between samples the figures stay those of the last sampled iteration.
        assert seen[11]["forward_compute_time_start"] == seen[10]["forward_compute_time_start"]


def test_without_overlap_the_overlap_is_zero():
    for seen in TABLE.results(2, Loop("ddp_ext", overlap=False)):
        for data in seen[1:]:
            assert data["backward_compute_comm_overlap_time"] == 0, data
            assert data["backward_comm_time"] >= 1, data


def test_the_same_keys_as_torch(single_process_group):
    ours = ddp_ext.DistributedDataParallel(_net())
    theirs = TorchDDP(_net())
    for ddp in (ours, theirs):
        for _ in range(3):
            ddp(torch.randn(4, 8)).sum().backward()
    ours_keys = set(ours._get_ddp_logging_data())
    theirs_keys = set(theirs._get_ddp_logging_data())
    wanted = {*TIMES, *(f"avg_{t}" for t in TIMES), *INSTANTS}
    assert wanted <= theirs_keys, sorted(wanted - theirs_keys)
    assert wanted <= ours_keys, sorted(wanted - ours_keys)
