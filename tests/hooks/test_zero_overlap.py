"""torch's ZeRO overlap hooks (hook_with_zero_step, hook_with_zero_step_interleaved
with ZeroRedundancyOptimizer(overlap_with_ddp=True)) under ddp_ext.

On Gloo both refuse with torch's own message before anything runs, as they
do for torch's DDP. hook_with_zero_step reads the wrapper's
_has_rebuilt_buckets on every bucket from inside the hook (which hung both
ranks before Note [Windows without the lock]); with the refusal patched out
while the hook is made (in both runs), it trains to the same parameters
under ddp_ext as under torch's DDP, with SGD and Adam.
hook_with_zero_step_interleaved is not run on Gloo: its future callback
waits for broadcasts on one of Gloo's own threads, which hangs under
torch's DDP just the same, and torch's refusal stands. See docs/TORCH_CONTRACT.md,
"Communication hooks"."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.optim import ZeroRedundancyOptimizer

from tests.support.spawn import run_ranks_for_each

STEPS = 6  # the first two update nothing: ZeRO learns DDP's buckets from them
TIMEOUT_S = 120.0  # a hook that blocks on the reducer hangs: fail instead
IMPLS = ("ddp_ext", "torch")  # each job runs both, one after the other, on the same ranks
GLOO_REFUSAL = "Gloo backend using Overlapping DDP with ZeRO may meet hangs"
MAKERS = {
    "step": ddp_zero_hook.hook_with_zero_step,
    "interleaved": ddp_zero_hook.hook_with_zero_step_interleaved,
}
OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _wrap(impl, model):
    import ddp_ext
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    wrapper = ddp_ext.DistributedDataParallel if impl == "ddp_ext" else TorchDDP
    return wrapper(model, bucket_cap_mb=0.0005)  # several buckets


def _without_gloo_refusal():
    """torch refuses the ZeRO hooks when get_backend says gloo; only while the
    hook is made (the one place that asks)."""
    return mock.patch.object(ddp_zero_hook.dist, "get_backend", lambda group=None: "nccl")


def _train(rank, world_size, impl, variant, optimizer):
    ddp = _wrap(impl, _model())
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class=OPTIMIZERS[optimizer], overlap_with_ddp=True, lr=0.01
    )
    with _without_gloo_refusal():
        hook = MAKERS[variant](allreduce_hook, ddp, zero)
    ddp.register_comm_hook(None, hook)
    before = [p.detach().clone() for p in ddp.module.parameters()]
    gen = torch.Generator().manual_seed(100 + rank)
    rebuilt_after_forward = []  # iteration by iteration, as the hook sees it
    unmoved = []  # whether each iteration left the parameters as they were
    for _ in range(STEPS):
        ddp.zero_grad()
        x = torch.randn(6, 8, generator=gen)
        y = torch.randn(6, 4, generator=gen)
        start = [p.detach().clone() for p in ddp.module.parameters()]
        out = ddp(x)
        rebuilt_after_forward.append(bool(ddp._has_rebuilt_buckets))
        nn.functional.mse_loss(out, y).backward()
        unmoved.append(all(torch.equal(a, p) for a, p in zip(start, ddp.module.parameters())))
    params = [p.detach().clone() for p in ddp.module.parameters()]
    return {
        "params": params,
        "moved": any(not torch.equal(a, b) for a, b in zip(before, params)),
        "rebuilt_after_forward": rebuilt_after_forward,
        "unmoved": unmoved,
    }


def _refusals(rank, world_size, impl):
    ddp = _wrap(impl, _model())
    refused = {}
    for variant, make in MAKERS.items():
        zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, overlap_with_ddp=True, lr=0.01)
        try:
            make(allreduce_hook, ddp, zero)
        except RuntimeError as error:
            refused[variant] = str(error)
    return refused


def test_on_gloo_both_hooks_refuse_with_torchs_message_as_under_torch():
    for impl, by_rank in zip(IMPLS, run_ranks_for_each(_refusals, 2, IMPLS, timeout=2 * TIMEOUT_S)):
        for refused in by_rank:
            assert refused == {variant: GLOO_REFUSAL for variant in MAKERS}, (impl, refused)


# ddp_ext's first bucket rebuild comes where torch's does, at the start of the
# second forward (docs/TORCH_CONTRACT.md), so ZeRO, which waits for it, starts
# updating at the same iteration with no leading iteration: same inputs, same
# steps for both.
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_hook_with_zero_step_trains_as_under_torch(optimizer):
    ours, theirs = run_ranks_for_each(_train, 2, IMPLS, "step", optimizer, timeout=2 * TIMEOUT_S)
    for rank, (mine, reference) in enumerate(zip(ours, theirs)):
        assert reference["rebuilt_after_forward"] == [False] + [True] * (STEPS - 1), reference
        assert mine["rebuilt_after_forward"] == reference["rebuilt_after_forward"], (rank, mine, reference)
        assert mine["unmoved"] == reference["unmoved"], (rank, mine["unmoved"], reference["unmoved"])
        assert mine["moved"] and reference["moved"], "ZeRO never stepped: the test proves nothing"
        for index, (a, b) in enumerate(zip(mine["params"], reference["params"])):
            torch.testing.assert_close(a, b, msg=f"{optimizer}, rank {rank}, parameter {index}")
    for index, (a, b) in enumerate(zip(ours[0]["params"], ours[1]["params"])):
        assert torch.equal(a, b), f"ranks differ on parameter {index}"
