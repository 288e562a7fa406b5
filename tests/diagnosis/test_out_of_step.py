"""Ranks out of step: a rank that skips a synchronising forward or backward
its peers ran pairs its gradient allreduces with another iteration's. Both
DDPs would train on silently; ddp_ext raises on every rank at the end of
that backward, naming each rank's step (see Note [Ranks out of step] in
reducer/agreement/step_check.h). Programs whose ranks stay in step, including
evaluation forwards that only one rank runs and uneven inputs under Join,
raise nothing and train like local training."""

import dataclasses
from typing import Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join

import ddp_ext
from tests.support.harness import CaseTable

STEPS = 6
ODD_STEP = 3  # the iteration at which one rank misbehaves
PHRASE = "Detected mismatch between collectives on ranks"


class Net(nn.Module):
    """Two layers (with BatchNorm between them, whose buffers are broadcast at
    each forward, if `buffers`); raises in forward when `fail` is set."""

    def __init__(self, buffers: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.fc0 = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8) if buffers else nn.Identity()
        self.fc1 = nn.Linear(8, 2)
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise ValueError("a bad batch")
        return self.fc1(torch.tanh(self.norm(self.fc0(x))))


def batch(step: int, rank: int, world_size: int) -> torch.Tensor:
    full = torch.randn(2 * world_size, 4, generator=torch.Generator().manual_seed(step))
    return full[2 * rank : 2 * rank + 2]


def train_local(world_size: int, steps) -> dict:
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in steps:
        opt.zero_grad()
        x = torch.cat([batch(step, r, world_size) for r in range(world_size)])
        (net(x) ** 2).sum().div(world_size).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


# What every rank's message says ("{in_step}": the ranks that behaved). The
# others' backward of step ODD_STEP + 1 meets the misbehaving rank's next
# collective: its next backward, or the check before its next broadcast.
NEXT_BACKWARD = (
    f"{{in_step}} in the backward of training step {ODD_STEP + 1}; "
    f"rank {{odd}} in the backward of training step {ODD_STEP + 2};"
)
NEXT_BROADCAST = (
    f"rank {{odd}} at a forward's buffer broadcast after {ODD_STEP} synchronising backward passes; "
    f"{{in_step}} in the backward of training step {ODD_STEP + 1};"
)


@dataclasses.dataclass(frozen=True)
class C:
    id: str
    misbehaviour: str  # what one rank does at ODD_STEP
    ddp_kwargs: Tuple = ()
    hook: bool = False
    buffers: bool = False
    says: Optional[str] = NEXT_BACKWARD  # None: nothing raised


CASES = [
    C("forward_exception_caught", "forward_raises"),
    C("backward_skipped", "skip_backward"),
    C("forward_exception_find_unused", "forward_raises", (("find_unused_parameters", True),)),
    C("backward_skipped_static_graph", "skip_backward", (("static_graph", True),)),
    C("forward_exception_bucket_view", "forward_raises", (("gradient_as_bucket_view", True),)),
    C("forward_exception_comm_hook", "forward_raises", hook=True),
    C("forward_exception_small_buckets", "forward_raises", (("bucket_cap_mb", 0),)),
    # With buffers, each forward broadcasts them: the check runs before that.
    C("forward_exception_with_buffers", "forward_raises", buffers=True, says=NEXT_BROADCAST),
    C("backward_skipped_with_buffers", "skip_backward", buffers=True, says=NEXT_BROADCAST),
    C("eval_forward_on_one_rank_with_buffers", "eval_forward", buffers=True, says=NEXT_BROADCAST),
    # Ranks that stay in step raise nothing.
    C("every_rank_catches_the_exception", "all_forward_raise", says=None),
    C("eval_forward_on_one_rank", "eval_forward", says=None),
    C("no_grad_forward_on_one_rank", "no_grad_forward", says=None),
    C("forward_without_backward_everywhere", "all_skip_backward", says=None),
    C("every_rank_catches_the_exception_with_buffers", "all_forward_raise", buffers=True, says=None),
    # Its broadcast pairs with the others' next one, as with torch's DDP.
    C("no_grad_forward_on_one_rank_with_buffers", "no_grad_forward", buffers=True, says=None),
    C("uneven_inputs_under_join", "join_uneven", says=None),
    C("uneven_inputs_under_join_with_buffers", "join_uneven", buffers=True, says=None),
]


# Groups of finished cases, held until the ranks exit: a group that ranks
# out of step left with allreduces without partners blocks whoever frees it
# last (ProcessGroupGloo's destructor joins its threads), and a garbage
# collection in a later case would free it on one rank while the other waits
# in that case's collectives.
_FINISHED_GROUPS = []


