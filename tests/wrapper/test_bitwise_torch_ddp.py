"""ddp_ext is bitwise torch's DDP at 3 and 4 ranks from the first iteration
on (real multi-process runs over Gloo).

With more than two ranks, the sum Gloo's ring allreduce gives an element
depends on the bucket's size and the element's offset in it, so the same
bits need the same buckets in every iteration: the first layout (Note
[torch's first buckets] in reducer/layout/bucket_assignment.h), the first
rebuild at torch's forward (a static graph's one forward later), and the
rebuilt layout. The first test compares the averaged gradients of every step
and the parameters they give; the second the buckets themselves, with the
layout torch's DDP hands its reducer."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddp_ext
from tests.support.harness import CaseTable, same_bits

STEPS = 4
# A few parameters a bucket under this cap (bytes: 2048, 128, 4096, 128, 512, 16).
FEW_PER_BUCKET_MB = 3000 / 2**20


class _Cast(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)


def _mlp(dtype_of_last=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), _Cast(dtype_of_last),
                         nn.Linear(32, 4).to(dtype_of_last))


@dataclasses.dataclass(frozen=True)
class Config:
    id: str
    kwargs: tuple  # the DDP constructor's keyword arguments, as items
    mixed: bool = False  # the last layer in float64


# torch's DDP never rebuilds buckets with find_unused_parameters (and no
# static graph). ddp_ext's default rebuild_buckets="continuous" re-lays them
# when their order delays launches enough, as it does here with many buckets
# (torch's first layout closes a bucket on the large middle weight): then
# rebuild_buckets="once", torch's rule, keeps torch's layout and bits.
FIND_UNUSED = {"find_unused_parameters": True}
CONFIGS = [
    Config(f"{buckets}-{mode}", tuple(sorted({**caps, **flags}.items())))
    for buckets, caps in (("one_bucket", {}), ("many_buckets", {"bucket_cap_mb": FEW_PER_BUCKET_MB}))
    for mode, flags in (("plain", {}), ("find_unused", FIND_UNUSED), ("static_graph", {"static_graph": True}),
                        ("find_unused-once", {**FIND_UNUSED, "rebuild_buckets": "once"}))
    if not (buckets == "many_buckets" and mode == "find_unused")
]


def _kwargs(wrapper, config: Config) -> dict:
    kwargs = dict(config.kwargs)
    if wrapper is TorchDDP:
        kwargs.pop("rebuild_buckets", None)  # ddp_ext's own
    return kwargs


def _train(wrapper, config: Config, rank: int):
    """Per step: the averaged gradients and whether buckets were rebuilt; at
    the end the parameters."""
    module = _mlp(torch.float64 if config.mixed else torch.float32)
    ddp = wrapper(module, **_kwargs(wrapper, config))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    grads, rebuilt = [], []
    for step in range(STEPS):
        data = torch.randn(8, 20, generator=torch.Generator().manual_seed(1000 * step + rank))
        F.mse_loss(ddp(data[:, :16]).float(), data[:, 16:]).backward()
        grads.append([p.grad.clone() for p in module.parameters()])
        rebuilt.append(bool(ddp._has_rebuilt_buckets))
        optimizer.step()
        optimizer.zero_grad()
    return {"grads": grads, "rebuilt": rebuilt, "params": [p.detach().clone() for p in module.parameters()]}


def _both(rank, world_size, config: Config):
    return {"torch": _train(TorchDDP, config, rank), "ours": _train(ddp_ext.DistributedDataParallel, config, rank)}


TABLE = CaseTable(_both, CONFIGS, timeout=300)


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.id)
def test_bitwise_torch_ddp_from_the_first_iteration(world_size, config):
    for rank, result in enumerate(TABLE.results(world_size, config)):
        theirs, ours = result["torch"], result["ours"]
        assert ours["rebuilt"] == theirs["rebuilt"], f"rank {rank}: rebuilt at other forwards than torch's DDP"
        for step in range(STEPS):
            for i, (t, o) in enumerate(zip(theirs["grads"][step], ours["grads"][step])):
                assert same_bits(t, o), (
                    f"rank {rank}, step {step}, parameter {i}: the averaged gradient differs from torch's "
                    f"by {(t - o).abs().max().item():.3g}"
                )
        assert all(same_bits(t, o) for t, o in zip(theirs["params"], ours["params"])), f"rank {rank}: parameters"


# --- the first buckets themselves ------------------------------------------------

LAYOUT_CONFIGS = CONFIGS + [
    Config("list", (("bucket_cap_mb_list", (0.002, 0.004, 1.0)),)),
    Config("list-find_unused", (("bucket_cap_mb_list", (0.002, 0.004, 1.0)), ("find_unused_parameters", True))),
    Config("mixed-one_bucket", (), mixed=True),
    Config("mixed-many_buckets-find_unused-once",
           (("bucket_cap_mb", FEW_PER_BUCKET_MB), ("find_unused_parameters", True), ("rebuild_buckets", "once")),
           mixed=True),
    Config("explicit_default_cap-find_unused", (("bucket_cap_mb", 25), ("find_unused_parameters", True))),
]


def _torch_first_buckets(module, kwargs):
    """torch's DDP and the bucket indices its _ddp_init_helper hands its reducer."""
    real, seen = dist.Reducer, []

    def capturing(params, bucket_indices, *args):
        seen.append([list(b) for b in bucket_indices])
        return real(params, bucket_indices, *args)

    dist.Reducer = capturing
    try:
        ddp = TorchDDP(module, **kwargs)
    finally:
        dist.Reducer = real
    return ddp, seen[0]


def _layouts(rank, world_size, config: Config):
    dtype = torch.float64 if config.mixed else torch.float32
    theirs, torch_buckets = _torch_first_buckets(_mlp(dtype), _kwargs(TorchDDP, config))
    ours = ddp_ext.DistributedDataParallel(_mlp(dtype), **dict(config.kwargs))
    result = {"torch": torch_buckets, "ours": [list(b) for b in ours.reducer.bucket_indices()], "logged": []}
    for ddp in (theirs, ours):
        data = torch.randn(8, 20, generator=torch.Generator().manual_seed(rank))
        for _ in range(STEPS):
            F.mse_loss(ddp(data[:, :16]).float(), data[:, 16:]).backward()
        logged = ddp._get_ddp_logging_data()
        rebuilt = logged.get("rebuilt_per_bucket_param_indices")
        # The buckets, not their order: torch's rebuild lists the last bucket
        # of each dtype in its hash map's order, ddp_ext in launch order.
        rebuilt = None if rebuilt is None else sorted(rebuilt.split(", "))
        result["logged"].append({"bucket_sizes": logged.get("bucket_sizes"), "rebuilt": rebuilt})
    return result


LAYOUT_TABLE = CaseTable(_layouts, LAYOUT_CONFIGS, timeout=300)


@pytest.mark.parametrize("config", LAYOUT_CONFIGS, ids=lambda c: c.id)
def test_first_buckets_are_torchs(config):
    for rank, result in enumerate(LAYOUT_TABLE.results(3, config)):
        assert result["ours"] == result["torch"], f"rank {rank}: first buckets"
        theirs, ours = result["logged"]
        assert ours == theirs, f"rank {rank}: bucket_sizes (the first layout) and the rebuilt buckets as logged"
