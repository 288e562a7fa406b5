"""torch's DistributedDataParallel internals that ddp_ext does not implement.

ddp_ext.DistributedDataParallel subclasses torch's class (so isinstance checks
pass) without running torch's __init__: torch's reducer, logger and hooks do
not exist. Every method torch's class defines is therefore either overridden
with ddp_ext's own implementation (ddp_ext/distributed.py) or listed here,
where calling it raises NotImplementedError naming it and what to use
instead, rather than running torch's body against state that is not there.
tests/wrapper/test_torch_contract.py fails when a torch upgrade adds a method that
is in neither place.
"""

from typing import Callable, Dict

# name -> what to use instead
UNSUPPORTED: Dict[str, str] = {
    "_ddp_init_helper": "ddp_ext builds its C++ Reducer in __init__; construct a new wrapper instead",
    "_register_accum_grad_hook": "the python_reducer mode of torch.compile is not supported; "
    "leave torch._dynamo.config.optimize_ddp at its default",
    "_fire_reducer_autograd_hook": "ddp_ext's mixed precision casts parameters inside the forward "
    "(ddp_ext/_mixed_precision.py), so the reducer's own hooks fire",
    "_root_copy_hook": "ddp_ext's mixed precision casts parameters inside the forward (ddp_ext/_mixed_precision.py)",
    "_module_wait_for_copy_hook": "ddp_ext's mixed precision casts parameters inside the forward "
    "(ddp_ext/_mixed_precision.py)",
    "_register_buffer_comm_hook": "buffers are broadcast from rank 0 before each synchronising forward "
    "(forward_sync_buffers=True); custom buffer hooks are not supported",
    "_set_sparse_metadata": "ddp_ext reduces dense gradients only",
}


def _refusal(name: str, instead: str) -> Callable:
    def refuse(self, *args, **kwargs):
        raise NotImplementedError(
            f"ddp_ext.DistributedDataParallel.{name} is not implemented: {instead}."
        )

    refuse.__name__ = name
    refuse.__qualname__ = f"DistributedDataParallel.{name}"
    return refuse


class UnsupportedTorchInternals:
    """Mixin placed before torch's class in the MRO."""


for _name, _instead in UNSUPPORTED.items():
    setattr(UnsupportedTorchInternals, _name, _refusal(_name, _instead))
