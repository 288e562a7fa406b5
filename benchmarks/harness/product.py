"""The one place the benchmarks reach past ddp_ext's public API.

Everything else in benchmarks/ uses only what `import ddp_ext` exports. What
this module takes, from where, and why:

- `int8_encode`, `int8_decode_sum`: the product's 8-bit codec
  (comm_hooks/compression/int8_codec.cpp), compiled with a binding of the
  benchmarks' own (benchmarks/native/codec_bindings.cpp) on first use, with
  ddp_ext's build facts and build lock: the `compression` experiment times
  the adaptive-precision hook's codec step by step, which the public hook
  only runs as a whole, and the shipped `ddp_ext._C` binds only what the
  product uses.
- `TuningStage` from `ddp_ext._bucket_tuner`: the `bucket` experiment runs the
  `bucket_cap_mb="auto"` replica until its tuner has settled before timing it.
- `settled_caps_mb(model)`, from the wrapper's `_auto_buckets`: the caps the
  tuner settled on, recorded with the `bucket` results.
- `with_separate_step_check(model)`: a DistributedDataParallel whose reducer
  (`ddp_ext._C.Reducer`) is built as for a module whose buffers are
  broadcast, so its step check runs as a collective of its own: the
  `fixedcost` experiment times it beside the default, where the check rides
  on bucket 0's allreduce. Nothing else differs.

When the product moves these, this file is the only one to change.
"""

import functools
import os
import sys

import torch

from ddp_ext import _build_info
from ddp_ext._bucket_tuner import TuningStage
from ddp_ext._build_lock import build_lock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CODEC_SOURCES = ["benchmarks/native/codec_bindings.cpp", "comm_hooks/compression/int8_codec.cpp"]
BUILD_WAIT_S = 1800  # a build by another process, under load on 2 cores

__all__ = ["TuningStage", "int8_decode_sum", "int8_encode", "settled_caps_mb", "with_separate_step_check"]


@functools.lru_cache(maxsize=None)
def _codec():
    """The codec module, built once per Python and torch in the checkout's
    build/bench_native/ (ranks that ask at once compile it once)."""
    from torch.utils.cpp_extension import load

    torch_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    build_dir = os.path.join(ROOT, "build", "bench_native", f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch_minor}")
    os.makedirs(build_dir, exist_ok=True)
    with build_lock(build_dir, timeout_s=BUILD_WAIT_S):
        return load(name="ddp_ext_bench_codec", sources=[os.path.join(ROOT, s) for s in CODEC_SOURCES],
                    extra_include_paths=[ROOT], extra_cflags=list(_build_info.CXX_FLAGS), build_directory=build_dir)


def int8_encode(values, chunk: int):
    """Encodes `values` (1-D float32) in place of what the codes miss; returns the payload."""
    return _codec().int8_encode(values, chunk)


def int8_decode_sum(payloads, out, chunk: int) -> None:
    """Writes the sum of the decoded `payloads` into `out`."""
    _codec().int8_decode_sum(payloads, out, chunk)


def settled_caps_mb(model) -> list:
    """The bucket caps (MiB) a `bucket_cap_mb="auto"` DistributedDataParallel uses now."""
    return list(model._auto_buckets.caps_mb())


def with_separate_step_check(model):
    """ddp_ext's DistributedDataParallel over `model`, its step check on a
    collective of its own (see the module docstring)."""
    from ddp_ext import DistributedDataParallel, _C

    native = _C.Reducer

    def separate_check(params, names, group, options, sparse):
        options.buffers_broadcast = True
        return native(params, names, group, options, sparse)

    _C.Reducer = separate_check
    try:
        return DistributedDataParallel(model)
    finally:
        _C.Reducer = native
