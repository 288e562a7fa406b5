"""Bucket assignment: the pure C++ function (single process, table-driven) and
the knobs that change the bucket layout in a real run (multi-process): tiny
and huge bucket_cap_mb and gradient_as_bucket_view=True train exactly like
the default and like local training (issue 2)."""

import random

import pytest
import torch

import ddp_ext
from tests.support import reference
from tests.support.harness import CaseTable, assert_grad_layout_kept, assert_same_on_every_rank, assert_states_close
from tests.support.reference import case

# --- assign_buckets: single process -------------------------------------------

F32, F64, I64 = torch.float32, torch.float64, torch.int64
CPU, GPU0, GPU1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


def _specs(*entries):
    """(nbytes, dtype=F32, device=CPU) shorthand."""
    out = []
    for e in entries:
        e = e if isinstance(e, tuple) else (e,)
        nbytes, dtype, device = (e + (F32, CPU)[len(e) - 1 :])[:3]
        out.append((nbytes, dtype, device))
    return out


# (id, tensors in registration order, cap_bytes, expected buckets)
ASSIGNMENT_TABLE = [
    ("empty", _specs(), 100, []),
    ("one_tensor", _specs(4), 100, [[0]]),
    ("all_fit_reverse_order", _specs(4, 4, 4), 100, [[2, 1, 0]]),
    ("exactly_at_cap_fits", _specs(4, 4, 4), 8, [[2, 1], [0]]),
    ("cap_one_byte_one_each", _specs(4, 4, 4), 1, [[2], [1], [0]]),
    ("closed_once_past_cap", _specs(10, 10, 10, 10, 10), 25, [[4, 3, 2], [1, 0]]),
    ("oversized_closes_its_bucket", _specs(4, 100, 4), 8, [[2, 1], [0]]),
    ("oversized_visited_first_alone", _specs(4, 4, 100), 8, [[2], [1, 0]]),
    ("zero_byte_tensors_follow_a_full_bucket", _specs(0, 0, 4), 4, [[2], [1, 0]]),
    ("zero_byte_tensors_join", _specs(4, 0, 0), 4, [[2, 1, 0]]),
    ("dtypes_never_mix", _specs(4, (8, F64), 4, (8, F64)), 100, [[3, 1], [2, 0]]),
    (
        "dtypes_capped_separately",
        _specs(4, (8, F64), 4, (8, F64), 4),
        8,
        [[4, 2], [3], [1], [0]],
    ),
    ("int_dtype_own_bucket", _specs((8, I64), 4, 4), 100, [[2, 1], [0]]),
    ("devices_never_mix", _specs(4, (4, F32, GPU0), (4, F32, GPU1), 4), 100, [[3, 0], [2], [1]]),
    ("same_dtype_other_device", _specs((4, F32, GPU0), 4, (4, F32, GPU0)), 100, [[2, 0], [1]]),
]


@pytest.mark.parametrize(
    "tensors, cap_bytes, expected",
    [row[1:] for row in ASSIGNMENT_TABLE],
    ids=[row[0] for row in ASSIGNMENT_TABLE],
)
def test_assign_buckets_table(tensors, cap_bytes, expected):
    assert ddp_ext._C.assign_buckets(tensors, cap_bytes) == expected


@pytest.mark.parametrize("cap_bytes", [0, -1])
def test_assign_buckets_rejects_non_positive_cap(cap_bytes):
    with pytest.raises(RuntimeError, match="bucket caps must be positive"):
        ddp_ext._C.assign_buckets(_specs(4), cap_bytes)
    with pytest.raises(RuntimeError, match="bucket caps must be positive"):
        ddp_ext._C.assign_buckets(_specs(4), 100, cap_bytes)


