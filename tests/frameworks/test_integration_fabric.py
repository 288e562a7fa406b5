"""Lightning Fabric trains with ddp_ext's DDP (DDPExtStrategy) to the same
parameters as with its own DDPStrategy (torch's DDP), on 2 CPU ranks: plain
steps, gradient accumulation under `fabric.no_backward_sync`, and a checkpoint
saved with `fabric.save` holds the same keys and values."""

import importlib.util
import logging
import os
import tempfile
import warnings
from dataclasses import dataclass

import pytest
import torch

from tests.support import frameworks
from tests.support.harness import CaseTable, assert_states_close

# Checked without importing it: only the ranks import lightning.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs the test extra")

STEPS = 4


@dataclass(frozen=True)
class Case:
    id: str
    accumulate: int = 1  # micro-batches per optimizer step


CASES = [Case("steps"), Case("no_backward_sync", accumulate=2)]


def _fit(rank, world_size, c, ext):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    from ddp_ext.integrations.fabric import DDPExtStrategy

    frameworks.set_torchrun_env(rank, world_size)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=(DDPExtStrategy if ext else DDPStrategy)())
    fabric.launch()
    net = frameworks.net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(frameworks.dataset(), batch_size=frameworks.BATCH))
    wrapper = type(model._forward_module)
    for i, (x, y) in enumerate(loader):
        if i == STEPS * c.accumulate:
            break
        stepping = (i + 1) % c.accumulate == 0
        with fabric.no_backward_sync(model, enabled=not stepping):
            fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        if stepping:
            opt.step()
            opt.zero_grad()
    with tempfile.TemporaryDirectory() as tmp:
        path = fabric.broadcast(tmp)  # rank 0's directory: fabric.save writes on rank 0 only
        fabric.save(os.path.join(path, "ckpt"), {"model": model})
        fabric.barrier()
        saved = torch.load(os.path.join(path, "ckpt"), weights_only=True)["model"]
        fabric.barrier()
    return frameworks.params(net), saved, wrapper


def _train(rank, world_size, c):
    import ddp_ext

    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    ext, ext_saved, ext_wrapper = _fit(rank, world_size, c, ext=True)
    reference, torch_saved, torch_wrapper = _fit(rank, world_size, c, ext=False)
    assert ext_wrapper is ddp_ext.DistributedDataParallel, ext_wrapper
    assert torch_wrapper is torch.nn.parallel.DistributedDataParallel, torch_wrapper
    return {"ext": ext, "torch": reference, "saved": (ext_saved, torch_saved)}


TABLE = CaseTable(_train, CASES)


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_fabric_matches_torch_ddp(c):
    frameworks.assert_parity(TABLE.results(2, c), f"Fabric {c.id}")


# Fabric unwraps instances of torch's DDP class before saving.
def test_fabric_save_matches_torch_ddp():
    ext_saved, torch_saved = TABLE.results(2, CASES[0])[0]["saved"]
    assert_states_close(ext_saved, torch_saved, "Fabric, fabric.save checkpoint")
