"""Layer dropping (ddp_ext.LayerDrop; Note [Layer dropping] in
reducer/participation/layer_drop.h).

Single process: the module's plans, its arguments, and the bucket rule that
keeps each layer's parameters apart. Multi-process (Gloo, 2 and 3 ranks):
training with dropped layers equals local training with the same drops and
torch's DDP (find_unused_parameters=True, with and without
skip_all_reduce_unused_params) across knobs; the bytes communicated are
those of the kept layers; bucket memory and .grad views never move; Join;
and ranks that drop different layers, or use a dropped layer's parameter,
get an error instead of a hang or wrong gradients.
"""

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ddp_ext
from ddp_ext._dropped_layers import DroppedLayers
from tests.support import models, reference
from tests.support.harness import CaseTable, assert_same_on_every_rank, assert_states_close
from tests.support.reference import case

F32 = torch.float32
CPU = torch.device("cpu")


# --- the module, in one process -------------------------------------------------


def _blocks(n=6, p=0.5, seed=7):
    return ddp_ext.LayerDrop([nn.Linear(4, 4) for _ in range(n)], p=p, seed=seed)


def test_plans_depend_only_on_seed_and_draw():
    a, b = _blocks(seed=11), _blocks(seed=11)
    assert [a.plan(d) for d in range(20)] == [b.plan(d) for d in range(20)]
    assert [a.plan(d) for d in range(20)] != [_blocks(seed=12).plan(d) for d in range(20)]
    assert len({tuple(a.plan(d)) for d in range(20)}) > 5, "plans should vary from draw to draw"


def test_drop_rate_is_about_p():
    blocks = _blocks(n=10, p=0.3)
    kept = sum(sum(blocks.plan(d)) for d in range(500))
    assert abs(kept / 5000 - 0.7) < 0.03


def test_training_calls_draw_and_run_the_kept_layers_eval_runs_all():
    blocks = _blocks()
    for layer in blocks:
        layer.register_forward_hook(lambda m, i, o: calls.append(m))
    calls: List[nn.Module] = []
    expected = [layer for layer, keep in zip(blocks, blocks.plan(0)) if keep]
    blocks(torch.randn(2, 4))
    assert calls == expected and blocks.draws == 1
    calls.clear()
    blocks.eval()
    blocks(torch.randn(2, 4))
    assert calls == list(blocks) and blocks.draws == 1, "eval mode neither drops nor draws"


def test_p_extremes():
    x = torch.randn(2, 4)
    assert torch.equal(_blocks(p=1.0)(x), x), "p=1 drops every layer"
    assert len(_blocks(p=0.0).kept()) == 6


def test_state_dict_is_a_module_lists():
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(3)]
    assert ddp_ext.LayerDrop(layers, p=0.2).state_dict().keys() == nn.ModuleList(layers).state_dict().keys()


@pytest.mark.parametrize(
    "kwargs, phrase",
    [({"p": 1.5}, "p must be a number in [0, 1]"), ({"p": True}, "p must be"), ({"p": "0.1"}, "p must be"),
     ({"seed": -1}, "seed must be an int"), ({"seed": 2**62}, "seed must be"), ({"seed": 1.0}, "seed must be")],
)
def test_bad_arguments(kwargs, phrase):
    with pytest.raises(ValueError, match=phrase.replace("[", r"\[").replace("]", r"\]")):
        ddp_ext.LayerDrop([nn.Linear(2, 2)], **kwargs)


def test_default_seed_follows_torch_manual_seed():
    torch.manual_seed(3)
    a = ddp_ext.LayerDrop([nn.Linear(2, 2)])
    torch.manual_seed(3)
    b = ddp_ext.LayerDrop([nn.Linear(2, 2)])
    assert a.seed == b.seed


