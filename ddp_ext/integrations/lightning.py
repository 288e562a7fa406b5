"""PyTorch Lightning's DDP strategy, wrapping the model in ddp_ext's DDP:

    from ddp_ext.integrations.lightning import DDPExtStrategy
    trainer = Trainer(accelerator="cpu", devices=2, strategy=DDPExtStrategy())

Takes every argument of ``lightning.pytorch.strategies.DDPStrategy``; the
extra keyword arguments (``find_unused_parameters=True``, ``static_graph=True``,
...) go to ``ddp_ext.DistributedDataParallel`` as they would go to torch's.
"""

import contextlib

import torch
from lightning.pytorch.strategies import DDPStrategy

from ddp_ext.distributed import DistributedDataParallel


class DDPExtStrategy(DDPStrategy):
    """``DDPStrategy`` whose model wrapper is ``ddp_ext.DistributedDataParallel``."""

    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        device_ids = self.determine_ddp_device_ids()
        # As Lightning does for torch's DDP: build on a side stream on GPUs.
        stream = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else contextlib.nullcontext()
        with stream:
            return DistributedDataParallel(module=model, device_ids=device_ids, **self._ddp_kwargs)
