"""ddp.overlap_optimizer(optimizer) trains exactly as a plain optimizer.step()
after backward does, with torch's DDP and with ddp_ext's own without it.

In real multi-process runs over Gloo (2 and 3 ranks), from the same seeds and
data: SGD with momentum, Adam and AdamW (foreach on and off), two parameter
groups with different learning rates and an LR scheduler (created before or
after overlap_optimizer), no_sync accumulation, find_unused_parameters (with
gradient_as_bucket_view too), static_graph, and a checkpoint (model,
optimizer and scheduler state) saved and loaded mid-run, compression hooks,
ddp_ext.LayerDrop, and buckets stepped in small chunks. Parameters and
optimizer state are compared bitwise with ddp_ext without overlap at every
world size, and with torch's DDP bitwise at 2 ranks and up to rounding at 3
(Gloo's ring at 3 ranks sums in an order that depends on the bucket sizes;
tests/wrapper/test_parity_torch_ddp.py says the same of ddp_ext itself).
Each run also asserts that the backward did step parameters (the overlap
happened), bucket by bucket in launch order, on the thread that called
backward. What is refused: test_optimizer_overlap_refusals.py.
"""

import contextlib
import dataclasses
import io
import threading
from typing import Any, Dict, List, Tuple

import pytest
import torch

from tests.optimizer.overlap_support import (SMALL_BUCKETS, assert_trained_alike, backward, plain_wrapper, snapshot,
                                             trained_three_ways, unchanged)
from tests.support import models, reference
from tests.support.harness import CaseTable, assert_states_bitwise



def _optimizer(name: str, module, first_group: bool = True) -> torch.optim.Optimizer:
    """Two parameter groups with different learning rates (the first layer
    apart from the rest); frozen parameters stay in. Without `first_group`,
    the rest only: FIRST_GROUP is added later."""
    params = list(module.parameters())
    groups = [{"params": params[:2], "lr": 0.05}, {"params": params[2:]}]
    if not first_group:
        groups = groups[1:]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    if name == "sgd_nesterov_wd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    kind, loop = name.split("_")
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    return cls(groups, lr=0.01, foreach={"foreach": True, "loop": False}[loop])


@dataclasses.dataclass(frozen=True)
class Run:
    model: str
    optimizer: str
    steps: int = 5
    micro_batches: int = 1  # all but the last under no_sync
    ddp: Tuple[Tuple[str, Any], ...] = ()
    scheduler_first: bool = False  # the scheduler is created before overlap_optimizer
    checkpoint_at: int = -1  # saved and loaded into a fresh wrapper before this step
    set_to_none: bool = True
    hook: str = ""  # a communication hook of HOOKS, registered on every wrapper
    chunk_bytes: int = 0  # the overlap's step chunk (Note [Stepping in chunks]); 0: its default
    lr_before_backward: bool = False  # each group's lr set by hand every step, after the forward
    scheduler: str = "step"  # of SCHEDULERS, stepped after optimizer.step()
    add_group_at: int = -1  # the first layer's group added between this step's backward and step

    @property
    def layer_drop(self) -> bool:
        return self.model.startswith("layerdrop")

    @property
    def id(self) -> str:
        parts = [self.model, self.optimizer] + [f"{k}={v}" for k, v in self.ddp]
        if self.hook:
            parts.append(self.hook)
        if self.chunk_bytes:
            parts.append(f"chunk{self.chunk_bytes}")
        if self.micro_batches != 1:
            parts.append(f"micro{self.micro_batches}")
        if self.scheduler_first:
            parts.append("scheduler_first")
        if self.checkpoint_at >= 0:
            parts.append(f"checkpoint{self.checkpoint_at}")
        if not self.set_to_none:
            parts.append("zero_grad_to_zeros")
        if self.lr_before_backward:
            parts.append("lr_before_backward")
        if self.scheduler != "step":
            parts.append(self.scheduler)
        if self.add_group_at >= 0:
            parts.append(f"add_group{self.add_group_at}")
        return "-".join(parts)


