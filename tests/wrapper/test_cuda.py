"""ddp_ext's DDP on a GPU: parity with local training and with torch's DDP for
CUDA tensors, over NCCL and over Gloo, and the stream handling of Note [CUDA
streams] (reducer/base/cuda_streams.h).

Without a CUDA device the whole module is skipped, with the reason printed
under `pytest -rs`. NCCL cases need NCCL in the torch build and a GPU per
rank (NCCL refuses two ranks on one device); Gloo cases put every rank on
cuda:(rank % device_count), so 2 and 3 ranks share one GPU. Ranks are
spawned (tests/support/spawn.py), never forked, so CUDA in the parent is no hazard.

Each case trains with ddp_ext's DDP and with torch's DDP (same settings,
same seed) on every rank, and on rank 0 the local reference on the
concatenated batch (or, for models whose forward differs between ranks, the
average of every rank's loss), all on the GPU with TF32 off and cuDNN
deterministic. Looser tolerances apply to float16/bfloat16 parameters, AMP
and float16 compression. Apart from the table: torch's non-default-stream
test, a module on the CPU and the GPU, and a backward pass run under
torch.cuda.set_sync_debug_mode("error") (the host never waits for the GPU).

DDP_EXT_CUDA_TESTS_ON_CPU=1 runs the same bodies on CPU tensors over Gloo
(NCCL cases skipped): a check of this module's own code on a machine without
a GPU, not a test of CUDA.
"""

import contextlib
import dataclasses
import math
import os
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

from tests.support import models, reference
from tests.support.harness import CaseTable, assert_same_on_every_rank, assert_states_close
from tests.support.spawn import run_ranks

ON_CPU = os.environ.get("DDP_EXT_CUDA_TESTS_ON_CPU") == "1"

if not ON_CPU and not torch.cuda.is_available():
    pytest.skip(
        f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, "
        f"CUDA build {torch.version.cuda or 'none'}); run on a machine with a GPU",
        allow_module_level=True,
    )

# (backend, world size). NCCL with one rank is the single-GPU case.
WORLDS = [("nccl", 1), ("nccl", 2), ("gloo", 2), ("gloo", 3)]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# (rtol, atol) by what limits precision, against torch's DDP (same operations
# on the same device) and against local training (another summation order).
TOLERANCES = {
    "float32": {"torch": (1e-5, 1e-5), "local": (1e-4, 1e-5)},
    "float16": {"torch": (1e-3, 1e-3), "local": (2e-2, 2e-2)},
    "bfloat16": {"torch": (1e-2, 1e-2), "local": (5e-2, 5e-2)},
    "amp": {"torch": (1e-4, 1e-4), "local": (1e-2, 1e-2)},
    "compressed": {"torch": (1e-4, 1e-4), "local": (1e-2, 1e-2)},
}


def _skip_unless_runnable(backend: str, world_size: int) -> None:
    if backend != "nccl":
        return
    if ON_CPU:
        pytest.skip("DDP_EXT_CUDA_TESTS_ON_CPU=1: NCCL cases need a GPU")
    if not dist.is_nccl_available():
        pytest.skip("NCCL is not available in this torch build")
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"NCCL needs a GPU per rank: {world_size} ranks, {torch.cuda.device_count()} GPU(s)")