def test_parameters_belong_to_their_innermost_layer_and_tied_ones_to_none():
    torch.manual_seed(0)
    module = models.Dropping(tied=True)
    params = [p for _, p in module.named_parameters()]
    names = [n for n, _ in module.named_parameters()]
    units = DroppedLayers(module, params).units
    by_name = dict(zip(names, units))
    assert by_name["inp.weight"] == by_name["out.bias"] == -1
    assert by_name["blocks.0.0.weight"] == by_name["blocks.0.2.bias"] == 0
    assert by_name["blocks.4.2.weight"] == 4
    assert by_name["blocks.2.0.weight"] == -1, "tied to `side`: used outside its layer"
    assert by_name["blocks.2.0.bias"] == 2

    outer = ddp_ext.LayerDrop([ddp_ext.LayerDrop([nn.Linear(2, 2), nn.Linear(2, 2)]), nn.Linear(2, 2)])
    nested = DroppedLayers(outer, list(outer.parameters()))
    assert nested.units == [2, 2, 3, 3, 1, 1], "inner layers are units of their own"
    assert nested.layer_params[0][0] == [0, 1, 2, 3], "dropping the outer layer drops the inner ones"


# --- training: parity with local training and torch's DDP -------------------------

OURS_ONLY = ("rebuild_buckets",)
_ld = functools.partial(case, steps=8)
CASES = [
    _ld("layerdrop"),
    _ld("layerdrop", "adam"),
    _ld("layerdrop", ddp={"gradient_as_bucket_view": True}),
    _ld("layerdrop", ddp={"find_unused_parameters": True}),
    _ld("layerdrop", ddp={"find_unused_parameters": True, "skip_all_reduce_unused_params": True}),
    _ld("layerdrop", ddp={"batched_grad_copy": True}),
    _ld("layerdrop", ddp={"bucket_cap_mb": 0.0001}),
    _ld("layerdrop", ddp={"rebuild_buckets": "never"}),
    _ld("layerdrop", micro_batches=3),
    _ld("layerdrop", micro_batches=2, ddp={"gradient_as_bucket_view": True}),
    _ld("layerdrop", set_to_none=False),
    _ld("layerdrop_tied"),
    _ld("layerdrop_tied", ddp={"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0001}),
]


def _torch_kwargs(c) -> Dict[str, Any]:
    kwargs = {k: v for k, v in c.ddp if k not in OURS_ONLY}
    kwargs["find_unused_parameters"] = True  # what torch's DDP needs for dropped layers
    return kwargs


def _train(rank, world_size, c):
    result = {
        "ext": reference.train_ddp(reference.ext_ddp, c, rank, world_size),
        "torch": reference.train_ddp(
            reference.torch_ddp, dataclasses.replace(c, ddp=tuple(sorted(_torch_kwargs(c).items()))), rank, world_size
        ),
    }
    if rank == 0:
        result["local"] = reference.train_local(c, world_size, concat=True)
    return result


TABLE = CaseTable(_train, CASES)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_matches_local_training_and_torch_ddp(c, world_size):
    results = TABLE.results(world_size, c)
    what = f"{c.id}, world size {world_size}"
    ours = [r["ext"] for r in results]
    assert_same_on_every_rank(ours, what)
    local = results[0]["local"]
    assert_states_close(ours[0]["params"], local["params"], f"{what}: ddp_ext vs local training")
    assert ours[0]["grad_none"] == local["grad_none"], "dropped parameters keep .grad as local training leaves it"
    assert any(step for step in local["grad_none"]) or not c.set_to_none, "the case should drop some layers"
    theirs = results[0]["torch"]
    assert_states_close(ours[0]["params"], theirs["params"], f"{what}: ddp_ext vs torch's DDP")
    assert ours[0]["grad_none"] == theirs["grad_none"]
    torch.manual_seed(0)
    module = models.build(c.model)
    units = DroppedLayers(module, [p for p in module.parameters() if p.requires_grad]).units
    for bucket in ours[0]["bucket_indices"]:
        assert len({units[i] for i in bucket}) == 1, f"bucket {bucket} mixes layers: {[units[i] for i in bucket]}"


# --- what travels, and what stays put ---------------------------------------------


def _recording_allreduce(sent: List[int]):
    def hook(state, bucket):
        sent.append(bucket.buffer().numel() * bucket.buffer().element_size())
        tensor = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])

    return hook


