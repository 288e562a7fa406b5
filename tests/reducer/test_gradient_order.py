"""Gradient order prediction as a user sees it: the `rebuild_buckets`
keyword, and one rank observing the order and rebuilding. The pure pieces
(bucket assignment for an observed order, the overlap measure, the watch's
hysteresis, the consensus rule) are tested in C++
(tests/cpp/gradient_order_test.cpp). See Note [Gradient order prediction] in
reducer/layout/gradient_order.h."""

import inspect

import pytest
import torch
from torch import nn

import ddp_ext

F32, F64 = torch.float32, torch.float64
CPU = torch.device("cpu")


def _specs(*entries):
    """(nbytes, dtype=F32) shorthand, all on the CPU."""
    out = []
    for e in entries:
        nbytes, dtype = (e + (F32,))[:2] if isinstance(e, tuple) else (e, F32)
        out.append((nbytes, dtype, CPU))
    return out


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
    """torch's timing: the first synchronising backward observes the order,
    and the next forward with gradients rebuilds from it (no vote), so the
    second backward already runs with the rebuilt buckets."""
    torch.manual_seed(0)
    ddp = ddp_ext.DistributedDataParallel(UsedInReverse(), rebuild_buckets=mode, bucket_cap_mb=1e-9)
    assert ddp.reducer.overlap_fraction is None and ddp.reducer.observed_order() == []
    # torch's first buckets (one bucket, registration order) where torch's
    # DDP rebuilds; "never" cuts from reverse registration order instead.
    construction = [[0, 1, 2, 3]] if rebuilt else [[3], [2], [1], [0]]
    assert ddp.bucket_indices() == construction
    ddp(torch.randn(4, 2)).sum().backward()
    # Autograd reaches each Linear's bias before its weight, `a` before `b`.
    assert ddp.reducer.observed_order() == [1, 0, 3, 2]
    # Not yet rebuilt: that waits for the next forward, as in torch's DDP.
    assert ddp._has_rebuilt_buckets is False
    assert ddp.bucket_indices() == construction
    if rebuilt:
        # One bucket: nothing launches before the last gradient; each waits
        # for the bytes after it (bias of `a` 60, its weight 36, `b`'s bias 24).
        assert ddp.reducer.overlap_fraction == 0.0
        assert ddp.reducer.launch_delay == pytest.approx((8 * 60 + 24 * 36 + 12 * 24) / 68**2)
    else:
        # Bucket 0 fills with the third gradient and launches the only one
        # early. Bias of `a` (8 bytes, first) waits for 60 bytes to arrive,
        # its weight (24 bytes, second) for 36; `b`'s launch on arrival.
        assert ddp.reducer.overlap_fraction == pytest.approx(12 / 68)
        assert ddp.reducer.launch_delay == pytest.approx((8 * 60 + 24 * 36) / 68**2)
    with torch.no_grad():
        ddp(torch.randn(4, 2))  # no gradients: torch rebuilds nothing here either
    assert ddp._has_rebuilt_buckets is False
    out = ddp(torch.randn(4, 2))
    assert ddp._has_rebuilt_buckets is rebuilt  # from this forward on
    assert ddp.reducer._rebuild_buckets() is False  # once only
    out.sum().backward()
    data = ddp._get_ddp_logging_data()
    assert data["prev_iteration_grad_ready_order_indices"] == "1, 0, 3, 2"
    assert data["has_rebuilt_buckets"] == int(rebuilt)
    assert data["rebuild_buckets"] == mode
    assert data["bucket_rebuilds"] == int(rebuilt)
    if rebuilt:
        assert ddp.bucket_indices() == [[1], [0], [3], [2]]
        assert data["rebuilt_per_bucket_param_indices"] == "1, 0, 3, 2"
        assert data["rebuilt_bucket_sizes"] == "8, 24, 12, 24"
        # The second backward ran with the rebuilt buckets: every bucket but
        # the last gradient's launched before it arrived, each on arrival.
        assert ddp.reducer.overlap_fraction == pytest.approx(1 - 24 / 68)
        assert ddp.reducer.launch_delay == 0.0
    else:
        assert ddp.bucket_indices() == construction
        assert "rebuilt_per_bucket_param_indices" not in data
        assert ddp.reducer.overlap_fraction == pytest.approx(12 / 68)
