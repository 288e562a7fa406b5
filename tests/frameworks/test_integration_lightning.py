"""PyTorch Lightning's Trainer trains with ddp_ext's DDP (DDPExtStrategy) to the
same parameters as with its own DDPStrategy (torch's DDP), on 2 CPU ranks:
automatic optimization (plain; with gradient accumulation, which runs under
no_sync; with a layer that forward never uses; with static_graph) and manual
optimization (where Lightning arms the reducer itself before manual_backward,
and flushes static_graph's first iteration itself after it)."""

import importlib.util
import logging
import warnings
from dataclasses import dataclass, field

import pytest
import torch

from tests.support import frameworks
from tests.support.harness import CaseTable

# Checked without importing it: only the ranks import lightning.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs the test extra")

STEPS = 4


@dataclass(frozen=True)
class Case:
    id: str
    manual: bool = False
    accumulate: int = 1
    ddp: dict = field(default_factory=dict)


CASES = [
    Case("automatic"),
    Case("automatic_accumulate", accumulate=2),
    Case("automatic_find_unused", ddp=dict(find_unused_parameters=True)),
    Case("automatic_static_graph", ddp=dict(static_graph=True)),
    Case("manual", manual=True),
    Case("manual_static_graph", manual=True, ddp=dict(static_graph=True)),
]


# Defined on first use: importing lightning.pytorch takes seconds.
def _module_class():
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        def __init__(self, manual: bool, unused_layer: bool):
            super().__init__()
            self.net = frameworks.net()
            # Never called: its parameters get no gradient.
            self.unused = torch.nn.Linear(2, 2) if unused_layer else None
            self.automatic_optimization = not manual
            self.wrapper = None

        def on_train_start(self):
            self.wrapper = type(self.trainer.strategy.model)

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            if not self.automatic_optimization:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    return Regression


def _fit(rank, world_size, c, ext):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from ddp_ext.integrations.lightning import DDPExtStrategy

    frameworks.set_torchrun_env(rank, world_size)
    strategy = (DDPExtStrategy if ext else DDPStrategy)(**c.ddp)
    model = _module_class()(c.manual, unused_layer=c.ddp.get("find_unused_parameters", False))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=STEPS,
        accumulate_grad_batches=c.accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(frameworks.dataset(), batch_size=frameworks.BATCH)
    trainer.fit(model, loader)
    return frameworks.params(model.net), model.wrapper


def _train(rank, world_size, c):
    import ddp_ext

    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    ext, ext_wrapper = _fit(rank, world_size, c, ext=True)
    reference, torch_wrapper = _fit(rank, world_size, c, ext=False)
    assert ext_wrapper is ddp_ext.DistributedDataParallel, ext_wrapper
    assert torch_wrapper is torch.nn.parallel.DistributedDataParallel, torch_wrapper
    return {"ext": ext, "torch": reference}


TABLE = CaseTable(_train, CASES)


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_lightning_trainer_matches_torch_ddp(c):
    frameworks.assert_parity(TABLE.results(2, c), f"Lightning {c.id}")
