"""The rows of tests/wrapper/test_bad_arguments.py: for each bad constructor input,
the module and keyword arguments every rank builds, and what ddp_ext's and
torch's DistributedDataParallel are expected to do with them.

Module factories take (rank, world_size) and are seeded, so that every rank
builds the same module unless the row is about ranks that differ; keyword
factories take (rank, world_size, module) and run on the rank, after
init_process_group.
"""

import dataclasses
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

IN_FEATURES = 4

# Outcomes
RAISES = "raises"  # an exception on every rank
TRAINS = "trains"  # trains, and equals local training
ALONE = "alone"  # rank 0 trains in a group of its own (like local training); the other ranks raise


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    ours: str  # RAISES or TRAINS (or ALONE)
    error: Optional[str] = None  # ddp_ext's exception type
    says: Tuple[str, ...] = ()  # phrases of ddp_ext's message: the argument, what to do
    torch: Optional[str] = None  # torch's DDP: RAISES or TRAINS (or ALONE); None: not run in this table
    phrase: str = ""  # torch's key phrase, which ddp_ext's message keeps


def mlp(rank=0, world_size=1):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN_FEATURES, 8), nn.Tanh(), nn.Linear(8, 2))


class ComplexLinear(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(IN_FEATURES, 2, dtype=torch.complex64))
        self.bias = nn.Parameter(torch.randn(2))

    def forward(self, x):
        return (x.to(torch.complex64) @ self.weight).abs() + self.bias


class ScaledByFrozenInteger(nn.Module):
    """Output scaled by 1 + a frozen int64 parameter, which starts at the rank:
    training matches local training only if rank 0's value was broadcast."""

    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(IN_FEATURES, 2)
        self.scale = nn.Parameter(torch.full((1,), rank, dtype=torch.int64), requires_grad=False)

    def forward(self, x):
        return self.fc(x) * (1 + self.scale)


class WithBuffers(nn.Module):
    """fc, then as the variant asks: a frozen parameter, buffers. Values
    depend on the rank, so that a broadcast that misplaces them shows."""

    def __init__(self, rank, frozen=3, buffer=3, buffer_dtype=torch.float32, extra_buffer=False,
                 hidden=4, fc2_dtype=torch.float32, extra_layer=False):
        super().__init__()
        torch.manual_seed(rank)
        self.fc = nn.Linear(IN_FEATURES, hidden)
        self.fc2 = nn.Linear(hidden, 2).to(fc2_dtype)
        if extra_layer:
            self.fc3 = nn.Linear(2, 2)
        self.frozen = nn.Parameter(torch.full((frozen,), 100.0 + rank), requires_grad=False)
        self.register_buffer("running", torch.full((buffer,), 200.0 + rank, dtype=buffer_dtype))
        if extra_buffer:
            self.register_buffer("extra", torch.full((2,), 300.0 + rank))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc(x)).to(self.fc2.weight.dtype)).float()


def _last(rank, world_size):
    return rank == world_size - 1


# Models that differ across ranks, by the last rank. id -> module factory.
DIFFERING = {
    "parameter_count_differs": lambda r, w: WithBuffers(r, extra_layer=_last(r, w)),
    "parameter_shape_differs": lambda r, w: WithBuffers(r, hidden=5 if _last(r, w) else 4),
    "parameter_dtype_differs": lambda r, w: WithBuffers(r, fc2_dtype=torch.float64 if _last(r, w) else torch.float32),
    "frozen_parameter_shape_differs": lambda r, w: WithBuffers(r, frozen=4 if _last(r, w) else 3),
    "buffer_shape_differs": lambda r, w: WithBuffers(r, buffer=4 if _last(r, w) else 3),
    "buffer_count_differs": lambda r, w: WithBuffers(r, extra_buffer=_last(r, w)),
    "rank0_has_more_buffers": lambda r, w: WithBuffers(r, extra_buffer=r == 0),
    "buffer_dtype_differs": lambda r, w: WithBuffers(r, buffer_dtype=torch.float64 if _last(r, w) else torch.float32),
}


def _cpu_and_meta(rank, world_size):
    return nn.Sequential(nn.Linear(IN_FEATURES, 4), nn.Linear(4, 2, device="meta"))


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape)


def _group_of_rank0(rank, world_size, module):
    group = dist.new_group([0])  # every rank takes part; the others get GroupMember.NON_GROUP_MEMBER
    return dict(process_group=group)


FLAGS = ("broadcast_buffers", "find_unused_parameters", "gradient_as_bucket_view", "static_graph",
         "skip_all_reduce_unused_params", "batched_grad_copy", "forward_sync_buffers")