def run(model, optimizer, **kwargs) -> Run:
    ddp = dict(kwargs.pop("ddp", {}))
    ddp.setdefault("bucket_cap_mb", SMALL_BUCKETS)
    return Run(model, optimizer, ddp=tuple(sorted(ddp.items())), **kwargs)


RUNS = [run("deep", name) for name in ("sgd", "sgd_nesterov_wd", "adam_foreach", "adam_loop", "adamw_foreach",
                                       "adamw_loop")]
RUNS += [
    run("conv", "adam_foreach", scheduler_first=True, set_to_none=False),
    run("deep", "sgd", micro_batches=3),
    run("batchnorm", "adamw_loop", micro_batches=2, scheduler_first=True),
    run("branches", "sgd", ddp=dict(find_unused_parameters=True)),
    run("branches", "adam_foreach", ddp=dict(find_unused_parameters=True, gradient_as_bucket_view=True)),
    run("branches", "adamw_loop", micro_batches=2, ddp=dict(find_unused_parameters=True)),
    # .grad kept as bucket views, stashed and restored for the heads no rank used.
    run("branches", "sgd", set_to_none=False, ddp=dict(find_unused_parameters=True, gradient_as_bucket_view=True)),
    run("deep", "adam_loop", ddp=dict(static_graph=True)),
    run("deep", "adam_foreach", ddp=dict(gradient_as_bucket_view=True)),
    run("mlp", "sgd", checkpoint_at=2),
    run("deep", "adamw_foreach", checkpoint_at=3, scheduler_first=True),
    # Compression hooks: the step comes once the hook's future has completed.
    run("deep", "adam_foreach", hook="fp16"),
    # PowerSGD runs several collectives per bucket, which torch's DDP too
    # pairs wrongly over Gloo with several buckets: one bucket here.
    run("deep", "sgd", hook="powersgd", steps=6, ddp=dict(bucket_cap_mb=25)),
    run("deep", "adamw_loop", hook="adaptive", micro_batches=2),
    # Layer dropping: a dropped layer's bucket is stepped with no gradient (skipped).
    run("layerdrop", "adam_foreach", steps=8),
    run("layerdrop", "sgd", steps=8, set_to_none=False, hook="fp16"),
    run("layerdrop", "adamw_loop", steps=8, micro_batches=2, ddp=dict(gradient_as_bucket_view=True)),
    # Buckets stepped in chunks (Note [Stepping in chunks]).
    run("conv", "adam_foreach", chunk_bytes=200, ddp=dict(bucket_cap_mb=25)),
    run("deep", "adamw_loop", chunk_bytes=100, ddp=dict(bucket_cap_mb=0.001)),
    # Group values changed where the backward's steps see them: Note
    # [Hyperparameters fixed at the backward] (a change between backward and
    # step is refused: test_optimizer_overlap_refusals.py).
    run("deep", "sgd", lr_before_backward=True),
    run("deep", "adam_foreach", scheduler="onecycle"),  # lr and betas, every step
    run("deep", "sgd", add_group_at=2),
]


def warm_up_lr(step: int, number: int) -> float:
    """What a loop sets group `number`'s lr to at `step`, by hand."""
    return 0.02 * (step + 1) / (number + 1)


# The first layer's group, as _optimizer(first_group=False) leaves it out.
FIRST_GROUP_LR = 0.05


def add_first_group(optimizer, module) -> None:
    optimizer.add_param_group({"params": list(module.parameters())[:2], "lr": FIRST_GROUP_LR})


def _scheduler(name: str, optimizer):
    if name == "onecycle":  # cycles lr and the momentum (SGD's momentum, Adam's first beta)
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=20)
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def _powersgd():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                    min_compression_rate=1, random_seed=0)
    return state, powersgd.powerSGD_hook


def _fp16():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return None, default_hooks.fp16_compress_hook


def _adaptive():
    import ddp_ext

    return ddp_ext.AdaptivePrecision(), ddp_ext.adaptive_precision_hook


