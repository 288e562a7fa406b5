"""DDP-native mixed precision (torch's `_MixedPrecision` config).

Parameters stay in full precision: they are what the optimizer steps and
what state_dict saves. Each forward runs the module with copies cast to
`param_dtype` (torch.func.functional_call), so forward and backward compute
in that dtype; autograd casts each gradient back to the parameter's dtype
on its way to .grad (exactly: the cast widens), so gradients accumulate in
full precision, also across no_sync micro-batches. The reducer's buckets are
in `reduce_dtype` (or `param_dtype`), so the reduction runs, and goes over
the wire, in that dtype. Buffers are cast to `buffer_dtype` once, at
construction, as torch does; floating-point inputs to `param_dtype`.
"""

from typing import Any, Dict, Optional, Set, Tuple

import torch
from torch import nn

from ddp_ext._output_sink import _map_tensors


def reduce_dtype_of(config) -> Optional[torch.dtype]:
    return config.reduce_dtype or config.param_dtype


def cast_buffers(config, module: nn.Module, ignored: Set[str]) -> None:
    if config.buffer_dtype is None:
        return
    for name, buffer in module.named_buffers():
        if name not in ignored and buffer.is_floating_point():
            buffer.data = buffer.to(dtype=config.buffer_dtype)


def run_forward(config, module: nn.Module, ignored: Set[str], inputs: Tuple, kwargs: Dict[str, Any]):
    """module(*inputs, **kwargs) computed in config.param_dtype."""
    dtype = config.param_dtype
    if dtype is None:
        return module(*inputs, **kwargs)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    low = {name: cast(p) for name, p in module.named_parameters() if name not in ignored}
    inputs, kwargs = _map_tensors((inputs, kwargs), cast)
    return torch.func.functional_call(module, low, inputs, kwargs, tie_weights=True, strict=False)
