"""A graph kept with retain_graph=True across a sharded optimizer.step()
behaves as with torch's DDP and a plain optimizer.step(): the step changes
the parameters the graph saved, so a second backward through it raises
autograd's "modified by an inplace operation" error. In real runs over Gloo
at 2 ranks, on the in-place path (the parameters in their bucket's storage,
Note [Parameters in the bucket's storage] in ddp_ext/_shard_plan.py), on
the copying path, and with the all-gathers waited for in the step
(overlap_forward=False); the parameters before the second backward are
torch's bits."""

import pytest
import torch
from torch import nn

from tests.support.harness import assert_states_bitwise
from tests.support.worlds import shared_world

SETTLED = 3  # steps before the kept graph's: the layout settled, the parameters in their storage
INPLACE_ERROR = "modified by an inplace operation"


def _job(rank, world_size, path):
    import ddp_ext

    out = {}
    for kind in ("ddp_ext", "torch"):
        torch.manual_seed(5)
        module = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        if kind == "torch":
            ddp = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=0.0002)
        else:
            ddp = ddp_ext.DistributedDataParallel(module, bucket_cap_mb=0.0002)
        optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
        if kind == "ddp_ext":
            ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0, overlap_forward=path != "waited")
            if path == "copying":
                ddp._optimizer_overlap.storage.in_place = False
        for step in range(SETTLED + 1):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward(retain_graph=step == SETTLED)
            optimizer.step()
            optimizer.zero_grad()
        if kind == "ddp_ext":
            plans = ddp._optimizer_overlap.plans.values()
            out["in_storage"] = sum(plan.storage is not None for plan in plans)
            out["buckets"] = len(plans)
        try:
            loss.backward()
            out[f"{kind}_error"] = ""
        except RuntimeError as e:
            out[f"{kind}_error"] = str(e)
        out[kind] = {n: p.detach().clone() for n, p in module.named_parameters()}
    return out


@pytest.mark.parametrize("path", ["in_place", "copying", "waited"])
def test_a_graph_kept_across_the_step_fails_its_second_backward_as_with_torch(path):
    for rank, out in enumerate(shared_world(2).run(_job, path)):
        assert INPLACE_ERROR in out["torch_error"], f"rank {rank}: torch's DDP: {out['torch_error']!r}"
        assert INPLACE_ERROR in out["ddp_ext_error"], f"rank {rank} {path}: ddp_ext: {out['ddp_ext_error']!r}"
        assert out["buckets"] > 1, (rank, out["buckets"])
        if path == "in_place":
            assert out["in_storage"] == out["buckets"], (rank, out["in_storage"], out["buckets"])
        if path == "copying":
            assert out["in_storage"] == 0, (rank, out["in_storage"])
        assert_states_bitwise(out["ddp_ext"], out["torch"], f"rank {rank} {path}: parameters")
