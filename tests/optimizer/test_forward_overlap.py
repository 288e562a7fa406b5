"""ddp.overlap_optimizer(optimizer, overlap_forward=True) trains exactly as a
plain optimizer.step() after backward does: the first layers' buckets are
still on the wire when the backward returns, and their parameters are
stepped when the next forward reads them.

Real multi-process runs over Gloo (2 and 3 ranks), from the same seeds and
data, compared bitwise with ddp_ext without the line at every world size and
with torch's DDP at 2 ranks (close at 3: Gloo's ring order, as in
test_optimizer_overlap.py): SGD with momentum, Adam and AdamW (foreach and
single-tensor), two parameter groups with an LR scheduler stepped after the
optimizer (the deferred steps must use the learning rate of their step),
zero_grad to None and to zeros, no_sync accumulation, unused parameters, a
static graph, a checkpoint saved and loaded mid-run, and reads between the
step and the next forward (an evaluation forward, state_dict(), a copy of
the parameters for an average, .grad for a norm). Each run also asserts that
the overlap happened: buckets were pending after optimizer.step() and were
finished by the next forward.
"""

import contextlib
import dataclasses
import io
from typing import Any, Dict, Tuple

import pytest
import torch

from tests.optimizer.overlap_support import (SMALL_BUCKETS, assert_trained_alike, backward, raised,
                                             trained_three_ways)
from tests.optimizer.test_optimizer_overlap import _optimizer, _optimizer_state, add_first_group, warm_up_lr
from tests.support import models, reference
from tests.support.harness import CaseTable, assert_states_bitwise


@dataclasses.dataclass(frozen=True)
class Run:
    model: str
    optimizer: str
    steps: int = 5
    micro_batches: int = 1  # all but the last under no_sync
    ddp: Tuple[Tuple[str, Any], ...] = ()
    set_to_none: bool = True
    checkpoint_at: int = -1
    reads: bool = False  # reads parameters and gradients between the step and the next forward
    fraction: Any = True
    lr_before_backward: bool = False  # each group's lr set by hand every step, after the forward
    add_group_at: int = -1  # the first layer's group added between this step's backward and step

    @property
    def id(self) -> str:
        parts = [self.model, self.optimizer] + [f"{k}={v}" for k, v in self.ddp]
        if self.micro_batches != 1:
            parts.append(f"micro{self.micro_batches}")
        if not self.set_to_none:
            parts.append("zero_grad_to_zeros")
        if self.checkpoint_at >= 0:
            parts.append(f"checkpoint{self.checkpoint_at}")
        if self.reads:
            parts.append("reads")
        if self.fraction is not True:
            parts.append(f"fraction{self.fraction}")
        if self.lr_before_backward:
            parts.append("lr_before_backward")
        if self.add_group_at >= 0:
            parts.append(f"add_group{self.add_group_at}")
        return "-".join(parts)


def run(model, optimizer, **kwargs) -> Run:
    ddp = dict(kwargs.pop("ddp", {}))
    ddp.setdefault("bucket_cap_mb", SMALL_BUCKETS)
    return Run(model, optimizer, ddp=tuple(sorted(ddp.items())), **kwargs)


RUNS = [run("deep", name) for name in ("sgd", "adam_foreach", "adam_loop", "adamw_foreach")]
RUNS += [
    run("deep", "adamw_loop", set_to_none=False, fraction=0.9),
    run("conv", "adam_foreach", set_to_none=False),
    run("deep", "sgd", micro_batches=3),
    run("branches", "adam_foreach", ddp=dict(find_unused_parameters=True)),
    run("deep", "adam_loop", ddp=dict(static_graph=True)),
    run("mlp", "sgd", checkpoint_at=2, fraction=0.5),
    run("deep", "adamw_foreach", checkpoint_at=3),
    run("deep", "adam_foreach", reads=True),
    # Note [Hyperparameters fixed at the backward] in ddp_ext/_optimizer_overlap.py.
    run("deep", "adamw_foreach", lr_before_backward=True),
    run("deep", "sgd", add_group_at=2),
]


