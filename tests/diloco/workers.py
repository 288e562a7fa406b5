"""What the ranks of tests/diloco run, and the single-process references.

Four ranks as two hosts of two (LOCAL_WORLD_SIZE=2): ranks 0, 1 are host 0,
ranks 2, 3 host 1. Each rank's batch of a step is drawn from (step, rank), so
a reference can rebuild any group's data."""

import io
import os

import torch
import torch.distributed as dist
from torch import nn
import torch.nn.functional as F

import ddp_ext
from ddp_ext.diloco import FaultTolerance, host_groups

RANKS_PER_HOST = 2
BATCH = 4


def build_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 2))


TEACHER = torch.randn(6, 2, generator=torch.Generator().manual_seed(12345))


def batch(step: int, rank: int):
    """Inputs drawn from (step, rank); targets a fixed function of them, so the loss can fall."""
    x = torch.randn(BATCH, 6, generator=torch.Generator().manual_seed(1000 * step + rank))
    return x, torch.tanh(x @ TEACHER)


def make_inner_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=0.01)


def plain_outer_sgd(params):
    return torch.optim.SGD(params, lr=1.0)


def as_host(rank: int) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(RANKS_PER_HOST)
    os.environ["LOCAL_RANK"] = str(rank % RANKS_PER_HOST)


class Run:
    """One rank's DDP model over its host, its inner optimizer and DiLoCo."""

    def __init__(self, rank: int, inner: str, diloco: dict, seed: int = 0):
        """`diloco`: DiLoCo's arguments (None: plain DDP), and explicit_groups=True
        to pass host_groups()' groups rather than let DiLoCo derive the outer one."""
        as_host(rank)
        diloco = dict(diloco) if diloco is not None else None
        self.rank = rank
        self.groups = host_groups()
        self.ddp = ddp_ext.DistributedDataParallel(build_model(seed), process_group=self.groups.inner)
        self.optimizer = make_inner_optimizer(inner, self.ddp.parameters())
        if diloco is not None and diloco.pop("explicit_groups", False):
            diloco = dict(diloco, inner_group=self.groups.inner, outer_group=self.groups.outer)
        self.outer = ddp_ext.DiLoCo(self.ddp, self.optimizer, **diloco) if diloco is not None else None
        self.losses = []

    def train(self, first: int, last: int) -> None:
        """Steps first .. last - 1."""
        for step in range(first, last):
            x, y = batch(step, self.rank)
            loss = F.mse_loss(self.ddp(x), y)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            if self.outer is not None:
                self.outer.step()
            self.losses.append(loss.item())

    def parameters(self):
        return [p.detach().clone() for p in self.ddp.module.parameters()]

    def global_parameters(self):
        return [p.clone() for p in self.outer.global_parameters()]


def train(rank, world_size, steps, inner, diloco, seed=0):
    """Trains `steps` steps from build_model(seed); this rank's live
    parameters, global parameters (None without DiLoCo), losses and bytes sent."""
    run = Run(rank, inner, diloco, seed=seed)
    run.train(0, steps)
    glob = run.global_parameters() if run.outer is not None else None
    return run.parameters(), glob, run.losses, run.outer.bytes_sent if run.outer is not None else 0


def train_plain_and_diloco(rank, world_size, steps, diloco):
    """The same steps with plain DDP over the host and with DiLoCo around it."""
    plain = train(rank, world_size, steps, "sgd", None)[0]
    return plain, train(rank, world_size, steps, "sgd", diloco)[0]


def train_split_and_whole(rank, world_size, steps, inner, diloco):
    """`train` with each host's ranks exchanging parts of each fragment
    (the default) and with each rank exchanging all of it."""
    split = train(rank, world_size, steps, inner, dict(diloco, split_within_host=True))
    return split, train(rank, world_size, steps, inner, dict(diloco, split_within_host=False))


def checkpoint_and_resume(rank, world_size, steps, at, inner, diloco):
    """Trains `steps` steps uninterrupted, its host's first rank saving a
    checkpoint after step `at` (the others go on meanwhile); then a fresh
    model (another seed), optimizer and DiLoCo on every rank of the host
    load that one and train the rest. Both runs' live and global parameters."""
    run = Run(rank, inner, diloco)
    run.train(0, at)
    saved = io.BytesIO()
    if rank % RANKS_PER_HOST == 0:
        torch.save(run.outer.state_dict(), saved)
    run.train(at, steps)
    shared = [saved.getvalue()]
    dist.broadcast_object_list(shared, src=rank - rank % RANKS_PER_HOST, group=run.groups.inner)
    resumed = Run(rank, inner, diloco, seed=1)
    resumed.outer.load_state_dict(torch.load(io.BytesIO(shared[0])))  # weights_only: plain data
    resumed.train(at, steps)
    return (run.parameters(), run.global_parameters()), (resumed.parameters(), resumed.global_parameters())


def construct(rank, world_size, case):
    """Builds DiLoCo with the bad setting `case`; the message it raised here."""
    as_host(rank)
    diloco = {"sync_every": 4}
    if case == "unequal_groups":
        small = [dist.new_group([0, 1, 2]), dist.new_group([3])]
        inner = small[0] if rank < 3 else small[1]
    else:
        inner = host_groups().inner
    model = build_model()
    ddp = ddp_ext.DistributedDataParallel(model, process_group=inner)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    if case == "sync_every_below_fragments":
        diloco.update(sync_every=1, fragments=2)
    elif case == "delay_too_long":
        diloco.update(fragments=2, delay=2)
    elif case == "outer_optimizer_over_other_parameters":
        diloco.update(outer_optimizer=lambda params: torch.optim.SGD(model.parameters(), lr=0.7))
    elif case == "outer_group_within_a_host":
        within = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        diloco.update(outer_group=within[rank // RANKS_PER_HOST])
    elif case == "delay_too_long_on_rank_0" and rank == 0:
        diloco.update(delay=4)
    elif case == "fault_tolerance_with_outer_group":  # refused before any coordinator is reached
        diloco.update(outer_group=host_groups().outer,
                      fault_tolerance=FaultTolerance("127.0.0.1:1", f"host{rank // RANKS_PER_HOST}"))
    elif case == "settings_differ_on_rank_3" and rank == 3:
        diloco.update(sync_every=8)
    try:
        ddp_ext.DiLoCo(ddp, optimizer, **diloco)
    except ValueError as error:
        return str(error)
    return None


# --- References, in one process ----------------------------------------------


def local_sgd_reference(steps: int, average: bool, seed: int = 0):
    """Each host's model trained with SGD (lr 0.1) on its two ranks'
    batches concatenated (what DDP over the host computes, up to rounding),
    the hosts' parameters replaced by their mean after every step if
    `average`. Both start from build_model(seed). The hosts' parameters, by host."""
    hosts = [build_model(seed) for _ in range(2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in hosts]
    for step in range(steps):
        for host, (model, optimizer) in enumerate(zip(hosts, optimizers)):
            parts = [batch(step, host * RANKS_PER_HOST + i) for i in range(RANKS_PER_HOST)]
            x = torch.cat([p[0] for p in parts])
            y = torch.cat([p[1] for p in parts])
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
        if average:
            with torch.no_grad():
                for params in zip(*(m.parameters() for m in hosts)):
                    mean = torch.stack(params).mean(0)
                    for p in params:
                        p.copy_(mean)
    return [[p.detach().clone() for p in m.parameters()] for m in hosts]