def run_case(rank: int, world_size: int, c: C):
    # A group of its own: ranks that raised out of step may leave bucket
    # allreduces without partners on it.
    group = dist.new_group()
    _FINISHED_GROUPS.append(group)
    try:
        return train(rank, world_size, c, group)
    finally:
        dist.destroy_process_group(group)


def train(rank: int, world_size: int, c: C, group):
    net = Net(c.buffers)
    ddp = ddp_ext.DistributedDataParallel(net, process_group=group, **dict(c.ddp_kwargs))
    if c.hook:
        ddp.register_comm_hook(group, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    odd_rank = world_size - 1
    trained = []  # steps whose gradients every rank applied

    def step(s: int) -> Optional[str]:
        try:
            return checked_step(s)
        except RuntimeError as error:
            return str(error)

    def checked_step(s: int) -> Optional[str]:
        opt.zero_grad()
        x = batch(s, rank, world_size)
        misbehaving = s == ODD_STEP and (rank == odd_rank or c.misbehaviour.startswith("all_"))
        if misbehaving and c.misbehaviour in ("forward_raises", "all_forward_raise"):
            net.fail = True
            try:
                ddp(x)
            except ValueError:
                return "skipped"
            finally:
                net.fail = False
        if misbehaving and c.misbehaviour == "eval_forward":
            ddp.eval()
            ddp(x)  # gradients enabled, eval mode: not a training step
            ddp.train()
        if misbehaving and c.misbehaviour == "no_grad_forward":
            with torch.no_grad():
                ddp(x)
        loss = (ddp(x) ** 2).sum()
        if misbehaving and c.misbehaviour in ("skip_backward", "all_skip_backward"):
            return "skipped"
        loss.backward()
        opt.step()
        trained.append(s)
        return None

    if c.misbehaviour == "join_uneven":
        my_steps = range(STEPS - rank)  # rank r runs out of data r steps early
        with Join([ddp]):
            for s in my_steps:
                assert step(s) is None
        return {"error": None, "trained": list(my_steps), "state": None}

    for s in range(STEPS):
        outcome = step(s)
        if outcome not in (None, "skipped"):
            return {"error": outcome, "trained": trained, "state": None}
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return {"error": None, "trained": trained, "state": state}


TABLE = CaseTable(run_case, CASES, timeout=120.0)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_out_of_step(c, world_size):
    results = TABLE.results(world_size, c)
    odd_rank = world_size - 1
    if c.says is not None:
        steps = c.says.format(in_step="ranks 0, 1" if world_size == 3 else "rank 0", odd=odd_rank)
        for rank, result in enumerate(results):
            message = result["error"]
            assert message is not None, f"rank {rank} trained on out of step: {result['trained']}"
            assert PHRASE in message, f"rank {rank}: {message}"
            assert f"this is rank {rank})" in message, message
            assert steps in message, f"rank {rank}: expected {steps!r} in: {message}"
            # Nothing after the odd step was applied on any rank.
            assert result["trained"] == list(range(ODD_STEP)), result["trained"]
        return
    for rank, result in enumerate(results):
        assert result["error"] is None, f"rank {rank}: {result['error']}"
    if c.misbehaviour == "join_uneven":
        return  # Join's results are checked against torch's DDP elsewhere.
    steps = [s for s in range(STEPS) if not (c.misbehaviour.startswith("all_") and s == ODD_STEP)]
    for rank, result in enumerate(results):
        assert result["trained"] == steps
    if c.buffers:
        # BatchNorm normalises each rank's batch on its own, so local training
        # on the whole batch is no reference; the replicas must still agree.
        for rank, result in enumerate(results[1:], start=1):
            for name, value in result["state"].items():
                if name.endswith(("weight", "bias")):
                    assert torch.equal(value, results[0]["state"][name]), f"rank {rank}: {name}"
        return
    reference = train_local(world_size, steps)
    for rank, result in enumerate(results):
        for name, expected in reference.items():
            torch.testing.assert_close(result["state"][name], expected, msg=f"rank {rank}: {name}")


def test_training_steps_count_synchronising_training_forwards(single_process_group):
    ddp = ddp_ext.DistributedDataParallel(Net())
    x = torch.randn(2, 4)
    ddp(x).sum().backward()
    with ddp.no_sync():
        ddp(x).sum().backward()
    with torch.no_grad():
        ddp(x)
    ddp.eval()
    ddp(x)
    ddp.train()
    ddp(x)  # a forward without backward still began a step
    assert ddp.reducer.training_steps == 2
