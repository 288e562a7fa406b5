"""Hierarchical allreduce (ddp_ext/hierarchy.py, Note [Hierarchical allreduce]).

- Unit: the topology torchrun's variables describe, when "auto" turns it on,
  and what hierarchical_allreduce=True refuses.
- 4 ranks as 2 fake hosts x 2 (LOCAL_WORLD_SIZE / LOCAL_RANK set in the
  ranks): where sums are exact in float32 (integer gradients), the same
  bits as flat allreduce; in training, the same parameters as flat
  allreduce up to float rounding (the host sums are added first, another
  order than the flat ring's), every rank bitwise equal, close to local
  training; the reducer's allreduces really ran in three steps; "auto" stays
  off on one host and with one rank per host.
"""

import contextlib
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddp_ext
from ddp_ext import hierarchy
from tests.support import reference
from tests.support.harness import CaseTable, assert_states_close, same_bits

# --- unit ---------------------------------------------------------------------

TOPOLOGIES = [
    # LOCAL_WORLD_SIZE, world size -> (hosts, ranks per host) or None; pays
    (None, 4, None, False),
    ("4", 4, (1, 4), False),  # one host: nothing crosses a slower link
    ("2", 4, (2, 2), True),
    ("1", 4, (4, 1), False),  # one rank per host: nothing to combine
    ("3", 4, None, False),  # does not divide the world
    ("x", 4, None, False),
    ("4", 8, (2, 4), True),
]


@pytest.mark.parametrize("local, world_size, expected, pays", TOPOLOGIES)
def test_topology_from_torchrun_variables(local, world_size, expected, pays):
    environ = {} if local is None else {"LOCAL_WORLD_SIZE": local}
    topology = hierarchy.topology_from_env(world_size, environ)
    assert (None if topology is None else (topology.hosts, topology.ranks_per_host)) == expected
    assert hierarchy.pays(topology) is pays


def test_setting_is_checked():
    for good in ("auto", True, False):
        hierarchy.check_setting(good)
    for bad in ("on", 1, None, "True"):
        with pytest.raises(ValueError, match="hierarchical_allreduce must be 'auto', True or False"):
            hierarchy.check_setting(bad)


# --- 2 fake hosts x 2 ranks -----------------------------------------------------


@contextlib.contextmanager
def _fake_hosts(rank, ranks_per_host):
    """torchrun's variables for `rank` as if hosts had `ranks_per_host` ranks."""
    saved = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(LOCAL_WORLD_SIZE=str(ranks_per_host), LOCAL_RANK=str(rank % ranks_per_host))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Fixed(nn.Module):
    """loss = sum_k sum(w_k * x_k): the gradient of w_k is x_k."""

    NUMELS = (1001, 7, 300)

    def __init__(self):
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.zeros(n)) for n in self.NUMELS)

    def forward(self, xs):
        return sum((w * x).sum() for w, x in zip(self.w, xs))


def _exact(rank, world_size, setting, ranks_per_host=2):
    """Integer gradients (times the world size, so the average is an exact
    float too): every order of summing gives the same bits."""
    module = Fixed()
    with _fake_hosts(rank, ranks_per_host):
        ddp = ddp_ext.DistributedDataParallel(module, bucket_cap_mb=1e-6, hierarchical_allreduce=setting)
        group = ddp.reducer_group
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    for step in range(5):
        g = torch.Generator().manual_seed(10 * step + rank)
        xs = [torch.randint(-50, 50, (n,), generator=g).float() * world_size for n in Fixed.NUMELS]
        ddp(xs).backward()
        optimizer.step()
        optimizer.zero_grad()
    return dict(weights=[w.detach().clone() for w in module.w], calls=hierarchy.hierarchical_calls(group))


@dataclasses.dataclass(frozen=True)
class Exact:
    setting: object
    ranks_per_host: int = 2

    @property
    def id(self):
        return f"exact-{self.setting}-{self.ranks_per_host}"


def _exact_case(rank, world_size, c: Exact):
    return _exact(rank, world_size, c.setting, c.ranks_per_host)


# (world size, ranks per host): hosts of one rank, one host, and several of
# several, forced on where "auto" would stay off.
FORCED_TOPOLOGIES = [(2, 1), (3, 3), (5, 1), (6, 3)]
EXACT = CaseTable(_exact_case, [Exact("auto"), Exact(False)]
                  + [Exact(True, per_host) for per_host in sorted({p for _, p in FORCED_TOPOLOGIES})])


