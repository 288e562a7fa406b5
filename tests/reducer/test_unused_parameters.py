"""find_unused_parameters=True: parameters used on some ranks, on none, or only
behind outputs the loss ignores (issue 3).

Parity with local training (each rank's loss averaged) and with torch's DDP,
with SGD-momentum and Adam: a parameter used on some ranks gets the average
(zeros from the others); one used on no rank keeps its `.grad` untouched, so
which `.grad` are None after each step is the same as torch's and as local
training's.
"""

import pytest

from tests.support import reference
from tests.support.harness import CaseTable, assert_grad_layout_kept, assert_same_on_every_rank, assert_states_close
from tests.support.reference import case

FIND = dict(find_unused_parameters=True)
CASES = [
    # Heads chosen differently per rank and per step; a frozen layer; a layer never used.
    case("branches", "sgd", ddp=FIND),
    case("branches", "adam", ddp=FIND),
    case("branches", "adam", ddp=dict(FIND, gradient_as_bucket_view=True)),
    case("branches", "sgd", ddp=FIND, set_to_none=False),
    case("branches", "sgd", ddp=dict(FIND, gradient_as_bucket_view=True), set_to_none=False),
    case("branches", "adam", ddp=dict(FIND, bucket_cap_mb=1e-9)),
    case("branches", "sgd", ddp=FIND, overlap=False),
    case("never_used", "sgd", ddp=FIND),
    case("never_used", "adam", ddp=FIND),
    # Outputs the loss ignores, nested in containers of several kinds.
    case("outputs_dict", "sgd", ddp=FIND),
    case("outputs_namedtuple", "adam", ddp=FIND),
    case("outputs_dataclass", "sgd", ddp=FIND),
    # Activation checkpointing: the non-reentrant kind works with
    # find_unused_parameters=True; the reentrant kind without it.
    case("checkpoint_nonreentrant", "adam", ddp=FIND),
    case("checkpoint_reentrant", "adam"),
    # The loss modifies the model's output in place.
    case("mlp_inplace_loss", "sgd", ddp=FIND),
]
# torch's DDP hides dataclass outputs from its sink (pytree treats them as
# leaves) and then waits for the ignored ones forever: compared locally only.
NOT_WITH_TORCH = {"outputs_dataclass"}


def _train(rank, world_size, c):
    result = {"ext": reference.train_ddp(reference.ext_ddp, c, rank, world_size)}
    if c.model not in NOT_WITH_TORCH:
        result["torch"] = reference.train_ddp(reference.torch_ddp, c, rank, world_size)
    if rank == 0:
        result["local"] = reference.train_local(c, world_size, concat=False)
    return result


TABLE = CaseTable(_train, CASES)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    "c",
    CASES,
    ids=lambda c: c.id,
)
def test_unused_parameters_match_local_and_torch_ddp(c, world_size):
    results = TABLE.results(world_size, c)
    ext = [r["ext"] for r in results]
    assert_same_on_every_rank(ext, f"{c.id}, world size {world_size}")
    assert_grad_layout_kept(ext, f"{c.id}, world size {world_size}")
    local = results[0]["local"]
    assert_states_close(ext[0]["params"], local["params"], f"{c.id}, ddp_ext vs local training")
    assert ext[0]["grad_none"] == local["grad_none"], "parameters with .grad None per step, ddp_ext vs local"
    for rank, r in enumerate(results):
        if "torch" not in r:
            continue
        what = f"{c.id}, rank {rank} of {world_size}, ddp_ext vs torch DDP"
        assert_states_close(r["ext"]["params"], r["torch"]["params"], what)
        assert r["ext"]["grad_none"] == r["torch"]["grad_none"], f"{what}: parameters with .grad None per step"


def test_schedule_exercises_partial_and_global_unuse():
    """The branch schedule must make some head used by only some ranks and some
    head used by none, in some step, at both world sizes (else the table above
    tests less than it claims)."""
    from tests.support.models import NUM_HEADS, branch_schedule

    for world_size in (2, 3):
        partial = unused = False
        for step in range(4):
            users = [sum(h in branch_schedule(r, step, 0) for r in range(world_size)) for h in range(NUM_HEADS)]
            partial |= any(0 < u < world_size for u in users)
            unused |= any(u == 0 for u in users)
        assert partial and unused, f"world size {world_size}"
