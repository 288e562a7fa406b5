"""Gradient order prediction, the pure pieces (single process, table-driven):
bucket assignment for an observed order, the overlap measure, the watch's
hysteresis step, the consensus rule, and the `rebuild_buckets` keyword. See
Note [Gradient order prediction] in reducer/gradient_order.h."""

import inspect
import random

import pytest
import torch
from torch import nn

import ddp_ext
from ddp_ext import _C

F32, F64 = torch.float32, torch.float64
CPU = torch.device("cpu")


def _specs(*entries):
    """(nbytes, dtype=F32) shorthand, all on the CPU."""
    out = []
    for e in entries:
        nbytes, dtype = (e + (F32,))[:2] if isinstance(e, tuple) else (e, F32)
        out.append((nbytes, dtype, CPU))
    return out


# --- assign_buckets_in_order --------------------------------------------------

# (id, tensors, order, caps, sparse, expected buckets)
IN_ORDER_TABLE = [
    ("in_order_one_kind", _specs(4, 4, 4, 4), [0, 1, 2, 3], [8], [], [[0, 1], [2, 3]]),
    ("reverse_order_is_the_construction_layout", _specs(4, 4, 4), [2, 1, 0], [100], [], [[2, 1, 0]]),
    ("shuffled", _specs(4, 4, 4, 4), [2, 0, 3, 1], [8], [], [[2, 0], [3, 1]]),
    ("first_bucket_keeps_small_cap", _specs(4, 4, 4, 4, 4), [4, 0, 3, 1, 2], [4, 100], [], [[4], [0, 3, 1, 2]]),
    ("oversized_closes_its_bucket", _specs(4, 100, 4), [0, 1, 2], [8], [], [[0, 1], [2]]),
    # f32 opens first, but the f64 bucket is full first, so it launches first.
    ("kinds_launch_when_full", _specs(4, (8, F64), 4, (8, F64)), [0, 1, 3, 2], [100], [], [[1, 3], [0, 2]]),
    ("sparse_alone_where_it_arrives", _specs(4, 4, 4), [0, 1, 2], [100], [False, True, False], [[1], [0, 2]]),
]


@pytest.mark.parametrize(
    "tensors, order, caps, sparse, expected",
    [row[1:] for row in IN_ORDER_TABLE],
    ids=[row[0] for row in IN_ORDER_TABLE],
)
def test_assign_buckets_in_order_table(tensors, order, caps, sparse, expected):
    assert _C.assign_buckets_in_order(tensors, order, caps, sparse) == expected


def test_assign_buckets_in_reverse_order_matches_construction():
    rng = random.Random(1)
    for _ in range(100):
        tensors = _specs(*(rng.choice([1, 4, 16, 64]) for _ in range(rng.randint(1, 20))))
        cap = rng.choice([4, 16, 100])
        order = list(reversed(range(len(tensors))))
        assert _C.assign_buckets_in_order(tensors, order, [cap]) == _C.assign_buckets(tensors, cap)


def test_assign_buckets_in_order_invariants_on_random_orders():
    rng = random.Random(0)
    for _ in range(200):
        tensors = [(rng.choice([0, 4, 16, 64]), rng.choice([F32, F64]), CPU) for _ in range(rng.randint(1, 25))]
        order = list(range(len(tensors)))
        rng.shuffle(order)
        cap = rng.choice([1, 16, 64, 1000])
        buckets = _C.assign_buckets_in_order(tensors, order, [cap])
        assert sorted(i for b in buckets for i in b) == list(range(len(tensors)))
        position = {index: k for k, index in enumerate(order)}
        completed = [max(position[i] for i in b) for b in buckets]
        assert completed == sorted(completed), "buckets must launch in the order they fill"
        for b in buckets:
            assert len({tensors[i][1] for i in b}) == 1, f"{b} mixes dtypes"
            assert [position[i] for i in b] == sorted(position[i] for i in b), f"{b} not in arrival order"
            before_last = sum(tensors[i][0] for i in b) - tensors[b[-1]][0]
            assert before_last < cap, f"{b} took a tensor after reaching its cap {cap}"


@pytest.mark.parametrize("order", [[0, 1], [0, 0, 1], [0, 1, 3]], ids=["short", "repeated", "out_of_range"])
def test_assign_buckets_in_order_needs_a_permutation(order):
    with pytest.raises(RuntimeError, match="gradient order must name each"):
        _C.assign_buckets_in_order(_specs(4, 4, 4), order, [100])