def test_exact_sums_give_the_same_bits_as_flat_allreduce():
    hier = EXACT.results(4, Exact("auto"))
    flat = EXACT.results(4, Exact(False))
    for h, f in zip(hier, flat):
        # Three buckets a step, 5 steps; and nothing hierarchical when off.
        assert h["calls"] >= 15 and f["calls"] == 0
        assert all(same_bits(a, b) for a, b in zip(h["weights"], f["weights"]))
        assert all(same_bits(a, b) for a, b in zip(h["weights"], hier[0]["weights"]))
    assert any(w.abs().sum() > 0 for w in hier[0]["weights"])


@pytest.mark.parametrize("world_size, ranks_per_host", FORCED_TOPOLOGIES)
def test_forced_hierarchy_gives_the_same_bits_at_other_world_sizes(world_size, ranks_per_host):
    hier = EXACT.results(world_size, Exact(True, ranks_per_host))
    flat = EXACT.results(world_size, Exact(False))
    for h, f in zip(hier, flat):
        assert h["calls"] >= 15
        assert all(same_bits(a, b) for a, b in zip(h["weights"], f["weights"]))
    assert any(w.abs().sum() > 0 for w in hier[0]["weights"])


TRAIN_CASES = [
    reference.case("mlp", steps=6),
    reference.case("conv", "adam", steps=6, ddp=dict(bucket_cap_mb=0.001)),
    reference.case("never_used", ddp=dict(find_unused_parameters=True)),
]


def _train(rank, world_size, c):
    out = {}
    for setting in ("auto", False):

        def make(module, **kwargs):
            with _fake_hosts(rank, 2):
                ddp = reference.ext_ddp(module, hierarchical_allreduce=setting, **kwargs)
                out[f"group-{setting}"] = ddp.reducer_group
            return ddp

        out[setting] = reference.train_ddp(make, c, rank, world_size)
        out[f"calls-{setting}"] = hierarchy.hierarchical_calls(out.pop(f"group-{setting}"))
    return out


TRAIN = CaseTable(_train, TRAIN_CASES)


@pytest.mark.parametrize("c", TRAIN_CASES, ids=lambda c: c.id)
def test_training_matches_flat_allreduce(c):
    results = TRAIN.results(4, c)
    local = reference.train_local(c, 4, concat=True)
    for r in results:
        assert r["calls-auto"] >= c.steps and r["calls-False"] == 0
        # Every rank the same bits: step 2's result is one Gloo ring's, copied.
        assert r["auto"]["digest"] == results[0]["auto"]["digest"]
        # Flat and hierarchical add the same four values in another order:
        # float32 rounding, a few ulps per step (rtol 1e-5 over 6 steps).
        assert_states_close(r["auto"]["params"], r[False]["params"], c.id, rtol=1e-5, atol=1e-6)
        assert_states_close(r["auto"]["params"], local["params"], c.id, rtol=1e-4, atol=1e-5)
        assert r["auto"]["grad_none"] == r[False]["grad_none"]


def _stays_off(rank, world_size, ranks_per_host):
    with _fake_hosts(rank, ranks_per_host):
        ddp = ddp_ext.DistributedDataParallel(nn.Linear(3, 2))
        return ddp.reducer_group is ddp.process_group


@dataclasses.dataclass(frozen=True)
class Off:
    ranks_per_host: int

    @property
    def id(self):
        return f"off-{self.ranks_per_host}"


def _off_case(rank, world_size, c: Off):
    return _stays_off(rank, world_size, c.ranks_per_host)


OFF = CaseTable(_off_case, [Off(4), Off(1)])


@pytest.mark.parametrize("c", OFF.cases, ids=lambda c: c.id)
def test_auto_stays_off_on_one_host_and_with_one_rank_per_host(c):
    assert all(OFF.results(4, c))


def _forced_without_topology(rank, world_size, _):
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    try:
        ddp_ext.DistributedDataParallel(nn.Linear(3, 2), hierarchical_allreduce=True)
    except ValueError as e:
        return str(e)
    return ""


FORCED = CaseTable(_forced_without_topology, [Off(0)])


def test_forcing_it_on_without_a_topology_says_why():
    for message in FORCED.results(2, Off(0)):
        assert "hierarchical_allreduce=True: cannot reduce hierarchically" in message and "LOCAL_WORLD_SIZE" in message