# (id, tensors in registration order, cap_bytes, first_cap_bytes, expected buckets)
FIRST_CAP_TABLE = [
    ("first_bucket_smaller", _specs(4, 4, 4, 4, 4), 100, 8, [[4, 3], [2, 1, 0]]),
    ("first_cap_equal_to_cap", _specs(4, 4, 4, 4, 4), 8, 8, [[4, 3], [2, 1], [0]]),
    ("first_bucket_per_kind", _specs(4, (8, F64), 4, (8, F64)), 100, 4, [[3], [2], [1], [0]]),
    ("first_cap_larger_than_cap", _specs(4, 4, 4, 4), 4, 8, [[3, 2], [1], [0]]),
]


@pytest.mark.parametrize(
    "tensors, cap_bytes, first_cap_bytes, expected",
    [row[1:] for row in FIRST_CAP_TABLE],
    ids=[row[0] for row in FIRST_CAP_TABLE],
)
def test_assign_buckets_first_cap_table(tensors, cap_bytes, first_cap_bytes, expected):
    assert ddp_ext._C.assign_buckets(tensors, cap_bytes, first_cap_bytes) == expected


def _check_invariants(tensors, cap, buckets):
    indices = [i for b in buckets for i in b]
    assert sorted(indices) == list(range(len(tensors))), "every tensor in exactly one bucket"
    last_bucket_of_kind = {}
    for b in buckets:
        assert b, "no empty bucket"
        kinds = {(tensors[i][1], tensors[i][2]) for i in b}
        assert len(kinds) == 1, f"bucket {b} mixes {kinds}"
        kind = kinds.pop()
        assert b == sorted(b, reverse=True), f"bucket {b} not in reverse registration order"
        size = sum(tensors[i][0] for i in b)
        assert size - tensors[b[-1]][0] < cap, f"bucket {b} took a tensor after reaching its cap {cap}"
        previous = last_bucket_of_kind.get(kind)
        if previous is not None:
            assert min(previous) > max(b), f"bucket {b} of kind {kind} not after {previous} in reverse order"
            fill = sum(tensors[i][0] for i in previous)
            assert fill >= cap, f"bucket {previous} was closed below its cap ({fill} < {cap} bytes)"
        last_bucket_of_kind[kind] = b


def test_assign_buckets_invariants_on_random_inputs():
    rng = random.Random(0)
    kinds = [(F32, CPU), (F64, CPU), (F32, GPU0), (torch.float16, CPU)]
    for _ in range(300):
        tensors = [(rng.choice([0, 1, 4, 16, 64, 256]),) + rng.choice(kinds) for _ in range(rng.randint(0, 30))]
        cap = rng.choice([1, 16, 64, 100, 1000, 10**9])
        _check_invariants(tensors, cap, ddp_ext._C.assign_buckets(tensors, cap))


def test_assign_buckets_matches_torch_on_random_inputs():
    """The same caps and visiting order group tensors into torch's DDP's
    buckets: its _compute_bucket_assignment_by_size, given the tensors in
    the visiting order with their indices, as torch's rebuild passes the
    order gradients arrived in. The construction layout visits in reverse;
    a rebuild, in any order. With several dtypes the two list the buckets
    in another order, so the groups are compared."""
    rng = random.Random(1)
    dtypes = [F32, F64, torch.float16]
    for _ in range(200):
        params = [torch.empty(rng.choice([0, 1, 3, 16, 64, 250]), dtype=rng.choice(dtypes))
                  for _ in range(rng.randint(1, 30))]
        caps = [rng.choice([1, 16, 100, 1000]), rng.choice([16, 100, 1000, 10**9])]
        specs = [(p.numel() * p.element_size(), p.dtype, p.device) for p in params]
        reverse = list(range(len(params)))[::-1]
        shuffled = rng.sample(range(len(params)), len(params))
        for order, ours in [(reverse, ddp_ext._C.assign_buckets(specs, caps[1], caps[0])),
                            (shuffled, ddp_ext._C.assign_buckets_in_order(specs, shuffled, caps, []))]:
            torchs, _ = torch.distributed._compute_bucket_assignment_by_size(
                [params[i] for i in order], caps, [False] * len(params), order)
            assert sorted(ours) == sorted(torchs), (specs, order, caps)


