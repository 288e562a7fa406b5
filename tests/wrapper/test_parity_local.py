"""ddp_ext's DDP trains exactly like local training on the concatenated batch.

Each rank takes its slice of a global batch; the loss is mean-reduced, so
DDP's gradient average equals the gradient of one process training on the
whole batch. After a few steps of SGD with momentum and of Adam, parameters
equal the local ones up to float rounding and are bitwise identical on every
rank (issue 2).
"""

import pytest

from tests.support import reference
from tests.support.harness import CaseTable, assert_grad_layout_kept, assert_same_on_every_rank, assert_states_close
from tests.support.reference import case

MODELS = ["mlp", "conv", "shared_weight", "mixed_dtype", "deep"]
CASES = [case(m, opt) for m in MODELS for opt in ("sgd", "adam")]


def _train(rank, world_size, c):
    result = {"ext": reference.train_ddp(reference.ext_ddp, c, rank, world_size)}
    if rank == 0:
        result["local"] = reference.train_local(c, world_size, concat=True)
    return result


TABLE = CaseTable(_train, CASES)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_matches_local_training_on_whole_batch(c, world_size):
    results = TABLE.results(world_size, c)
    traces = [r["ext"] for r in results]
    assert_same_on_every_rank(traces, f"{c.id}, world size {world_size}")
    assert_grad_layout_kept(traces, f"{c.id}, world size {world_size}")
    local = results[0]["local"]
    assert_states_close(traces[0]["params"], local["params"], f"{c.id}, ddp_ext vs local training")
    assert traces[0]["grad_none"] == local["grad_none"]
