"""no_sync(): gradients accumulate locally over micro-batches and the first
synchronising backward reduces everything accumulated (issue 3).

Over 1, 2 and 4 micro-batches, with and without find_unused_parameters, the
result equals local training on all the micro-batches together and torch's
DDP. Ranks that run different numbers of no_sync micro-batches still agree,
which they could not if anything were communicated inside no_sync.
"""

import pytest

from tests.support import models, reference
from tests.support.harness import CaseTable, assert_grad_layout_kept, assert_same_on_every_rank, assert_states_close
from tests.support.reference import case

FIND = dict(find_unused_parameters=True)
CASES = [case("mlp", "sgd", micro_batches=k, ddp=d) for d in ({}, FIND) for k in (1, 2, 4)]
CASES += [
    case("mlp", "adam", micro_batches=4, ddp=dict(gradient_as_bucket_view=True)),
    case("mlp", "sgd", micro_batches=2, ddp=dict(gradient_as_bucket_view=True), set_to_none=False),
    # Heads differ per rank, step and micro-batch: a head used only inside
    # no_sync still counts as used.
    case("branches", "adam", micro_batches=2, ddp=FIND),
    case("branches", "sgd", micro_batches=4, ddp=FIND),
    case("branches", "sgd", micro_batches=2, ddp=dict(FIND, gradient_as_bucket_view=True), set_to_none=False),
    # Rank r runs r more no_sync micro-batches than rank 0.
    case("mlp", "sgd", micro_batches=2, uneven_no_sync=True),
    case("branches", "adam", micro_batches=1, uneven_no_sync=True, ddp=FIND),
]


def _concat_ok(c):
    return not c.uneven_no_sync and models.MODELS[c.model].extra_args(0, 0, 0) == ()


def _train(rank, world_size, c):
    result = {
        "ext": reference.train_ddp(reference.ext_ddp, c, rank, world_size),
        "torch": reference.train_ddp(reference.torch_ddp, c, rank, world_size),
    }
    if rank == 0:
        result["local"] = reference.train_local(c, world_size, concat=_concat_ok(c))
    return result


TABLE = CaseTable(_train, CASES)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_no_sync_matches_local_and_torch_ddp(c, world_size):
    results = TABLE.results(world_size, c)
    ext = [r["ext"] for r in results]
    assert_same_on_every_rank(ext, f"{c.id}, world size {world_size}")
    assert_grad_layout_kept(ext, f"{c.id}, world size {world_size}")
    local = results[0]["local"]
    assert_states_close(ext[0]["params"], local["params"], f"{c.id}, ddp_ext vs local training")
    assert ext[0]["grad_none"] == local["grad_none"], "parameters with .grad None per step, ddp_ext vs local"
    for rank, r in enumerate(results):
        what = f"{c.id}, rank {rank} of {world_size}, ddp_ext vs torch DDP"
        assert_states_close(r["ext"]["params"], r["torch"]["params"], what)
        assert r["ext"]["grad_none"] == r["torch"]["grad_none"], f"{what}: parameters with .grad None per step"