# --- the measure ----------------------------------------------------------------

# (id, buckets in launch order, arrival order, bytes, (wait, overlap_fraction))
COST_TABLE = [
    # One bucket: the first gradient waits for the second; nothing launches early.
    ("one_bucket", [[0, 1]], [0, 1], [1, 1], (1 / 4, 0.0)),
    ("one_per_gradient_in_order", [[0], [1]], [0, 1], [1, 1], (0.0, 0.5)),
    ("one_per_gradient_reversed", [[1], [0]], [0, 1], [1, 1], (1 / 4, 0.0)),
    ("two_buckets_in_order", [[0, 1], [2, 3]], [0, 1, 2, 3], [1, 1, 1, 1], (2 / 16, 0.5)),
    # The first bucket fills last: everything waits for the end.
    ("two_buckets_reversed", [[0, 1], [2, 3]], [2, 3, 0, 1], [1, 1, 1, 1], ((3 + 2 + 1) / 16, 0.0)),
    # Waits weigh by bytes: 1 byte waits for 3 that arrive after it.
    ("weighted_by_bytes", [[0], [1]], [1, 0], [3, 1], (3 / 16, 0.0)),
    ("no_bytes", [[0, 1]], [1, 0], [0, 0], (0.0, 0.0)),
]


@pytest.mark.parametrize(
    "buckets, order, nbytes, expected", [row[1:] for row in COST_TABLE], ids=[row[0] for row in COST_TABLE]
)
def test_order_cost_table(buckets, order, nbytes, expected):
    assert _C.order_cost(buckets, order, nbytes) == pytest.approx(expected)


def test_a_layout_built_from_the_order_costs_no_more_than_any_other():
    rng = random.Random(2)
    for _ in range(100):
        n = rng.randint(2, 16)
        nbytes = [rng.choice([4, 16, 64]) for _ in range(n)]
        order = list(range(n))
        rng.shuffle(order)
        tensors = [(b, F32, CPU) for b in nbytes]
        cap = rng.choice([16, 64, 128])
        fitted = _C.assign_buckets_in_order(tensors, order, [cap])
        guessed = _C.assign_buckets(tensors, cap)  # same caps, reverse registration order
        assert _C.order_cost(fitted, order, nbytes)[0] <= _C.order_cost(guessed, order, nbytes)[0] + 1e-12


# --- the watch -------------------------------------------------------------------

EXACT_GAIN = 0.0625  # a power of two: gains at the threshold compare exactly

# (id, (streak, current, candidate, fresh), patience, (streak, adopt_fresh, vote))
WATCH_TABLE = [
    ("fresh_gains_starts_streak", (0, 0.5, 0.5, 0.1), 3, (1, True, False)),
    ("fresh_gains_too_little", (0, 0.5, 0.5, 0.45), 3, (0, False, False)),
    ("gain_exactly_at_threshold_counts", (0, 0.5, 0.5, 0.5 - EXACT_GAIN), 3, (1, True, False)),
    ("candidate_keeps_gaining", (1, 0.5, 0.1, 0.1), 3, (2, False, False)),
    ("patience_reached_votes", (2, 0.5, 0.1, 0.1), 3, (3, False, True)),
    ("keeps_voting", (7, 0.5, 0.1, 0.1), 3, (8, False, True)),
    # The order went back: the candidate loses, and the current layout fits.
    ("candidate_loses_streak_ends", (2, 0.1, 0.4, 0.1), 3, (0, False, False)),
    # The order changed again: the candidate loses, a new one starts.
    ("candidate_loses_fresh_restarts", (2, 0.5, 0.48, 0.1), 3, (1, True, False)),
    ("patience_one_votes_at_once", (0, 0.5, 0.5, 0.0), 1, (1, True, True)),
]


@pytest.mark.parametrize(
    "inputs, patience, expected", [row[1:] for row in WATCH_TABLE], ids=[row[0] for row in WATCH_TABLE]
)
def test_watch_step_table(inputs, patience, expected):
    assert _C.watch_step(*inputs, patience=patience, min_gain=EXACT_GAIN) == expected