def _not_on_gloo_cpu(rank, world_size, _):
    """The decision for a module on a GPU, with 2 hosts of 2 ranks: "auto"
    stays flat (NCCL's own rings and trees; the subgroups are Gloo's), True
    says why it cannot be."""
    with _fake_hosts(rank, 2):
        auto = hierarchy.resolve("auto", dist.distributed_c10d._get_default_group(), "cuda")
        try:
            hierarchy.resolve(True, dist.distributed_c10d._get_default_group(), "cuda")
        except ValueError as e:
            return auto, str(e)
    return auto, ""


NOT_GLOO_CPU = CaseTable(_not_on_gloo_cpu, [Off(2)])


def test_a_module_on_a_gpu_stays_flat():
    for auto, message in NOT_GLOO_CPU.results(4, Off(2)):
        assert auto is None
        assert "cannot reduce hierarchically" in message and "CPU tensors over Gloo" in message, message


def _join(rank, world_size, setting):
    from torch.distributed.algorithms.join import Join

    from tests.support import models

    module = models.build("mlp")
    with _fake_hosts(rank, 2):
        ddp = ddp_ext.DistributedDataParallel(module, hierarchical_allreduce=setting)
        calls = hierarchy.hierarchical_calls(ddp.reducer_group)
        group = ddp.reducer_group
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with Join([ddp]):
        for step in range(3 + 2 * rank):  # uneven inputs: ranks join at different steps
            args, target = models.rank_batch("mlp", step, 0, rank, world_size, 4)
            models.MODELS["mlp"].loss(ddp(*args), target).backward()
            optimizer.step()
            optimizer.zero_grad()
    return dict(params=reference.state_tensors(module)[0], calls=hierarchy.hierarchical_calls(group) - calls)


@dataclasses.dataclass(frozen=True)
class JoinCase:
    setting: object

    @property
    def id(self):
        return f"join-{self.setting}"


def _join_case(rank, world_size, c: JoinCase):
    return _join(rank, world_size, c.setting)


JOIN = CaseTable(_join_case, [JoinCase("auto"), JoinCase(False)])


def test_join_with_uneven_inputs_matches_flat_allreduce():
    hier = JOIN.results(4, JoinCase("auto"))
    flat = JOIN.results(4, JoinCase(False))
    assert all(h["calls"] > 0 for h in hier) and all(f["calls"] == 0 for f in flat)
    for h, f in zip(hier, flat):
        assert_states_close(h["params"], f["params"], "join", rtol=1e-5, atol=1e-6)
        for name, value in h["params"].items():
            assert same_bits(value, hier[0]["params"][name]), name


def _collectives(rank, world_size, _):
    """What the reducer's group does besides its three-step SUM allreduce."""
    with _fake_hosts(rank, 2):
        ddp = ddp_ext.DistributedDataParallel(nn.Linear(3, 2))
        group = ddp.reducer_group
    before = hierarchy.hierarchical_calls(group)
    out = {}
    ints = torch.tensor([rank, 1, 2 * rank], dtype=torch.int32)  # odd length: padded segments
    group.allreduce([ints]).wait()
    out["ints"] = ints.tolist()
    out["three_step"] = hierarchy.hierarchical_calls(group) - before
    biggest = torch.tensor([float(rank)])
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    group.allreduce([biggest], opts).wait()  # not SUM: the flat group
    pair = [torch.ones(2), torch.full((2,), float(rank))]
    group.allreduce(pair).wait()  # two tensors: the flat group
    out["flat"] = [biggest.item(), pair[0].tolist(), pair[1].tolist()]
    out["flat_three_step"] = hierarchy.hierarchical_calls(group) - before
    sent = torch.full((4,), float(rank))
    bopts = dist.BroadcastOptions()
    bopts.rootRank = 2
    group.broadcast([sent], bopts).wait()
    group.barrier().wait()
    out["broadcast"] = sent.tolist()
    return out


COLLECTIVES = CaseTable(_collectives, [Off(-1)])


def test_the_reducer_group_forwards_what_it_does_not_run_in_three_steps():
    for r in COLLECTIVES.results(4, Off(-1)):
        assert r["ints"] == [6, 4, 12] and r["three_step"] == 1
        assert r["flat"] == [3.0, [10.0, 10.0], [10.0, 10.0]]  # Gloo sums the local tensors too and r["flat_three_step"] == 1
        assert r["broadcast"] == [2.0] * 4