def _setup(c: Run, wrapper: str, overlap: bool, seed: int):
    module = models.build(c.model, seed)
    kwargs = dict(c.ddp)
    ddp = reference.torch_ddp(module, **kwargs) if wrapper == "torch" else reference.ext_ddp(module, **kwargs)
    optimizer = _optimizer(c.optimizer, module, first_group=c.add_group_at < 0)
    if overlap:
        ddp.overlap_optimizer(optimizer, overlap_forward=c.fraction)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return module, ddp, optimizer, scheduler


def _reads(ddp, module, spec, args) -> Dict[str, Any]:
    """What a loop may read between the step and the next forward."""
    average = [p.detach().clone() for p in module.parameters()]
    norms = [p.grad.norm() for p in module.parameters() if p.grad is not None]
    state = {k: v.clone() for k, v in ddp.state_dict().items()}
    ddp.eval()
    with torch.no_grad():
        evaluated = ddp(*args)
    ddp.train()
    return dict(average=average, norms=norms, state=state, evaluated=evaluated)


def _train(rank: int, world_size: int, c: Run, wrapper: str, overlap: bool) -> Dict[str, Any]:
    import ddp_ext  # noqa: F401  (the ranks import the checkout's)

    spec = models.MODELS[c.model]
    module, ddp, optimizer, scheduler = _setup(c, wrapper, overlap, models.MODEL_SEED)
    pending_after_step, pending_after_forward, reads = [], [], []
    for step in range(c.steps):
        if step == c.checkpoint_at:
            saved = io.BytesIO()
            torch.save({"model": ddp.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, saved)
            saved.seek(0)
            checkpoint = torch.load(saved)
            module, ddp, optimizer, scheduler = _setup(c, wrapper, overlap, models.MODEL_SEED + 1)
            ddp.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            scheduler.load_state_dict(checkpoint["scheduler"])
        for micro in range(c.micro_batches):
            args, target = models.rank_batch(c.model, step, micro, rank, world_size, per_rank=4)
            last = micro == c.micro_batches - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                output = ddp(*args)
                if overlap and micro == 0:
                    pending_after_forward.append(len(ddp._optimizer_overlap.tail.pending))
                if c.lr_before_backward:
                    for number, group in enumerate(optimizer.param_groups):
                        group["lr"] = warm_up_lr(step, number)
                spec.loss(output, target).backward()
        if step == c.add_group_at:
            add_first_group(optimizer, module)
        optimizer.step()
        if overlap:
            pending_after_step.append(len(ddp._optimizer_overlap.tail.pending))
        scheduler.step()
        optimizer.zero_grad(set_to_none=c.set_to_none)
        if c.reads:
            reads.append(_reads(ddp, module, spec, args))
    params, buffers = reference.state_tensors(module)  # reads what the last backward left pending
    on_read = ddp._optimizer_overlap.tail.finished_on_read if overlap else 0
    return dict(params=params, buffers=buffers, optimizer=_optimizer_state(optimizer), reads=reads,
                pending_after_step=pending_after_step, pending_after_forward=pending_after_forward,
                finished_on_read=on_read)


def _three(rank, world_size, c):
    return trained_three_ways(_train, rank, world_size, c)


TABLE = CaseTable(_three, RUNS)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("c", RUNS, ids=lambda c: c.id)
def test_forward_overlap_is_exact(c, world_size):
    results = TABLE.results(world_size, c)
    for rank, r in enumerate(results):
        what = f"{c.id}, rank {rank} of {world_size}"
        assert_trained_alike(r, what, torch_bitwise=world_size == 2)
        for step, (mine, plain) in enumerate(zip(r["overlap"]["reads"], r["ext"]["reads"])):
            for key in ("average", "norms"):
                for a, b in zip(mine[key], plain[key]):
                    assert torch.equal(a, b), f"{what}: step {step}: {key} read before the next forward differs"
            assert_states_bitwise(mine["state"], plain["state"], f"{what}: step {step}: state_dict()")
            assert torch.equal(mine["evaluated"], plain["evaluated"]), f"{what}: step {step}: evaluation forward"
        # The overlap happened: from the second synchronising backward on
        # (the first only remembers: Note [Gradients edited before the
        # step]), buckets were still pending after optimizer.step() (unless
        # the reads finished them), and every forward finished them all.
        after_step = r["overlap"]["pending_after_step"]
        first = 2 if dict(c.ddp).get("static_graph") else 1
        overlapped = [s for s in range(first, c.steps) if s not in (c.checkpoint_at,)]
        assert all(after_step[s] > 0 for s in overlapped), f"{what}: nothing pending after the steps: {after_step}"
        assert not any(r["overlap"]["pending_after_forward"]), f"{what}: a forward left buckets pending"
        # Each overlapped backward's buckets were finished (at least one of
        # them) by a read of their parameters: the next forward's layers or,
        # after the last, the copy of the parameters above (counted by the
        # last wrapper: the one after the checkpoint, if any).
        last_wrapper = [s for s in overlapped if s > c.checkpoint_at]
        assert r["overlap"]["finished_on_read"] >= len(last_wrapper), (
            f"{what}: {r['overlap']['finished_on_read']} buckets finished on a read for {len(last_wrapper)} backwards")


def _refused(rank, world_size, case):
    import ddp_ext

    module = models.build("deep", models.MODEL_SEED)
    kwargs = {"bucket_cap_mb": SMALL_BUCKETS, **dict(case.get("ddp", {}))}
    ddp = ddp_ext.DistributedDataParallel(module, **kwargs)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    if case.get("hook"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    before = [p.detach().clone() for p in module.parameters()]
    message = joined = regrouped = ""
    if case.get("join"):
        ddp.overlap_optimizer(optimizer, overlap_forward=True)
        joined = raised(lambda: ddp.join().__enter__())
    elif case.get("regroup"):
        ddp.overlap_optimizer(optimizer, overlap_forward=True)
        for step in range(3):  # the first backward only remembers; the second leaves buckets pending
            backward(ddp, rank, world_size, step)
            optimizer.step()
        import torch.distributed as dist

        regrouped = raised(lambda: ddp._update_process_group(dist.group.WORLD))
        ddp.finish_forward_tail()
        regrouped += f" | pending after finish_forward_tail: {len(ddp._optimizer_overlap.tail.pending)}"
    else:
        message = raised(lambda: ddp.overlap_optimizer(optimizer, overlap_forward=case.get("fraction", True)))
    return dict(message=message, joined=joined, regrouped=regrouped,
                unchanged=all(torch.equal(a, b) for a, b in zip(before, module.parameters())),
                overlapped=ddp._optimizer_overlap is not None)


class _Case(dict):
    @property
    def id(self):
        return self["id"]


REFUSALS = [
    _Case(id="bucket_view", ddp={"gradient_as_bucket_view": True}, expect="gradient_as_bucket_view=True"),
    _Case(id="hook", hook=True, expect="communication hook"),
    _Case(id="fraction", fraction=1.5, expect="fraction of the gradient bytes in (0, 1)"),
]
REFUSED = CaseTable(_refused, REFUSALS + [_Case(id="join", join=True), _Case(id="regroup", regroup=True)])


@pytest.mark.parametrize("case", REFUSALS, ids=lambda c: c.id)
def test_forward_overlap_refusals(case):
    for rank, r in enumerate(REFUSED.results(2, case)):
        assert case["expect"] in r["message"], f"rank {rank}: {r['message']}"
        assert f"rank {rank}" in r["message"] or case.id == "fraction", f"rank {rank}: {r['message']}"
        assert r["unchanged"] and not r["overlapped"], f"rank {rank}: the refused line changed something"


def test_join_is_refused_with_forward_overlap():
    for rank, r in enumerate(REFUSED.results(2, _Case(id="join", join=True))):
        assert "cannot join uneven inputs" in r["joined"] and f"rank {rank}" in r["joined"], r["joined"]


def _compiled_or_threaded(rank, world_size, case):
    """The same 4 steps with and without the line, the forward compiled
    (torch.compile of the wrapper), or each step on a thread of its own, so
    that each forward runs on a thread other than the one whose stack holds
    the mode: there the mode sees no read, so every pending bucket is
    finished before the forward. The parameters are then read on the main
    thread, after finish_forward_tail() as the docs say."""
    import threading

    import ddp_ext

    def train(overlap: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
        ddp = ddp_ext.DistributedDataParallel(model, bucket_cap_mb=1)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        if overlap:
            ddp.overlap_optimizer(optimizer, overlap_forward=True)
        net = torch.compile(ddp) if case.id == "compiled" else ddp
        data = torch.Generator().manual_seed(rank)
        pending = []

        def one_step():
            net(torch.randn(8, 512, generator=data)).pow(2).mean().backward()
            optimizer.step()
            if overlap:
                pending.append(len(ddp._optimizer_overlap.tail.pending))
            optimizer.zero_grad()

        for _ in range(4):
            if case.id == "threaded":
                worker = threading.Thread(target=one_step)
                worker.start()
                worker.join()
            else:
                one_step()
        ddp.finish_forward_tail()
        return [p.detach().clone() for p in model.parameters()], pending

    plain, _ = train(False)
    overlapped, pending = train(True)
    return dict(equal=[torch.equal(a, b) for a, b in zip(plain, overlapped)], pending=pending)


ELSEWHERE = [_Case(id="compiled"), _Case(id="threaded")]
ELSEWHERE_TABLE = CaseTable(_compiled_or_threaded, ELSEWHERE)


@pytest.mark.parametrize("case", ELSEWHERE, ids=lambda c: c.id)
def test_forward_overlap_where_reads_are_unseen(case):
    for rank, r in enumerate(ELSEWHERE_TABLE.results(2, case)):
        assert all(r["equal"]), f"{case.id}, rank {rank}: parameters differ from the plain loop: {r['equal']}"
        assert any(r["pending"]), f"{case.id}, rank {rank}: nothing was pending after a step: {r['pending']}"


def test_process_group_change_is_refused_while_buckets_are_pending():
    for rank, r in enumerate(REFUSED.results(2, _Case(id="regroup", regroup=True))):
        assert "cannot change its process group while buckets" in r["regrouped"], r["regrouped"]
        assert f"rank {rank}" in r["regrouped"] and r["regrouped"].endswith("pending after finish_forward_tail: 0")


# --- the mode on the stack only while buckets are pending ---------------------------


def _mode_stack(rank, world_size, case):
    """Note [The mode only while pending] in ddp_ext/_forward_tail.py: what
    thread's torch function stack holds at each point of a loop whose
    forward, backward and step run inside a mode of the user's."""
    from torch.overrides import TorchFunctionMode

    from tests.optimizer.overlap_support import plain_wrapper

    class Users(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    module, ddp = plain_wrapper()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    ddp.overlap_optimizer(optimizer, overlap_forward=True)

    def stack():
        """This wrapper's mode and the user's (earlier cases' wrappers in this process may have left theirs)."""
        modes = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
        ours = ddp._optimizer_overlap.tail.mode
        return ["_PendingReads" if m is ours else "Users" for m in modes if m is ours or isinstance(m, Users)]

    seen = dict(after_line=stack(), after_forward=[], in_block=[], after_block=[], pending=[])
    for step in range(4):
        args, target = models.rank_batch("deep", step, 0, rank, world_size, per_rank=4)
        with Users():
            output = ddp(*args)
            seen["after_forward"].append(stack())
            models.MODELS["deep"].loss(output, target).backward()
            optimizer.step()
            seen["in_block"].append(stack())
        seen["after_block"].append(stack())
        seen["pending"].append(len(ddp._optimizer_overlap.tail.pending))
        optimizer.zero_grad()
    ddp.finish_forward_tail()
    with torch.no_grad():
        ddp(*args)
    seen["after_last_forward"] = stack()
    return seen


MODE_TABLE = CaseTable(_mode_stack, [_Case(id="mode_stack")])


def test_the_mode_is_on_the_stack_only_while_buckets_are_pending():
    for rank, seen in enumerate(MODE_TABLE.results(2, _Case(id="mode_stack"))):
        what = f"rank {rank}: {seen}"
        assert seen["after_line"] == [] and seen["after_last_forward"] == [], what
        # The first backward steps nothing and defers nothing; from the second on, buckets are pending.
        assert seen["pending"][0] == 0 and all(seen["pending"][1:]), what
        # No mode before the overlap starts (at the first step); then pushed
        # at the end of each forward, for its backward.
        assert seen["after_forward"][0] == seen["in_block"][0] == ["Users"], what
        assert seen["after_block"][0] == [], what
        assert all(s == ["_PendingReads", "Users"] for s in seen["after_forward"][1:]), what
        # Under the user's mode, so that leaving the block pops the user's.
        assert all(s == ["_PendingReads", "Users"] for s in seen["in_block"][1:]), what
        assert all(s == ["_PendingReads"] for s in seen["after_block"][1:]), what
