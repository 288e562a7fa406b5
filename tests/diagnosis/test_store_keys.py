"""Every rank of a group meets its peers in the store under the same key for
the same wrapper, however many other wrappers each rank built before it
(ddp_ext/_diagnosis/hang.py, store_key; Note [Hang attribution]).

Rank 0 builds one more wrapper than the others first: over a group of its
own (an evaluation model), or over the training group without init_sync
(no collectives). Then the wrapper that matters must still read the other
ranks' hang reports (the message names the parameters rank 1 left without a
gradient), and the 8-bit exchange's companion groups must still meet their
own peers (training goes on, with every rank's gradients averaged).
"""

import copy
import datetime
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddp_ext
from tests.support.spawn import run_ranks

HANG_TIMEOUT_S = 2.0
SLACK_S = 6.0  # a loaded machine


class _Net(nn.Module):
    def __init__(self, skip=False):
        super().__init__()
        self.skip = skip
        self.fc0 = nn.Linear(4, 4)
        self.fc1 = nn.Linear(4, 4)

    def forward(self, x):
        x = torch.tanh(self.fc0(x))
        return x if self.skip else self.fc1(x)


def _extra_wrapper_on_rank_0(rank, extra, group, solo):
    """One more wrapper on rank 0 than on the others."""
    if rank != 0:
        return None
    if extra == "other_group":
        return ddp_ext.DistributedDataParallel(nn.Linear(4, 4), process_group=solo)
    return ddp_ext.DistributedDataParallel(nn.Linear(4, 4), process_group=group, init_sync=False)


def _skip_after_extra_wrapper(rank, world_size, extra):
    torch.manual_seed(0)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    solo = dist.new_group(ranks=[0], backend="gloo")  # every rank takes part in new_group
    keep = _extra_wrapper_on_rank_0(rank, extra, group, solo)
    ddp = ddp_ext.DistributedDataParallel(
        _Net(skip=rank == 1), process_group=group, hang_timeout_s=HANG_TIMEOUT_S, on_hang="raise"
    )
    x = torch.randn(3, 4)
    message, seconds = None, None
    loss = ddp(x).pow(2).mean()
    start = time.monotonic()
    try:
        loss.backward()
        ddp(x)  # rank 1 raises at its next forward
    except RuntimeError as e:
        message, seconds = str(e), time.monotonic() - start
    store = dist.distributed_c10d._get_default_store()
    store.add("skip-done", 1)  # not a collective: the group may be unusable
    while int(store.add("skip-done", 0)) < world_size:
        time.sleep(0.05)
    del keep
    return ddp._store_key, message, seconds


@pytest.mark.parametrize("extra", ["other_group", "same_group_without_init_sync"])
def test_hang_reports_are_read_under_the_same_key(extra):
    outcomes = run_ranks(_skip_after_extra_wrapper, 2, extra, timeout=150)
    keys = [key for key, _, _ in outcomes]
    assert len(set(keys)) == 1, f"the ranks meet under different keys: {keys}"
    message, seconds = outcomes[0][1], outcomes[0][2]
    print(message)
    assert message is not None, "rank 0 did not raise"
    assert seconds < HANG_TIMEOUT_S + 1.0 + SLACK_S, f"rank 0 took {seconds:.1f} s"
    # Only rank 1's report, read under the right key, says this:
    assert "rank 1 left parameters without a gradient" in message, message
    assert "Parameters that got no gradient on rank 1: fc1.weight, fc1.bias" in message, message
    assert "reported nothing" not in message, message


def _compress_after_extra_wrapper(rank, world_size):
    torch.manual_seed(0)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
    solo = dist.new_group(ranks=[0], backend="gloo")
    if rank == 0:
        # An evaluation model of rank 0's own, with a companion group of its own.
        extra = ddp_ext.DistributedDataParallel(nn.Linear(4, 4), process_group=solo)
        extra.register_comm_hook(ddp_ext.AdaptivePrecision(int8_exchange="reduce_scatter"),
                                 ddp_ext.adaptive_precision_hook)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    plain = copy.deepcopy(model)  # no step is taken: the same parameters throughout
    ddp = ddp_ext.DistributedDataParallel(model, process_group=group)
    state = ddp_ext.AdaptivePrecision(warmup_iterations=0, check_every=1, int8_exchange="reduce_scatter")
    ddp.register_comm_hook(state, ddp_ext.adaptive_precision_hook)  # meets its companion here
    gaps = []
    for step in range(4):
        torch.manual_seed(100 * step + rank)
        x = torch.randn(16, 64)
        ddp.zero_grad()
        ddp(x).pow(2).mean().backward()
        plain.zero_grad()
        plain(x).pow(2).mean().backward()
        for p, q in zip(model.parameters(), plain.parameters()):
            exact = q.grad / world_size
            dist.all_reduce(exact, group=group)
            gaps.append(float((p.grad - exact).abs().max() / exact.abs().max()))
    return state.int8_exchange_used, ddp._store_key, max(gaps)


def test_compression_companions_meet_their_own_peers():
    outcomes = run_ranks(_compress_after_extra_wrapper, 2, timeout=150)
    (exchange0, key0, gap0), (exchange1, key1, gap1) = outcomes
    assert key0 == key1, (key0, key1)
    assert exchange0 == exchange1 == "reduce_scatter", (exchange0, exchange1)
    # 8 bits or float16 per element: the average within a few per cent.
    assert gap0 < 0.05 and gap1 < 0.05, (gap0, gap1)


def _torch_ddp_compress_after_extra_state(rank, world_size):
    """torch's DDP runs the hook through Python and binds the state at its
    first use: companions then meet under a count per process group."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
    solo = dist.new_group(ranks=[0], backend="gloo")
    if rank == 0:
        torch.manual_seed(0)
        extra = nn.parallel.DistributedDataParallel(nn.Linear(4, 4), process_group=solo)
        extra.register_comm_hook(ddp_ext.AdaptivePrecision(solo, int8_exchange="reduce_scatter"),
                                 ddp_ext.adaptive_precision_hook)
        extra(torch.randn(2, 4)).sum().backward()  # binds its state: a companion over `solo`
    torch.manual_seed(1)
    model = nn.Linear(64, 8)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    state = ddp_ext.AdaptivePrecision(group, warmup_iterations=0, check_every=1, int8_exchange="reduce_scatter")
    ddp.register_comm_hook(state, ddp_ext.adaptive_precision_hook)
    for step in range(3):
        torch.manual_seed(100 * step + rank)
        ddp.zero_grad()
        ddp(torch.randn(16, 64)).pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return state.int8_exchange_used, grads


def test_companions_of_torch_ddp_meet_their_own_peers():
    (exchange0, grads0), (exchange1, grads1) = run_ranks(_torch_ddp_compress_after_extra_state, 2, timeout=150)
    assert exchange0 == exchange1 == "reduce_scatter", (exchange0, exchange1)
    for g0, g1 in zip(grads0, grads1):
        assert torch.equal(g0, g1)  # the same average on every rank