DEVICE_IDS = "DistributedDataParallel device_ids and output_device arguments only work with"
SAME_MODEL = "DDP expects same model across all ranks"

# id -> (module factory, keyword factory)
BUILD = {
    "device_ids_not_a_list": (mlp, lambda r, w, m: dict(device_ids=0)),
    "device_ids_cpu_device": (mlp, lambda r, w, m: dict(device_ids=[torch.device("cpu")])),
    "output_device_cpu": (mlp, lambda r, w, m: dict(output_device="cpu")),
    "output_device_zero": (mlp, lambda r, w, m: dict(output_device=0)),
    "dim_string": (mlp, lambda r, w, m: dict(dim="x")),
    **{f"{flag}_string": (mlp, lambda r, w, m, flag=flag: {flag: "False"}) for flag in FLAGS},
    "flags_as_numbers": (mlp, lambda r, w, m: dict(find_unused_parameters=0, gradient_as_bucket_view=1)),
    "process_group_of_rank0_only": (mlp, _group_of_rank0),
    "process_group_and_device_mesh": (
        mlp, lambda r, w, m: dict(process_group=dist.group.WORLD, device_mesh=_mesh((w,)))),
    "device_mesh_2d": (mlp, lambda r, w, m: dict(device_mesh=_mesh((1, w)))),
    "device_mesh_not_a_mesh": (mlp, lambda r, w, m: dict(device_mesh="cpu")),
    "bucket_cap_mb_huge": (mlp, lambda r, w, m: dict(bucket_cap_mb=1e12)),
    "bucket_cap_mb_negative": (mlp, lambda r, w, m: dict(bucket_cap_mb=-1)),
    "bucket_cap_mb_list_not_a_list": (mlp, lambda r, w, m: dict(bucket_cap_mb_list=5)),
    "bucket_cap_mb_list_negative": (mlp, lambda r, w, m: dict(bucket_cap_mb_list=[-1])),
    "bucket_cap_mb_list_empty": (mlp, lambda r, w, m: dict(bucket_cap_mb_list=[])),
    "bucket_cap_mb_auto": (mlp, lambda r, w, m: dict(bucket_cap_mb="auto")),
    "bucket_cap_mb_Auto": (mlp, lambda r, w, m: dict(bucket_cap_mb="Auto")),
    "bucket_cap_mb_fast": (mlp, lambda r, w, m: dict(bucket_cap_mb="fast")),
    "bucket_cap_mb_auto_with_list": (mlp, lambda r, w, m: dict(bucket_cap_mb="auto", bucket_cap_mb_list=[1, 25])),
    "bucket_cap_mb_auto_rebuild_never": (mlp, lambda r, w, m: dict(bucket_cap_mb="auto", rebuild_buckets="never")),
    "mixed_precision_not_a_config": (mlp, lambda r, w, m: dict(mixed_precision="bf16")),
    "delay_all_reduce_named_params_not_pairs": (
        mlp, lambda r, w, m: dict(delay_all_reduce_named_params=[1, 2], param_to_hook_all_reduce=m[0].weight)),
    "param_to_hook_all_reduce_not_a_tensor": (
        mlp, lambda r, w, m: dict(delay_all_reduce_named_params=[("2.weight", m[2].weight)],
                                  param_to_hook_all_reduce=3)),
    "uninitialized_parameters": (lambda r, w: nn.LazyLinear(2), lambda r, w, m: {}),
    "parameters_on_meta": (lambda r, w: nn.Linear(IN_FEATURES, 2, device="meta"), lambda r, w, m: {}),
    "parameters_on_cpu_and_meta": (_cpu_and_meta, lambda r, w, m: {}),
    "complex_parameters": (lambda r, w: ComplexLinear(), lambda r, w, m: {}),
    "frozen_integer_parameter": (lambda r, w: ScaledByFrozenInteger(r), lambda r, w, m: {}),
    "buffers_differ_broadcast_buffers_false": (
        lambda r, w: WithBuffers(0, buffer=3 + r), lambda r, w, m: dict(broadcast_buffers=False)),
    **{key: (make, lambda r, w, m: {}) for key, make in DIFFERING.items()},
}

