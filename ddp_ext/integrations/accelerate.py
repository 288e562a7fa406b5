"""HF Accelerate with ddp_ext's DDP:

    from ddp_ext.integrations.accelerate import Accelerator   # was: from accelerate import Accelerator

``Accelerator.prepare`` then wraps models in ``ddp_ext.DistributedDataParallel``
wherever Accelerate would wrap them in torch's, with the same arguments
(``DistributedDataParallelKwargs``, its ``comm_hook`` included). Launch as
usual; for CPU ranks, ``Accelerator(cpu=True)`` and
``accelerate launch --multi_gpu --num_processes 2 train.py`` (without MPI,
``--cpu`` starts a single process).

Code that builds its Accelerator itself (transformers' Trainer, for one) can
run inside ``with ddp_ext_as_torch_ddp(): ...`` instead.
"""

import contextlib
from typing import Iterator

import accelerate
import torch

from ddp_ext.distributed import DistributedDataParallel


@contextlib.contextmanager
def ddp_ext_as_torch_ddp() -> Iterator[None]:
    """Inside, ``torch.nn.parallel.DistributedDataParallel`` names ddp_ext's DDP.

    Only that attribute changes (Accelerate looks it up each time it wraps a
    model); torch's own module ``torch.nn.parallel.distributed`` keeps its class.
    ddp_ext's DDP subclasses torch's, so isinstance checks against torch's
    class still pass after the block. Not thread-safe: the name is global.
    """
    previous = torch.nn.parallel.DistributedDataParallel
    torch.nn.parallel.DistributedDataParallel = DistributedDataParallel
    try:
        yield
    finally:
        torch.nn.parallel.DistributedDataParallel = previous


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` that wraps models in ddp_ext's DDP."""

    def prepare_model(self, *args, **kwargs):
        with ddp_ext_as_torch_ddp():
            return super().prepare_model(*args, **kwargs)
