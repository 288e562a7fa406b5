"""The one place the benchmarks reach past ddp_ext's public API.

Everything else in benchmarks/ uses only what `import ddp_ext` exports. What
this module takes, from where, and why:

- `int8_encode`, `int8_decode_sum` from `ddp_ext._C` (the compiled extension):
  the `compression` experiment times the adaptive-precision hook's 8-bit
  codec step by step, which the public hook only runs as a whole.
- `TunerPhase` from `ddp_ext._bucket_tuner`: the `bucket` experiment runs the
  `bucket_cap_mb="auto"` replica until its tuner has settled before timing it.
- `settled_caps_mb(model)`, from the wrapper's `_auto_buckets`: the caps the
  tuner settled on, recorded with the `bucket` results.

When the product moves these, this file is the only one to change.
"""

from ddp_ext import _C
from ddp_ext._bucket_tuner import TunerPhase

int8_encode = _C.int8_encode
int8_decode_sum = _C.int8_decode_sum

__all__ = ["TunerPhase", "int8_decode_sum", "int8_encode", "settled_caps_mb"]


def settled_caps_mb(model) -> list:
    """The bucket caps (MiB) a `bucket_cap_mb="auto"` DistributedDataParallel uses now."""
    return list(model._auto_buckets.caps_mb())
