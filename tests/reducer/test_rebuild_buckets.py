"""Rebuilding buckets in the observed gradient order, in real runs over Gloo.

Models whose order of use disagrees with their registration order, switches
every few steps, alternates every step, or differs between ranks, with
find_unused_parameters, static_graph, gradient_as_bucket_view, no_sync,
communication hooks and shared parameters. After every step's backward, on
every rank: the gradients and parameters equal local training's (up to float
rounding) and are bitwise equal across ranks, every rank has the same bucket
layout, and the number of rebuilds is the one the watch's rules give (see
Note [Gradient order prediction] in reducer/layout/gradient_order.h). With
gradient_as_bucket_view, each .grad stays a view into its bucket as buckets
move.
"""

import pytest
import torch

from tests.support import models, reference
from tests.support.harness import CaseTable, assert_same_on_every_rank, assert_states_close, same_bits
from tests.support.reference import case

# Two Stack layers (2 x 288 bytes) per bucket.
CAP_MB = 576 / 2**20
STEPS = 3 * models.SWITCH_EVERY


def _case(model, mode="continuous", expected=None, **kwargs):
    """A case, and the number of layout-changing rebuilds it must end with."""
    ddp = dict(bucket_cap_mb=CAP_MB, rebuild_buckets=mode, **kwargs.pop("ddp", {}))
    return case(model, "sgd", steps=kwargs.pop("steps", STEPS), ddp=ddp, **kwargs), expected


# Stack: the first rebuild follows torch's rule (to the first iteration's
# order) and re-lays torch's first buckets (one bucket: Note [torch's first
# buckets] in reducer/layout/bucket_assignment.h), so it counts in every
# mode but "never"; then the order changes at steps 5 and 10 rebuild (each
# after 3 iterations of patience and 1 of consensus).
CASES_AND_REBUILDS = [
    _case("stack_reversed", "continuous", 1),
    _case("stack_reversed", "once", 1),
    _case("stack_reversed", "never", 0),
    _case("stack_switching", "continuous", 3),
    _case("stack_switching", "once", 1),
    _case("stack_switching", "never", 0),
    # Orders that alternate every step never win a vote.
    _case("stack_alternating", "continuous", 1),
    # Rank 0's order wins the first rebuild; the other rank, unserved, votes
    # alone and never forces another.
    _case("stack_per_rank", "continuous", 1),
    _case("stack_switching", "continuous", 3, ddp=dict(gradient_as_bucket_view=True)),
    _case("stack_switching", "continuous", 3, ddp=dict(gradient_as_bucket_view=True), set_to_none=False),
    _case("stack_switching", "continuous", 3, ddp=dict(static_graph=True)),
    _case("stack_switching", "continuous", 3, micro_batches=2),
    _case("stack_switching", "continuous", 3, micro_batches=2, ddp=dict(gradient_as_bucket_view=True)),
    # No first rebuild with find_unused_parameters (torch's rule); the watch
    # follows the branch switches at steps 5 and 10.
    _case("branches_switching", "continuous", 2, ddp=dict(find_unused_parameters=True)),
    _case("branches_switching", "once", 0, ddp=dict(find_unused_parameters=True)),
    _case("branches_switching", "continuous", 2, ddp=dict(find_unused_parameters=True, gradient_as_bucket_view=True)),
    _case("shared_weight", "continuous", None),
    _case("shared_weight", "continuous", None, ddp=dict(gradient_as_bucket_view=True)),
]
CASES = [c for c, _ in CASES_AND_REBUILDS]
REBUILDS = {c.id: expected for c, expected in CASES_AND_REBUILDS}


def _views_off_their_bucket(ddp, module):
    """Parameters whose .grad is not the slice of its bucket the layout says:
    one storage per bucket, slices consecutive in layout order. (A .grad left
    None, by parameters no rank used, is no view.)"""
    params = [p for p in module.parameters() if p.requires_grad]
    off = []
    for bucket in ddp.bucket_indices():
        start = None  # (storage, address) the bucket's first byte would have
        offset = 0
        for i in bucket:
            grad = params[i].grad
            if grad is not None:
                if start is None:
                    start = (grad.untyped_storage().data_ptr(), grad.data_ptr() - offset)
                if (grad.untyped_storage().data_ptr(), grad.data_ptr() - offset) != start:
                    off.append(i)
            offset += params[i].numel() * params[i].element_size()
    return off


def _params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _grads(module):
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def _train(rank, world_size, c):
    per_step = []
    view = dict(c.ddp).get("gradient_as_bucket_view", False)

    def on_step(ddp, module):
        per_step.append(
            dict(
                params=_params(module),
                grads=_grads(module),
                buckets=ddp.bucket_indices(),
                rebuilds=ddp.reducer.rebuilds,
                overlap=ddp.reducer.overlap_fraction,
                views_off=_views_off_their_bucket(ddp, module) if view else [],
            )
        )

    result = {"trace": reference.train_ddp(reference.ext_ddp, c, rank, world_size, on_step=on_step), "steps": per_step}
    if rank == 0:
        local = []
        trace = reference.train_local(
            c, world_size, concat=False, on_step=lambda m: local.append((_params(m), _grads(m)))
        )
        result["local"] = trace
        result["local_steps"] = local
    return result


TABLE = CaseTable(_train, CASES)


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_rebuilds_change_no_result(c):
    results = TABLE.results(2, c)
    assert_same_on_every_rank([r["trace"] for r in results], c.id)
    local = results[0]["local_steps"]
    for step in range(c.steps):
        what = f"{c.id}, step {step}"
        ranks = [r["steps"][step] for r in results]
        for name in ("params", "grads"):
            differ = [n for n, t in ranks[0][name].items() if not same_bits(t, ranks[1][name][n])]
            assert not differ, f"{what}: {name} differ between ranks: {differ}"
        assert ranks[0]["buckets"] == ranks[1]["buckets"], f"{what}: ranks laid out different buckets"
        assert ranks[0]["rebuilds"] == ranks[1]["rebuilds"], what
        assert_states_close(ranks[0]["params"], local[step][0], f"{what}: parameters vs local training")
        assert_states_close(ranks[0]["grads"], local[step][1], f"{what}: gradients vs local training")
        for rank, r in enumerate(ranks):
            assert not r["views_off"], f"{what}, rank {rank}: .grad not its bucket view for {r['views_off']}"
    assert_states_close(results[0]["trace"]["params"], results[0]["local"]["params"], f"{c.id}: final vs local")
    if REBUILDS[c.id] is not None:
        assert results[0]["steps"][-1]["rebuilds"] == REBUILDS[c.id]


def test_continuous_rebuilds_restore_overlap_after_the_order_changes():
    """stack_switching: from the first order change on, the layout of `once`
    launches nothing before the end of the backward; continuous rebuilding
    gets back to the overlap of the first phase."""
    by_mode = {}
    for mode in ("continuous", "once"):
        c = next(c for c in CASES if c.id == _case("stack_switching", mode)[0].id)
        by_mode[mode] = [s["overlap"] for s in TABLE.results(2, c)[0]["steps"]]
    first_phase = by_mode["once"][2]
    assert first_phase > 0.5
    assert by_mode["once"][5:10] == [0.0] * 5
    # continuous: steps 5-8 still run the first phase's layout, the rebuild
    # at the end of step 8 serves step 9 on.
    assert by_mode["continuous"][5:9] == [0.0] * 4
    assert by_mode["continuous"][9] == pytest.approx(first_phase)