ROWS = [
    Row("device_ids_not_a_list", RAISES, "TypeError", ("device_ids",), torch=RAISES),
    Row("device_ids_cpu_device", RAISES, "ValueError", ("device_ids", "CPU"), torch=RAISES, phrase=DEVICE_IDS),
    Row("output_device_cpu", RAISES, "ValueError", ("output_device", "CPU"), torch=RAISES, phrase=DEVICE_IDS),
    # torch's DDP reads output_device=0 as unset (0 is falsy).
    Row("output_device_zero", RAISES, "ValueError", ("output_device", "CPU"), torch=TRAINS),
    # dim only matters where inputs are scattered over device_ids.
    Row("dim_string", TRAINS, torch=TRAINS),
    *[Row(f"{flag}_string", RAISES, "TypeError", (flag, "must be a bool"), torch=RAISES) for flag in FLAGS],
    Row("flags_as_numbers", TRAINS, torch=TRAINS),
    Row("process_group_of_rank0_only", ALONE, "TypeError", ("does not include this rank", "NON_GROUP_MEMBER"),
        torch=ALONE),
    Row("process_group_and_device_mesh", RAISES, "RuntimeError", torch=RAISES,
        phrase="Cannot specify both process_group and device_mesh arguments"),
    Row("device_mesh_2d", RAISES, "RuntimeError", torch=RAISES, phrase="Only 1D device mesh is supported"),
    Row("device_mesh_not_a_mesh", RAISES, "TypeError", ("device_mesh", "DeviceMesh"), torch=RAISES),
    Row("bucket_cap_mb_huge", TRAINS, torch=TRAINS),
    Row("bucket_cap_mb_negative", TRAINS, torch=TRAINS),
    Row("bucket_cap_mb_list_not_a_list", RAISES, "TypeError", ("bucket_cap_mb_list",), torch=RAISES),
    # Negative caps mean a bucket per parameter, as for bucket_cap_mb; torch fails in pybind11.
    Row("bucket_cap_mb_list_negative", TRAINS, torch=RAISES),
    Row("bucket_cap_mb_list_empty", TRAINS, torch=TRAINS),
    # ddp_ext's self-tuning buckets (torch's DDP has no "auto").
    Row("bucket_cap_mb_auto", TRAINS),
    Row("bucket_cap_mb_Auto", RAISES, "ValueError", ("bucket_cap_mb", "'Auto'", "'auto'")),
    Row("bucket_cap_mb_fast", RAISES, "ValueError", ("bucket_cap_mb", "'fast'", "'auto'")),
    Row("bucket_cap_mb_auto_with_list", RAISES, "ValueError", ("bucket_cap_mb_list", "one or the other")),
    Row("bucket_cap_mb_auto_rebuild_never", RAISES, "ValueError", ("rebuild_buckets='never'", "'continuous'")),
    Row("mixed_precision_not_a_config", RAISES, "TypeError", ("mixed_precision", "_MixedPrecision"), torch=RAISES),
    Row("delay_all_reduce_named_params_not_pairs", RAISES, "TypeError", ("delay_all_reduce_named_params", "pairs"),
        torch=RAISES),
    Row("param_to_hook_all_reduce_not_a_tensor", RAISES, "TypeError", ("param_to_hook_all_reduce",), torch=RAISES),
    Row("uninitialized_parameters", RAISES, "RuntimeError", torch=RAISES,
        phrase="Modules with uninitialized parameters can't be used with `DistributedDataParallel`"),
    Row("parameters_on_meta", RAISES, "RuntimeError", ("meta device", "to_empty"), torch=RAISES),
    Row("parameters_on_cpu_and_meta", RAISES, "ValueError", torch=RAISES, phrase="must be on the same type of devices"),
    Row("complex_parameters", TRAINS, torch=TRAINS),
    Row("frozen_integer_parameter", TRAINS, torch=TRAINS),
    Row("buffers_differ_broadcast_buffers_false", TRAINS, torch=TRAINS),
    # Models that differ across ranks. ddp_ext: every rank raises, naming the
    # tensor (parameters that require grad: tests/diagnosis/test_model_check.py).
    # torch's DDP runs each in a world of its own (test_torch_with_models_that_differ).
    Row("frozen_parameter_shape_differs", RAISES, "RuntimeError", (SAME_MODEL, "frozen")),
    Row("buffer_shape_differs", RAISES, "RuntimeError", (SAME_MODEL, "running")),
    Row("buffer_count_differs", RAISES, "RuntimeError", (SAME_MODEL, "extra")),
    Row("rank0_has_more_buffers", RAISES, "RuntimeError", (SAME_MODEL, "extra")),
    Row("buffer_dtype_differs", RAISES, "RuntimeError", (SAME_MODEL, "running", "float64")),
]
assert {r.id for r in ROWS} <= set(BUILD), sorted({r.id for r in ROWS} - set(BUILD))