# --- Knobs that change the layout: multi-process ------------------------------

TINY_MB = 1e-9  # less than one byte: every parameter gets a bucket of its own
HUGE_MB = 1e4  # one bucket per dtype
TWO_DEEP_LAYERS_MB = 2 * (4 * 4 + 4) * 4 / 2**20  # two Linear(4, 4): 160 bytes

KNOBS = {
    "default": dict(),
    "tiny": dict(ddp=dict(bucket_cap_mb=TINY_MB)),
    "huge": dict(ddp=dict(bucket_cap_mb=HUGE_MB)),
    "view": dict(ddp=dict(gradient_as_bucket_view=True)),
    "view_zero_grad_to_zeros": dict(ddp=dict(gradient_as_bucket_view=True), set_to_none=False),
    "view_tiny": dict(ddp=dict(gradient_as_bucket_view=True, bucket_cap_mb=TINY_MB)),
    "no_overlap": dict(overlap=False),
}
MODELS = {"mlp": "sgd", "mixed_dtype": "adam", "deep": "adam"}
CASES = [case(m, opt, **knob) for m, opt in MODELS.items() for knob in KNOBS.values()]
CASES.append(case("deep", "adam", ddp=dict(bucket_cap_mb=TWO_DEEP_LAYERS_MB)))


def _train(rank, world_size, c):
    storages = []  # per step: how many distinct storages the grads of each bucket use

    def on_step(ddp, module):
        params = [p for p in module.parameters() if p.requires_grad]
        storages.append(
            [len({params[i].grad.untyped_storage().data_ptr() for i in b}) for b in ddp.bucket_indices()]
        )

    result = {"ext": reference.train_ddp(reference.ext_ddp, c, rank, world_size, on_step=on_step)}
    result["storages"] = storages
    if rank == 0:
        result["local"] = reference.train_local(c, world_size, concat=True)
    return result


TABLE = CaseTable(_train, CASES)


def _expected_buckets(c, n):
    cap = dict(c.ddp).get("bucket_cap_mb")
    if cap == TINY_MB:
        return [[i] for i in reversed(range(n))]
    if c.model == "mixed_dtype" and cap in (None, HUGE_MB):
        # a(f32) b(f64) c(f32) d(f64), weight then bias: one bucket per dtype,
        # opened in reverse order (d.bias is float64).
        return [[7, 6, 3, 2], [5, 4, 1, 0]]
    if cap in (None, HUGE_MB):
        return [list(reversed(range(n)))]
    if cap == TWO_DEEP_LAYERS_MB:
        return [[i, i - 1, i - 2, i - 3] for i in range(n - 1, 0, -4)]
    raise AssertionError(f"no expectation for {c.id}")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_bucket_layout_does_not_change_training(c, world_size):
    results = TABLE.results(world_size, c)
    traces = [r["ext"] for r in results]
    assert_same_on_every_rank(traces, f"{c.id}, world size {world_size}")
    assert_grad_layout_kept(traces, f"{c.id}, world size {world_size}")
    assert_states_close(traces[0]["params"], results[0]["local"]["params"], f"{c.id}, ddp_ext vs local training")
    default = TABLE.results(world_size, case(c.model, c.optimizer))[0]["ext"]
    assert_states_close(traces[0]["params"], default["params"], f"{c.id} vs default bucketing")

    n = len(traces[0]["params"])
    assert traces[0]["bucket_indices"] == _expected_buckets(c, n)
    if dict(c.ddp).get("gradient_as_bucket_view"):
        # Every .grad is a view into its bucket: one storage per bucket.
        for step, per_bucket in enumerate(results[0]["storages"]):
            assert per_bucket == [1] * len(per_bucket), f"step {step}: grads of a bucket span {per_bucket} storages"
