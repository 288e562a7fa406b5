"""ddp.overlap_optimizer(optimizer, shard=True) trains as torch's DDP with a
plain optimizer.step() does: in real multi-process runs over Gloo, from the
same seeds and data, parameters and the unsharded optimizer state
(optimizer.state_dict(), gathered) are bitwise torch's at 2 ranks, and at 3
and 4 ranks too: over Gloo each bucket's ranges go out as an all-to-all and
each rank sums its range's copies in the order Gloo's ring allreduce sums
them in torch's DDP (the same bucket layout, the same sums: Note [Ring-ordered
sum] in reducer/transport/ring_order_sum.h; tests/sharding/test_ring_order.py).
"""

import pytest

from tests.sharding.shard_support import run, trained
from tests.support.harness import assert_states_bitwise
from tests.support.worlds import shared_world

RUNS = [run(optimizer=name) for name in ("sgd", "adam", "adam_foreach", "adamw", "rmsprop", "adagrad", "nadam")]
RUNS += [
    run(optimizer="adam", lr_after_backward=True, between_steps=True),
    run(optimizer="sgd", micro_batches=3),
    run(model="branches", optimizer="adamw", ddp=dict(find_unused_parameters=True)),
    run(model="branches", optimizer="adam", ddp=dict(find_unused_parameters=True, gradient_as_bucket_view=True)),
    run(model="branches", optimizer="sgd", micro_batches=2, ddp=dict(find_unused_parameters=True)),
    run(model="branches", optimizer="adam", micro_batches=2,
        ddp=dict(find_unused_parameters=True, gradient_as_bucket_view=True)),
    run(optimizer="adam", freeze_first=True),
    run(optimizer="adam", ddp=dict(static_graph=True)),
    run(optimizer="adamw", ddp=dict(gradient_as_bucket_view=True)),
    run(model="conv", optimizer="adam", steps=5),
    run(model="mlp", optimizer="adam", ddp=dict(bucket_cap_mb=25)),  # one bucket
]


def _job(rank, world_size, r):
    return {"sharded": trained(rank, world_size, r, "sharded"), "torch": trained(rank, world_size, r, "torch")}


@pytest.mark.parametrize("r", RUNS, ids=lambda r: r.id)
def test_bitwise_torch_ddp_at_2_ranks(r):
    for rank, result in enumerate(shared_world(2).run(_job, r)):
        for kind in ("params", "optimizer"):
            assert_states_bitwise(result["sharded"][kind], result["torch"][kind], f"rank {rank} {r.id}: {kind}")


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("r", [RUNS[i] for i in (1, 7, 8, 9, 14, 16)], ids=lambda r: r.id)
def test_bitwise_torch_ddp_at_3_and_4_ranks(r, world_size):
    results = shared_world(world_size).run(_job, r)
    for rank, result in enumerate(results):
        for kind in ("params", "optimizer"):
            assert_states_bitwise(result["sharded"][kind], result["torch"][kind], f"rank {rank} {r.id}: {kind}")
            # Every rank ends with the same bits.
            assert_states_bitwise(result["sharded"][kind], results[0]["sharded"][kind], f"rank {rank} vs 0: {kind}")