def _rank_device(rank: int) -> torch.device:
    """This rank's device, made current; TF32 off and cuDNN deterministic."""
    if ON_CPU:
        return torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.cuda.set_device(rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


# --- Cases ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CudaCase:
    base: reference.Case
    dtype: str = "float32"  # parameters and inputs: a key of DTYPES
    amp: bool = False  # float32 parameters, forward under autocast(float16), GradScaler
    # "" (default allreduce), "allreduce" or "fp16_compress" (torch's Python
    # hooks), "builtin_fp16_compress" (the C++ built-in hook).
    hook: str = ""
    round_robin: int = 0  # > 0: both DDPs over a round-robin group of that many children of the backend
    cpu_inputs: bool = False  # device_ids/output_device given, inputs left on the CPU for the wrapper to move
    # "" or "side": DDP built on the default stream, then forward, backward
    # and optimizer on a side stream (hooks run on the default stream, the
    # end of backward on the side stream).
    stream: str = ""
    # After every backward, fill fresh NaN tensors of every parameter's size
    # on the default and the current stream: memory a collective or a copy
    # still needs, if freed early, gets overwritten (the caching allocator
    # hazard).
    scribble: bool = False
    # The first half of the parameters get their gradient accumulators on a
    # side stream before the wrapper is built, the rest on the default
    # stream: one bucket is filled from two streams (Note [CUDA streams],
    # point 2).
    split_accumulators: bool = False
    against_local: bool = True
    against_torch: bool = True

    @property
    def id(self) -> str:
        parts = [self.base.id]
        if self.dtype != "float32":
            parts.append(self.dtype)
        parts += [k for k in ("amp", "cpu_inputs", "scribble", "split_accumulators") if getattr(self, k)]
        if self.hook:
            parts.append(f"hook={self.hook}")
        if self.round_robin:
            parts.append(f"round_robin={self.round_robin}")
        if self.stream:
            parts.append(f"stream={self.stream}")
        return "-".join(parts)

    @property
    def precision(self) -> str:
        if self.amp:
            return "amp"
        if "fp16" in self.hook:
            return "compressed"
        return self.dtype


def _case(model: str, optimizer: str = "sgd", ddp: Optional[dict] = None, micro_batches: int = 1,
          set_to_none: bool = True, **kwargs) -> CudaCase:
    base = reference.case(model, optimizer, ddp=ddp or {}, micro_batches=micro_batches, set_to_none=set_to_none)
    return CudaCase(base, **kwargs)


CASES = [
    # Parity for the test models, float32.
    _case("mlp", "sgd"),
    _case("conv", "adam"),
    _case("mixed_dtype", "sgd"),
    _case("deep", "sgd"),
    _case("shared_weight", "adam"),
    # Half precision parameters (SGD: Adam's eps vanishes in float16), and AMP.
    _case("mlp", "sgd", dtype="float16"),
    _case("conv", "sgd", dtype="bfloat16"),
    _case("mlp", "sgd", dtype="bfloat16"),
    _case("conv", "sgd", amp=True),
    _case("mlp", "adam", amp=True),
    # gradient_as_bucket_view, with non-default strides.
    _case("conv_channels_last", "adam", ddp=dict(gradient_as_bucket_view=True)),
    _case("transposed", "sgd", ddp=dict(gradient_as_bucket_view=True)),
    # find_unused_parameters: the used bitmap goes to the device and back.
    _case("branches", "sgd", ddp=dict(find_unused_parameters=True)),
    _case("branches", "adam", ddp=dict(find_unused_parameters=True, gradient_as_bucket_view=True), set_to_none=False),
    # no_sync.
    _case("mlp", "sgd", micro_batches=2),
    _case("branches", "sgd", micro_batches=2, ddp=dict(find_unused_parameters=True)),
    # static_graph: the learning iteration is finished in an engine callback.
    _case("mlp", "adam", ddp=dict(static_graph=True)),
    _case("checkpoint_reentrant", "sgd", ddp=dict(static_graph=True)),
    # Buffers (BatchNorm statistics, broadcast from rank 0 each forward):
    # local training normalises over another batch.
    _case("batchnorm", "adam", against_local=False),
    # Communication hooks.
    _case("mlp", "sgd", hook="allreduce"),
    _case("conv", "sgd", hook="fp16_compress"),
    _case("mlp", "sgd", hook="builtin_fp16_compress"),
    # Round-robin groups whose children are the world's backend (NCCL or Gloo).
    _case("mlp", "sgd", round_robin=3),
    _case("conv", "adam", round_robin=2, ddp=dict(gradient_as_bucket_view=True)),
    # device_ids/output_device: the wrappers move CPU inputs to the GPU.
    _case("mlp", "sgd", cpu_inputs=True),
    # Streams: training on a side stream, and memory reused as soon as freed.
    _case("mlp", "sgd", stream="side"),
    _case("conv", "sgd", stream="side", scribble=True, against_torch=False),
    # Stashed gradients of globally unused parameters (views into buckets,
    # cloned on the hooks' stream, read at the end on the side stream).
    _case("branches", "sgd", ddp=dict(find_unused_parameters=True, gradient_as_bucket_view=True), set_to_none=False,
          stream="side", scribble=True, against_torch=False),
    _case("mlp", "sgd", micro_batches=2, stream="side", scribble=True, hook="allreduce", against_torch=False),
    # Buckets filled from two streams (against local training only: whether
    # torch's DDP orders them is not what this tests).
    _case("mlp", "sgd", split_accumulators=True, against_torch=False),
    _case("conv", "adam", ddp=dict(gradient_as_bucket_view=True), split_accumulators=True, scribble=True,
          against_torch=False),
]


# --- Training ------------------------------------------------------------------


def _to(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    t = t.to(device)
    return t.to(dtype) if t.is_floating_point() and t.dtype == torch.float32 else t


def _batches(cc: CudaCase, step: int, rank: int, world_size: int, local: bool) -> List[tuple]:
    """(forward args, target, loss divisor, last of the step) for one step:
    this rank's micro-batches, or for local training the global batch (or
    every rank's slice when forward takes per-rank arguments)."""
    c = cc.base
    spec = models.MODELS[c.model]
    if not local:
        n = c.micro_batches_of(rank)
        return [(*models.rank_batch(c.model, step, m, rank, world_size, c.per_rank), 1, m == n - 1) for m in range(n)]
    if spec.extra_args(0, step, 0) == ():
        return [(*models.global_batch(c.model, step, m, c.per_rank * world_size), 1, True)
                for m in range(c.micro_batches)]
    return [(*models.rank_batch(c.model, step, m, r, world_size, c.per_rank), world_size, True)
            for r in range(world_size) for m in range(c.micro_batches_of(r))]


def _scribble(module: torch.nn.Module, device: torch.device) -> None:
    if device.type != "cuda":
        return
    for stream in (torch.cuda.default_stream(device), torch.cuda.current_stream(device)):
        with torch.cuda.stream(stream):
            junk = [torch.full_like(p, float("nan")) for p in module.parameters() for _ in range(2)]
            del junk


def _cpu(trace: Dict[str, Any]) -> Dict[str, Any]:
    for key in ("params", "buffers"):
        trace[key] = {n: t.cpu() for n, t in trace[key].items()}
    return trace


def _accumulators_on_side_stream(module: torch.nn.Module, device: torch.device) -> list:
    """Views of the first half of the parameters made on a side stream: their
    gradient accumulators are created there (and kept by the wrapper)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    params = list(module.parameters())
    with torch.cuda.stream(side):
        return [p.view_as(p) for p in params[: len(params) // 2]]


def _wrap(kind: str, module, cc: CudaCase, device: torch.device, group):
    import ddp_ext
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    views = _accumulators_on_side_stream(module, device) if cc.split_accumulators and device.type == "cuda" else []
    kwargs = dict(cc.base.ddp)
    if group is not None:
        kwargs["process_group"] = group
    if cc.cpu_inputs:
        kwargs.update(device_ids=[device.index], output_device=device.index)
    wrapper = ddp_ext.DistributedDataParallel if kind == "ext" else torch.nn.parallel.DistributedDataParallel
    ddp = wrapper(module, **kwargs)
    del views  # the wrapper holds the accumulators now
    if cc.hook == "builtin_fp16_compress":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    elif cc.hook:
        ddp.register_comm_hook(group, getattr(default_hooks, f"{cc.hook}_hook"))
    return ddp


def _train(kind: str, cc: CudaCase, rank: int, world_size: int, device: torch.device, group=None) -> Dict[str, Any]:
    """Trains case `cc` as `kind` ("ext", "torch" or "local") on `device`; the trace on the CPU."""
    c = cc.base
    spec = models.MODELS[c.model]
    dtype = DTYPES[cc.dtype]
    local = kind == "local"
    module = models.build(c.model).to(device)
    if dtype != torch.float32:
        module = module.to(dtype)
    model = module if local else _wrap(kind, module, cc, device, group)
    optimizer = reference.OPTIMIZERS[c.optimizer](module.parameters())
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**8) if cc.amp else None
    side = None
    if cc.stream and device.type == "cuda":
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
    grad_none = []
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for step in range(c.steps):
            for args, target, divisor, last in _batches(cc, step, rank, world_size, local):
                moved = not cc.cpu_inputs or local
                args = tuple(_to(a, device, dtype) if moved and torch.is_tensor(a) else a for a in args)
                target = _to(target, device, dtype)
                sync = contextlib.nullcontext() if local or last else model.no_sync()
                with sync:
                    with torch.autocast(device.type, dtype=torch.float16) if cc.amp else contextlib.nullcontext():
                        loss = spec.loss(model(*args), target) / divisor
                    (scaler.scale(loss) if scaler else loss).backward()
                if cc.scribble and not local:
                    _scribble(module, device)
            grad_none.append(reference.none_grads(module))
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=c.set_to_none)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return _cpu(reference.trace_of(module, grad_none))


def _train_case(rank: int, world_size: int, cc: CudaCase) -> Dict[str, Any]:
    import ddp_ext

    device = _rank_device(rank)
    result = {}
    for kind in ("ext", "torch"):
        if kind == "torch" and not cc.against_torch:
            continue
        group = None
        if cc.round_robin:
            group = ddp_ext.new_round_robin_group(num_groups=cc.round_robin, backend=dist.get_backend())
        result[kind] = _train(kind, cc, rank, world_size, device, group)
    if rank == 0 and cc.against_local:
        result["local"] = _train("local", cc, rank, world_size, device)
    return result


TABLES = {backend: CaseTable(_train_case, CASES, timeout=600, isolated=True, backend=backend)
          for backend in ("nccl", "gloo")}


@pytest.mark.parametrize("backend,world_size", WORLDS, ids=[f"{b}-ws{n}" for b, n in WORLDS])
@pytest.mark.parametrize("cc", CASES, ids=lambda cc: cc.id)
def test_matches_local_training_and_torch_ddp(cc, backend, world_size):
    _skip_unless_runnable(backend, world_size)
    if ON_CPU and cc.cpu_inputs:
        pytest.skip("DDP_EXT_CUDA_TESTS_ON_CPU=1: device_ids needs a GPU")
    results = TABLES[backend].results(world_size, cc)
    what = f"{cc.id}, {backend} world size {world_size}"
    assert_same_on_every_rank([r["ext"] for r in results], what)
    tol = TOLERANCES[cc.precision]
    for p in results[0]["ext"]["params"].values():
        assert torch.isfinite(p).all(), f"{what}: ddp_ext's parameters hold NaN or inf"
    if cc.against_torch:
        rtol, atol = tol["torch"]
        for rank, r in enumerate(results):
            where = f"{what}, rank {rank}, ddp_ext vs torch DDP"
            assert_states_close(r["ext"]["params"], r["torch"]["params"], where + " parameters", rtol=rtol, atol=atol)
            assert_states_close(r["ext"]["buffers"], r["torch"]["buffers"], where + " buffers", rtol=rtol, atol=atol)
            assert r["ext"]["grad_none"] == r["torch"]["grad_none"], where
    if cc.against_local:
        rtol, atol = tol["local"]
        local = results[0]["local"]
        where = f"{what}, ddp_ext vs local training"
        assert_states_close(results[0]["ext"]["params"], local["params"], where, rtol=rtol, atol=atol)


# --- A non-default current stream (torch's DistributedDataParallel_non_default_stream) ---

STREAM_ITERATIONS = 300


def _non_default_stream(rank: int, world_size: int, built_inside: bool) -> Dict[str, Any]:
    """Rank r feeds r + 1 to a 1x1 linear layer on a side stream; every
    .grad must then be the mean, (world_size + 1) / 2, on that stream, in
    every iteration: allreducing it there right after backward shows a write
    back the stream did not wait for."""
    import ddp_ext

    device = _rank_device(rank)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    expected = (world_size + 1) / 2
    wrong = []

    def build():
        torch.manual_seed(0)
        return ddp_ext.DistributedDataParallel(torch.nn.Linear(1, 1, bias=False).to(device))

    net = None if built_inside else build()
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        if built_inside:
            net = build()
        for i in range(STREAM_ITERATIONS):
            grad = net.module.weight.grad
            if grad is not None:
                grad.requires_grad_(False)
                grad.zero_()
            batch = torch.tensor([float(rank + 1)], device=device)
            net(batch).sum().backward()
            average = net.module.weight.grad.clone()
            dist.all_reduce(average)
            average.div_(world_size)
            seen = (net.module.weight.grad[0, 0].item(), average[0, 0].item())
            if not all(math.isclose(v, expected, rel_tol=1e-6) for v in seen):
                wrong.append((i, seen))
    return {"wrong": wrong[:5], "wrong_count": len(wrong)}


@pytest.mark.parametrize("built_inside", [True, False], ids=["built_on_side_stream", "built_on_default_stream"])
@pytest.mark.parametrize("backend,world_size", WORLDS, ids=[f"{b}-ws{n}" for b, n in WORLDS])
def test_non_default_stream(backend, world_size, built_inside):
    _skip_unless_runnable(backend, world_size)
    results = run_ranks(_non_default_stream, world_size, built_inside, timeout=300, backend=backend)
    for rank, r in enumerate(results):
        assert r["wrong_count"] == 0, (
            f"rank {rank} of {world_size} ({backend}): {r['wrong_count']} of {STREAM_ITERATIONS} iterations saw "
            f"(.grad, allreduced .grad) other than {(world_size + 1) / 2}; first: {r['wrong']}"
        )


# --- Parameters on the CPU and on the GPU ------------------------------------------


class _Straddling(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.on_cpu = torch.nn.Linear(2, 2)
        self.on_gpu = torch.nn.Linear(2, 2).to(device)


def _mixed_devices(rank: int, world_size: int) -> Dict[str, str]:
    import ddp_ext

    device = _rank_device(rank)
    messages = {}
    wrappers = {"ext": ddp_ext.DistributedDataParallel, "torch": torch.nn.parallel.DistributedDataParallel}
    for name, wrapper in wrappers.items():
        try:
            wrapper(_Straddling(device))
            messages[name] = ""
        except Exception as error:  # what each raises is the result
            messages[name] = f"{type(error).__name__}: {error}"
    return messages


def test_module_on_cpu_and_gpu_is_refused_like_torch_ddp():
    if ON_CPU:
        pytest.skip("DDP_EXT_CUDA_TESTS_ON_CPU=1: needs a GPU for the second device type")
    [messages] = run_ranks(_mixed_devices, 1)
    assert messages["torch"], "torch's DDP accepted a module on the CPU and the GPU; update this test"
    assert messages["ext"].startswith("ValueError") and "same type of devices" in messages["ext"], messages


# --- No host wait in the backward pass ---------------------------------------------

# Wrapper settings under which a one-rank NCCL backward copies into buckets
# and communicates (a plain world of one leaves gradients alone: Note [A
# world of one rank]), and reads nothing back to the host.
NO_WAIT_SETTINGS = {
    "default": dict(),
    "gradient_as_bucket_view": dict(gradient_as_bucket_view=True),
    "static_graph": dict(gradient_as_bucket_view=True, static_graph=True),
    "builtin_fp16_compress": dict(hook=True),
}


def _backward_without_host_wait(rank: int, world_size: int, setting: str, on_side_stream: bool) -> List[str]:
    """Trains a few steps; from the third on, each backward runs under
    torch.cuda.set_sync_debug_mode("error"), which raises wherever the host
    would wait for the GPU (a blocking copy, .item(), a synchronize).
    Returns the errors raised."""
    import ddp_ext

    device = _rank_device(rank)
    kwargs = dict(NO_WAIT_SETTINGS[setting])
    hook = kwargs.pop("hook", False)
    module = models.build("conv").to(device)
    ddp = ddp_ext.DistributedDataParallel(module, **kwargs)
    if hook:
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    errors = []
    with torch.cuda.stream(side) if on_side_stream else contextlib.nullcontext():
        for step in range(5):
            (x,), y = models.global_batch("conv", step, 0, 8)
            loss = models.MODELS["conv"].loss(ddp(x.to(device)), y.to(device))
            torch.cuda.set_sync_debug_mode("error" if step >= 2 else "default")
            try:
                loss.backward()
            except RuntimeError as error:
                errors.append(f"step {step}: {error}")
            finally:
                torch.cuda.set_sync_debug_mode("default")
            optimizer.step()
            optimizer.zero_grad()
    return errors


@pytest.mark.parametrize("on_side_stream", [False, True], ids=["default_stream", "side_stream"])
@pytest.mark.parametrize("setting", list(NO_WAIT_SETTINGS))
def test_backward_makes_the_host_wait_for_the_gpu_nowhere(setting, on_side_stream):
    """Note [CUDA streams]: hooks, launches and the end of the backward only
    queue work and stream waits (a single NCCL rank: more ranks add the step
    check's read at the end, point 6)."""
    if ON_CPU:
        pytest.skip("DDP_EXT_CUDA_TESTS_ON_CPU=1: needs a GPU")
    _skip_unless_runnable("nccl", 1)
    [errors] = run_ranks(_backward_without_host_wait, 1, setting, on_side_stream, timeout=300, backend="nccl")
    assert not errors, "\n".join(errors)
