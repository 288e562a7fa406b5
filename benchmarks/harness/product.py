"""The one place the benchmarks reach past ddp_ext's public API.

Everything else in benchmarks/ uses only what `import ddp_ext` exports. What
this module takes, from where, and why:

- `int8_encode`, `int8_decode_sum`: the product's 8-bit codec
  (comm_hooks/compression/int8_codec.cpp), as the native core binds it for
  DiLoCo: the `compression` experiment times the adaptive-precision hook's
  codec step by step, which the public hook only runs as a whole.
- `TuningStage` from `ddp_ext._bucket_tuner`: the `bucket` experiment runs the
  `bucket_cap_mb="auto"` replica until its tuner has settled before timing it.
- `settled_caps_mb(model)`, from the wrapper's `_auto_buckets`: the caps the
  tuner settled on, recorded with the `bucket` results.
- `with_separate_step_check(model)`: a DistributedDataParallel whose reducer
  (`ddp_ext._C.Reducer`) is built as for a module whose buffers are
  broadcast, so its step check runs as a collective of its own: the
  `fixedcost` experiment times it beside the default, where the check rides
  on bucket 0's allreduce. Nothing else differs.
- `wrap_sharded_all_gathers(wrap)`: the sharded optimizer's all-gather
  launcher (`ddp_ext._sharded_optimizer`) replaced by `wrap(launcher)`, for
  `benchmarks/sharding_profile.py` to time each all-gather from its launch
  to its completion. The product records no such events of its own.

When the product moves these, this file is the only one to change.
"""

import torch

from ddp_ext._bucket_tuner import TuningStage
from ddp_ext._native import core

__all__ = ["TuningStage", "int8_decode_sum", "int8_encode", "settled_caps_mb", "with_separate_step_check",
           "wrap_sharded_all_gathers"]


def int8_encode(values, chunk: int):
    """Encodes `values` (1-D float32) in place of what the codes miss; returns the payload."""
    payload = torch.empty(core.int8_payload_bytes(values.numel(), chunk), dtype=torch.uint8, device=values.device)
    core.encode_int8(values, payload, chunk)
    return payload


def int8_decode_sum(payloads, out, chunk: int) -> None:
    """Writes the sum of the decoded `payloads` into `out`."""
    core.decode_sum_int8(payloads, out, chunk)


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


def wrap_sharded_all_gathers(wrap) -> None:
    """Every all-gather the sharded optimizer launches from now on goes through
    `wrap(launcher)`, which takes the launcher's arguments."""
    import ddp_ext._sharded_optimizer as sharded

    sharded._all_gather = wrap(sharded._all_gather)