# Compression hooks, each (state, hook) new for every wrapper.
HOOKS = {"fp16": _fp16, "powersgd": _powersgd, "adaptive": _adaptive}


def _wrap(wrapper: str, module, c: "Run"):
    kwargs = dict(c.ddp)
    if wrapper == "torch":
        if c.layer_drop:
            kwargs["find_unused_parameters"] = True  # what torch's DDP needs for dropped layers
        ddp = reference.torch_ddp(module, **kwargs)
    else:
        ddp = reference.ext_ddp(module, **kwargs)
    if c.hook:
        ddp.register_comm_hook(*HOOKS[c.hook]())
    return ddp


class StepLog:
    """Records, for each call of the optimizer class's step during backward,
    the thread and the parameters stepped (by their index among the reduced
    parameters, as in bucket_indices())."""

    def __init__(self, module, optimizer):
        reduced = [p for p in module.parameters() if p.requires_grad]
        self.index = {id(p): i for i, p in enumerate(reduced)}
        self.sizes = [p.numel() * p.element_size() for p in reduced]
        self.calls: List[Tuple[int, List[int]]] = []
        self.inside_backward = False
        step = type(optimizer).step
        log = self

        def logged(opt, *args, **kwargs):
            if log.inside_backward:
                stepped = [log.index[id(p)] for g in opt.param_groups for p in g["params"]]
                log.calls.append((threading.get_ident(), stepped))
            return step(opt, *args, **kwargs)

        self.logged = logged


def _setup(c: Run, wrapper: str, overlap: bool, seed: int):
    module = models.build(c.model, seed)
    ddp = _wrap(wrapper, module, c)
    optimizer = _optimizer(c.optimizer, module, first_group=c.add_group_at < 0)
    if c.scheduler_first:
        scheduler = _scheduler(c.scheduler, optimizer)
    if overlap:
        ddp.overlap_optimizer(optimizer)
        if c.chunk_bytes:
            ddp._optimizer_overlap.step_chunk_bytes = c.chunk_bytes
    if not c.scheduler_first:
        scheduler = _scheduler(c.scheduler, optimizer)
    return module, ddp, optimizer, scheduler


def _optimizer_state(optimizer) -> Dict[str, torch.Tensor]:
    state = optimizer.state_dict()
    flat = {}
    for index, per_param in state["state"].items():
        for key, value in per_param.items():
            flat[f"{index}.{key}"] = value.clone() if torch.is_tensor(value) else torch.tensor(value)
    for number, group in enumerate(state["param_groups"]):
        flat[f"group{number}.lr"] = torch.tensor(group["lr"], dtype=torch.float64)
        flat[f"group{number}.params"] = torch.tensor(group["params"])
    return flat


def _train(rank: int, world_size: int, c: Run, wrapper: str, overlap: bool) -> Dict[str, Any]:
    import ddp_ext  # noqa: F401  (the ranks import the checkout's)

    spec = models.MODELS[c.model]
    module, ddp, optimizer, scheduler = _setup(c, wrapper, overlap, models.MODEL_SEED)
    stepped_in_backward, calls, buckets = [], [], []
    main_thread = threading.get_ident()
    for step in range(c.steps):
        if step == c.checkpoint_at:
            saved = io.BytesIO()
            torch.save({"model": ddp.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, saved)
            saved.seek(0)
            checkpoint = torch.load(saved)
            # A fresh wrapper from other weights, then everything loaded.
            module, ddp, optimizer, scheduler = _setup(c, wrapper, overlap, models.MODEL_SEED + 1)
            ddp.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            scheduler.load_state_dict(checkpoint["scheduler"])
        log = StepLog(module, optimizer)
        original = type(optimizer).step
        micro_batches = c.micro_batches
        for micro in range(micro_batches):
            args, target = models.rank_batch(c.model, step, micro, rank, world_size, per_rank=4)
            last = micro == micro_batches - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = spec.loss(ddp(*args), target)
                if c.lr_before_backward:
                    for number, group in enumerate(optimizer.param_groups):
                        group["lr"] = warm_up_lr(step, number)
                if overlap:
                    buckets = [[i for i in b] for b in ddp.bucket_indices()]
                log.inside_backward = True
                type(optimizer).step = log.logged  # this process's class, for this backward only
                try:
                    loss.backward()
                finally:
                    type(optimizer).step = original
                    log.inside_backward = False
        if overlap:
            stepped_in_backward.append(len(ddp._optimizer_overlap.stepped))
            calls.append(dict(threads=sorted({t == main_thread for t, _ in log.calls}), sizes=log.sizes,
                              stepped=[s for _, s in log.calls], buckets=buckets))
        if step == c.add_group_at:
            add_first_group(optimizer, module)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=c.set_to_none)
    params, buffers = reference.state_tensors(module)
    return dict(params=params, buffers=buffers, optimizer=_optimizer_state(optimizer),
                stepped_in_backward=stepped_in_backward, calls=calls,
                reduced=[n for n, p in module.named_parameters() if p.requires_grad])


