"""ddp_ext's DDP trains exactly like torch's DistributedDataParallel.

From the same seed and data, after a few steps of SGD with momentum and of
Adam, parameters and buffers (BatchNorm running statistics included) equal
torch's DDP's on every rank up to float rounding, the same `.grad` are None
after each step, and ddp_ext's parameters are bitwise identical across ranks
(issue 2). Parameters with non-default strides (channels_last convolution
weights, a transposed weight) keep gradients strided like themselves, with
and without gradient_as_bucket_view.
"""

import pytest

from tests import reference
from tests.harness import CaseTable, assert_same_on_every_rank, assert_states_close
from tests.reference import case

MODELS = ["mlp", "conv", "shared_weight", "mixed_dtype", "deep", "batchnorm", "conv_channels_last", "transposed"]
CASES = [case(m, opt) for m in MODELS for opt in ("sgd", "adam")]
# Parameters with non-default strides, their .grad as views into buckets.
CASES += [case(m, "adam", ddp=dict(gradient_as_bucket_view=True)) for m in ("conv_channels_last", "transposed")]


def _train(rank, world_size, c):
    return {
        "ext": reference.train_ddp(reference.ext_ddp, c, rank, world_size),
        "torch": reference.train_ddp(reference.torch_ddp, c, rank, world_size),
    }


TABLE = CaseTable(_train, CASES)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_matches_torch_ddp(c, world_size):
    results = TABLE.results(world_size, c)
    assert_same_on_every_rank([r["ext"] for r in results], f"{c.id}, world size {world_size}")
    for rank, r in enumerate(results):
        what = f"{c.id}, rank {rank} of {world_size}, ddp_ext vs torch DDP"
        assert_states_close(r["ext"]["params"], r["torch"]["params"], what + " parameters")
        assert_states_close(r["ext"]["buffers"], r["torch"]["buffers"], what + " buffers")
        assert r["ext"]["grad_none"] == r["torch"]["grad_none"], what
