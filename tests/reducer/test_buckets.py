"""The knobs that change the bucket layout in a real run (multi-process):
tiny and huge bucket_cap_mb and gradient_as_bucket_view=True train exactly
like the default and like local training. The assignment rule itself is
tested in C++ (tests/cpp/bucket_assignment_test.cpp)."""

import pytest

from tests.support import reference
from tests.support.harness import CaseTable, assert_grad_layout_kept, assert_same_on_every_rank, assert_states_close
from tests.support.reference import case

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