def _three(rank, world_size, c):
    return trained_three_ways(_train, rank, world_size, c)


TABLE = CaseTable(_three, RUNS)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("c", RUNS, ids=lambda c: c.id)
def test_overlapped_optimizer_is_exact(c, world_size):
    results = TABLE.results(world_size, c)
    for rank, r in enumerate(results):
        what = f"{c.id}, rank {rank} of {world_size}"
        # torch's DDP needs find_unused_parameters for dropped layers; fp16
        # sums in half precision, in an order that differs with Gloo's ring segments.
        tolerance = dict(rtol=1e-2, atol=1e-3) if c.hook == "fp16" else {}
        assert_trained_alike(r, what, torch_bitwise=world_size == 2 and not c.layer_drop, **tolerance)
        assert_states_bitwise(r["overlap"]["params"], results[0]["overlap"]["params"], f"{what}: params vs rank 0")
        # The overlap happened: the backward stepped parameters, one call per
        # bucket that holds any, in launch order, on the training thread;
        # except in a static graph's first backward, and the first
        # synchronising backward after overlap_optimizer, which only
        # remembers the gradients (Note [Gradients edited before the step]).
        learning = 1 if dict(c.ddp).get("static_graph", False) else 0
        unstepped = {0, learning} | ({c.checkpoint_at, c.checkpoint_at + learning} if c.checkpoint_at >= 0 else set())
        for step, (count, calls) in enumerate(zip(r["overlap"]["stepped_in_backward"], r["overlap"]["calls"])):
            if step in unstepped:
                assert count == 0 and not calls["stepped"], f"{what}: step {step}: the backward stepped"
                continue
            assert count > 0, f"{what}: step {step}: the backward stepped nothing"
            assert calls["threads"] == [True], f"{what}: step {step}: stepped off the thread that called backward"
            if step <= c.add_group_at:
                continue  # the first layer was in no group: its buckets were stepped in part
            # Bucket after bucket in launch order, each in one call, or in
            # several of at most the chunk's bytes (a larger parameter alone).
            assert _as_buckets(calls["stepped"], calls["buckets"]) == [sorted(b) for b in calls["buckets"]], (
                f"{what}: step {step}: the steps {calls['stepped']} are not the buckets {calls['buckets']}")
            chunk = c.chunk_bytes or _default_chunk()
            for stepped in calls["stepped"]:
                size = sum(calls["sizes"][i] for i in stepped)
                assert size <= chunk or len(stepped) == 1, f"{what}: step {step}: {stepped} ({size} bytes) in one call"
            if c.chunk_bytes:
                assert len(calls["stepped"]) > len(calls["buckets"]), f"{what}: step {step}: no bucket was cut"
        # Several buckets once the first bucket's cap no longer applies (from the rebuild on).
        if dict(c.ddp)["bucket_cap_mb"] == SMALL_BUCKETS:
            assert max(len(calls["buckets"]) for calls in r["overlap"]["calls"]) >= 2, f"{what}: one bucket only"


