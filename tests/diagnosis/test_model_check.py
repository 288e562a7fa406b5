"""Construction checks that every rank wraps the same model, and makes their
state rank 0's (issue 2).

A rank whose model differs (one parameter more or less, another shape, dtype
or name) makes the constructor raise the same RuntimeError on every rank,
naming the parameter, instead of hanging. A rank that merely starts from
other values (parameters, frozen parameters, buffers) is overwritten with
rank 0's values; with init_sync=False it is left alone.
"""

import dataclasses
import datetime
from typing import Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.support import models, reference
from tests.support.harness import CaseTable, same_bits


class _Net(nn.Module):
    def __init__(self, hidden=8, fc2_dtype=torch.float32, fc2_name="fc2", extra=False, freeze_fc1=False):
        super().__init__()
        self.fc1 = nn.Linear(6, hidden)
        self.fc1.requires_grad_(not freeze_fc1)
        setattr(self, fc2_name, nn.Linear(hidden, 3).to(fc2_dtype))
        if extra:
            self.extra = nn.Linear(3, 3)


@dataclasses.dataclass(frozen=True)
class Mismatch:
    id: str
    # How the odd rank (the last one) builds its _Net; the others build _Net().
    odd: Tuple[Tuple[str, object], ...]
    # Parameter names the error must mention (any one of them suffices).
    names: Tuple[str, ...]
    # Freeze the odd rank's whole module (nothing to train there).
    freeze_all: bool = False


@dataclasses.dataclass(frozen=True)
class Divergent:
    """Every rank builds `model` from its own seed and shifts its buffers."""

    model: str
    init_sync: bool = True

    @property
    def id(self):
        return self.model + ("" if self.init_sync else "-init_sync=False")


MISMATCHES = [
    Mismatch("extra_parameter_on_one_rank", (("extra", True),), ("extra.weight",)),
    Mismatch("shape", (("hidden", 9),), ("fc1.weight",)),
    Mismatch("dtype", (("fc2_dtype", torch.float64),), ("fc2.weight",)),
    Mismatch("name", (("fc2_name", "head"),), ("fc2.weight", "head.weight")),
    Mismatch("frozen_on_one_rank", (("freeze_fc1", True),), ("fc1.weight",)),
]
DIVERGENT = [Divergent("batchnorm"), Divergent("branches"), Divergent("mlp", init_sync=False)]
# Last: on failure its ranks fall out of step.
NOTHING_TO_TRAIN = Mismatch("nothing_to_train_on_one_rank", (), ("fc1.weight",), freeze_all=True)


def _construct(rank, world_size, m: Mismatch) -> Optional[Tuple[str, str]]:
    torch.manual_seed(0)
    odd = rank == world_size - 1
    module = _Net(**dict(m.odd)) if odd else _Net()
    group = None
    if m.freeze_all:
        # A process group with a short timeout turns a hang into an error.
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=5))
        if odd:
            module.requires_grad_(False)
    try:
        reference.ext_ddp(module, process_group=group)
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def _start_from_other_values(rank, world_size, d: Divergent):
    module = models.build(d.model, seed=models.MODEL_SEED + rank)
    with torch.no_grad():
        for b in module.buffers():
            b.add_(rank)  # running_mean, running_var, num_batches_tracked
    before = reference.state_tensors(module)
    reference.ext_ddp(module, init_sync=d.init_sync)
    return before, reference.state_tensors(module)


def _run(rank, world_size, c):
    return _construct(rank, world_size, c) if isinstance(c, Mismatch) else _start_from_other_values(rank, world_size, c)


# Isolated: cases time out their own process groups on purpose.
TABLE = CaseTable(_run, MISMATCHES + DIVERGENT + [NOTHING_TO_TRAIN], timeout=120, isolated=True)



@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    "m",
    MISMATCHES + [NOTHING_TO_TRAIN],
    ids=lambda m: m.id,
)
def test_mismatched_models_raise_on_every_rank(m, world_size):
    per_rank = TABLE.results(world_size, m)
    for rank, raised in enumerate(per_rank):
        assert raised is not None, f"rank {rank} of {world_size} constructed DDP over a mismatched model"
        kind, message = raised
        assert kind == "RuntimeError", f"rank {rank}: {kind}: {message}"
        assert "DDP expects same model across all ranks" in message, f"rank {rank}: {message}"
        assert any(name in message for name in m.names), f"rank {rank}: none of {m.names} named in: {message}"
    assert len({message for _, message in per_rank}) == 1, f"ranks raised different errors: {per_rank}"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("d", DIVERGENT, ids=lambda d: d.id)
def test_construction_makes_every_rank_start_from_rank0_state(d, world_size):
    per_rank = TABLE.results(world_size, d)
    (rank0_params, rank0_buffers), _ = per_rank[0]
    assert any(
        not same_bits(per_rank[1][0][0][n], a) for n, a in rank0_params.items()
    ), "test setup: ranks should start from different parameters"
    for rank, ((params_before, buffers_before), (params, buffers)) in enumerate(per_rank):
        expected = (rank0_params, rank0_buffers) if d.init_sync else (params_before, buffers_before)
        for name, a in list(params.items()) + list(buffers.items()):
            want = expected[0].get(name, expected[1].get(name))
            whose = "rank 0's" if d.init_sync else "its own"
            assert same_bits(a, want), f"rank {rank}: `{name}` is not {whose} after construction"
