"""Lightning Fabric's DDP strategy, wrapping modules in ddp_ext's DDP:

    from ddp_ext.integrations.fabric import DDPExtStrategy
    fabric = Fabric(accelerator="cpu", devices=2, strategy=DDPExtStrategy())

Takes every argument of ``lightning.fabric.strategies.DDPStrategy``; the extra
keyword arguments go to ``ddp_ext.DistributedDataParallel``.
"""

import contextlib

import torch
from lightning.fabric.strategies import DDPStrategy

from ddp_ext.distributed import DistributedDataParallel


class DDPExtStrategy(DDPStrategy):
    """Fabric's ``DDPStrategy`` whose module wrapper is ``ddp_ext.DistributedDataParallel``."""

    def setup_module(self, module: torch.nn.Module) -> DistributedDataParallel:
        device_ids = self._determine_ddp_device_ids()
        # As Fabric does for torch's DDP: build on a side stream on GPUs.
        stream = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else contextlib.nullcontext()
        with stream:
            return DistributedDataParallel(module=module, device_ids=device_ids, **self._ddp_kwargs)