def _default_chunk() -> int:
    from ddp_ext._optimizer_overlap import STEP_CHUNK_BYTES

    return STEP_CHUNK_BYTES


def _as_buckets(stepped: List[List[int]], buckets: List[List[int]]) -> List[List[int]]:
    """The calls `stepped` joined into runs that make up the buckets, in
    order; a call that spans two buckets or comes out of order breaks it."""
    joined, current = [], []
    remaining = [sorted(b) for b in buckets]
    for call in stepped:
        current = sorted(current + call)
        if remaining and current == remaining[0]:
            joined.append(current)
            remaining.pop(0)
            current = []
    if current:
        joined.append(current)
    return joined


ALONE = [run("deep", "adam_foreach"), run("branches", "sgd", ddp=dict(find_unused_parameters=True))]
ALONE_TABLE = CaseTable(_three, ALONE)  # a world of one trains only these, not all of RUNS


@pytest.mark.parametrize("c", ALONE, ids=lambda c: c.id)
def test_overlapped_optimizer_is_exact_alone(c):
    """A world of one, where gradients stay where autograd put them (Note [A
    world of one rank] in reducer/core/reducer.cpp)."""
    (r,) = ALONE_TABLE.results(1, c)
    for kind in ("params", "optimizer"):
        assert_states_bitwise(r["overlap"][kind], r["ext"][kind], f"{c.id}, alone: {kind}, overlap vs ddp_ext without")
        assert_states_bitwise(r["overlap"][kind], r["torch"][kind], f"{c.id}, alone: {kind}, overlap vs torch DDP")
    first, *later = r["overlap"]["stepped_in_backward"]  # the first backward only remembers
    assert first == 0 and all(count > 0 for count in later), r["overlap"]["stepped_in_backward"]


# --- uneven inputs (Join) ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Uneven:
    id: str = "join"


def _uneven_run(rank, world_size, overlap: bool):
    module, ddp = plain_wrapper()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    if overlap:
        ddp.overlap_optimizer(optimizer)
    with ddp.join():
        for step in range(3 + rank):  # rank r runs out of data r steps after rank 0
            optimizer.zero_grad()
            backward(ddp, rank, world_size, step)
            optimizer.step()
    return reference.state_tensors(module)[0]


def _uneven(rank, world_size, _case):
    return {"overlap": _uneven_run(rank, world_size, True), "plain": _uneven_run(rank, world_size, False)}


UNEVEN_TABLE = CaseTable(_uneven, [Uneven()])


@pytest.mark.parametrize("world_size", [2, 3])
def test_uneven_inputs_under_join(world_size):
    """Ranks that run out of data shadow the others' collectives (Join); the
    others step bucket by bucket, exactly as they step without overlap."""
    for rank, r in enumerate(UNEVEN_TABLE.results(world_size, Uneven())):
        assert_states_bitwise(r["overlap"], r["plain"], f"join, rank {rank} of {world_size}: overlap vs without")


# --- copies ----------------------------------------------------------------------


def test_a_copy_does_not_overlap(single_process_group):
    """A deep copy has a reducer of its own and no overlapped optimizer: its
    backward steps nothing, while the original's still does."""
    import copy

    module, ddp = plain_wrapper()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    ddp.overlap_optimizer(optimizer)
    twin = copy.deepcopy(ddp)
    assert twin._optimizer_overlap is None
    before = snapshot(twin.module)
    backward(twin, 0, 1)
    assert unchanged(twin.module, before), "the copy's backward stepped its parameters"
    backward(ddp, 0, 1)  # the first backward only remembers the gradients
    optimizer.step()
    optimizer.zero_grad()
    backward(ddp, 0, 1, step=1)
    assert len(ddp._optimizer_overlap.stepped) == len(before), "the original's backward did not step"
    twin._register_fused_optim(torch.optim.SGD, lr=0.1)  # the copy has no overlap to refuse it for
    assert twin._comm_hooks, "the copy refused a hook that steps parameters"