def test_watch_orders_alternating_every_iteration_never_vote():
    """The hysteresis on a sequence: orders A, B, A, B, ... under a layout
    that fits A never produce a vote; B repeated does, after `patience`."""
    a_fits, b_fits = 0.05, 0.45  # cost of the layout fitted to A, to B, under order B
    costs_under = {"A": (0.0, 0.4), "B": (b_fits, a_fits)}  # (current layout = A's, candidate = B's)
    streak, votes = 0, []
    for order in "ABABABAB":
        current, candidate = costs_under[order]
        fresh = 0.0 if order == "A" else a_fits
        streak, _, vote = _C.watch_step(streak, current, candidate, fresh)
        votes.append(vote)
    assert not any(votes)
    streak, votes = 0, []
    for order in "BBBB":
        streak, _, vote = _C.watch_step(streak, b_fits, a_fits, a_fits)
        votes.append(vote)
    assert votes == [False, False, True, True]


@pytest.mark.parametrize(
    "votes, ranks, agreed",
    [(2, 2, True), (1, 2, False), (0, 2, False), (3, 3, True), (2, 3, False), (1, 1, True), (0, 1, False), (0, 0, False)],
)
def test_rebuild_needs_every_rank(votes, ranks, agreed):
    assert _C.rebuild_agreed(votes, ranks) is agreed


# --- the keyword -------------------------------------------------------------------


def test_rebuild_buckets_is_a_keyword_only_addition_defaulting_to_continuous():
    parameter = inspect.signature(ddp_ext.DistributedDataParallel.__init__).parameters["rebuild_buckets"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
    assert parameter.default == "continuous"


@pytest.mark.parametrize("value", ["sometimes", True, None])
def test_rebuild_buckets_rejects_other_values(value, single_process_group):
    with pytest.raises(ValueError, match="rebuild_buckets must be one of"):
        ddp_ext.DistributedDataParallel(nn.Linear(2, 2), rebuild_buckets=value)


class UsedInReverse(nn.Module):
    """`a` is registered first and used last."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)  # parameters 0 (weight, 24 bytes) and 1 (bias, 8)
        self.b = nn.Linear(2, 3)  # parameters 2 (weight, 24 bytes) and 3 (bias, 12)

    def forward(self, x):
        return self.a(torch.tanh(self.b(x)))


@pytest.mark.parametrize("mode, rebuilt", [("continuous", True), ("once", True), ("never", False)])
def test_one_rank_observes_and_rebuilds(mode, rebuilt, single_process_group):
    """A world of one rank decides alone: the vote cast after the first
    iteration is counted in the second, at whose end the buckets are rebuilt."""
    torch.manual_seed(0)
    ddp = ddp_ext.DistributedDataParallel(UsedInReverse(), rebuild_buckets=mode, bucket_cap_mb=1e-9)
    assert ddp.reducer.overlap_fraction is None and ddp.reducer.observed_order() == []
    construction = [[3], [2], [1], [0]]
    assert ddp.bucket_indices() == construction
    for _ in range(2):
        ddp(torch.randn(4, 2)).sum().backward()
    # Autograd reaches each Linear's bias before its weight, `a` before `b`.
    assert ddp.reducer.observed_order() == [1, 0, 3, 2]
    # The second iteration still ran with the construction layout, in which
    # bucket 0 fills with the third gradient and launches the only one early.
    assert ddp.reducer.overlap_fraction == pytest.approx(12 / 68)
    # Bias of `a` (8 bytes, first) waits for 60 bytes to arrive, its weight
    # (24 bytes, second) for 36; the two gradients of `b` launch on arrival.
    assert ddp.reducer.launch_delay == pytest.approx((8 * 60 + 24 * 36) / 68**2)
    assert ddp._has_rebuilt_buckets is rebuilt
    data = ddp._get_ddp_logging_data()
    assert data["prev_iteration_grad_ready_order_indices"] == "1, 0, 3, 2"
    assert data["has_rebuilt_buckets"] == int(rebuilt)
    assert data["rebuild_buckets"] == mode
    assert data["bucket_rebuilds"] == int(rebuilt)
    ddp(torch.randn(4, 2)).sum().backward()
    if rebuilt:
        assert ddp.bucket_indices() == [[1], [0], [3], [2]]
        assert data["rebuilt_per_bucket_param_indices"] == "1, 0, 3, 2"
        assert data["rebuilt_bucket_sizes"] == "8, 24, 12, 24"
        # Every bucket but the last gradient's launched before it arrived,
        # each on its gradient's arrival.
        assert ddp.reducer.overlap_fraction == pytest.approx(1 - 24 / 68)
        assert ddp.reducer.launch_delay == 0.0
    else:
        assert ddp.bucket_indices() == construction
        assert "rebuilt_per_bucket_param_indices" not in data
        assert ddp.reducer.overlap_fraction == pytest.approx(12 / 68)