def _bytes_and_addresses(p, ddp_kwargs, rank, world_size):
    torch.manual_seed(0)
    module = models.Dropping()
    module.blocks.p = p
    ddp = ddp_ext.DistributedDataParallel(module, **ddp_kwargs)
    sent: List[int] = []
    ddp.register_comm_hook(None, _recording_allreduce(sent))
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    per_step, expected, addresses, bucket_sizes = [], [], [], []
    for step in range(12):
        draw = module.blocks.draws
        (x,), y = models.global_batch("layerdrop", step, 0, 4)
        F.mse_loss(ddp(x), y).backward()
        per_step.append(sum(sent))
        sent.clear()
        kept = module.blocks.plan(draw)
        dropped = {id(q) for layer, keep in zip(module.blocks, kept) if not keep for q in layer.parameters()}
        expected.append(sum(q.numel() * q.element_size() for q in module.parameters() if id(q) not in dropped))
        addresses.append({n: q.grad.data_ptr() for n, q in module.named_parameters() if q.grad is not None})
        bucket_sizes.append(ddp.reducer.bucket_sizes())
        opt.step()
    return dict(per_step=per_step, expected=expected, addresses=addresses, bucket_sizes=bucket_sizes)


BYTES_CASES = {
    "p0.5": functools.partial(_bytes_and_addresses, 0.5, {"rebuild_buckets": "never"}),
    "p0": functools.partial(_bytes_and_addresses, 0.0, {"rebuild_buckets": "never"}),
    "p0.5-gradient_as_bucket_view": functools.partial(
        _bytes_and_addresses, 0.5, {"gradient_as_bucket_view": True, "rebuild_buckets": "never"}
    ),
}


@dataclasses.dataclass(frozen=True)
class Run:
    id: str
    fn: Callable


def _run(rank, world_size, r):
    return r.fn(rank, world_size)


RUNS = [Run(k, v) for k, v in BYTES_CASES.items()]
RUN_TABLE = CaseTable(_run, RUNS)


@pytest.mark.parametrize("r", RUNS, ids=lambda r: r.id)
def test_bytes_sent_are_the_kept_layers(r):
    for rank, out in enumerate(RUN_TABLE.results(2, r)):
        assert out["per_step"] == out["expected"], f"rank {rank}: bytes sent per step vs bytes of kept layers"
        if r.id.startswith("p0.5"):
            assert min(out["per_step"]) < max(out["per_step"]), "some steps should drop more than others"
        assert all(s == out["bucket_sizes"][0] for s in out["bucket_sizes"]), "bucket memory must not change"


def test_gradient_views_never_move():
    for rank, out in enumerate(RUN_TABLE.results(2, Run("p0.5-gradient_as_bucket_view", None))):
        first_seen: Dict[str, int] = {}
        for step in out["addresses"]:
            for name, address in step.items():
                assert first_seen.setdefault(name, address) == address, f"rank {rank}: {name}'s .grad moved"


# --- Join, rebuilds, misuse --------------------------------------------------------


def _join(wrapper_name, rank, world_size):
    torch.manual_seed(0)
    module = models.Dropping()
    if wrapper_name == "torch":
        ddp = torch.nn.parallel.DistributedDataParallel(module, find_unused_parameters=True)
    else:
        ddp = ddp_ext.DistributedDataParallel(module)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    with ddp.join():
        for step in range(5 + 2 * rank):  # later ranks have more data
            (x,), y = models.global_batch("layerdrop", step, rank, 4)
            F.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
    return {n: q.detach().clone() for n, q in module.named_parameters()}


def _join_both(rank, world_size):
    return _join("torch", rank, world_size), _join("ext", rank, world_size)


