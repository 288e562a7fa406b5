"""ddp_ext's DDP trains exactly like torch's DistributedDataParallel.

From the same seed and data, after a few steps of SGD with momentum and of
Adam, parameters and buffers (BatchNorm running statistics included) equal
torch's DDP's on every rank up to float rounding (bitwise with 2 ranks), the
same `.grad` are None after each step, and ddp_ext's parameters are bitwise
identical across ranks (issue 2). Parameters with non-default strides (channels_last convolution
weights, a transposed weight) keep gradients strided like themselves, with
and without gradient_as_bucket_view.
"""

import pytest

from tests.support import reference
from tests.support.harness import (
    CaseTable,
    assert_grad_layout_kept,
    assert_same_on_every_rank,
    assert_states_close,
    same_bits,
)
from tests.support.reference import case

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
    assert_grad_layout_kept([r["ext"] for r in results], f"{c.id}, world size {world_size}")
    for rank, r in enumerate(results):
        what = f"{c.id}, rank {rank} of {world_size}, ddp_ext vs torch DDP"
        assert_states_close(r["ext"]["params"], r["torch"]["params"], what + " parameters")
        assert_states_close(r["ext"]["buffers"], r["torch"]["buffers"], what + " buffers")
        assert r["ext"]["grad_none"] == r["torch"]["grad_none"], what
        if world_size == 2:
            # Two addends sum the same in any order, and both scale each
            # gradient by 1/world_size before summing (Note [Gradient
            # averaging] in reducer/base/averaging.h): the results are bitwise equal.
            differ = [n for n, t in r["ext"]["params"].items() if not same_bits(t, r["torch"]["params"][n])]
            assert not differ, f"{what}: not bitwise equal at world size 2: {differ}"


# --- A process group of some of the ranks ----------------------------------------

SUBGROUP_CASES = [case("mlp", "sgd"), case("batchnorm", "adam"), case("branches", "sgd", ddp=dict(find_unused_parameters=True))]


def _train_in_subgroup(rank, world_size, c):
    """Ranks 1 and 2 of 3 train through a group of their own: its rank 0
    (global rank 1) is the broadcast source, its size the divisor."""
    import torch.distributed as dist

    members = [1, 2]
    group = dist.new_group(members)
    if rank not in members:
        return None
    group_rank, group_size = members.index(rank), len(members)
    result = {}
    for name, wrapper in (("ext", reference.ext_ddp), ("torch", reference.torch_ddp)):
        in_group = lambda module, wrapper=wrapper, **kw: wrapper(module, process_group=group, **kw)
        # Start every member from other weights: construction must make them rank 1's.
        result[name] = reference.train_ddp(in_group, c, group_rank, group_size, seed=1000 * rank)
    return result


SUBGROUP_TABLE = CaseTable(_train_in_subgroup, SUBGROUP_CASES)


@pytest.mark.parametrize("c", SUBGROUP_CASES, ids=lambda c: c.id)
def test_process_group_of_some_ranks_matches_torch_ddp(c):
    results = SUBGROUP_TABLE.results(3, c)
    assert results[0] is None
    members = results[1:]
    assert_same_on_every_rank([r["ext"] for r in members], f"{c.id}, ranks 1 and 2")
    assert_grad_layout_kept([r["ext"] for r in members], f"{c.id}, ranks 1 and 2")
    for rank, r in enumerate(members, start=1):
        what = f"{c.id}, rank {rank}, ddp_ext vs torch DDP over the group of ranks 1 and 2"
        assert_states_close(r["ext"]["params"], r["torch"]["params"], what + " parameters")
        assert_states_close(r["ext"]["buffers"], r["torch"]["buffers"], what + " buffers")
        assert r["ext"]["grad_none"] == r["torch"]["grad_none"], what