def _rebuilds(rank, world_size):
    torch.manual_seed(0)
    module = models.Dropping()
    ddp = ddp_ext.DistributedDataParallel(module, bucket_cap_mb=0.0001)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    for step in range(20):
        (x,), y = models.global_batch("layerdrop", step, 0, 4)
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    units = DroppedLayers(module, list(module.parameters())).units
    return ddp.reducer.rebuilds, [[units[i] for i in b] for b in ddp.bucket_indices()]


def _static_graph(rank, world_size):
    torch.manual_seed(0)
    try:
        ddp_ext.DistributedDataParallel(models.Dropping(), static_graph=True)
    except ValueError as e:
        return str(e)
    return "no error"


def _seeds_taken_from_rank_0(rank, world_size):
    torch.manual_seed(rank)  # a different default seed on every rank
    module = models.Dropping()
    module.blocks.seed = 1000 + rank
    module.blocks.draws = rank
    ddp_ext.DistributedDataParallel(module)
    return module.blocks.seed, module.blocks.draws


MORE = [
    Run("join", _join_both),
    Run("rebuilds", _rebuilds),
    Run("static_graph", _static_graph),
    Run("seeds", _seeds_taken_from_rank_0),
]
MORE_TABLE = CaseTable(_run, MORE)


def test_join_matches_torch_ddp():
    for rank, (theirs, ours) in enumerate(MORE_TABLE.results(2, MORE[0])):
        assert_states_close(ours, theirs, f"rank {rank}: ddp_ext vs torch's DDP under Join")


def test_dropped_layers_do_not_read_as_a_changing_order():
    for rebuilds, unit_buckets in MORE_TABLE.results(2, MORE[1]):
        assert rebuilds <= 1, f"{rebuilds} rebuilds: drops should not look like a new gradient order"
        assert all(len(set(b)) == 1 for b in unit_buckets), f"a rebuild mixed layers: {unit_buckets}"


def test_static_graph_is_refused():
    for message in MORE_TABLE.results(2, MORE[2]):
        assert "static_graph=True needs the same parameters used in every iteration" in message


def test_seed_and_draw_count_come_from_rank_0():
    assert MORE_TABLE.results(2, MORE[3]) == [(1000, 0), (1000, 0)]


def _plans_differ(rank, world_size):
    torch.manual_seed(0)
    module = models.Dropping()
    ddp = ddp_ext.DistributedDataParallel(module)
    if rank == 1:
        module.blocks.draws += 3  # as if this rank had called the LayerDrop more often
    step = 0
    try:
        for step in range(3):
            (x,), y = models.global_batch("layerdrop", step, 0, 4)
            F.mse_loss(ddp(x), y).backward()
    except RuntimeError as e:
        return str(e), step
    return "no error", step


class UsesDroppedWeight(models.Dropping):
    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(self.blocks(h) + F.linear(h, self.blocks[1][0].weight))


def _dropped_parameter_used(rank, world_size):
    torch.manual_seed(0)
    module = UsesDroppedWeight()
    ddp = ddp_ext.DistributedDataParallel(module)
    try:
        for step in range(8):
            (x,), y = models.global_batch("layerdrop", step, 0, 4)
            F.mse_loss(ddp(x), y).backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


MISUSE = [Run("plans_differ", _plans_differ), Run("dropped_parameter_used", _dropped_parameter_used)]
MISUSE_TABLE = CaseTable(_run, MISUSE, timeout=120, isolated=True)


def test_ranks_that_drop_different_layers_raise():
    for rank, (message, step) in enumerate(MISUSE_TABLE.results(2, MISUSE[0])):
        assert "Detected mismatch between collectives on ranks" in message, f"rank {rank}: {message}"
        assert "dropped different layers" in message and f"this is rank {rank}" in message
        assert step == 0, f"rank {rank}: the first backward with different plans must raise"


def test_gradient_of_a_dropped_layer_is_an_error():
    for rank, message in enumerate(MISUSE_TABLE.results(2, MISUSE[1])):
        assert "blocks.1.0.weight belongs to a layer that LayerDrop dropped" in message, f"rank {rank}: {message}"
